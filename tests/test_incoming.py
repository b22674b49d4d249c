"""data/incoming: new labelled samples join the split a device stage trains on, converted as prepare() converts."""
from pathlib import Path

import pytest
import torch
from PIL import Image

from edgeflux.data import Images, RawDataset, load_raw, prepare, tensors
from edgeflux.data.incoming import IncomingDataError, add_incoming, find_incoming, load_incoming


def write_png(path: Path, image: torch.Tensor) -> None:
    """uint8 [C, H, W] (C = 1 or 3) as a lossless PNG."""
    path.parent.mkdir(parents=True, exist_ok=True)
    array = image[0].numpy() if image.shape[0] == 1 else image.permute(1, 2, 0).numpy()
    Image.fromarray(array).save(path)


@pytest.fixture(scope="module")
def raw_subset():
    return load_raw("mnist-subset")


def test_incoming_samples_join_the_split_after_its_limit(mnist_subset, raw_subset, tmp_path):
    """Real MNIST images saved as PNGs come back with their labels and the pixels prepare() gave them,
    after the first `limit` images of target_train, which stay as they were."""
    picks = [3, 17, 250, 999, 3999]   # rows of the raw train set = rows of the prepared images (train first)
    for i in picks:
        write_png(tmp_path / str(int(raw_subset.train_labels[i])) / f"sample{i}.png", raw_subset.train_images[i])
    (tmp_path / "README.md").write_text("layout\n")
    (tmp_path / "3").mkdir(exist_ok=True)
    (tmp_path / "3" / "notes.txt").write_text("not an image\n")

    split = tensors(mnist_subset, "target_train", limit=100)
    incoming = load_incoming(tmp_path, mnist_subset)
    images, labels = add_incoming(split, incoming)

    assert len(incoming) == len(picks) and len(images) == len(labels) == 100 + len(picks)
    order = sorted(picks, key=lambda i: (int(raw_subset.train_labels[i]), f"sample{i}.png"))  # sorted by folder, name
    assert torch.equal(labels[100:], raw_subset.train_labels[order])
    assert torch.equal(images.pixels[100:], mnist_subset.images[order])
    assert torch.equal(images.pixels[:100], split[0].pixels) and torch.equal(labels[:100], split[1])
    expected = Images(mnist_subset.images[order], mnist_subset.mean, mnist_subset.std)
    assert torch.equal(images[100:], expected[:])   # normalised with the prepared data's statistics


def test_any_size_and_colour_converts_as_prepare_does(tmp_path):
    """40x40 RGB samples for 32x32 gray data: the same luma-then-antialiased-resize as prepare()."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (12, 3, 40, 40), dtype=torch.uint8, generator=gen)
    y = torch.arange(12) % 2
    raw = RawDataset("synthetic", ["a", "b"], x, y, x[:4], y[:4], sources=[])
    data = prepare(raw, image_size=32, channels=1, val_fraction=0.5, split_by="none")
    for i in range(12):
        write_png(tmp_path / str(int(y[i])) / f"{i:02d}.png", x[i])
    incoming = load_incoming(tmp_path, data)
    order = [i for c in (0, 1) for i in range(12) if y[i] == c]
    assert incoming.images.shape == (12, 1, 32, 32)
    assert torch.equal(incoming.images, data.images[order])
    assert torch.equal(incoming.labels, y[order])


def test_missing_or_empty_directory_changes_nothing(mnist_subset, tmp_path):
    split = tensors(mnist_subset, "target_train", limit=10)
    (tmp_path / "README.md").write_text("layout\n")
    (tmp_path / "4").mkdir()   # a class folder with no images yet
    for root in (tmp_path / "absent", tmp_path):
        incoming = load_incoming(root, mnist_subset)
        assert len(incoming) == 0 and incoming.images.shape == (0, 1, 32, 32)
        assert add_incoming(split, incoming) is split


@pytest.mark.parametrize("where, content, message", [
    ("shirt/a.png", "png", r"incoming/shirt: a class folder is named by its class id, 0\.\.9 .*rename it"),
    ("10/a.png", "png", r"incoming/10: a class folder is named by its class id, 0\.\.9"),
    ("a.png", "png", r"incoming/a.png is outside any class folder: move it into .*/<class id>/"),
    ("3/broken.png", b"not a png", r"incoming/3/broken.png is not a readable image .*replace or delete it"),
    ("3/cut.png", "cut", r"incoming/3/cut.png is not a readable image .*replace or delete it"),
])
def test_bad_input_is_one_line_naming_the_file_and_the_fix(mnist_subset, tmp_path, where, content, message):
    path = tmp_path / "incoming" / where
    if content in ("png", "cut"):
        write_png(path, mnist_subset.images[0])
        if content == "cut":   # a copy that stopped half-way
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.parent.mkdir(parents=True)
        path.write_bytes(content)
    with pytest.raises(IncomingDataError, match=message) as err:
        load_incoming(tmp_path / "incoming", mnist_subset)
    assert "\n" not in str(err.value) and "dvc add data/incoming" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_stages_report_bad_incoming_data_as_a_user_error():
    from edgeflux.errors import UserError   # what run_stage shows as one line, without a traceback

    assert issubclass(IncomingDataError, UserError)


def test_find_incoming_skips_hidden_entries_and_non_images(tmp_path):
    for name in ("2/a.PNG", "2/b.jpg", "2/sub/c.bmp", "2/.ipynb_checkpoints/d.png", ".cache/e.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "2" / "labels.csv").write_text("x\n")
    assert [(p.relative_to(tmp_path).as_posix(), c) for p, c in find_incoming(tmp_path, 10)] == [
        ("2/a.PNG", 2), ("2/b.jpg", 2), ("2/sub/c.bmp", 2)]


def png_header(width: int, height: int) -> bytes:
    """A PNG that says it is width x height (8-bit RGB) and holds no pixel data: what PIL reads first."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("width, height", [(20_000, 20_000), (8_000, 7_000)])   # PIL's own bomb error; ours
def test_an_image_over_the_pixel_limit_is_refused_before_it_is_decoded(mnist_subset, tmp_path, width, height):
    path = tmp_path / "incoming/3/huge.png"
    path.parent.mkdir(parents=True)
    path.write_bytes(png_header(width, height))
    with pytest.raises(IncomingDataError, match=r"incoming/3/huge.png .*over the 48-megapixel limit for one "
                                                r"incoming image.*; downscale it, then version it again") as err:
        load_incoming(tmp_path / "incoming", mnist_subset)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("link", ["file", "folder", "nested"])
def test_a_symbolic_link_under_incoming_is_refused_before_anything_reads_or_versions_it(mnist_subset, tmp_path,
                                                                                       monkeypatch, link):
    """A linked file would put a host file (/etc/passwd) into DVC's cache and the shared remote; a linked folder
    would train on data DVC does not version. The retrain flow checks before `dvc add`."""
    from pipeline.flows import track_new_data

    outside = tmp_path / "outside"
    write_png(outside / "a.png", mnist_subset.images[0])
    incoming = tmp_path / "data/incoming"
    write_png(incoming / "3/ok.png", mnist_subset.images[1])
    where = {"file": incoming / "3/passwd.png", "folder": incoming / "5", "nested": incoming / "3/more"}[link]
    where.symlink_to(outside / "a.png" if link == "file" else outside)
    with pytest.raises(IncomingDataError, match=rf"{where} is a symbolic link \(to {outside}.*\): incoming data is "
                                                r"regular files inside .* only; copy the files in instead"):
        load_incoming(incoming, mnist_subset)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(IncomingDataError, match="is a symbolic link"):
        track_new_data.fn()
    assert not list(incoming.glob("*.dvc"))   # nothing versioned, so nothing to push
    where.unlink()
    assert len(load_incoming(incoming, mnist_subset)) == 1
