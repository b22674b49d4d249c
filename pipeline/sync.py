"""Moving a clone's code and artifacts: git for code, dvc.lock and small outputs; the DVC remote for the rest.

The flows' tasks for what travels between the cloud and the devices (docs/orchestration.md, "What
travels"): which outputs a stage owns and where each is stored (`stage_outputs`, `split_by_store`), `dvc
push`/`dvc pull` with the bytes they move, `git pull` that keeps this clone's own dvc.lock entries, and
`git publish` to `main` (the cloud) or `devices/<id>` (a device).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from edgeflux.environ import offline_env

os.environ.update(offline_env())   # before prefect reads its settings: no telemetry, no heartbeat traceback
from prefect import get_run_logger, task  # noqa: E402
from prefect.exceptions import MissingContextError  # noqa: E402

# --- commands ----------------------------------------------------------------------------------------

class CommandError(RuntimeError):
    """A git or dvc command failed; the message ends with its output's last lines."""


def command(args: list[str], env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip())[-3000:]
        raise CommandError(f"`{' '.join(args)}` failed ({proc.returncode}):\n{tail}")
    return proc


def _git_identity() -> dict[str, str]:
    """A commit author for machines without one configured (a worker's service account)."""
    if command(["git", "config", "user.email"], check=False).stdout.strip():
        return {}
    who = f"edgeflux@{socket.gethostname()}"
    return {"GIT_AUTHOR_NAME": "edgeflux", "GIT_AUTHOR_EMAIL": who,
            "GIT_COMMITTER_NAME": "edgeflux", "GIT_COMMITTER_EMAIL": who}


def _logger():
    """The flow run's logger (its lines reach the Prefect UI); this module's outside a run."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


# --- one flow at a time in a clone ----------------------------------------------------------------------

CLONE_LOCK = Path(".edgeflux/flow.lock")


@contextmanager
def clone_lock(flow_name: str) -> Iterator[None]:
    """Hold this clone (the working directory) for one flow run; another flow run waits here until it ends.

    A clone's git index, dvc.lock and outputs are one working copy: a scheduled retrain_flow starting while
    a device_flow pulls or trains would fail on git's or DVC's own locks, or worse, train on half-pulled
    files. A worker started with Prefect's defaults runs several flow runs at once, so the flows hold the
    clone themselves (fcntl.flock: released by the kernel when the run's process dies, so a killed run
    leaves no stale lock)."""
    CLONE_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with CLONE_LOCK.open("a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            _logger().warning("waiting for the clone: %s is running in %s", f.read().strip() or "another flow",
                                     Path.cwd())
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"{flow_name} (pid {os.getpid()})\n")
        f.flush()
        yield


# --- what a stage owns ---------------------------------------------------------------------------------

def _lock() -> dict:
    path = Path("dvc.lock")
    if not path.exists():
        return {}
    return yaml.safe_load(path.read_text()) or {}


def stage_group(entry: str) -> str:
    """dvc.lock names a foreach item `finetune@ft_all`; dvc.yaml has the group `finetune`."""
    return entry.split("@", 1)[0]


def stage_outputs(stages, lock: dict | None = None) -> list[str]:
    """Every output path of these stages as dvc.lock records them (foreach items resolved)."""
    lock = _lock() if lock is None else lock
    return [out["path"] for name, entry in lock.get("stages", {}).items() if stage_group(name) in set(stages)
            for out in entry.get("outs", [])]


def split_by_store(paths: list[str]) -> tuple[list[str], list[str]]:
    """(in DVC's cache: git ignores them, files tracked by git: the uncached metrics, reports, plots)."""
    if not paths:
        return [], []
    ignored = set(command(["git", "check-ignore", *paths], check=False).stdout.split())
    return [p for p in paths if p in ignored], [p for p in paths if p not in ignored]


def _transfer_status(targets: list[str]) -> dict[str, str]:
    """`dvc status --cloud` per file: new (here, not in the remote), deleted (in the remote, not here), ..."""
    out = command(["dvc", "status", "--cloud", "--json", *targets]).stdout
    return json.loads(out or "{}")


def _size(paths) -> int:
    return sum(Path(p).stat().st_size for p in paths if Path(p).is_file())


@task(retries=2, retry_delay_seconds=10, task_run_name="dvc push")
def dvc_push(targets: list[str]) -> int:
    """Upload these outputs' missing objects; returns the bytes sent."""
    if not targets:
        return 0
    new = [p for p, state in _transfer_status(targets).items() if state == "new"]
    command(["dvc", "push", *targets])
    sent = _size(new)
    get_run_logger().info("dvc push: %d files, %.1f MB (%s)", len(new), sent / 1e6, ", ".join(targets))
    return sent


@task(retries=2, retry_delay_seconds=10, task_run_name="dvc pull")
def dvc_pull(targets: list[str]) -> int:
    """Fetch and check out these stages' or files' outputs; returns the bytes received."""
    if not targets:
        return 0
    missing = [p for p, state in _transfer_status(targets).items() if state in ("deleted", "missing")]
    command(["dvc", "pull", *targets])
    got = _size(missing)
    get_run_logger().info("dvc pull: %d files, %.1f MB (%s)", len(missing), got / 1e6, ", ".join(targets))
    return got


@task(retries=2, retry_delay_seconds=10, task_run_name="git pull {branch}")
def git_pull(branch: str, own: list[str]) -> str:
    """Pull the code and the cloud's dvc.lock, keeping what this clone's own stages (``own``) recorded.

    dvc.lock is one file both sides write: upstream's entries for the other stages are taken, this clone's
    entries for its own stages kept, as are their uncached outputs (metrics, reports) and any params
    overrides, which are re-applied by the flow after the pull."""
    lock = _lock()
    keep_files = split_by_store(stage_outputs(own, lock))[1]
    kept = {p: Path(p).read_bytes() for p in keep_files if Path(p).is_file()}
    modified = command(["git", "diff", "--name-only", "HEAD"]).stdout.split()
    discard = [p for p in modified if p in {"dvc.lock", "params.yaml", *kept}]
    if discard:
        command(["git", "checkout", "HEAD", "--", *discard])
    command(["git", "pull", "--ff-only", "origin", branch])
    for path, data in kept.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
    merged = _lock() or {"schema": "2.0", "stages": {}}
    merged.setdefault("stages", {}).update({n: e for n, e in lock.get("stages", {}).items() if stage_group(n) in own})
    Path("dvc.lock").write_text(yaml.safe_dump(merged, sort_keys=False))
    head = command(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
    get_run_logger().info("git pull: at %s of origin/%s; kept this clone's lock entries for %s", head, branch,
                          ", ".join(own))
    return head


@task(retries=2, retry_delay_seconds=10, task_run_name="git push {ref}")
def git_publish(stages: list[str], ref: str, message: str, extra: list[str] = ()) -> str | None:
    """Commit dvc.lock, params.yaml and the stages' git-tracked outputs and push them to origin's ``ref``.

    ``ref`` "HEAD:main" moves the branch this clone is on (the cloud); "devices/<id>" writes a commit on top
    of HEAD without moving it (a device: its results sit beside main, never merged into it by a pull)."""
    paths = ["dvc.lock", "params.yaml", *split_by_store(stage_outputs(stages))[1], *extra]
    paths = [p for p in paths if Path(p).exists()]
    env = {**os.environ, **_git_identity()}
    if ref.startswith("HEAD:"):
        command(["git", "add", "--", *paths])
        if command(["git", "diff", "--cached", "--quiet"], check=False).returncode == 0:
            get_run_logger().info("git: nothing changed, nothing to push")
            return None
        command(["git", "commit", "-q", "-m", message], env=env)
        commit = command(["git", "rev-parse", "HEAD"]).stdout.strip()
        command(["git", "push", "-q", "origin", ref])
    else:
        index = Path(command(["git", "rev-parse", "--git-dir"]).stdout.strip()) / "edgeflux-publish-index"
        side = {**env, "GIT_INDEX_FILE": str(index)}
        command(["git", "read-tree", "HEAD"], env=side)
        command(["git", "add", "--", *paths], env=side)
        tree = command(["git", "write-tree"], env=side).stdout.strip()
        commit = command(["git", "commit-tree", tree, "-p", "HEAD", "-m", message], env=side).stdout.strip()
        command(["git", "push", "-q", "--force", "origin", f"{commit}:refs/heads/{ref}"])
    get_run_logger().info("git push: %s -> origin %s", commit[:10], ref)
    return commit
