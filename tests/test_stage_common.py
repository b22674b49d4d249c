"""What every stage script shares (stages/common.py): one line and an exit code for an interrupt, and no
stage left running beside its rerun (it dies with its parent, and two of it cannot run at once)."""
import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from stages.common import run_stage, stage_parser

REPO = Path(__file__).resolve().parents[1]
STARTUP_S = 120  # a stage imports torch: slow on a busy machine
DEADLINE_S = 20  # generous: the stage needs a second or so once signalled

# A stage that marks its start (started-<pid>) and then waits; {setup} runs before run_stage.
WAITING_STAGE = """
import os, time
from pathlib import Path
import stages.common as common
{setup}

def main(args, params):
    Path(f"started-{{os.getpid()}}").write_text("")
    time.sleep(600)

if __name__ == "__main__":
    common.run_stage(main, common.stage_parser("a stage that waits"))
"""
# Starts the command in argv and prints its pid: the parent the test kills.
LAUNCHER = ("import subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL); "
            "print(p.pid, flush=True); p.wait()")


@pytest.mark.parametrize("resumes", [True, False])
def test_an_interrupted_stage_says_whether_its_rerun_resumes(monkeypatch, capsys, tmp_path, resumes):
    """A stage without checkpoints must not promise to resume from one: its rerun starts over."""
    monkeypatch.setattr(sys, "argv", ["stage", "--params", str(REPO / "params.yaml")])
    monkeypatch.chdir(tmp_path)  # the stage's lock file
    before = signal.getsignal(signal.SIGTERM)

    def main(args, params):
        raise KeyboardInterrupt

    try:
        with pytest.raises(SystemExit) as stopped:
            run_stage(main, stage_parser("a stage"), resumes=resumes)
    finally:
        signal.signal(signal.SIGTERM, before)
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 128 + signal.SIGINT and "\n" not in err
    assert ("resume from its last checkpoint" in err) == resumes
    assert ("keeps no checkpoint" in err) == (not resumes)


def test_the_stages_that_checkpoint_are_the_ones_that_say_they_resume():
    """resumes=True exactly where the stage writes training checkpoints (a CHECKPOINT(S) path)."""
    for path in sorted((REPO / "stages").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets
                 if isinstance(t, ast.Name)} | {e.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                                                for t in node.targets if isinstance(t, ast.Tuple)
                                                for e in t.elts if isinstance(e, ast.Name)}
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                 and getattr(node.func, "id", None) == "run_stage"]
        if not calls:
            continue
        resumes = any(k.arg == "resumes" and getattr(k.value, "value", False) is True for k in calls[0].keywords)
        assert resumes == bool(names & {"CHECKPOINT", "CHECKPOINTS"}), path.name


def _stage_command(tmp_path: Path, setup: str = "") -> list[str]:
    (tmp_path / "waiting_stage.py").write_text(WAITING_STAGE.format(setup=setup))
    return [sys.executable, "waiting_stage.py", "--params", str(REPO / "params.yaml")]


def _popen(cmd: list[str], tmp_path: Path, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, **kwargs)


def _started(tmp_path: Path, pid: int, running) -> bool:
    """Wait until the stage reaches its main (True) or exits (False)."""
    end = time.monotonic() + STARTUP_S
    while not (tmp_path / f"started-{pid}").exists():
        if not running():
            return False
        assert time.monotonic() < end, "the stage neither reached its main nor exited"
        time.sleep(0.1)
    return True


def _alive(proc: psutil.Process) -> bool:
    """A zombie has ended: it is not necessarily ours to reap."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone(proc: psutil.Process, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while _alive(proc):
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def _kill(*procs) -> None:
    """SIGKILL what is still running (psutil checks that a pid was not reused)."""
    for proc in procs:
        try:
            proc.kill()
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass


@pytest.mark.parametrize("watch", ["prctl", "polling", "shell"])
def test_a_stage_dies_with_the_process_that_started_it(tmp_path, watch):
    """SIGKILL the stage's parent (dvc): the stage gets SIGTERM and unwinds instead of running on beside a
    rerun. polling: the fallback where there is no prctl (macOS). shell: dvc starts the stage through
    `/bin/sh -c` where SHELL is unset, and a shell that does not exec its command stays in between."""
    no_prctl = "import edgeflux.process; edgeflux.process.set_pdeathsig = lambda signum: False"
    setup = no_prctl if watch == "polling" else ""
    stage_cmd = _stage_command(tmp_path, setup)
    if watch == "shell":   # `; true`: no shell can replace itself with the stage
        stage_cmd = ["/bin/sh", "-c", " ".join(stage_cmd) + "; true"]
    log = (tmp_path / "stage.err").open("w")
    parent = _popen([sys.executable, "-c", LAUNCHER, *stage_cmd], tmp_path,
                    stdout=subprocess.PIPE, stderr=log, text=True)
    stage = None
    try:
        stage_pid = int(parent.stdout.readline())
        if watch == "shell":
            shell = psutil.Process(stage_pid)
            while not shell.children():
                time.sleep(0.05)
            stage_pid = shell.children()[0].pid
        stage = psutil.Process(stage_pid)
        assert _started(tmp_path, stage_pid, lambda: _alive(stage)), "the stage exited before its main"
        parent.kill()
        parent.wait()
        assert _gone(stage, DEADLINE_S), "the stage ran on after its parent was killed"
        err = (tmp_path / "stage.err").read_text()
        assert "interrupted (SIGTERM)" in err, err
    finally:
        _kill(*(p for p in (parent, stage) if p is not None))
        parent.wait()
        parent.stdout.close()
        log.close()


@pytest.mark.slow   # three stage processes, one killed
def test_a_stage_refuses_to_run_while_another_process_runs_it(tmp_path):
    """A second instance exits 2 with one line naming the running one; once that is killed (SIGKILL: it
    cannot clean up), the stage runs again: the lock dies with its process."""
    cmd = _stage_command(tmp_path)
    first = _popen(cmd, tmp_path, stderr=subprocess.DEVNULL)
    second = third = None
    try:
        assert _started(tmp_path, first.pid, lambda: first.poll() is None), "the stage exited before its main"
        second = _popen(cmd, tmp_path, stderr=subprocess.PIPE, text=True)
        assert not _started(tmp_path, second.pid, lambda: second.poll() is None), "two instances ran at once"
        _, err = second.communicate()
        assert second.returncode == 2 and first.poll() is None
        assert err.strip() == (f"error: stage waiting_stage is already running (pid {first.pid}); "
                               f"wait for it or stop it (kill {first.pid})")
        first.kill()
        first.wait()
        third = _popen(cmd, tmp_path, stderr=subprocess.DEVNULL)
        assert _started(tmp_path, third.pid, lambda: third.poll() is None), "the lock outlived its holder"
    finally:
        for proc in (p for p in (first, second, third) if p is not None):
            _kill(proc)
            proc.wait()


def _run_stage_in_process(monkeypatch, tmp_path, main) -> int:
    monkeypatch.setattr(sys, "argv", ["stage", "--params", str(REPO / "params.yaml")])
    monkeypatch.chdir(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stopped:
            run_stage(main, stage_parser("a stage"))
    finally:
        signal.signal(signal.SIGTERM, before)
    return stopped.value.code


def test_a_full_disk_is_one_line_and_leaves_the_previous_file(monkeypatch, capsys, tmp_path):
    """The write goes to a real ENOSPC (/dev/full behind the temporary name): one line naming the file and
    the fix, the previous output untouched, no half-written temporary left behind."""
    from edgeflux.artifacts import save_checked

    out = tmp_path / "models" / "model.pt"
    out.parent.mkdir()
    out.write_bytes(b"the last good model")
    (out.parent / "model.pt.tmp").symlink_to("/dev/full")

    def main(args, params):
        save_checked(out, {"w": torch.zeros(100_000)})

    code = _run_stage_in_process(monkeypatch, tmp_path, main)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err
    assert f"could not write {out}" in err and "No space left on device" in err and "disk is full" in err
    assert out.read_bytes() == b"the last good model" and not os.path.lexists(out.parent / "model.pt.tmp")


def _read_only_dir(tmp_path: Path) -> Path:
    """A directory this process cannot create files in: chmod 555, or (as root, who ignores that) sysfs."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    for where in (ro, Path("/sys")):
        try:
            (where / "probe").open("w").close()
        except OSError:
            return where
    pytest.skip("no read-only directory to write into")


def test_a_read_only_directory_is_one_line(monkeypatch, capsys, tmp_path):
    from edgeflux.artifacts import write_json

    target = _read_only_dir(tmp_path) / "cache" / "manifest.json"

    def main(args, params):
        write_json(target, {"a": 1})

    code = _run_stage_in_process(monkeypatch, tmp_path, main)
    err = capsys.readouterr().err.strip()
    (tmp_path / "ro").chmod(0o755)
    assert code == 2 and "\n" not in err and "Traceback" not in err
    assert "could not write" in err and "make it writable" in err


def test_a_missing_gpu_is_one_line(monkeypatch, capsys, tmp_path):
    from edgeflux.train import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code = _run_stage_in_process(monkeypatch, tmp_path, lambda args, params: resolve_device("cuda"))
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "set device: cpu (or auto)" in err


def test_run_group_stops_a_shells_children_on_a_timeout(tmp_path):
    """What the end-to-end tests run dvc with: subprocess.run's timeout would kill the shell and leave its
    child (dvc, holding the repository's lock) running."""
    from edgeflux.process import run_group
    with pytest.raises(subprocess.TimeoutExpired):
        run_group("sleep 300 & echo $! > child; wait", 2, shell=True, cwd=tmp_path)
    child = int((tmp_path / "child").read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    done = run_group([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"], 60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
