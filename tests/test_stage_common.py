"""What every stage script shares (stages/common.py): one line and an exit code for an interrupt."""
import ast
import signal
import sys
from pathlib import Path

import pytest

from stages.common import run_stage, stage_parser

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("resumes", [True, False])
def test_an_interrupted_stage_says_whether_its_rerun_resumes(monkeypatch, capsys, resumes):
    """A stage without checkpoints must not promise to resume from one: its rerun starts over."""
    monkeypatch.setattr(sys, "argv", ["stage", "--params", str(REPO / "params.yaml")])
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
