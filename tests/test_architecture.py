"""docs/architecture.md's recipes, each followed in a temporary copy: a new stage shows in the registry and the
report, a new device preset sets every budgeted stage, a new fine-tuning method gets its row and label."""
import shutil
import sys
from pathlib import Path

import yaml

from edgeflux.config import validate
from edgeflux.presets import load_preset, merge
from edgeflux.rows import RowInputs
from stages.registry import stages
from stages.report import collect_rows

REPO = Path(__file__).resolve().parents[1]

TOY_STAGE = '''"""A toy stage: what docs/architecture.md's recipe asks of a new stage's module."""
from edgeflux.rows import MethodRow, RowInputs, training_row
from stages.registry import Stage

STAGE = Stage(name="toy", section="train_bp", side="device", budgeted=True, rows=True,
              curve="plots/toy.csv", outs=("metrics/toy.json", "plots/toy.csv"))


def summary_rows(inputs: RowInputs) -> list[MethodRow]:
    if "toy" not in inputs.head:
        return []
    return [training_row("Toy" + inputs.plus("train_bp"), "toy", "scratch", "vgg11-w0.25", inputs.head["toy"],
                         curve=STAGE.curve, plotted=True)]
'''


def test_a_new_stage_module_is_registered_and_shows_in_the_report(tmp_path, monkeypatch):
    package = tmp_path / "toystages"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "toy.py").write_text(TOY_STAGE)
    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text())
    dvc["stages"]["toy"] = {"cmd": "python -m toystages.toy", "outs": ["plots/toy.csv"], "metrics": ["metrics/toy.json"]}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dvc, sort_keys=False))
    monkeypatch.syspath_prepend(str(tmp_path))

    (toy,) = stages(package, package="toystages", dvc_yaml=tmp_path / "dvc.yaml")
    assert (toy.name, toy.side, toy.budgeted, toy.module) == ("toy", "device", True, "toystages.toy")
    head = {"toy": {"test_acc": 0.8, "peak_mib": 10.0, "budget_mib": 61.0, "batch": 32}}
    rows = collect_rows(RowInputs(head, {}, {"train_bp": True}), [*stages(), toy])
    assert [(r.method, r.peak_mib, r.pareto) for r in rows] == [("Toy + BitTrain", 10.0, True)]
    sys.modules.pop("toystages.toy", None)
    sys.modules.pop("toystages", None)


def test_a_new_device_preset_sets_every_budgeted_stage(tmp_path):
    presets = tmp_path / "presets"
    shutil.copytree(REPO / "presets", presets)
    (presets / "tiny-board.yaml").write_text(
        "description: a board with 1 GB\nstages: null\n"
        "params:\n  device.device: cpu\n  device.budget: 96MB\n  device.max_batch: 32\n  device.threads: 2\n")
    preset = load_preset("tiny-board", presets)
    params = validate(merge(yaml.safe_load((REPO / "params.yaml").read_text()), preset.params))
    sections = [params.train_bp, params.neuroflux, params.finetune, params.meanet]
    assert {(s.device, s.budget, s.max_batch) for s in sections} == {("cpu", 96_000_000, 32)}
    assert params.device.threads == 2 and preset.env() == {"EDGEFLUX_PRESET": "tiny-board"}


def test_a_new_finetune_method_is_accepted_run_and_labelled(monkeypatch):
    """Recipe (a): a function in edgeflux/finetune/methods.py's METHODS and a label in options.py's METHOD_LABELS."""
    import torch

    from edgeflux.finetune import methods, options
    from edgeflux.models import build_model
    from stages.finetune import summary_rows

    def ft_head(model, opts, calibration, device):   # the classifier only, like ft_last
        return methods.METHODS["ft_last"](model, opts, calibration, device)

    monkeypatch.setitem(methods.METHODS, "ft_head", ft_head)
    monkeypatch.setitem(options.METHOD_LABELS, "ft_head", "FT-Head")
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["finetune"]["methods"] = ["ft_head", "ft_head-bittrain", "elastic-ft_head"]
    assert validate(raw).finetune.methods == ["ft_head", "ft_head-bittrain", "elastic-ft_head"]

    model = build_model("mobilenet_v2", width=0.25, num_classes=10, in_channels=1)
    prepared = methods.prepare("ft_head", model, options.FinetuneOptions(), [], torch.device("cpu"))
    trainable = [n for n, p in prepared.model.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith(f"units.{len(model.units) - 1}.") for n in trainable)

    head = {"budget_mib": 61.0, "peak_mib": 5.0, "test_acc": 0.8, "batch": 64}
    rows = summary_rows(RowInputs({"finetune/ft_head-bittrain": head}, {"finetune/ft_head-bittrain": {"model": "m"}},
                                  {}, "mobilenet_v2-w0.25"))
    assert [r.method for r in rows] == ["FT-Head + BitTrain"]
