"""Rank function for tests/test_bench_bare.py (module level: spawned ranks import it; tests/ is on sys.path)."""

from __future__ import annotations

from typing import Any

import torch

from dualpipe_kernels.benchmarks.sleep_stages import SleepStage
from dualpipe_kernels.transport.base import Handle, Transport


class _Logged(Handle):
    def __init__(self, inner: Handle, log: list[tuple[Any, ...]], tag: int) -> None:
        self.inner, self.log, self.tag = inner, log, tag

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def wait(self, timeout_s: float | None = None) -> None:
        self.inner.wait(timeout_s)
        self.log.append(("wait", self.tag))


class Recording(Transport):
    """Forwards to ``inner``, logging each send post (``("send", tag)``) and each receive's wait."""

    name = "recording"

    def __init__(self, inner: Transport, log: list[tuple[Any, ...]]) -> None:
        super().__init__(inner.timeout_s)
        self.inner, self.log = inner, log

    @property
    def rank(self) -> int:
        return self.inner.rank

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        self.log.append(("send", tag))
        return self.inner.isend(tensor, peer, tag, what)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        self.log.append(("post", tag))
        return _Logged(self.inner.irecv(tensor, peer, tag, what), self.log, tag)


class LoggedStage(SleepStage):
    """A sleep chunk (no sleeps) that logs its forward: ``("F", stage)``."""

    def __init__(self, stage: int, log: list[tuple[Any, ...]]) -> None:
        super().__init__(0.0, 0.0, 0.0)
        self.stage, self.log = stage, log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(("F", self.stage))
        return super().forward(x)


def bare_run(rank: int, world: int, microbatches: int) -> dict[str, Any]:
    """Two bare-pipeline steps of DualPipeV: the events of each, the timed step, and the events the runtime's
    rules give for this rank's lowered list (the spec, worked out here independently)."""
    from dualpipe_kernels.benchmarks.compute_floor import bare_pipeline
    from dualpipe_kernels.runtime.executor import _lowered_program
    from dualpipe_kernels.runtime.p2p import TagSpace
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.schedules.ir import T_F, T_PAIR, T_RECV_B, T_RECV_F, T_SEND_B, T_SEND_F

    sched = build_schedule("dualpipev", world, microbatches)
    log: list[tuple[Any, ...]] = []
    modules = {s: LoggedStage(s, log) for s in sched.stages_of_rank(rank)}
    transport = Recording(TorchDistTransport_(), log)
    times = bare_pipeline(rank, world, sched, modules, transport, 4096, 1)

    program = _lowered_program(sched)
    tags = TagSpace(sched.num_stages, microbatches)
    actions = program.schedule.actions[rank]

    def tag(i: int) -> int:
        a = actions[i]
        key = program.sends[rank][i][0][0] if a.type in (T_SEND_F, T_SEND_B) else program.remote[rank][i][0]
        return tags.tag(*program.tag_key(key), 0)

    # The rules: a receive is posted at its RECV and waited right before the compute half that reads it; an
    # F&B pair's forward send goes out between its halves when the list has that SEND_F right after the pair
    # (before the next compute); every other send at its SEND.
    expected: list[tuple[Any, ...]] = []
    posted: dict[tuple[bool, int, int], int] = {}
    early: set[int] = set()
    for i, a in enumerate(actions):
        if a.type in (T_RECV_F, T_RECV_B):
            posted[(a.type is T_RECV_F, a.stage, a.microbatch)] = tag(i)
            expected.append(("post", tag(i)))
        elif a.type in (T_SEND_F, T_SEND_B):
            if i not in early:
                expected.append(("send", tag(i)))
        else:
            halves = a.computes()
            for n, h in enumerate(halves):
                t = posted.pop((h.type is T_F, h.stage, h.microbatch), None)
                if t is not None:
                    expected.append(("wait", t))
                if h.type is T_F:
                    expected.append(("F", h.stage))
                if n == 0 and a.type is T_PAIR:
                    j = next((k for k in range(i + 1, len(actions)) if actions[k].is_compute), len(actions))
                    for k in range(i + 1, j):
                        b = actions[k]
                        if b.type is T_SEND_F and (b.stage, b.microbatch) == (h.stage, h.microbatch):
                            expected.append(("send", tag(k)))
                            early.add(k)
    transport.inner.close()
    return {"times": times, "log": log, "expected": expected, "pairs": sum(a.type is T_PAIR for a in actions)}


def TorchDistTransport_() -> Transport:  # noqa: N802 - a factory named for what it builds
    from dualpipe_kernels.transport.torch_dist import TorchDistTransport

    return TorchDistTransport(timeout_s=30.0)
