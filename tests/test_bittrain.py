"""BitTrain: the bitmap format is exact and exactly sized; compressed saved activations give
bit-identical gradients on real Fashion-MNIST images and measurably less memory."""
import contextlib
import copy
import gc
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from edgeflux.bittrain import (BitmapTensor, BitTrainOptions, CompressedActivations, FloatTensorRequired,
                               SavedTensorModifiedError, compress, compressed_activations, theoretical_bytes)
from edgeflux.bittrain.doublemask import DoubleMaskError
from edgeflux.bittrain import hooks, kernel
from edgeflux.bittrain.bitmap import MAX_CHUNK, _chunk, count_kept, pack_bits
from edgeflux.bittrain.packed import Kept, Narrowed, Packed
from edgeflux.memory import OUTSIDE_UNITS, measure_step, track_live_tensors, training_step_fn
from edgeflux.models import build_model

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns in logical order (so -0.0 != 0.0 and NaN == NaN)."""
    return t.reshape(-1).contiguous().view(INT_OF[t.element_size()])


def nonzero_bits(t: torch.Tensor) -> int:
    return int((bits(t) != 0).sum())


def _compiled_kernel(portable: bool):
    """The compiled kernel with its AVX-512 loops (where the CPU has them) or its portable loops (an ARM board's)."""
    if not kernel.available():
        pytest.skip("the C++ bitmap kernel could not be built here (needs g++ and ninja)")
    return kernel.portable_loops() if portable else contextlib.nullcontext()


@pytest.fixture(params=["kernel", "kernel-portable", "torch"])
def bitmap_path(request):
    """Run a test on the compiled CPU kernel (both loop kinds) and on the torch-op path (all write the same format)."""
    with kernel.disabled() if request.param == "torch" else _compiled_kernel(request.param == "kernel-portable"):
        yield request.param


@pytest.fixture(scope="module")
def fmnist():
    """64 real Fashion-MNIST training images at 32x32, normalised as the pipeline does."""
    from edgeflux.data import load_raw, prepare, tensors
    x, y = tensors(prepare(load_raw("fashion-mnist"), image_size=32), "train", limit=64)
    return x[:], y


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    relu = torch.relu(torch.randn(4, 6, 5, 7, generator=g))
    return {
        "relu_4d": relu,
        "scalar_0d": torch.tensor(2.5),
        "scalar_zero": torch.tensor(0.0),
        "scalar_neg_zero": torch.tensor(-0.0),
        "empty": torch.empty(0, 3),
        "all_zero": torch.zeros(13),
        "all_zero_groups": torch.zeros(5, 67),          # whole 16-element groups with nothing to store
        "all_nonzero": torch.rand(37, generator=g) + 1,
        "odd_length": torch.relu(torch.randn(1001, generator=g)),
        "specials": torch.tensor([float("nan"), -0.0, 0.0, float("inf"), -float("inf"), 1e-30, -2.0]),
        "channels_last": relu.contiguous(memory_format=torch.channels_last),
        "transposed": torch.relu(torch.randn(6, 8, generator=g)).t(),
        "strided_slice": relu[:, ::2, 1:, :],
        "expanded": torch.relu(torch.randn(5, 1, generator=g)).expand(5, 4),
        "several_chunks": torch.relu(torch.randn(3 * MAX_CHUNK + 13, generator=g)),   # last chunk partial
    }


# ----------------------------------------------------------------------------- bitmap format

@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("case", list(_cases()))
def test_round_trip_is_exact_and_sized_exactly(case, dtype, bitmap_path):
    t = _cases()[case].to(dtype)
    packed = compress(t)
    out = packed.decompress()
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(bits(out), bits(t))                      # every bit, -0.0 and NaN included
    n, nnz = t.numel(), nonzero_bits(t)
    assert packed.nnz == nnz
    assert packed.nbytes == math.ceil(n / 8) + nnz * t.element_size() == theoretical_bytes(n, nnz, t.element_size())
    # what it holds is exactly its own memory, not views of larger storages
    assert packed.bitmap.dtype == torch.uint8 and packed.bitmap.numel() == math.ceil(n / 8)
    assert packed.bitmap.untyped_storage().nbytes() == packed.bitmap.numel()
    assert packed.values.untyped_storage().nbytes() == nnz * t.element_size()


@pytest.mark.parametrize("case", ["channels_last", "transposed"])
def test_memory_layout_is_restored(case, bitmap_path):
    t = _cases()[case]
    out = compress(t).decompress()
    assert out.stride() == t.stride() and torch.equal(out, t)


@pytest.mark.parametrize("threshold", [0.0, 0.1])
def test_compressing_needs_one_chunk_of_temporaries_not_a_tensors_worth(threshold, bitmap_path):
    """Compression runs while the forward holds the dense tensor: its transient memory adds to the peak.
    Measured: the compiled kernel allocates nothing but its result; the torch-op path at most a
    chunk's buffers (about 30 bytes per chunk element), far below the dense tensor's own bytes
    (whole-tensor masks and copies would exceed it)."""
    t = torch.relu(torch.randn(1 << 23, generator=torch.Generator().manual_seed(0)))
    with track_live_tensors(seed=[t]) as tracker:
        before = tracker.current_bytes
        packed = compress(t, threshold=threshold)
        transient = tracker.peak_bytes - before - packed.nbytes
    if bitmap_path.startswith("kernel"):
        assert transient == 0
    else:
        assert 0 < transient <= 32 * _chunk(t.numel()) <= t.numel() * t.element_size() // 4


@pytest.fixture(params=["vector", "portable"])
def kernel_loops(request):
    with _compiled_kernel(request.param == "portable"):
        yield request.param


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("store_dtype", [None, torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("threshold", [0.0, 0.05, 1.0])
def test_kernel_and_torch_paths_write_the_same_bytes(dtype, store_dtype, threshold, kernel_loops):
    """The compiled kernel and the torch ops produce identical bitmaps and values (every size class:
    a partial byte, a partial 16-element group, several kernel blocks) and restore each other's output.
    (No NaN here: the torch path's scatter canonicalises bfloat16 NaN payloads; the round-trip test
    checks NaN bits on each path.)"""
    g = torch.Generator().manual_seed(1)
    for n in (1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, (1 << 16) * 3 + 5):
        t = torch.relu(torch.randn(n, generator=g)).to(dtype)
        if n > 4:
            t[1], t[3] = -0.0, float("inf")
        if n > 64:
            t[n // 2 - 40: n // 2 + 40] = 0         # whole groups with no value (the vector loops skip their store/load)
            # float16 storage's edge cases: a subnormal, an overflow to inf, and two ties (round to even)
            t[5:10] = torch.tensor([1e-6, 7e4, 1 + 2 ** -11, 1 + 3 * 2 ** -11, -2.0 ** -24], dtype=torch.float64).to(dtype)
        a = compress(t, threshold=threshold, store_dtype=store_dtype)
        with kernel.disabled():
            b = compress(t, threshold=threshold, store_dtype=store_dtype)
        assert torch.equal(a.bitmap, b.bitmap), n
        assert a.values.dtype == b.values.dtype and torch.equal(bits(a.values), bits(b.values)), n
        from_torch = b.decompress()          # restored by the kernel
        with kernel.disabled():
            from_kernel = a.decompress()     # restored by torch ops
        assert torch.equal(bits(from_torch), bits(from_kernel)), n


@pytest.mark.parametrize("threshold", [0.0, 0.05])
def test_kernel_block_size_does_not_change_the_bytes(threshold, kernel_loops):
    """Blocks that split a 16-element group (8, 24, 40: the vector loops' tails inside a block) write
    and restore the same bytes as one whole block."""
    g = torch.Generator().manual_seed(2)
    for n in (5, 16, 100, 1001):
        t = torch.relu(torch.randn(n, generator=g))
        ref_bitmap, ref_values, ref_nnz = kernel.compress(t, threshold, None, -1, 1 << 16)
        for block in (8, 24, 40):
            bitmap, values, nnz = kernel.compress(t, threshold, None, -1, block)
            assert nnz == ref_nnz and torch.equal(bitmap, ref_bitmap) and torch.equal(values, ref_values), (n, block)
            out = torch.full_like(t, float("nan"))
            kernel.decompress_into(bitmap, values, block, out)
            assert torch.equal(out, torch.where(t.abs() < threshold, 0.0, t) if threshold else t), (n, block)


@pytest.mark.skipif(not kernel.available(), reason="the C++ bitmap kernel could not be built here")
def test_kernel_narrow_index_picks_the_smallest_integer_type_that_holds_every_value():
    x = torch.randint(-1000, 30000, ((1 << 16) + 3,), generator=torch.Generator().manual_seed(3))
    for extreme, dtype in ((32767, torch.int16), (-32768, torch.int16), (32768, torch.int32),
                           (-(2**31), torch.int32), (2**31, None), (-(2**40), None)):
        x[-1] = extreme                 # in the last, partial chunk: every chunk's verdict counts
        out = kernel.narrow_index(x)
        if dtype is None:
            assert out.numel() == 0
        else:
            assert out.dtype == dtype and torch.equal(out.long(), x), extreme


@pytest.mark.skipif(not kernel.available(), reason="the C++ bitmap kernel could not be built here")
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_kernel_activation_mask_matches_torch(dtype):
    """range_mask: bit i = lo < x < hi (NaN never inside, hi = inf unbounded) in the bitmap layout, and
    the count of non-zero bit patterns; fill_from_mask restores inside/outside values from it."""
    g = torch.Generator().manual_seed(4)
    for n in (1, 7, 8, 15, 16, 17, 100, 1001, 70_000):
        x = (torch.randn(n, generator=g) * 5).to(dtype)
        if n > 6:
            x[1], x[2], x[3], x[4], x[5] = float("nan"), 6.0, 0.0, float("inf"), -0.0
        for lo, hi in ((0.0, 6.0), (0.0, math.inf), (-1.0, 1.0)):
            inside = (x > lo) & (x < hi) if hi != math.inf else x > lo
            padded = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.bool)
            padded[:n] = inside
            bitmap, nonzero = kernel.range_mask(x, lo, hi)
            assert torch.equal(bitmap, pack_bits(padded)), (n, lo, hi)
            assert nonzero == int(torch.count_nonzero(x.view(torch.int16 if x.element_size() == 2 else
                                                             torch.int32 if x.element_size() == 4 else torch.int64)))
            out = torch.empty(n, dtype=dtype)
            kernel.fill_from_mask(bitmap, 3.0, lo, out)
            assert torch.equal(out, torch.where(inside, 3.0, lo).to(dtype)), (n, lo, hi)


@pytest.mark.skipif(not kernel.available(), reason="the C++ bitmap kernel could not be built here")
@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_kernel_count_each_counts_like_count_kept(threshold):
    """One call for many tensors (small saved tensors are counted in batches) = one count per tensor."""
    g = torch.Generator().manual_seed(5)
    tensors = []
    for dtype in FLOATS:
        for n in (0, 1, 7, 16, 17, 1000):
            t = (torch.relu(torch.randn(n, generator=g)) * torch.randn(n, generator=g)).to(dtype)
            if n > 3:
                t[1], t[2], t[3] = -0.0, float("nan"), 0.25
            tensors.append(t.reshape(-1, 1) if n % 2 else t)
    with kernel.disabled():
        expected = [count_kept(t, threshold) for t in tensors]
    assert kernel.count_each(tensors, threshold) == expected


def test_small_tensors_counted_in_batches_add_up_the_same(monkeypatch, fmnist, bitmap_path):
    """BatchNorm's saved means and inverse stds (below min_bytes) are counted at the end of the block, or
    whenever the batch reaches SMALL_BATCH_BYTES: per-unit figures do not depend on when."""
    torch.manual_seed(0)
    model = build_model("mobilenet_v2", width=0.25)
    x, y = fmnist[0][:4], fmnist[1][:4]
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    ends = _train_step(a, x, y, compressed_activations(units=a)).summary()["units"]
    monkeypatch.setattr(hooks, "SMALL_BATCH_BYTES", 1)
    each = _train_step(b, x, y, compressed_activations(units=b)).summary()["units"]
    assert ends == each
    small = sum(u["small"] for u in ends.values())
    assert small > 50 and sum(u["nnz"] for u in ends.values()) > 0


def test_bitmap_layout_every_byte_pattern(bitmap_path):
    """Element 8g+k is bit k of byte g: all 256 patterns pack to their own value and back."""
    patterns = torch.arange(256)
    mask = ((patterns.unsqueeze(1) >> torch.arange(8)) & 1).bool().reshape(-1)
    t = torch.where(mask, torch.arange(1.0, 2049.0), 0.0)
    packed = compress(t)
    assert torch.equal(packed.bitmap, patterns.to(torch.uint8))
    assert torch.equal(packed.values, t[mask])
    assert torch.equal(packed.decompress(), t)


def test_theoretical_bytes_formula():
    assert theoretical_bytes(16 * 64 * 56 * 56, 0) == 401_408                   # the bitmap alone: n/8
    assert theoretical_bytes(2_408_448, 2_408_448) == 4 * 2_408_448 + 301_056   # 100% non-zero: +3.125%
    assert theoretical_bytes(9, 3, itemsize=2) == 6 + 2                         # ceil(9/8) = 2


def test_pruning_drops_exactly_small_magnitudes(bitmap_path):
    t = torch.tensor([0.0, -0.0, 0.009, -0.0099, 0.01, -0.01, 0.5, -3.0, float("nan"), float("inf")])
    packed = compress(t, threshold=0.01)
    keep = ~(t.abs() < 0.01)                        # NaN is not < threshold: kept
    assert torch.equal(bits(packed.values), bits(t[keep]))
    out = packed.decompress()
    assert torch.equal(bits(out), bits(torch.where(keep, t, 0.0)))
    assert packed.nbytes == 2 + 4 * int(keep.sum())
    relu = _cases()["relu_4d"]
    for thr in (0.01, 0.1, 1.0):
        p = compress(relu, threshold=thr)
        assert p.nnz == int((relu.abs() >= thr).sum())
        assert torch.equal(p.decompress(), torch.where(relu.abs() < thr, 0.0, relu))


def test_fp16_store_halves_value_bytes(bitmap_path):
    t = _cases()["odd_length"]
    full, half = compress(t), compress(t, store_dtype=torch.float16)
    assert half.values.dtype == torch.float16 and half.nnz == full.nnz
    assert half.values.untyped_storage().nbytes() * 2 == full.values.untyped_storage().nbytes()
    assert half.nbytes == math.ceil(t.numel() / 8) + 2 * full.nnz
    out = half.decompress()
    assert out.dtype == torch.float32 and torch.equal(out, t.half().float())   # approximate: fp16 rounding


def test_compress_refuses_integer_tensors():
    with pytest.raises(FloatTensorRequired, match="max-pool indices"):
        compress(torch.arange(10))
    with pytest.raises(ValueError, match="threshold"):
        compress(torch.ones(3), threshold=-1)


# ----------------------------------------------------------------------------- saved-tensor hooks

def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _train_step(model: nn.Module, x, y, context=None, seed: int = 1):
    torch.manual_seed(seed)   # MobileNetV2's dropout draws the same mask in both runs
    model.zero_grad(set_to_none=True)
    if context is None:
        F.cross_entropy(model(x), y).backward()
        return None
    with context as ca:
        F.cross_entropy(model(x), y).backward()
    return ca


MODELS = [("vgg16", {"batch_norm": False}), ("vgg16", {}), ("resnet18", {}), ("mobilenet_v2", {})]


@pytest.mark.parametrize("name,kw", MODELS, ids=["vgg16_nobn", "vgg16_bn", "resnet18", "mobilenet_v2"])
def test_gradients_bit_identical(fmnist, name, kw, bitmap_path):
    torch.manual_seed(0)
    model = build_model(name, width=0.25, **kw)
    twin = copy.deepcopy(model)
    x, y = fmnist[0][:4], fmnist[1][:4]
    _train_step(model, x, y)
    ca = _train_step(twin, x, y, compressed_activations(units=twin))
    for (pname, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), pname
    total = ca.summary()["total"]
    assert total["compressed"] > 0 and total["stored_bytes"] < total["dense_bytes"]
    assert set(ca.summary()["units"]) == set(model.unit_names) | {OUTSIDE_UNITS}
    # MobileNetV2's in-place ReLU6 input copies are held as 1-bit masks (activation_masks, on by default)
    assert (total["mask_only"] > 0) == (name == "mobilenet_v2")


def test_activation_masks_hold_relu6_input_copies_as_one_bit(fmnist, bitmap_path):
    """Each in-place ReLU6's saved input copy: nothing, or n/8 bytes, instead of 4n (it is dense, so
    a bitmap would not shrink it); gradients stay bit-identical (checked above); off, the copies
    stay dense."""
    torch.manual_seed(0)
    model = build_model("mobilenet_v2", width=0.25)
    x, y = fmnist[0][:4], fmnist[1][:4]
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    on = _train_step(a, x, y, compressed_activations(units=a)).total()
    off = _train_step(b, x, y, compressed_activations(units=b, activation_masks=False)).total()
    relu6 = sum(isinstance(m, nn.ReLU6) and m.inplace for m in model.modules())
    assert on.mask_only == relu6 > 0 and off.mask_only == 0
    assert on.dense_bytes == off.dense_bytes
    assert off.stored_bytes - on.stored_bytes > 0.25 * off.stored_bytes


class _Relu6Net(nn.Module):
    """conv-BN-ReLU6 into a conv (which saves the ReLU6 output), then conv-BN-ReLU6 into a mean
    (which saves nothing) and a linear layer: MobileNetV2's two situations."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(inplace=True))
        self.b = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(inplace=True))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x)).mean((2, 3)))


@pytest.mark.parametrize("threshold,store_dtype", [(0.0, None), (0.05, None), (0.0, torch.float16)],
                         ids=["lossless", "pruned", "fp16"])
def test_relu6_input_copy_is_read_from_the_output_when_storage_is_lossless(bitmap_path, threshold, store_dtype):
    """Lossless: the copy holds nothing and backward reads the ReLU6 output's bitmap, the same holder
    the next conv got; where no operation saves the output (ReLU6 into a mean), and whenever storage
    is lossy (pruning could zero an output inside (0, 6), fp16 round 5.9999 to 6), it is a 1-bit mask.
    Lossless, every gradient is bit-identical to plain training's."""
    from edgeflux.bittrain.masked import MaskOnly
    torch.manual_seed(0)
    net = _Relu6Net()
    x = torch.randn(4, 3, 12, 12) * 3          # activations on both sides of 0 and 6
    plain, m = copy.deepcopy(net), copy.deepcopy(net)
    plain(x).square().sum().backward()
    ca = compressed_activations(units=m, threshold=threshold, store_dtype=store_dtype)
    holders = []
    pack = ca._pack
    ca._pack = lambda t: holders.append(pack(t)) or holders[-1]   # (hooks are installed from the instance)
    with ca:
        m(x).square().sum().backward()
    first, second = [h for h in holders if isinstance(h, MaskOnly)]
    lossless = threshold == 0 and store_dtype is None
    assert (first.output is not None) == lossless and (first.bitmap is None) == lossless
    if lossless:
        assert any(h is first.output for h in holders)        # the conv's save of the output
        for p, q in zip(plain.parameters(), m.parameters()):
            assert torch.equal(p.grad, q.grad)
    assert second.output is None and second.bitmap is not None
    n = 4 * 8 * 12 * 12
    masks = 1 if lossless else 2
    assert ca.total().mask_only == 2
    assert sum(h.bitmap.numel() for h in (first, second) if h.bitmap is not None) == masks * n // 8


@pytest.mark.parametrize("dtype,lo,hi", [(torch.bfloat16, 0.1, 0.9), (torch.float16, 0.3, 6.0),
                                         (torch.float16, 0.0, 0.1), (torch.bfloat16, 0.0, 6.0)])
def test_hardtanh_bounds_not_exact_in_the_dtype_keep_gradients_bit_identical(bitmap_path, dtype, lo, hi):
    """Hardtanh's backward compares the saved value with the Python bound in float; a mask made in
    bfloat16 compares with bfloat16(0.1) > 0.1 instead. Such copies are stored normally (exact); with
    bounds the dtype holds exactly (ReLU6: 0 and 6) they still become masks."""
    from edgeflux.bittrain.masked import MaskOnly
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Hardtanh(lo, hi, inplace=True), nn.Conv2d(8, 4, 3)).to(dtype)
    x = (torch.rand(4, 3, 10, 10) * 2 - 0.5).to(dtype)    # conv outputs on both sides of the bounds
    plain, m = copy.deepcopy(net), copy.deepcopy(net)
    plain(x).float().square().sum().backward()
    ca = compressed_activations(units=[("net", m)])
    holders = []
    pack = ca._pack
    ca._pack = lambda t: holders.append(pack(t)) or holders[-1]
    with ca:
        m(x).float().square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), m.parameters()):
        assert torch.equal(p.grad, q.grad), name
    exact = float(torch.tensor(lo, dtype=dtype)) == lo and float(torch.tensor(hi, dtype=dtype)) == hi
    assert any(isinstance(h, MaskOnly) for h in holders) == exact


@pytest.mark.parametrize("name", ["vgg16", "resnet18"])
def test_unit_model_attribution_without_hooks_matches_module_hooks(fmnist, name):
    """units=UnitModel reads the model's running_unit (no module hooks); (name, module) pairs use
    hooks. Both attribute every saved tensor to the same unit."""
    torch.manual_seed(0)
    model = build_model(name, width=0.25)
    x, y = fmnist[0][:4], fmnist[1][:4]
    fast = compressed_activations(units=model)
    hooked = compressed_activations(units=list(zip(model.unit_names, model.units)))
    for ctx in (fast, hooked):
        _train_step(model, x, y, ctx)
    assert fast._tracker.model is model and hooked._tracker.model is None
    per_unit = {k: v for k, v in fast.summary()["units"].items()}
    assert per_unit == hooked.summary()["units"]
    assert sum(u["tensors"] > 0 for u in per_unit.values()) >= len(model.unit_names) - 1
    assert model.running_unit is None               # reset after the forward


def test_parameters_views_and_indices_never_reach_storage(fmnist):
    torch.manual_seed(0)
    model = build_model("vgg16", width=0.25, batch_norm=False)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ca = compressed_activations(units=model, min_bytes=0)
    stored = []
    original = ca.store
    ca.store = lambda t, stats: stored.append(t) or original(t, stats)
    _train_step(model, *fmnist, context=ca)
    assert stored and all(t.is_floating_point() for t in stored)              # no max-pool indices
    assert all(t.untyped_storage().data_ptr() not in param_storages for t in stored)
    views_of_leaves = [t for t in stored if t._base is not None and t._base.is_leaf and t._base.requires_grad]
    assert not any(isinstance(t, nn.Parameter) for t in stored) and not views_of_leaves
    # per conv: weight (+ bias not saved); classifier: weight.t() view; pools: indices
    assert ca.not_activations >= 13 + 1 + 5


@pytest.mark.parametrize("side,dtype", [(32, torch.int16), (256, torch.int32)])
def test_max_pool_indices_are_narrowed_exactly(side, dtype, bitmap_path):
    """Max-pool's int64 indices (positions within a side x side map) are held as int16 when they fit,
    int32 when not (256*256 > 32767), widened back with the same strides: gradients bit-identical."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 2, 3))
    twin = copy.deepcopy(net)
    x = torch.randn(2, 1, side, side).contiguous(memory_format=torch.channels_last)
    net(x).square().sum().backward()
    with compressed_activations(units=twin) as ca:
        out = twin(x).square().sum()
    out.backward()
    for p, q in zip(net.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)
    pool = ca.stats["2"]
    n = 2 * 4 * (side // 2) ** 2
    assert pool.narrowed == 1 and pool.index_dense_bytes == 8 * n
    assert pool.index_stored_bytes == n * dtype.itemsize
    with compressed_activations(units=twin, narrow_indices=False) as off:
        twin(x).sum().backward()
    assert off.total().narrowed == 0
    # the holder itself: narrow dtype, widened back with the original (channels_last) strides
    _, idx = F.max_pool2d(torch.relu(twin[0](x)), 2, return_indices=True)
    with compressed_activations(min_bytes=0) as ca:
        holder = ca._pack(idx)
    assert isinstance(holder, Narrowed) and holder.data.dtype == dtype
    back = holder.unpack()
    assert back.dtype == torch.int64 and back.stride() == idx.stride() and torch.equal(back, idx)
    big = torch.full((1024,), 1 << 40)                              # values beyond int32: kept as they are
    with compressed_activations(min_bytes=0) as ca:
        holder = ca._pack(big)
    assert holder.data.dtype == torch.int64 and ca.total().narrowed == 0
    back = holder.unpack()
    assert back.data_ptr() == big.data_ptr() and torch.equal(back, big)   # the original memory, not a copy


def test_a_reused_id_never_returns_another_tensors_holder():
    """Deduplication is keyed by id(); an entry whose tensor is gone (its id now another tensor's)
    or was modified in place since is a miss, so the tensor is stored on its own."""
    a, b = torch.relu(torch.randn(64, 64)), torch.relu(torch.randn(64, 64))
    with compressed_activations(min_bytes=0) as ca:
        held = ca._pack(a)
        ca._seen[id(b)] = ca._seen[id(a)]          # as if b had taken a's id after a was freed
        other = ca._pack(b)
        assert other is not held and torch.equal(other.unpack(), b)
        assert ca._pack(a) is held                 # a itself still finds its holder
        a.mul_(2)                                  # ... until it changes in place
        assert ca._pack(a) is not held


def test_env_switch_turns_the_kernel_off():
    code = "from edgeflux.bittrain import kernel; print(kernel.available())"
    env = {**os.environ, "EDGEFLUX_BITTRAIN_KERNEL": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_shared_relu_output_is_stored_once():
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(8, 8, 3, padding=1))
    x = torch.randn(4, 3, 16, 16)
    with compressed_activations(units=net) as ca:
        net(x).sum().backward()
    relu_out = ca.stats["1"]            # the ReLU unit: its output is saved by relu_ ...
    conv2 = ca.stats["2"]               # ... and by the second conv, which finds it already stored
    assert relu_out.packs == 1 and relu_out.tensors == 1 and relu_out.compressed == 1
    assert conv2.packs == 1 and conv2.tensors == 0
    total = ca.total()
    assert total.packs == total.tensors + 1


def test_dense_kept_when_bitmap_would_be_bigger():
    net = nn.Sequential(nn.Linear(64, 256), nn.Sigmoid(), nn.Linear(256, 8))
    x = torch.randn(32, 64)
    with compressed_activations(units=net) as ca:
        net(x).sum().backward()
    sig = ca.stats["1"]                 # sigmoid output: no zeros, 32 KiB; a bitmap would be 3.1% bigger
    assert sig.kept_dense == 1 and sig.compressed == 0
    assert sig.stored_bytes == sig.dense_bytes == 32 * 256 * 4
    assert sig.theoretical_bytes == 32 * 256 * 4 + 32 * 256 // 8


def test_inplace_change_after_save_raises_like_autograd():
    a = torch.randn(64, 64, requires_grad=True)
    with compressed_activations(min_bytes=0):
        b = torch.relu(a * 2)
        c = b.sin()
    b.mul_(3)
    with pytest.raises(SavedTensorModifiedError, match="modified by an inplace operation"):
        c.sum().backward()


def test_checkpoint_nested_hooks_still_identical(fmnist):
    torch.manual_seed(0)
    model = build_model("vgg16", width=0.25, batch_norm=False)
    twin = copy.deepcopy(model)
    x, y = fmnist[0][:4], fmnist[1][:4]
    _train_step(model, x, y)

    def forward(m, inp):
        h = m.forward_until(inp, 4)
        h = checkpoint(nn.Sequential(*m.units[4:10]), h, use_reentrant=False)
        return nn.Sequential(*m.units[10:])(h)

    twin.zero_grad()
    with compressed_activations(units=twin) as ca:
        F.cross_entropy(forward(twin, x), y).backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert ca.total().compressed > 0     # the checkpoint's saved input went through these hooks


def test_fp16_storage_and_pruning_are_close_not_exact(fmnist):
    torch.manual_seed(0)
    model = build_model("vgg16", width=0.25, batch_norm=False)
    x, y = fmnist[0][:8], fmnist[1][:8]
    ref = copy.deepcopy(model)
    _train_step(ref, x, y)
    g_ref = torch.cat([p.grad.flatten() for p in ref.parameters()])
    fp32 = _train_step(copy.deepcopy(model), x, y, compressed_activations(units=model))
    half_model = copy.deepcopy(model)
    half = _train_step(half_model, x, y, compressed_activations(units=half_model, store_dtype="float16"))
    g_half = torch.cat([p.grad.flatten() for p in half_model.parameters()])
    assert 0 < (g_half - g_ref).norm() / g_ref.norm() < 1e-2
    a, b = fp32.total(), half.total()
    assert a.compressed == b.compressed and a.nnz == b.nnz
    assert b.stored_bytes < a.stored_bytes
    pruned = _train_step(copy.deepcopy(model), x, y, compressed_activations(units=model, threshold=0.05))
    assert pruned.total().nnz < a.nnz and pruned.total().stored_bytes < a.stored_bytes


def test_measured_memory_drops_by_what_the_accounting_says(fmnist):
    """Live tensor bytes after forward (exact, edgeflux.memory's tracker) fall by exactly
    dense - stored bytes: every compressed tensor owned its storage (nbytes == storage bytes),
    its dense storage is freed, nothing else changes. The step's measured peak falls too."""
    torch.manual_seed(0)
    model = build_model("vgg16", width=0.25, batch_norm=False)
    x, y = fmnist[0][:16], fmnist[1][:16]
    live = {}
    for enabled in (False, True):
        ca = compressed_activations(units=model) if enabled else None
        gc.collect()
        with track_live_tensors(list(model.parameters()) + [x, y]) as tracker:
            if ca is None:
                loss = F.cross_entropy(model(x), y)
            else:
                with ca:
                    loss = F.cross_entropy(model(x), y)
            live[enabled] = tracker.current_bytes
        del loss
    total = ca.total()
    assert total.compressed > 0 and total.narrowed == 5          # VGG-16's five max-pools' indices
    assert total.index_stored_bytes * 4 == total.index_dense_bytes   # int64 -> int16
    assert live[False] - live[True] == (total.dense_bytes - total.stored_bytes
                                        + total.index_dense_bytes - total.index_stored_bytes)

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    peaks = {}
    for opts in (BitTrainOptions(enabled=False), BitTrainOptions(enabled=True)):
        training_step_fn(model, opt, x, y, context=opts.context)()      # warm-up: momentum buffers exist
        step = training_step_fn(model, opt, x, y, context=opts.context)
        peaks[opts.enabled] = measure_step(step, model=model, optimizer=opt, inputs=(x, y)).peak_bytes
    assert peaks[True] < peaks[False]


# ----------------------------------------------------------------------------- double mask

def _frozen_bn(model: nn.Module, x: torch.Tensor) -> nn.Module:
    with torch.no_grad():
        model(x)                                    # non-trivial running statistics
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    return model


@pytest.mark.parametrize("name", ["vgg16", "mobilenet_v2"])
def test_double_mask_exact_for_eval_batchnorm(fmnist, name):
    torch.manual_seed(0)
    x, y = fmnist[0][:8], fmnist[1][:8]
    model = _frozen_bn(build_model(name, width=0.25), x)
    twin, plain = copy.deepcopy(model), copy.deepcopy(model)
    _train_step(model, x, y)
    dm = _train_step(twin, x, y, compressed_activations(units=twin, double_mask=True))
    base = _train_step(plain, x, y, compressed_activations(units=plain))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)
    t = dm.total()
    assert t.double_masked > 0 and t.stored_bytes < base.total().stored_bytes
    if name == "mobilenet_v2":
        assert t.mask_only > 0                      # ReLU6 input copies stored as 1-bit masks


@pytest.mark.parametrize("name", ["vgg16", "mobilenet_v2"])
def test_double_mask_training_batchnorm_is_approximate_and_smaller(fmnist, name):
    torch.manual_seed(0)
    x, y = fmnist[0][:8], fmnist[1][:8]
    model = build_model(name, width=0.25)
    twin, plain = copy.deepcopy(model), copy.deepcopy(model)
    _train_step(model, x, y)
    dm = _train_step(twin, x, y, compressed_activations(units=twin, double_mask=True))
    base = _train_step(plain, x, y, compressed_activations(units=plain))
    g = torch.cat([p.grad.flatten() for p in model.parameters()])
    g_dm = torch.cat([p.grad.flatten() for p in twin.parameters()])
    err = ((g_dm - g).norm() / g.norm()).item()
    assert 0 < err < 1e-5                            # rounding of the inverted BN affine map only
    assert dm.total().double_masked > 0
    assert dm.total().stored_bytes < 0.8 * base.total().stored_bytes


class _BNWithTwoConsumers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.bn(self.conv(x))
        side = y.sum()                              # a second consumer that saves nothing
        return self.relu(y).sum() + side


def test_double_mask_refuses_a_bn_output_with_another_consumer():
    net = _BNWithTwoConsumers()
    with torch.no_grad():
        net(torch.randn(4, 3, 16, 16))
    net.bn.eval()
    x = torch.randn(4, 3, 16, 16)
    with compressed_activations(units=net, double_mask=True):
        out = net(x)
    with pytest.raises(DoubleMaskError, match="another consumer"):
        out.backward()


# ----------------------------------------------------------------------------- options

def test_options_context_and_step_context(fmnist):
    assert not isinstance(BitTrainOptions().context(), CompressedActivations)   # disabled: nullcontext
    opts = BitTrainOptions(enabled=True, threshold=0.01, store_dtype="float16", double_mask=True)
    ctx = opts.context()
    assert isinstance(ctx, CompressedActivations) and ctx.store_dtype == torch.float16 and ctx.threshold == 0.01
    assert not opts.exact and BitTrainOptions(enabled=True).exact
    with pytest.raises(ValueError, match="store_dtype"):
        BitTrainOptions(enabled=True, store_dtype="int8")
    # as an edgeflux.memory StepContext
    torch.manual_seed(0)
    model = build_model("resnet18", width=0.25)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss = training_step_fn(model, opt, fmnist[0][:4], fmnist[1][:4], context=BitTrainOptions(enabled=True).context)()
    assert math.isfinite(loss)
    summary = compressed_activations(units=model).summary()
    assert summary["options"] == {"threshold": 0.0, "min_bytes": 4096, "narrow_indices": True, "store_dtype": None,
                                  "double_mask": False, "activation_masks": True}
    assert isinstance(summary["total"], dict) and list(summary["units"])[:2] == ["stem", "block1.0"]


def test_holders_keep_what_they_should():
    t = torch.relu(torch.randn(64, 64))
    kept, packed = Kept(t), Packed(compress(t), t)
    assert kept.tensor.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert isinstance(packed.data, BitmapTensor) and not packed.restored
    restored = packed.unpack()
    assert torch.equal(restored, t)
    # the compressed copy is let go once restored (it would only add to backward's peak), and a
    # second unpack returns the same tensor instead of decompressing again
    assert packed.restored and packed.data is restored and packed.unpack() is restored


def test_in_place_change_through_another_alias_after_a_temporary_view_was_saved_raises(bitmap_path):
    """Only a temporary view of h is saved (by pow), and it dies at once; h is then changed in place.
    Plain autograd raises (a view shares its base's version counter); so must the context, whose
    holder (h is half zeros: a bitmap) must watch the base, not the dead view."""
    mask = (torch.rand(64, 32, generator=torch.Generator().manual_seed(0)) > 0.5).float()

    def forward():
        x = torch.randn(64, 32, requires_grad=True)
        h = x * mask                           # mul saves the mask only, not h
        return h, (h.view(32, 64) ** 2).sum()

    h, out = forward()
    h.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()
    with compressed_activations(min_bytes=0, exclude=[mask]) as ca:
        h, out = forward()
    assert ca.total().compressed == 1          # the view of h
    h.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_the_params_schema_names_the_store_dtypes_the_bitmap_has():
    from edgeflux.bittrain.bitmap import STORE_DTYPES
    from edgeflux.bittrain.options import STORE_DTYPE_NAMES

    assert tuple(STORE_DTYPES) == STORE_DTYPE_NAMES


# ----------------------------------------------------------------------------- every batch under the budget

def _step_kinds():
    """(model, step factory taking bounds) for the two steps that train under a budget: backprop's TrainStep on
    train_bp's model, and NeuroFlux's block step on MobileNetV2's first two units (a VGG block's peak comes
    before its variable stores: every batch peaks the same there)."""
    from edgeflux.neuroflux.aux import local_learners
    from edgeflux.neuroflux.block import BlockStep, LocalBlock
    from edgeflux.step import TrainStep
    from edgeflux.train import TrainOptions, optimizer_factory

    context, optimizer = BitTrainOptions(enabled=True).context, optimizer_factory(TrainOptions(lr=0.01))
    torch.manual_seed(0)
    model = build_model("vgg11", width=0.25)   # train_bp's model
    block = LocalBlock(local_learners(build_model("mobilenet_v2", width=0.25, seed=0), seed=0)[:2])
    return {"backprop": (model, lambda bounds: TrainStep.factory(optimizer, context=context,
                                                                 bound=bounds[0] if bounds else None)),
            "neuroflux block": (block, lambda bounds: BlockStep.factory(optimizer, context, bounds))}


@pytest.mark.parametrize("kind", ["backprop", "neuroflux block"])
def test_bittrain_under_a_budget_holds_every_batch_of_an_epoch_not_only_the_measured_ones(fmnist_288, kind):
    """The batch is chosen on the first CONTENT_SAMPLES batches; a denser batch stores bigger bitmaps. Here the
    measured batches are the epoch's sparsest and the budget is their peak exactly (no headroom): without a
    bound some batch of the epoch goes over it; with the StoredBounds every step's measured allocator peak
    stays within it (a denser batch trained in halves)."""
    from edgeflux.memory import CONTENT_SAMPLES, choose_batch, measure_training_step, stored_bounds

    model, make_step = _step_kinds()[kind]
    x, y, batch = _sparsest_first(model, make_step(None), *fmnist_288)

    def measure(xb, yb):
        return measure_training_step(model, make_step(None), (xb.clone(), yb.clone()), (xb.clone(), yb.clone()))

    budget = max(measure(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]).peak_bytes
                 for i in range(CONTENT_SAMPLES))
    choice = choose_batch(measure, (x, y), budget_bytes=budget, max_batch=batch)
    assert choice.batch_size == batch and choice.memory.peak_bytes == budget
    bounds = stored_bounds(choice.memory, budget)
    assert bounds is not None and {b.headroom for b in bounds} == {0}

    def epoch_peaks(step_bounds):
        net = copy.deepcopy(model)
        step = make_step(step_bounds)(net)
        step(x[:batch], y[:batch])   # optimizer state exists, as in the measured (steady-state) step
        peaks = []
        for i in range(0, len(y), batch):
            xb, yb = x[i:i + batch].clone(), y[i:i + batch].clone()   # the batch alone: not a view of the epoch
            peaks.append(measure_step(lambda xb=xb, yb=yb: step(xb, yb), model=net, optimizer=step.optimizer,
                                      inputs=(xb, yb), process_stats=False).peak_bytes)
        return peaks, step.split_batches

    unbounded, _ = epoch_peaks(None)
    assert max(unbounded) > budget, "no batch of this epoch is denser than the measured ones: the test shows nothing"
    bounded, splits = epoch_peaks(bounds)
    assert max(bounded) <= budget, ([p - budget for p in unbounded], [p - budget for p in bounded], splits)
    assert splits >= 1


@pytest.fixture(scope="module")
def fmnist_288():
    """288 real Fashion-MNIST training images (an epoch of 12 batches of 24) at 32x32."""
    from edgeflux.data import load_raw, prepare, tensors
    x, y = tensors(prepare(load_raw("fashion-mnist"), image_size=32), "train", limit=288)
    return x[:], y


def _sparsest_first(model, make_step, x, y, batch=24, count=12):
    """count batches of real images, those the step stores the fewest bytes for first (the batches the batch
    size is measured on), as (x, y, batch)."""
    from edgeflux.memory import measure_training_step

    x, y = x[:batch * count].clone(), y[:batch * count].clone()
    stored = [measure_training_step(model, make_step, (x[:batch], y[:batch]),
                                    (x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]),
                                    process_stats=False).saved_bytes for i in range(count)]
    index = torch.cat([torch.arange(i * batch, (i + 1) * batch) for i in sorted(range(count), key=stored.__getitem__)])
    return x[index], y[index], batch


def test_a_batch_trained_in_halves_has_the_whole_batchs_gradient(fmnist):
    """Held to the stored bytes of its first half (measured), a whole batch cannot be stored: it is trained in
    parts, whose weighted gradients add up to the whole batch's (no BatchNorm), to float rounding."""
    from edgeflux.memory import measure_training_step, stored_bounds
    from edgeflux.step import TrainStep

    x, y = fmnist[0][:32].clone(), fmnist[1][:32].clone()
    torch.manual_seed(0)
    model = build_model("vgg11", width=0.25, batch_norm=False)
    opts = BitTrainOptions(enabled=True)

    def make_step(net, bound=None):
        return TrainStep(net, torch.optim.SGD(net.parameters(), lr=0.0), context=opts.context, bound=bound)

    half = measure_training_step(model, make_step, (x[:16], y[:16]), (x[:16], y[:16]))
    (bound,) = stored_bounds(half, half.peak_bytes)
    grads, splits = [], []
    for step_bound in (None, bound):
        net = copy.deepcopy(model)
        step = make_step(net, step_bound)
        step(x, y)
        grads.append([p.grad for p in net.parameters()])
        splits.append(step.split_batches)
    assert splits[0] == 0 and splits[1] >= 1
    for whole, parts in zip(*grads):
        torch.testing.assert_close(parts, whole, rtol=1e-4, atol=1e-6)
