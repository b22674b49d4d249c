"""The `edgeflux` command: what a user does with the project, each a thin wrapper over the tool that does it.

    edgeflux run --preset pi4 --budget 200MB      # params.yaml updated (comments kept), `dvc repro`, the summary
    edgeflux run --exp big --budget 300MB         # the same as a DVC experiment: `dvc exp run -n big -S ...`
    edgeflux status                               # stages up to date / stale / running (DVC + MLflow)
    edgeflux compare --last 3                     # recent pipeline runs side by side (MLflow), and a plot
    edgeflux report --open                        # reports/summary.md, then the report opened
    edgeflux export finetune-mobiletl             # one trained model as checked ONNX + TorchScript files
    edgeflux plan --budget 16MB                   # every method's measured peak, batch and speed under a budget
    edgeflux servers | worker --pool pi | serve-cloud   # pipeline.servers and pipeline.cloud, unchanged

The tools stay the source of truth: DVC decides what is stale and runs the stages, MLflow holds the runs,
Prefect runs the workers; their output is streamed, not captured, and their exit code is this command's.
Heavy imports (mlflow, matplotlib; torch, which validating params needs) happen inside the subcommand that
needs them, so `--help` answers at once. One module per subcommand (run, status, compare, report, export, plan; forward:
servers, worker, serve-cloud), what they share in common.py. docs/cli.md has more examples.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edgeflux.errors import UserError

from .common import RAW, Parser, UsageError, wrap
from .compare import add_compare
from .export import add_export
from .forward import FORWARDED
from .plan import add_plan
from .report import add_report
from .run import BUDGET_KEY, add_run
from .status import add_status

__all__ = ["BUDGET_KEY", "Parser", "UsageError", "build_parser", "main", "version_line"]

TOP_EXAMPLES = """\
examples:
  edgeflux run --preset pi4 --budget 200MB       # the pipeline as a Raspberry Pi 4 runs it, every method at 200 MB
  edgeflux run --exp big --budget 300MB          # the same as a DVC experiment
  edgeflux status                                # up to date / stale (what changed) / running, per stage
  edgeflux compare --last 2                      # two pipeline runs side by side; reports/compare.png
  edgeflux report --open                         # the summary, and its plots opened
  edgeflux export finetune-mobiletl              # a trained model as checked ONNX + TorchScript files
  edgeflux plan --budget 16MB                    # what a budget buys: every method measured and timed
  edgeflux servers --host 0.0.0.0 --init-auth --deploy   # cloud host: Prefect + MLflow servers
  edgeflux worker --pool pi --device-id pi-01    # device: a Prefect worker in this clone
  edgeflux serve-cloud                           # MEANet's cloud model over HTTP

`edgeflux COMMAND --help` gives each command's flags and examples; docs/cli.md has more.
"""


def version_line() -> str:
    """``edgeflux 0.1.0 (commit 1a2b3c4, torch 2.14.1, Python 3.11.7)``: what a bug report needs, without importing
    torch (its installed version is read from its metadata)."""
    import platform
    import subprocess
    from importlib.metadata import PackageNotFoundError, version

    from edgeflux import __version__

    parts = []
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parents[2])
        if done.returncode == 0 and done.stdout.strip():
            parts.append(f"commit {done.stdout.strip()}")
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        parts.append(f"torch {version('torch')}")
    except PackageNotFoundError:
        parts.append("torch not installed")
    parts.append(f"Python {platform.python_version()}")
    return f"edgeflux {__version__} ({', '.join(parts)})"


class _Version(argparse.Action):
    """--version: computed when asked for, so --help stays quick."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the version (and commit, torch, Python) and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def build_parser() -> Parser:
    parser = Parser(prog="edgeflux", formatter_class=RAW, epilog=TOP_EXAMPLES,
                    description=wrap("Train CNNs on edge devices under a memory budget: the pipeline (DVC), "
                                     "its runs (MLflow), its servers and workers (Prefect)."))
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run(sub)
    add_status(sub)
    add_compare(sub)
    add_report(sub)
    add_export(sub)
    add_plan(sub)
    for name, (text, _) in FORWARDED.items():   # listed here; their own parsers read their flags
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in FORWARDED:
        return FORWARDED[argv[0]][1](argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:   # UsageError, PresetError, and the library's (a tracking store it cannot open)
        print(f"edgeflux {args.command}: error: {exc}", file=sys.stderr)
        return 2
