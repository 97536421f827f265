"""Per-rank memory of a planned pipeline: parameter state plus peak saved activations.

Model (memory policy ``keep``: every saved activation stays in memory until its backward frees it):

* parameter state: each IR stage a rank holds costs its model stage's
  ``param_bytes x state_multiplier`` (default 4: parameters, gradients and the
  two Adam moments, all in the parameters' dtype).  DualPipe's second copy of a
  model stage is a real copy and counts again.
* activations: walking the rank's action list in order, an F of stage ``s``
  adds stage ``s``'s activation bytes for one micro-batch; a full B frees them;
  when the backward is split, the I keeps them (the deferred W still reads
  the layer inputs) and the W frees them.  An F&B pair adds its F before its
  backward half frees.  The peak of that running sum is the prediction; it
  depends only on the order, so it is computed once per (schedule, ranks,
  micro-batches) as the set of count vectors that can be a maximum.  For the
  planned schedules these vectors stop changing once ``N >= 2 x ranks`` (the
  warm-up depth bounds what is in flight; tests/test_planner_memory.py checks
  it), which lets the planner profile a long step on a shorter one.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..schedules import ActionType, Schedule

__all__ = ["ActivationProfile", "activation_profile", "param_state_bytes"]

_F, _B, _I, _W, _FB = ActionType.F, ActionType.B, ActionType.I, ActionType.W, ActionType.OVERLAP_F_B


class ActivationProfile:
    """Candidate peaks of one schedule: per rank, the stage-count vectors at each local maximum.

    ``peak_bytes(per_stage)`` returns, per rank, ``max over vectors of sum(count[s] x bytes[s])``;
    ``per_stage`` is indexed by IR stage.
    """

    def __init__(self, stages_of_rank: list[tuple[int, ...]], vectors: list[list[tuple[int, ...]]]) -> None:
        self.stages_of_rank = stages_of_rank
        self.vectors = vectors

    def peak_bytes(self, per_stage: Sequence[float]) -> list[float]:
        out = []
        for stages, vecs in zip(self.stages_of_rank, self.vectors, strict=True):
            w = [per_stage[s] for s in stages]
            out.append(max((sum(c * x for c, x in zip(v, w, strict=True)) for v in vecs), default=0.0))
        return out


def _events(action: object) -> list[tuple[int, int]]:
    """(stage, +1/-1/0) steps of one compute action on the live-activation count."""
    t = action.type  # type: ignore[attr-defined]
    if t is _FB:
        return [e for sub in action.sub_actions for e in _events(sub)]  # type: ignore[attr-defined]
    if t is _F:
        return [(action.stage, 1)]  # type: ignore[attr-defined]
    if t is _B or t is _W:
        return [(action.stage, -1)]  # type: ignore[attr-defined]
    return []


def activation_profile(schedule: Schedule) -> ActivationProfile:
    """Walk each rank's compute actions once; keep the count vectors that are Pareto-maximal."""
    stages_of_rank, vectors = [], []
    for r in range(schedule.num_ranks):
        stages = schedule.stages_of_rank(r)
        pos = {s: k for k, s in enumerate(stages)}
        count = [0] * len(stages)
        peaks: set[tuple[int, ...]] = set()
        rising = False
        for a in schedule.compute_actions(r):
            for stage, step in _events(a):
                if step > 0:
                    count[pos[stage]] += 1
                    rising = True
                elif step < 0:
                    if rising:
                        peaks.add(tuple(count))
                    rising = False
                    count[pos[stage]] -= 1
        if rising:
            peaks.add(tuple(count))
        stages_of_rank.append(stages)
        vectors.append(_pareto(peaks))
    return ActivationProfile(stages_of_rank, vectors)


def _pareto(vecs: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Drop vectors dominated componentwise by another (they can never be the maximum)."""
    keep: list[tuple[int, ...]] = []
    for v in sorted(vecs, reverse=True):
        if not any(all(a >= b for a, b in zip(k, v, strict=True)) for k in keep):
            keep.append(v)
    return keep


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
