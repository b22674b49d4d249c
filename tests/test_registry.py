"""The stage registry (each stage's STAGE declaration) against dvc.yaml, the graph: the same stages, the same
outputs, the device section where a stage is budgeted, and deps that cover every file a stage imports."""
import dataclasses
from pathlib import Path

import pytest
import yaml

from stages.registry import MATRIX_ITEM, RegistryError, Stage, stages

ROOT = Path(__file__).resolve().parents[1]
DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def _paths(entries) -> set[str]:
    return {next(iter(e)) if isinstance(e, dict) else e for e in entries or []}


def dvc_outs(stage: dict) -> set[str]:
    return _paths(stage.get("outs")) | _paths(stage.get("metrics")) | _paths(stage.get("plots"))


def problems(registered: list[Stage], dvc: dict) -> list[str]:
    """What differs between the registry and dvc.yaml's stages, one line each."""
    names = {s.name for s in registered}
    found = [f"{n}: in dvc.yaml, not in the registry (declare STAGE = Stage(...) in its module)"
             for n in dvc if n not in names]
    found += [f"{n}: in the registry, not in dvc.yaml" for n in sorted(names - set(dvc))]
    for s in (s for s in registered if s.name in dvc):
        if set(s.outs) != dvc_outs(dvc[s.name]):
            found.append(f"{s.name}: outs differ: registry {sorted(s.outs)}, dvc.yaml {sorted(dvc_outs(dvc[s.name]))}")
        if s.curve is not None and s.curve not in s.outs:
            found.append(f"{s.name}: its curve {s.curve} is not one of its outs")
        if s.budgeted != ("device.budget" in dvc[s.name].get("params", [])):
            found.append(f"{s.name}: budgeted={s.budgeted}, but dvc.yaml's params "
                         f"{'do not list' if s.budgeted else 'list'} device.budget")
    return found


def test_every_stage_is_in_the_registry_and_in_dvc_yaml_with_the_same_outputs():
    assert problems(stages(), DVC) == []


def test_the_check_fails_when_a_stage_is_missing_or_its_outputs_differ():
    registered = stages()
    assert problems([s for s in registered if s.name != "train_bp"], DVC) == [
        "train_bp: in dvc.yaml, not in the registry (declare STAGE = Stage(...) in its module)"]
    assert problems(registered, {k: v for k, v in DVC.items() if k != "select_exit"}) == [
        "select_exit: in the registry, not in dvc.yaml"]
    dropped = {**DVC, "partition": {**DVC["partition"], "outs": DVC["partition"]["outs"][:1]}}
    assert [p.split(":")[0] for p in problems(registered, dropped)] == ["partition"]


def test_budgeted_stages_read_the_sections_the_schema_lets_inherit_the_device_section():
    from edgeflux.config import budgeted_sections

    assert {s.section for s in stages() if s.budgeted} == set(budgeted_sections())


def test_dvc_plots_draw_every_registered_curve():
    """The top-level accuracy plot lists each stage's curve (finetune's once per method in params.yaml)."""
    methods = yaml.safe_load((ROOT / "params.yaml").read_text())["finetune"]["methods"]
    plots = yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]
    drawn = set(next(p["accuracy_vs_time"]["y"] for p in plots if "accuracy_vs_time" in p))
    curves = {c.replace(MATRIX_ITEM, m) for s in stages() if (c := s.curve) for m in (methods if s.matrix else [""])}
    assert drawn == curves


def test_a_declaration_must_hold_literals(tmp_path):
    (tmp_path / "bad.py").write_text('NAME = "x"\nSTAGE = Stage(name=NAME, section=None, side="device")\n')
    with pytest.raises(RegistryError, match=r"bad.py: STAGE = Stage\(\.\.\.\) must hold literals only"):
        stages(tmp_path, dvc_yaml=tmp_path / "dvc.yaml")


def test_the_declaration_read_from_source_is_the_module_s_own():
    for s in stages():
        assert dataclasses.replace(s.load_module().STAGE, module=s.module) == s, s.name
