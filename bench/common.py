"""What every benchmark shares: the machine it ran on, its flags, and how results are written.

Each benchmark writes bench/results/<name>.json (machine-readable) and <name>.md (a table
with the machine and the exact command line that produced it) side by side:

    result = BenchResult()
    result.add(model="vgg16", batch=8, peak_bytes=123)
    result.write("memory_baseline", title="Peak training memory", notes="...")
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
import torch

from edgeflux.machine import cpu_model
from edgeflux.colours import METHOD_COLOURS  # noqa: F401  (the benchmarks' figures: one colour per method)
from edgeflux.models.spec import ModelSpec

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _nvidia_driver() -> str | None:
    """The NVIDIA driver's version, from nvidia-smi (torch does not report it)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def gpu_info() -> dict[str, Any]:
    """The GPU, its driver and the CUDA/cuDNN builds torch runs on ({} without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    props = torch.cuda.get_device_properties(0)
    return {"cuda_memory_bytes": props.total_memory, "cuda_capability": f"{props.major}.{props.minor}",
            "nvidia_driver": _nvidia_driver(), "cuda_runtime": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version()}


def machine_info() -> dict[str, Any]:
    """The machine a result came from: absolute numbers mean nothing without it."""
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cores_logical": os.cpu_count(),
        "cores_physical": psutil.cpu_count(logical=False),
        "memory_bytes": psutil.virtual_memory().total,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_device": cuda,
        **gpu_info(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def machine_line(info: dict[str, Any]) -> str:
    mem_gib = info["memory_bytes"] / 2**30
    cuda = info["cuda_device"] or "none"
    if info.get("cuda_runtime"):
        cuda += (f" ({info['cuda_memory_bytes'] / 2**30:.0f} GiB, driver {info['nvidia_driver']}, CUDA "
                 f"{info['cuda_runtime']}, cuDNN {info['cudnn']})")
    return (f"{info['hostname']} · {info['cpu']} · {info['cores_logical']} logical cores · {mem_gib:.1f} GiB RAM · "
            f"{info['platform']} · Python {info['python']} · torch {info['torch']} · "
            f"CUDA: {cuda} · {info['date']}")


def _invocation() -> list[str]:
    """How the running program was started, before its arguments: ["-m", "bench.<name>"] for a benchmark.

    Under `python -m bench.<name>`, sys.argv[0] is the module's absolute file path, so the module's name
    is taken instead; a bench/<name>.py run as a file is given in that same form.
    """
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    if spec is not None and spec.name:
        return ["-m", spec.name.removesuffix(".__main__")]
    if script is not None and script.suffix == ".py" and script.parent == Path(__file__).resolve().parent:
        return ["-m", f"bench.{script.stem}"]
    return sys.argv[:1]


def program_name() -> str:
    """The program as a usage line shows it (`python -m bench.<name>`; argparse would name the file)."""
    return shlex.join(["python", *_invocation()])


def command_line() -> str:
    """The command that is running, as it could be typed again from the repository root."""
    return shlex.join(["python", *_invocation(), *sys.argv[1:]])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | dict[str, str] | None = None) -> str:
    """A markdown table of `rows`; columns: keys to show, or {key: header}; default: all keys."""
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    headers = columns if isinstance(columns, dict) else {c: c for c in columns}
    lines = ["| " + " | ".join(headers.values()) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(row.get(k)) for k in headers) + " |" for row in rows]
    return "\n".join(lines)


class BenchResult:
    """Rows of one benchmark run (plus optional extra tables), written as JSON and markdown."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.sections: list[dict[str, Any]] = []

    def add(self, **row: Any) -> None:
        """One row of the main table; values are JSON-serialisable."""
        self.rows.append(row)

    def add_section(self, title: str, rows: Sequence[dict[str, Any]],
                    columns: Sequence[str] | dict[str, str] | None = None) -> None:
        """An extra table written after the main one (e.g. a fit per model)."""
        self.sections.append({"title": title, "rows": list(rows), "columns": columns})

    def write(self, name: str, results_dir: str | Path = RESULTS_DIR, title: str | None = None,
              columns: Sequence[str] | dict[str, str] | None = None, notes: str | None = None,
              md_rows: Sequence[dict[str, Any]] | None = None, extra: dict[str, Any] | None = None,
              measured_by: dict[str, Any] | None = None) -> tuple[Path, Path]:
        """Write <results_dir>/<name>.json and <name>.md; returns their paths.

        md_rows: what the markdown table shows (e.g. values converted to MiB); default: the rows.
        extra: more top-level JSON fields (settings, fits, ...). Every results file has a top-level n_seeds, how many
        seeds its rows cover: 1 unless extra says more (a benchmark without --seeds measures one run).
        measured_by: {"machine", "command"} of the run that measured the rows, when they are written
        again elsewhere (re-rendered from its JSON); default: this machine and command. Its ``runs`` (a merge's,
        read_parts) are kept in the JSON, so that merging the merge again lists each run once.
        """
        out = Path(results_dir)
        out.mkdir(parents=True, exist_ok=True)
        info, command = (measured_by["machine"], measured_by["command"]) if measured_by else \
            (machine_info(), command_line())
        payload = {"benchmark": name, "title": title or name, "command": command, "machine": info,
                   "rows": self.rows, "sections": self.sections, "notes": notes, "n_seeds": 1, **(extra or {}),
                   **({"runs": measured_by["runs"]} if measured_by and measured_by.get("runs") else {})}
        json_path, md_path = out / f"{name}.json", out / f"{name}.md"
        json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")

        parts = [f"# {title or name}", "", f"Machine: {machine_line(info)}", "",
                 f"Command: `{command}`", "", markdown_table(md_rows if md_rows is not None else self.rows, columns)]
        for section in self.sections:
            parts += ["", f"## {section['title']}", "", markdown_table(section["rows"], section["columns"])]
        if notes:
            parts += ["", notes.strip()]
        md_path.write_text("\n".join(parts) + "\n")
        return json_path, md_path


def read_parts(paths: Sequence[str | Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Results files of runs to merge into one (a benchmark's --combine): the parts, their rows in order, and the
    measured_by BenchResult.write takes (the first part's machine, every run's command joined by &&, and ``runs``:
    each run's command and notes, once; a part that is itself a merge brings its runs, not itself)."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    runs = [run for part in parts for run in part.get("runs") or [{"command": part["command"], "notes": part["notes"]}]]
    return parts, [r for part in parts for r in part["rows"]], {
        "machine": parts[0]["machine"], "command": " && ".join(run["command"] for run in runs), "runs": runs}


class RunLog:
    """A long benchmark's finished runs, each one JSON line of ``path`` the moment it finishes. Started again with
    the same settings and --out, the benchmark takes these instead of running them again: each run is measured on
    its own (its own weights, data order and clock), so the resumed table is the one an uninterrupted run writes, up
    to the machine's speed between the two. Lines of other settings are kept and not read; a line a stop cut short
    is dropped. ``fresh``: forget every line (the file is removed)."""

    def __init__(self, path: str | Path, settings: dict[str, Any], fresh: bool = False) -> None:
        self.path, self.settings = Path(path), json.loads(json.dumps(settings, default=str))
        self.done: dict[str, dict[str, Any]] = {}
        if fresh:
            self.path.unlink(missing_ok=True)
        text = self.path.read_text() if self.path.exists() else ""
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if entry.get("settings") == self.settings:
                self.done[entry["key"]] = entry["result"]
        if text and not text.endswith("\n"):   # the next line must not join the cut one
            with self.path.open("a") as f:
                f.write("\n")

    def get(self, *key: Any) -> dict[str, Any] | None:
        """The result logged under ``key`` with these settings, or None."""
        return self.done.get(json.dumps(key, default=str))

    def add(self, result: dict[str, Any], *key: Any) -> dict[str, Any]:
        """Log ``result`` under ``key`` (on disk before this returns); returns it as a resumed run reads it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        entry = json.loads(json.dumps({"key": json.dumps(key, default=str), "settings": self.settings,
                                       "result": result}, default=str))
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done[entry["key"]] = entry["result"]
        return entry["result"]


def runs_notes(runs: Sequence[dict[str, Any]]) -> str:
    """The notes of merged runs (read_parts' ``runs``): one line per run, its command and what it noted."""
    return "\n".join([f"Merged from {len(runs)} runs:", "", *(f"- `{r['command']}`: {r['notes']}" for r in runs)])


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every flag's default after its help."""


WORKLOADS = ("default", "realistic")


def add_workload(parser: argparse.ArgumentParser, default: str, realistic: str, defaults: dict) -> None:
    """--workload: what the default and the realistic workload are (help text), and the realistic one's own
    ``defaults`` (applied by parse_workload)."""
    flags = ", ".join("--" + k.replace("_", "-") + " " + (" ".join(map(str, v)) if isinstance(v, list) else str(v))
                      for k, v in defaults.items())
    parser.add_argument("--workload", choices=WORKLOADS, default="default",
                        help=f"default: {default}; realistic: {realistic}, and unless given: {flags}")
    parser.set_defaults(realistic_defaults=defaults)


def parse_workload(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """parser's arguments, with the realistic workload's defaults where the command line left a flag at the
    default workload's; --quick (the default workload's smallest run) with it is an error."""
    args = parser.parse_args(argv)
    defaults = args.__dict__.pop("realistic_defaults")
    if args.workload == "realistic":
        if args.quick:
            parser.error("--quick runs the default workload's smallest model; leave out --workload realistic")
        for key, value in defaults.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    return args


def workload_model(name: str, args: argparse.Namespace) -> ModelSpec:
    """The model a benchmark trains on its workload: torchvision's architecture on the realistic one (photos), the
    zoo's at --width on the default one (32-px grey images)."""
    return ModelSpec(name=name, arch="torchvision") if args.workload == "realistic" else ModelSpec(name=name,
                                                                                                 width=args.width)


def model_args(name: str, args: argparse.Namespace, image_size: int, num_classes: int) -> dict:
    """build_model's arguments for ``name`` on the workload (the seed aside)."""
    in_channels = 3 if args.workload == "realistic" else 1
    return {k: v for k, v in workload_model(name, args).build_args(num_classes, in_channels, image_size, None).items()
            if k != "seed"}


def result_name(name: str, args: argparse.Namespace) -> str:
    """A benchmark's results file name: the default workload's ``name``; another's beside it, not over it."""
    return name if args.workload == "default" else f"{name}_{args.workload}"


def bench_argparser(description: str) -> argparse.ArgumentParser:
    """The flags every benchmark takes (--quick, --out); add the benchmark's own to the result."""
    parser = argparse.ArgumentParser(prog=program_name(), description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="CI-sized run: fewer models/settings, small sizes; finishes in a minute or two")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR,
                        help="directory for the results (<name>.json, <name>.md, plots); default: bench/results")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice, one per core)")
    return parser


# Student's t, two-sided 95%, by degrees of freedom (n - 1); above 30 the normal's 1.96 is within 4%
T975 = dict(enumerate((12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
                       2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
                       2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042), start=1))


def mean_ci(values: list[float]) -> dict:
    """Mean and 95% interval (Student's t) of the values; the interval needs two or more."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "lo": None, "hi": None}
    mean = statistics.fmean(values)
    half = T975.get(n - 1, 1.96) * statistics.stdev(values) / math.sqrt(n) if n > 1 else None
    return {"n": n, "mean": mean, "lo": None if half is None else mean - half,
            "hi": None if half is None else mean + half}


def fmt_ci(ci: dict, unit: str = "", digits: int = 3) -> str:
    if not ci["n"]:
        return "-"
    text = f"{ci['mean']:.{digits}g}{unit}"
    return text + (f" [{ci['lo']:.{digits}g}, {ci['hi']:.{digits}g}]" if ci["lo"] is not None else "") + \
        f" (n={ci['n']})"


def add_seeds(parser: argparse.ArgumentParser, what: str = "weights, data order") -> None:
    """The --seeds flag: committed results are the mean and 95% interval over three; --quick runs one."""
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help=f"seeds ({what}), one run each (default: 0 1 2; --quick: 0)")


def quick_args(args: argparse.Namespace, quick: dict) -> argparse.Namespace:
    """``args`` with ``quick``'s values set over them when --quick is given (the CI-sized run)."""
    if args.quick:
        for key, value in quick.items():
            setattr(args, key, value)
    return args


def seeds_of(args: argparse.Namespace) -> list[int]:
    """The seeds to run: --seeds as given, else three (one under --quick). A seed given twice would count one run
    as two in every interval: refused."""
    if args.seeds is not None and len(set(args.seeds)) < len(args.seeds):
        raise SystemExit(f"--seeds {' '.join(map(str, args.seeds))}: a seed is given twice; give each seed once")
    return args.seeds if args.seeds is not None else [0] if args.quick else [0, 1, 2]


def over_seeds(rows: list[dict], by: Sequence[str], metrics: Sequence[str]) -> list[dict]:
    """One row per `by` group of per-seed rows (each with "seed"): every metric's mean over the group, its 95%
    half-width beside it as <metric>_ci95 (None with one seed), n_seeds and seeds; other fields the first seed's."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in by), []).append(row)
    out = []
    for group in groups.values():
        row = {k: v for k, v in group[0].items() if k != "seed"}
        for metric in metrics:      # a seed without the figure (a method that did not fit) is left out
            ci = mean_ci([r[metric] for r in group if r.get(metric) is not None])
            row[metric], row[f"{metric}_ci95"] = ci["mean"], None if ci["hi"] is None else ci["hi"] - ci["mean"]
        out.append({**row, "n_seeds": len(group), "seeds": [r["seed"] for r in group]})
    return out


def judged(values: list[float], at_least: float) -> tuple[str, dict]:
    """Whether the values' mean is at least `at_least`, by its 95% interval: "met" when the whole interval is,
    "not met" when none of it is, "not shown" when it spans the target, "not judged" with one value."""
    ci = mean_ci(values)
    if ci["lo"] is None:
        return "not judged (one seed)", ci
    return ("met" if ci["lo"] >= at_least else "not met" if ci["hi"] < at_least else "not shown"), ci


def target(what: str, bound: float, values: list[float], exact: bool = False, at_most: bool = False,
           **labels: Any) -> dict:
    """A target row of a results file: what is judged, its bound, the per-seed values' mean and 95% interval, and
    judged()'s verdict; labels (model, ...) first. Every benchmark's targets have this shape. exact: the value is
    deterministic (a byte count), one value judged as it is; at_most: the values must stay at or below the bound."""
    sign = -1 if at_most else 1
    if exact:
        (value,) = set(values)
        verdict = "met" if sign * value >= sign * bound else "not met"
        ci = {"n": None, "mean": value, "lo": value, "hi": value}
    else:
        verdict, ci = judged([sign * v for v in values], sign * bound)
        if at_most:
            ci = {"n": ci["n"], "mean": -ci["mean"], "lo": None if ci["hi"] is None else -ci["hi"],
                  "hi": None if ci["lo"] is None else -ci["lo"]}
    return {**labels, "target": f"{what} {'<=' if at_most else '>='} {bound:+g}", "bound": bound, "mean": ci["mean"],
            "lo": ci["lo"], "hi": ci["hi"], "n_seeds": ci["n"], "verdict": verdict}


TARGET_COLUMNS = ("target", "mean", "lo", "hi", "n_seeds", "verdict")


def pm(row: dict, key: str, scale: float = 1.0, digits: int = 4) -> str:
    """A markdown cell of an over_seeds row: the mean, and ± its 95% half-width where there is one."""
    value, half = row.get(key), row.get(f"{key}_ci95")
    if value is None:
        return ""
    return f"{scale * value:.{digits}g}" + ("" if half is None else f" ± {scale * half:.{digits}g}")
