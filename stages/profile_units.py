"""Stage profile (NeuroFlux §1; named profile_units: a module called profile would shadow the standard
library's, which cProfile imports): measured training memory of every unit with its auxiliary head.

For each unit, one training step (unit + aux head, local loss, update) is measured at each of
neuroflux.profile_batches and a line bytes = a*batch + b is fitted; a poor fit (R² below
neuroflux.min_r2) stops the stage. Writes profile/memory.json (the per-unit linear models the
partitioner uses), profile/memory.png (measured bytes per unit and batch) and metrics/profile.json.
"""
from __future__ import annotations

from pathlib import Path

from edgeflux.data import load_prepared, tensors
from edgeflux.neuroflux.model import aux_args, build_learners
from edgeflux.neuroflux.plots import plot_profile
from edgeflux.neuroflux.profile import profile_units, profiling_seconds, save_profile
from edgeflux.tracking import stage_run
from edgeflux.train import optimizer_factory, resolve_device
from stages.common import run_stage, stage_parser, write_metrics
from stages.registry import Stage

STAGE = Stage(name="profile", section="neuroflux", side="device",
              outs=("details/profile.json", "profile/memory.json", "metrics/profile.json", "profile/memory.png"))

PROFILE, PLOT = Path("profile/memory.json"), Path("profile/memory.png")


def main(args, params) -> None:
    p = params.neuroflux
    data = load_prepared(Path("data/prepared"))
    device = resolve_device(p.device)
    train = tensors(data, "target_train", limit=p.max_train_samples)
    spec = p.model.build_args(len(data.classes), train[0].shape[1], train[0].shape[-1], p.seed)
    with stage_run("profile", p.model_dump()) as run:
        model, learners = build_learners(spec, aux_args(p))
        profiles = profile_units(learners, model.describe(), len(data.classes), optimizer_factory(p),
                                 batches=p.profile_batches, device=device, data=train, context=p.bittrain.context,
                                 min_r2=p.min_r2)
        seconds = profiling_seconds(profiles)
        save_profile(PROFILE, profiles, {"model": p.model.key, "aux": p.aux, "device": str(device)})
        plot_profile(profiles, PLOT)
        metrics = {"model": p.model.key, "units": len(profiles), "profile_time_s": seconds,
                   "min_r2": min(u.r2 for u in profiles),
                   "peak_mem_bytes": max(max(u.peak_bytes) for u in profiles)}
        written = write_metrics("profile", metrics, run, names={
            "units": "units", "profile_time_s": "profile_time_s", "min_r2": "min_r2", "peak_mem_bytes": "peak_mib"})
        for path in (PROFILE, PLOT, *written):
            run.log_artifact(path)


if __name__ == "__main__":
    run_stage(main, stage_parser(__doc__))
