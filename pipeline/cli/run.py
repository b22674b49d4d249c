"""`edgeflux run`: a device preset and overrides applied to params.yaml, then `dvc repro`; or, with --exp,
the same as a DVC experiment (`dvc exp run -S`)."""
from __future__ import annotations

import argparse
import itertools
import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import yaml

from edgeflux.presets import OVERRIDES_ENV, Preset, available, load_preset, merge, set_params

from .common import RAW, UsageError, wrap

PARAMS = Path("params.yaml")
# --budget: the device's budget, which every budgeted stage inherits, so the report compares them under one
BUDGET_KEY = "device.budget"
CHECKED = "params.yaml + overrides"   # how a validation error names the file it checked (a temporary copy)


def _budget(text: str) -> str:
    from edgeflux.options import parse_bytes   # light: no torch

    try:
        parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _parse_set(text: str) -> tuple[str, Any]:
    """KEY=VALUE, the value read as YAML (as in params.yaml: 1 is a number, [1, 2] a list, 200MB text)."""
    key, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*", key.strip()):
        raise UsageError(f"--set {text!r}: expected KEY=VALUE with a dotted key, e.g. train_bp.epochs=1")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise UsageError(f"--set {text!r}: the value is not valid YAML ({str(exc).splitlines()[0]})") from None


def collect_overrides(args: argparse.Namespace, preset: Preset | None, params: dict) -> dict[str, tuple[Any, str]]:
    """{key: (value, where it came from)}, in the order they apply: the preset's, --budget, then --set
    (the most specific wins; a later key moves to the end so that it also applies last)."""
    layers = [(preset.params if preset else {}, f"preset {preset and preset.name}"),
              ({BUDGET_KEY: args.budget} if args.budget else {}, "--budget"),
              (dict(_parse_set(text) for text in args.overrides), "--set")]
    out: dict[str, tuple[Any, str]] = {}
    for values, source in layers:
        for key, value in values.items():
            out.pop(key, None)
            out[key] = (value, source)
    return out


def check_params(merged: dict) -> None:
    """Validate params as the stages will (edgeflux.config, which loads without torch); UsageError with its
    message, one line per problem."""
    from edgeflux.config import ParamsError, validate

    try:
        validate(merged, where=CHECKED)
    except ParamsError as exc:
        raise UsageError(str(exc)) from None


_MISSING = object()


def _lookup(params: dict, key: str) -> Any:
    node: Any = params
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _hydra(value: Any) -> str:
    """A value in Hydra's override grammar, which `dvc exp run -S` parses (quoted where Hydra would read the
    text as another type, or as a sweep: a comma)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(map(_hydra, value)) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra(v)}" for k, v in value.items()) + "}"
    text = str(value)
    plain = re.fullmatch(r"[\w.\-/]+", text) and yaml.safe_load(text) == text
    try:
        float(text.replace("_", ""))   # Hydra reads 1e3, 1_000, inf, nan as numbers
        plain = False
    except ValueError:
        pass
    return text if plain else '"' + text.replace('"', '\\"') + '"'


def set_args(params: dict, key: str, value: Any) -> list[str]:
    """The -S arguments for one override. A mapping onto a section merges into it (as set_params does), so it
    becomes one argument per leaf; a key params.yaml lacks is added with Hydra's `+`."""
    current = _lookup(params, key)
    if isinstance(value, dict) and isinstance(current, dict):
        return [arg for k, v in value.items() for arg in set_args(params, f"{key}.{k}", v)]
    return [f"{'+' if current is _MISSING else ''}{key}={_hydra(value)}"]


def run_command(args: argparse.Namespace, params: dict, overrides: dict[str, Any]) -> list[str]:
    """The DVC command line (argv[0] "dvc": the venv's, first on the PATH of venv_env)."""
    if not args.exp:
        return ["dvc", "repro", *args.targets]
    sets = [arg for key, value in overrides.items() for arg in set_args(params, key, value)]
    return ["dvc", "exp", "run", "-n", args.exp, *(["--temp"] if args.temp else []),
            *[part for s in sets for part in ("-S", s)], *args.targets]


def print_plan(args, preset: Preset | None, overrides: dict[str, tuple[Any, str]], env: dict, command: list[str]):
    if preset:
        print(f"preset {preset.name}: {preset.description}")
    if overrides:
        width = max(len(k) for k in overrides)
        print("overrides:")
        for key, (value, source) in overrides.items():
            print(f"  {key:<{width}} = {json.dumps(value)}   ({source})")
        print("params.yaml: " + ("left to DVC, which applies the overrides in the experiment" if args.exp
                                 else "these values " + ("would be " if args.dry_run else "") + "written in "
                                 "place, comments kept"))
    if env:
        print("env: " + " ".join(f"{k}={v}" for k, v in env.items()))
    print(f"$ {shlex.join(command)}", flush=True)


def call(command: list[str], env: dict[str, str]) -> int:
    """Run a tool with its output streamed; its exit code (128 + N when signal N ended it, as a shell says).
    Ctrl-C reaches the tool too (same process group): wait for it to stop cleanly; a second one stops it."""
    try:
        proc = subprocess.Popen(command, env=env)
    except FileNotFoundError:
        raise UsageError(f"{command[0]} not found: install the project (pip install -e .) in this environment") from None
    try:
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            rc = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        rc = proc.wait()
    return 128 - rc if rc < 0 else rc


def report_stale(env: dict[str, str]) -> list[str] | None:
    """The stages whose changes reports/summary.md lacks (`dvc status report`: the report stage and what it reads
    that is not up to date), [] when it is up to date, None when DVC cannot say."""
    try:
        done = subprocess.run(["dvc", "status", "--json", "report"], capture_output=True, text=True, env=env,
                              timeout=300)
        return sorted(json.loads(done.stdout or "{}")) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return None


def show_summary(args: argparse.Namespace, env: dict[str, str]) -> None:
    if args.exp and args.temp:   # the results are in the experiment, not in this workspace
        print(f"experiment {args.exp}: `dvc exp show`, `edgeflux compare`; `dvc exp apply {args.exp}` brings it here")
        return
    if not Path("reports/summary.md").exists():   # a run of other stages only may have written none yet
        print("no summary yet: `edgeflux run` (every stage) writes reports/summary.md")
    elif args.targets and "report" not in args.targets and (stale := report_stale(env)):
        ran = ", ".join(args.targets)
        print(f"reports/summary.md predates this run of {ran} (stale: {', '.join(stale)}), so it is not shown; "
              f"`edgeflux run report` brings it up to date (running every stale stage it reads). This run's "
              f"figures: `dvc metrics show`, MLflow.")
    else:
        from stages.report import show

        show()
    print("compare with earlier runs: edgeflux compare" + ("; DVC's view: dvc exp show" if args.exp else ""))


def _resolve(value: Any, params: dict) -> Any:
    """dvc.yaml's `${a.b}` (a whole-value reference into params), or the value itself."""
    if isinstance(value, str) and (ref := re.fullmatch(r"\$\{\s*([\w.-]+)\s*\}", value)):
        found = _lookup(params, ref.group(1))
        return [] if found is _MISSING else found
    return value


def stage_names(dvc_yaml: dict, params: dict) -> list[str]:
    """Every name `dvc repro` takes for dvc.yaml's stages: a stage's, and for foreach and matrix stages each
    instance's too (name@item, name@key, name@value1-value2, as DVC names them), from ``params``."""
    names = []
    for name, stage in (dvc_yaml.get("stages") or {}).items():
        names.append(name)
        if "foreach" in stage:
            items = _resolve(stage["foreach"], params)
            names += [f"{name}@{item}" for item in (items if isinstance(items, (list, dict)) else [])]
        elif "matrix" in stage:
            axes = [_resolve(values, params) for values in stage["matrix"].values()]
            names += [f"{name}@{'-'.join(map(str, combo))}" for combo in itertools.product(*axes)]
    return names


def check_targets(targets: list[str], params: dict) -> None:
    """A target DVC would not know is refused before params.yaml changes (DVC's own addresses, such as
    dvc.yaml:stage or a .dvc file, are left to it)."""
    if not Path("dvc.yaml").is_file():   # not a project's root: DVC says so itself
        return
    known = stage_names(yaml.safe_load(Path("dvc.yaml").read_text()) or {}, params)
    for target in targets:
        if target not in known and ":" not in target and not target.endswith((".dvc", "dvc.yaml")):
            raise UsageError(f"no stage {target!r} in dvc.yaml; stages: {', '.join(known)}")


def repro_holder() -> str | None:
    """'dvc repro (pid N)' when a live DVC process holds a lock on this repository's outputs (DVC's
    .dvc/tmp/rwlock), else None."""
    import psutil

    path = Path(".dvc/tmp/rwlock")
    try:
        lock = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return None
    infos = [*lock.get("write", {}).values(), *(i for infos in lock.get("read", {}).values() for i in infos)]
    live = [i for i in infos if isinstance(i, dict) and psutil.pid_exists(i.get("pid", -1))]
    if not live:
        return None
    program, _, rest = str(live[0].get("cmd", "dvc")).partition(" ")
    return f"{Path(program).name} {rest} (pid {live[0]['pid']})".replace("  ", " ")


def _restore(original: str) -> None:
    if PARAMS.read_text() != original:   # written as set_params writes it (edgeflux.artifacts would import torch)
        PARAMS.write_text(original)
        print("params.yaml: restored as it was before this run (the run did not succeed)")


def cmd_run(args: argparse.Namespace) -> int:
    if args.temp and not args.exp:
        raise UsageError("--temp needs --exp NAME (it runs the experiment in a temporary copy)")
    preset = load_preset(args.preset) if args.preset else None
    if not PARAMS.is_file():
        raise UsageError(f"{PARAMS} not found: run edgeflux from the project's root (where dvc.yaml is)")
    params = yaml.safe_load(PARAMS.read_text()) or {}
    sourced = collect_overrides(args, preset, params)
    overrides = {k: v for k, (v, _) in sourced.items()}
    check_params(merge(params, overrides))    # before anything runs or params.yaml changes
    if not args.targets and preset and preset.stages:
        args.targets = list(preset.stages)
    check_targets(args.targets, merge(params, overrides))
    command = run_command(args, params, overrides)
    env = preset.env() if preset else {}      # threads; EDGEFLUX_PRESET tags the MLflow runs
    # params.yaml is what a running repro's stages read and what its dvc.lock records: leave it alone then
    if not args.dry_run and not (args.exp and args.temp) and (holder := repro_holder()):
        raise UsageError(f"{holder} is running in this repository: wait for it to end (edgeflux status shows it), "
                         "then run again; or run as an experiment in a copy with --exp NAME --temp")
    print_plan(args, preset, sourced, env, command)
    if args.dry_run:
        return 0
    original = PARAMS.read_text()
    if not args.exp:
        set_params(overrides, PARAMS)
    from edgeflux.environ import venv_env   # offline, the venv's dvc and python first on PATH

    # the overrides also go to the pipeline's MLflow parent run, beside params.yaml (edgeflux.tracking.parents)
    rc, tool_env = 1, venv_env({**env, **({OVERRIDES_ENV: json.dumps(overrides)} if overrides else {})})
    try:
        rc = call(command, tool_env)
    finally:   # a refused or failed run leaves params.yaml as it found it
        if rc != 0 and not args.exp:
            _restore(original)
    if rc == 0:
        show_summary(args, tool_env)
    return rc


RUN_EXAMPLES = """\
examples:
  edgeflux run                                   # dvc repro: every stage that is not up to date
  edgeflux run --preset pi4                      # a Raspberry Pi 4's params and threads (presets/pi4.yaml)
  edgeflux run --preset pi4 --budget 200MB train_bp   # every method under 200 MB; train_bp and what it needs
  edgeflux run --set train_bp.epochs=1 --set neuroflux.cache.storage=dense
  edgeflux run --exp pi4-200MB --preset pi4 --budget 200MB   # a DVC experiment: dvc exp run -n ... -S ...
  edgeflux run --dry-run --preset jetson-nano    # print the overrides and the dvc command, run nothing
"""


def add_run(sub) -> None:
    p = sub.add_parser("run", help="run the pipeline (dvc repro), or a DVC experiment with --exp",
                       description=wrap("Apply a device preset and overrides to params.yaml, then run the stages "
                                        "that are not up to date (dvc repro); or, with --exp, run them as a DVC "
                                        "experiment with the overrides given to DVC (dvc exp run -S)."),
                       epilog=RUN_EXAMPLES, formatter_class=RAW)
    p.add_argument("targets", nargs="*", metavar="STAGE",
                   help="stages to run, with what they need (default: every stage, or the preset's)")
    p.add_argument("--preset", metavar="NAME", help=f"device preset: {', '.join(available()) or 'none in presets/'} "
                   "(presets/NAME.yaml), or the path of a preset file: its params and its thread count")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="set one param, dotted key, YAML value (repeatable; wins over --preset and --budget), "
                        "e.g. train_bp.epochs=1")
    p.add_argument("--budget", type=_budget, metavar="SIZE",
                   help=f"every method's memory budget at once ({BUDGET_KEY}, which the budgeted stages inherit), "
                        "e.g. 200MB or 1GiB")
    p.add_argument("--exp", metavar="NAME", help="run as the DVC experiment NAME (dvc exp run -n NAME -S ...): "
                   "edgeflux leaves params.yaml to DVC, which applies the overrides in the experiment")
    p.add_argument("--temp", action="store_true",
                   help="with --exp: run it in a temporary copy (dvc exp run --temp), leaving this workspace as it is")
    p.add_argument("--dry-run", action="store_true",
                   help="print the overrides and the dvc command; change and run nothing")
    p.set_defaults(func=cmd_run)
