"""Memory the cloud host's servers hold while idle: the MLflow tracking server as pipeline.servers starts it
(MLflow's job runner off: NO_JOBS) against MLflow's default (its job runner on: huey consumers for its GenAI
jobs), and the Prefect server. Each is started on loopback in a new directory, waited for until its health
probe answers, left --settle seconds, then measured over its whole process tree (psutil): the processes,
their resident set (RSS: shared pages counted in every process) and their unique set (USS: the memory that
would be freed if the tree stopped). The median over --repeats starts; every server is always stopped.

    python -m bench.servers                          # results in bench/results/servers.{json,md,png}
    python -m bench.servers --quick --out /tmp/bench # one start each, 2 s settle
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import psutil

from bench.common import BenchResult, bench_argparser
from edgeflux.environ import venv_env
from edgeflux.neuroflux.plots import _pyplot, _save
from pipeline.servers import NO_JOBS, MLflowServer, PrefectServer

NAME = "servers"
MIB = 2 ** 20
CONFIGS = {   # label: how the server is made in a new directory
    "MLflow, job runner on (MLflow's default)":
        lambda d: _with_env(MLflowServer(d), {key: "true" for key in NO_JOBS}),
    "MLflow, job runner off (edgeflux)": lambda d: MLflowServer(d),
    "Prefect server": lambda d: PrefectServer(d),
}


def _with_env(server, env: dict[str, str]):
    server.env = venv_env({**(server.env or {}), **env})
    return server


def tree_memory(pid: int) -> dict:
    """Processes, RSS and USS summed over ``pid`` and its descendants (those that vanish meanwhile: left out)."""
    procs, rss, uss = 0, 0, 0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            info = proc.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        procs, rss, uss = procs + 1, rss + info.rss, uss + info.uss
    return {"processes": procs, "rss_mib": rss / MIB, "uss_mib": uss / MIB}


def measure(make, settle_s: float) -> dict:
    with tempfile.TemporaryDirectory() as d, make(Path(d)) as server:
        time.sleep(settle_s)
        return tree_memory(server.process.pid)


def plot(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.2))
    labels = [r["server"] for r in rows]
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [r["rss_mib"] for r in rows], height=0.4, color="#9ecae1",
            label="RSS (shared pages counted in each process)")
    ax.barh([i - 0.2 for i in y], [r["uss_mib"] for r in rows], height=0.4, color="#08519c",
            label="USS (freed if it stopped)")
    for i, r in enumerate(rows):
        procs = round(r["processes"])
        ax.text(r["rss_mib"], i + 0.2, f" RSS {r['rss_mib']:.0f} MiB, USS {r['uss_mib']:.0f} MiB, {procs} "
                f"process{'es' if procs != 1 else ''}", va="center", fontsize=8)
    ax.set_yticks(list(y), labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("memory of the server's process tree while idle (MiB)")
    ax.set_xlim(0, max(r["rss_mib"] for r in rows) * 1.9)
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    _save(fig, path)


def main(argv=None) -> None:
    parser = bench_argparser(__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="starts per server (the median is reported)")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds idle after the health probe answers")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.settle = 1, 2.0
    result = BenchResult()
    for label, make in CONFIGS.items():
        runs = [measure(make, args.settle) for _ in range(args.repeats)]
        row = {"server": label, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}, "repeats": len(runs)}
        result.add(**row)
        print(f"{label}: {row['processes']:.0f} processes, RSS {row['rss_mib']:.0f} MiB, USS {row['uss_mib']:.0f} MiB",
              flush=True)
    plot(result.rows, args.out / f"{NAME}.png")
    result.write(NAME, args.out, title="The cloud host's servers while idle: processes and memory",
                 columns={"server": "server", "processes": "processes", "rss_mib": "RSS MiB", "uss_mib": "USS MiB",
                          "repeats": "starts (median)"},
                 notes=f"Each server on loopback in a new directory, measured {args.settle:g} s after its health "
                       "probe answered, over its whole process tree. pipeline.servers and docker/compose.yaml start "
                       "MLflow with its job runner off (MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false): edgeflux submits "
                       "no MLflow jobs.")


if __name__ == "__main__":
    main()
