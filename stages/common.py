"""What every stage script shares: logging, its params section, and clean errors for users."""
from __future__ import annotations

import argparse
import contextlib
import csv
import errno
import fcntl
import logging
import os
import resource
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from rich.logging import RichHandler

from edgeflux.artifacts import write_json
from edgeflux.colours import method_colour
from edgeflux.config import Params, load_params
from edgeflux.errors import UserError
from edgeflux.process import die_with_parent


class StageRunningError(UserError):
    """Another process runs the same stage: both would write its checkpoint and outputs."""


# What the machine refuses (a full disk, a read-only directory): one line naming the file, no traceback.
MACHINE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}

# One lock file per stage, relative to the working directory (dvc runs stages in the repository root).
LOCKS = Path(".edgeflux/locks")
METRICS_DIR, DETAILS_DIR = Path("metrics"), Path("details")   # the headline (DVC metrics), every figure (DVC outs)


def stage_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", default="params.yaml", help="the params file to read (default: params.yaml)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages too")
    return parser


def run_stage(main: Callable[[argparse.Namespace, Params], None], parser: argparse.ArgumentParser,
              resumes: bool = False, name: str | None = None) -> None:
    """Run a stage's main with its params, turning user errors and interrupts into one line and an exit code.

    The stage dies with the process that started it (dvc), and refuses to start while another process
    runs it (name: the stage's lock, by default its script's name), so that no orphan and rerun write
    the same checkpoint and outputs.

    resumes: the stage checkpoints its training, so an interrupted run continues where it stopped (the
    message says so only then: the other stages start over, and are short)."""
    args = parser.parse_args()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s",
                        handlers=[RichHandler(show_path=False, rich_tracebacks=True)])
    for noisy in ("alembic", "mlflow", "urllib3", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        # Dies with dvc, even one killed by SIGKILL, so that no orphan runs on beside dvc's rerun; SIGTERM
        # unwinds it as Interrupted.
        if not die_with_parent(signal.SIGTERM):   # dvc died first: nothing would send the signal
            raise Interrupted(signal.SIGTERM)
        with _exclusive(name or Path(main.__code__.co_filename).stem):
            params = load_params(args.params)
            _set_threads(params.device.threads)
            main(args, params)
    except (UserError, FileNotFoundError) as exc:   # the user's to fix; a missing file is too, though not ours
        print(f"\nerror: {exc}", file=sys.stderr)
        sys.exit(2)
    except OSError as exc:
        if exc.errno not in MACHINE_ERRNOS:
            raise
        print(f"\nerror: {_machine_error(exc)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        again = "to resume from its last checkpoint" if resumes else "to run it again (it keeps no checkpoint)"
        print(f"\ninterrupted ({signal.Signals(signum).name}): run the stage again (dvc repro) {again}", file=sys.stderr)
        sys.exit(128 + signum)


def _set_threads(threads: int | None) -> None:
    """device.threads: torch's intra-op threads for this stage (None keeps torch's default, one per core)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def _machine_error(exc: OSError) -> str:
    """A refused write as one line: what, where, and the fix."""
    where = exc.filename or "a file"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "the disk is full: free space and rerun the stage"
    else:
        fix = "the directory is read-only or not yours: make it writable (or run from a writable clone) and rerun"
    return f"could not write {where} ({exc.strerror}): {fix}"


class Interrupted(KeyboardInterrupt):
    """A termination signal, raised in the main thread like Ctrl-C so that the stage unwinds: its
    MLflow run is closed as KILLED, and the rerun resumes from checkpoints that are written atomically."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum: int, frame) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def _exclusive(stage: str) -> Iterator[None]:
    """Hold the stage's lock, with this pid written in it, or raise StageRunningError. The OS releases
    a flock when its process dies, so a killed stage leaves no stale lock."""
    LOCKS.mkdir(parents=True, exist_ok=True)
    fd = os.open(LOCKS / f"{stage}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder(fd)
            raise StageRunningError(f"stage {stage} is already running (pid {pid}); "
                                    f"wait for it or stop it (kill {pid})") from None
        mine = f"{os.getpid()}\n".encode()
        os.pwrite(fd, mine, 0)  # before truncating: a reader sees one whole pid first, never none
        os.ftruncate(fd, len(mine))
        yield
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    """The pid the lock's holder wrote, waiting briefly for one that has just taken it."""
    for _ in range(20):
        if words := os.pread(fd, 32, 0).split():
            return words[0].decode()
        time.sleep(0.05)
    return "unknown"


CURVE_COLUMNS = ("step", "epoch", "time_s", "cpu_s", "train_loss", "val_acc")


def write_history_csv(path: Path, history: list[dict], method: str) -> None:
    """The accuracy-vs-time rows DVC plots (dvc.yaml's plots: x time_s or cpu_s, y val_acc), each with the label
    of the method that trained (the report's row) and its colour (edgeflux.colours): the plots' legend names
    methods, not files, and a method is drawn in the colour every other figure gives it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*CURVE_COLUMNS, "method", "colour"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows({**row, "method": method, "colour": method_colour(method)} for row in history)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# A training stage's headline: its detail names -> the names every stage shares (MiB, not bytes: a
# column of `dvc exp show` is read by a person). Accuracy is on the stage's own test split.
TRAINING_HEADLINE = {"test_acc": "test_acc", "train_time_s": "train_time_s", "train_cpu_s": "train_cpu_s",
                     "peak_mem_bytes": "peak_mib", "budget_bytes": "budget_mib", "batch_size": "batch",
                     "trainable_params": "trainable_params", "params": "params"}


def headline(detail: Mapping[str, Any], names: Mapping[str, str] = TRAINING_HEADLINE) -> dict[str, float]:
    """The figures of `detail` that `names` lists, renamed; bytes become MiB (one decimal)."""
    out = {}
    for key, name in names.items():
        value = detail.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = round(value / 2**20, 1) if key.endswith("bytes") else value
    return out


def write_metrics(name: str, detail: Mapping[str, Any], run, names: Mapping[str, str] = TRAINING_HEADLINE,
                  head: Mapping[str, Any] | None = None) -> list[Path]:
    """Write a stage's figures twice: metrics/<name>.json, the headline (a few figures under names every
    stage shares: what `dvc metrics show` and `dvc exp show` list, and what the stage's MLflow run and its
    pipeline's parent run carry) and details/<name>.json (everything). Returns both paths.

    head: the headline when it is not one flat selection of `detail` (several models in one stage).
    """
    head = dict(head) if head is not None else headline(detail, names)
    paths = [METRICS_DIR / f"{name}.json", DETAILS_DIR / f"{name}.json"]
    write_json(paths[0], head)
    write_json(paths[1], detail)
    run.log_metrics({k: v for k, v in detail.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    run.log_headline(head)
    return paths
