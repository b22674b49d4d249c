"""Device presets: every shipped preset makes valid params, overrides land in params.yaml with its comments
kept, and a bad preset or override is refused with a message that names it."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from edgeflux.config import validate
from edgeflux.presets import PresetError, available, load_preset, merge, set_params

REPO = Path(__file__).resolve().parents[1]
PRESETS = REPO / "presets"


def test_every_shipped_preset_makes_valid_params_under_its_budget():
    names = available(PRESETS)
    assert {"pi4", "jetson-nano", "jetson-orin", "laptop"} <= set(names)
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    for name in names:
        preset = load_preset(name, PRESETS)
        assert preset.name == name and preset.description
        params = validate(merge(base, preset.params), where=f"preset {name}")
        budgets = {params.train_bp.budget, params.neuroflux.budget, params.finetune.budget, params.meanet.budget}
        assert budgets == {params.device.budget}, f"{name}: every method under the device's budget, got {budgets}"
        assert {params.train_bp.device, params.neuroflux.device, params.finetune.device,
                params.meanet.device} == {params.device.device}
        assert not [k for k in preset.params if k.split(".")[0] in ("train_bp", "neuroflux", "finetune", "meanet")
                    and k.split(".")[1] in ("device", "budget", "max_batch")], f"{name}: say it once, in device.*"


def test_merge_dotted_keys_and_sections_without_touching_the_input():
    base = {"train_bp": {"budget": "24MB", "bittrain": {"enabled": False, "threshold": 0.0}}, "report": {"x": 1}}
    out = merge(base, {"train_bp.budget": "1GB", "train_bp.bittrain": {"enabled": True}, "report.y": 2})
    assert out == {"train_bp": {"budget": "1GB", "bittrain": {"enabled": True, "threshold": 0.0}},
                   "report": {"x": 1, "y": 2}}
    assert base["train_bp"]["budget"] == "24MB" and base["train_bp"]["bittrain"]["enabled"] is False
    with pytest.raises(PresetError, match="train_bp.budget is a value, not a section"):
        merge(base, {"train_bp.budget.x": 1})


def test_set_params_keeps_comments_and_changes_only_the_overridden_values(tmp_path):
    path = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", path)
    before = path.read_text()
    epochs = yaml.safe_load(before)["train_bp"]["epochs"] + 1   # a value the file does not hold already
    set_params(load_preset("pi4", PRESETS).params | {"train_bp.epochs": epochs}, path)
    after = path.read_text()
    assert "# units: B, KB, MB, GB" in after and after.count("#") == before.count("#")
    params = yaml.safe_load(after)
    assert params["device"]["budget"] == "256MB" and params["train_bp"]["epochs"] == epochs
    assert params["neuroflux"]["cache"]["storage"] == "float16" and params["device"]["device"] == "cpu"
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    assert len(before.splitlines()) == len(after.splitlines())
    # the device, its budget, batch limit and threads, and the epochs; cache.storage is float16 there already
    assert len(changed) == 5, changed
    assert all(a.split(":")[0] == b.split(":")[0] for a, b in changed)


def test_bad_presets_are_refused_naming_the_problem(tmp_path):
    with pytest.raises(PresetError, match=r"no preset 'pi5'.*presets in .*: jetson-nano, jetson-orin, laptop, pi4"):
        load_preset("pi5", PRESETS)
    bad = tmp_path / "bad.yaml"
    bad.write_text("description: x\nthread: 4\n")
    with pytest.raises(PresetError, match=r"bad.yaml: not a valid preset: thread: Extra inputs"):
        load_preset(str(bad))
    bad.write_text("description: x\nthreads: 4\n")
    with pytest.raises(PresetError, match=r"threads: Extra inputs"):   # a param now: device.threads
        load_preset(str(bad))


def test_check_reports_a_bad_override_in_one_line_per_problem(tmp_path):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    set_params({"train_bp.budget": "256", "neuroflux.budgt": "1MB"}, tmp_path / "params.yaml")
    out = subprocess.run([sys.executable, "-m", "edgeflux.presets", "check"], cwd=tmp_path, capture_output=True,
                         text=True)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2 and any("train_bp.budget = '256'" in line for line in lines)
    assert any("neuroflux.budgt" in line and "did you mean budget?" in line for line in lines)
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    ok = subprocess.run([sys.executable, "-m", "edgeflux.presets", "check"], cwd=tmp_path, capture_output=True,
                        text=True)
    assert ok.returncode == 0 and "valid" in ok.stdout


def test_preset_env_names_the_preset_and_its_threads_are_a_param():
    assert load_preset("pi4", PRESETS).env() == {"EDGEFLUX_PRESET": "pi4"}
    assert load_preset("pi4", PRESETS).params["device.threads"] == 4


def test_the_docs_table_says_what_the_preset_files_hold():
    rows = [line for line in (REPO / "docs/orchestration.md").read_text().splitlines() if line.startswith("| `")]
    table = {line.split("`")[1]: [c.strip() for c in line.strip("|").split("|")] for line in rows
             if line.split("`")[1] in available(PRESETS)}
    assert set(table) == set(available(PRESETS))
    for name, cells in table.items():
        preset = load_preset(name, PRESETS)
        budget, batch, threads, device = cells[2:6]
        assert budget.replace(" ", "") == preset.params["device.budget"], name
        assert int(batch) == preset.params["device.max_batch"], name
        assert threads == (str(preset.params["device.threads"]) if preset.params["device.threads"]
                           else "torch's default"), name
        assert device == preset.params["device.device"], name
