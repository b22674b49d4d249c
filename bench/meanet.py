"""MEANet on Fashion-MNIST, measured (Long et al.: Tables II-VI, Fig. 6's memory, Figs. 7-8's threshold sweep).

Fashion-MNIST split by data (as the pipeline's default): the cloud trains on the source half, the edge on the
target half, every test instance is the shared test split. Its hard classes (shirt, pullover, coat, T-shirt)
are genuinely hard. For each CNN (CIFAR-style ResNet-18, MobileNetV2; CPU-sized widths, 1 channel, 32x32):

* the CNN is pre-trained on the source half (the cloud's data); model B keeps it as the main block, model A
  cuts it at the default fusion point and trains CNN and the new exit jointly for --cloud-epochs;
* hard classes: the main block's validation precision, ascending; the first n_hard (half) are hard;
* the edge trains the adaptive and extension blocks on the target half's hard-class instances, the main
  block fixed, at --batch; the same batch is measured under joint optimisation (every block, both exits);
* Table II (hard-class test accuracy: the main block over all classes vs the extension exit over the hard
  ones), Table III (all-class accuracy: main vs MEANet routed on the edge; easy/hard detection), Table VI
  (fixed vs trained parameters and multiply-adds);
* the threshold sweep with the real cloud: bench.meanet_cloud's CNN (a full-width ResNet-18 trained on the
  source half, on a GPU, passed as --cloud-dir; else trained here), saved in MLflow's format, served by ``mlflow models serve`` on loopback (edgeflux.meanet.server.ModelServer) and asked over HTTP
  (edgeflux.meanet.cloud.CloudClient): accuracy, share answered by the cloud, edge energy and latency per
  threshold (Table I's model: edge time and round trip measured here, upload and edge power modelled).

Tables IV-V (ResNet-18 model A, as the paper): hard vs random class selection and several n_hard.

    python -m bench.meanet_cloud --device cuda --out runs/cloud       # on a GPU machine: the cloud, 3 seeds
    python -m bench.meanet --threads 2 --cloud-dir runs/cloud         # full run, results in bench/results/
    python -m bench.meanet --quick --out /tmp/bench     # CI-sized: ResNet-18 B only, small data, 3 thresholds
"""
from __future__ import annotations

import copy
import logging
import random
import tempfile
import time
from pathlib import Path

import torch
from rich.logging import RichHandler

from bench import meanet_cloud
from bench.common import BenchResult, HelpFormatter, bench_argparser
from edgeflux.backprop import train_under_budget
from edgeflux.data import load_raw, prepare, tensors
from edgeflux.meanet.cloud import CloudClient
from edgeflux.meanet.cost import CostModel
from edgeflux.meanet.evaluate import edge_cloud_report, edge_tables
from edgeflux.meanet.hard import detection_accuracy, entropy_range, hard_classes
from edgeflux.meanet.model import MEANetSpec, block_costs, build_meanet, main_block
from edgeflux.meanet.plot import plot_sweep
from edgeflux.meanet.server import ModelServer
from edgeflux.meanet.train import edge_step_memory, joint_step_memory, main_logits, train_edge, train_main_block
from edgeflux.models import build_model
from edgeflux.neuroflux.plots import _pyplot, _save
from edgeflux.tracking import save_model_dir
from edgeflux.train import MemoryOptions, TrainOptions, TrainRun, evaluate

NAME = "meanet"
log = logging.getLogger("bench.meanet")
MODELS = {"resnet18": 0.25, "mobilenet_v2": 0.5}           # main-block CNNs at CPU-sized widths
HARD_TARGET, CLOUD_TOLERANCE, CLOUD_SHARE, MEMORY_RATIO = 0.04, 0.01, 0.30, 0.50
QUICK = dict(models=["resnet18"], variants=["B"], pretrain_samples=1024, pretrain_epochs=1, cloud_epochs=1,
             train_samples=1024, eval_samples=256, test_samples=256, edge_epochs=1, sweep=3, n_hards=[])


class EdgeOptions(TrainOptions, MemoryOptions):
    """The edge's training options: the one loop's, with the memory options (no budget: --batch)."""


def parse_args(argv=None):
    parser = bench_argparser(__doc__)
    parser.formatter_class = HelpFormatter
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), metavar="MODEL",
                        help=f"main-block CNNs (of {', '.join(MODELS)}; widths {MODELS})")
    parser.add_argument("--variants", nargs="+", default=["A", "B"], choices=["A", "B"], help="MEANet models")
    parser.add_argument("--pretrain-samples", type=int, default=None, help="source images (default: all 27,000)")
    parser.add_argument("--pretrain-epochs", type=int, default=2, help="the main CNN's pre-training epochs")
    parser.add_argument("--cloud-epochs", type=int, default=1, help="model A: the main block's joint training epochs")
    parser.add_argument("--cloud-dir", type=Path, default=None,
                        help="clouds trained by bench.meanet_cloud (on a GPU): serve its cloud_seed0.pt; default: "
                             "train bench.meanet_cloud's CNN here for --cloud-model-epochs")
    parser.add_argument("--cloud-model-epochs", type=int, default=2, help="without --cloud-dir: the cloud's epochs")
    parser.add_argument("--train-samples", type=int, default=None, help="target images the edge sees (hard ones train)")
    parser.add_argument("--eval-samples", type=int, default=None, help="validation images (default: all)")
    parser.add_argument("--test-samples", type=int, default=None, help="test images (default: all 10,000)")
    parser.add_argument("--edge-epochs", type=int, default=4, help="epochs of the adaptive + extension blocks")
    parser.add_argument("--batch", type=int, default=64, help="the edge's batch, and the joint measurement's")
    parser.add_argument("--lr", type=float, default=1e-3, help="the edge's learning rate (Adam)")
    parser.add_argument("--sweep", type=int, default=9, help="thresholds in the sweep")
    parser.add_argument("--n-hards", nargs="*", type=int, default=[3, 7],
                        help="Table V: other n_hard values for ResNet-18 model A (5, the default, always runs)")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def load(args) -> dict:
    data = prepare(load_raw("fashion-mnist"), image_size=32, val_fraction=0.1, seed=0, split_by="data")
    return {"classes": data.classes,
            "source": {s: tensors(data, f"source_{s}", limit=n) for s, n in
                       (("train", args.pretrain_samples), ("val", args.eval_samples), ("test", args.test_samples))},
            "target": {s: tensors(data, f"target_{s}", limit=n) for s, n in
                       (("train", args.train_samples), ("val", args.eval_samples), ("test", args.test_samples))}}


def pretrain(name: str, width: float, epochs: int, data: dict) -> torch.nn.Module:
    """A CNN trained with plain backprop on the source half (the pipeline's pretrain stage, same recipe)."""
    model = build_model(name, 10, 1, width, 32, seed=0)
    model.build_args = dict(name=name, num_classes=10, in_channels=1, width=width, image_size=32, batch_norm=True,
                            seed=0)
    opts = TrainOptions(epochs=epochs, batch_size=128, lr=0.05, evals_per_epoch=1, device="cpu")
    s = data["source"]
    run = train_under_budget(model, s["train"], s["val"], s["test"], opts,
                             TrainRun(torch.device("cpu"), desc=f"pretrain {name}-w{width:g}"))
    log.info("pretrained %s-w%g: source test accuracy %.4f in %.0fs", name, width, run.test_acc, run.train.train_time_s)
    return model


def main_net(pretrained, variant: str, args, data: dict, n_hard: int = 5):
    """The MEANet of a copy of `pretrained` (model A: its main block trained at the cloud first)."""
    model = copy.deepcopy(pretrained)
    spec = MEANetSpec(variant=variant, n_hard=n_hard)
    main, k = main_block(model, spec)
    if variant == "A":
        s = data["source"]
        opts = TrainOptions(epochs=args.cloud_epochs, batch_size=128, lr=0.05, evals_per_epoch=1, device="cpu")
        train_main_block(model, main, k, s["train"], s["val"], s["test"], opts, torch.device("cpu"))
    return build_meanet(model, spec, model.build_args, main=main)


def edge_run(net, hard, args, data: dict) -> dict:
    """Train the adaptive + extension blocks (main block fixed) and measure both methods' steps at --batch."""
    t = data["target"]
    opts = EdgeOptions(epochs=args.edge_epochs, batch_size=args.batch, lr=args.lr, optimizer="adam",
                       evals_per_epoch=1, device="cpu", max_batch=args.batch)
    run = train_edge(net, hard, t["train"], t["val"], t["test"], opts, torch.device("cpu"))
    edge = edge_step_memory(net, hard, args.batch, t["train"], opts, "cpu")
    joint = joint_step_memory(net, hard, args.batch, t["train"], opts, "cpu")
    return {"edge_train_s": run.train.train_time_s, "edge_train_peak_bytes": edge.peak_bytes,
            "joint_train_peak_bytes": joint.peak_bytes, "edge_saved_bytes": edge.saved_bytes,
            "joint_saved_bytes": joint.saved_bytes, "peak_ratio": edge.peak_bytes / joint.peak_bytes}


def hard_of(net, data: dict, n_hard: int, choose=None):
    val = data["source"]["val"]
    logits = main_logits(net, val[0])
    return hard_classes(logits, val[1], n_hard, choose), entropy_range(logits, val[1])


def one_config(name: str, variant: str, pretrained, client, cloud_acc: float, args, data: dict, plots: Path) -> dict:
    net = main_net(pretrained, variant, args, data)
    hard, mu = hard_of(net, data, 5)
    row = {"model": name, "variant": variant, "hard_classes": [data["classes"][c] for c in hard.hard],
           "mu_correct": mu[0], "mu_wrong": mu[1], **edge_run(net, hard, args, data)}
    x, y = data["target"]["test"]
    row.update(edge_tables(net, hard, x, y), **block_costs(net, x[:1]), cloud_acc=cloud_acc)
    report = edge_cloud_report(net, hard, client, x, y, mu, sum(mu) / 2, args.sweep, CostModel())
    edge_only, cloud_only = report["edge_only"], report["cloud_only"]
    row.update(best_within_target(report["sweep"], cloud_only["acc"]), sweep=report["sweep"],
               cloud_only_routed_acc=cloud_only["acc"], edge_energy_j=edge_only["edge_energy_j"],
               cloud_energy_j=cloud_only["edge_energy_j"], round_trip_s_per_instance=report["round_trip_s"],
               edge_main_s=report["edge_latency"]["main_s"], edge_extension_s=report["edge_latency"]["extension_s"])
    plot_sweep(row["sweep"], edge_only, cloud_only, mu, sum(mu) / 2, plots / f"{NAME}_{name}_{variant}_sweep.png",
               f"MEANet {name} model {variant}: edge-cloud inference (Fashion-MNIST test)")
    log.info("%s %s: hard %.4f -> %.4f, all %.4f -> %.4f, peak %.2f of joint", name, variant, row["hard_acc_main"],
             row["hard_acc_meanet"], row["all_acc_main"], row["all_acc_meanet"], row["peak_ratio"])
    return row


def best_within_target(sweep: list[dict], cloud_acc: float) -> dict:
    """The threshold sending the fewest instances whose accuracy is within CLOUD_TOLERANCE of cloud-only."""
    ok = [r for r in sweep if r["acc"] >= cloud_acc - CLOUD_TOLERANCE]
    best = min(ok, key=lambda r: r["cloud_frac"]) if ok else max(sweep, key=lambda r: r["acc"])
    return {"edge_cloud_threshold": best["threshold"], "edge_cloud_acc": best["acc"],
            "edge_cloud_frac": best["cloud_frac"], "edge_cloud_within_1pt": bool(ok)}


def class_selection(pretrained, args, data: dict) -> list[dict]:
    """Tables IV-V on ResNet-18 model A: hard (n_hard 5 and --n-hards) vs 5 random classes."""
    rows = []
    choices = [(n, None) for n in [5, *args.n_hards]] + [(5, sorted(random.Random(0).sample(range(10), 5)))]
    x, y = data["target"]["test"]
    for n_hard, choose in choices:
        net = main_net(pretrained, "A", args, data, n_hard)
        hard, _ = hard_of(net, data, n_hard, choose)
        edge_run(net, hard, args, data)
        tables = edge_tables(net, hard, x, y)
        rows.append({"selection": f"{n_hard} {'random' if choose else 'hard'}", "classes": hard.hard,
                     "detection_acc": detection_accuracy(main_logits(net, x), y, hard),
                     **{k: tables[k] for k in ("hard_acc_main", "hard_acc_meanet", "all_acc_main", "all_acc_meanet")}})
    return rows


def cloud_model(args, data: dict, directory: Path) -> dict:
    """The cloud's CNN (bench.meanet_cloud's: from --cloud-dir, else trained here on the source half with its
    recipe), saved in MLflow's format for the server; its build arguments and target test accuracy."""
    path = args.cloud_dir / "cloud_seed0.pt" if args.cloud_dir else None
    if path is None:
        flags = ["--quick"] if args.quick else ["--epochs", str(args.cloud_model_epochs)]
        cloud_args = meanet_cloud.parse_args([*flags, "--device", "cpu", "--out", str(directory.parent)])
        splits = {"train": data["source"]["train"], "val": data["source"]["val"], "test": data["target"]["test"]}
        path = directory.parent / meanet_cloud.train_cloud(cloud_args, splits, 0, directory.parent)["file"]
    model = meanet_cloud.load_cloud(path)
    save_model_dir(model, directory, data["target"]["test"][0][:2])
    return {**model.spec, "from": str(args.cloud_dir or "trained here"),
            "test_acc": evaluate(model, *data["target"]["test"])}


def plot_summary(rows: list[dict], out: Path) -> None:
    """Hard-class and all-class accuracy, main vs MEANet, and the edge's training peak vs joint, per config."""
    plt = _pyplot()
    labels = [f"{r['model']} {r['variant']}" for r in rows]
    idx = range(len(rows))
    fig, (acc, mem) = plt.subplots(1, 2, figsize=(11, 4))
    for offset, key, label in ((-0.3, "hard_acc_main", "hard classes: main"), (-0.1, "hard_acc_meanet", "hard: MEANet"),
                               (0.1, "all_acc_main", "all classes: main"), (0.3, "all_acc_meanet", "all: MEANet")):
        acc.bar([i + offset for i in idx], [100 * r[key] for r in rows], width=0.2, label=label)
    acc.set_xticks(list(idx), labels)
    acc.set(ylabel="test accuracy (%)", title="Tables II-III: main block vs MEANet", ylim=(40, 100))
    acc.legend(fontsize=7)
    mem.bar([i - 0.2 for i in idx], [r["edge_train_peak_bytes"] / 2**20 for r in rows], width=0.4,
            label="MEANet (main fixed)")
    mem.bar([i + 0.2 for i in idx], [r["joint_train_peak_bytes"] / 2**20 for r in rows], width=0.4, label="joint")
    mem.set_xticks(list(idx), labels)
    mem.set(ylabel="measured training-step peak (MiB)", title="Fig. 6: training memory at equal batch")
    mem.legend(fontsize=7)
    for ax in (acc, mem):
        ax.grid(alpha=0.3, axis="y")
    _save(fig, out)


def targets(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        gain = r["hard_acc_meanet"] - r["hard_acc_main"]
        lines.append(f"- {r['model']} {r['variant']}: hard-class +{100 * gain:.1f} points "
                     f"({'met' if gain >= HARD_TARGET else 'missed'} >= {100 * HARD_TARGET:.0f}); all classes "
                     f"{100 * (r['all_acc_meanet'] - r['all_acc_main']):+.1f} points "
                     f"({'met' if r['all_acc_meanet'] >= r['all_acc_main'] else 'missed'}: not below the main block); "
                     f"edge-cloud {100 * r['edge_cloud_acc']:.2f}% vs cloud-only {100 * r['cloud_acc']:.2f}% sending "
                     f"{100 * r['edge_cloud_frac']:.1f}% ({'met' if r['edge_cloud_within_1pt'] and r['edge_cloud_frac'] <= CLOUD_SHARE else 'missed'}"
                     f": within 1 point, <= 30%); training peak {r['peak_ratio']:.2f} of joint "
                     f"({'met' if r['peak_ratio'] <= MEMORY_RATIO else 'missed'} <= {MEMORY_RATIO:.2f})")
    return lines


def write(result: BenchResult, rows: list[dict], selection: list[dict], args, extra: dict) -> None:
    result.rows = rows
    md = [{k: v for k, v in r.items() if k not in ("sweep", "hard_classes")} for r in rows]
    result.add_section("Table II: hard-class test accuracy", rows, ["model", "variant", "hard_acc_main", "hard_acc_meanet",
                                                                     "hard_acc_routed"])
    result.add_section("Table III: all-class test accuracy, easy/hard detection", rows,
                       ["model", "variant", "all_acc_main", "all_acc_meanet", "detection_acc", "edge_exit_extension"])
    result.add_section("Table VI: fixed and trained parameters, multiply-adds per instance", rows,
                       ["model", "variant", "fixed_params", "trained_params", "fixed_macs", "trained_macs"])
    result.add_section("Fig. 6: measured training-step peak at equal batch", rows,
                       ["model", "variant", "edge_train_peak_bytes", "joint_train_peak_bytes", "peak_ratio"])
    result.add_section("Edge-cloud (real HTTP cloud): the threshold with the fewest sent within 1 point of cloud-only",
                       rows, ["model", "variant", "cloud_acc", "edge_cloud_acc", "edge_cloud_frac", "edge_cloud_threshold",
                              "edge_energy_j", "cloud_energy_j", "round_trip_s_per_instance"])
    for r in rows:
        result.add_section(f"Threshold sweep, {r['model']} model {r['variant']} (Figs. 7-8)", r["sweep"],
                           ["threshold", "acc", "cloud_frac", "fallbacks", "edge_energy_j", "latency_s"])
    if selection:
        result.add_section("Tables IV-V: class selection (ResNet-18 model A)", selection)
    notes = "Targets (this run):\n\n" + "\n".join(targets(rows))
    result.write(NAME, args.out, title="MEANet: edge-cloud complexity-aware training and inference (Fashion-MNIST)",
                 md_rows=md, columns=["model", "variant", "hard_acc_main", "hard_acc_meanet", "all_acc_main",
                                      "all_acc_meanet", "cloud_acc", "edge_cloud_acc", "edge_cloud_frac", "peak_ratio",
                                      "edge_train_s"],
                 notes=notes, extra=extra)
    plot_summary(rows, args.out / f"{NAME}.png")


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[RichHandler(show_path=False)])
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    start, data = time.perf_counter(), load(args)
    rows, selection = [], []
    with tempfile.TemporaryDirectory() as tmp:
        cloud = cloud_model(args, data, Path(tmp) / "cloud")
        cloud_acc = cloud["test_acc"]
        with ModelServer(Path(tmp) / "cloud", log_path=Path(tmp) / "server.log") as server, \
                CloudClient(server.url) as client:
            for name in args.models:
                pretrained = pretrain(name, MODELS[name], args.pretrain_epochs, data)
                for variant in args.variants:
                    rows.append(one_config(name, variant, pretrained, client, cloud_acc, args, data, args.out))
                if name == "resnet18" and "A" in args.variants and not args.quick:
                    selection = class_selection(pretrained, args, data)
    extra = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
             "cloud_model": cloud,
             "wall_s": time.perf_counter() - start}
    write(BenchResult(), rows, selection, args, extra)
    log.info("wrote %s in %.0fs", args.out / f"{NAME}.json", time.perf_counter() - start)


if __name__ == "__main__":
    main()
