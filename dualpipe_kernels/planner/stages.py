"""A (schedule, pp) layout with its optimal partition: per-stage sums and per-rank static figures.

Everything here is independent of the micro-batch count and size: costs scale
linearly with the micro-batch size (the planner multiplies by
``microbatch_size / profiled size``), which leaves the optimal partition
unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules import schedule_layout
from .layers import LayerTable
from .memory import param_state_bytes
from .partition import Partition, partition_layers, placement_of

__all__ = ["StagePlan", "stage_plan", "stages_per_rank", "PLAN_SCHEDULES"]

#: Schedules the planner searches.
PLAN_SCHEDULES = ("1f1b", "zb1p", "interleaved1f1b", "dualpipe", "dualpipev")

_MODEL_STAGES_PER_RANK = {"1f1b": 1, "zb1p": 1, "interleaved1f1b": 2, "dualpipe": 1, "dualpipev": 2}


def stages_per_rank(schedule: str) -> int:
    """Model stages per pipeline rank (DualPipe: 1, held twice; the V and interleaved: 2)."""
    return _MODEL_STAGES_PER_RANK[schedule]


@dataclass(frozen=True)
class StagePlan:
    """One schedule on ``pp`` ranks with its partition; sums are per model stage, at the profiled size.

    ``stage_to_rank``/``model_stage``/``share`` are per IR stage (``share``: the
    fraction of micro-batches that pass through it).  ``head_f`` per rank: the
    least forward time (profiled size) before any input can reach it.  ``inputs`` per model
    stage: its input's bytes (the previous layer's output; the first stage: its first layer's).
    """

    schedule: str
    pp: int
    partition: Partition
    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    activation: tuple[float, ...]
    params: tuple[float, ...]
    boundary: float
    inputs: tuple[float, ...]
    stage_to_rank: tuple[int, ...]
    model_stage: tuple[int, ...]
    share: tuple[float, ...]
    head_f: tuple[float, ...]

    def busy(self, microbatches: int, scale: float) -> list[float]:
        """Compute time per rank for one step (F + B of every micro-batch through its stages)."""
        out = [0.0] * self.pp
        for s, r in enumerate(self.stage_to_rank):
            m = self.model_stage[s]
            out[r] += self.share[s] * microbatches * (self.f[m] + self.b[m]) * scale
        return out

    def param_state(self, multiplier: float) -> list[float]:
        stages = [tuple(s for s, r in enumerate(self.stage_to_rank) if r == q) for q in range(self.pp)]
        return param_state_bytes(self.model_stage, stages, self.params, multiplier)

    def grad_bytes(self) -> float:
        """Largest gradient a rank reduces (its stages' parameters)."""
        return max(self.param_state(1.0))


def _sums(table: LayerTable, sizes: tuple[int, ...], field: str) -> tuple[float, ...]:
    out, start = [], 0
    for n in sizes:
        out.append(float(sum(getattr(x, field) for x in table.layers[start : start + n])))
        start += n
    return tuple(out)


def stage_plan(table: LayerTable, schedule: str, pp: int) -> StagePlan:
    """Partition ``table`` for ``schedule`` on ``pp`` ranks (ValueError when it has too few layers)."""
    placement = placement_of(schedule, pp)
    part = partition_layers([x.time_s for x in table.layers], placement)
    layout = schedule_layout(schedule, pp, 4 * pp * stages_per_rank(schedule))
    model_stage = layout.model_stage or tuple(range(len(layout.stage_to_rank)))
    n_mb = len(layout.microbatch_path)
    share = [0.0] * len(layout.stage_to_rank)
    for p in layout.microbatch_path:
        for s in layout.paths[p]:
            share[s] += 1.0 / n_mb
    f = _sums(table, part.sizes, "f_s")
    # The forward time before each IR stage on each path; a rank can start no earlier than its minimum.
    head = [float("inf")] * pp
    for path in layout.paths:
        acc = 0.0
        for s in path:
            r = layout.stage_to_rank[s]
            head[r] = min(head[r], acc)
            acc += f[model_stage[s]]
    ends = [e for _, e in part.bounds[:-1]]
    boundary = max((table.layers[e - 1].boundary_bytes for e in ends), default=0.0)
    inputs = tuple(float(table.layers[max(b - 1, 0)].boundary_bytes) for b, _ in part.bounds)
    return StagePlan(
        schedule=schedule,
        pp=pp,
        partition=part,
        f=f,
        b=_sums(table, part.sizes, "b_s"),
        w=_sums(table, part.sizes, "w_s"),
        activation=_sums(table, part.sizes, "activation_bytes"),
        params=_sums(table, part.sizes, "param_bytes"),
        boundary=float(boundary),
        inputs=inputs,
        stage_to_rank=tuple(layout.stage_to_rank),
        model_stage=tuple(model_stage),
        share=tuple(share),
        head_f=tuple(head),
    )
