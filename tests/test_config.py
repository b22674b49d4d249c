import copy
from pathlib import Path

import pytest
import yaml

from edgeflux.config import ParamsError, load_params, parse_bytes, validate

REPO = Path(__file__).resolve().parents[1]
MINIMAL = {"pretrain": {"models": [{"name": "resnet18", "width": 0.25}]},
           "train_bp": {"model": {"name": "vgg11", "width": 0.25}, "budget": "24MB"}}


def with_change(section, key, value):
    raw = copy.deepcopy(MINIMAL)
    raw[section][key] = value
    return raw


def test_repository_params_yaml_is_valid():
    params = load_params(REPO / "params.yaml")
    assert params.data.dataset == "fashion-mnist"
    # one budget for every method: the report compares them under it
    assert params.train_bp.budget == params.neuroflux.budget == params.finetune.budget == params.meanet.budget \
        == params.device.budget
    assert params.finetune.methods[-2:] == ["mobiletl-bittrain", "elastic-mobiletl"]
    assert [m.key for m in params.pretrain.models] == ["mobilenet_v2-w0.5", "resnet18-w0.25"]


@pytest.mark.parametrize("text,expected", [
    ("300MB", 300_000_000), ("1.5GiB", 1_610_612_736), ("4096B", 4096), ("64 KiB", 65_536), ("2GB", 2_000_000_000),
    ("64kB", 64_000),
])
def test_parse_bytes_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text, fix", [("24Mb", "'24MB' or '24MiB'"), ("2gb", "'2GB' or '2GiB'"), ("8b", "'8B'")])
def test_a_lowercase_b_is_bits_and_refused(text, fix):
    """24Mb is megabits by convention: read as megabytes it would promise eight times the memory."""
    with pytest.raises(ValueError, match="lowercase b means bits") as err:
        parse_bytes(text)
    assert fix in str(err.value)


def test_unknown_key_names_key_and_allowed_keys():
    with pytest.raises(ParamsError) as err:
        validate(with_change("train_bp", "budgt", "24MB"))
    msg = str(err.value)
    assert "train_bp.budgt" in msg and "unknown key" in msg and "budget" in msg and "max_batch" in msg


def test_a_misspelt_section_is_one_short_line():
    """The section's contents are not printed back (a whole dict on one line); the likely key is named."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["neurofluxx"] = raw.pop("neuroflux")
    with pytest.raises(ParamsError) as err:
        validate(raw)
    msg = str(err.value)
    assert msg.startswith("params.yaml: neurofluxx = a section: unknown key (did you mean neuroflux?);")
    assert "'model'" not in msg and len(msg) < 200 and "\n" not in msg


def test_nested_unknown_key():
    raw = copy.deepcopy(MINIMAL)
    raw["pretrain"]["models"][0]["widht"] = 0.5
    with pytest.raises(ParamsError, match=r"pretrain\.models\.0\.widht.*allowed keys.*width"):
        validate(raw)


@pytest.mark.parametrize("value,fragment", [(300, "needs a unit"), ("300", "cannot read '300'"),
                                            ("3 parsecs", "unknown unit 'parsecs'"), ("-5MB", "cannot read")])
def test_budget_without_valid_unit(value, fragment):
    with pytest.raises(ParamsError) as err:
        validate(with_change("train_bp", "budget", value))
    assert "train_bp.budget" in str(err.value) and fragment in str(err.value)
    assert "MiB" in str(err.value) or "unit" in str(err.value)


def test_negative_batch_size_and_wrong_types():
    with pytest.raises(ParamsError, match=r"train_bp\.batch_size = -3: .*greater than or equal to 1"):
        validate(with_change("train_bp", "batch_size", -3))
    with pytest.raises(ParamsError, match=r"train_bp\.lr = 'fast'"):
        validate(with_change("train_bp", "lr", "fast"))
    with pytest.raises(ParamsError, match=r"train_bp\.epochs = 2\.5"):
        validate(with_change("train_bp", "epochs", 2.5))
    with pytest.raises(ParamsError, match=r"pretrain\.models\.0\.name = 'vgg13'.*'vgg11'"):
        validate({**MINIMAL, "pretrain": {"models": [{"name": "vgg13"}]}})


def test_every_problem_is_reported_at_once():
    raw = with_change("train_bp", "lr", -1.0)
    raw["data"] = {"val_fraction": 1.5}
    msg = str(pytest.raises(ParamsError, validate, raw).value)
    assert "train_bp.lr" in msg and "data.val_fraction" in msg


def test_missing_section_and_bad_file(tmp_path):
    with pytest.raises(ParamsError, match="train_bp is missing"):
        validate({"pretrain": MINIMAL["pretrain"]})
    bad = tmp_path / "params.yaml"
    bad.write_text("train_bp: [unclosed")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(bad)
    with pytest.raises(ParamsError, match="not found"):
        load_params(tmp_path / "nope.yaml")


def test_duplicate_pretrain_models_rejected():
    raw = copy.deepcopy(MINIMAL)
    raw["pretrain"]["models"] = [{"name": "resnet18", "width": 0.25}, {"name": "resnet18", "width": 0.25}]
    with pytest.raises(ParamsError, match="listed twice: resnet18-w0.25"):
        validate(raw)


def test_cache_threshold_without_bittrain_storage_is_refused_before_training():
    """A pruning threshold only means something for bitmap storage; caught when params are read, not after a block."""
    import yaml

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["neuroflux"]["cache"] = {"storage": "float16", "threshold": 0.1}
    with pytest.raises(ParamsError, match="neuroflux.cache.*needs storage: bittrain.*set threshold: 0"):
        validate(raw, where="params.yaml")
    raw["neuroflux"]["cache"] = {"storage": "bittrain", "threshold": 0.1}
    assert validate(raw, where="params.yaml").neuroflux.cache.threshold == 0.1


def test_an_exponent_yaml_reads_as_text_gets_a_hint():
    """PyYAML (YAML 1.1) reads `lr: 1e-3` as the string '1e-3': the error says how to write it."""
    import yaml

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["pretrain"]["lr"] = yaml.safe_load("lr: 1e-3")["lr"]
    assert raw["pretrain"]["lr"] == "1e-3"
    with pytest.raises(ParamsError, match=r"pretrain.lr = '1e-3'.*write it as 0.001 or with a dot, like 1.0e-3"):
        validate(raw, where="params.yaml")


def test_finetune_section_names_a_pretrained_model_and_known_methods():
    raw = copy.deepcopy(MINIMAL)
    raw["finetune"] = {"model": "resnet18-w0.25", "methods": ["mobiletl", "ft_all"], "budget": "64MB"}
    params = validate(raw)
    assert params.finetune.methods == ["mobiletl", "ft_all"] and params.finetune.blocks == 3
    raw["finetune"]["model"] = "mobilenet_v2-w0.5"
    with pytest.raises(ParamsError, match=r"finetune.model = 'mobilenet_v2-w0.5': not a model the pretrain stage "
                                          r"trains; allowed: resnet18-w0.25"):
        validate(raw)
    raw["finetune"].update(model="resnet18-w0.25", methods=["mobiletl", "ft_everything"])
    with pytest.raises(ParamsError, match=r"finetune method 'ft_everything' is unknown: one of ft_all .*mobiletl"):
        validate(raw)
    raw["finetune"]["methods"] = ["mobiletl-bitrain"]   # a misspelt composition
    with pytest.raises(ParamsError, match=r"'mobiletl-bitrain' is unknown: .*optionally followed by -bittrain"):
        validate(raw)
    raw["finetune"]["methods"] = ["elastic-mobiletl-bittrain", "ft_all-bittrain"]
    assert validate(raw).finetune.methods == raw["finetune"]["methods"]
    raw["finetune"]["methods"] = ["ft_all", "ft_all"]
    with pytest.raises(ParamsError, match="a method is listed twice"):
        validate(raw)


def test_meanet_edge_options_are_the_training_options_alone():
    p = load_params(REPO / "params.yaml").meanet
    edge = p.edge_options()
    assert edge.budget == p.budget == 32_000_000 and edge.epochs == p.epochs and edge.bittrain == p.bittrain
    assert "threshold" not in edge.model_dump() and "client" not in edge.model_dump()
    changed = load_params(REPO / "params.yaml").meanet.model_copy(update={"threshold": 0.3, "sweep": 7})
    assert changed.edge_options().model_dump() == edge.model_dump()   # the router's settings: same training run



def test_budgeted_sections_inherit_the_device_section_and_may_override_it():
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["device"] = {"device": "cpu", "budget": "32MB", "max_batch": 100, "bittrain": {"enabled": True}}
    raw["train_bp"]["budget"] = "16MB"                  # one stage's own budget
    raw["neuroflux"]["bittrain"] = {"threshold": 0.5}   # one BitTrain key, the rest from the device
    params = validate(raw)
    assert (params.train_bp.budget, params.neuroflux.budget, params.finetune.budget) == (16_000_000, 32_000_000,
                                                                                        32_000_000)
    assert params.neuroflux.bittrain.enabled and params.neuroflux.bittrain.threshold == 0.5
    assert params.meanet.device == params.finetune.device == "cpu" and params.pretrain.device == "auto"
    # max_batch is a limit in both places: the smaller holds (finetune and meanet cap at 128 themselves)
    assert (params.train_bp.max_batch, params.finetune.max_batch, params.meanet.max_batch) == (100, 100, 100)
    raw["device"]["max_batch"] = 512
    assert (validate(raw).train_bp.max_batch, validate(raw).finetune.max_batch) == (512, 128)


def test_a_bad_device_key_is_one_message_naming_the_device_section():
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["device"]["budget"] = 64
    with pytest.raises(ParamsError) as err:
        validate(raw)
    assert str(err.value).splitlines() == [
        "params.yaml: device.budget = 64: a memory size needs a unit, e.g. '64MB' or '64MiB' "
        "(allowed units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"]
    raw["device"] = {"budjet": "1MB"}
    with pytest.raises(ParamsError, match=r"device.budjet = '1MB': unknown key \(did you mean budget\?\)"):
        validate(raw)


def test_neuroflux_refuses_weights_it_would_not_read():
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["neuroflux"]["model"] = {"arch": "torchvision", "name": "resnet18", "weights": "resnet18.pth"}
    with pytest.raises(ParamsError, match="NeuroFlux trains its model from scratch"):
        validate(raw)
    raw["neuroflux"]["model"] = {"arch": "torchvision", "name": "resnet18"}
    assert validate(raw).neuroflux.model.key == "tv-resnet18"
