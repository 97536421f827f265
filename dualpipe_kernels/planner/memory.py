"""Per-rank memory of a planned pipeline: parameter state plus peak saved activations.

* parameter state: each IR stage a rank holds costs its model stage's
  ``param_bytes x state_multiplier`` (default 4: parameters, gradients and the
  two Adam moments, all in the parameters' dtype).  DualPipe's second copy of a
  model stage is a real copy and counts again.
* activations: :func:`dualpipe_kernels.schedules.memory_model.peak_saved_bytes`,
  the one lifetime rule the runtime is measured against (keep: an F's saved
  tensors live until its B, or until its W after an I; recompute and offload
  as documented there).  The planner only adapts its per-stage sums to that
  model's :class:`ChunkBytes`: ``saved`` = the stage's activation bytes,
  ``kept`` (what recompute/offload never drop) = the stage input, i.e. the
  boundary bytes of the layer before the stage, capped at ``saved``.  The
  first stage's input is the caller's batch, which the runtime counts under no
  policy: that stage keeps nothing, and its saved bytes leave out its input
  (the table has no input size: its first layer's output stands in).

Peaks are linear in the chunk sizes, so the planner computes them once per
(schedule, ranks, micro-batches, policy) at the profiled micro-batch size and
scales.  For the planned schedules they stop changing once ``N >= 2 x ranks``
(the warm-up depth bounds what is in flight; tests/unit/test_planner_memory.py
checks it), which lets the planner profile a long step on a shorter one.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..schedules import Schedule
from ..schedules.memory_model import ChunkBytes, peak_saved_bytes

__all__ = ["PLAN_MEMORY_POLICIES", "chunk_bytes", "activation_peaks", "param_state_bytes"]

#: Activation memory policies the planner searches, in the order a tie in step time goes (compress changes
#: the numerics of every backward and is never chosen for you; the offload casts only change what crosses the
#: host link, and win only where the lossless offload's reloads cannot hide: cheaper link, same device bytes).
PLAN_MEMORY_POLICIES = ("keep", "recompute", "offload", "offload:bf16", "offload:fp8")


def chunk_bytes(saved: Sequence[float], stage_input: Sequence[float]) -> list[ChunkBytes]:
    """Per model stage: the memory model's sizes from the planner's sums (``kept`` = the input, <= saved).

    The first model stage's input is the caller's batch, which the runtime never counts as saved
    activations (the caller holds it anyway), under any policy: that stage keeps nothing of its own,
    and its saved bytes leave out its input (``stage_input[0]``, the table's stand-in for it).
    """
    out = []
    for m, (s, k) in enumerate(zip(saved, stage_input, strict=True)):
        out.append(ChunkBytes(max(s - k, 0.0), 0.0) if m == 0 else ChunkBytes(s, min(k, s)))
    return out


def activation_peaks(
    schedule: Schedule, policy: str, per_model_stage: Sequence[ChunkBytes], model_stage: Sequence[int]
) -> list[float]:
    """Peak saved-activation bytes of every rank of ``schedule`` under ``policy`` (sizes per model stage)."""
    sizes = [per_model_stage[m] for m in model_stage]
    return [float(x) for x in peak_saved_bytes(schedule, policy, sizes)]


def param_state_bytes(
    schedule_model_stage: Sequence[int],
    stages_of_rank: Sequence[Sequence[int]],
    stage_param_bytes: Sequence[float],
    state_multiplier: float,
) -> list[float]:
    """Per rank: parameter state of every IR stage it holds (model-stage bytes x multiplier)."""
    return [
        state_multiplier * sum(stage_param_bytes[schedule_model_stage[s]] for s in stages) for stages in stages_of_rank
    ]
