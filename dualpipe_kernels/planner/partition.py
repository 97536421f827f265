"""Exact partition of a layer sequence into contiguous model stages, balanced per rank.

The objective is the slowest *rank*, not the slowest stage: a rank's load is
the sum, over the IR stages it holds, of (share of the micro-batches that pass
through that stage) x (the stage's layer costs).  The schedule's placement
(``schedules.schedule_layout``) decides which loads add up:

* one model stage per rank (1f1b, zb1p, gpipe): the classic linear partition,
  solved exactly by bisection over the sorted segment sums with a greedy check;
* nested pairs, model stages ``k`` and ``M-1-k`` on the same ranks
  (DualPipeV's V: rank r holds stages r and 2R-1-r; DualPipe's two copies:
  ranks r and R-1-r both hold model stages r and R-1-r, each for half the
  micro-batches): a threshold dynamic programme over (left cut, right cut)
  states, bisected to the optimum (exact up to floating-point rounding of the
  threshold: relative 1e-12; exact for integer costs);
* round robin, model stage ``s`` on rank ``s mod R`` (interleaved1f1b's
  virtual stages, every stage carrying every micro-batch): with two stages per
  rank, a threshold dynamic programme over (cut in the first half, cut in the
  second half) states for every position of the middle cut, bisected to the
  optimum (exact like the nested one); with more stages per rank, a search over
  cuts keeping per (stage, cut) only the Pareto-minimal per-rank load vectors
  (exact; its cost grows with the number of ranks, fine for the small problems
  such placements come with);
* anything else: the slowest model stage is minimised (exact for that
  objective, not for the per-rank sum).

Every model stage gets at least one layer.  Embedding and head imbalance need
no special case: the optimum simply gives a heavy first or last layer a stage
of its own (or pairs it with a light one, for the V).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..schedules import schedule_layout

if TYPE_CHECKING:  # torch is imported only by stage_modules, so planning from a cost file stays light
    from torch import nn

__all__ = ["Placement", "Partition", "placement_of", "partition_layers", "rank_loads", "stage_modules"]

_REL_TOL = 1e-12


@dataclass(frozen=True)
class Placement:
    """Which model stages share a rank, and the share of micro-batches each one carries there.

    ``groups[g]`` lists the model stages whose loads add up on one rank;
    ``weights[m]`` is model stage ``m``'s share of micro-batches on that rank.
    ``kind`` is ``"linear"``, ``"nested"``, ``"round_robin"`` or ``"per_stage"`` (see module docstring).
    """

    num_stages: int
    groups: tuple[tuple[int, ...], ...]
    weights: tuple[float, ...]
    kind: str


@dataclass(frozen=True)
class Partition:
    """``sizes[m]``: number of layers of model stage ``m`` (what ``Pipeline.from_sequential(partition=)`` takes).

    ``max_load``: the objective at the optimum, in the costs' unit (slowest
    rank's load, or slowest stage for ``per_stage``).
    """

    sizes: tuple[int, ...]
    max_load: float
    placement: Placement

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """``[start, end)`` layer indices per model stage."""
        out, start = [], 0
        for n in self.sizes:
            out.append((start, start + n))
            start += n
        return out


def placement_of(schedule: str, ranks: int, stages_per_rank: int | None = None) -> Placement:
    """The placement of ``schedule`` on ``ranks`` ranks, read from its layout (public schedules API)."""
    # The placement does not depend on the micro-batch count; use the smallest valid even one.
    mb = 2 * ranks * (stages_per_rank or 1) * 2
    layout = schedule_layout(schedule, ranks, mb, stages_per_rank)
    model_stage = layout.model_stage or tuple(range(len(layout.stage_to_rank)))
    num_model = max(model_stage) + 1
    share = [0.0] * len(layout.stage_to_rank)
    for path_index in layout.microbatch_path:
        for s in layout.paths[path_index]:
            share[s] += 1.0 / mb
    held: dict[int, dict[int, float]] = {}
    for s, r in enumerate(layout.stage_to_rank):
        held.setdefault(r, {})[model_stage[s]] = share[s]
    groups = sorted({tuple(sorted(h)) for h in held.values()})
    weights = [0.0] * num_model
    for h in held.values():
        for m, w in h.items():
            weights[m] = w
    return Placement(num_model, tuple(groups), tuple(weights), _kind(groups, weights, num_model))


def _kind(groups: list[tuple[int, ...]], weights: list[float], num_model: int) -> str:
    if all(len(g) == 1 for g in groups) and len(groups) == num_model:
        return "linear"
    nested = num_model % 2 == 0 and sorted(groups) == [(k, num_model - 1 - k) for k in range(num_model // 2)]
    even = max(weights) - min(weights) <= 1e-12
    if nested and even:
        return "nested"
    ranks = len(groups)
    robin = num_model % ranks == 0 and sorted(groups) == [tuple(range(r, num_model, ranks)) for r in range(ranks)]
    if robin and even:
        return "round_robin"
    return "per_stage"


def rank_loads(sizes: Sequence[int], costs: Sequence[float], placement: Placement) -> list[float]:
    """Load of each placement group for a given partition (layer counts per model stage)."""
    stage, start = [], 0
    for n in sizes:
        stage.append(float(sum(costs[start : start + n])))
        start += n
    return [sum(placement.weights[m] * stage[m] for m in g) for g in placement.groups]


def partition_layers(costs: Sequence[float], placement: Placement) -> Partition:
    """Cut ``costs`` (one per layer, >= 0) into ``placement.num_stages`` contiguous stages, optimally."""
    m, n = placement.num_stages, len(costs)
    if n < m:
        raise ValueError(f"{n} layers cannot fill {m} model stages (each needs at least one layer)")
    c = [float(x) for x in costs]
    if placement.kind == "nested":
        sizes = _nested(c, m)
    elif placement.kind == "round_robin" and m == 2 * len(placement.groups):
        sizes = _robin_two(c, len(placement.groups))
    elif placement.kind == "round_robin":
        sizes = _robin_pareto(c, len(placement.groups), m)
    else:
        sizes = _linear(c, m)
    loads = rank_loads(sizes, c, placement)
    if placement.kind == "per_stage":
        loads = rank_loads(sizes, c, Placement(m, tuple((k,) for k in range(m)), (1.0,) * m, "linear"))
    return Partition(tuple(sizes), max(loads), placement)


# ---- linear: bisection over segment sums, greedy check -----------------------
def _greedy_segments(c: list[float], limit: float) -> list[int] | None:
    """Fewest contiguous segments with sums <= limit (None if a layer exceeds it)."""
    sizes, acc, count = [], 0.0, 0
    for x in c:
        if x > limit:
            return None
        if count and acc + x > limit:
            sizes.append(count)
            acc, count = 0.0, 0
        acc += x
        count += 1
    sizes.append(count)
    return sizes


def _split_to(sizes: list[int], m: int) -> list[int]:
    """Split segments (largest first) until there are ``m``: costs are >= 0, so no sum grows."""
    sizes = list(sizes)
    while len(sizes) < m:
        k = max(range(len(sizes)), key=lambda i: sizes[i])
        sizes[k : k + 1] = [sizes[k] - 1, 1]
    return sizes


def _linear(c: list[float], m: int) -> list[int]:
    prefix = np.concatenate([[0.0], np.cumsum(c)])
    # The optimum is one of the segment sums; bisect over them (sorted, unique).
    sums = np.unique((prefix[None, :] - prefix[:, None])[np.triu_indices(len(c) + 1, 1)])
    lo_i = bisect.bisect_left(sums.tolist(), max(c))
    hi_i = len(sums) - 1
    while lo_i < hi_i:
        mid = (lo_i + hi_i) // 2
        seg = _greedy_segments(c, float(sums[mid]))
        if seg is not None and len(seg) <= m:
            hi_i = mid
        else:
            lo_i = mid + 1
    seg = _greedy_segments(c, float(sums[hi_i]))
    assert seg is not None and len(seg) <= m
    return _split_to(seg, m)


# ---- nested pairs: threshold DP over (left cut, right cut) --------------------
def _nested_feasible(prefix: np.ndarray, pairs: int, limit: float) -> list[int] | None:
    """Cut positions ``x_0..x_M`` with every pair load ``<= limit``, or None.

    State after ``k`` outer pairs: ``(i, j) = (x_k, x_{M-k})``.  A step to
    ``(i', j')`` loads ``P[i'] - P[i] + P[j] - P[j']``; feasibility of a target
    is a 2-D running minimum of ``P[j] - P[i]`` over reachable states with
    ``i < i'`` and ``j > j'``.  The last pair is the two middle segments, one
    contiguous block ``[x_{m-1}, x_{m+1})`` of at least two layers.
    """
    n = len(prefix) - 1
    big = np.inf
    idx = np.arange(n + 1)
    span = prefix[None, :] - prefix[:, None]  # span[i, j] = P[j] - P[i]
    reach = np.zeros((n + 1, n + 1), dtype=bool)
    reach[0, n] = True
    levels = [reach]
    tol = limit * _REL_TOL * 1e-3  # rounding slack, well below the bisection's stopping width
    for k in range(1, pairs):
        val = np.where(reach, span, big)
        best = np.minimum.accumulate(val, axis=0)
        best = np.minimum.accumulate(best[:, ::-1], axis=1)[:, ::-1]
        # shifted[i', j'] = best[i' - 1, j' + 1]
        shifted = np.full((n + 1, n + 1), big)
        shifted[1:, :-1] = best[:-1, 1:]
        need = 2 * (pairs - k)  # layers the inner pairs still need
        reach = (shifted - span <= limit + tol) & (idx[None, :] - idx[:, None] >= need)
        if not reach.any():
            return None
        levels.append(reach)
    last = reach & (span <= limit + tol) & (idx[None, :] - idx[:, None] >= 2)
    if not last.any():
        return None
    i, j = map(int, np.argwhere(last)[0])
    left, right = [i], [j]
    for k in range(pairs - 1, 0, -1):
        prev = levels[k - 1]
        ok = prev.copy()
        ok[i:, :] = False
        ok[:, : j + 1] = False
        loads = (prefix[i] - prefix[:, None]) + (prefix[None, :] - prefix[j])
        ok &= loads <= limit + tol
        i, j = map(int, np.argwhere(ok)[0])
        left.append(i)
        right.append(j)
    # The middle cut: any split of the last block works (both halves non-empty).
    mid = left[0] + 1
    cuts = list(reversed(left)) + [mid] + right
    return cuts


def _nested(c: list[float], m: int) -> list[int]:
    prefix = np.concatenate([[0.0], np.cumsum(c)])
    pairs = m // 2

    def achieved(cuts: list[int]) -> float:
        seg = [prefix[cuts[t + 1]] - prefix[cuts[t]] for t in range(m)]
        return max(seg[k] + seg[m - 1 - k] for k in range(pairs))

    best = _nested_feasible(prefix, pairs, float(prefix[-1]))
    assert best is not None  # the whole sum is always feasible when len(c) >= m
    # Some pair carries at least the average load: just below it is infeasible (or the optimum is 0).
    hi, lo = achieved(best), float(prefix[-1]) / pairs * (1 - 1e-9)
    for _ in range(200):  # bisection halves the gap; 200 steps exhaust float precision
        if hi - lo <= _REL_TOL * hi:
            break
        mid = (lo + hi) / 2
        cuts = _nested_feasible(prefix, pairs, mid)
        if cuts is None:
            lo = mid
        else:
            best, hi = cuts, achieved(cuts)
    return [best[t + 1] - best[t] for t in range(m)]


# ---- round robin, two stages per rank: threshold DP over (first-half cut, second-half cut) ----
def _robin_two_feasible(prefix: np.ndarray, ranks: int, limit: float) -> tuple[list[int] | None, float]:
    """``(cuts x_0..x_2R, inf)`` with every rank's load ``<= limit``, or ``(None, next)``.

    Rank ``k`` holds stages ``k`` and ``R + k``: the first half of the stages
    cuts ``[0, x)`` and the second half ``[x, n)``, walked in lockstep.  State
    after ``k`` ranks: ``(x, i, j) = (x_R, x_k, x_{R+k})``, from ``(x, 0, x)``
    to ``(x, x, n)``; a step to ``(i', j')`` loads ``P[i'] - P[i] + P[j'] -
    P[j]``, so a target is reachable when the running maximum of ``P[i] +
    P[j]`` over reachable states with ``i < i'`` and ``j < j'`` is at least
    ``P[i'] + P[j'] - limit``.  Arrays hold every ``x`` at once, in offsets
    ``(q, u, v) = (x - R, i - k, j - x - k)``: each stage takes at least one
    layer, so ``0 <= u <= q``, ``0 <= v <= W - 1 - q`` (``W = n - 2R + 1``), and
    ``i < i'`` becomes ``u <= u'``.  When infeasible, ``next`` is the least
    limit at which any comparison made here would turn: every limit below it is
    infeasible too (the reachable sets stay the same), so the search can jump.
    """
    n = len(prefix) - 1
    w = n - 2 * ranks + 1
    q = np.arange(w)
    valid = (q[None, :] <= q[:, None])[:, :, None] & (q[None, :] <= w - 1 - q[:, None])[:, None, :]
    second = q[:, None] + q[None, :] + ranks  # x + v without k, clipped where invalid
    tol = limit * _REL_TOL * 1e-3

    def pair(k: int) -> np.ndarray:  # P[i] + P[j] at level k, shape (w, w, w)
        return prefix[q + k][None, :, None] + prefix[np.minimum(second + k, n)][:, None, :]

    def running_best(reach: np.ndarray, k: int) -> np.ndarray:
        best = np.where(reach, pair(k), -np.inf)
        return np.maximum.accumulate(np.maximum.accumulate(best, axis=1), axis=2)

    reach = np.zeros((w, w, w), dtype=bool)
    reach[:, 0, 0] = True
    levels, nxt = [reach], np.inf
    for k in range(1, ranks):
        need = np.where(valid, pair(k) - running_best(reach, k - 1), np.inf)
        reach = need <= limit + tol
        missed = need[~reach]
        nxt = min(nxt, float(missed.min())) if missed.size else nxt
        if not reach.any():
            return None, nxt
        levels.append(reach)
    xs = q + ranks
    need_end = prefix[xs] + prefix[n] - running_best(reach, ranks - 1)[q, q, w - 1 - q]
    end = need_end <= limit + tol
    if not end.any():
        return None, min(nxt, float(need_end.min()))
    t = int(np.argmax(end))
    x = t + ranks
    i, j = x, n
    first, last = [x], [n]
    for k in range(ranks - 1, 0, -1):
        ii = (q + k)[:, None]
        jj = (x + q + k)[None, :]
        ok = levels[k][t] & (ii < i) & (jj < j)
        ok &= prefix[i] + prefix[j] - (prefix[ii] + prefix[np.minimum(jj, n)]) <= limit + tol
        u, v = map(int, np.argwhere(ok)[0])
        i, j = u + k, x + v + k
        first.append(i)
        last.append(j)
    return [0, *reversed(first), *reversed(last)], np.inf


def _robin_two(c: list[float], ranks: int) -> list[int]:
    prefix = np.concatenate([[0.0], np.cumsum(c)])
    m = 2 * ranks

    def achieved(cuts: list[int]) -> float:
        seg = [prefix[cuts[t + 1]] - prefix[cuts[t]] for t in range(m)]
        return max(seg[k] + seg[ranks + k] for k in range(ranks))

    # Lower bound: the mean rank load and the heaviest layer; on even costs it is often the optimum.
    lo = max(float(prefix[-1]) / ranks, max(c))
    best, lo = _robin_two_feasible(prefix, ranks, lo)
    if best is not None:
        return [best[t + 1] - best[t] for t in range(m)]
    # A first solution: the best cut of the stages alone (cheap), counted per rank.
    linear = _linear(c, m)
    best = [0, *np.cumsum(linear).tolist()]
    hi = achieved(best)
    # Invariant: every limit below ``lo`` is infeasible, ``hi`` is achieved.  Probing ``lo`` itself ends
    # the search when it is feasible (often, after a jump); bisection keeps the probes logarithmic.
    for step in range(200):
        if lo >= hi * (1 - _REL_TOL):
            break
        mid = lo if step % 3 == 2 else (lo + hi) / 2
        cuts, nxt = _robin_two_feasible(prefix, ranks, mid)
        if cuts is None:
            lo = max(lo, nxt)
        else:
            best, hi = cuts, min(hi, achieved(cuts))
    return [best[t + 1] - best[t] for t in range(m)]


# ---- round robin, any number of stages per rank: Pareto-pruned search over cuts -------
def _pareto(entries: list[tuple[tuple[float, ...], object]]) -> list[tuple[tuple[float, ...], object]]:
    """The entries whose load vectors no other entry's is componentwise <= (one of equal vectors kept)."""
    entries = sorted(entries, key=lambda e: (sum(e[0]), e[0]))
    kept: list[tuple[tuple[float, ...], object]] = []
    for vec, parent in entries:
        if not any(all(a <= b for a, b in zip(k, vec, strict=True)) for k, _ in kept):
            kept.append((vec, parent))
    return kept


def _robin_pareto(c: list[float], ranks: int, m: int) -> list[int]:
    """Exact: the best cut among those whose every rank load is ``<= limit``, for growing limits from the
    lower bound up to a known solution's load (the first limit that admits a cut gives the optimum)."""
    robin = Placement(m, tuple(tuple(range(r, m, ranks)) for r in range(ranks)), (1.0,) * m, "round_robin")
    linear = _linear(c, m)
    bound = max(rank_loads(linear, c, robin))
    limit = max(sum(c) / ranks, max(c))
    while True:
        limit = min(limit, bound) * (1 + _REL_TOL)
        cuts = _robin_pareto_within(c, ranks, m, limit)
        if cuts is not None:
            return cuts
        limit *= 1.05  # tight limits prune most partial cuts, so start low and grow


def _robin_pareto_within(c: list[float], ranks: int, m: int, limit: float) -> list[int] | None:
    """The best cut with every rank load ``<= limit`` (None if there is none).

    A partial cut is dropped when its slowest rank exceeds ``limit``, or when
    another one ending at the same layer and stage has per-rank loads at most
    its own everywhere (any completion of it is then no better): exact.
    """
    n = len(c)
    prefix = [0.0]
    for x in c:
        prefix.append(prefix[-1] + x)
    # front[i]: (loads per rank, (previous cut, previous loads)) for partial cuts ending at layer i.
    front: dict[int, list[tuple[tuple[float, ...], object]]] = {0: [((0.0,) * ranks, None)]}
    history = [front]
    for s in range(m):
        r = s % ranks
        nxt: dict[int, list[tuple[tuple[float, ...], object]]] = {}
        for i, entries in front.items():
            for e in range(i + 1, n - (m - s - 1) + 1):
                seg = prefix[e] - prefix[i]
                for vec, _ in entries:
                    load = vec[r] + seg
                    if load <= limit:
                        nxt.setdefault(e, []).append((vec[:r] + (load,) + vec[r + 1 :], (i, vec)))
        front = {e: _pareto(v) for e, v in nxt.items()}
        history.append(front)
    if n not in front:
        return None
    vec, parent = min(front[n], key=lambda e: max(e[0]))
    cuts = [n]
    for s in range(m, 0, -1):
        assert isinstance(parent, tuple)
        i, prev = parent
        cuts.append(i)
        parent = next(p for v, p in history[s - 1][i] if v == prev)
    cuts.reverse()
    return [cuts[t + 1] - cuts[t] for t in range(m)]


# ---- from a partition to modules ------------------------------------------------
def stage_modules(layers: Sequence[nn.Module] | nn.Sequential, sizes: Sequence[int]) -> list[nn.Sequential]:
    """One ``nn.Sequential`` per model stage, sharing the given layer modules (no copies)."""
    from torch import nn

    layers = list(layers)
    if any(n < 1 for n in sizes) or sum(sizes) != len(layers):
        raise ValueError(f"partition {list(sizes)} must give >= 1 layer per stage and sum to {len(layers)} layers")
    out, start = [], 0
    for n in sizes:
        out.append(nn.Sequential(*layers[start : start + n]))
        start += n
    return out
