"""Plans kept for the next run: a candidate's row is measured once per model, data shape, options and machine.

A plan costs seconds (every candidate's batch search and timed steps), which on a short run is a large part of
its time, and it measures nothing that a new seed, a new learning rate or new data of the same shape change:
the batch a budget fits is the model's and the shapes', the samples/s the machine's. So ``method: auto`` reuses
the rows a plan measured under the same key (plan_key) and measures only the candidates missing; ``edgeflux
plan`` always measures afresh and stores what it measured, which is how a user re-times a plan (a machine
under other load, a new torch). The run still confirms the plan's batch in its own measured steps
(TrainRun.batch_hint), so a stored row can cost speed, never the budget.

    cache = PlanCache(plan_key(model, train, opts, device))
    rows = plan_training(model, train, opts, cache=cache)

Files: .edgeflux/plans/<key digest>.json (the project's untracked state, as its checkpoints), one per key,
holding the key and a row per candidate; written atomically; one that cannot be read is measured again and
rewritten, with a warning.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import fields
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from edgeflux.artifacts import atomic_write
from edgeflux.checkpoint import run_signature
from edgeflux.machine import speed_identity

from .core import PlanRow

log = logging.getLogger(__name__)

PLANS = Path(".edgeflux/plans")
FORMAT = 3   # the rows' meaning (3: timed in rounds, the slow out after the first): another format is measured again
# options that change neither a step's memory nor its speed: runs that differ only in these share a plan
# (the data's size neither: a stored row's epoch time is scaled to the data's; incoming samples grow it)
UNTIMED = {"seed", "epochs", "evals_per_epoch", "lr", "lr_scaling", "lr_reference_batch", "method", "methods",
           "max_train_samples"}


def plan_key(model: nn.Module, train: tuple, opts, device: str | torch.device) -> dict:
    """What a plan's rows depend on: the model's layers (not its weights), a training sample's shape (not the
    data's values or size), the options that shape a step (UNTIMED aside) and the machine that timed it."""
    x = train[0]
    return {"format": FORMAT, "model": hashlib.sha256(repr(model).encode()).hexdigest()[:16],
            "input": [type(x).__name__, str(x.dtype), *x.shape[1:]],
            "options": opts.model_dump(mode="json", exclude=UNTIMED), **speed_identity(device)}


class PlanCache:
    """The stored rows of one plan_key; ``fresh``: ignore them (measure every candidate) but store anew."""

    def __init__(self, key: dict, root: Path = PLANS, fresh: bool = False) -> None:
        self.key, self.path = key, Path(root) / f"{run_signature(**key)}.json"
        self.rows: dict[str, PlanRow] = {} if fresh else self._load()
        self.reused: set[str] = set()   # the specs get() answered from the file

    def get(self, spec: str) -> PlanRow | None:
        row = self.rows.get(spec)
        if row is not None:
            self.reused.add(spec)
        return row

    def put(self, row: PlanRow) -> None:
        self.rows[row.method] = row
        record = {"key": self.key, "measured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "rows": [r.to_dict() for r in self.rows.values()]}
        atomic_write(self.path, lambda tmp: tmp.write_text(json.dumps(record, indent=1) + "\n"))

    def _load(self) -> dict[str, PlanRow]:
        if not self.path.exists():
            return {}
        names = {f.name for f in fields(PlanRow)}
        try:
            record = json.loads(self.path.read_text())
            if record["key"] != self.key:
                raise ValueError("it holds another key")
            rows = [PlanRow(**r) for r in record["rows"] if set(r) == names]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("%s: a stored plan that cannot be read (%s): measuring it again", self.path, exc)
            return {}
        log.info("reusing the plan measured %s (%s; `edgeflux plan` measures again)", record.get("measured"),
                 self.path)
        return {r.method: r for r in rows}

