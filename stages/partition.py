"""Stage partition (NeuroFlux §2, Algorithm 1): blocks of consecutive units and a batch size per block.

Reads the per-unit linear models in profile/memory.json; each unit's largest batch under
the budget (device.budget, capped at device.max_batch) groups consecutive units whose batch sizes
differ by at most neuroflux.rho. A unit that cannot fit batch 1 stops the stage with the
smallest budget that would work. Writes partition/blocks.json and metrics/partition.json.
"""
from __future__ import annotations

from pathlib import Path

from edgeflux.config import ParamsError
from edgeflux.neuroflux.partition import partition, save_blocks
from edgeflux.neuroflux.profile import load_profile
from edgeflux.tracking import stage_run
from stages.common import run_stage, stage_parser, write_metrics
from stages.registry import Stage

STAGE = Stage(name="partition", section="neuroflux", side="device", budgeted=True,
              outs=("details/partition.json", "partition/blocks.json", "metrics/partition.json"))

PROFILE, BLOCKS = Path("profile/memory.json"), Path("partition/blocks.json")


def main(args, params) -> None:
    p = params.neuroflux
    if p.budget is None:
        raise ParamsError(f"{args.params}: device.budget is not set (null or absent); NeuroFlux partitions a model "
                          "under a memory budget: set it with a unit, e.g. device.budget: 16MB")
    profiles, meta = load_profile(PROFILE)
    with stage_run("partition", {"budget": p.budget, "max_batch": p.max_batch, "rho": p.rho}) as run:
        blocks = partition([(u.slope_bytes_per_sample, u.intercept_bytes) for u in profiles], p.budget, p.max_batch,
                           rho=p.rho, names=[u.name for u in profiles], floors=[u.min_bytes for u in profiles])
        save_blocks(BLOCKS, blocks, {"budget_bytes": p.budget, "batch_limit": p.max_batch, "rho": p.rho, **meta})
        metrics = {"blocks": len(blocks), "budget_bytes": p.budget,
                   "min_block_batch": min(b.batch_size for b in blocks),
                   "max_block_batch": max(b.batch_size for b in blocks)}
        written = write_metrics("partition", metrics, run, names={
            "blocks": "blocks", "min_block_batch": "min_block_batch", "max_block_batch": "max_block_batch",
            "budget_bytes": "budget_mib"})
        for path in (BLOCKS, *written):
            run.log_artifact(path)


if __name__ == "__main__":
    run_stage(main, stage_parser(__doc__))
