"""Training MEANet: the main block at the cloud, the adaptive and extension blocks on the edge (Algorithm 1).

    main, k = main_block(model, spec)              # model A: the cloud trains it (train_main_block)
    hard = hard_classes(main_logits(net, x_val), y_val, n_hard)
    run = train_edge(net, hard, train, val, test, opts, device)    # the main block fixed, hard classes only
    joint = joint_step_memory(net, hard, batch, train, opts, device)  # Fig. 6's comparison, same batch

Every run goes through the one training loop (``edgeflux.backprop.train_under_budget``): the batch is
the largest whose measured step fits the budget, BitTrain applies to what the step saves, and an
interrupted run resumes from its checkpoint.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgeflux.backprop import BudgetedRun, train_under_budget
from edgeflux.memory import StepMemory, measure_training_step
from edgeflux.models import UnitModel, eval_mode
from edgeflux.step import TrainStep
from edgeflux.train import TrainOptions, TrainRun, optimizer_factory

from .hard import HardClasses, select_hard
from .model import MEANet, TwoExits, exits_loss, fix_main


@torch.no_grad()
def main_logits(net: MEANet, x, batch_size: int = 512, device: torch.device | str = "cpu") -> Tensor:
    """ŷ1 for every instance of x (Tensor or Images), in eval mode, on the CPU."""
    out = []
    with eval_mode(net):
        for i in range(0, len(x), batch_size):
            out.append(net.main_exit(x[i:i + batch_size].to(device))[0].cpu())
    return torch.cat(out)


def train_main_block(model: UnitModel, main: UnitModel, k: int, train, val, test, opts: TrainOptions,
                     device: torch.device, checkpoint: Path | None = None, signature: str = "") -> BudgetedRun:
    """Model A at the cloud: the CNN and the main block's new exit trained jointly on every class (the sum of both
    exits' losses), so the main block learns from the whole dataset and the CNN's tail, which becomes the
    extension block and the cloud's half in features mode, still fits the main block's features. signature: the
    weights it starts from and the split (fit's), so that a checkpoint of another start is not resumed."""
    return train_under_budget(TwoExits(model, main, k), train, val, test, opts,
                              TrainRun(device, checkpoint=checkpoint, signature=signature, desc="meanet main block (A)",
                                       loss_fn=exits_loss))


def train_edge(net: MEANet, hard: HardClasses, train, val, test, opts, device: torch.device,
               checkpoint: Path | None = None, signature: str = "", track_test: bool = False) -> BudgetedRun:
    """Algorithm 1, steps 5-8: hard-class instances with their new labels; the main block fixed (no gradients,
    eval mode); the adaptive and extension blocks trained with cross-entropy at the extension exit, under
    opts.budget with opts.bittrain. val and test are reduced to the hard classes the same way."""
    fix_main(net)
    train_h, val_h, test_h = (select_hard(*split, hard) for split in (train, val, test))
    return train_under_budget(net, train_h, val_h, test_h, opts,
                              TrainRun(device, checkpoint=checkpoint, signature=signature, desc="meanet edge",
                                       context=opts.bittrain.context, track_test=track_test), memory=opts)


class JointMEANet(nn.Module):
    """Every block trained at once from the losses at both exits (joint optimisation, BranchyNet's)."""

    def __init__(self, net: MEANet) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y1, features = self.net.main_exit(x)
        return y1, self.net.extension_exit(x, features)


def joint_loss(hard: HardClasses):
    """Cross-entropy at the main exit (all classes) plus at the extension exit (the instances of hard classes)."""
    table = hard.lookup()

    def loss(outputs: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
        y1, y2 = outputs
        new = table.to(y.device)[y]
        mask = new >= 0
        return F.cross_entropy(y1, y) + (F.cross_entropy(y2[mask], new[mask]) if mask.any() else y2.sum() * 0)

    return loss


def joint_step_memory(net: MEANet, hard: HardClasses, batch: int, train, opts, device: torch.device) -> StepMemory:
    """The measured training step of joint optimisation at `batch`, on all-class instances, with every block
    trainable and in train mode: what the edge's fixed main block is compared with (Fig. 6)."""
    joint = copy.deepcopy(net)
    joint.requires_grad_(True)
    for m in joint.modules():
        m.__dict__.pop("edgeflux_keep_eval", None)
    make_step = TrainStep.factory(optimizer_factory(opts), loss_fn=joint_loss(hard), context=opts.bittrain.context)
    return _measure(JointMEANet(joint), make_step, train, batch, device)


def edge_step_memory(net: MEANet, hard: HardClasses, batch: int, train, opts, device: torch.device) -> StepMemory:
    """The measured training step of the edge's method at `batch` (the main block fixed), on hard instances."""
    make_step = TrainStep.factory(optimizer_factory(opts), context=opts.bittrain.context)
    return _measure(fix_main(net), make_step, select_hard(*train, hard), batch, device)


def _measure(model: nn.Module, make_step, data, batch: int, device: torch.device) -> StepMemory:
    """measure_training_step on the first batch, after a warm-up step on the second (the first again if short)."""
    x, y = data
    first = (x[:batch].clone(), y[:batch].clone())
    second = (x[batch:2 * batch].clone(), y[batch:2 * batch].clone()) if len(x) >= 2 * batch else first
    return measure_training_step(model, make_step, second, first, device)
