"""engine: schedule engine speed, build + validate + simulate DualPipeV at 64 ranks x 1024 micro-batches.

Each repeat times the three phases separately (``build_schedule``,
``validate``, ``simulate`` on the compute-only schedule, which applies the
comm rules inline); the figure is the median of the per-repeat totals,
reported against the 2 s target as a ratio (below 1: faster than the target).
Wall and this process's CPU time are both reported: CPU time is less disturbed
by other processes on a shared machine, wall time is what a user waits.
``--lowered`` also times ``lower_comms`` + the simulation of the lowered lists
(the path that records every event for the exporters), and checks that both
simulator engines agree on the makespan.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

NAME = "engine"

__all__ = ["NAME", "EngineConfig", "add_arguments", "run", "to_markdown"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", default="dualpipev", help="schedule name (default dualpipev)")
    p.add_argument("--ranks", type=int, default=None, help="ranks (default 64; quick 8)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches (default 1024; quick 64)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default 3; quick 2)")
    p.add_argument("--target-s", type=float, default=2.0, help="target for the total, seconds (default 2)")
    p.add_argument("--lowered", action="store_true", help="also time lower_comms + the lowered simulation")


@dataclass(frozen=True)
class EngineConfig:
    schedule: str
    ranks: int
    microbatches: int
    repeats: int
    target_s: float
    lowered: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        from dualpipe_kernels.benchmarks.common import option

        cfg = cls(
            schedule=str(getattr(args, "schedule", "dualpipev")),
            ranks=int(option(args, "ranks", 64, 8)),
            microbatches=int(option(args, "microbatches", 1024, 64)),
            repeats=int(option(args, "repeats", 3, 2)),
            target_s=float(getattr(args, "target_s", 2.0)),
            lowered=bool(getattr(args, "lowered", False)),
        )
        if cfg.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {cfg.repeats}")
        if not cfg.target_s > 0:
            raise ValueError(f"--target-s must be > 0, got {cfg.target_s}")
        return cfg


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall seconds, this process's CPU seconds, result)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def _one_repeat(cfg: EngineConfig) -> tuple[dict[str, float], Any, Any]:
    from dualpipe_kernels.schedules import build_schedule, lower_comms, validate
    from dualpipe_kernels.schedules.costs import CostModel
    from dualpipe_kernels.schedules.simulator import simulate

    costs = CostModel(f=1, b=2, w=1, fb=2.5)
    t_build, c_build, sched = _timed(lambda: build_schedule(cfg.schedule, cfg.ranks, cfg.microbatches))
    t_validate, c_validate, _ = _timed(lambda: validate(sched))
    t_sim, c_sim, res = _timed(lambda: simulate(sched, costs))
    row = {
        "build_s": t_build,
        "validate_s": t_validate,
        "simulate_s": t_sim,
        "total_s": t_build + t_validate + t_sim,
        "build_cpu_s": c_build,
        "validate_cpu_s": c_validate,
        "simulate_cpu_s": c_sim,
        "total_cpu_s": c_build + c_validate + c_sim,
    }
    if cfg.lowered:
        t_lower, _, low = _timed(lambda: lower_comms(sched))
        t_sim_low, _, res_low = _timed(lambda: simulate(low, costs))
        if res_low.makespan != res.makespan:  # both engines agree (tests check it in detail)
            raise ValueError(f"simulator engines disagree: {res_low.makespan} != {res.makespan}")
        row.update(lower_s=t_lower, simulate_lowered_s=t_sim_low)
    return row, sched, res


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = EngineConfig.from_args(args)
    repeats = [_one_repeat(cfg) for _ in range(cfg.repeats)]
    per_repeat = [r for r, _, _ in repeats]
    _, sched, res = repeats[-1]
    med = {k: statistics.median(r[k] for r in per_repeat) for k in per_repeat[0]}
    row = {
        "schedule": cfg.schedule,
        "ranks": cfg.ranks,
        "microbatches": cfg.microbatches,
        "compute_actions": sum(len(a) for a in sched.actions),
        "transfers": res.num_transfers,
        **med,
        "target_s": cfg.target_s,
        "ratio_to_target": med["total_s"] / cfg.target_s,
        "cpu_ratio_to_target": med["total_cpu_s"] / cfg.target_s,
    }
    return {
        "rows": [row],
        "repeats": per_repeat,
        "config": asdict(cfg),
        "makespan": float(res.makespan),
        "bubble": float(res.bubble),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "cpu_count": os.cpu_count(),
    }


def to_markdown(result: dict[str, Any]) -> str:
    from dualpipe_kernels.benchmarks.common import markdown_table

    cols = ["schedule", "ranks", "microbatches", "compute_actions", "build_s", "validate_s", "simulate_s", "total_s"]
    heads = ["schedule", "ranks", "N", "compute actions", "build (s)", "validate (s)", "simulate (s)", "total (s)"]
    cols += ["total_cpu_s", "target_s", "ratio_to_target"]
    heads += ["total CPU (s)", "target (s)", "total / target"]
    lines = [
        f"Median of {len(result['repeats'])} repeats; below 1 meets the target. "
        f"1-min load average {result['load_average_1min']} on {result['cpu_count']} CPUs (shared machine).",
        "",
        markdown_table(result["rows"], cols, heads),
    ]
    return "\n".join(lines)
