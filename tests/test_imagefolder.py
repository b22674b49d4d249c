"""imagefolder (a user's own photos), ImageNet normalisation and training-batch augmentation, on generated images."""
import logging
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from edgeflux.data import (IMAGENET_MEAN, IMAGENET_STD, LUMA_601, DatasetFormatError, DatasetNotFoundError, Images,
                           augment_pixels, batches, load_raw, prepare)
from edgeflux.data.incoming import load_incoming
from edgeflux.errors import UserError
from edgeflux.options import AugmentOptions, TrainOptions

REPO = Path(__file__).resolve().parents[1]


def save(path: Path, rgb: tuple[int, int, int], size: tuple[int, int] = (30, 20), fmt: str = "PNG") -> None:
    """A uniform image (size is width, height): uniform images keep their colour exactly through resize and crop."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, rgb).save(path, fmt)


def colour(cls: int, i: int, part: int = 0) -> tuple[int, int, int]:
    """R names the class, G the image, B the split folder it came from: each image says where it belongs."""
    return 40 * cls + 20, 10 * i, 100 * part


def one_line(exc: pytest.ExceptionInfo) -> str:
    assert isinstance(exc.value, UserError) and "\n" not in str(exc.value)
    return str(exc.value)


# --------------------------------------------------------------------------- layouts


def test_flat_layout_carves_a_stratified_deterministic_test_split_and_decodes_in_place(tmp_path):
    counts = {"mango": 5, "Zebra": 10, "apple": 15}   # sorted as ImageFolder sorts: Zebra, apple, mango
    sizes = [(30, 20), (17, 41), (64, 64)]
    for cls, name in enumerate(sorted(counts)):
        for i in range(counts[name]):
            save(tmp_path / name / f"{i:02d}.png", colour(cls, i), sizes[i % 3])
    raw = load_raw("imagefolder", root=tmp_path, image_size=16, test_fraction=0.2)
    assert raw.classes == ["Zebra", "apple", "mango"]
    assert raw.train_images.shape == (24, 3, 16, 16) and raw.test_images.shape == (6, 3, 16, 16)
    assert torch.bincount(raw.test_labels).tolist() == [2, 3, 1]   # 20% of 10, 15, 5
    for images, labels in ((raw.train_images, raw.train_labels), (raw.test_images, raw.test_labels)):
        assert torch.equal(images[:, 0, 0, 0].long(), 40 * labels + 20)   # every image kept its class's label
        assert (images == images[:, :, :1, :1]).all()   # uniform images of every size stay uniform at 16x16
    again = load_raw("imagefolder", root=tmp_path, image_size=16, test_fraction=0.2)
    assert torch.equal(again.test_images, raw.test_images) and torch.equal(again.train_images, raw.train_images)
    data = prepare(raw, image_size=16, seed=3)
    assert data.images.data_ptr() == raw.train_images.data_ptr()   # the decoded tensor itself: no second copy
    assert data.manifest["loader"]["layout"] == "classes" and data.manifest["resize"] == "shorter-side+center-crop"
    assert sorted(data.splits["test"].tolist()) == list(range(24, 30))


def test_split_layout_takes_val_from_its_folder(tmp_path):
    per = {"train": 4, "val": 2, "test": 3}
    for part, name in enumerate(("train", "val", "test")):
        for cls in range(2):
            for i in range(per[name]):
                save(tmp_path / name / f"class{cls}" / f"{i}.png", colour(cls, i, part))
    raw = load_raw("imagefolder", root=tmp_path, image_size=8)
    assert raw.classes == ["class0", "class1"] and raw.given_val == 4
    data = prepare(raw, image_size=8, val_fraction=0.5, seed=0)
    came_from = data.images[:, 2, 0, 0] // 100   # B: the folder of each image
    for part, name in enumerate(("train", "val", "test")):
        idx = data.splits[name]
        assert len(idx) == 2 * per[name] and (came_from[idx] == part).all(), name
        assert torch.equal(data.images[idx, 0, 0, 0].long(), 40 * data.labels[idx] + 20)
    assert data.manifest["val_fraction"] is None and data.manifest["loader"]["val"] == "val/"
    assert torch.equal(prepare(raw, image_size=8, seed=0).splits["val"], data.splits["val"])   # a seed names it
    # without val/, val is carved from train/ as for any dataset
    (tmp_path / "val" / "class0").rename(tmp_path / "class0")
    (tmp_path / "val" / "class1").rename(tmp_path / "class1")
    (tmp_path / "val").rmdir()
    carved = prepare(load_raw("imagefolder", root=tmp_path, image_size=8), image_size=8, val_fraction=0.25)
    assert len(carved.splits["val"]) == 2 and (carved.images[carved.splits["val"], 2, 0, 0] == 0).all()


def test_images_are_resized_on_their_shorter_side_and_centre_cropped(tmp_path):
    """A wide image of red | green | blue thirds (and a tall one of thirds top to bottom) keeps its green centre:
    stretching it to a square would keep every band."""
    wide = np.zeros((30, 90, 3), np.uint8)
    wide[:, :30, 0], wide[:, 30:60, 1], wide[:, 60:, 2] = 255, 255, 255
    Image.fromarray(wide).save(_mkdir(tmp_path / "wide") / "a.png")
    Image.fromarray(wide.transpose(1, 0, 2).copy()).save(_mkdir(tmp_path / "tall") / "a.png")
    raw = load_raw("imagefolder", root=tmp_path, image_size=16, test_fraction=0.5)
    images = torch.cat([raw.train_images, raw.test_images])
    assert images.shape == (2, 3, 16, 16)
    inner = images[:, :, 1:-1, 1:-1]   # the outermost pixels may blend a little with the bands beside
    assert (inner[:, 1] == 255).all() and (inner[:, 0] == 0).all() and (inner[:, 2] == 0).all()
    assert (images[:, 1] > 200).all()


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_files_that_do_not_decode_are_skipped_with_one_warning(tmp_path, caplog):
    for cls in ("a", "b"):
        for i in range(5):
            save(tmp_path / cls / f"{i}.png", colour(ord(cls) - 97, i))
    good = (tmp_path / "a" / "0.png").read_bytes()
    (tmp_path / "a" / "truncated.png").write_bytes(good[: len(good) // 2])
    (tmp_path / "b" / "notes.png").write_text("not an image\n")
    (tmp_path / "b" / "README.txt").write_text("not an image file name: ignored\n")
    with caplog.at_level(logging.WARNING):
        raw = load_raw("imagefolder", root=tmp_path, image_size=8, test_fraction=0.2)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert str(tmp_path / "a" / "truncated.png") in text and str(tmp_path / "b" / "notes.png") in text
    assert "README" not in text and "Traceback" not in text
    assert len(raw.train_labels) + len(raw.test_labels) == 10
    assert [s["path"] for s in raw.notes["skipped"]] == [str(tmp_path / "a" / "truncated.png"),
                                                         str(tmp_path / "b" / "notes.png")]


# --------------------------------------------------------------------------- errors


def test_layout_problems_are_one_line_errors_naming_the_fix(tmp_path):
    with pytest.raises(DatasetNotFoundError) as e:
        load_raw("imagefolder")
    assert "data.root" in one_line(e)
    with pytest.raises(DatasetNotFoundError) as e:
        load_raw("imagefolder", root=tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in one_line(e)

    save(tmp_path / "flat" / "cat" / "0.png", (1, 2, 3))
    (tmp_path / "flat" / "dog").mkdir()
    (tmp_path / "flat" / "dog" / "notes.txt").write_text("no image here\n")
    with pytest.raises(DatasetNotFoundError) as e:
        load_raw("imagefolder", root=tmp_path / "flat")
    assert str(tmp_path / "flat" / "dog") in one_line(e) and "cat" not in one_line(e)

    for part, names in (("train", ["cat", "dog", "owl"]), ("test", ["cat", "dog", "emu"])):
        for name in names:
            save(tmp_path / "split" / part / name / "0.png", (1, 2, 3))
    with pytest.raises(DatasetFormatError) as e:
        load_raw("imagefolder", root=tmp_path / "split")
    msg = one_line(e)
    assert "only in train/: ['owl']" in msg and "only in test/: ['emu']" in msg and "same class folders" in msg

    save(tmp_path / "half" / "train" / "cat" / "0.png", (1, 2, 3))
    with pytest.raises(DatasetFormatError) as e:
        load_raw("imagefolder", root=tmp_path / "half")
    assert "no test/" in one_line(e)


# --------------------------------------------------------------------------- memory


def test_decoding_holds_one_full_size_image_at_a_time(tmp_path, monkeypatch):
    import torchvision.datasets.folder as folder

    for i in range(12):
        save(tmp_path / f"c{i % 2}" / f"{i}.png", colour(i % 2, i), (120, 90))
    alive, most = set(), [0]
    loader = folder.default_loader

    def tracked(path):
        image = loader(path)
        alive.add(id(image))
        weakref.finalize(image, alive.discard, id(image))
        most[0] = max(most[0], len(alive))
        return image

    monkeypatch.setattr(folder, "default_loader", tracked)
    load_raw("imagefolder", root=tmp_path, image_size=8)
    assert most[0] <= 2   # the one being fitted, and the one just loaded before the former's name is rebound


def _status_bytes(key: str) -> int:
    """A size from /proc/self/status (VmRSS: resident now; VmHWM: its peak since the last reset)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def test_preparing_needs_little_more_than_the_prepared_bytes(tmp_path):
    """Peak RSS of loading and preparing 100 large photos at 32 px, after a warm-up: under twice the prepared uint8
    bytes plus a small constant, far below the photos' decoded size (92 MB)."""
    rng = np.random.default_rng(0)
    for i in range(100):
        Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(
            _mkdir(tmp_path / "big" / f"c{i % 3}") / f"{i}.bmp")
    for i in range(12):
        save(tmp_path / "warm" / f"c{i % 3}" / f"{i}.png", (1, 2, 3))
    prepare(load_raw("imagefolder", root=tmp_path / "warm", image_size=32), image_size=32)   # code paths paged in
    try:   # Linux: "5" resets the peak RSS (VmHWM) to the RSS now, so the peak below is this step's alone
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("/proc/self/clear_refs is not writable here")
    base = _status_bytes("VmRSS")
    data = prepare(load_raw("imagefolder", root=tmp_path / "big", image_size=32), image_size=32)
    grown, nbytes = _status_bytes("VmHWM") - base, data.images.nbytes
    assert nbytes == 100 * 3 * 32 * 32
    assert grown < 2 * nbytes + 24 * 2**20, f"peak RSS grew {grown / 2**20:.1f} MiB for {nbytes / 2**20:.2f} MiB"


# --------------------------------------------------------------------------- normalisation


def test_imagenet_normalisation_stores_imagenet_statistics(tmp_path):
    for cls in range(2):
        for i in range(5):
            save(tmp_path / f"c{cls}" / f"{i}.png", colour(cls, i))
    raw = load_raw("imagefolder", root=tmp_path, image_size=8)
    rgb = prepare(raw, image_size=8, normalize="imagenet")
    assert rgb.mean == list(IMAGENET_MEAN) and rgb.std == list(IMAGENET_STD)
    assert rgb.manifest["normalize"] == "imagenet" and rgb.manifest["mean"] == list(IMAGENET_MEAN)
    gray = prepare(raw, image_size=8, channels=1, normalize="imagenet")
    assert gray.mean == pytest.approx([sum(w * m for w, m in zip(LUMA_601, IMAGENET_MEAN))])
    assert gray.std == pytest.approx([sum(w * s for w, s in zip(LUMA_601, IMAGENET_STD))])
    own = prepare(raw, image_size=8)
    assert own.manifest["normalize"] == "dataset"
    red = own.images[own.splits["train"], 0].double() / 255
    assert own.mean[0] == pytest.approx(red.mean().item()) and own.mean != rgb.mean


# --------------------------------------------------------------------------- augmentation


def _pixels(n: int = 16, size: int = 12) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, size, size), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)


def test_augmentation_changes_training_batches_deterministically_per_seed():
    pixels = _pixels()
    before = pixels.clone()
    images, labels = Images(pixels, [0.5] * 3, [0.25] * 3), torch.arange(16)
    on = AugmentOptions(enabled=True)

    def epoch(seed, augment):   # in order: batches differ by their augmentation alone
        return [x for x, _ in batches(images, labels, 8, shuffle=False, seed=seed, augment=augment)]

    plain, first, again, other = epoch(0, None), epoch(0, on), epoch(0, on), epoch(1, on)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, plain))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))
    assert all(torch.equal(a, b) for a, b in zip(epoch(0, AugmentOptions(enabled=False)), plain))
    assert first[0].shape == (8, 3, 12, 12) and first[0].dtype == torch.float32
    assert torch.equal(pixels, before)   # the dataset itself is never changed
    out = augment_pixels(pixels, on, torch.Generator().manual_seed(0))
    assert out.dtype == torch.uint8 and out.shape == pixels.shape


def test_training_augments_its_batches_and_never_the_evaluation_reads(monkeypatch):
    import edgeflux.data.feed as feed
    from edgeflux.train import fit

    seen = []
    real = feed.augment_pixels
    monkeypatch.setattr(feed, "augment_pixels", lambda x, *a: seen.append(len(x)) or real(x, *a))
    train = (Images(_pixels(24), [0.5] * 3, [0.25] * 3), torch.arange(24) % 3)
    val = (Images(_pixels(10), [0.5] * 3, [0.25] * 3), torch.arange(10) % 3)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 12 * 12, 3))
    opts = TrainOptions(epochs=2, evals_per_epoch=2, device="cpu", augment=AugmentOptions(enabled=True))
    fit(model, train, val, opts, batch_size=8)
    assert sum(seen) == 2 * 24 and all(n == 8 for n in seen)   # every training image each epoch, nothing else
    seen.clear()
    fit(model, train, val, opts.model_copy(update={"augment": AugmentOptions()}), batch_size=8)
    assert seen == []


def test_neuroflux_refuses_augmentation_in_one_line():
    import yaml

    from edgeflux.config import ParamsError, validate

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["train_bp"]["augment"] = {"enabled": True, "scale": [0.5, 1.0]}
    assert validate(raw).train_bp.augment.scale == [0.5, 1.0]
    raw["neuroflux"]["augment"] = {"enabled": True}
    with pytest.raises(ParamsError) as e:
        validate(raw)
    assert "neuroflux.augment" in one_line(e) and "cached activations" in str(e.value)


# --------------------------------------------------------------------------- incoming samples


def test_incoming_samples_of_an_imagefolder_dataset_are_cropped_as_its_images(tmp_path):
    for cls in range(2):
        for i in range(5):
            save(tmp_path / "photos" / f"c{cls}" / f"{i}.png", colour(cls, i))
    data = prepare(load_raw("imagefolder", root=tmp_path / "photos", image_size=8), image_size=8)
    wide = np.zeros((10, 30, 3), np.uint8)
    wide[:, 10:20, 1] = 255
    Image.fromarray(wide).save(_mkdir(tmp_path / "incoming" / "1") / "new.png")
    incoming = load_incoming(tmp_path / "incoming", data)
    assert incoming.labels.tolist() == [1] and (incoming.images[0, 1, 1:-1, 1:-1] == 255).all()
