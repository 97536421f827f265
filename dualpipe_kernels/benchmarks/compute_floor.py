"""What a host gives a runtime that costs nothing: each rank's compute alone, then all ranks' at once.

A sleep-stage pipeline's step is its ranks' chunks, the runtime's own work and
the waits between ranks.  :func:`compute_floor` runs, inside the rank processes
of a measurement, every rank's compute actions in its schedule's order with
the same :class:`~.sleep_stages.SleepStage` modules and no runtime, transport
or waits (a forward's input is a fresh leaf on one preallocated tensor, a
backward's gradient another): first one rank at a time while the others wait at a barrier
(``alone``), then all ranks together (``together``).  ``together / alone`` is
what sharing the host's CPUs does to the compute itself: on a machine with a
core per rank about 1, with four ranks on two CPUs above it.  A pipeline's
measured / simulated ratio cannot fall below that factor whatever the runtime
does, since the simulator is fed chunks timed alone.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["compute_floor"]


def _compute_step(actions: list[Any], modules: Mapping[int, Any], x: Any, grad: Any) -> None:
    """The rank's compute actions once: F, B (full), I (W deferred through a bound store), W, F&B pairs."""
    import torch

    from dualpipe_kernels.runtime.zero_bubble import WeightGradStore
    from dualpipe_kernels.schedules.ir import T_B, T_F, T_I, T_W

    store = WeightGradStore()
    outs: dict[tuple[int, int], Any] = {}

    def run(a: Any) -> None:  # a plain compute action (an F&B pair's halves come one by one)
        key = (a.stage, a.microbatch)
        if a.type is T_F:
            outs[key] = modules[a.stage](x.detach().requires_grad_(True))  # a fresh leaf, as a received input
        elif a.type is T_B or a.type is T_I:
            with store.enabled_for(a.type is T_I):
                torch.autograd.backward([outs.pop(key)], [grad])
            if a.type is T_I:
                store.flush(key)
        elif a.type is T_W:
            store.pop(key)

    with store.bind():
        for op in actions:
            for a in op.computes():
                run(a)
    if outs or len(store):
        raise RuntimeError(f"compute floor: {len(outs)} forwards without a backward, {len(store)} W units left")


def compute_floor(
    rank: int, world: int, schedule: Any, modules: Mapping[int, Any], activation_bytes: int, steps: int
) -> tuple[list[float], list[float]]:
    """(this rank's compute step alone, each measured step; the same with every rank at once), seconds.

    Runs in a rank process whose default group holds ``world`` ranks (every rank calls it); one untimed
    step first in each phase.  A rank whose compute fails still meets every barrier and returns two empty
    lists (the floor is left out of the row; the message goes to stderr).
    """
    import torch
    import torch.distributed as dist

    from dualpipe_kernels.benchmarks.sleep_stages import sleep_batch

    actions = list(schedule.compute_actions(rank))
    x = sleep_batch(1, activation_bytes)
    grad = torch.zeros_like(x)

    failed: list[BaseException] = []

    def timed(n: int, barrier_each: bool) -> list[float]:
        """``n`` steps (after a failure: none, but every barrier still met, so no other rank waits forever)."""
        times = []
        for _ in range(n):
            if barrier_each:
                dist.barrier()
            if failed:
                continue
            t0 = time.perf_counter()
            try:
                _compute_step(actions, modules, x, grad)
            except Exception as e:  # noqa: BLE001 - the floor is optional: its fields are left empty
                failed.append(e)
                continue
            times.append(time.perf_counter() - t0)
        return times

    alone: list[float] = []
    for r in range(world):
        dist.barrier()
        if r == rank:
            alone = timed(steps + 1, False)[1:]
        dist.barrier()
    together = timed(steps + 1, True)[1:]
    for m in modules.values():
        m.zero_grad(set_to_none=True)
    if failed:
        sys.stderr.write(f"compute floor, rank {rank}: {type(failed[0]).__name__}: {failed[0]}\n")
        return [], []
    return alone, together
