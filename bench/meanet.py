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
    python -m bench.meanet --threads 2 --cloud-dir runs/cloud         # full run, 3 seeds, results in bench/results/
    python -m bench.meanet --quick --out /tmp/bench     # CI-sized: ResNet-18 B only, small data, 3 thresholds, 1 seed

Every seed is a whole run: its own pre-trained CNN, new blocks, edge training order and cloud (cloud_seed{S}.pt).
Rows are means over the seeds with each figure's 95% interval (Student's t) as <figure>_ci95; a target is met
when the whole interval of its per-seed differences clears it (bench.common.judged), "not shown" when the
interval spans it. Tables IV-V and the sweep figures are the first seed's. Within one configuration the cloud
is asked over HTTP once per test image (the cloud-only pass, whose round trip the cost model uses); the sweep's
passes reuse those answers (RememberedCloud: the same served model answers the same image the same way).
"""
from __future__ import annotations

import copy
import hashlib
import logging
import random
import tempfile
import time
from pathlib import Path

import torch
from rich.logging import RichHandler

from bench import meanet_cloud
from bench.common import (TARGET_COLUMNS, BenchResult, HelpFormatter, add_seeds, bench_argparser, over_seeds, pm,
                          quick_args, seeds_of, target)
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
EDGE_GAIN, EDGE_GAIN_SHARE = 0.02, 0.15      # edge-cloud this far above the edge alone, sending at most this share
QUICK = dict(models=["resnet18"], variants=["B"], pretrain_samples=1024, pretrain_epochs=1, cloud_epochs=1,
             train_samples=1024, eval_samples=256, test_samples=256, edge_epochs=1, sweep=3, n_hards=[])
# what is averaged over seeds (the rest of a row is its first seed's)
METRICS = ("hard_acc_main", "hard_acc_meanet", "hard_acc_routed", "all_acc_main", "all_acc_meanet", "edge_acc",
           "detection_acc", "edge_exit_extension", "cloud_acc", "cloud_only_routed_acc", "edge_cloud_acc",
           "edge_cloud_frac", "acc_at_15", "frac_at_15", "acc_at_30", "frac_at_30", "edge_train_s",
           "edge_train_peak_bytes", "joint_train_peak_bytes", "peak_ratio", "edge_energy_j", "cloud_energy_j",
           "round_trip_s_per_instance")


class EdgeOptions(TrainOptions, MemoryOptions):
    """The edge's training options: the one loop's, with the memory options (no budget: --batch)."""


def add_flags(parser) -> None:
    """The flags bench.meanet and bench.meanet_blocks share: the CNNs, the data, pre-training, the edge's training."""
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), metavar="MODEL",
                        help=f"main-block CNNs (of {', '.join(MODELS)}; widths {MODELS})")
    parser.add_argument("--pretrain-samples", type=int, default=None, help="source images (default: all 27,000)")
    parser.add_argument("--pretrain-epochs", type=int, default=2, help="the main CNN's pre-training epochs")
    parser.add_argument("--train-samples", type=int, default=None, help="target images the edge sees (hard ones train)")
    parser.add_argument("--eval-samples", type=int, default=None, help="validation images (default: all)")
    parser.add_argument("--test-samples", type=int, default=None, help="test images (default: all 10,000)")
    parser.add_argument("--edge-epochs", type=int, default=4, help="epochs of the adaptive + extension blocks")
    parser.add_argument("--batch", type=int, default=64, help="the edge's batch (bench.meanet: and the joint measurement's)")
    parser.add_argument("--lr", type=float, default=1e-3, help="the edge's learning rate (Adam)")


def parse_args(argv=None):
    parser = bench_argparser(__doc__)
    parser.formatter_class = HelpFormatter
    add_flags(parser)
    parser.add_argument("--variants", nargs="+", default=["A", "B"], choices=["A", "B"], help="MEANet models")
    parser.add_argument("--cloud-epochs", type=int, default=1, help="model A: the main block's joint training epochs")
    parser.add_argument("--cloud-dir", type=Path, default=None,
                        help="clouds trained by bench.meanet_cloud (on a GPU): each seed serves its cloud_seed{S}.pt; "
                             "default: train bench.meanet_cloud's CNN here for --cloud-model-epochs")
    parser.add_argument("--cloud-model-epochs", type=int, default=2, help="without --cloud-dir: the cloud's epochs")
    parser.add_argument("--sweep", type=int, default=13, help="thresholds in the sweep")
    parser.add_argument("--n-hards", nargs="*", type=int, default=[3, 7],
                        help="Table V: other n_hard values for ResNet-18 model A (5, the default, always runs)")
    add_seeds(parser, "CNN and block weights, data order, the cloud")
    args = quick_args(parser.parse_args(argv), QUICK)
    args.seeds = seeds_of(args)
    return args


def load(args) -> dict:
    data = prepare(load_raw("fashion-mnist"), image_size=32, val_fraction=0.1, seed=0, split_by="data")
    return {"classes": data.classes,
            "source": {s: tensors(data, f"source_{s}", limit=n) for s, n in
                       (("train", args.pretrain_samples), ("val", args.eval_samples), ("test", args.test_samples))},
            "target": {s: tensors(data, f"target_{s}", limit=n) for s, n in
                       (("train", args.train_samples), ("val", args.eval_samples), ("test", args.test_samples))}}


def pretrain(name: str, epochs: int, data: dict, seed: int) -> torch.nn.Module:
    """A CNN trained with plain backprop on the source half (the pipeline's pretrain stage, same recipe)."""
    width = MODELS[name]
    model = build_model(name, 10, 1, width, 32, seed=seed)
    model.build_args = dict(name=name, num_classes=10, in_channels=1, width=width, image_size=32, batch_norm=True,
                            seed=seed)
    opts = TrainOptions(epochs=epochs, batch_size=128, lr=0.05, evals_per_epoch=1, device="cpu", seed=seed)
    s = data["source"]
    run = train_under_budget(model, s["train"], s["val"], s["test"], opts,
                             TrainRun(torch.device("cpu"), desc=f"pretrain {name}-w{width:g} seed {seed}"))
    log.info("pretrained %s-w%g: source test accuracy %.4f in %.0fs", name, width, run.test_acc, run.train.train_time_s)
    return model


def main_net(pretrained, spec: MEANetSpec, args, data: dict):
    """The MEANet ``spec`` of a copy of `pretrained` (model A: its main block trained at the cloud first)."""
    model = copy.deepcopy(pretrained)
    main, k = main_block(model, spec)
    if spec.variant == "A":
        s = data["source"]
        opts = TrainOptions(epochs=args.cloud_epochs, batch_size=128, lr=0.05, evals_per_epoch=1, device="cpu",
                            seed=model.build_args["seed"])
        train_main_block(model, main, k, s["train"], s["val"], s["test"], opts, torch.device("cpu"))
    return build_meanet(model, spec, model.build_args, main=main)


def edge_train(net, hard, args, data: dict):
    """Train the adaptive + extension blocks (main block fixed) at --batch: the run and its options."""
    t = data["target"]
    opts = EdgeOptions(epochs=args.edge_epochs, batch_size=args.batch, lr=args.lr, optimizer="adam",
                       evals_per_epoch=1, device="cpu", max_batch=args.batch, seed=net.build_args["seed"])
    return train_edge(net, hard, t["train"], t["val"], t["test"], opts, torch.device("cpu")), opts


def edge_run(net, hard, args, data: dict) -> dict:
    """Train the adaptive + extension blocks (main block fixed) and measure both methods' steps at --batch."""
    t = data["target"]
    run, opts = edge_train(net, hard, args, data)
    edge = edge_step_memory(net, hard, args.batch, t["train"], opts, "cpu")
    joint = joint_step_memory(net, hard, args.batch, t["train"], opts, "cpu")
    return {"edge_train_s": run.train.train_time_s, "edge_train_peak_bytes": edge.peak_bytes,
            "joint_train_peak_bytes": joint.peak_bytes, "edge_saved_bytes": edge.saved_bytes,
            "joint_saved_bytes": joint.saved_bytes, "peak_ratio": edge.peak_bytes / joint.peak_bytes}


def hard_of(net, data: dict, n_hard: int, choose=None):
    val = data["source"]["val"]
    logits = main_logits(net, val[0])
    return hard_classes(logits, val[1], n_hard, choose), entropy_range(logits, val[1])


class RememberedCloud:
    """The served cloud, asked over HTTP once per distinct image: later passes reuse its answer (the same model
    answers the same image the same way), so a sweep of many thresholds costs one pass of the cloud on this CPU."""

    def __init__(self, client: CloudClient) -> None:
        self.client, self.answers = client, {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        keys = [hashlib.blake2b(row.numpy().tobytes(), digest_size=16).digest() for row in x]
        new = [i for i, key in enumerate(keys) if key not in self.answers]
        if new:
            for i, logits in zip(new, self.client(x[new])):
                self.answers[keys[i]] = logits
        return torch.stack([self.answers[key] for key in keys])


def at_share(sweep: list[dict], edge_only: dict, share: float) -> dict:
    """The most accurate way to send at most `share` of the instances: a sweep point, or the edge alone."""
    return max([edge_only, *(r for r in sweep if r["cloud_frac"] <= share)], key=lambda r: r["acc"])


def one_config(name: str, variant: str, pretrained, client, args, data: dict, plots: Path | None) -> dict:
    """One MEANet (model `variant` on `name`) trained on the edge and routed with the cloud; plots: the sweep's
    figure's directory (None: no figure)."""
    net = main_net(pretrained, MEANetSpec(variant=variant), args, data)
    hard, mu = hard_of(net, data, 5)
    row = {"model": name, "variant": variant, "seed": net.build_args["seed"],
           "hard_classes": [data["classes"][c] for c in hard.hard], "mu_correct": mu[0], "mu_wrong": mu[1],
           **edge_run(net, hard, args, data)}
    x, y = data["target"]["test"]
    row.update(edge_tables(net, hard, x, y), **block_costs(net, x[:1]))
    report = edge_cloud_report(net, hard, RememberedCloud(client), x, y, mu, sum(mu) / 2, args.sweep, CostModel())
    edge_only, cloud_only, sweep = report["edge_only"], report["cloud_only"], report["sweep"]
    for point in sweep:
        point["round_trip_s"] = None         # answered from RememberedCloud: the cost model uses cloud-only's
    low, high = at_share(sweep, edge_only, EDGE_GAIN_SHARE), at_share(sweep, edge_only, CLOUD_SHARE)
    row.update(best_within_target(sweep, cloud_only["acc"]), sweep=sweep, edge_acc=edge_only["acc"],
               cloud_only_routed_acc=cloud_only["acc"], acc_at_15=low["acc"], frac_at_15=low["cloud_frac"],
               acc_at_30=high["acc"], frac_at_30=high["cloud_frac"], edge_energy_j=edge_only["edge_energy_j"],
               cloud_energy_j=cloud_only["edge_energy_j"], round_trip_s_per_instance=report["round_trip_s"],
               edge_main_s=report["edge_latency"]["main_s"], edge_extension_s=report["edge_latency"]["extension_s"])
    if plots is not None:
        plot_sweep(sweep, edge_only, cloud_only, mu, sum(mu) / 2, plots / f"{NAME}_{name}_{variant}_sweep.png",
                   f"MEANet {name} model {variant}: edge-cloud inference (Fashion-MNIST test, seed {row['seed']})")
    log.info("%s %s seed %d: hard %.4f -> %.4f, all %.4f -> %.4f, edge-cloud %.4f at <= 15%% sent, cloud-only %.4f",
             name, variant, row["seed"], row["hard_acc_main"], row["hard_acc_meanet"], row["all_acc_main"],
             row["all_acc_meanet"], row["acc_at_15"], cloud_only["acc"])
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
        net = main_net(pretrained, MEANetSpec(variant="A", n_hard=n_hard), args, data)
        hard, _ = hard_of(net, data, n_hard, choose)
        edge_run(net, hard, args, data)
        tables = edge_tables(net, hard, x, y)
        rows.append({"selection": f"{n_hard} {'random' if choose else 'hard'}", "classes": hard.hard,
                     "detection_acc": detection_accuracy(main_logits(net, x), y, hard),
                     **{k: tables[k] for k in ("hard_acc_main", "hard_acc_meanet", "all_acc_main", "all_acc_meanet")}})
    return rows


def cloud_model(args, data: dict, directory: Path, seed: int) -> dict:
    """The seed's cloud CNN (bench.meanet_cloud's: from --cloud-dir, else trained here on the source half with its
    recipe), saved in MLflow's format for the server; its build arguments and target test accuracy."""
    path = args.cloud_dir / f"cloud_seed{seed}.pt" if args.cloud_dir else None
    if path is None:
        flags = ["--quick"] if args.quick else ["--epochs", str(args.cloud_model_epochs)]
        cloud_args = meanet_cloud.parse_args([*flags, "--device", "cpu", "--out", str(directory.parent)])
        splits = {"train": data["source"]["train"], "val": data["source"]["val"], "test": data["target"]["test"]}
        path = directory.parent / meanet_cloud.train_cloud(cloud_args, splits, seed, directory.parent)["file"]
    model = meanet_cloud.load_cloud(path)
    save_model_dir(model, directory, data["target"]["test"][0][:2])
    return {**model.spec, "from": str(args.cloud_dir or "trained here"),
            "test_acc": evaluate(model, *data["target"]["test"])}


def plot_summary(rows: list[dict], out: Path) -> None:
    """Hard-class and all-class accuracy, main vs MEANet (means, 95% intervals), and the edge's training peak vs
    joint, per config."""
    plt = _pyplot()
    labels = [f"{r['model']}\nmodel {r['variant']}" for r in rows]
    idx = range(len(rows))
    fig, (acc, mem) = plt.subplots(1, 2, figsize=(12, 4.8))
    for offset, key, label in ((-0.3, "hard_acc_main", "hard classes: main"), (-0.1, "hard_acc_meanet", "hard: MEANet"),
                               (0.1, "all_acc_main", "all classes: main"), (0.3, "all_acc_meanet", "all: MEANet")):
        acc.bar([i + offset for i in idx], [100 * r[key] for r in rows], width=0.2, label=label,
                yerr=[100 * (r.get(f"{key}_ci95") or 0) for r in rows], capsize=3)
    acc.set_xticks(list(idx), labels)
    acc.set(ylabel="test accuracy (%; mean, 95% interval)", title="Tables II-III: main block vs MEANet",
            ylim=(40, 100))
    acc.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    mem.bar([i - 0.2 for i in idx], [r["edge_train_peak_bytes"] / 2**20 for r in rows], width=0.4,
            label="MEANet (main fixed)")
    mem.bar([i + 0.2 for i in idx], [r["joint_train_peak_bytes"] / 2**20 for r in rows], width=0.4, label="joint")
    mem.set_xticks(list(idx), labels)
    mem.set(ylabel="measured training-step peak (MiB)", title="Fig. 6: training memory at equal batch")
    mem.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    for ax in (acc, mem):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    _save(fig, out)


def targets(seed_rows: list[dict]) -> list[dict]:
    """Each configuration's targets, judged by the 95% interval of its per-seed figures."""
    checks = (("hard-class gain of the extension exit (points)", HARD_TARGET,
               lambda r: r["hard_acc_meanet"] - r["hard_acc_main"]),
              ("all classes, MEANet on the edge minus the main block (points)", 0.0,
               lambda r: r["all_acc_meanet"] - r["all_acc_main"]),
              (f"edge-cloud minus the edge alone, <= {EDGE_GAIN_SHARE:.0%} sent (points)", EDGE_GAIN,
               lambda r: r["acc_at_15"] - r["edge_acc"]),
              (f"edge-cloud minus cloud-only, <= {CLOUD_SHARE:.0%} sent (points)", -CLOUD_TOLERANCE,
               lambda r: r["acc_at_30"] - r["cloud_only_routed_acc"]),
              ("training peak saved against joint training (% of joint)", 1 - MEMORY_RATIO,
               lambda r: 1 - r["peak_ratio"]))
    groups: dict[tuple, list[dict]] = {}
    for r in seed_rows:
        groups.setdefault((r["model"], r["variant"]), []).append(r)
    return [target(what, 100 * bound, [100 * value(r) for r in group], model=model, variant=variant)
            for (model, variant), group in groups.items() for what, bound, value in checks]


def write(result: BenchResult, rows: list[dict], selection: list[dict], args, extra: dict) -> None:
    result.rows = rows
    md = [{**r, **{k: pm(r, k) for k in METRICS if k in r and not k.endswith("_bytes")}} for r in rows]
    result.add_section("Table II: hard-class test accuracy", md, ["model", "variant", "hard_acc_main", "hard_acc_meanet",
                                                                   "hard_acc_routed"])
    result.add_section("Table III: all-class test accuracy, easy/hard detection", md,
                       ["model", "variant", "all_acc_main", "all_acc_meanet", "detection_acc", "edge_exit_extension"])
    result.add_section("Table VI: fixed and trained parameters, multiply-adds per instance", rows,
                       ["model", "variant", "fixed_params", "trained_params", "fixed_macs", "trained_macs"])
    result.add_section("Fig. 6: measured training-step peak at equal batch", md,
                       ["model", "variant", "edge_train_peak_bytes", "joint_train_peak_bytes", "peak_ratio"])
    result.add_section("Edge-cloud with the real HTTP cloud: the edge alone, at most 15% and 30% sent, cloud-only",
                       md, {"model": "model", "variant": "variant", "edge_acc": "edge alone", "acc_at_15": "<= 15% sent",
                            "frac_at_15": "share sent", "acc_at_30": "<= 30% sent", "frac_at_30": "share sent ",
                            "cloud_only_routed_acc": "cloud-only", "edge_energy_j": "edge alone: modelled energy (J)",
                            "cloud_energy_j": "cloud-only: modelled energy (J)",
                            "round_trip_s_per_instance": "measured round trip (s/instance)"})
    result.add_section("Targets: each judged by the 95% interval of its per-seed values", extra["targets"],
                       ["model", "variant", *TARGET_COLUMNS])
    for r in rows:
        result.add_section(f"Threshold sweep, {r['model']} model {r['variant']}, seed {r['seeds'][0]} (Figs. 7-8; "
                           "energy and latency modelled by Table I)", r["sweep"],
                           ["threshold", "acc", "cloud_frac", "fallbacks", "edge_energy_j", "latency_s"])
    if selection:
        result.add_section(f"Tables IV-V: class selection (ResNet-18 model A, seed {args.seeds[0]})", selection)
    result.write(NAME, args.out, title="MEANet: edge-cloud complexity-aware training and inference (Fashion-MNIST)",
                 md_rows=md, columns=["model", "variant", "hard_acc_main", "hard_acc_meanet", "edge_acc", "cloud_acc",
                                      "acc_at_15", "frac_at_15", "peak_ratio", "edge_train_s", "n_seeds"],
                 notes=NOTES, extra=extra)
    plot_summary(rows, args.out / f"{NAME}.png")


NOTES = """Figures are means over the seeds ± the 95% interval's half-width (Student's t). edge_acc: MEANet routed on
the edge alone; cloud_acc: the cloud CNN's own test accuracy; cloud-only: every instance sent over HTTP. Energy is
Table I's model (a stated edge power times measured edge time, upload modelled), not a measurement."""


def seed_run(seed: int, args, data: dict) -> tuple[list[dict], list[dict], dict]:
    """One seed: its cloud served on loopback, every model and variant; Tables IV-V on the first seed."""
    rows, selection = [], []
    with tempfile.TemporaryDirectory() as tmp:
        cloud = cloud_model(args, data, Path(tmp) / "cloud", seed)
        with ModelServer(Path(tmp) / "cloud", log_path=Path(tmp) / "server.log") as server, \
                CloudClient(server.url) as client:
            for name in args.models:
                pretrained = pretrain(name, args.pretrain_epochs, data, seed)
                for variant in args.variants:
                    plots = args.out if seed == args.seeds[0] else None
                    rows.append({**one_config(name, variant, pretrained, client, args, data, plots),
                                 "cloud_acc": cloud["test_acc"]})
                if name == "resnet18" and "A" in args.variants and not args.quick and seed == args.seeds[0]:
                    selection = class_selection(pretrained, args, data)
    return rows, selection, cloud


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[RichHandler(show_path=False)])
    if args.threads:
        torch.set_num_threads(args.threads)
    for seed in args.seeds if args.cloud_dir else ():     # before any training: every seed needs its cloud
        if not (args.cloud_dir / f"cloud_seed{seed}.pt").is_file():
            raise SystemExit(f"{args.cloud_dir / f'cloud_seed{seed}.pt'} is missing: train it with python -m "
                             f"bench.meanet_cloud --seeds {seed} --out {args.cloud_dir}, or drop seed {seed} from --seeds")
    args.out.mkdir(parents=True, exist_ok=True)
    start, data = time.perf_counter(), load(args)
    seed_rows, selection, clouds = [], [], []
    for seed in args.seeds:
        rows, chosen, cloud = seed_run(seed, args, data)
        seed_rows, selection, clouds = seed_rows + rows, selection or chosen, clouds + [cloud]
    extra = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
             "n_seeds": len(args.seeds), "cloud_model": clouds[0], "clouds": clouds, "targets": targets(seed_rows),
             "per_seed": seed_rows, "wall_s": time.perf_counter() - start}
    write(BenchResult(), over_seeds(seed_rows, ("model", "variant"), METRICS), selection, args, extra)
    log.info("wrote %s in %.0fs", args.out / f"{NAME}.json", time.perf_counter() - start)


if __name__ == "__main__":
    main()
