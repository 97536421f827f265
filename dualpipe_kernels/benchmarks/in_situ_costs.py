"""Per-action costs read from measured step timelines, for the simulator: what each action really cost in the run.

A stage chunk timed alone in one process (``memory``'s old feed) misses what the
pipeline adds around every action: on a small machine the ranks' compute
contends for the cores, and between two compute actions the runtime posts
receives, hands sends to the transport and reaps them.  Fed costs without
that, the simulator predicts a step 10-50% short.  Here each compute action of
a measured step costs

    (its span - the receive waits nested in it) + (the gap since the previous compute on its rank)

so the runtime's own work before an action is charged to it, and a wait for a
peer (which the simulator derives from the schedule) is not.  The time before
a rank's first compute and after its last (step set-up, the final send waits)
is ``fixed_s``, added once per step.  ``forward_s`` is an F's span alone (no
gap): what a recompute re-runs.

A wait for a peer is partly the schedule's (simulated) and partly the
transfer's own latency (gloo's, the receiving process being scheduled).
:func:`fit_latency` finds the one per-transfer latency with which the
simulated step of the measured run equals its measured step: a calibration on
that run, to be used for predicting other runs (other memory policies).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["InSituCosts", "in_situ_costs", "fit_latency"]


@dataclass(frozen=True)
class InSituCosts:
    """Per-stage medians (seconds, index = IR stage) of the measured steps; see the module docstring."""

    f: list[float]
    b: list[float]
    w: list[float]
    fb: list[float]
    forward_s: list[float]
    fixed_s: float
    latency_s: float = 0.0

    def cost_model(self) -> Any:
        from dualpipe_kernels.schedules.costs import CostModel

        return CostModel(f=list(self.f), b=list(self.b), w=list(self.w), fb=list(self.fb))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _kind(act: Any) -> str:
    subs = act.computes()
    return "FB" if len(subs) == 2 else act.type.value


def _rank_samples(
    entries: Sequence[tuple[int, Any, float, float]], step_s: float, out: dict[tuple[str, int], list[float]]
) -> float:
    """Add one rank's step to ``out[(kind, stage)]`` (kind ``F0`` = F span alone); return its fixed time."""
    comps = sorted((e for e in entries if e[1].is_compute), key=lambda e: e[2])
    recvs = [(t0, t1) for _r, a, t0, t1 in entries if not a.is_compute and a.type.name.startswith("RECV")]
    prev_end = None
    for _r, a, t0, t1 in comps:
        waits = sum(max(0.0, min(t1, r1) - max(t0, r0)) for r0, r1 in recvs)
        busy = max(0.0, t1 - t0 - waits)
        gap = 0.0 if prev_end is None else max(0.0, t0 - prev_end)
        prev_end = t1
        out.setdefault((_kind(a), a.stage), []).append(busy + gap)
        if a.type.value == "F":
            out.setdefault(("F0", a.stage), []).append(busy)
    if not comps:
        return step_s
    return comps[0][2] + max(0.0, step_s - comps[-1][3])


def in_situ_costs(
    steps: Iterable[Sequence[tuple[Sequence[tuple[int, Any, float, float]], float]]], num_stages: int
) -> InSituCosts:
    """Costs from ``steps``: each a list over ranks of ``(timeline entries, the rank's step seconds)``.

    Stages with no sample of a kind fall back as :func:`runtime.timeline.measured_stage_costs` does
    (B = I + W, W = B / 2, F&B = F + B clamped to [max(F, B), F + B]).
    """
    from dualpipe_kernels.runtime.timeline import costs_from_samples, schedule_entries

    samples: dict[tuple[str, int], list[float]] = {}
    fixed: list[float] = []
    for ranks in steps:
        per_rank = [_rank_samples(schedule_entries(tl), s, samples) for tl, s in ranks]
        fixed.append(statistics.median(per_rank))

    f, b, w, fb = costs_from_samples(samples, num_stages)
    fwd = [float(statistics.median(samples[("F0", s)])) if samples.get(("F0", s)) else f[s] for s in range(num_stages)]
    return InSituCosts(f, b, w, fb, fwd, float(statistics.median(fixed)) if fixed else 0.0)


def fit_latency(costs: InSituCosts, schedule: Any, step_s: float, iters: int = 40) -> InSituCosts:
    """``costs`` with the transfer latency at which ``schedule`` simulates to ``step_s`` (0 if it already
    does or exceeds it; the simulated step grows with the latency, so bisection finds it)."""
    from dataclasses import replace

    from dualpipe_kernels.schedules.costs import CommModel
    from dualpipe_kernels.schedules.simulator import simulate

    model = costs.cost_model()

    def step(latency: float) -> float:
        return float(simulate(schedule, model, CommModel(latency=latency)).makespan) + costs.fixed_s

    if step(0.0) >= step_s:
        return replace(costs, latency_s=0.0)
    lo, hi = 0.0, step_s
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < step_s else (lo, mid)
    return replace(costs, latency_s=lo)
