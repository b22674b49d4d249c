"""The pipeline's wall times, measured: a fresh clone's `dvc repro`, the no-op repro, Prefect's overhead per
stage, a worker's pick-up latency and the cloud -> device round trip through real servers and workers.

1. repro_s: `dvc repro --force` (every stage) in a fresh clone: the files `git ls-files -co --exclude-standard`
   lists here (what would be committed, uncommitted work included) copied into a new directory, committed
   there, the venv used as it is. --force: the copy carries dvc.lock and the uncached outputs git tracks
   (metrics, plots), so a plain `dvc repro` would skip the stages whose deps hash as before (profile,
   partition); --force makes it every stage, as a first run has to. Each stage's wall time is read from
   DVC's output as it streams: from its "Running stage 'x'" line to the "Updating lock file" line DVC prints
   once the stage's outputs are saved (or, when its lock entry did not change and DVC prints no such line, to
   the next stage's start); what is left of repro_s is DVC's own work (status, hashing).
2. noop_s: `dvc repro` right after: nothing to do.
3. prefect_overhead_s: with a Prefect server up, `python -m pipeline.flows` (the in-process `pipeline` flow;
   every stage cached, so each task is a no-op `dvc repro --single-item <stage>`) against a plain loop of
   `dvc repro --single-item <stage>` over the same stages in the same order, in the same clone: (flow wall -
   loop wall) / stages, the median over --repeats.
4. pickup_s: for flow runs started from deployments, the flow run's start_time minus its expected_start_time
   as the Prefect API records them (the worker's poll, the flow-run process starting, the flow loading), the
   median over the runs of 5 and --pickup-runs more (no-op runs: everything cached).
5. roundtrip_s: CI-sized params (pipeline.sandbox.QUICK), an origin, a cloud and a pi clone, a local DVC
   remote, Prefect and MLflow servers and one worker per clone (pipeline.sandbox, as tests/test_orchestration.py
   runs them): from triggering cloud_flow/cloud until device_flow/pi (the device stages) is Completed. With
   --target, the cloud's and the device's stages among those the target needs only.

    python -m bench.pipeline                          # full run (default params), results in bench/results/
    python -m bench.pipeline --quick --out /tmp/bench # CI-sized params everywhere, workers polling every 2 s
    python -m bench.pipeline --quick --target train_bp --out /tmp/bench   # every item on two stages (the test's)

Servers, workers and the timed commands are always stopped, on an error or Ctrl-C too.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import yaml
from rich.logging import RichHandler

from bench.common import BenchResult, HelpFormatter, bench_argparser
from edgeflux.environ import offline_env, venv_env
from edgeflux.neuroflux.plots import _pyplot, _save
from edgeflux.process import start_group, stop_group
from pipeline.sandbox import DEVICE_STAGES, GIT_IDENTITY, REPO, quick_params, sandbox, sh
from pipeline.servers import PrefectServer

NAME = "pipeline"
log = logging.getLogger("bench.pipeline")
TARGETS = {"repro_s": 900.0, "noop_s": 5.0, "prefect_overhead_s": 2.0}   # pickup, roundtrip: measured only
WHAT = {"repro_s": "dvc repro --force in a fresh clone",
        "noop_s": "dvc repro again, nothing to do",
        "prefect_overhead_s": "Prefect flow vs plain dvc loop, per stage",
        "pickup_s": "worker pick-up: start_time - expected_start_time (median)",
        "roundtrip_s": "cloud_flow/cloud triggered -> device_flow/pi Completed"}
LABELS = {"repro_s": "full repro, fresh clone", "noop_s": "no-op repro", "prefect_overhead_s": "Prefect, per stage",
          "pickup_s": "worker pick-up", "roundtrip_s": "cloud -> device round trip"}   # the plot's short names
RUNNING = re.compile(r"^Running stage '([^']+)':")
RUN_TIMEOUT_S = 3600   # one deployment run, CI-sized params: minutes; this is a hang


class BenchError(RuntimeError):
    """A command the benchmark times failed: the figures would mean nothing."""


def parse_args(argv=None):
    parser = bench_argparser(__doc__)
    parser.formatter_class = HelpFormatter
    parser.add_argument("--repeats", type=int, default=3,
                        help="Prefect overhead: times the flow and the plain loop each run (median taken)")
    parser.add_argument("--pickup-runs", type=int, default=4,
                        help="no-op deployment runs after the round trip, for more pick-up samples")
    parser.add_argument("--poll-s", type=float, default=10.0,
                        help="how often each worker polls for runs (PrefectWorker poll_s; 10 is Prefect's default)")
    stages = list(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])
    parser.add_argument("--target", default=None, choices=stages, metavar="STAGE",
                        help="every item on this stage and what it needs only (dvc repro --force STAGE, "
                             "python -m pipeline.flows --target STAGE, the round trip's flows on those stages): "
                             f"a shorter check; one of {', '.join(stages)}")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the fresh clone, the sandbox and their logs here (default: a temp dir, removed)")
    args = parser.parse_args(argv)
    if args.quick:   # CI-sized: the quick params in the fresh clone too, fewer repeats, a fast poll
        args.repeats, args.pickup_runs, args.poll_s = 1, 2, 2.0
    return args


def child_env() -> dict[str, str]:
    """The stages' environment: unbuffered (DVC's lines arrive when printed), no server of this shell's
    (a stage logs to the clone's own mlflow.db, a flow finds no PREFECT_API_URL it was not given)."""
    env = venv_env({"PYTHONUNBUFFERED": "1", **GIT_IDENTITY})
    for key in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "EDGEFLUX_PIPELINE_ID"):
        env.pop(key, None)
    return env


def fresh_clone(dest: Path, quick: bool, env: dict[str, str]) -> Path:
    """What would be committed here (tracked and untracked, not ignored), copied and committed in ``dest``."""
    files = sh("git ls-files -co --exclude-standard -z", REPO, env=env).stdout.split("\0")
    copied = 0
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():   # a tracked file deleted here is not part of the next commit
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dest / name)
            copied += 1
    if quick:
        (dest / "params.yaml").write_text(yaml.safe_dump(quick_params(dest / "params.yaml"), sort_keys=False))
    sh("git init -q -b main && dvc config core.analytics false && git add -A && git commit -qm 'fresh clone'",
       dest, env=env)
    log.info("fresh clone: %d files in %s%s", copied, dest, " (quick params)" if quick else "")
    return dest


def timed_repro(clone: Path, env: dict[str, str], log_path: Path, *flags: str) -> dict:
    """`dvc repro` in ``clone``, its output read line by line as it comes and time-stamped into ``log_path``;
    its wall time and each stage's (see the module's docstring)."""
    stages, current, start = [], None, time.perf_counter()
    # a session of its own: stopping it (an error, Ctrl-C) signals dvc and the stage it runs together
    proc = start_group(["dvc", "repro", *flags], cwd=clone, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, errors="replace")
    try:
        with log_path.open("a") as out:
            out.write(f"$ dvc repro {' '.join(flags)}\n")
            for line in proc.stdout:
                now = time.perf_counter() - start
                out.write(f"{now:9.2f} {line}")
                if (match := RUNNING.match(line)) or line.startswith("Updating lock file"):
                    current = _stage_done(stages, current, now)
                if match:
                    current = {"stage": match.group(1), "start_s": round(now, 3)}
                    log.info("%7.1fs  running stage %s", now, current["stage"])
        proc.wait()
        _stage_done(stages, current, time.perf_counter() - start)
    finally:
        if proc.poll() is None:
            stop_group(proc, 10.0, "dvc repro")
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise BenchError(f"dvc repro {' '.join(flags)} failed ({proc.returncode}) in {clone}; {log_path}:\n{tail}")
    return {"wall_s": wall, "stages": stages}


def _stage_done(stages: list[dict], current: dict | None, now: float) -> None:
    """Close the running stage at ``now``: at its lock update, or, when its lock entry did not change (DVC
    prints no update: a deterministic stage forced to run again), at the next stage's start or the end."""
    if current:
        stages.append({**current, "wall_s": now - current["start_s"]})
        log.info("%7.1fs  %s done in %.1fs", now, current["stage"], stages[-1]["wall_s"])


def stage_loop(clone: Path, stages: list[str], env: dict[str, str]) -> float:
    """Wall time of `dvc repro --single-item <stage>` over ``stages``, one after the other, as the flow's tasks."""
    start = time.perf_counter()
    for stage in stages:
        out = sh(f"dvc repro --single-item {stage}", clone, env=env)
        if "Running stage" in out.stdout:
            raise BenchError(f"stage {stage} was not up to date in {clone}: the loop timed a real run")
    return time.perf_counter() - start


def flow_run(clone: Path, env: dict[str, str], target: str | None) -> float:
    """Wall time of `python -m pipeline.flows` (the pipeline, or ``target`` and what it needs, as one in-process
    flow run) in ``clone``."""
    start = time.perf_counter()
    out = sh(f"{sys.executable} -m pipeline.flows" + (f" --target {target}" if target else ""), clone, env=env)
    if "Running stage" in out.stdout + out.stderr:
        raise BenchError(f"the flow ran a stage in {clone}: it was meant to time cached ones")
    return time.perf_counter() - start


def prefect_overhead(clone: Path, env: dict[str, str], home: Path, repeats: int, target: str | None) -> dict:
    """Prefect's cost per stage once the server is up: the flow against the plain loop, alternated."""
    from pipeline.flows import stage_graph, stages_for

    stages = stages_for(target, stage_graph(clone / "dvc.yaml"))   # the flow's own order
    with PrefectServer(home / "server") as server:
        flow_env = {**env, "PREFECT_API_URL": server.api_url, "PREFECT_HOME": str(home / "client")}
        runs = []
        for i in range(repeats):
            flow_s, loop_s = flow_run(clone, flow_env, target), stage_loop(clone, stages, env)
            runs.append({"repeat": i + 1, "flow_wall_s": flow_s, "loop_wall_s": loop_s, "stages": len(stages),
                         "overhead_per_stage_s": (flow_s - loop_s) / len(stages)})
            log.info("prefect overhead, repeat %d: flow %.1fs, loop %.1fs over %d stages: %.2fs per stage",
                     i + 1, flow_s, loop_s, len(stages), runs[-1]["overhead_per_stage_s"])
    flow_s = statistics.median(r["flow_wall_s"] for r in runs)
    loop_s = statistics.median(r["loop_wall_s"] for r in runs)
    return {"flow_wall_s": flow_s, "loop_wall_s": loop_s, "stages": stages, "n_stages": len(stages),
            "overhead_per_stage_s": (flow_s - loop_s) / len(stages), "runs": runs}


def fresh_clone_figures(work: Path, args, env: dict[str, str]) -> dict:
    """Items 1-3: the fresh clone's repro and no-op repro, then Prefect's overhead over its cached stages."""
    clone = fresh_clone(work / "clone", args.quick, env)
    log_path = work / "repro.log"
    targets = [args.target] if args.target else []
    log.info("dvc repro --force %s in the fresh clone (output: %s)", args.target or "(every stage)", log_path)
    first = timed_repro(clone, env, log_path, "--force", *targets)
    log.info("repro: %.1fs, %d stages", first["wall_s"], len(first["stages"]))
    second = timed_repro(clone, env, log_path, *targets)
    if second["stages"]:
        raise BenchError(f"the second dvc repro ran {[s['stage'] for s in second['stages']]}: not a no-op")
    log.info("no-op repro: %.2fs", second["wall_s"])
    overhead = prefect_overhead(clone, env, work / "prefect", args.repeats, args.target)
    return {"repro_s": first["wall_s"], "noop_s": second["wall_s"], "stages": first["stages"],
            "prefect_overhead_s": overhead["overhead_per_stage_s"], "prefect": overhead}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def deployment_run(name: str, parameters: dict) -> str:
    """Start a run of deployment ``name`` and wait for its end; its flow run id. BenchError unless Completed."""
    from prefect.deployments import run_deployment

    start = time.perf_counter()
    run = run_deployment(name, parameters=parameters, timeout=RUN_TIMEOUT_S, poll_interval=1, as_subflow=False)
    if not (run.state and run.state.is_completed()):
        raise BenchError(f"{name} {parameters} ended {run.state.name if run.state else 'unknown'} "
                         f"(flow run {run.id}): see the worker's log under the sandbox")
    log.info("%s: Completed in %.1fs", name, time.perf_counter() - start)
    return str(run.id)


def flow_run_times(run_ids: dict[str, tuple[str, dict]]) -> list[dict]:
    """Each flow run as the Prefect API records it: pick-up (start - expected start) and duration."""
    from prefect.client.orchestration import get_client

    rows = []
    with get_client(sync_client=True) as client:
        for label, (run_id, parameters) in run_ids.items():
            run = client.read_flow_run(run_id)
            rows.append({"run": label, "deployment": label.split(" ")[0], "parameters": parameters,
                         "pickup_s": (run.start_time - run.expected_start_time).total_seconds(),
                         "duration_s": (run.end_time - run.start_time).total_seconds(), "state": run.state_name})
    return rows


def roundtrip_figures(root: Path, poll_s: float, pickup_runs: int, target: str | None = None) -> dict:
    """Items 4-5: the cloud -> device round trip in a sandbox, then no-op runs for more pick-up samples.
    ``target``: each flow runs its share of the stages the target needs (default: the cloud's and the device's
    whole parts)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from pipeline.flows import CLOUD_STAGES, stage_graph, stages_for

    cloud, device = {}, {"stages": DEVICE_STAGES}
    if target:
        needed = stages_for(target, stage_graph(REPO / "dvc.yaml"))
        cloud = {"stages": [s for s in needed if s in CLOUD_STAGES]}
        device = {"stages": [s for s in needed if s not in CLOUD_STAGES]}

    with ExitStack() as stack:   # the sandbox stops its workers, then its servers, whatever happens here
        system = stack.enter_context(sandbox(root, poll_s=poll_s))
        stack.enter_context(temporary_settings(updates={PREFECT_API_URL: system["prefect"].api_url}))
        remote, runs = root / "remote", {}
        start = time.perf_counter()
        runs["cloud_flow/cloud"] = (deployment_run("cloud_flow/cloud", cloud), cloud)
        after_cloud = dir_bytes(remote)
        runs["device_flow/pi"] = (deployment_run("device_flow/pi", device), device)
        roundtrip = time.perf_counter() - start
        after_device = dir_bytes(remote)
        log.info("round trip: %.1fs; DVC remote %.1f MB after the cloud, %.1f MB after the device", roundtrip,
                 after_cloud / 1e6, after_device / 1e6)
        noop = {"cloud_flow/cloud": {**cloud, "push": False},   # every stage cached: only the pick-up and the flow's start
                "device_flow/pi": {"stages": device["stages"][:1], "pull": False, "push": False}}
        for i in range(pickup_runs):
            name = list(noop)[i % 2]   # both workers, alternately
            runs[f"{name} no-op {i + 1}"] = (deployment_run(name, noop[name]), noop[name])
        rows = flow_run_times(runs)
    pickups = [r["pickup_s"] for r in rows]
    return {"roundtrip_s": roundtrip, "pickup_s": statistics.median(pickups), "flow_runs": rows,
            "roundtrip": {"cloud_flow_s": rows[0]["duration_s"], "device_flow_s": rows[1]["duration_s"],
                          "remote_bytes_after_cloud": after_cloud, "remote_bytes_after_device": after_device},
            "workers": {"poll_s": poll_s, "prefetch_s": poll_s}}


def figure_rows(figures: dict, stage: str | None) -> list[dict]:
    """The main table: each figure, its target and whether this run met it."""
    rows = []
    for key, what in WHAT.items():
        if key in ("repro_s", "noop_s", "prefect_overhead_s"):
            what += f" ({stage} and the stages it needs)" if stage else " (every stage)"
        target = TARGETS.get(key)
        rows.append({"figure": key, "what": what, "measured_s": figures[key],
                     "target": f"<= {target:g} s{' per stage' if key == 'prefect_overhead_s' else ''}"
                     if target else "measured, no target",
                     "met": ("yes" if figures[key] <= target else "no") if target else "-"})
    return rows


def plot(figures: dict, stages: list[dict], out: Path) -> None:
    """The five timings (log scale, targets marked) and the repro's per-stage times."""
    plt = _pyplot()
    fig, (ax, per_stage) = plt.subplots(1, 2, figsize=(12, max(3.5, 0.3 * len(stages) + 1.5)))
    keys = list(WHAT)
    ax.barh(range(len(keys)), [figures[k] for k in keys], color="tab:blue")
    for i, key in enumerate(keys):
        if key in TARGETS:
            ax.plot([TARGETS[key]] * 2, [i - 0.4, i + 0.4], color="tab:red", lw=2,
                    label="target" if i == 0 else None)
        ax.annotate(f"{figures[key]:.3g} s", (figures[key], i), xytext=(3, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.set_yticks(range(len(keys)), [LABELS[k] for k in keys])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set(xlabel="wall time (s, log scale; Prefect: its overhead per stage)", title="Pipeline timings")
    ax.set_xlim(right=max(figures[k] for k in keys) * 8)   # room for the last bar's figure
    ax.legend(fontsize=8, loc="lower right")
    names = [s["stage"] for s in stages]
    per_stage.barh(range(len(names)), [s["wall_s"] for s in stages], color="tab:green")
    per_stage.set_yticks(range(len(names)), names)
    per_stage.invert_yaxis()
    per_stage.set(xlabel="stage wall time (s)", title="dvc repro --force in a fresh clone, per stage")
    for a in (ax, per_stage):
        a.grid(alpha=0.3, axis="x")
    _save(fig, out)


def write(figures: dict, args, started: float) -> None:
    result = BenchResult()
    result.rows = figure_rows(figures, args.target)
    stages = figures["stages"]
    result.add_section("dvc repro --force in a fresh clone, per stage", stages, ["stage", "start_s", "wall_s"])
    result.add_section("Prefect overhead: the in-process flow vs a plain `dvc repro --single-item` loop",
                       figures["prefect"]["runs"])
    result.add_section("Deployment runs (sandbox, CI-sized params)", figures["flow_runs"],
                       ["run", "pickup_s", "duration_s", "state"])
    trip = figures["roundtrip"]
    result.add_section("Round trip", [trip])
    notes = (f"Stages: {sum(s['wall_s'] for s in stages):.1f} s of the repro's {figures['repro_s']:.1f} s "
             f"(the rest: DVC's own work). Prefect overhead: median flow {figures['prefect']['flow_wall_s']:.2f} s "
             f"vs loop {figures['prefect']['loop_wall_s']:.2f} s over {figures['prefect']['n_stages']} stages, "
             f"{args.repeats} repeat(s). Workers poll every {args.poll_s:g} s (prefetch {args.poll_s:g} s). "
             f"Round trip: cloud_flow {trip['cloud_flow_s']:.1f} s, device_flow {trip['device_flow_s']:.1f} s; "
             f"DVC remote {trip['remote_bytes_after_cloud'] / 1e6:.1f} MB after the cloud, "
             f"{trip['remote_bytes_after_device'] / 1e6:.1f} MB after the device. "
             f"{'--quick: CI-sized params in the fresh clone too. ' if args.quick else ''}"
             f"Plot: {NAME}.png. Bench time {time.perf_counter() - started:.0f} s.")
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    extra = {k: figures[k] for k in ("repro_s", "noop_s", "prefect_overhead_s", "pickup_s", "roundtrip_s",
                                     "stages", "prefect", "flow_runs", "roundtrip", "workers")}
    json_path, md_path = result.write(NAME, args.out, title="Pipeline wall times: DVC, Prefect, workers",
                                      columns=["figure", "what", "measured_s", "target", "met"], notes=notes,
                                      extra={**extra, "targets": TARGETS, "settings": settings})
    plot(figures, stages, Path(args.out) / f"{NAME}.png")
    print(md_path.read_text())
    print(f"wrote {json_path}, {md_path} and {Path(args.out) / f'{NAME}.png'}")


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(show_path=False)])
    logging.getLogger("httpx").setLevel(logging.WARNING)   # every API request of the Prefect client: noise here
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        if args.workdir:
            work = args.workdir.resolve()
            work.mkdir(parents=True, exist_ok=False)   # a used one would mix two runs' clones
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="edgeflux-bench-pipeline-")))
        # this process's Prefect client: offline, its files under the work dir, no server but the ones started here
        os.environ.update(offline_env({"PREFECT_HOME": str(work / "prefect-bench")}))
        os.environ.pop("PREFECT_API_URL", None)
        if args.threads:   # torch's intra-op threads in every stage, the sandbox's flow runs' too
            os.environ["OMP_NUM_THREADS"] = str(args.threads)
        figures = fresh_clone_figures(work, args, child_env())
        (work / "sandbox").mkdir()
        figures |= roundtrip_figures(work / "sandbox", args.poll_s, args.pickup_runs, args.target)
    write(figures, args, started)


if __name__ == "__main__":
    main()
