"""Bytes saved for backward: counted in saved-tensor hooks, deduplicated by storage, attributed to units.

Parameters and buffers are excluded (their memory exists anyway); a saved tensor belongs to the innermost
unit whose forward is running when autograd saves it, or to OUTSIDE_UNITS (e.g. the loss).
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from .tracker import storage_of as _storage

OUTSIDE_UNITS = "(outside units)"   # saved bytes of ops that run in no unit (e.g. the loss)

UnitsArg = nn.Module | Sequence[tuple[str, nn.Module]] | None


def resolve_units(units: UnitsArg) -> tuple[list[tuple[str, nn.Module]], list[nn.Module]]:
    """(name, module) pairs to attribute to, and the modules whose parameters/buffers they cover.

    units: None (no attribution); a UnitModel (its unit_names/units); any other nn.Module (its
    named children, or the module itself when it has none); or (name, module) pairs.
    """
    if units is None:
        return [], []
    if isinstance(units, nn.Module):
        if hasattr(units, "units") and hasattr(units, "unit_names"):
            return list(zip(units.unit_names, units.units)), [units]
        children = list(units.named_children())
        return (children or [(type(units).__name__, units)]), [units]
    pairs = list(units)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], nn.Module)):
            raise TypeError(f"units must be a module or (name, module) pairs, got an element {pair!r}")
    return pairs, [m for _, m in pairs]


def _reports_running_unit(model: nn.Module, units: Sequence[tuple[str, nn.Module]]) -> bool:
    """model is a UnitModel and `units` are exactly its units (same names, same modules, same order)."""
    names, modules = getattr(model, "unit_names", None), getattr(model, "units", None)
    return (hasattr(type(model), "running_unit") and names is not None and modules is not None
            and [n for n, _ in units] == list(names) and all(m is u for (_, m), u in zip(units, modules)))


class UnitTracker:
    """Which unit's forward is running, for saved-tensor attribution.

        with UnitTracker([("conv1", m1), ("conv2", m2)]) as where:
            ...                       # inside a saved_tensors_hooks pack hook: where.current

    A saved tensor belongs to the innermost unit whose forward is running when autograd saves
    it, or to OUTSIDE_UNITS (e.g. the loss). One tracker for SavedTensorCounter and BitTrain's
    accounting, so both attribute the same tensor to the same unit.
    """

    def __init__(self, units: Sequence[tuple[str, nn.Module]], model: nn.Module | None = None) -> None:
        """model: a UnitModel whose units these are; its forward reports the running unit itself
        (UnitModel.running_unit), so no module hooks are needed (they cost every unit call)."""
        self.units = list(units)
        self.model = model if model is not None and _reports_running_unit(model, self.units) else None
        self._stack: list[str] = []
        self._handles: list[Any] = []

    @property
    def current(self) -> str:
        """The innermost running unit, or OUTSIDE_UNITS."""
        if self.model is not None:
            name = self.model.running_unit
            return name if name is not None else OUTSIDE_UNITS
        return self._stack[-1] if self._stack else OUTSIDE_UNITS

    def _enter(self, name: str, _module: nn.Module, _inputs: Any) -> None:
        self._stack.append(name)

    def _exit(self, _module: nn.Module, _inputs: Any, _output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def __enter__(self) -> UnitTracker:
        if self.model is not None:
            return self
        for name, module in self.units:
            self._handles.append(module.register_forward_pre_hook(partial(self._enter, name)))
            # always_call: a forward that raises still pops its name
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()


class SavedTensorModifiedError(RuntimeError):
    """A tensor saved for backward was modified in place before backward used it."""


def check_saved_version(t: Tensor, saved_version: int) -> Tensor:
    """Autograd's own in-place check, which custom saved-tensor hooks otherwise switch off."""
    if t._version != saved_version:
        raise SavedTensorModifiedError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{t.dtype}{list(t.shape)}] is at version {t._version}; expected version {saved_version} "
            f"(checked by edgeflux, whose saved-tensor hooks replace autograd's own check). "
            f"Avoid modifying tensors in place between forward and backward, e.g. use an out-of-place op")
    return t


class SavedTensorCounter:
    """Bytes saved for backward, deduplicated by storage, persistent tensors excluded, per unit."""

    def __init__(self, units: Sequence[tuple[str, nn.Module]], exclude: Iterable[Tensor]) -> None:
        self.total_bytes = 0
        self.by_unit: dict[str, int] = {name: 0 for name, _ in units} | {OUTSIDE_UNITS: 0}
        self.where = UnitTracker(units)
        # Pin the excluded storages so their ids stay unique (they are alive anyway).
        self._excluded = {id(st): st for st in map(_storage, exclude) if st is not None}
        self._seen: dict[int, weakref.ref] = {}

    def pack(self, t: Tensor) -> tuple[Tensor, int]:
        # detach: returning t itself would make an op's saved output hold its own grad_fn (a
        # reference cycle that outlives the step); the version restores autograd's in-place check.
        packed = (t if isinstance(t, nn.Parameter) else t.detach(), t._version)
        st = _storage(t)
        if isinstance(t, nn.Parameter) or st is None or id(st) in self._excluded or id(st) in self._seen:
            return packed
        key = id(st)
        self._seen[key] = weakref.ref(st, lambda _r, k=key: self._seen.pop(k, None))
        self.total_bytes += st.nbytes()
        unit = self.where.current
        self.by_unit[unit] = self.by_unit.get(unit, 0) + st.nbytes()
        return packed

    @staticmethod
    def unpack(packed: tuple[Tensor, int]) -> Tensor:
        return check_saved_version(*packed)


@contextmanager
def count_saved_tensors(units: Sequence[tuple[str, nn.Module]] | None = None,
                        params: Iterable[Tensor] = ()) -> Iterator[SavedTensorCounter]:
    """Count the bytes autograd saves for backward inside the block.

    units: (name, module) pairs; a saved tensor is attributed to the innermost unit whose
    forward is running, or to OUTSIDE_UNITS (e.g. the loss), so by_unit sums to total_bytes.
    params: tensors whose storage is not counted when saved (parameters, buffers);
    nn.Parameter instances are always excluded. Saved tensors are restored unchanged, so
    training is unaffected. An inner saved_tensors_hooks (e.g. BitTrain's) takes precedence,
    and then this counter sees nothing.
    """
    counter = SavedTensorCounter(list(units or []), params)
    with counter.where, torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        yield counter


def saved_bytes_by_node(output: Tensor, exclude: Iterable[Tensor] = ()) -> dict[str, int]:
    """Bytes autograd holds for the backward of ``output``, per graph node type (``ConvolutionBackward0``, ...).

    Read from the graph itself (every node's ``_saved_*`` tensors, each storage counted once, for the
    first node that holds it in a walk from ``output``; the storages of ``exclude`` (parameters,
    buffers) and nn.Parameter never counted), so it answers what count_saved_tensors cannot: which
    operations the saved bytes belong to (e.g. the input copies an in-place ReLU6 saves). Its total
    equals count_saved_tensors' for the same forward. Call it before backward, on a graph built
    without saved-tensor hooks (reading a saved tensor runs a hook's unpack: BitTrain would restore).
    """
    # (a saved tensor's storage object is made anew on each read: storages are told apart by address)
    excluded = {st.data_ptr() for st in map(_storage, exclude) if st is not None and st.nbytes()}
    seen: set[int] = set()
    by_node: dict[str, int] = {}
    todo, visited = [output.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            value = getattr(node, name)
            for t in value if isinstance(value, (tuple, list)) else (value,):
                st = _storage(t) if isinstance(t, Tensor) and not isinstance(t, nn.Parameter) else None
                if st is None or not st.nbytes() or st.data_ptr() in excluded or st.data_ptr() in seen:
                    continue
                seen.add(st.data_ptr())
                kind = type(node).__name__
                by_node[kind] = by_node.get(kind, 0) + st.nbytes()
        todo += [fn for fn, _ in node.next_functions]
    return dict(sorted(by_node.items(), key=lambda kv: -kv[1]))

