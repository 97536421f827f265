"""A planned partition beats an even split, measured: DualPipeV on 2 CPU processes with sleeping layers.

Eight layers sleep for known times (the last one, a "head", four times the
others).  The profiler measures them, the planner partitions them for the V
(rank 0 holds the first and the last stage), and both the planned and the even
partition (2, 2, 2, 2) run the same steps through
``Pipeline.from_sequential(partition=...)``.  Even: rank 0 carries 2 + 5 = 7
units per micro-batch; planned: at most 6.

Timing is reported (``-s``), not asserted: a timed assertion fails on a loaded
machine.  What is asserted: the planner's cut from the profiled table keeps the
heavy rank lighter than the even split, and both partitions train with the same
losses.  `dualpipe-kernels plan` and the planner tests check the simulated ranking.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from torch import nn

from dualpipe_kernels.planner import Cluster, plan, profile_layers
from dualpipe_kernels.runtime import Pipeline, spawn
from dualpipe_kernels.schedules import build_schedule

UNIT_S = 0.002
WEIGHTS = [1, 1, 1, 1, 1, 1, 1, 4]
BATCH, MICROBATCHES, STEPS = 8, 8, 3


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        time.sleep(seconds)
        return x * w

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        time.sleep(2 * ctx.seconds)
        return g, g.sum().reshape(1), None


class _SleepLayer(nn.Module):
    """Forward sleeps ``units x UNIT_S``, backward twice that, whatever the micro-batch size."""

    def __init__(self, units: int) -> None:
        super().__init__()
        self.seconds = units * UNIT_S
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.w, self.seconds)


def _model() -> nn.Sequential:
    return nn.Sequential(*[_SleepLayer(u) for u in WEIGHTS])


def _steps(rank: int, world: int, partition: list[int]) -> tuple[float, list[float]]:
    pipe = Pipeline.from_sequential(build_schedule("dualpipev", world, MICROBATCHES), _model(), partition=partition,
                                    timeout_s=60.0)  # fmt: skip
    x, t = torch.ones(BATCH, 4), torch.zeros(BATCH, 4)
    times, losses = [], []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        res = pipe.step(x, labels=(t,), criterion=lambda out, y: (out - y).sum())
        times.append(time.perf_counter() - t0)
        losses.extend(float(v) for _, v in sorted(res.losses.items()))
    pipe.close()
    return statistics.median(times), losses


def _worker(rank: int, world: int, partitions: list[list[int]]) -> list[tuple[float, list[float]]]:
    return [_steps(rank, world, p) for p in partitions]


@pytest.mark.timeout(300)
def test_planned_partition_beats_an_even_split() -> None:
    table = profile_layers(_model(), torch.ones(1, 4), repeats=3)
    best = plan(table, Cluster(2, 2, 1e9), MICROBATCHES, schedules=("dualpipev",), pp_degrees=(2,)).best
    planned, even = list(best.partition), [2, 2, 2, 2]
    # Rank 0 holds stages 0 and 3: the planned cut keeps its load at most 6 units (even: 2 + 5 = 7).
    assert sum(WEIGHTS[: planned[0]]) + sum(WEIGHTS[-planned[3] :]) <= 6, planned
    res = spawn(_worker, 2, [planned, even], timeout_s=240)
    step_planned, step_even = (max(res[r][k][0] for r in range(2)) for k in range(2))
    loss_rank = next(r for r in range(2) if res[r][0][1])
    assert res[loss_rank][0][1] == res[loss_rank][1][1]  # the cut changes placement, not the maths
    print(f"planned {planned}: {step_planned:.3f} s, even {even}: {step_even:.3f} s (measured, median of {STEPS})")
