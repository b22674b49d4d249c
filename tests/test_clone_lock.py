"""One flow run at a time in a clone: a second one waits for the first, and a killed one leaves no lock."""
import logging
import subprocess
import sys
from pathlib import Path

from edgeflux.environ import venv_env
from pipeline.sync import clone_lock

REPO = Path(__file__).resolve().parents[1]
SECOND_FLOW = """
from pipeline.sync import clone_lock
with clone_lock("retrain_flow"):
    print("retrain_flow holds the clone", flush=True)
    input()   # holds it until told (stdin) or killed
"""


def start_second_flow(clone: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SECOND_FLOW], cwd=clone, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=venv_env({"PYTHONPATH": str(REPO)}))


def read_until(proc: subprocess.Popen, *texts: str) -> str:
    """The process's output up to the first line holding one of ``texts`` (all of it if the process ends first)."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if any(t in line for t in texts):
            break
    return "".join(seen)


def test_a_second_flow_waits_for_the_clone_and_a_killed_one_leaves_no_lock(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    with clone_lock("device_flow"):
        second = start_second_flow(tmp_path)
        out = read_until(second, "waiting for the clone", "holds the clone")
        assert "waiting for the clone: device_flow" in out and "holds the clone" not in out, out
        assert second.poll() is None
    # the first run ended: the second gets the clone
    assert "retrain_flow holds the clone" in read_until(second, "holds the clone")
    second.kill()   # killed while holding it: the kernel releases the lock with the process
    second.wait(timeout=30)
    with caplog.at_level(logging.WARNING, logger="pipeline.sync"), clone_lock("device_flow"):
        pass
    assert "waiting" not in caplog.text
