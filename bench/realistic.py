"""The realistic workload (presets/realistic-128.yaml): every method of the pipeline on a folder of photos at
3x128x128 with full-width torchvision MobileNetV2 and ResNet-18, and where each one's measured memory goes.

    python -m bench.realistic                              # a fresh clone, its photos, the preset, `dvc repro`
    python -m bench.realistic --photos data/realistic-photos   # only make the photo folder the preset reads
    python -m bench.realistic --project DIR --wall-s S     # the table of a pipeline already run in DIR

The photos: Fashion-MNIST's first PHOTOS_PER_CLASS training and TEST_PER_CLASS test images of each class, upscaled
to PHOTO_SIZE px RGB PNGs in train/ and test/ class folders (data.dataset imagefolder decodes, resizes and crops
them to 128 px as it does a user's photos). No photo data set can be downloaded here; what the methods measure
depends on the tensors' sizes, and a few thousand images is what a user fine-tuning on a device brings.

For each method of the report (reports/summary.json): its batch, the measured peak of its training step and how
much of that peak is activations (the bytes alive at the peak beyond parameters, gradients, optimizer state and the
batch: edgeflux.memory's ``activation_bytes``; NeuroFlux: its largest block's), training images per second (the
images of its training set times its passes over them, over its training wall time) and its test accuracy. Writes
bench/results/realistic.{json,md,png}.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import BenchResult, bench_argparser
from edgeflux.neuroflux.plots import _pyplot, _save
from edgeflux.presets import load_preset

NAME, PRESET = "realistic", "realistic-128"
PHOTO_PX = load_preset(PRESET).params["data.image_size"]   # the preset's photo size, which the benchmarks read at
MIB = 2**20
PHOTOS = Path("data/realistic-photos")      # where the preset's data.root points, relative to the repository
PHOTOS_PER_CLASS, TEST_PER_CLASS, PHOTO_SIZE = 300, 100, 160


def photo_data(split_by: str, source_classes: list[int] | None = None, image_size: int = PHOTO_PX):
    """The photo folder (made when absent) read as the preset reads it: 3 channels at ``image_size``, split by
    edgeflux.data.prepare (``split_by``: none, data or classes), 10% of the training photos for validation."""
    from edgeflux.data import load_raw, prepare

    raw = load_raw("imagefolder", root=make_photos(PHOTOS), image_size=image_size, channels=3)
    return prepare(raw, image_size=image_size, channels=3, val_fraction=0.1, seed=0, split_by=split_by,
                   source_classes=source_classes)


def make_photos(root: Path) -> Path:
    """The photo folder the preset reads (see the module docstring); kept when it is there already."""
    from PIL import Image

    from edgeflux.data import load_raw

    if (root / "test").is_dir():
        return root
    raw = load_raw("fashion-mnist")
    tmp = root.with_name(root.name + ".tmp")
    for part, images, labels, n in (("train", raw.train_images, raw.train_labels, PHOTOS_PER_CLASS),
                                    ("test", raw.test_images, raw.test_labels, TEST_PER_CLASS)):
        for label, name in enumerate(raw.classes):
            folder = tmp / part / name.replace("/", "-")
            folder.mkdir(parents=True, exist_ok=True)
            for i in (labels == label).nonzero().flatten()[:n].tolist():
                image = Image.fromarray(images[i, 0].numpy()).resize((PHOTO_SIZE, PHOTO_SIZE), Image.BICUBIC)
                image.convert("RGB").save(folder / f"{i:05d}.png")
    tmp.rename(root)
    return root


def _json(project: Path, path: str) -> dict | None:
    file = project / path
    return json.loads(file.read_text()) if file.is_file() else None


def _activations(project: Path, stage: str) -> float | None:
    """MiB of activations alive at the measured peak of the stage's training step."""
    if stage == "train_blocks" or stage == "select_exit":
        blocks = (_json(project, "details/train_blocks.json") or {}).get("block_results", [])
        found = [b["activation_bytes"] for b in blocks if b.get("activation_bytes")]
        return max(found) / MIB if found else None
    name = {"evaluate_edge_cloud": "meanet_edge"}.get(stage, stage).replace("@", "/")
    memory = _json(project, f"memory/{name}.json")
    return memory["step_memory"]["activation_bytes"] / MIB if memory else None


def _images_per_s(project: Path, stage: str, params: dict) -> float | None:
    """Training images per second: the training set's images times its passes, over the training wall time."""
    key = {"train_blocks": "neuroflux", "select_exit": "neuroflux", "evaluate_edge_cloud": "meanet",
           "meanet_edge": "meanet"}.get(stage, stage.split("@")[0])
    details = _json(project, f"details/{'train_blocks' if key == 'neuroflux' else stage.replace('@', '/')}.json")
    if stage == "evaluate_edge_cloud":
        details = _json(project, "details/meanet_edge.json")
    if not details or not details.get("train_time_s"):
        return None
    section, manifest = params[key], _json(project, "data/prepared/manifest.json")
    if manifest is None:   # the prepared data is a DVC output: absent from a fresh clone until `dvc pull`
        return None
    split = manifest["counts"]["target_train"]["total"]
    n = min(split, section.get("max_train_samples") or split)
    if key == "meanet":   # the edge trains on the hard classes' instances only
        n = details.get("train_instances", n)
    return n * section["epochs"] / details["train_time_s"]


def collect(project: Path) -> list[dict]:
    params = yaml.safe_load((project / "params.yaml").read_text())
    rows = []
    for row in json.loads((project / "reports/summary.json").read_text())["rows"]:
        activations = _activations(project, row["stage"])
        rows.append({"method": row["method"], "model": row["model"], "batch": row["batch"],
                     "budget_mib": row["budget_mib"], "peak_mib": row["peak_mib"],
                     "activations_mib": round(activations, 1) if activations is not None else None,
                     "activation_share": round(activations / row["peak_mib"], 3) if activations and row["peak_mib"]
                     else None,
                     "images_per_s": round(ips, 1) if (ips := _images_per_s(project, row["stage"], params)) else None,
                     "test_acc": row["test_acc"], "train_s": round(row["train_s"], 1) if row.get("train_s") else None})
    return rows


def plot(rows: list[dict], out: Path) -> None:
    """Each method's measured peak, split into activations and the rest, beside the budget."""
    plt = _pyplot()
    rows = [r for r in rows if r["peak_mib"]]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 2.2))
    y = range(len(rows))
    act = [r["activations_mib"] or 0 for r in rows]
    ax.barh(y, act, color="tab:orange", label="activations")
    ax.barh(y, [r["peak_mib"] - a for r, a in zip(rows, act)], left=act, color="tab:blue",
            label="weights, gradients, optimizer state, batch")
    budget = rows[0]["budget_mib"]
    ax.axvline(budget, color="tab:red", lw=1.5, ls="--", label=f"budget ({budget:g} MiB)")
    for i, r in enumerate(rows):
        ax.annotate(f"batch {r['batch']}", (max(r["peak_mib"], budget), i), xytext=(4, 0),
                    textcoords="offset points", va="center", fontsize=8)   # right of the budget line
    ax.set_yticks(list(y), [r["method"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, budget * 1.35)
    ax.set(xlabel="measured peak of the training step (MiB)",
           title="Where each method's memory goes\n3x128x128 images, torchvision MobileNetV2 / ResNet-18")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    ax.grid(alpha=0.3, axis="x")
    _save(fig, out)


def run_pipeline(work: Path) -> tuple[Path, float, list[dict]]:
    """A fresh clone of this working tree with the preset's params, and its `dvc repro` timed."""
    from bench.pipeline import child_env, fresh_clone, timed_repro
    from edgeflux.presets import load_preset, set_params

    env = child_env()
    clone = fresh_clone(work / "clone", quick=False, env=env)
    make_photos(clone / PHOTOS)
    preset = load_preset(PRESET)
    set_params(preset.params, clone / "params.yaml")
    timed = timed_repro(clone, {**env, **preset.env()}, work / "repro.log")
    return clone, timed["wall_s"], timed["stages"]


def chance_note(pretrained: dict, n_classes: int) -> str:
    """What the accuracies mean when a pre-trained model ended near chance (below twice 1/n_classes)."""
    near = {k: v["test_acc"] for k, v in pretrained.items() if isinstance(v, dict) and v.get("test_acc") is not None
            and v["test_acc"] < 2 / n_classes}
    if not near:
        return ""
    names = ", ".join(f"{k} at {acc:.3g}" for k, acc in near.items())
    return (f"Pre-training left {names}, near chance (1 in {n_classes} classes: {1 / n_classes:.3g}): the models start "
            "from random weights, as no ImageNet weights can be downloaded here. The methods that keep a pre-trained "
            "model's lower layers frozen (MobileTL, MEANet's main block) stay near chance, while the ones that "
            "can retrain every layer (FT-All, ElasticTrainer) learn: the memory columns, batches and speeds are what "
            "this workload is for; its accuracies need real pre-trained weights (docs/your-model.md). ")


def main(argv=None) -> None:
    parser = bench_argparser(__doc__)
    parser.add_argument("--project", type=Path, help="a repository where the preset's pipeline has run: "
                        "only collect its results (default: clone this one and run it)")
    parser.add_argument("--wall-s", type=float, help="with --project: the wall time its dvc repro took")
    parser.add_argument("--remark", default="", help="with --project: how the run went (said under the table)")
    parser.add_argument("--photos", type=Path, help="only make the preset's photo folder there, and exit")
    args = parser.parse_args(argv)
    if args.photos:
        print(make_photos(args.photos))
        return
    stages = None
    if args.project:
        project, wall = args.project, args.wall_s
    else:
        started = time.perf_counter()
        project, wall, stages = run_pipeline(Path(tempfile.mkdtemp(prefix="edgeflux-realistic-")))
        wall = wall or time.perf_counter() - started
    result = BenchResult()
    result.rows = collect(project)
    pretrained = _json(project, "details/pretrain.json") or {}
    result.add_section("The cloud's pre-trained models (stage pretrain), which fine-tuning and MEANet start from",
                       [{"model": k, "test_acc": v.get("test_acc")} for k, v in pretrained.items() if isinstance(v, dict)],
                       ["model", "test_acc"])
    exported = (_json(project, "details/export.json") or {}).get("models", {})
    result.add_section("Exported files (stage export): max |logit difference| from PyTorch on the first test batch",
                       [{"model": k, "onnx": v["onnx_max_abs_diff"], "TorchScript": v["trace_max_abs_diff"]}
                        for k, v in exported.items()], ["model", "onnx", "TorchScript"])
    if stages:
        result.add_section("dvc repro, per stage", stages, ["stage", "start_s", "wall_s"])
    classes = (_json(project, "data/prepared/manifest.json") or {}).get("classes", [])
    notes = ((f"The whole pipeline (`dvc repro`, every stage) took {wall / 60:.1f} min. " if wall else "")
             + (chance_note(pretrained, len(classes)) if classes else "") + args.remark)
    result.write(NAME, args.out, title="The realistic workload: 3x128x128, torchvision MobileNetV2 and ResNet-18",
                 notes=notes, extra={"preset": PRESET, "wall_s": wall,
                                     "params": yaml.safe_load((project / "params.yaml").read_text())})
    plot(result.rows, args.out / f"{NAME}.png")


if __name__ == "__main__":
    main()
