"""Stage train_blocks (NeuroFlux §3, Algorithm 2): block-wise adaptive local learning under the budget.

Trains the blocks of partition/blocks.json in order, each at its own batch size (lowered only if
the measured block step exceeds the budget, device.budget); a finished block's outputs for the train,
validation and test splits are cached in cache/neuroflux/ (a DVC output) and feed the next block.
A rerun skips finished blocks whose config and input match, verifies their caches (rebuilding a
corrupt one) and resumes an interrupted block from its last epoch. Writes models/neuroflux.pt
(every unit and auxiliary head), metrics/train_blocks.json, plots/train_blocks.csv.
"""
from __future__ import annotations

from pathlib import Path

from edgeflux.data import load_prepared, tensors
from edgeflux.neuroflux.aux import exit_params
from edgeflux.neuroflux.model import aux_args, build_learners, save_learners
from edgeflux.neuroflux.partition import load_blocks
from edgeflux.neuroflux.profile import load_profile
from edgeflux.neuroflux.worker import train_blocks
from edgeflux.tracking import stage_run
from edgeflux.train import resolve_device
from edgeflux.rows import NEUROFLUX_FULL, MethodRow, RowInputs, training_row, with_bittrain
from stages.common import peak_rss_bytes, run_stage, stage_parser, write_history_csv, write_metrics
from stages.registry import Stage

STAGE = Stage(name="train_blocks", section="neuroflux", side="device", budgeted=True,
              curve="plots/train_blocks.csv", rows=True,
              outs=("details/train_blocks.json", "cache/neuroflux", "models/neuroflux.pt", "plots/train_blocks.csv",
                    "metrics/train_blocks.json"))

BLOCKS, PROFILE = Path("partition/blocks.json"), Path("profile/memory.json")
CACHE, CHECKPOINTS = Path("cache/neuroflux"), Path(".edgeflux/checkpoints/neuroflux")
MODEL, PLOT = Path("models/neuroflux.pt"), Path(STAGE.curve)


def main(args, params) -> None:
    p = params.neuroflux
    data = load_prepared(Path("data/prepared"))
    device = resolve_device(p.device)
    splits = {"train": tensors(data, "target_train", limit=p.max_train_samples),
              "val": tensors(data, "target_val"), "test": tensors(data, "target_test")}
    x = splits["train"][0]
    spec, aux = p.model.build_args(len(data.classes), x.shape[1], x.shape[-1], p.seed), aux_args(p)
    blocks, _ = load_blocks(BLOCKS)
    with stage_run("train_blocks", p.model_dump()) as run:
        model, learners = build_learners(spec, aux)
        result = train_blocks(learners, blocks, splits, p, workdir=CACHE, budget_bytes=p.budget, device=device,
                              cache=p.cache, context=p.bittrain.context,
                              signature={"spec": spec, "aux": aux, "bittrain": p.bittrain.to_dict()}, checkpoint_dir=CHECKPOINTS,
                              desc="neuroflux", split_rho=p.rho)
        profile_s = load_profile(PROFILE)[1]["profiling_seconds"]
        last = len(learners) - 1
        metrics = {"model": p.model.key, "device": str(device), "planned_blocks": len(blocks),
                   "blocks": len(result.blocks),   # more than planned where a block was split to fit the budget
                   "batch_sizes": [b.batch_size for b in result.blocks],
                   "peak_mem_bytes": result.peak_bytes, "budget_bytes": p.budget,
                   "within_budget": all(b.peak_bytes <= p.budget for b in result.blocks) if p.budget else None,
                   "train_time_s": result.train_time_s, "train_cpu_s": result.train_cpu_s, "steps": sum(b.steps for b in result.blocks),
                   "cache_bytes": sum(b.cache_bytes for b in result.blocks),
                   "profile_time_s": profile_s, "profile_overhead": profile_s / max(result.train_time_s, 1e-9),
                   # the whole process on the host (torch, data, caches read): not what the budget bounds
                   "peak_rss_bytes": peak_rss_bytes(),
                   # the names every stage shares (edgeflux.tracking): the full model's, and the batch of
                   # the block with the smallest one (each block trains at its own, in batch_sizes)
                   "batch_size": min(b.batch_size for b in result.blocks), "params": exit_params(learners, last),
                   # every unit and every auxiliary head trains (the heads are dropped after)
                   "trainable_params": sum(p.numel() for learner in learners for p in learner.parameters()),
                   "val_acc": result.unit_val_acc[last], "test_acc": result.unit_test_acc[last],
                   "best_val_acc": max(result.unit_val_acc), "unit_val_acc": result.unit_val_acc,
                   "unit_test_acc": result.unit_test_acc, "block_results": result.to_dict()["blocks"]}
        written = write_metrics("train_blocks", metrics, run)
        write_history_csv(PLOT, result.history, with_bittrain(NEUROFLUX_FULL, p.bittrain.enabled))
        save_learners(MODEL, learners, spec, aux, meta={"stage": "train_blocks", "blocks": [b.to_dict() for b in blocks],
                                                       "unit_names": model.unit_names,
                                                       "unit_val_acc": result.unit_val_acc,
                                                       "unit_test_acc": result.unit_test_acc})
        run.log_metrics({f"block{i}.{name}": value for i, b in enumerate(result.blocks) for name, value in
                         (("batch_size", b.batch_size), ("peak_mem_bytes", b.peak_bytes), ("train_time_s", b.train_time_s))})
        # the curve is the best exit's so far (what NeuroFlux could output at that time); val_acc and
        # test_acc above are the full model's, so the curve gets names of its own
        run.log_history([{(f"best_exit_{k}" if k in ("val_acc", "test_acc") else k): v for k, v in row.items()}
                         for row in result.history])
        for path in (*written, PLOT):
            run.log_artifact(path)


def summary_rows(inputs: RowInputs) -> list[MethodRow]:
    if "train_blocks" not in inputs.head:
        return []
    detail = inputs.detail["train_blocks"]
    return [training_row(NEUROFLUX_FULL + inputs.plus("neuroflux"), "train_blocks", "scratch", detail["model"],
                         inputs.head["train_blocks"], batch="/".join(map(str, detail["batch_sizes"])),
                         curve=STAGE.curve, plotted=True)]


if __name__ == "__main__":
    run_stage(main, stage_parser(__doc__), resumes=True)
