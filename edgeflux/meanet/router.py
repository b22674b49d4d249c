"""Inference in the edge-cloud system (Algorithm 2), per instance, with a cloud that may fail.

    router = Router(net, hard, threshold=0.6, cloud=CloudClient(url))
    routed = router.route(x_test)          # predictions and, per instance, the exit that answered
    routed.fractions()                     # {'main': .., 'extension': .., 'cloud': .., 'fallback': ..}

For each instance the main block predicts first. If the cloud is enabled and the entropy of that
prediction exceeds the threshold, the instance (or its features F) goes to the cloud. Otherwise, if
the predicted class is hard, the adaptive and extension blocks run and the more confident of the two
exits answers (confidence: the top softmax probability); otherwise the main block answers.

The cloud is any callable from a batch (images or F) to logits that raises ``CloudUnavailable`` when it
cannot answer. Instances it could not answer are answered by the edge as if the cloud were disabled and
counted as ``fallback``: no instance is ever dropped, and a dead cloud never stops inference.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from edgeflux.models import eval_mode

from .cloud import CloudUnavailable
from .hard import HardClasses, entropy
from .model import MEANet

log = logging.getLogger(__name__)

EXITS = ("main", "extension", "cloud", "fallback")
SEND = ("images", "features")


@dataclass
class Routed:
    """What the router answered: predictions (original labels), the exit per instance (an index into EXITS),
    the main block's entropy per instance, and the seconds spent on the edge and waiting for the cloud."""

    pred: Tensor
    exit: Tensor
    entropy: Tensor
    edge_s: float = 0.0
    cloud_s: float = 0.0        # waiting for the cloud: answered requests and failed ones
    cloud_errors: list[str] = field(default_factory=list)
    extension_runs: int = 0     # instances the adaptive and extension blocks ran for (whichever exit answered)
    answered_s: float = 0.0     # waiting for the requests the cloud answered: the round trips

    def counts(self) -> dict[str, int]:
        return {name: int((self.exit == i).sum()) for i, name in enumerate(EXITS)}

    def fractions(self) -> dict[str, float]:
        n = max(1, len(self.exit))
        return {name: count / n for name, count in self.counts().items()}

    def accuracy(self, labels: Tensor) -> float:
        return (self.pred == labels).float().mean().item() if len(labels) else 0.0

    @staticmethod
    def join(parts: list[Routed]) -> Routed:
        if not parts:
            empty = torch.empty(0, dtype=torch.long)
            return Routed(empty, empty, torch.empty(0))
        return Routed(torch.cat([p.pred for p in parts]), torch.cat([p.exit for p in parts]),
                      torch.cat([p.entropy for p in parts]), sum(p.edge_s for p in parts),
                      sum(p.cloud_s for p in parts), [e for p in parts for e in p.cloud_errors],
                      sum(p.extension_runs for p in parts), sum(p.answered_s for p in parts))


def confidence(logits: Tensor) -> Tensor:
    """The top softmax probability per row (the paper's Confidence)."""
    return torch.softmax(logits.float(), dim=1).max(1).values


class Router:
    """Algorithm 2 over a MEANet, its hard classes, an entropy threshold and an optional cloud callable."""

    def __init__(self, net: MEANet, hard: HardClasses, threshold: float | None = None,
                 cloud: Callable[[Tensor], Tensor] | None = None, send: str = "images", cloud_batch: int = 64) -> None:
        if send not in SEND:
            raise ValueError(f"send must be one of {SEND}, got {send!r}")
        if cloud is not None and threshold is None:
            raise ValueError("a cloud needs an entropy threshold (see entropy_range for the useful range)")
        self.net, self.hard, self.threshold, self.cloud = net, hard, threshold, cloud
        self.send, self.cloud_batch = send, cloud_batch
        self.table, self.originals = hard.lookup(), hard.originals()

    @torch.no_grad()
    def __call__(self, x: Tensor) -> Routed:
        """Route one batch (on the network's device); the answers come back on the CPU."""
        start = time.perf_counter()
        device = next(self.net.parameters()).device
        x = x.to(device)
        with eval_mode(self.net):
            y1, features = self.net.main_exit(x)
            h = entropy(y1)
            pred, exit_ = y1.argmax(1), torch.zeros(len(x), dtype=torch.long, device=device)
            sent = h > self.threshold if self.cloud is not None else torch.zeros_like(pred, dtype=torch.bool)
            waited, answered_s, errors, answered = self._ask_cloud(x if self.send == "images" else features, sent,
                                                                   pred, y1.shape[1])
            exit_[answered] = EXITS.index("cloud")
            runs = self._extension(x, features, y1, ~answered, pred, exit_)
            exit_[sent & ~answered] = EXITS.index("fallback")
        edge_s = time.perf_counter() - start - waited
        return Routed(pred.cpu(), exit_.cpu(), h.cpu(), edge_s, waited, errors, runs, answered_s)

    def _ask_cloud(self, inputs: Tensor, sent: Tensor, pred: Tensor,
                   classes: int) -> tuple[float, float, list[str], Tensor]:
        """Send the chosen instances in chunks; write the cloud's answers into pred. Returns (seconds waited,
        seconds of the answered requests, the errors of chunks that failed, which instances the cloud answered).
        An answer that is not one row of `classes` logits per instance counts as a failure."""
        answered = torch.zeros_like(sent)
        if self.cloud is None or not sent.any():
            return 0.0, 0.0, [], answered
        errors, answered_s, start = [], 0.0, time.perf_counter()
        for chunk in torch.nonzero(sent).flatten().split(self.cloud_batch):
            asked = time.perf_counter()
            try:
                logits = self.cloud(inputs[chunk])
                if tuple(logits.shape) != (len(chunk), classes):
                    raise CloudUnavailable(f"the cloud answered {tuple(logits.shape)} for {len(chunk)} instances "
                                           f"of {classes} classes (a model for other classes?)")
            except CloudUnavailable as exc:
                errors.append(str(exc))
                continue
            answered_s += time.perf_counter() - asked
            pred[chunk] = logits.argmax(1).to(pred.device, pred.dtype)
            answered[chunk] = True
        return time.perf_counter() - start, answered_s, errors, answered

    def _extension(self, x: Tensor, features: Tensor, y1: Tensor, edge: Tensor, pred: Tensor, exit_: Tensor) -> int:
        """For edge instances predicted as hard: the extension exit answers unless the main exit is more
        confident (Algorithm 2: ŷ1 only if Confidence(ŷ1) > Confidence(ŷ2)). Returns how many it ran for."""
        hard = edge & (self.table.to(x.device)[y1.argmax(1)] >= 0)
        if not hard.any():
            return 0
        index = torch.nonzero(hard).flatten()
        y2 = self.net.extension_exit(x[index], features[index])
        better = confidence(y2) >= confidence(y1[index])
        pred[index[better]] = self.originals.to(x.device)[y2[better].argmax(1)]
        exit_[index[better]] = EXITS.index("extension")
        return len(index)

    def route(self, x, batch_size: int = 256) -> Routed:
        """Route a whole split (Tensor or Images) in batches."""
        parts = [self(x[i:i + batch_size]) for i in range(0, len(x), batch_size)]
        routed = Routed.join(parts)
        if routed.cloud_errors:
            log.warning("cloud unavailable for %d chunk(s), answered on the edge (fallback): %s",
                        len(routed.cloud_errors), routed.cloud_errors[0])
        return routed
