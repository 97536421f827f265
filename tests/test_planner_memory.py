"""Memory model: activation peaks per rank from the action order, and their saturation in the micro-batch count.

The planner profiles a long step's order on a shorter one (``N >= 4 pp``); that
is exact only because every planned schedule's peak vectors stop changing once
``N >= 2 pp``, checked here.
"""

from __future__ import annotations

import pytest

from dualpipe_kernels.planner.memory import activation_profile
from dualpipe_kernels.planner.stages import PLAN_SCHEDULES
from dualpipe_kernels.schedules import build_schedule, schedule_layout


def _valid(name: str, pp: int, n: int) -> bool:
    try:
        schedule_layout(name, pp, n)
    except ValueError:
        return False
    return True


_LAYOUTS = [(n, pp) for n in PLAN_SCHEDULES for pp in (1, 2, 3, 4, 6) if n != "dualpipe" or pp % 2 == 0]


@pytest.mark.parametrize("name,pp", _LAYOUTS)
def test_peaks_saturate_from_2pp(name: str, pp: int) -> None:
    counts = [n for n in range(2 * pp, 10 * pp + 1) if _valid(name, pp, n)]
    first = activation_profile(build_schedule(name, pp, counts[0])).vectors
    for n in counts[1:]:
        assert activation_profile(build_schedule(name, pp, n)).vectors == first, (name, pp, n)


def test_1f1b_peaks_by_hand() -> None:
    # 1F1B on 4 ranks: rank r holds at most 4 - r micro-batches in flight.
    prof = activation_profile(build_schedule("1f1b", 4, 8))
    assert prof.peak_bytes([10.0, 20.0, 30.0, 40.0]) == [40.0, 60.0, 60.0, 40.0]
