"""Hard classes (Algorithm 1, steps 2-3 and 5) and the entropy range of the router's threshold (Section III.C).

    hard = hard_classes(val_logits, val_labels, n_hard=5)   # classes ranked by main-block precision
    x_hard, y_hard = select_hard(x, y, hard.class_map)      # Algorithm 1, step 5
    mu_c, mu_w = entropy_range(val_logits, val_labels)      # the useful thresholds (μ_correct, μ_wrong)

The class map is the artifact a device pulls with the main block: ``class_map[c]`` is the new label of
hard class c (0..n_hard-1, in the order of the original labels, as the paper's ClassDict loop builds
it); easy classes are absent.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from .model import check_n_hard


@dataclass(frozen=True)
class HardClasses:
    """The hard classes, the label map and the statistics they were chosen from."""

    hard: list[int]                  # original labels, hardest (lowest precision) first
    class_map: dict[int, int]        # original label -> 0..n_hard-1 (ascending original label)
    precision: list[float]           # per original class, on the validation split
    recall: list[float]
    num_classes: int

    @property
    def easy(self) -> list[int]:
        return [c for c in range(self.num_classes) if c not in self.class_map]

    def lookup(self) -> Tensor:
        """A [num_classes] tensor: the new label of each class, -1 for easy classes."""
        table = torch.full((self.num_classes,), -1, dtype=torch.long)
        for c, new in self.class_map.items():
            table[c] = new
        return table

    def originals(self) -> Tensor:
        """A [n_hard] tensor: the original label of each new label."""
        return torch.tensor(sorted(self.class_map, key=self.class_map.get), dtype=torch.long)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["class_map"] = {str(k): v for k, v in self.class_map.items()}   # JSON keys are strings
        return d

    @classmethod
    def from_dict(cls, d: dict) -> HardClasses:
        return cls(hard=list(d["hard"]), class_map={int(k): int(v) for k, v in d["class_map"].items()},
                   precision=list(d["precision"]), recall=list(d["recall"]), num_classes=int(d["num_classes"]))


def per_class_precision(pred: Tensor, labels: Tensor, num_classes: int) -> tuple[list[float], list[float]]:
    """(precision, recall) of every class; a class never predicted has precision 0 (its FDR is undefined:
    it is treated as the hardest, since the main block cannot recognise it)."""
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.long)   # [true, predicted]
    confusion.index_put_((labels, pred), torch.ones_like(labels), accumulate=True)
    predicted, actual = confusion.sum(0), confusion.sum(1)
    correct = confusion.diagonal()
    precision = torch.where(predicted > 0, correct / predicted.clamp(min=1), torch.zeros(num_classes))
    recall = torch.where(actual > 0, correct / actual.clamp(min=1), torch.zeros(num_classes))
    return precision.tolist(), recall.tolist()


def hard_classes(logits: Tensor, labels: Tensor, n_hard: int | None = None,
                 choose: Sequence[int] | None = None) -> HardClasses:
    """Algorithm 1, steps 2-3: rank classes by validation precision, ascending; the first n_hard are hard.

    choose: take these classes instead (the paper's random-selection baseline, Tables IV-V); the
    statistics are still the main block's.
    """
    num_classes = logits.shape[1]
    n_hard = num_classes // 2 if n_hard is None else n_hard
    check_n_hard(n_hard, num_classes)
    precision, recall = per_class_precision(logits.argmax(1), labels, num_classes)
    if choose is None:
        hard = sorted(range(num_classes), key=lambda c: (precision[c], c))[:n_hard]   # ties: lower label first
    else:
        hard = [int(c) for c in choose]
        if len(set(hard)) != n_hard or not all(0 <= c < num_classes for c in hard):
            raise ValueError(f"choose needs {n_hard} distinct classes in 0..{num_classes - 1}, got {hard}")
    class_map = {c: i for i, c in enumerate(sorted(hard))}   # the paper's loop: for c in C, in label order
    return HardClasses(hard=hard, class_map=class_map, precision=precision, recall=recall, num_classes=num_classes)


def select_hard(x, y: Tensor, hard: HardClasses):
    """Algorithm 1, step 5: the instances of hard classes, with their new labels (x may be Images)."""
    new = hard.lookup()[y]
    index = torch.nonzero(new >= 0).flatten()
    return x[index], new[index]


def entropy(logits: Tensor) -> Tensor:
    """Entropy (nats) of softmax(logits), per row: the router's measure of instance-wise complexity."""
    logp = torch.log_softmax(logits.float(), dim=1)
    return -(logp.exp() * logp).sum(1)


def entropy_range(logits: Tensor, labels: Tensor) -> tuple[float, float]:
    """(μ_correct, μ_wrong): mean entropy of the main block's correct and wrong validation predictions."""
    h = entropy(logits)
    right = logits.argmax(1) == labels
    if right.all() or not right.any():
        raise ValueError("the entropy range needs both correct and wrong validation predictions")
    return h[right].mean().item(), h[~right].mean().item()


def detection_accuracy(logits: Tensor, labels: Tensor, hard: HardClasses) -> float:
    """How often the main block's predicted class is hard exactly when the true class is (Tables III-IV)."""
    table = hard.lookup()
    return ((table[logits.argmax(1)] >= 0) == (table[labels] >= 0)).float().mean().item()
