"""Planner memory: the memory model's peaks per rank, and their saturation in the micro-batch count.

The planner profiles a long step's order on a shorter one (``N >= 4 pp``); that
is exact only because every planned schedule's peaks, under every policy the
planner searches, stop changing once ``N >= 2 pp``, checked here with stage
sizes that tell the stages apart (powers of a base larger than any count).
"""

from __future__ import annotations

import pytest

from dualpipe_kernels.planner.memory import PLAN_MEMORY_POLICIES, activation_peaks, chunk_bytes
from dualpipe_kernels.planner.stages import PLAN_SCHEDULES
from dualpipe_kernels.schedules import build_schedule, schedule_fits
from dualpipe_kernels.schedules.memory_model import ChunkBytes, peak_saved_bytes

_LAYOUTS = [(n, pp) for n in PLAN_SCHEDULES for pp in (1, 2, 3, 4, 6) if n != "dualpipe" or pp % 2 == 0]


def _peaks(name: str, pp: int, n: int, policy: str) -> list[int]:
    sched = build_schedule(name, pp, n)
    base = 8 * pp + 8
    sizes = [ChunkBytes(base ** (2 * s + 1), base ** (2 * s)) for s in range(sched.num_stages)]
    return peak_saved_bytes(sched, policy, sizes)


@pytest.mark.parametrize("name,pp", _LAYOUTS)
@pytest.mark.parametrize("policy", PLAN_MEMORY_POLICIES)
def test_peaks_saturate_from_2pp(name: str, pp: int, policy: str) -> None:
    counts = [n for n in range(2 * pp, 10 * pp + 1) if schedule_fits(name, pp, n)]
    first = _peaks(name, pp, counts[0], policy)
    for n in counts[1:]:
        assert _peaks(name, pp, n, policy) == first, (name, pp, n)


def test_1f1b_peaks_by_hand() -> None:
    # 1F1B on 4 ranks: rank r holds at most 4 - r micro-batches in flight.
    # The first stage's input (the caller's batch, 1.0 here) counts nowhere: its chunk is 10 - 1 = 9.
    sizes = chunk_bytes([10.0, 20.0, 30.0, 40.0], [1.0, 2.0, 3.0, 4.0])
    sched = build_schedule("1f1b", 4, 8)
    assert activation_peaks(sched, "keep", sizes, sched.model_stage) == [36.0, 60.0, 60.0, 40.0]
    # recompute: the inputs of the (4 - r) in flight (none on rank 0), plus one chunk's recomputed rest
    assert activation_peaks(sched, "recompute", sizes, sched.model_stage) == [9.0, 24.0, 33.0, 40.0]


def test_zero_bubble_frees_at_w() -> None:
    # ZB1P on 2 ranks, rank 0: F0 F1 I0 W0 F2 I1 W1 ...; after an I the saved tensors live until its W.
    sched = build_schedule("zb1p", 2, 8)
    sizes = chunk_bytes([100.0, 1.0], [0.0, 0.0])
    assert activation_peaks(sched, "keep", sizes, sched.model_stage)[0] == 200.0
