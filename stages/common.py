"""What every stage script shares: logging, its params section, and clean errors for users."""
from __future__ import annotations

import argparse
import csv
import logging
import resource
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from rich.logging import RichHandler

from edgeflux.artifacts import CorruptFileError
from edgeflux.config import Params, ParamsError, load_params
from edgeflux.data import DataParamsError, DatasetNotFoundError, PreparedDataError
from edgeflux.memory import BudgetTooSmallError
from edgeflux.neuroflux.profile import PoorFitError

# Errors that are the user's to fix: shown as one message, no traceback.
USER_ERRORS = (ParamsError, DatasetNotFoundError, DataParamsError, PreparedDataError, BudgetTooSmallError,
               PoorFitError, CorruptFileError, FileNotFoundError)


def stage_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", default="params.yaml", help="the params file to read (default: params.yaml)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages too")
    return parser


def run_stage(main: Callable[[argparse.Namespace, Params], None], parser: argparse.ArgumentParser,
              resumes: bool = False) -> None:
    """Run a stage's main with its params, turning user errors and interrupts into one line and an exit code.

    resumes: the stage checkpoints its training, so an interrupted run continues where it stopped (the
    message says so only then: the other stages start over, and are short)."""
    args = parser.parse_args()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s",
                        handlers=[RichHandler(show_path=False, rich_tracebacks=True)])
    for noisy in ("alembic", "mlflow", "urllib3", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        main(args, load_params(args.params))
    except USER_ERRORS as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        again = "to resume from its last checkpoint" if resumes else "to run it again (it keeps no checkpoint)"
        print(f"\ninterrupted ({signal.Signals(signum).name}): run the stage again (dvc repro) {again}", file=sys.stderr)
        sys.exit(128 + signum)


class Interrupted(KeyboardInterrupt):
    """A termination signal, raised in the main thread like Ctrl-C so that the stage unwinds: its
    MLflow run is closed as KILLED, and the rerun resumes from checkpoints that are written atomically."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum: int, frame) -> None:
    raise Interrupted(signum)


def write_history_csv(path: Path, history: list[dict]) -> None:
    """The accuracy-vs-time rows DVC plots (dvc.yaml's plots: x time_s, y val_acc)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "epoch", "time_s", "train_loss", "val_acc"])
        writer.writeheader()
        writer.writerows(history)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
