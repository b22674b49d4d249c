"""A row of the report: one trained method's figures, built by the stage that trained it (its module's
``summary_rows``, see stages/registry.py) from the headline and details files the stages wrote.

Kept apart from the report's rendering (edgeflux.summary): a stage's code depends on this small module,
so that a change to the report's table or plots does not rerun the training stages.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# the labels of rows that several stages write (the curve file's method column, the report's row)
NEUROFLUX_FULL, MEANET_EDGE, BITTRAIN = "NeuroFlux, full model", "MEANet, edge only", " + BitTrain"


def with_bittrain(label: str, on: bool) -> str:
    """``label`` + " + BitTrain" when the stage ran with it and the label does not already say so."""
    return label + BITTRAIN if on and BITTRAIN not in label else label


@dataclass
class MethodRow:
    method: str
    stage: str                      # where its figures come from
    starts_from: str                # scratch | a pretrained model
    model: str
    budget_mib: float | None
    batch: str
    peak_mib: float | None
    trainable_params: int | None
    params: int | None
    train_s: float | None           # wall clock
    cpu_s: float | None             # the process's CPU time
    test_acc: float
    to_target_cpu_s: float | None = None   # CPU time until validation accuracy first reached the report's target
    pareto: bool = False            # no other row is at least as accurate with a smaller or equal peak
    curve: str | None = None        # the accuracy-vs-time CSV its time to target is read from
    plotted: bool = False           # its curve is drawn on the accuracy-vs-time plot


@dataclass(frozen=True)
class RowInputs:
    """What a stage's summary_rows() reads: every stage's headline and details (keyed by stage name,
    "finetune/<method>" per fine-tuning run), the "+ BitTrain" suffix of each params section whose stage ran
    with it, and the fine-tuned model's key."""

    head: Mapping[str, Mapping]
    detail: Mapping[str, Mapping]
    bittrain: Mapping[str, bool]
    finetune_model: str | None = None

    def plus(self, section: str) -> str:
        return BITTRAIN if self.bittrain.get(section) else ""


def training_row(method: str, stage: str, starts_from: str, model: str, head: Mapping, **override) -> MethodRow:
    """A row from a training stage's headline; `override` replaces what the headline does not say."""
    row = MethodRow(method=method, stage=stage, starts_from=starts_from, model=model,
                    budget_mib=head.get("budget_mib"), batch=str(head.get("batch", "-")), peak_mib=head.get("peak_mib"),
                    trainable_params=head.get("trainable_params"), params=head.get("params"),
                    train_s=head.get("train_time_s"), cpu_s=head.get("train_cpu_s"), test_acc=head.get("test_acc", 0.0))
    for key, value in override.items():
        setattr(row, key, value)
    return row
