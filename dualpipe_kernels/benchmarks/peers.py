"""torch.distributed.pipelining side by side: the same sleep-stage model and costs through torch's schedules.

Runs inside a rank process of the ``schedules`` suite (the process group is
already up).  ``torch_schedule_step_times`` builds torch's ``PipelineStage``
objects around the same :class:`SleepStage` chunks our runtime runs, drives
``ScheduleDualPipeV`` (2 chunks per rank, V placement) or ``Schedule1F1B``
(one stage of two chunks per rank, so the model matches) and returns this
rank's step times.

Peer names (``PEERS``) map to (torch class name, our schedule name).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["PEERS", "torch_schedule_step_times"]

#: peer name -> (class in torch.distributed.pipelining, the schedule of ours it is compared with)
PEERS: dict[str, tuple[str, str]] = {
    "torch.ScheduleDualPipeV": ("ScheduleDualPipeV", "dualpipev"),
    "torch.Schedule1F1B": ("Schedule1F1B", "1f1b"),
}


def _v_stages(rank: int, ranks: int) -> tuple[int, int]:
    """Stages of ``rank`` in the V placement: ``rank`` and ``2 * ranks - 1 - rank``."""
    return rank, 2 * ranks - 1 - rank


def torch_schedule_step_times(
    peer: str,
    rank: int,
    ranks: int,
    microbatches: int,
    f_s: float,
    b_s: float,
    w_s: float,
    activation_bytes: int,
    steps: int,
    warmup: int = 1,
) -> list[float]:
    """This rank's wall time of each measured ``schedule.step`` (seconds), after ``warmup`` untimed steps.

    ``f_s``/``b_s``/``w_s`` are the costs of one stage *chunk*; a 1F1B stage is two chunks.
    Every step starts after a barrier so ranks start together.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining as pp

    from dualpipe_kernels.benchmarks.sleep_stages import SleepStage, sleep_batch, sleep_criterion

    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; choose one of {', '.join(PEERS)}")
    cls_name, _ = PEERS[peer]
    cls = getattr(pp, cls_name, None)
    if cls is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.distributed.pipelining.{cls_name}")
    dev = torch.device("cpu")
    if cls_name == "Schedule1F1B":
        stages = [pp.PipelineStage(SleepStage(2 * f_s, 2 * b_s, 2 * w_s), rank, ranks, dev)]
        sched: Any = cls(stages[0], microbatches, loss_fn=sleep_criterion)
    else:
        stages = [pp.PipelineStage(SleepStage(f_s, b_s, w_s), s, 2 * ranks, dev) for s in _v_stages(rank, ranks)]
        sched = cls(stages, microbatches, loss_fn=sleep_criterion)
    x = sleep_batch(microbatches, activation_bytes)
    target = torch.zeros(x.shape[0])
    holds_first = any(st.is_first for st in stages)
    holds_last = any(st.is_last for st in stages)
    times: list[float] = []
    for k in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        args = (x,) if holds_first else ()
        sched.step(*args, target=target if holds_last else None, losses=[] if holds_last else None)
        dt = time.perf_counter() - t0
        if k >= warmup:
            times.append(dt)
    dist.barrier()
    return times
