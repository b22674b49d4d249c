"""The tensor selector: which tensors to train so that the backward pass fits a time budget (the paper's
Section 6, Eq. 3 and 7).

Tensors are indexed in execution order, 0 nearest the input. Training the set M costs

    cost(M) = sum_{k in M} t_dw[k]  +  sum_{j > d} t_dy[j]        d = min(M), the deepest selected tensor

(every selected tensor computes its weight gradient; the error gradient passes every tensor between the
output and d, but not d itself). An empty selection costs 0. The selector maximises the summed importance of
M subject to cost(M) <= budget.

The paper's DP (Figure 6) decomposes the problem by the depth of the backward pass. Fix d: the t_dy part is
then the constant S[d] = sum_{j>d} t_dy[j], and the rest is a 0/1 knapsack over the tensors above d with
weights t_dw and capacity budget - S[d] - t_dw[d]. The knapsack table over tensors > d extends to tensors
>= d by one row, so sweeping d from the output towards the input solves every depth in one pass:
O(N * resolution) time, one table row per tensor for the traceback. (The paper's recurrence backtracks over
the nearest selected tensor k_c for each of its subproblems, O(N^2 T); it reaches the same optimum.)
Depths whose t_dy alone exceeds the budget are skipped (the paper's "redundant subproblems"), and as S[d]
only grows towards the input the sweep stops at the first such depth.

Times are scaled to `resolution` steps of the budget and rounded UP (the paper floors, Eq. 8, which can
return a selection over the budget), so the rounded cost of a returned selection never exceeds
`resolution` and its real cost never exceeds `budget`. The result is the exact optimum for the rounded costs.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["rounded_costs", "select_tensors", "selection_cost"]


def selection_cost(t_dw: Sequence[float], t_dy: Sequence[float], mask: Sequence[bool]) -> float:
    """cost(M) of the module docstring, in the units of t_dw and t_dy."""
    chosen = [k for k, m in enumerate(mask) if m]
    if not chosen:
        return 0
    return sum(t_dw[k] for k in chosen) + sum(t_dy[min(chosen) + 1:])


def rounded_costs(t_dw: Sequence[float], t_dy: Sequence[float], budget: float,
                  resolution: int) -> tuple[np.ndarray, np.ndarray]:
    """t_dw and t_dy in integer steps of budget/resolution, rounded up."""
    scale = resolution / budget
    up = np.vectorize(lambda t: math.ceil(t * scale), otypes=[np.int64])
    return up(np.asarray(t_dw, dtype=float)), up(np.asarray(t_dy, dtype=float))


def _check(t_dw, t_dy, importance, budget: float, resolution: int) -> None:
    if not (len(t_dw) == len(t_dy) == len(importance)):
        raise ValueError(f"t_dw, t_dy and importance differ in length ({len(t_dw)}, {len(t_dy)}, {len(importance)})")
    if not budget > 0 or not math.isfinite(budget):
        raise ValueError(f"budget must be a positive time, got {budget}")
    if resolution < 1:
        raise ValueError(f"resolution must be at least 1, got {resolution}")
    if any(t < 0 or not math.isfinite(t) for t in (*t_dw, *t_dy)):
        raise ValueError("t_dw and t_dy must be finite and non-negative")
    if any(not math.isfinite(i) for i in importance):
        raise ValueError("importance must be finite")


def select_tensors(t_dw: Sequence[float], t_dy: Sequence[float], importance: Sequence[float], budget: float,
                   resolution: int = 1000) -> list[bool]:
    """The selection of maximum summed importance whose cost (module docstring) fits ``budget``.

    t_dw, t_dy: per-tensor times, index 0 nearest the input; budget: the same unit. Times are scaled to
    ``resolution`` steps of the budget and rounded up, so the returned selection's cost is <= budget.
    Exact for the rounded costs. Tensors of negative importance are never worth selecting.
    """
    _check(t_dw, t_dy, importance, budget, resolution)
    n, cap = len(t_dw), resolution
    w, y = rounded_costs(t_dw, t_dy, budget, resolution)
    gain = np.asarray(importance, dtype=float)
    # best[c]: the largest importance of a subset of the tensors above the current depth with sum(w) <= c;
    # took[k][c]: whether tensor k is in that subset at capacity c (for the traceback).
    best = np.zeros(cap + 1)
    took = np.zeros((n, cap + 1), dtype=bool)
    above_dy = 0                                 # S[d]: t_dy of the tensors above depth d
    top = (0.0, None)                            # (importance, deepest tensor) of the best selection so far
    for d in range(n - 1, -1, -1):
        room = cap - above_dy - w[d]             # what the tensors above d may spend on weight gradients
        if room >= 0 and gain[d] > 0 and gain[d] + best[room] > top[0]:
            top = (gain[d] + best[room], d)
        # add tensor d to the knapsack over the tensors above the next (deeper) depth
        if gain[d] > 0 and w[d] <= cap:
            with_d = np.full(cap + 1, -np.inf)
            with_d[w[d]:] = best[:cap + 1 - w[d]] + gain[d]
            took[d] = with_d > best
            best = np.where(took[d], with_d, best)
        above_dy += y[d]
        if above_dy > cap:                       # every deeper depth's t_dy alone is over the budget
            break
    return _traceback(top[1], took, w, y, n, cap)


def _traceback(deepest: int | None, took: np.ndarray, w: np.ndarray, y: np.ndarray, n: int, cap: int) -> list[bool]:
    mask = [False] * n
    if deepest is None:
        return mask
    mask[deepest] = True
    room = int(cap - y[deepest + 1:].sum() - w[deepest])
    # the knapsack rows were added from the output end, so the last row added (deepest + 1) is read first
    for k in range(deepest + 1, n):
        if took[k][room]:
            mask[k] = True
            room -= int(w[k])
    return mask
