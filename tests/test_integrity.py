"""Every file edgeflux writes and reads back is checked on load: a flipped bit or a truncation is one
line naming the file and the fix (or, for a checkpoint, a warning and a run from scratch), never a
silently different model, a resumed run on damaged state, or a traceback deep inside training."""
import logging

import pytest
import torch

from edgeflux.artifacts import (CHECKSUM_KEY, CorruptFileError, content_digest, load_checked, load_model, read_json,
                                save_checked, save_model, write_json)
from edgeflux.data import PreparedDataError, load_prepared, save_prepared, tensors
from edgeflux.models import build_model
from edgeflux.neuroflux.model import build_learners, load_learners, save_learners
from edgeflux.train import TrainRun, fit
from tests.test_train import OPTS, Interrupt, small_model

SPEC = dict(name="vgg11", num_classes=10, in_channels=1, width=0.125)


def flip_inside(path, tensor: torch.Tensor) -> None:
    """Flip one bit inside `tensor`'s bytes as stored in the file at `path` (a silent change to a value:
    the zip and pickle structure stay intact, so only a content check can see it)."""
    data = bytearray(path.read_bytes())
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    start = next(i for i in range(0, len(raw) - 64, 16) if len(set(raw[i:i + 64])) >= 16)   # not padding
    at = data.find(raw[start:start + 64])
    assert at >= 0 and data.find(raw[start:start + 64], at + 1) < 0, "the bytes must appear once in the file"
    data[at + 5] ^= 0x10
    path.write_bytes(bytes(data))


def test_content_digest_sees_values_shapes_dtypes_and_order():
    base = {"w": torch.arange(6.0).reshape(2, 3), "meta": {"lr": 0.1, "names": ["a", "b"]}, "n": 3, "none": None}
    same = {"w": torch.arange(6.0).reshape(2, 3), "meta": {"lr": 0.1, "names": ["a", "b"]}, "n": 3, "none": None}
    assert content_digest(base) == content_digest(same)
    for changed in ({**base, "w": torch.arange(6.0).reshape(3, 2)}, {**base, "w": torch.arange(6).reshape(2, 3)},
                    {**base, "n": 4}, {**base, "meta": {"lr": 0.1 + 1e-12, "names": ["a", "b"]}},
                    {**base, "meta": {"lr": 0.1, "names": ["b", "a"]}}, {**base, "none": 0}):
        assert content_digest(changed) != content_digest(base)
    with pytest.raises(TypeError, match="cannot checksum"):
        content_digest({"x": object()})


def test_a_flipped_bit_in_a_model_is_caught_and_names_the_fix(tmp_path):
    model = build_model(**SPEC)
    path = tmp_path / "model.pt"
    save_model(path, model, SPEC, meta={"stage": "train_bp"})
    loaded, meta = load_model(path)
    assert meta == {"stage": "train_bp"} and all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert torch.load(path, weights_only=True)[CHECKSUM_KEY]    # still a plain torch file, one key more
    weight = next(v for k, v in model.state_dict().items() if k.endswith("weight") and v.numel() > 1000)
    flip_inside(path, weight)
    with pytest.raises(CorruptFileError, match=r"model.pt is corrupt .*does not match its checksum.*dvc checkout"):
        load_model(path)


def test_a_truncated_model_is_one_line_not_a_stream_reader_traceback(tmp_path):
    path = tmp_path / "model.pt"
    save_model(path, build_model(**SPEC), SPEC)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CorruptFileError, match="corrupt or truncated") as info:
        load_model(path)
    assert "\n" not in str(info.value)


def test_the_neuroflux_model_is_checked(tmp_path):
    """models/neuroflux.pt with a flipped weight: select_exit would have exported a broken model."""
    spec, aux = dict(SPEC, image_size=32, batch_norm=True, seed=0), dict(mode="adaptive", classic_filters=256,
                                                                         pool=2, seed=0)
    _, learners = build_learners(spec, aux)
    path = tmp_path / "neuroflux.pt"
    save_learners(path, learners, spec, aux, meta={"unit_names": ["u"]})
    assert load_learners(path)[2] == {"unit_names": ["u"]}
    weight = max((p for p in learners[2].parameters()), key=torch.Tensor.numel)
    flip_inside(path, weight)
    with pytest.raises(CorruptFileError, match="dvc repro --force train_blocks"):
        load_learners(path)


@pytest.mark.slow   # tens of seconds: make test-fast leaves it out
def test_a_flipped_checkpoint_is_not_resumed(mnist_subset, tmp_path, caplog):
    """A bit flipped in an epoch checkpoint: the run warns and trains from scratch, to the weights of an
    uninterrupted run, instead of resuming damaged state."""
    train, val = tensors(mnist_subset, "train", limit=200), tensors(mnist_subset, "val", limit=100)
    torch.manual_seed(0)
    reference = small_model(mnist_subset)
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    fit(reference, train, val, OPTS, batch_size=64)
    ckpt = tmp_path / "ckpt.pt"
    interrupted = small_model(mnist_subset)
    interrupted.load_state_dict(initial)
    with pytest.raises(Interrupt):
        fit(interrupted, train, val, OPTS, 64,
            TrainRun(checkpoint=ckpt, on_epoch_end=lambda e, r: (_ for _ in ()).throw(Interrupt())))
    flip_inside(ckpt, max(interrupted.state_dict().values(), key=torch.Tensor.numel))
    again = small_model(mnist_subset)
    again.load_state_dict(initial)
    with caplog.at_level(logging.WARNING):
        result = fit(again, train, val, OPTS, 64, TrainRun(checkpoint=ckpt))
    assert result.resumed_from_epoch == 0 and "does not match its checksum" in caplog.text
    for (name, a), b in zip(reference.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_prepared_data_with_a_flipped_pixel_is_caught(tmp_path, mnist_subset):
    save_prepared(mnist_subset, tmp_path)
    assert torch.equal(load_prepared(tmp_path).labels, mnist_subset.labels)
    flip_inside(tmp_path / "data.pt", mnist_subset.images[100:200])
    with pytest.raises(PreparedDataError, match="does not match its checksum.*dvc repro prepare"):
        load_prepared(tmp_path)


def test_prepared_data_with_a_label_out_of_range_is_refused_on_load(tmp_path, mnist_subset):
    """A label outside the classes (a hand-made or foreign prepare output, checksum intact) is named on
    load, not an IndexError inside cross_entropy minutes later."""
    save_prepared(mnist_subset, tmp_path)
    state = load_checked(tmp_path / "data.pt", "", weights_only=True)
    state["labels"] = state["labels"].clone()
    state["labels"][7] = 10
    save_checked(tmp_path / "data.pt", state)
    with pytest.raises(PreparedDataError, match=r"labels range over 0\.\.10, outside the 10 classes 0\.\.9"):
        load_prepared(tmp_path)


def test_json_a_later_stage_reads_is_checked(tmp_path):
    path = tmp_path / "blocks.json"
    write_json(path, {"blocks": [{"batch_size": 64}]}, checksum=True)
    assert read_json(path, "remake it", checksum=True) == {"blocks": [{"batch_size": 64}]}
    path.write_text(path.read_text().replace("64", "66"))     # still valid JSON, a different plan
    with pytest.raises(CorruptFileError, match="does not match its checksum"):
        read_json(path, "run the partition stage", checksum=True)
    write_json(path, {"blocks": []})
    with pytest.raises(CorruptFileError, match="carries no edgeflux checksum"):
        read_json(path, "run the partition stage", checksum=True)
