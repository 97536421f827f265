"""Partitioner: the exact optimum (brute force over every cut), placement-aware, on random and adversarial costs."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from dualpipe_kernels.planner.partition import partition_layers, placement_of, rank_loads, stage_modules


def _brute(costs, placement):
    """Smallest slowest-rank load (slowest stage for per_stage placements) over every contiguous cut."""
    n, m = len(costs), placement.num_stages
    best = None
    for cuts in itertools.combinations(range(1, n), m - 1):
        bounds = list(zip((0, *cuts), (*cuts, n), strict=True))
        sizes = [b - a for a, b in bounds]
        if placement.kind == "per_stage":
            load = max(sum(costs[a:b]) for a, b in bounds)
        else:
            load = max(rank_loads(sizes, costs, placement))
        best = load if best is None else min(best, load)
    return best


_LAYOUTS = [("1f1b", 1), ("1f1b", 3), ("zb1p", 4), ("dualpipe", 2), ("dualpipe", 4), ("dualpipev", 1),
            ("dualpipev", 2), ("dualpipev", 3), ("interleaved1f1b", 2), ("interleaved1f1b", 3),
            ("interleaved1f1b", 4), ("interleaved1f1b", (2, 3)), ("interleaved1f1b", (3, 3))]  # fmt: skip


def _placement(schedule, ranks):
    """``ranks`` is R, or (R, stages per rank) for interleaving deeper than the default two."""
    return placement_of(schedule, *ranks) if isinstance(ranks, tuple) else placement_of(schedule, ranks)


def test_placements_follow_the_schedules():
    assert placement_of("1f1b", 3).groups == ((0,), (1,), (2,))
    v = placement_of("dualpipev", 3)  # rank r holds stages r and 2R-1-r
    assert v.kind == "nested" and v.groups == ((0, 5), (1, 4), (2, 3)) and v.weights == (1.0,) * 6
    d = placement_of("dualpipe", 4)  # two copies: ranks r and R-1-r hold model stages r and R-1-r, half the mbs each
    assert d.kind == "nested" and d.groups == ((0, 3), (1, 2)) and d.weights == (0.5,) * 4
    i = placement_of("interleaved1f1b", 3)  # round robin: rank r holds stages r and R + r
    assert i.kind == "round_robin" and i.groups == ((0, 3), (1, 4), (2, 5))
    assert placement_of("interleaved1f1b", 2, 3).groups == ((0, 2, 4), (1, 3, 5))


@pytest.mark.parametrize("schedule,ranks", _LAYOUTS)
def test_exact_optimum_on_random_costs(schedule, ranks):
    rng = random.Random(f"{schedule}{ranks}")
    placement = _placement(schedule, ranks)
    for _ in range(25):
        n = rng.randint(placement.num_stages, placement.num_stages + 5)
        costs = [rng.randint(0, 30) for _ in range(n)]
        costs[rng.randrange(n)] += 1  # not all zero
        part = partition_layers(costs, placement)
        assert sum(part.sizes) == n and min(part.sizes) >= 1
        assert part.max_load == pytest.approx(_brute(costs, placement), rel=1e-12, abs=0), (schedule, ranks, costs)


@pytest.mark.parametrize("schedule,ranks", _LAYOUTS)
@pytest.mark.parametrize(
    "costs",
    [
        [1, 1, 1, 100, 1, 1, 1, 1],  # one huge layer
        [5, 1, 1, 1, 1, 1, 1, 1, 1, 40],  # light embedding, heavy head
        [40, 1, 1, 1, 1, 1, 1, 1, 1, 5],  # heavy embedding
        [0.1, 0.2, 0.3, 0.25, 0.15, 0.05, 3.3, 0.7],  # floats
    ],
)
def test_exact_optimum_on_adversarial_costs(schedule, ranks, costs):
    placement = _placement(schedule, ranks)
    if len(costs) < placement.num_stages:
        costs = costs + costs[::-1]  # 9 interleaved stages need more layers
    part = partition_layers(costs, placement)
    assert part.max_load == pytest.approx(_brute(costs, placement), rel=1e-9)


def test_the_v_pairs_the_heavy_head_with_a_light_stage():
    # Balancing stages alone would give each of the 4 stages ~1/4 of the work; with the V, rank 0
    # also holds the head's stage, so the rank-aware optimum is strictly better per rank.
    costs = [2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 12]
    v = placement_of("dualpipev", 2)
    part = partition_layers(costs, v)
    per_stage = partition_layers(costs, placement_of("1f1b", 4))
    assert part.max_load == _brute(costs, v)
    assert part.max_load < max(rank_loads(per_stage.sizes, costs, v))


def test_too_few_layers_is_an_error():
    with pytest.raises(ValueError, match="3 layers cannot fill 4 model stages"):
        partition_layers([1, 2, 3], placement_of("dualpipev", 2))


def test_stage_modules_share_the_layers():
    layers = [nn.Linear(3, 3) for _ in range(5)]
    stages = stage_modules(nn.Sequential(*layers), [2, 1, 2])
    assert [len(s) for s in stages] == [2, 1, 2]
    assert stages[1][0] is layers[2]
    x = torch.randn(2, 3)
    y = x
    for s in stages:
        y = s(y)
    assert torch.equal(y, nn.Sequential(*layers)(x))
    with pytest.raises(ValueError, match="sum to 5 layers"):
        stage_modules(layers, [2, 2])


def test_interleaving_balances_ranks_not_stages():
    # Light embedding, heavy head, R = 2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3 (the head's).
    # Balancing the 4 stages alone (7, 7, 1, 1) gives rank 0 seven blocks + the embedding (17); the
    # rank-aware cut reaches the mean, 14.
    costs = [4] + [1] * 14 + [10]
    robin = placement_of("interleaved1f1b", 2)
    part = partition_layers(costs, robin)
    per_stage = partition_layers(costs, placement_of("1f1b", 4))
    assert part.max_load == _brute(costs, robin) == sum(costs) / 2
    assert max(rank_loads(per_stage.sizes, costs, robin)) == 17


def test_interleaved_partition_of_a_large_table_is_quick():
    import time

    rng = random.Random(7)
    costs = [rng.uniform(0.5, 1.5) for _ in range(64)]
    t0 = time.perf_counter()
    part = partition_layers(costs, placement_of("interleaved1f1b", 8))
    assert time.perf_counter() - t0 < 60  # generous: a loaded 2-core machine
    loads = rank_loads(part.sizes, costs, part.placement)
    assert max(loads) == pytest.approx(part.max_load) and max(loads) <= sum(costs) / 8 + 2 * max(costs)
