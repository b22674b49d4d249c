"""Every technique, in process as its stages call it, on a real small case: a generated folder of photos
(imagefolder, 64 px RGB, ImageNet normalisation; one truncated PNG and one text file named .png among them) and
torchvision's MobileNetV2 and ResNet-18 built from state_dict files of random weights, loaded strictly.

Budgets are measured here, never hard-coded: a step is measured at batch 1 and 4 and the budget set half a
sample above batch 4's peak, so that the budget binds (the batch is > 1 and below the data) on any torch.
"""
from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from torch import nn
from torchvision.models.mobilenetv2 import InvertedResidual

from edgeflux.artifacts import load_model, save_model
from edgeflux.backprop import train_under_budget
from edgeflux.config import (BitTrainParams, FinetuneParams, MEANetParams, ModelSpec, NeuroFluxParams,
                             PretrainParams, TrainBPParams)
from edgeflux.data import IMAGENET_MEAN, IMAGENET_STD, load_raw, prepare, tensors
from edgeflux.elastic.options import ElasticOptions
from edgeflux.finetune import finetune
from edgeflux.meanet.hard import hard_classes, select_hard
from edgeflux.meanet.model import MEANetSpec, build_meanet, load_meanet, main_block, save_meanet
from edgeflux.meanet.train import edge_step_memory, joint_step_memory, main_logits, train_edge, train_main_block
from edgeflux.memory import measure_training_step
from edgeflux.tricks import LeanBatchNorm2d
from edgeflux.mobiletl.ops import ShiftOnlyBatchNorm, SignBackward
from edgeflux.models import build_model
from edgeflux.neuroflux.aux import exit_params
from edgeflux.neuroflux.exit import ExitModel, select_exit
from edgeflux.neuroflux.model import aux_args, build_learners
from edgeflux.neuroflux.partition import min_budget_bytes, partition
from edgeflux.neuroflux.profile import profile_units
from edgeflux.neuroflux.worker import train_blocks
from edgeflux.step import TrainStep
from edgeflux.train import TrainRun, evaluate, optimizer_factory

SIZE, PER_CLASS, CPU = 64, 14, torch.device("cpu")
# sorted, as ImageFolder orders them; each class has its own dominant colour channel and its own pattern
CLASSES = {"blue_checks": 2, "green_columns": 1, "red_rows": 0}
MOBILENET, RESNET = "mobilenet_v2", "resnet18"

pytestmark = pytest.mark.slow   # about a minute of CPU (one thread)


def photo(pattern: str, channel: int, rng: np.random.Generator) -> Image.Image:
    """A noisy photo of 80-120 px a side (not square): the class's pattern in its colour on a darker ground."""
    w, h = (int(v) for v in rng.integers(80, 121, 2))
    yy, xx = np.mgrid[0:h, 0:w]
    period = int(rng.integers(6, 11))
    on = {"blue_checks": (yy // period + xx // period) % 2 == 0, "green_columns": (xx // period) % 2 == 0,
          "red_rows": (yy // period) % 2 == 0}[pattern]
    colour = np.full(3, 40.0)
    colour[channel] = 220.0
    pixels = np.where(on[..., None], colour, 0.45 * colour) + rng.normal(0, 15, (h, w, 3))
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on the shared 2 cores (make test runs two workers) two threads each are many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """root/<class>/*.png, and the two files that do not decode: a truncated PNG and a text file named x.png."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for name, channel in CLASSES.items():
        (root / name).mkdir()
        for i in range(PER_CLASS):
            photo(name, channel, rng).save(root / name / f"{i:02d}.png")
    good = (root / "red_rows" / "00.png").read_bytes()
    bad = [root / "green_columns" / "truncated.png", root / "blue_checks" / "x.png"]
    bad[0].write_bytes(good[: len(good) // 2])
    bad[1].write_text("a text file, named as a photo\n")
    return root, bad


@pytest.fixture(scope="module")
def data(photos):
    raw = load_raw("imagefolder", root=photos[0], image_size=SIZE, test_fraction=0.2)
    return prepare(raw, image_size=SIZE, channels=3, val_fraction=0.2, seed=0, split_by="none", normalize="imagenet")


@pytest.fixture(scope="module")
def splits(data):
    return {s: tensors(data, f"target_{s}") for s in ("train", "val", "test")}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """name -> (file, its state_dict): torchvision's ImageNet models (1000 classes) with random weights, saved as
    a user saves downloaded ones. Every tensor is drawn away from what a fresh build holds (BatchNorm's ones and
    zeros too), so that a tensor the loader left out cannot pass for a loaded one."""
    folder = tmp_path_factory.mktemp("weights")
    out = {}
    for seed, name in enumerate((MOBILENET, RESNET), 1):
        torch.manual_seed(seed)
        state = getattr(torchvision.models, name)(num_classes=1000).state_dict()
        for value in state.values():   # positive shifts: running variances stay positive
            value.add_(torch.rand_like(value) * 0.1 if value.is_floating_point() else 7)
        torch.save(state, folder / f"{name}.pth")
        out[name] = (folder / f"{name}.pth", state)
    return out


def spec(weights, name: str = MOBILENET) -> ModelSpec:
    return ModelSpec(arch="torchvision", name=name, weights=str(weights[name][0]))


def build(weights, name: str = MOBILENET, seed: int = 0):
    """As the stages build a model: the spec's build_args and its weights file (loaded strictly)."""
    s = spec(weights, name)
    args = s.build_args(len(CLASSES), 3, SIZE, seed)
    return build_model(**args, pretrained_path=s.weights_path()), args


def pretrained(weights, folder, name: str = MOBILENET):
    """What the finetune and meanet_cloud stages start from: the pretrain stage's model file of the strictly loaded
    model (models/pretrained/<key>.pt), read back with load_model (its build_args name arch: torchvision)."""
    model, args = build(weights, name)
    assert_holds_the_file(model, weights[name][1])
    save_model(folder / f"tv-{name}.pt", model, args)
    model, _ = load_model(folder / f"tv-{name}.pt")
    assert model.build_args == args and model.build_args["arch"] == "torchvision"
    assert_holds_the_file(model, weights[name][1])
    return model


def assert_holds_the_file(model: nn.Module, state: dict) -> None:
    """Every tensor of the model but the re-made 3-class head is the file's, in torchvision's order."""
    head = {k for k, v in state.items() if v.dim() and v.shape[0] == 1000}   # the ImageNet classifier's
    theirs = [v for k, v in state.items() if k not in head]
    ours = list(model.state_dict().values())
    assert len(ours) == len(theirs) + len(head)
    for i, (mine, file_tensor) in enumerate(zip(ours[: len(theirs)], theirs)):
        assert torch.equal(mine, file_tensor), f"tensor {i} differs from the file's"
    assert ours[-2].shape[0] == len(CLASSES)


def changed(model: nn.Module, state: dict) -> list[str]:
    """The model's parameters (not the head) that no longer equal the file's, by torchvision's order."""
    params = {id(p) for p in model.parameters()}
    values = list(model.state_dict(keep_vars=True).values())
    names = [k for k, v in state.items() if v.dim() == 0 or v.shape[0] != 1000]
    return [n for n, v, f in zip(names, values, [state[n] for n in names])
            if id(v) in params and not torch.equal(v.detach(), f)]


def budget_for(measure) -> int:
    """Half a sample above the measured peak at batch 4: batch 4 fits, 5 does not (if the peak grows linearly)."""
    p1, p4 = measure(1), measure(4)
    assert p4 > p1, "the measured peak grows with the batch"
    return int(p4 + (p4 - p1) / 6)


def step_peak(model: nn.Module, opts, train, context=None):
    make = TrainStep.factory(optimizer_factory(opts), context=context)

    def measure(batch: int) -> int:
        first = (train[0][:batch], train[1][:batch])
        return measure_training_step(model, make, first, first, CPU, process_stats=False).peak_bytes
    return measure


def within(run, budget: int, n: int, binds: bool = True) -> None:
    """A budgeted run trained at a batch > 1, its measured peak under the budget, and the next batch measured
    over it (unless the batch is the whole training set; binds: the budget left it smaller)."""
    assert run.batch_fit is not None and run.batch_fit.budget_bytes == budget
    assert run.step_memory.peak_bytes == run.batch_fit.peak_bytes <= budget
    assert 1 < run.batch_size <= n, run.batch_size
    measured = dict(run.batch_fit.measurements)
    assert run.batch_size == n or measured[run.batch_size + 1] > budget
    assert run.batch_size < n or not binds
    assert run.train.steps == math.ceil(n / run.batch_size) and run.train.epochs_done == 1
    assert all(math.isfinite(r["train_loss"]) for r in run.train.history)


# --------------------------------------------------------------------------- the photos


def test_the_folder_loads_with_the_two_bad_files_skipped_in_one_warning(photos, data, caplog):
    root, bad = photos
    with caplog.at_level(logging.WARNING):
        raw = load_raw("imagefolder", root=root, image_size=SIZE, test_fraction=0.2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and all(str(path) in warnings[0] for path in bad), warnings
    assert sorted(s["path"] for s in raw.notes["skipped"]) == sorted(map(str, bad))
    assert raw.classes == list(CLASSES)
    assert len(raw.train_labels) + len(raw.test_labels) == 3 * PER_CLASS
    assert torch.bincount(torch.cat([raw.train_labels, raw.test_labels])).tolist() == [PER_CLASS] * 3

    assert data.images.shape == (3 * PER_CLASS, 3, SIZE, SIZE) and data.classes == list(CLASSES)
    assert data.mean == pytest.approx(IMAGENET_MEAN) and data.std == pytest.approx(IMAGENET_STD)
    # each photo kept its label: its dominant colour channel is its class's
    dominant = data.images.float().mean((2, 3)).argmax(1)
    assert torch.equal(dominant, torch.tensor(list(CLASSES.values()))[data.labels])
    sizes = {s: len(data.splits[f"target_{s}"]) for s in ("train", "val", "test")}
    assert sum(sizes.values()) == 3 * PER_CLASS and sizes["train"] > 20, sizes
    for s in ("train", "val", "test"):   # stratified: every class in every split
        assert torch.bincount(data.labels[data.splits[f"target_{s}"]], minlength=3).min() >= 2, s


# --------------------------------------------------------------------------- backprop (train_bp), with BitTrain


@pytest.mark.parametrize("bittrain", [False, True], ids=["backprop", "bittrain"])
def test_backprop_trains_the_strictly_loaded_model_one_epoch_under_the_budget(weights, splits, bittrain, tmp_path):
    bt = BitTrainParams(enabled=bittrain)
    probe = TrainBPParams(model=spec(weights), epochs=1, evals_per_epoch=1, device="cpu", bittrain=bt)
    model, args = build(weights)
    assert_holds_the_file(model, weights[MOBILENET][1])
    budget = budget_for(step_peak(model, probe, splits["train"], bt.context))
    p = TrainBPParams(model=spec(weights), budget=f"{budget}B", max_batch=64, epochs=1, evals_per_epoch=1,
                      device="cpu", bittrain=bt)
    assert args["arch"] == "torchvision" and p.model.key == "tv-mobilenet_v2"
    run = train_under_budget(model, splits["train"], splits["val"], splits["test"], p,
                             TrainRun(CPU, checkpoint=tmp_path / "train_bp.pt", desc="train_bp", context=p.bittrain.context),
                             memory=p)
    within(run, budget, len(splits["train"][1]))
    assert len(changed(model, weights[MOBILENET][1])) == len(list(model.parameters())) - 2   # all but the new head
    metrics = run.metrics()
    if bittrain:   # the saved activations were held as bitmaps: fewer bytes than dense
        assert run.step_memory.activation_storage is not None
        assert metrics["saved_stored_bytes"] < metrics["saved_dense_bytes"]
    else:
        assert run.step_memory.activation_storage is None and "saved_stored_bytes" not in metrics


# --------------------------------------------------------------------------- NeuroFlux


def test_neuroflux_profiles_partitions_and_trains_the_torchvision_model_block_by_block(weights, splits, tmp_path):
    """NeuroFlux trains from scratch: its stages build the model from the spec's build_args, without weights.
    Classic auxiliary heads of 32 filters: the adaptive ones (AAN-LL) of torchvision's MobileNetV2 have 640 (half
    its 1280-channel last conv), several times the model's own parameters, and would double this test's time."""
    p = NeuroFluxParams(model=ModelSpec(arch="torchvision", name=MOBILENET), aux="classic", classic_filters=32,
                        max_batch=16, epochs=1, lr=0.05, evals_per_epoch=1, profile_batches=[2, 4, 8], min_r2=0.9,
                        device="cpu", cache={"storage": "float16", "shard_size": "256KiB"})
    train = splits["train"]
    s = p.model.build_args(len(CLASSES), 3, SIZE, p.seed)
    model, learners = build_learners(s, aux_args(p))
    assert isinstance(learners[1].unit, InvertedResidual) and len(learners) == len(model.units) == 20
    before = [u.detach().clone() for u in model.parameters()]
    # profile (stage profile)
    profiles = profile_units(learners, model.describe(), len(CLASSES), optimizer_factory(p), batches=p.profile_batches,
                             device=CPU, data=train, context=p.bittrain.context, min_r2=p.min_r2)
    assert [u.name for u in profiles] == model.unit_names and all(u.r2 >= p.min_r2 for u in profiles)
    # partition under a budget from the profile (stage partition)
    lines, floors = [(u.slope_bytes_per_sample, u.intercept_bytes) for u in profiles], [u.min_bytes for u in profiles]
    budget = int(1.5 * min_budget_bytes(lines, floors))
    p = p.model_copy(update={"budget": budget})
    blocks = partition(lines, p.budget, p.max_batch, rho=p.rho, names=model.unit_names, floors=floors)
    # train the blocks (stage train_blocks)
    run = train_blocks(learners, blocks, splits, p, workdir=tmp_path / "cache", budget_bytes=p.budget, device=CPU,
                       cache=p.cache, context=p.bittrain.context, signature={"spec": s, "aux": aux_args(p)},
                       checkpoint_dir=tmp_path / "checkpoints", desc="neuroflux", split_rho=p.rho)
    assert run.complete and [u for b in run.blocks for u in b.units] == list(range(len(learners)))
    for b in run.blocks:
        assert b.budget_bytes == budget and b.peak_bytes <= budget and 1 <= b.batch_size <= b.planned_batch, b
    assert max(b.batch_size for b in run.blocks) > 1
    assert all(not torch.equal(a, u) for a, u in zip(before, model.parameters()) if a.dim() == 4)   # every conv trained
    # the compact exit (stage select_exit)
    k = select_exit(run.unit_val_acc, [exit_params(learners, i) for i in range(len(learners))], p.exit_tolerance)
    x = splits["test"][0][:5]
    for exit_ in (ExitModel(learners, k), ExitModel(learners, len(learners) - 1)):
        with torch.no_grad():
            logits = exit_.eval()(x)
        assert logits.shape == (5, len(CLASSES)) and torch.isfinite(logits).all()
    full = ExitModel(learners, len(learners) - 1)
    assert run.unit_test_acc[-1] == pytest.approx(evaluate(full, *splits["test"]))


# --------------------------------------------------------------------------- fine-tuning (MobileTL, ElasticTrainer)

METHODS = ["ft_all", "mobiletl", "elastic", "mobiletl-bittrain"]


@pytest.fixture(scope="module")
def finetuned(weights, splits, tmp_path_factory):
    """run(method) -> (its FinetuneRun, the float model it fine-tuned), run on first use, each from a fresh pretrained
    file of the strictly loaded weights; one budget for every method (the pipeline's), run.budget, measured on
    ft_all's step."""
    opts = FinetuneParams(model="tv-mobilenet_v2", methods=METHODS, max_batch=64, epochs=1, lr=0.001, optimizer="adam",
                          evals_per_epoch=1, calibration_batches=2, device="cpu",
                          elastic=ElasticOptions(rho=0.7, repeats=1, probe_samples=8))
    model, _ = build(weights)
    budget = budget_for(step_peak(model, opts, splits["train"]))
    opts = opts.model_copy(update={"budget": budget})
    folder, runs = tmp_path_factory.mktemp("finetune"), {}

    def run(method: str):
        if method not in runs:
            model = pretrained(weights, folder)
            runs[method] = finetune(model, method, opts, splits["train"], splits["val"], splits["test"], CPU,
                                    checkpoint=folder / f"{method}.pt", start="random-weights"), model
        return runs[method]
    run.budget = budget
    return run


@pytest.mark.parametrize("method", METHODS)
def test_each_fine_tuning_method_trains_one_epoch_within_the_budget(finetuned, splits, weights, method):
    result, model = finetuned(method)
    # MobileTL's frozen int8 bottom saves nothing for backward: the budget that binds ft_all may fit the whole set
    within(result.run, finetuned.budget, len(splits["train"][1]), binds=not method.startswith("mobiletl"))
    metrics = result.metrics()
    assert metrics["method"] == method and 0 < metrics["trainable_params"] <= metrics["params"]
    assert metrics["params"] == sum(p.numel() for p in model.parameters())
    assert changed(model, weights[MOBILENET][1]), "fine-tuning changed no weight of the loaded model"
    if method.endswith("bittrain"):
        assert metrics["saved_stored_bytes"] < metrics["saved_dense_bytes"]
    if method == "elastic":   # ElasticTrainer selected some of ft_all's tensors, the classifier among them
        (mask,) = result.selections
        assert 0 < sum(mask) < len(mask) and metrics["elastic_selections"] == 1
        selected = [n for n, on in zip(result.tensors, mask) if on]
        assert any("units.19" in n for n in selected), selected


def test_mobiletl_transforms_the_torchvision_blocks_and_trains_fewer_parameters_than_ft_all(finetuned, weights):
    mobiletl, model = finetuned("mobiletl")
    ft_all, ft_model = finetuned("ft_all")
    info = mobiletl.info
    assert info["trains"] == ["irb15", "irb16", "irb17", "last_conv", "classifier"]
    assert sorted(info["transformed"]) == ["irb15", "irb16", "irb17"]
    for name in ("irb15", "irb16", "irb17"):   # torchvision's block: expand and depthwise BN+ReLU6, project BN
        kinds = [type(m) for m in model.units[model.unit_index(name)].modules()]
        plain_norms = sum(k in (nn.BatchNorm2d, LeanBatchNorm2d) for k in kinds)   # (lean: the same, saving less)
        assert (kinds.count(ShiftOnlyBatchNorm), kinds.count(SignBackward), plain_norms) == (2, 2, 1)
        assert len(info["transformed"][name]["shift_only_norms"]) == 2, info["transformed"][name]
    assert info["bottom_int8"] and info["bottom_float_units"] == []
    assert mobiletl.train_params < ft_all.train_params == sum(p.numel() for p in ft_model.parameters())
    assert mobiletl.run.batch_size > ft_all.run.batch_size   # it saves less: the same budget fits a larger batch
    moved = changed(model, weights[MOBILENET][1])
    assert moved and not [n for n in moved if not n.startswith(("features.15", "features.16", "features.17",
                                                                "features.18"))], moved   # the bottom stayed frozen


# --------------------------------------------------------------------------- MEANet


def test_meanet_b_trains_the_edge_blocks_on_the_torchvision_mobilenet_main_block(weights, splits, tmp_path):
    p = MEANetParams(main="tv-mobilenet_v2", cloud="tv-resnet18", variant="B", extension_blocks=1, n_hard=2,
                     max_batch=64, epochs=1, lr=0.001, optimizer="adam", evals_per_epoch=1, device="cpu")
    model = pretrained(weights, tmp_path)
    main, k = main_block(model, meanet_spec(p))
    assert main is model and model.unit_names[k - 1] == "irb17"   # B's default: the whole CNN, F after the last IRB
    net, hard = cloud_side(model, main, p, splits, tmp_path)
    assert [type(m) for m in net.extension[:-1]] == [InvertedResidual]   # a new block of MobileNetV2's own kind
    edge_side(net, hard, p, splits, tmp_path)


def test_meanet_a_cut_from_a_torchvision_resnet18_trains_at_the_cloud_then_on_the_edge(weights, splits, tmp_path):
    p = MEANetParams(main="tv-resnet18", cloud="tv-mobilenet_v2", variant="A", n_hard=2, max_batch=64, epochs=1,
                     lr=0.001, optimizer="adam", evals_per_epoch=1, device="cpu")
    model = pretrained(weights, tmp_path, RESNET)
    main, k = main_block(model, meanet_spec(p))
    assert model.unit_names[k - 1] == "block3.1"   # A's default: the last unit before the coarsest stage
    stem = model.units[0][0].weight.detach().clone()
    cloud = PretrainParams(models=[spec(weights, RESNET)], epochs=1, batch_size=16, lr=0.05, evals_per_epoch=1,
                           device="cpu")
    trained = train_main_block(model, main, k, splits["train"], splits["val"], splits["test"], cloud, CPU,
                               tmp_path / "cloud.pt", "start")
    assert trained.train.steps == 2 and not torch.equal(model.units[0][0].weight, stem)   # the cloud trained it
    net, hard = cloud_side(model, main, p, splits, tmp_path)
    assert len(net.extension) == 3 and net.extension[-1][-1].out_features == p.n_hard   # block4.0, block4.1, fc
    edge_side(net, hard, p, splits, tmp_path)


def meanet_spec(p) -> MEANetSpec:
    return MEANetSpec(variant=p.variant, split_after=p.split_after, fusion=p.fusion, n_hard=p.n_hard,
                      extension_blocks=p.extension_blocks, num_classes=len(CLASSES))


def cloud_side(model, main, p, splits, tmp_path):
    """Stage meanet_cloud: the MEANet of the main block, its hard classes, written to main.pt; and what the
    device reads back from it (stage meanet_edge: load_meanet rebuilds the torchvision model from its build_args)."""
    net = build_meanet(model, meanet_spec(p), model.build_args, main=main)
    hard = hard_classes(main_logits(net, splits["val"][0]), splits["val"][1], p.n_hard)
    save_meanet(tmp_path / "main.pt", net)
    loaded, _ = load_meanet(tmp_path / "main.pt")
    x = splits["test"][0][:3]
    with torch.no_grad():
        y2, (y1, _) = loaded.eval()(x), loaded.main_exit(x)
        assert torch.equal(y2, net.eval()(x)) and torch.equal(y1, net.main_exit(x)[0])
    assert y2.shape == (3, p.n_hard) and y1.shape == (3, len(CLASSES))
    return loaded, hard


def edge_side(net, hard, p, splits, tmp_path) -> None:
    """Stage meanet_edge: the adaptive and extension blocks train on the hard classes under a budget measured
    here, the main block fixed; joint optimisation of every block at the same batch needs more memory."""
    train = splits["train"]
    budget = budget_for(lambda b: edge_step_memory(net, hard, b, train, p.edge_options(), CPU).peak_bytes)
    p = p.model_copy(update={"budget": budget})
    main_before = [t.clone() for t in net.main.state_dict().values()]
    adaptive_before = [t.detach().clone() for t in net.adaptive.parameters()]
    run = train_edge(net, hard, train, splits["val"], splits["test"], p.edge_options(), CPU, tmp_path / "edge.pt",
                     signature="start")
    within(run, budget, len(select_hard(*train, hard)[1]))
    assert all(torch.equal(a, b) for a, b in zip(main_before, net.main.state_dict().values()))   # fixed: BN stats too
    assert all(not torch.equal(a, b) for a, b in zip(adaptive_before, net.adaptive.parameters()))
    joint = joint_step_memory(net, hard, run.batch_size, train, p, CPU)
    assert run.step_memory.peak_bytes < joint.peak_bytes
