"""What the short-chunk row of ``bench schedules`` adds to a schedule row: DualPipeV on 1/2/1 ms
chunks, where the runtime's own cost per action shows.  The suite (:func:`.schedules.short_chunk_rows`)
runs the row; this module reads its extra fields (it imports nothing of the suite).

The row is the suite's schedule row, measured
``cfg.short_launches`` times, each launch with fresh rank processes and its own
calibration just before (a launch's ratio moved by up to 20% between launches
minutes apart on the 2-core machine, calibration and measurement together): the
row is the launch of median ratio, with every launch's ratio in ``ratios`` and
their range in ``ratio_min`` / ``ratio_max``.  Each launch also measures its
compute floor (:mod:`.compute_floor`), which splits the ratio into three factors
(:func:`floor_fields`), and runs the bare pipeline, which splits it into the host's share and the runtime's
(:func:`bare_fields`).
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["SHORT_TARGET_RATIO", "floor_fields", "bare_fields", "short_targets"]

#: measured / simulated target of the short-chunk row, DualPipeV 4 ranks x 16 (at most 10% over the simulator)
SHORT_TARGET_RATIO = 1.10


def floor_fields(
    per_rank: list[Any], microbatches: int, ranks: int, chunks: dict[int, Any], ratio: float | None
) -> dict[str, Any]:
    """The compute floor of one launch (:mod:`.compute_floor`) and what it says of the launch's ``ratio``.

    ``floor_alone_s`` / ``floor_together_s``: the slowest rank's compute alone and with every rank at once
    (medians over steps of the slowest rank's step); ``floor_inflation``: their ratio, the host's share of
    measured / simulated.  ``alone_drift``: each rank's compute alone in this launch over the same actions
    at the calibrated chunk costs the simulator got (median over ranks): how far the calibration, taken
    before the launch, is from what the chunks cost during it.  ``ratio_runtime``: ``ratio`` with both
    taken out, the runtime's own share and the waits it causes.
    """
    from dualpipe_kernels.benchmarks.sleep_runs import chunks_per_stage, slowest_step_median
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.schedules.ir import T_B, T_F, T_I, T_W

    keys = ("floor_alone_s", "floor_together_s", "floor_inflation", "alone_drift", "ratio_runtime")
    if not per_rank or any(m is None or not m.floor_alone or not m.floor_together for m in per_rank):
        return dict.fromkeys(keys)
    sched = build_schedule("dualpipev", ranks, microbatches)
    c = chunks[chunks_per_stage(sched)]
    cost = {T_F: c.f, T_B: c.i + c.w, T_I: c.i, T_W: c.w}  # as the simulator's cost model (B = I + W)
    drift = statistics.median(
        statistics.median(m.floor_alone) / sum(cost[a.type] for op in sched.compute_actions(r) for a in op.computes())
        for r, m in enumerate(per_rank)
    )
    # one statistic for both phases: the median over steps of the slowest rank's step (a max of several noisy
    # ranks sits above the largest of their medians, which alone would tilt the ratio above 1)
    alone = slowest_step_median([m.floor_alone for m in per_rank])
    together = slowest_step_median([m.floor_together for m in per_rank])
    inflation = together / alone
    runtime = ratio / (inflation * drift) if ratio is not None else None
    return dict(zip(keys, (alone, together, inflation, drift, runtime), strict=True))


def bare_fields(per_rank: list[Any], measured: float | None, simulated: float | None) -> dict[str, Any]:
    """The bare pipeline of one launch (:func:`.compute_floor.bare_pipeline`) against the row.

    ``bare_s``: the median over steps of the slowest rank's step with the same chunks and transfers and no
    runtime; ``bare_over_simulated``: what the host gives any runtime (the chunks, the transfers' copies and
    the wake-ups of waiting ranks); ``measured_over_bare``: what this runtime adds to that, its own share.
    Their product is ``ratio``.
    """
    from dualpipe_kernels.benchmarks.sleep_runs import slowest_step_median

    keys = ("bare_s", "bare_over_simulated", "measured_over_bare")
    if not per_rank or any(m is None or not m.bare for m in per_rank) or not measured or not simulated:
        return dict.fromkeys(keys)
    bare = slowest_step_median([m.bare for m in per_rank])
    return dict(zip(keys, (bare, bare / simulated, measured / bare), strict=True))


def short_targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The short-chunk row's target (measured / simulated <= 1.10), where this run measured it."""
    out: dict[str, Any] = {}
    for r in rows:
        if r["ranks"] == 4 and r["microbatches"] == 16 and r.get("ratio"):
            out["dualpipev_4x16_short_chunks_measured_over_simulated"] = r["ratio"]
            out["dualpipev_4x16_short_chunks_target"] = SHORT_TARGET_RATIO
            out["dualpipev_4x16_short_chunks_met"] = r["ratio"] <= SHORT_TARGET_RATIO
    return out
