"""The tensor timing profiler: per trainable tensor k, t_dw[k] (computing its weight gradient) and t_dy[k]
(passing the error gradient through it towards the input), measured on this device (the paper's Section 5).

PyTorch's profiler times operators, not tensors: a convolution's backward is one operator
(``convolution_backward``) that computes the input and the weight gradient together, so its record cannot
be split. The profiler here times every node of the autograd graph during a real backward pass (a pre-hook
and a post-hook on each node, with ``perf_counter``; on CUDA each hook synchronises) and splits each node's
time by *differential* runs over the same batch, in which the same nodes execute with fewer gradients asked:

* run A: every tensor trains (the full step: its graph says which node owns which tensor);
* run B: only tensor 0 trains: every node above it computes its input gradient and nothing else;
* run C: tensor 0 and every bias train;
* run D: tensor 0 and every other (non-bias) tensor train.

The nodes of the data path (those through which tensor 0 receives its gradient) are the same in the four
runs and are matched by their creation order (the autograd sequence number). For a node that owns tensors
(a conv, linear or norm layer): B is its input-gradient time, C - B what its bias costs, D - B what its
kernel (or scale) costs. Each tensor is charged what it costs *alone*: on CPU a convolution's bias gradient
runs in the same oneDNN primitive as its kernel gradient, so either alone costs about what both cost, and
an additive model that charged the second one its increment would under-predict a selection of it alone.
Nodes that only lead to a parameter (``AccumulateGrad``, a linear weight's transpose) go
to that parameter's t_dw. Where each input-gradient time goes:

* a node's input gradient is needed iff some selected tensor lies on its input side. With reach(n), the
  largest tensor index reachable from node n through the data path, that is iff d <= reach(n), d the
  deepest selected tensor: the time goes to t_dy[reach(n) + 1]. For a layer in a chain this is the
  layer's own first tensor (a conv's dx goes to its kernel); for a layer without tensors (activation,
  pooling, a residual add) it is the nearest tensor on its output side, as the paper's Section 5.3 asks;
* a normalization's backward goes to the t_dy of its shift (the paper's Section 5.2);
* what lies above the last tensor (the loss) and the backward pass's fixed cost (the last tensor alone,
  measured, less its node times) are ``t_head``, paid whenever anything trains.

Node times include the hooks' own cost, the same for every node: measured on a node that does next to
nothing (``_hook_cost``), it is taken off every node, and what remains is scaled so that
the prediction for the full selection is at least that measured backward. The optimizer's update is measured once over all tensors
and shared out by element count (``t_opt``: an estimate per tensor, a measurement in total). ``T_forward``,
the full step's backward and ``T_full`` (forward + backward + optimizer step) are measured without hooks.
Each figure is the median of ``repeats`` rounds after ``warmup`` training steps of every tensor, hooked as run
A and untimed (a first pass pays for primitives and allocations that later ones reuse; runs B to D call a
subset of run A's kernels, so one warm-up configuration serves them all). The first warm-up step, on the model as it was, is also each
tensor's importance on this batch (``gains``): profiled on the probe, it saves the first selection the probe's
own pass. Profiling leaves the model, its BatchNorm statistics and the optimizer's state as they were.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgeflux.elastic.importance import update_gains
from edgeflux.elastic.select import selection_cost
from edgeflux.elastic.snapshot import Snapshot
from edgeflux.models.units import eval_mode
from edgeflux.step import StepContext, no_context

log = logging.getLogger(__name__)

__all__ = ["TensorTiming", "execution_order", "measure_backward", "predict_backward", "predict_step", "profile_tensors"]

NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


@dataclass
class TensorTiming:
    """Per-tensor times in seconds, index 0 nearest the input (``names``), and the measured totals."""
    names: list[str]
    t_dw: list[float]          # the tensor's weight gradient (and its accumulation)
    t_dy: list[float]          # the error gradient through the tensor towards the input (+ tensor-less layers)
    t_opt: list[float]         # the optimizer's update of the tensor (estimate: the measured step by numel)
    t_head: float              # backward above the last tensor (the loss): paid whenever anything trains
    t_forward: float           # measured
    t_backward: float          # measured, every tensor training
    t_optimizer: float         # measured, every tensor training
    t_full: float              # measured: forward + backward + optimizer step, every tensor training
    batch_size: int
    repeats: int
    hook_s: float              # the hooks' cost per node, taken off every node time
    hook_scale: float          # measured backward / the prediction for every tensor, after that
    profile_s: float           # what profiling took
    # each tensor's importance on the profiled batch (edgeflux.elastic.importance), from the warm-up step: the
    # probe's evaluation when the profiled batch is the probe (None without a warm-up or an optimizer)
    gains: list[float] | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def update_cost(self) -> list[float]:
        """What training tensor k adds besides passing the error gradient: t_dw + t_opt."""
        return [w + o for w, o in zip(self.t_dw, self.t_opt)]


def execution_order(model: nn.Module, run: Callable[[], None], names: Sequence[str] | None = None) -> list[str]:
    """Names of the model's trainable parameters (or of ``names``) in the order ``run()`` first uses their
    modules. ``run`` goes in eval mode and without gradients: BatchNorm statistics do not move."""
    wanted = set(names) if names is not None else None
    owner = {id(p): name for name, p in model.named_parameters()
             if (p.requires_grad if wanted is None else name in wanted)}
    order: list[str] = []

    def seen(module: nn.Module, _inputs) -> None:
        for p in module.parameters(recurse=False):
            if id(p) in owner and owner[id(p)] not in order:
                order.append(owner[id(p)])

    handles = [m.register_forward_pre_hook(seen) for m in model.modules() if any(True for _ in m.parameters(False))]
    try:
        with torch.no_grad(), eval_mode(model):
            run()
    finally:
        for h in handles:
            h.remove()
    return order


@dataclass
class _Graph:
    data: list        # data-path nodes (tensor 0 gets its gradient through them), by creation order
    children: dict    # data node -> its data-path children
    own: dict         # data node -> the parameters it owns (reached through param-only nodes)
    param_only: list  # (node, parameters it leads to): AccumulateGrad, a weight's transpose, any subtree that
    #                   does not reach tensor 0 (its time goes to the tensors it leads to)


def _walk(root) -> list:
    seen, stack, out = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        out.append(node)
        stack.extend(child for child, _ in node.next_functions)
    return out


def _param_of(node) -> Tensor | None:
    return getattr(node, "variable", None)


def _graph(loss: Tensor, first: Tensor) -> _Graph:
    nodes = _walk(loss.grad_fn)
    anchor = next((n for n in nodes if _param_of(n) is first), None)
    if anchor is None:
        raise RuntimeError("the first trainable tensor receives no gradient from the loss")
    # children are created before their consumers, so increasing sequence numbers visit children first
    # (AccumulateGrad leaves carry the largest number and have no children: they go first)
    reaches = {}
    for node in sorted(nodes, key=lambda n: -1 if _param_of(n) is not None else n._sequence_nr()):
        reaches[node] = node is anchor or any(reaches[c] for c, _ in node.next_functions if c is not None)
    data = sorted((n for n in nodes if reaches[n] and n is not anchor), key=lambda n: n._sequence_nr())
    children, own, param_only, attributed = {}, {}, [], set(data)
    for node in data:
        kids = [c for c, _ in node.next_functions if c is not None]
        children[node] = [c for c in kids if reaches[c] and c is not anchor]
        own[node] = []
        for kid in kids:
            if kid is anchor or not reaches[kid]:
                sub = [n for n in _walk(kid) if n not in attributed]
                params = [_param_of(n) for n in sub if _param_of(n) is not None]
                own[node] += params
                param_only += [(n, params) for n in sub]
                attributed.update(sub)
    return _Graph(data, children, own, param_only)


def _timed_backward(loss: Tensor, nodes: Sequence, sync: Callable[[], None]) -> dict:
    """Backward of ``loss`` with each of ``nodes`` timed (seconds, by node)."""
    start, took, handles = {}, {}, []
    for node in nodes:
        def pre(*_a, node=node):
            sync()
            start[node] = time.perf_counter()

        def post(*_a, node=node):
            sync()
            took[node] = took.get(node, 0.0) + time.perf_counter() - start[node]
        handles += [node.register_prehook(pre), node.register_hook(post)]
    try:
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    return took


def _sync_for(x: Tensor) -> Callable[[], None]:
    return torch.cuda.synchronize if x.is_cuda else (lambda: None)


def _hooked_run(model, x, y, params, keep: set[int], context, loss_fn, sync) -> tuple[_Graph, list, list]:
    """One backward pass with only `keep` training, every node timed: the graph, the time of each data node
    (by creation order) and of each param-only node (in traversal order). Each run builds its own graph, so
    runs are matched by position."""
    for p in params:
        p.requires_grad_(id(p) in keep)
    with context(model):
        loss = loss_fn(model(x), y)
        graph = _graph(loss, params[0])
        took = _timed_backward(loss, graph.data + [n for n, _ in graph.param_only], sync)
    model.zero_grad(set_to_none=True)
    return graph, [took.get(n, 0.0) for n in graph.data], [took.get(n, 0.0) for n, _ in graph.param_only]


def _full_step(model, x, y, params, optimizer, context, loss_fn, sync) -> tuple[float, float, float]:
    """(forward, backward, optimizer step) seconds of one full training step, unhooked."""
    for p in params:
        p.requires_grad_(True)
    sync()
    t0 = time.perf_counter()
    with context(model):
        loss = loss_fn(model(x), y)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
    t2 = time.perf_counter()
    if optimizer is not None:
        optimizer.step()
        sync()
    t3 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1, t3 - t2


def _warm_step(model, x, y, params, optimizer, context, loss_fn) -> list[float] | None:
    """A training step of every tensor, its nodes hooked as run A's, its times dropped: the first use of this
    batch's shapes and of the hooks pays what later ones do not (oneDNN's primitives, allocations). Its update,
    on the model as it was, gives each tensor's importance."""
    for p in params:
        p.requires_grad_(True)
    with context(model):
        loss = loss_fn(model(x), y)
        graph = _graph(loss, params[0])
        _timed_backward(loss, graph.data + [n for n, _ in graph.param_only], lambda: None)
    gains = update_gains(optimizer, params) if optimizer is not None else None
    model.zero_grad(set_to_none=True)
    return gains


def _hook_cost(sync: Callable[[], None], device: torch.device, nodes: int = 100, repeats: int = 3) -> float:
    """What the timing hooks add to each node's time, seconds: the median hooked time of a node that does next
    to nothing (the backward of a scalar multiplication, in a chain of ``nodes``, ``repeats`` times). Its own
    work is well under a microsecond, so this bounds the hooks' share from above; a cheap chain measures it
    apart from the model's own noise, which a difference of two of the model's backward passes would carry."""
    leaf = torch.zeros((), device=device, requires_grad=True)
    took = []
    for _ in range(repeats):
        chain = [leaf * 1.0]
        for _ in range(nodes - 1):
            chain.append(chain[-1] * 1.0)
        took += _timed_backward(chain[-1], [c.grad_fn for c in chain], sync).values()
    return statistics.median(took)


def _medians(rows: list[list[float]]) -> list[float]:
    if len({len(r) for r in rows}) > 1:
        raise RuntimeError("the backward graph changed between identical runs; cannot time its nodes")
    return [statistics.median(column) for column in zip(*rows)]


def profile_tensors(model: nn.Module, x: Tensor, y: Tensor, *, optimizer: torch.optim.Optimizer | None = None,
                    context: StepContext = no_context, loss_fn=F.cross_entropy, repeats: int = 3,
                    warmup: int = 1, names: Sequence[str] | None = None) -> TensorTiming:
    """Time every trainable tensor of ``model`` (or the tensors ``names``, whatever they require now) on the
    batch (x, y), in train mode (module docstring).

    optimizer: the one training uses (its update is timed; its state is restored); context: the step
    context training uses (e.g. BitTrain), entered around forward and backward as the step does. The runs
    A to D, an unhooked full step and an unhooked backward of the last tensor alone are interleaved, so
    that a drift of the machine's speed touches all.
    """
    started = time.perf_counter()
    by_name = dict(model.named_parameters())
    with Snapshot(model, optimizer):
        names = execution_order(model, lambda: model(x), names)
        if not names:
            raise ValueError("the model has no trainable tensor to profile")
        params = [by_name[n] for n in names]
        sync = _sync_for(x)
        first, biases = id(params[0]), {id(p) for n, p in zip(names, params) if n.endswith("bias")}
        weights = {id(p) for p in params} - biases
        configs = ({id(p) for p in params}, {first}, {first} | biases, {first} | weights)   # runs A, B, C, D
        last = [k == len(params) - 1 for k in range(len(params))]
        warm = [_warm_step(model, x, y, params, optimizer, context, loss_fn) for _ in range(warmup)]
        runs = [[_hooked_run(model, x, y, params, keep, context, loss_fn, sync) for keep in configs]
                + [_full_step(model, x, y, params, optimizer, context, loss_fn, sync),
                   measure_backward(model, names, last, x, y, context=context, loss_fn=loss_fn, repeats=1, warmup=0)]
                for _ in range(repeats)]
    graphs = [g for g, _, _ in runs[-1][:4]]
    for other in graphs[1:]:
        _check_same(graphs[0], other)
    forward, backward, opt = (statistics.median(r[4][i] for r in runs) for i in range(3))
    data = [_medians([r[c][1] for r in runs]) for c in range(4)]
    extra = _medians([r[0][2] for r in runs])
    per_node = _hook_cost(sync, x.device)
    data = [[max(0.0, t - per_node) for t in times] for times in data]
    extra = [max(0.0, t - per_node) for t in extra]
    t_dw, t_dy, head = _attribute(model, graphs[0], params, biases, data, extra)
    # a backward pass has a fixed cost besides its nodes (the engine's start): the last tensor alone, measured
    # unhooked, shows it; it is paid whenever anything trains
    head += max(0.0, statistics.median(r[5] for r in runs) - head - t_dw[-1])
    # tensors of one node are charged what each costs alone, so the full selection may be over-predicted (a
    # convolution's bias and kernel gradients share work): the model is scaled up to the measured full
    # backward, never down
    predicted = head + sum(t_dw) + sum(t_dy[1:])
    scale = max(1.0, backward / predicted) if predicted > 0 else 1.0
    numel = sum(p.numel() for p in params)
    timing = TensorTiming(names, [t * scale for t in t_dw], [t * scale for t in t_dy],
                          [opt * p.numel() / numel for p in params], head * scale, forward, backward, opt,
                          forward + backward + opt, len(x), repeats, per_node, scale, time.perf_counter() - started,
                          warm[0] if warm else None)
    log.info("profiled %d tensors at batch %d in %.2fs: forward %.1f ms, backward %.1f ms, optimizer %.1f ms "
             "(hooks %.1f us a node)", len(names), len(x), timing.profile_s, forward * 1e3, backward * 1e3, opt * 1e3,
             per_node * 1e6)
    return timing


def _check_same(a: _Graph, b: _Graph) -> None:
    names_a, names_b = [n.name() for n in a.data], [n.name() for n in b.data]
    if names_a != names_b:
        at = next((i for i, (p, q) in enumerate(zip(names_a, names_b)) if p != q), min(len(names_a), len(names_b)))
        raise RuntimeError(f"the backward graph changes with the trainable set (node {at}: "
                           f"{names_a[at:at + 1]} vs {names_b[at:at + 1]}); cannot split its times by tensor")


def _attribute(model: nn.Module, graph: _Graph, params: list[Tensor], biases: set[int],
               ranked: tuple[list[float], ...], param_only: list[float]) -> tuple[list[float], list[float], float]:
    """Node times (runs B, C, D by data node; param-only nodes from A) -> t_dw, t_dy, t_head (module docstring).
    The node that owns tensor 0 never computes an input gradient: B is tensor 0's own time there, and its other
    tensors are charged on top of it."""
    n = len(params)
    index = {id(p): k for k, p in enumerate(params)}
    norm_params = {id(p) for m in model.modules() if isinstance(m, NORMS) for p in m.parameters(recurse=False)}
    t_dw, t_dy, head = [0.0] * n, [0.0] * n, 0.0
    reach: dict = {}
    for rank, node in enumerate(graph.data):
        b, c, d = (times[rank] for times in ranked[1:])
        own = [index[id(p)] for p in graph.own[node] if id(p) in index]
        reach[node] = max((max([reach[k], *(index[id(p)] for p in graph.own[k] if id(p) in index)])
                           for k in graph.children[node]), default=-1)
        in_b = [k for k in own if k == 0]
        in_c = [k for k in own if k != 0 and id(params[k]) in biases]
        in_d = [k for k in own if k != 0 and id(params[k]) not in biases]
        dx = b if graph.children[node] else 0.0
        for group, t in ((in_b, b - dx), (in_c, c - b), (in_d, d - b)):
            for k in group:
                t_dw[k] += max(0.0, t) / len(group)
        shift = [k for k in own if id(params[k]) in norm_params and id(params[k]) in biases]
        pos = shift[-1] if shift else reach[node] + 1
        if pos >= n:
            head += dx
        else:
            t_dy[pos] += dx
    for (_node, ps), took in zip(graph.param_only, param_only):
        ks = [index[id(p)] for p in ps if id(p) in index]
        for k in ks:
            t_dw[k] += took / len(ks)
    return t_dw, t_dy, head


def predict_backward(timing: TensorTiming, mask: Sequence[bool]) -> float:
    """The time model's backward time (seconds) of training the tensors in ``mask``."""
    if not any(mask):
        return 0.0
    return timing.t_head + selection_cost(timing.t_dw, timing.t_dy, mask)


def predict_step(timing: TensorTiming, mask: Sequence[bool]) -> float:
    """The time model's training step (seconds: forward, backward, optimizer updates) for ``mask``."""
    if not any(mask):
        return timing.t_forward
    return timing.t_forward + timing.t_head + selection_cost(timing.update_cost(), timing.t_dy, mask)


def measure_backward(model: nn.Module, names: Sequence[str], mask: Sequence[bool], x: Tensor, y: Tensor, *,
                     context: StepContext = no_context, loss_fn=F.cross_entropy, repeats: int = 3,
                     warmup: int = 1) -> float:
    """The measured backward time (median, seconds) of training only the tensors in ``mask``; the model is
    left as it was."""
    by_name = dict(model.named_parameters())
    params = [by_name[n] for n in names]
    sync, took = _sync_for(x), []
    with Snapshot(model, None) as flags:
        flags.train_only(params, {id(p) for p, m in zip(params, mask) if m})
        for _ in range(warmup + repeats):
            with context(model):
                loss = loss_fn(model(x), y)
                sync()
                start = time.perf_counter()
                if loss.requires_grad:
                    loss.backward()
                sync()
            took.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    return statistics.median(took[warmup:])
