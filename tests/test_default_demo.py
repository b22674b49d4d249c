"""The committed default run (`make run`: params.yaml as committed) shows what each technique is for: under
the default budget NeuroFlux splits the model into blocks, backprop's batch is squeezed below its limit, and
the fine-tuning methods differ in memory. Read from the committed outputs (metrics/), which are the default
params' (dvc.lock): a budget change that makes every method fit with room fails here."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from edgeflux.options import parse_bytes

ROOT = Path(__file__).resolve().parents[1]


def _metrics(name: str) -> dict:
    return json.loads((ROOT / "metrics" / f"{name}.json").read_text())


def test_the_default_budget_makes_the_techniques_differ():
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    budget_mib = round(parse_bytes(params["device"]["budget"]) / 2**20, 1)
    partition, train_bp = _metrics("partition"), _metrics("train_bp")
    ft_all, mobiletl = _metrics("finetune/ft_all"), _metrics("finetune/mobiletl")
    # the outputs are the committed params' run
    assert partition["budget_mib"] == train_bp["budget_mib"] == ft_all["budget_mib"] == budget_mib
    assert partition["blocks"] >= 2                                          # NeuroFlux: blocks, each its batch
    assert partition["min_block_batch"] < partition["max_block_batch"]
    assert train_bp["batch"] < min(params["device"]["max_batch"], 128)      # backprop: squeezed
    # fine-tuning: FT-All's batch squeezed to a few samples, MobileTL's (less memory per sample) at its limit
    assert 4 * ft_all["batch"] <= mobiletl["batch"] and ft_all["peak_mib"] > mobiletl["peak_mib"]
    for m in (train_bp, ft_all, mobiletl, _metrics("meanet_edge")):
        assert m["peak_mib"] <= budget_mib                                   # the promise
