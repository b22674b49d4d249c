"""Stage prepare: dataset -> 32x32 uint8 tensors + deterministic split manifest (data/prepared/)."""
from __future__ import annotations

from pathlib import Path

from edgeflux.data import load_raw, prepare, save_prepared
from edgeflux.tracking import stage_run
from stages.common import peak_rss_bytes, run_stage, stage_parser
from stages.registry import Stage

STAGE = Stage(name="prepare", section="data", side="cloud",
              outs=("data/prepared",))

OUT = Path("data/prepared")


def main(args, params) -> None:
    p = params.data
    with stage_run("prepare", p.model_dump()) as run:
        raw = load_raw(p.dataset, root=p.root, download=p.download, image_size=p.image_size, channels=p.channels,
                       test_fraction=p.test_fraction)
        data = prepare(raw, image_size=p.image_size, channels=p.channels, val_fraction=p.val_fraction, seed=p.seed,
                       split_by=p.split_by, source_fraction=p.source_fraction, source_classes=p.source_classes,
                       normalize=p.normalize)
        save_prepared(data, OUT)
        run.log_metrics({f"n_{name}": len(idx) for name, idx in data.splits.items()})
        run.log_metrics({"peak_rss_bytes": peak_rss_bytes()})
        run.log_artifact(OUT / "manifest.json")


if __name__ == "__main__":
    run_stage(main, stage_parser(__doc__))
