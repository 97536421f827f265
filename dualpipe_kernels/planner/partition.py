"""Exact partition of a layer sequence into contiguous model stages, balanced per rank.

The objective is the slowest *rank*, not the slowest stage: a rank's load is
the sum, over the IR stages it holds, of (share of the micro-batches that pass
through that stage) x (the stage's layer costs).  The schedule's placement
(``schedules.schedule_layout``) decides which loads add up:

* one model stage per rank (1f1b, zb1p, gpipe): the classic linear partition,
  solved exactly by bisection over the greedy's segment sums (with jumps);
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

Bounded work.  The linear search is O(layers) per probe and always exact.  The
nested, two-per-rank and Pareto searches grow as ``pairs x layers^2``,
``ranks x layers^3`` and exponentially: each runs exactly only while its
estimated work stays under :data:`EXACT_WORK_LIMIT` (about 0.3 s and well under
1 GB).  Beyond it the same exact search runs on the layers merged into
cost-balanced blocks (as many as the limit allows), the result is improved
layer by layer (a cut moves one layer while that lowers the slowest rank, or
leaves it and sheds one rank off it), and :attr:`Partition.lower_bound`
states how far from the optimum it can be: ``max_load <= optimum x
(max_load / lower_bound)``, the bound being the per-rank mean, the
heaviest layer's rank share and (nested) the two end layers' pair.  :attr:`Partition.exact` says which happened.

Every model stage gets at least one layer.  Embedding and head imbalance need
no special case: the optimum simply gives a heavy first or last layer a stage
of its own (or pairs it with a light one, for the V).
"""

from __future__ import annotations

import math
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
    rank's load, or slowest stage for ``per_stage``).  ``exact``: whether
    ``max_load`` is the proven optimum; when not, ``lower_bound`` is a
    proven lower bound of the optimum (else it equals ``max_load``).
    """

    sizes: tuple[int, ...]
    max_load: float
    placement: Placement
    exact: bool = True
    lower_bound: float = 0.0

    @property
    def gap(self) -> float:
        """Relative bound on the distance from the optimum: ``max_load / lower_bound - 1`` (0 when exact)."""
        if self.exact or self.max_load <= self.lower_bound:
            return 0.0
        return self.max_load / self.lower_bound - 1 if self.lower_bound > 0 else float("inf")

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
    """Cut ``costs`` (one per layer, >= 0) into ``placement.num_stages`` contiguous stages.

    Optimal while the search fits :data:`EXACT_WORK_LIMIT`; otherwise within the
    stated ``lower_bound`` of the optimum (module docstring).
    """
    m, n = placement.num_stages, len(costs)
    if n < m:
        raise ValueError(f"{n} layers cannot fill {m} model stages (each needs at least one layer)")
    c = [float(x) for x in costs]
    if not all(math.isfinite(x) and x >= 0 for x in c) or not math.isfinite(math.fsum(c)):
        raise ValueError("layer costs must be finite numbers >= 0 whose sum is finite")
    exact = True
    if placement.kind == "linear" or placement.kind == "per_stage":
        sizes = _linear(c, m)
    elif _exact_work(placement, n) <= EXACT_WORK_LIMIT:
        sizes = _exact(c, placement)
    else:
        sizes, exact = _bounded(c, placement), False
    loads = rank_loads(sizes, c, placement)
    if placement.kind == "per_stage":
        loads = rank_loads(sizes, c, Placement(m, tuple((k,) for k in range(m)), (1.0,) * m, "linear"))
    best = max(loads)
    if exact:
        return Partition(tuple(sizes), best, placement, True, best)
    return Partition(tuple(sizes), best, placement, False, min(best, _lower_bound(c, placement)))


#: Largest estimated work (array cells touched per probe) for an exact nested / round-robin search.
EXACT_WORK_LIMIT = 300_000


def _exact_work(placement: Placement, n: int) -> float:
    """Cells per feasibility probe of the exact search for ``n`` layers (Pareto: a rough count)."""
    m, groups = placement.num_stages, len(placement.groups)
    if placement.kind == "nested":
        return (m // 2) * float(n + 1) ** 2
    if m == 2 * groups:  # round robin, two stages per rank
        w = n - 2 * groups + 1
        return groups * float(w) ** 3
    # Pareto fronts: up to (stages x layers^2) pairs of partial cuts, each front growing with the ranks
    return m * float(n) ** 2 * groups**2


def _exact(c: list[float], placement: Placement) -> list[int]:
    m, ranks = placement.num_stages, len(placement.groups)
    if placement.kind == "nested":
        return _nested(c, m)
    if m == 2 * ranks:
        return _robin_two(c, ranks)
    return _robin_pareto(c, ranks, m)


def _lower_bound(c: list[float], placement: Placement) -> float:
    """A proven lower bound of the slowest rank: the mean per rank, the heaviest layer (and, nested, the two
    end layers together).

    Every model stage sits in exactly one group (nested and round-robin placements), so the group loads
    sum to ``sum_m weight_m x stage_m >= min weight x total``.
    """
    w = min(placement.weights)
    bound = max(w * math.fsum(c) / len(placement.groups), w * max(c))
    if placement.kind == "nested":  # the first and the last layer always share the outer pair
        bound = max(bound, w * (c[0] + c[-1]))
    return bound


def _blocks(c: list[float], k: int) -> list[int]:
    """Sizes of ``k`` contiguous blocks of about equal cost (each >= 1 layer)."""
    n = len(c)
    prefix = np.concatenate([[0.0], np.cumsum(c)])
    total = float(prefix[-1])
    ends = np.searchsorted(prefix, total * np.arange(1, k) / k, side="left").tolist() if total > 0 else []
    if len(ends) != k - 1:
        ends = [round(n * j / k) for j in range(1, k)]
    cut = [0, *ends, n]
    for j in range(1, k):  # strictly increasing, leaving a layer for every later block
        cut[j] = min(max(cut[j], cut[j - 1] + 1), n - (k - j))
    return [cut[j + 1] - cut[j] for j in range(k)]


def _bounded(c: list[float], placement: Placement) -> list[int]:
    """The exact search on cost-balanced blocks of layers, then refined one layer at a time."""
    n, m = len(c), placement.num_stages
    k = n
    while k > m and _exact_work(placement, k) > EXACT_WORK_LIMIT:
        k = max(m, int(k * 0.9))
    if _exact_work(placement, k) <= EXACT_WORK_LIMIT:
        block = _blocks(c, k)
        bc, start = [], 0
        for size in block:
            bc.append(math.fsum(c[start : start + size]))
            start += size
        block_sizes = _exact(bc, placement)
        sizes, b = [], 0
        for count in block_sizes:
            sizes.append(sum(block[b : b + count]))
            b += count
    else:  # even one block per stage is too much work: the per-stage optimum, refined
        sizes = _linear(c, m)
    return _refine(c, sizes, placement)


def _refine(c: list[float], sizes: list[int], placement: Placement) -> list[int]:
    """Move single layers across cuts while that lowers (slowest load, ranks at it); bounded passes."""
    m = len(sizes)
    group_of = [0] * m
    for g, members in enumerate(placement.groups):
        for s in members:
            group_of[s] = g
    w = placement.weights
    cuts = [0, *np.cumsum(sizes).tolist()]
    prefix = np.concatenate([[0.0], np.cumsum(c)]).tolist()
    loads = [0.0] * len(placement.groups)
    for s in range(m):
        loads[group_of[s]] += w[s] * (prefix[cuts[s + 1]] - prefix[cuts[s]])

    def key(ld: list[float]) -> tuple[float, int]:
        top = max(ld)
        return top, sum(1 for x in ld if x >= top * (1 - 1e-12))

    current = key(loads)
    for _ in range(4 * len(c) + 100):  # each accepted move lowers the key; the cap bounds the work
        improved = False
        for t in range(1, m):  # cut t separates stages t-1 and t
            for step in (-1, 1):
                x = cuts[t] + step
                if not cuts[t - 1] < x < cuts[t + 1]:
                    continue
                layer = c[x] if step > 0 else c[cuts[t] - 1]
                moved = layer if step > 0 else -layer  # cost that enters stage t-1 (leaves stage t)
                trial = list(loads)
                trial[group_of[t - 1]] += w[t - 1] * moved
                trial[group_of[t]] -= w[t] * moved
                k = key(trial)
                if k < current:
                    cuts[t], loads, current, improved = x, trial, k, True
        if not improved:
            break
    return [cuts[s + 1] - cuts[s] for s in range(m)]


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


def _greedy_probe(c: list[float], limit: float) -> tuple[int, float, float]:
    """Greedy at ``limit``: (segments, largest segment sum, least sum that made a cut: the next limit to try).

    Every limit below the third value gives the same segments (no comparison turns), so when there are too
    many segments the optimum is at least that value.
    """
    acc, count, segments, most, nxt = 0.0, 0, 1, 0.0, math.inf
    for x in c:
        if x > limit:
            return len(c) + 1, math.inf, x
        if count and acc + x > limit:
            nxt = min(nxt, acc + x)
            most = max(most, acc)
            acc, count, segments = 0.0, 0, segments + 1
        acc += x
        count += 1
    return segments, max(most, acc), nxt


def _linear(c: list[float], m: int) -> list[int]:
    """Exact: the least limit at which the greedy needs <= m segments, by bisection with jumps (O(n) per probe).

    The optimum is a segment sum; an infeasible probe lifts the lower end to the next sum the greedy would
    compare, a feasible one lowers the upper end to the largest segment it made.
    """
    lo, hi = max(c), _greedy_probe(c, math.inf)[1]
    for step in range(400):  # bisection halves the gap; a third of the probes try the lower end itself
        if lo >= hi * (1 - _REL_TOL):
            break
        mid = lo if step % 3 == 2 else (lo + hi) / 2
        count, most, nxt = _greedy_probe(c, mid)
        if count <= m:
            hi = min(hi, most)
        else:
            lo = max(lo, nxt)
    if lo <= hi and _greedy_probe(c, lo)[0] <= m:
        hi = lo
    seg = _greedy_segments(c, hi)
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
