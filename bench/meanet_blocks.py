"""MEANet model B's hard-class gain against the new residual blocks of its extension block (the paper builds four
on ImageNet; edgeflux's default, meanet.extension_blocks, is 2), over seeds.

The data, pre-training, hard classes and edge training are bench.meanet's (its functions, its recipe): for each
CNN and seed the CNN is pre-trained on the source half once; then, for each --blocks N, model B with N new
residual blocks in its extension block trains its adaptive and extension blocks on the target half's hard-class
instances (the main block fixed) and Table II's hard-class test accuracy is measured on the whole test split: the
main block over all classes against the extension exit over the hard ones. No cloud: the extension exit is the
edge's own. The gain is judged against the +4 points of bench.meanet's target, by the 95% interval of its
per-seed values.

    python -m bench.meanet_blocks --threads 2                # ResNet-18 and MobileNetV2, 1, 2 and 4 blocks, 3 seeds
    python -m bench.meanet_blocks --quick --out /tmp/bench   # CI-sized: ResNet-18, 1 and 2 blocks, small data, 1 seed
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from rich.logging import RichHandler

from bench.common import (TARGET_COLUMNS, BenchResult, HelpFormatter, add_seeds, bench_argparser, mean_ci,
                          over_seeds, pm, quick_args, seeds_of, target)
from bench.meanet import HARD_TARGET, add_flags, edge_train, hard_of, load, main_net, pretrain
from edgeflux.meanet.evaluate import edge_tables
from edgeflux.meanet.model import MEANetSpec, block_costs
from edgeflux.neuroflux.plots import _pyplot, _save

NAME = "meanet_blocks"
log = logging.getLogger("bench.meanet_blocks")
QUICK = dict(models=["resnet18"], blocks=[1, 2], pretrain_samples=1024, pretrain_epochs=1, train_samples=1024,
             eval_samples=256, test_samples=256, edge_epochs=1)
METRICS = ("hard_acc_main", "hard_acc_meanet", "gain", "all_acc_meanet", "edge_train_s")


def parse_args(argv=None):
    parser = bench_argparser(__doc__)
    parser.formatter_class = HelpFormatter
    add_flags(parser)
    parser.add_argument("--blocks", nargs="+", type=int, default=[1, 2, 4],
                        help="new residual blocks in model B's extension block, one MEANet each")
    add_seeds(parser, "CNN and block weights, data order")
    args = quick_args(parser.parse_args(argv), QUICK)
    if min(args.blocks) < 1:
        parser.error(f"--blocks must be at least 1 (model B needs a new block), got {args.blocks}")
    args.seeds = seeds_of(args)
    return args


def blocks_row(name: str, pretrained, blocks: int, args, data: dict) -> dict:
    """Model B with ``blocks`` extension blocks on a copy of ``pretrained``: trained on the edge, Table II measured."""
    net = main_net(pretrained, MEANetSpec(variant="B", extension_blocks=blocks), args, data)
    hard, _ = hard_of(net, data, 5)
    run, _ = edge_train(net, hard, args, data)
    x, y = data["target"]["test"]
    tables, costs = edge_tables(net, hard, x, y), block_costs(net, x[:1])
    row = {"model": name, "blocks": blocks, "seed": net.build_args["seed"], **tables,
           "gain": tables["hard_acc_meanet"] - tables["hard_acc_main"], "edge_train_s": run.train.train_time_s,
           "trained_params": costs["trained_params"], "trained_macs": costs["trained_macs"]}
    log.info("%s B, %d extension block(s), seed %d: hard %.4f -> %.4f (%+.2f points) in %.0fs", name, blocks,
             row["seed"], row["hard_acc_main"], row["hard_acc_meanet"], 100 * row["gain"], row["edge_train_s"])
    return row


def targets(seed_rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in seed_rows:
        groups.setdefault((r["model"], r["blocks"]), []).append(r)
    return [target(f"hard-class gain of the extension exit, {blocks} extension block{'s' * (blocks > 1)} (points)",
                   100 * HARD_TARGET, [100 * r["gain"] for r in group], model=model, variant="B")
            for (model, blocks), group in groups.items()]


def plot(seed_rows: list[dict], path) -> None:
    """Per model: the hard-class gain and the trained parameters against the extension blocks."""
    plt = _pyplot()
    fig, (gain, size) = plt.subplots(1, 2, figsize=(10.4, 4.4), layout="constrained")
    for i, model in enumerate(dict.fromkeys(r["model"] for r in seed_rows)):
        mine = [r for r in seed_rows if r["model"] == model]
        blocks = sorted({r["blocks"] for r in mine})
        cis = [mean_ci([100 * r["gain"] for r in mine if r["blocks"] == b]) for b in blocks]
        half = [0.0 if c["hi"] is None else c["hi"] - c["mean"] for c in cis]
        # offset by model, so that the intervals do not hide each other
        gain.errorbar([b + 0.06 * i for b in blocks], [c["mean"] for c in cis], yerr=half, marker="o", ms=4,
                      capsize=3, label=model, color=plt.cm.tab10(i))
        size.plot(blocks, [next(r["trained_params"] for r in mine if r["blocks"] == b) / 1e3 for b in blocks],
                  marker="o", ms=4, label=model, color=plt.cm.tab10(i))
    gain.axhline(100 * HARD_TARGET, color="grey", ls=":", label=f"target: +{100 * HARD_TARGET:g} points")
    gain.set(xlabel="new residual blocks in the extension block", ylabel="hard-class test accuracy gain (points)",
             title="extension exit over the main block, hard classes")
    size.set(xlabel="new residual blocks in the extension block",
             ylabel="trained parameters (thousands)", title="what the edge trains")
    for ax in (gain, size):
        ax.set_xticks(sorted({r["blocks"] for r in seed_rows}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("MEANet model B against its extension blocks: mean and 95% interval over seeds", fontsize=10)
    _save(fig, path)


def write(seed_rows: list[dict], args, started: float) -> None:
    rows = over_seeds(seed_rows, ("model", "blocks"), METRICS)
    md = [{"model": r["model"], "blocks": r["blocks"], "hard_acc_main": pm(r, "hard_acc_main"),
           "hard_acc_meanet": pm(r, "hard_acc_meanet"), "gain_points": pm(r, "gain", 100, 3),
           "all_acc_meanet": pm(r, "all_acc_meanet"), "trained_params": r["trained_params"],
           "trained_macs": r["trained_macs"], "edge_train_s": pm(r, "edge_train_s", digits=3), "seeds": r["n_seeds"]}
          for r in rows]
    goals = targets(seed_rows)
    result = BenchResult()
    result.rows = rows
    result.add_section("Targets, each judged by the 95% interval of its per-seed values", goals,
                       ["model", "variant", *TARGET_COLUMNS])
    notes = ("Figures are means over the seeds ± the 95% interval's half-width (Student's t). hard_acc_main: the main "
             "block over all classes, on the hard classes' test instances; hard_acc_meanet: the extension exit over "
             "the hard classes on the same instances; all_acc_meanet: MEANet routed on the edge alone (no cloud), "
             "every test instance. trained_params, trained_macs: the adaptive and extension blocks (the first "
             f"seed's). bench time {time.perf_counter() - started:.0f}s.")
    result.write(NAME, args.out, title="MEANet model B: hard-class gain against its extension blocks (Fashion-MNIST)",
                 md_rows=md, notes=notes, extra={"n_seeds": len(args.seeds), "targets": goals, "per_seed": seed_rows,
                                                 "settings": {k: str(v) if isinstance(v, Path) else v
                                                              for k, v in vars(args).items()}})
    plot(seed_rows, args.out / f"{NAME}.png")


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[RichHandler(show_path=False)])
    if args.threads:
        torch.set_num_threads(args.threads)
    started, data = time.perf_counter(), load(args)
    seed_rows = []
    for seed in args.seeds:
        for name in args.models:
            pretrained = pretrain(name, args.pretrain_epochs, data, seed)
            seed_rows += [blocks_row(name, pretrained, n, args, data) for n in args.blocks]
        write(seed_rows, args, started)      # after every seed: a stopped run keeps the seeds done
    log.info("wrote %s in %.0fs", args.out / f"{NAME}.json", time.perf_counter() - started)


if __name__ == "__main__":
    main()
