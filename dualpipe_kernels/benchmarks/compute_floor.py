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

__all__ = ["compute_floor", "bare_pipeline"]


def _runner(modules: Mapping[int, Any], x: Any, grad: Any, store: Any, outs: dict[tuple[int, int], Any]) -> Any:
    """``run(a)`` for a plain compute action ``a`` (an F&B pair's halves come one by one): F on a fresh leaf of
    ``x`` (as a received input), B or I seeded with ``grad`` (I's W deferred through ``store``), W."""
    import torch

    from dualpipe_kernels.schedules.ir import T_B, T_F, T_I, T_W

    def run(a: Any) -> None:
        key = (a.stage, a.microbatch)
        if a.type is T_F:
            outs[key] = modules[a.stage](x.detach().requires_grad_(True))
        elif a.type is T_B or a.type is T_I:
            with store.enabled_for(a.type is T_I):
                torch.autograd.backward([outs.pop(key)], [grad])
            if a.type is T_I:
                store.flush(key)
        elif a.type is T_W:
            store.pop(key)

    return run


def _check_done(outs: dict[tuple[int, int], Any], store: Any) -> None:
    if outs or len(store):
        raise RuntimeError(f"compute floor: {len(outs)} forwards without a backward, {len(store)} W units left")


def _compute_step(actions: list[Any], modules: Mapping[int, Any], x: Any, grad: Any) -> None:
    """The rank's compute actions once: F, B (full), I (W deferred through a bound store), W, F&B pairs."""
    from dualpipe_kernels.runtime.zero_bubble import WeightGradStore

    store = WeightGradStore()
    outs: dict[tuple[int, int], Any] = {}
    run = _runner(modules, x, grad, store, outs)
    with store.bind():
        for op in actions:
            for a in op.computes():
                run(a)
    _check_done(outs, store)


def _timed(n: int, step: Any, failed: list[BaseException], barrier_each: bool) -> list[float]:
    """``n`` calls of ``step()``, timed; ``barrier_each``: a barrier before each.  After a failure (appended to
    ``failed``; the floor's fields are optional and left empty) no more calls, but every barrier is still met,
    so no other rank waits at one forever."""
    import torch.distributed as dist

    times = []
    for _ in range(n):
        if barrier_each:
            dist.barrier()
        if failed:
            continue
        t0 = time.perf_counter()
        try:
            step()
        except Exception as e:  # noqa: BLE001 - see above
            failed.append(e)
            continue
        times.append(time.perf_counter() - t0)
    return times


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

    def step() -> None:
        _compute_step(actions, modules, x, grad)

    alone: list[float] = []
    for r in range(world):
        dist.barrier()
        if r == rank:
            alone = _timed(steps + 1, step, failed, barrier_each=False)[1:]
        dist.barrier()
    together = _timed(steps + 1, step, failed, barrier_each=True)[1:]
    for m in modules.values():
        m.zero_grad(set_to_none=True)
    if failed:
        sys.stderr.write(f"compute floor, rank {rank}: {type(failed[0]).__name__}: {failed[0]}\n")
        return [], []
    return alone, together


def bare_pipeline(
    rank: int,
    world: int,
    schedule: Any,
    modules: Mapping[int, Any],
    transport: Any,
    activation_bytes: int,
    steps: int,
    channel: int = 0,
) -> list[float]:
    """This rank's steps of ``schedule`` with no runtime: its lowered action list (the one the runtime and the
    simulator run) with the same chunks as :func:`compute_floor`, and each SEND / RECV a plain transfer of one
    activation-sized tensor over ``transport`` (preallocated: no metadata, allocation, protocol or autograd
    wiring).  Receives are posted, waited and sent where the runtime (runtime/loop.py) does it on this
    transport: posted ``transport.recv_lookahead`` computes ahead (all at the step's start where the transport
    asks for early receives) and waited by the compute half that reads them (an F&B pair's backward half after
    its forward half); a pair's forward send goes out between its halves when the list sends it right after
    the pair, every other send at its SEND.  One untimed step first.

    What a host gives a runtime whose only work is to move the bytes and wait: the chunks, the transfers'
    copies and the wake-ups of ranks waiting for each other.  Measured / this (``measured_over_bare``) is the
    runtime's own share.  Collective over the default group (every rank calls it, after its pipeline steps,
    nothing in flight).  A rank that fails meets every barrier and returns an empty list.
    """
    import torch.distributed as dist

    failed: list[BaseException] = []
    step: Any = None
    try:
        step = _bare_step(rank, schedule, modules, transport, activation_bytes, channel)
    except Exception as e:  # noqa: BLE001 - optional fields; the barriers below are still met
        failed.append(e)
    times = _timed(steps + 1, step, failed, barrier_each=True)[1:]  # (a peer waiting on a failed rank times out)
    for m in modules.values():
        m.zero_grad(set_to_none=True)
    dist.barrier()
    if failed:
        sys.stderr.write(f"bare pipeline, rank {rank}: {type(failed[0]).__name__}: {failed[0]}\n")
        return []
    return times


def _bare_step(
    rank: int, schedule: Any, modules: Mapping[int, Any], transport: Any, activation_bytes: int, channel: int = 0
) -> Any:
    """One step of :func:`bare_pipeline` as a function of no arguments (everything worked out once here)."""
    import torch

    from dualpipe_kernels.benchmarks.sleep_stages import sleep_batch
    from dualpipe_kernels.runtime.boundary.header import TagSpace
    from dualpipe_kernels.runtime.executor import _lowered_program
    from dualpipe_kernels.runtime.loop import ActionLoop
    from dualpipe_kernels.runtime.zero_bubble import WeightGradStore
    from dualpipe_kernels.schedules.ir import T_F, T_RECV_F, T_SEND_B, T_SEND_F

    program = _lowered_program(schedule)
    actions = program.schedule.actions[rank]
    loop = ActionLoop(actions, transport.recv_lookahead, transport.early_small_receives)  # its posting plan
    tags = TagSpace(schedule.num_stages, schedule.num_microbatches, channel=channel)  # a pipeline's block of tags
    x = sleep_batch(1, activation_bytes)
    grad, out = torch.zeros_like(x), torch.zeros_like(x)
    sends_at: dict[int, tuple[int, int]] = {}  # SEND index -> (peer, tag)
    recvs_at: dict[int, tuple[int, int, Any, Any]] = {}  # RECV index -> (peer, tag, key of its reader, buffer)
    for i, a in enumerate(actions):
        if a.type in (T_SEND_F, T_SEND_B):
            key, peer = program.sends[rank][i][0]
            sends_at[i] = (peer, tags.tag(*program.tag_key(key), 0))
        elif not a.is_compute:
            key = program.remote[rank][i][0]
            reader = (a.type is T_RECV_F, a.stage, a.microbatch)
            recvs_at[i] = (program.topo.key_rank(key), tags.tag(*program.tag_key(key), 0), reader, x.clone())
    timeout = transport.timeout_s

    def step() -> None:
        store = WeightGradStore()
        outs: dict[tuple[int, int], Any] = {}
        run = _runner(modules, x, grad, store, outs)
        posted: dict[int, Any] = {}  # RECV index -> handle
        readers: dict[Any, int] = {}  # reader key -> RECV index, once the list reached the RECV
        sends: list[Any] = []
        sent_early: set[int] = set()

        def post(j: int) -> None:
            if j not in posted:
                peer, tag, _, buf = recvs_at[j]
                posted[j] = transport.irecv(buf, peer, tag, f"bare pipeline: {actions[j]}")

        def send(j: int) -> None:
            peer, tag = sends_at[j]
            sends.append(transport.isend(out, peer, tag, f"bare pipeline: {actions[j]}"))

        if loop.early_small:
            for j in loop.recvs:
                post(j)
        with store.bind():
            for i, op in enumerate(actions):
                for j in loop.posts[i]:
                    post(j)
                if i in recvs_at:
                    post(i)
                    readers[recvs_at[i][2]] = i
                    continue
                if i in sends_at:
                    if i not in sent_early:
                        send(i)
                    continue
                halves = op.computes()
                for n, a in enumerate(halves):
                    r = readers.pop((a.type is T_F, a.stage, a.microbatch), -1)
                    if r >= 0:
                        posted.pop(r).wait(timeout)
                    run(a)
                    if n == 0 and len(halves) == 2 and i in loop.early_send:
                        send(loop.early_send[i])
                        sent_early.add(loop.early_send[i])
        _check_done(outs, store)
        if posted or readers:
            raise RuntimeError(f"bare pipeline: {len(posted)} receives no compute read")
        for h in sends:
            h.wait(timeout)

    return step
