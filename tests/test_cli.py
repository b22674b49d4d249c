"""The `edgeflux` command: help for every flag, `run` (dry, for real, as a DVC experiment, bad input refused in
one line), `status` (DVC + MLflow), `compare` against a real MLflow server, `report --open`, and the forwarded
server/worker commands.

The DVC tests use a tiny project: a git + DVC repo holding the real params.yaml and presets/ (so edgeflux's own
validation applies) and stages that only write what they read (a param, the environment).
"""
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline import cli
from edgeflux.presets import set_params
from pipeline.sandbox import GIT_IDENTITY, git_env, sh

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BUDGET = yaml.safe_load((REPO / "params.yaml").read_text())["device"]["budget"]   # the default, as params.yaml has it

# Each stage writes what it ran with: the param it reads, the device's budget and threads, and the environment
# the CLI gave it.
STAGE = ("python -c \"import os, yaml; p = yaml.safe_load(open('params.yaml')); e = os.environ.get; "
         "open('target.txt', 'w').write(' '.join(map(str, [p['report']['target_acc'], p['device']['budget'], "
         "e('EDGEFLUX_PRESET'), p['device']['threads'], e('DVC_EXP_NAME')])))\"")
DVC_YAML = {"stages": {
    "target": {"cmd": STAGE, "params": ["report.target_acc", "device.budget", "device.threads"], "outs": ["target.txt"]},
    "other": {"cmd": "echo other > other.txt", "outs": ["other.txt"]},
    # runs until the test creates `go`: a stage that is running while `status` looks
    "wait": {"cmd": "while [ ! -e go ]; do sleep 0.1; done; echo > wait.txt", "outs": ["wait.txt"]},
    "fail": {"cmd": "exit 3"},
}}


@pytest.fixture
def project(tmp_path, monkeypatch):
    """params.yaml and presets/ as in the repository; the working directory."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "params.yaml").write_text((REPO / "params.yaml").read_text())
    sh(f"cp -r {REPO / 'presets'} {root}", root)
    monkeypatch.chdir(root)
    return root


@pytest.fixture
def dvc_project(project, monkeypatch):
    """The project as a git + DVC repo with DVC_YAML's stages, committed (DVC experiments start from a commit)."""
    (project / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, sort_keys=False))
    (project / ".gitignore").write_text("go\nmlflow.db\nmlruns/\n")
    sh("git init -q -b main && dvc init -q && git add -A && git commit -qm init", project, env=git_env())
    for key, value in GIT_IDENTITY.items():   # `dvc exp run` commits the experiment
        monkeypatch.setenv(key, value)
    return project


@contextlib.contextmanager
def repro_holding_locks(project: Path):
    """`dvc repro wait` running, its locks in .dvc/tmp/rwlock, until the block ends (then it finishes)."""
    repro = subprocess.Popen([str(Path(sys.executable).parent / "dvc"), "repro", "wait"], cwd=project,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        rwlock = project / ".dvc/tmp/rwlock"
        deadline = time.monotonic() + 60
        while not (rwlock.exists() and "wait.txt" in rwlock.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        yield repro
    finally:
        (project / "go").touch()
        assert repro.wait(timeout=60) == 0


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        rc = cli.main(list(argv))
    except SystemExit as exc:   # argparse (--help, a bad argument), or sys.exit("message") as python would end
        rc = exc.code
    out, err = capsys.readouterr()
    if isinstance(rc, str):
        rc, err = 1, err + rc + "\n"
    return rc, out, err


# --- help ---------------------------------------------------------------------------------------------

FORWARDED_FLAGS = {   # the wrapped tools' own flags, which their parsers define
    "servers": ["--dir", "--host", "--public-host", "--prefect-port", "--mlflow-port", "--allowed-hosts", "--init-auth", "--deploy",
                "--follow"],
    "worker": ["--pool", "--device-id", "--clone", "--api-url", "--tracking-uri", "--poll-s"],
    "serve-cloud": ["--model", "--port", "--host", "--ready-timeout-s", "--log"],
}


def test_help_of_the_command_and_of_every_subcommand_names_every_flag(project, capsys):
    rc, top, _ = run_cli(capsys, "--help")
    assert rc == 0 and "examples:" in top
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == {"run", "status", "compare", "report", "export", "plan", *FORWARDED_FLAGS}
    for name, sub in commands.items():
        assert f"\n    {name}" in top, name
        rc, out, _ = run_cli(capsys, name, "--help")
        assert rc == 0, name
        assert out.startswith(f"usage: edgeflux {name} ") and "examples:\n  edgeflux " + name in out, name
        flags = FORWARDED_FLAGS.get(name) or [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
        for action in [] if name in FORWARDED_FLAGS else sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest}: no help"
        missing = [flag for flag in flags if flag not in out]
        assert not missing, f"edgeflux {name} --help does not mention {missing}"
    assert "jetson-nano, jetson-orin, laptop, pi4" in run_cli(capsys, "run", "--help")[1].replace("\n", " ")


# --- run ----------------------------------------------------------------------------------------------

def test_dry_run_prints_the_overrides_and_the_dvc_command_and_changes_nothing(project, capsys):
    before = (project / "params.yaml").read_text()
    rc, out, err = run_cli(capsys, "run", "--dry-run", "--preset", "pi4", "--set", "train_bp.epochs=1",
                           "--budget", "200MB")
    assert rc == 0, err
    assert "$ dvc repro\n" in out and "env: EDGEFLUX_PRESET=pi4" in out
    lines = {ln.split("=")[0].strip(): ln for ln in out.splitlines() if ln.startswith("  ")}
    assert '= 1   (--set)' in lines["train_bp.epochs"] and '"cpu"   (preset pi4)' in lines["device.device"]
    assert '= 4   (preset pi4)' in lines["device.threads"]
    # --budget wins over the preset's 256MB: one key, which every method inherits
    assert '"200MB"   (--budget)' in lines[cli.BUDGET_KEY] and "256MB" not in out

    rc, out, _ = run_cli(capsys, "run", "--dry-run", "--exp", "x", "--preset", "pi4", "--set", "train_bp.epochs=1",
                         "--budget", "200MB", "--set", "orchestration.retrain_cron=0 4 * * *", "train_bp")
    assert rc == 0
    command = next(ln for ln in out.splitlines() if ln.startswith("$ "))
    assert command.startswith("$ dvc exp run -n x -S device.device=cpu ") and command.endswith(" train_bp")
    for arg in ["-S train_bp.epochs=1", "-S device.budget=200MB", "-S neuroflux.cache.storage=float16",
                """-S 'orchestration.retrain_cron="0 4 * * *"'"""]:   # quoted for Hydra (DVC's -S grammar)
        assert arg in command, arg
    assert "256MB" not in command and (project / "params.yaml").read_text() == before


@pytest.mark.parametrize("argv, expected", [
    (["--preset", "pi5"], ["no preset 'pi5'", "jetson-nano, jetson-orin, laptop, pi4"]),
    (["--set", "train_bp.budgt=1MB"], ["train_bp.budgt", "did you mean budget?", "allowed keys in train_bp: ",
                                       "max_batch", "epochs"]),
    (["--set", "train_bp.budget=lots"], ["train_bp.budget = 'lots'", "memory size"]),
    (["--set", "train_bp.epochs=two"], ["train_bp.epochs = 'two'"]),
    (["--budget", "lots"], ["--budget", "cannot read 'lots' as a memory size"]),
    (["--set", "epochs"], ["expected KEY=VALUE"]),
])
def test_bad_input_is_one_line_naming_what_is_allowed_and_runs_nothing(project, capsys, argv, expected):
    before = (project / "params.yaml").read_text()
    rc, out, err = run_cli(capsys, "run", *argv)   # no --dry-run: nothing may run all the same
    assert rc == 2 and "$ dvc" not in out
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("edgeflux run: error: ") and all(text in err for text in expected), err
    assert (project / "params.yaml").read_text() == before


def test_a_bad_param_is_answered_in_this_process_without_importing_torch(project):
    """The params schema loads without torch: `edgeflux run` checks params itself, at once, even on a Pi."""
    code = ("import sys; from pipeline.cli import main; rc = main(['run', '--dry-run', '--set', 'train_bp.epochs=two']); "
            "print(rc, sorted(m for m in ('torch', 'mlflow', 'prefect') if m in sys.modules))")
    out = subprocess.run([PYTHON, "-c", code], cwd=project, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.split("\n")[0] == "2 []", out.stdout + out.stderr
    assert out.stderr.strip() == "edgeflux run: error: params.yaml + overrides: train_bp.epochs = 'two': Input should be a valid integer"


def test_run_writes_params_keeping_comments_runs_the_stage_with_the_preset_env(dvc_project):
    path = dvc_project / "params.yaml"
    before = path.read_text()
    cmd = [PYTHON, "-m", "pipeline.cli", "run", "--preset", "pi4", "--set", "report.target_acc=0.7", "target"]
    bad = subprocess.run(cmd[:-3] + ["--set", "report.target_acc=2"], check=False, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1   # one line
    assert "params.yaml + overrides: report.target_acc = 2: Input should be less than or equal to 1" in bad.stderr
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "$ dvc repro target\nRunning stage 'target'" in done.stdout   # DVC's output, streamed through
    assert (dvc_project / "target.txt").read_text() == "0.7 256MB pi4 4 None"   # the preset's budget and threads
    after = path.read_text()
    assert after.count("#") == before.count("#") and len(after.splitlines()) == len(before.splitlines())
    line = next(ln for ln in after.splitlines() if ln.strip().startswith("target_acc:"))
    assert line.split("#")[0].split() == ["target_acc:", "0.7"] and "# drawn on the accuracy-vs-time plot" in line
    assert yaml.safe_load(after)["device"]["max_batch"] == 64
    assert not (dvc_project / "other.txt").exists()   # the target only


def test_run_exits_with_the_tools_exit_code(dvc_project, capsys):
    direct = sh("dvc repro fail", dvc_project, check=False).returncode
    rc, out, _ = run_cli(capsys, "run", "fail")
    assert rc == direct != 0 and "$ dvc repro fail" in out


def test_exp_runs_a_dvc_experiment_with_the_overrides(dvc_project, capsys):
    rc, out, err = run_cli(capsys, "run", "--exp", "e1", "--budget", "200MB", "--set", "report.target_acc=0.55",
                           "target")
    assert rc == 0, err
    assert "$ dvc exp run -n e1 -S device.budget=200MB" in out
    # DVC set DVC_EXP_NAME for the stage: edgeflux.tracking tags the MLflow runs with it
    assert (dvc_project / "target.txt").read_text() == "0.55 200MB None None e1"   # no preset: params' threads
    before = (dvc_project / "params.yaml").read_text()
    rc, out, err = run_cli(capsys, "run", "--exp", "e2", "--temp", "--set", "report.target_acc=0.45", "target")
    assert rc == 0, err
    assert (dvc_project / "params.yaml").read_text() == before   # --temp: the workspace as it was
    shown = json.loads(sh("dvc exp show --json", dvc_project).stdout)
    exps = {rev["name"]: rev["data"]["params"]["params.yaml"]["data"]
            for baseline in shown for exp in baseline.get("experiments") or [] for rev in exp["revs"]}
    assert set(exps) == {"e1", "e2"}
    assert exps["e1"]["report"]["target_acc"] == 0.55 and exps["e2"]["report"]["target_acc"] == 0.45
    assert exps["e1"]["device"]["budget"] == "200MB"   # the one key every budgeted stage inherits


def test_an_unknown_stage_is_refused_before_params_change(dvc_project, capsys):
    before = (dvc_project / "params.yaml").read_text()
    rc, out, err = run_cli(capsys, "run", "--budget", "12MB", "monkeys")
    assert rc == 2 and "$ dvc" not in out and len(err.strip().splitlines()) == 1, err
    assert "no stage 'monkeys' in dvc.yaml; stages: target, other, wait, fail" in err
    assert (dvc_project / "params.yaml").read_text() == before


def test_after_a_run_of_some_stages_a_summary_they_make_stale_is_named_not_shown(dvc_project, capsys):
    stages = {**DVC_YAML["stages"], "report": {"cmd": "mkdir -p reports && cp target.txt reports/summary.md",
                                               "deps": ["target.txt"], "outs": ["reports/summary.md"]}}
    (dvc_project / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    rc, out, err = run_cli(capsys, "run", "--set", "report.target_acc=0.6", "report")   # target, then report
    assert rc == 0 and f"\n0.6 {BUDGET}" in out and "predates" not in out, err
    rc, out, err = run_cli(capsys, "run", "--set", "report.target_acc=0.7", "target")
    assert rc == 0, err
    assert "reports/summary.md predates this run of target (stale: report), so it is not shown; `edgeflux run " \
           "report` brings it up to date" in out and f"0.6 {BUDGET}" not in out
    rc, out, err = run_cli(capsys, "run", "report")
    assert rc == 0 and f"\n0.7 {BUDGET}" in out, err
    rc, out, err = run_cli(capsys, "run", "other")   # nothing the report reads changed: the summary is current
    assert rc == 0 and f"\n0.7 {BUDGET}" in out and "predates" not in out, err


def test_stage_names_are_the_ones_dvc_takes_with_matrix_instances_from_params():
    from pipeline.cli.run import stage_names
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    names = stage_names(yaml.safe_load((REPO / "dvc.yaml").read_text()), params)
    listed = sh("dvc stage list --name-only", REPO).stdout.split()
    assert set(listed) <= set(names) and set(names) - set(listed) == {"finetune"}   # the matrix's group name too
    assert [n for n in names if n.startswith("finetune@")] == [f"finetune@{m}" for m in params["finetune"]["methods"]]


def test_a_failed_run_leaves_params_as_it_found_them(dvc_project, capsys):
    before = (dvc_project / "params.yaml").read_text()
    rc, out, _ = run_cli(capsys, "run", "--set", "report.target_acc=0.5", "fail")
    assert rc != 0 and "params.yaml: restored as it was" in out
    assert (dvc_project / "params.yaml").read_text() == before


def test_run_leaves_params_alone_while_a_repro_holds_the_repository(dvc_project, capsys):
    """A running repro's stages read params.yaml and its dvc.lock records it: changing it then would record
    params the outputs were not made with."""
    before = (dvc_project / "params.yaml").read_text()
    with repro_holding_locks(dvc_project):
        rc, out, err = run_cli(capsys, "run", "--set", "report.target_acc=0.6", "target")
        assert rc == 2 and "$ dvc" not in out and len(err.strip().splitlines()) == 1, err
        assert re.search(r"dvc repro wait \(pid \d+\) is running in this repository: wait for it to end", err), err
        assert (dvc_project / "params.yaml").read_text() == before
    rc, out, err = run_cli(capsys, "run", "--set", "report.target_acc=0.6", "target")   # free again
    assert rc == 0 and (dvc_project / "target.txt").read_text().startswith("0.6 "), err


# --- status -------------------------------------------------------------------------------------------

def test_status_cached_stale_and_running_from_dvc_and_mlflow(dvc_project, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from edgeflux.tracking import EXPERIMENT, _process_tags

    sh("dvc repro target other", dvc_project)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rc, out, _ = run_cli(capsys, "status", "--json", "--tracking-uri", uri)
    report = json.loads(out)
    states = {row["stage"]: row for row in report["stages"]}
    assert rc == 0 and states["target"]["state"] == states["other"]["state"] == "up to date"
    assert states["wait"]["state"] == "never run" and report["mlflow"]["note"].startswith("no store yet")

    set_params({"report.target_acc": 0.6}, dvc_project / "params.yaml")
    client = MlflowClient(uri)   # a pipeline run whose stage `other` is running, in this very process
    experiment = client.create_experiment(EXPERIMENT)
    parent = client.create_run(experiment, run_name="pipeline p1", tags={"edgeflux.kind": "pipeline",
                                                                        "edgeflux.preset": "pi4"})
    client.create_run(experiment, run_name="other", tags={"edgeflux.kind": "stage", "edgeflux.stage": "other",
                                                          "mlflow.parentRunId": parent.info.run_id, **_process_tags()})
    rc, out, _ = run_cli(capsys, "status", "--json", "--tracking-uri", uri)
    report = json.loads(out)
    states = {row["stage"]: row for row in report["stages"]}
    assert states["target"]["state"] == "stale"
    assert states["target"]["changes"] == [{"what": "param", "name": "report.target_acc", "state": "modified"}]
    assert states["other"]["state"] == "running" and report["mlflow"]["running"][0]["alive"] is True
    assert report["mlflow"]["last_pipeline"]["name"] == "pipeline p1"
    assert report["mlflow"]["last_pipeline"]["preset"] == "pi4"

    rc, out, _ = run_cli(capsys, "status", "--tracking-uri", uri)   # the table
    assert rc == 0 and "modified params: report.target_acc" in out and "running: other since" in out
    assert "last pipeline run: pipeline p1 RUNNING" in out


def test_status_while_dvc_repro_holds_its_locks(dvc_project, capsys):
    with repro_holding_locks(dvc_project):
        rc, out, err = run_cli(capsys, "status", "--json", "--tracking-uri", "sqlite:////nonexistent/mlflow.db")
        report = json.loads(out)
        states = {row["stage"]: row["state"] for row in report["stages"]}
        assert rc == 0 and report["dvc_busy"] == ["wait"], err
        assert re.fullmatch(r"dvc repro wait \(pid \d+\)", report["dvc_lock_holder"])
        assert states == {"target": "never run", "other": "never run", "wait": "locked", "fail": "never run"}


# --- compare ------------------------------------------------------------------------------------------

RUNS = {   # pipeline id: (preset, DVC experiment, {stage: headline})
    "p1": ("pi4", None, {"train_bp": {"test_acc": 0.81, "peak_mib": 190.5, "train_cpu_s": 40.0, "batch": 16},
                         "finetune@mobiletl": {"test_acc": 0.74, "peak_mib": 120.0, "train_cpu_s": 12.5}}),
    "p2": ("laptop", "bigger", {"train_bp": {"test_acc": 0.86, "peak_mib": 250.0, "train_cpu_s": 25.0, "batch": 64},
                                "finetune@mobiletl": {"test_acc": 0.79, "peak_mib": 160.25, "train_cpu_s": 9.0}}),
}


@pytest.mark.parametrize("command", ["status", "compare"])
def test_an_mlflow_server_that_does_not_answer_is_one_line_naming_it(dvc_project, capsys, command):
    from edgeflux.service import free_port
    uri = f"http://127.0.0.1:{free_port()}"   # nothing listens there
    rc, out, err = run_cli(capsys, command, "--tracking-uri", uri)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"edgeflux {command}: error: cannot reach MLflow at {uri} (ConnectError"), err
    assert "edgeflux servers" in err


def test_compare_takes_finished_runs_unless_asked_and_status_names_the_last_finished(dvc_project, monkeypatch, capsys):
    """Two failed attempts after a good run: compare's window still holds the good run, and status shows the
    failed one as failed, beside the last one that finished."""
    from edgeflux.tracking import stage_run
    for pid, fails in (("good", False), ("bad-1", True), ("bad-2", True)):
        monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", pid)
        with contextlib.suppress(RuntimeError), stage_run("train_bp") as run:
            if fails:
                raise RuntimeError("a bad param")
            run.log_headline({"test_acc": 0.8})
        time.sleep(0.01)   # distinct start times
    capsys.readouterr()
    rc, out, err = run_cli(capsys, "compare", "--last", "2", "--json", "--no-plot")
    assert rc == 0, err
    assert [(r["status"], r["metrics"]) for r in json.loads(out)["runs"]] == [("FINISHED", {"train_bp.test_acc": 0.8})]
    rc, out, err = run_cli(capsys, "compare", "--last", "2", "--json", "--no-plot", "--include-failed")
    assert [r["status"] for r in json.loads(out)["runs"]] == ["FAILED", "FAILED"]
    rc, out, err = run_cli(capsys, "status", "--json")
    tracked = json.loads(out)["mlflow"]
    assert tracked["last_pipeline"]["status"] == "FAILED" and tracked["last_finished_pipeline"]["status"] == "FINISHED"
    rc, out, err = run_cli(capsys, "status")
    assert re.search(r"last pipeline run: [^()]* FAILED \(.*\) last finished run: [^()]* FINISHED", " ".join(out.split()))


def test_pipeline_runs_carry_their_params_and_compare_shows_what_differs(project, monkeypatch, capsys):
    """Each pipeline run's parent holds params.yaml (flattened, and the file) and the overrides `edgeflux run`
    applied; compare shows the budget, the params that differ, or the params asked for."""
    from mlflow.tracking import MlflowClient

    from edgeflux.tracking import EXPERIMENT, flatten, stage_run
    for pid, budget in (("p1", "64MB"), ("p2", "16MB")):
        set_params({"device.budget": budget}, project / "params.yaml")
        monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", pid)
        monkeypatch.setenv("EDGEFLUX_OVERRIDES", json.dumps({"device.budget": budget}))
        for stage in ("train_bp", "report"):   # two stages of one pipeline run: one parent, its params logged once
            with stage_run(stage) as run:
                run.log_headline({"test_acc": 0.8})
        time.sleep(0.01)   # distinct start times: newest first
    client = MlflowClient()
    parent = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id],
                                "tags.`edgeflux.pipeline_id` = 'p2'")[0]
    params = yaml.safe_load((project / "params.yaml").read_text())
    assert parent.data.params == {**{k: "null" if v is None else str(v) for k, v in flatten(params).items()},
                                  "edgeflux.overrides": '{"device.budget": "16MB"}'}
    assert [a.path for a in client.list_artifacts(parent.info.run_id)] == ["params.yaml"]
    capsys.readouterr()
    rc, out, err = run_cli(capsys, "compare", "--json", "--no-plot")
    data = json.loads(out)
    assert rc == 0 and [r["budget"] for r in data["runs"]] == ["16MB", "64MB"], err
    assert data["params"] == {"device.budget": ["16MB", "64MB"],
                              "edgeflux.overrides": ['{"device.budget": "16MB"}', '{"device.budget": "64MB"}']}
    rc, out, _ = run_cli(capsys, "compare", "--json", "--no-plot", "--params", "train_bp.l?")
    assert json.loads(out)["params"] == {"train_bp.lr": [str(params["train_bp"]["lr"])] * 2}
    rc, out, _ = run_cli(capsys, "compare", "--no-plot")
    table = out.split("params that differ")[1]
    assert rc == 0 and "device.budget" in table and table.index("16MB") < table.index("64MB")
    rc, _, err = run_cli(capsys, "compare", "--params", "nothing.*")
    assert rc == 2 and "--params nothing.*: no param of these runs matches; they carry " in err


@pytest.mark.parametrize("argv, expected", [
    (["--metric", "["], "--metric '[': an unclosed [; patterns are shell-style"),
    (["--metric", "*.acc"], "--metric *.acc: no metric of these runs matches; they carry train_bp.batch, "
                            "train_bp.test_acc"),
    (["--plot", "/proc/x.png"], "--plot /proc/x.png: cannot write it ("),
])
def test_compare_answers_a_bad_pattern_or_plot_path_in_one_line(monkeypatch, capsys, argv, expected):
    from edgeflux.tracking import stage_run
    monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", "p1")
    with stage_run("train_bp") as run:   # in the test's own sqlite store (conftest)
        run.log_headline({"test_acc": 0.8, "batch": 16})
    capsys.readouterr()
    rc, out, err = run_cli(capsys, "compare", *argv)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("edgeflux compare: error: " + expected), err


@pytest.mark.slow   # an MLflow server
def test_compare_reads_pipeline_runs_from_an_mlflow_server(tmp_path, monkeypatch, capsys):
    from edgeflux.tracking import stage_run
    from pipeline.servers import MLflowServer

    with MLflowServer(tmp_path / "mlflow") as server:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
        for pid, (preset, exp, stages) in RUNS.items():
            monkeypatch.setenv("EDGEFLUX_PIPELINE_ID", pid)
            monkeypatch.setenv("EDGEFLUX_PRESET", preset)
            monkeypatch.setenv("DVC_EXP_NAME", exp or "")
            for stage, headline in stages.items():
                with stage_run(stage) as run:
                    run.log_headline(headline)
            time.sleep(0.01)   # distinct start times: newest first
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'elsewhere.db'}")   # --tracking-uri wins
        plot = tmp_path / "out" / "compare.png"
        capsys.readouterr()   # what MLflow printed while logging ("View run ... at")
        rc, out, err = run_cli(capsys, "compare", "--tracking-uri", server.url, "--json", "--plot", str(plot))
        assert rc == 0, err
        data = json.loads(out)
        assert [(r["preset"], r["dvc_exp"], r["status"]) for r in data["runs"]] == [
            ("laptop", "bigger", "FINISHED"), ("pi4", None, "FINISHED")]
        for run, pid in zip(data["runs"], ["p2", "p1"]):
            expected = {f"{stage.replace('@', '.')}.{name}": value for stage, values in RUNS[pid][2].items()
                        for name, value in values.items() if name != "batch"}   # not in the default patterns
            assert run["metrics"] == pytest.approx(expected)
        assert data["table"]["test_acc"] == {"finetune.mobiletl": [0.79, 0.74], "train_bp": [0.86, 0.81]}
        assert data["table"]["peak_mib"]["finetune.mobiletl"] == [160.25, 120.0]
        assert data["plot"] == str(plot) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

        rc, out, _ = run_cli(capsys, "compare", "--tracking-uri", server.url, "--last", "1", "--metric", "*.batch",
                             "--no-plot", "--json")
        assert [r["metrics"] for r in json.loads(out)["runs"]] == [{"train_bp.batch": 64}]
        monkeypatch.setenv("COLUMNS", "160")   # a 160-column terminal: every run, stage and figure whole
        rc, out, _ = run_cli(capsys, "compare", "--tracking-uri", server.url, "--no-plot")   # the tables
    assert rc == 0 and "#1" in out and "#2" in out and "laptop" in out and "bigger" in out
    assert max(map(len, out.splitlines())) <= 160 and "finetune.mobiletl" in out and "160.2" in out
    tables = out.split("test_acc")[1]
    assert "train_bp" in tables and "0.86" in tables and tables.index("0.86") < tables.index("0.81")


# --- report, and the forwarded commands --------------------------------------------------------------

def test_report_prints_the_summary_and_opens_it_or_prints_where_it_is(tmp_path, monkeypatch, capsys):
    import webbrowser

    monkeypatch.chdir(tmp_path)
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports/summary.md").write_text("# edgeflux pipeline summary\n\n| method | acc |\n")
    (tmp_path / "reports/accuracy_vs_time.png").write_bytes(b"png")
    bin_dir, opened = tmp_path / "bin", tmp_path / "opened.txt"
    bin_dir.mkdir()
    (bin_dir / "xdg-open").write_text(f"#!/bin/sh\necho \"$1\" >> {opened}\n")
    (bin_dir / "xdg-open").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("DISPLAY", ":0")
    rc, out, _ = run_cli(capsys, "report", "--open")
    assert rc == 0 and "| method | acc |" in out
    assert opened.read_text().split() == ["reports/summary.md", "reports/accuracy_vs_time.png"]   # what exists
    paths = [str(tmp_path / "reports/summary.md"), str(tmp_path / "reports/accuracy_vs_time.png")]

    (bin_dir / "xdg-open").write_text("#!/bin/sh\necho 'xdg-open: no method available for opening' >&2\nexit 3\n")
    rc, out, err = run_cli(capsys, "report", "--open")   # the opener fails: said, with where the files are
    assert rc == 0 and "| method | acc |" in out and not err
    assert "not opened: xdg-open could not open reports/summary.md: xdg-open: no method available" in out
    assert out.split("the files are:\n")[1].split() == paths

    monkeypatch.delenv("DISPLAY")   # a device over ssh: nothing is tried, the paths are printed
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    rc, out, err = run_cli(capsys, "report", "--open")
    assert rc == 0 and not err and "no display here (DISPLAY and WAYLAND_DISPLAY are unset)" in out
    assert out.split("browse to this machine):\n")[1].split() == paths

    (bin_dir / "xdg-open").unlink()
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.delenv("BROWSER", raising=False)
    monkeypatch.setattr(webbrowser, "_tryorder", None)   # look for browsers again, on this PATH
    rc, out, err = run_cli(capsys, "report", "--open")
    assert rc == 0 and "not opened: no program to open files with" in out

    (tmp_path / "reports/summary.md").unlink()
    rc, _, err = run_cli(capsys, "report")
    assert rc != 0 and "reports/summary.md does not exist yet" in err


def test_version_names_the_package_commit_torch_and_python(capsys):
    import platform
    from importlib.metadata import version

    rc, out, _ = run_cli(capsys, "--version")
    commit = sh("git rev-parse --short HEAD", REPO).stdout.strip()
    assert rc == 0 and out.strip() == (f"edgeflux {version('edgeflux')} (commit {commit}, torch {version('torch')}, "
                                       f"Python {platform.python_version()})")


def test_worker_and_serve_cloud_pass_their_arguments_to_the_wrapped_commands(tmp_path):
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    worker = subprocess.run([PYTHON, "-m", "pipeline.cli", "worker", "--pool", "pi", "--clone", str(tmp_path)],
                            check=False, capture_output=True, text=True, env=env)
    assert worker.returncode == 1 and f"{tmp_path} is not an edgeflux clone (no dvc.yaml)" in worker.stderr
    cloud = subprocess.run([PYTHON, "-m", "pipeline.cli", "serve-cloud", "--model", str(tmp_path / "none"),
                            "--port", "0"], check=False, capture_output=True, text=True)
    assert cloud.returncode == 1 and f"no MLflow model at {tmp_path / 'none'}" in cloud.stderr
