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
from .partition_search import linear_sizes, nested_sizes, robin_pareto_sizes, robin_two_sizes

if TYPE_CHECKING:  # torch is imported only by stage_modules, so planning from a cost file stays light
    from torch import nn

__all__ = ["Placement", "Partition", "placement_of", "partition_layers", "rank_loads", "stage_modules"]


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
        sizes = linear_sizes(c, m)
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
        return nested_sizes(c, m)
    if m == 2 * ranks:
        return robin_two_sizes(c, ranks)
    return robin_pareto_sizes(c, ranks, m)


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
        sizes = linear_sizes(c, m)
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
