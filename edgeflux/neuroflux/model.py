"""The NeuroFlux model: a zoo model's units with their auxiliary heads, built and saved the same way
by every stage (profile, train_blocks and select_exit must agree on every weight's origin)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from edgeflux.artifacts import load_checked, model_fix, save_checked
from edgeflux.models import UnitModel, build_model

from .aux import LocalLearner, local_learners


def aux_args(p: Any) -> dict:
    """local_learners keyword arguments from params.yaml's neuroflux section (any object with its fields:
    the library does not depend on the params schema)."""
    return dict(mode=p.aux, classic_filters=p.classic_filters, pool=p.aux_pool, seed=p.seed)


def build_learners(spec: dict, aux: dict) -> tuple[UnitModel, list[LocalLearner]]:
    """The model (untrained, seeded) and one LocalLearner per unit sharing its modules."""
    model = build_model(**spec)
    return model, local_learners(model, **aux)


def save_learners(path: str | Path, learners: list[LocalLearner], spec: dict, aux: dict, meta: dict | None = None) -> None:
    save_checked(path, {"spec": spec, "aux": aux, "learners": [learner.state_dict() for learner in learners],
                        "meta": meta or {}})


def load_learners(path: str | Path) -> tuple[UnitModel, list[LocalLearner], dict]:
    """Rebuild what save_learners wrote: (model, learners, meta)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no trained NeuroFlux model; run `dvc repro train_blocks` first")
    state = load_checked(path, model_fix(path, "train_blocks"), weights_only=True)
    model, learners = build_learners(state["spec"], state["aux"])
    for learner, sd in zip(learners, state["learners"], strict=True):
        learner.load_state_dict(sd)
    return model, learners, state["meta"]
