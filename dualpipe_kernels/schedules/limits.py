"""Sizes the tools serve: a schedule of at most ``MAX_RANK_MICROBATCHES`` (ranks x micro-batches).

Building, validating and simulating a schedule takes about 45 us and 5 KB per
(rank, micro-batch) pair on one CPU core: the limit keeps one simulation under
about 10 s and 1 GB.  The commands refuse anything larger in one line naming
the limit instead of running for minutes; the planner does not simulate
candidates beyond it (and says so).
"""

from __future__ import annotations

__all__ = ["MAX_RANK_MICROBATCHES", "check_schedule_size"]

#: Largest ranks x micro-batches the simulate command and the planner build and simulate.
MAX_RANK_MICROBATCHES = 200_000


def check_schedule_size(ranks: int, microbatches: int) -> None:
    """ValueError naming the limit when ``ranks x microbatches`` exceeds :data:`MAX_RANK_MICROBATCHES`."""
    if ranks * microbatches > MAX_RANK_MICROBATCHES:
        raise ValueError(
            f"{ranks} ranks x {microbatches} micro-batches = {ranks * microbatches:,} is beyond what the simulator "
            f"serves (at most {MAX_RANK_MICROBATCHES:,} ranks x micro-batches, about 10 s and 1 GB)"
        )
