"""Processes that never outlive the one that started them.

Two directions, one mechanism (Linux's parent-death signal, with a polling fallback where it is missing):

* this process dies with its parent: ``die_with_parent()``, for a stage that dvc started, so that a killed
  dvc leaves no orphan running beside its rerun;
* a child dies with this process and is stopped as a whole: ``start_group()`` runs a command in its own
  process group (the children it starts, uvicorn under mlflow, go with it) that gets SIGTERM when the
  starting thread dies; ``stop_group()`` sends SIGTERM to the group, then SIGKILL after a grace period.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import psutil

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# libc's, among the interpreter's own symbols; resolved once, since a preexec_fn should do little.
_prctl = getattr(ctypes.CDLL(None), "prctl", None) if sys.platform.startswith("linux") else None
# dvc runs a stage as `$SHELL -c cmd` (/bin/sh where SHELL is unset); these may stay in between.
SHELLS = {"sh", "dash", "bash", "zsh", "ksh", "busybox"}


def set_pdeathsig(signum: int) -> bool:
    """prctl(PR_SET_PDEATHSIG); False where there is none (macOS). The kernel sends it when the parent
    *thread* that forked this process exits: dvc starts a stage from its main thread, so that is when dvc
    itself exits, and a service must be started from a thread that outlives it."""
    return _prctl is not None and _prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0


def _sigterm_with_parent() -> None:
    """A child's preexec_fn, after fork and before exec: it only calls the prctl resolved beforehand."""
    set_pdeathsig(signal.SIGTERM)


def die_with_parent(signum: int = signal.SIGTERM) -> bool:
    """Have ``signum`` sent to this process when its parent dies, even by SIGKILL. False when the parent
    died before the signal was armed: then nothing will send it, and the caller should stop now."""
    ppid = os.getppid()
    if not set_pdeathsig(signum):
        _watch(lambda: os.getppid() == ppid, signum, "watch-parent")   # reparented: the parent is gone
    if os.getppid() != ppid:
        return False
    if (launcher := _behind_shell(ppid)) is not None:
        _watch(lambda: _running(launcher), signum, "watch-launcher")
    return True


def _behind_shell(ppid: int) -> psutil.Process | None:
    """The shell's parent when this process's parent is a shell: dash, unlike bash, does not replace itself
    with the command, so the launcher's death orphans the shell and no parent-death signal reaches us."""
    try:
        parent = psutil.Process(ppid)
        return parent.parent() if parent.name() in SHELLS else None
    except psutil.Error:
        return None


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE   # is_running: pid not reused
    except psutil.NoSuchProcess:
        return False


def _watch(alive: Callable[[], bool], signum: int, name: str) -> None:
    """Send ``signum`` to this process, from a daemon thread, once ``alive()`` turns false (polled each second)."""
    def watch() -> None:
        while alive():
            time.sleep(1)
        os.kill(os.getpid(), signum)

    threading.Thread(target=watch, name=name, daemon=True).start()


def start_group(command: list[str], **popen_kwargs) -> subprocess.Popen:
    """Popen(command) as the leader of a new process group that gets SIGTERM when the calling thread dies."""
    # preexec_fn, unsafe beside threads in general: _sigterm_with_parent only calls an already resolved prctl.
    return subprocess.Popen(command, start_new_session=True, preexec_fn=_sigterm_with_parent,  # noqa: PLW1509
                            **popen_kwargs)


def run_group(command: list[str] | str, timeout_s: float, **popen_kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output=True, text=True) in a process group of its own. On a timeout the whole
    group is stopped before TimeoutExpired is raised: subprocess.run kills only its child, and a shell's or
    dvc's children would go on (holding DVC's lock, say)."""
    process = start_group(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kwargs)
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(process, grace_s=10.0)
        raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    """Whether a live process is in the group. Zombies do not count: they hold no port and no memory, and one
    that no init reaps (a container whose PID 1 does not) would make every stop wait out its grace period."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):   # gone meanwhile
            continue
    return False


def wait_group_gone(process: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        process.poll()   # reap the leader: it is our child, no init reaps it
        if not group_alive(process.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def stop_group(process: subprocess.Popen, grace_s: float = 10.0, name: str | None = None) -> None:
    """SIGTERM to the leader's group, SIGKILL to what is left of it after ``grace_s``; reaps the leader."""
    signal_group(process.pid, signal.SIGTERM)
    if not wait_group_gone(process, grace_s):
        log.warning("%s ignored SIGTERM for %g s: killing it", name or f"process group {process.pid}", grace_s)
        kill_group(process)
    process.wait()


def kill_group(process: subprocess.Popen, wait_s: float = 5.0) -> None:
    """SIGKILL the whole group at once, as a power cut or the OOM killer would, and reap the leader."""
    signal_group(process.pid, signal.SIGKILL)
    wait_group_gone(process, wait_s)   # SIGKILL is not instant either: stopped means stopped
    process.wait()
