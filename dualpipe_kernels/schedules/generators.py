"""The schedule registry: ``build_schedule(name, ranks, microbatches)``.

Every generator returns a compute-only :class:`Schedule` (F, B, I, W and
OVERLAP_F_B; no comm actions: see :func:`lowering.lower_comms`).

Constraints (ValueError naming the one that fails):

=================  =============================================  =================
name               ranks / micro-batches                          stages per rank
=================  =============================================  =================
dualpipe           even ranks >= 2, even N, N >= 2 * ranks        2 (two copies)
dualpipev          ranks >= 1, N >= 2 * ranks                     2 (V shape)
1f1b, gpipe, zb1p  ranks >= 1, N >= 1                             1
interleaved1f1b    ranks >= 1, N >= 1, N % ranks == 0             V >= 1 (default 2)
zbv                ranks >= 1, N >= 1                             2 (V shape)
=================  =============================================  =================
"""

from __future__ import annotations

from collections.abc import Callable

from ._program import Layout, gc_paused
from .baselines import (
    check_interleaved,
    check_linear,
    gpipe,
    interleaved_1f1b,
    interleaved_layout,
    linear_layout,
    one_f_one_b,
    v_layout,
    zb1p,
    zbv,
)
from .dualpipe import check_dualpipe, check_dualpipev, dualpipe, dualpipe_layout, dualpipev, dualpipev_layout
from .ir import Schedule

__all__ = ["SCHEDULE_NAMES", "build_schedule", "schedule_fits", "schedule_layout", "stages_per_rank_of"]

SCHEDULE_NAMES = ("dualpipe", "dualpipev", "1f1b", "gpipe", "interleaved1f1b", "zb1p", "zbv")

# Stage chunks per rank of the schedules where it is fixed.
_FIXED_STAGES_PER_RANK = {"dualpipe": 2, "dualpipev": 2, "1f1b": 1, "gpipe": 1, "zb1p": 1, "zbv": 2}
_DEFAULT_INTERLEAVED_CHUNKS = 2

# Name -> generator (and its stage placement; 1f1b, gpipe and zb1p share linear_layout) of the schedules whose
# stages per rank are fixed; interleaved1f1b takes its chunk count as a third argument.
_BUILDERS: dict[str, Callable[[int, int], Schedule]] = {
    "dualpipe": dualpipe,
    "dualpipev": dualpipev,
    "1f1b": one_f_one_b,
    "gpipe": gpipe,
    "zb1p": zb1p,
    "zbv": zbv,
}
_LAYOUTS: dict[str, Callable[[int, int], Layout]] = {
    "dualpipe": dualpipe_layout,
    "dualpipev": dualpipev_layout,
    "zbv": v_layout,
}


def _check_name(name: str) -> None:
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")


def _as_int(value: object, what: str) -> int:
    # bool is an int subclass; True ranks is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return value


def stages_per_rank_of(name: str, stages_per_rank: int | None = None) -> int:
    """Stage chunks per rank for ``name`` (checks a given value against a fixed one)."""
    _check_name(name)
    if name == "interleaved1f1b":
        if stages_per_rank is None:
            return _DEFAULT_INTERLEAVED_CHUNKS
        v = _as_int(stages_per_rank, "stages_per_rank")
        if v < 1:
            raise ValueError(f"interleaved1f1b needs stages_per_rank >= 1, got {v}")
        return v
    fixed = _FIXED_STAGES_PER_RANK[name]
    if stages_per_rank is not None and _as_int(stages_per_rank, "stages_per_rank") != fixed:
        raise ValueError(f"{name} has {fixed} stage(s) per rank, got stages_per_rank={stages_per_rank}")
    return fixed


def _check(name: str, ranks: int, microbatches: int, v: int) -> None:
    if name == "dualpipe":
        check_dualpipe(ranks, microbatches)
    elif name == "dualpipev":
        check_dualpipev(ranks, microbatches)
    elif name == "interleaved1f1b":
        check_interleaved(ranks, microbatches, v)
    else:
        check_linear(name, ranks, microbatches)


def _checked_args(name: str, ranks: int, microbatches: int, stages_per_rank: int | None) -> tuple[int, int, int]:
    """``(ranks, microbatches, stages per rank)`` as ints, checked for schedule ``name`` (ValueError otherwise)."""
    ranks = _as_int(ranks, "ranks")
    microbatches = _as_int(microbatches, "microbatches")
    v = stages_per_rank_of(name, stages_per_rank)
    _check(name, ranks, microbatches, v)
    return ranks, microbatches, v


def schedule_layout(name: str, ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Layout:
    """The stage placement and paths ``build_schedule`` would use, without building the orders."""
    ranks, microbatches, v = _checked_args(name, ranks, microbatches, stages_per_rank)
    if name == "interleaved1f1b":
        return interleaved_layout(ranks, microbatches, v)
    return _LAYOUTS.get(name, linear_layout)(ranks, microbatches)


def schedule_fits(name: str, ranks: int, microbatches: int, stages_per_rank: int | None = None) -> bool:
    """Whether ``build_schedule`` accepts these arguments (the generators own the constraints)."""
    try:
        schedule_layout(name, ranks, microbatches, stages_per_rank)
    except ValueError:
        return False
    return True


def build_schedule(name: str, ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """Build the compute-only schedule ``name`` for ``ranks`` ranks and ``microbatches`` micro-batches.

    ``stages_per_rank`` matters only for ``interleaved1f1b`` (default 2); for the
    others it may be omitted or must equal their fixed value.
    """
    ranks, microbatches, v = _checked_args(name, ranks, microbatches, stages_per_rank)
    with gc_paused():
        return _build(name, ranks, microbatches, v)


def _build(name: str, ranks: int, microbatches: int, v: int) -> Schedule:
    if name == "interleaved1f1b":
        return interleaved_1f1b(ranks, microbatches, v)
    return _BUILDERS[name](ranks, microbatches)
