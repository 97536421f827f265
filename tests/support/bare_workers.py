"""Rank function for tests/process/test_bench_bare.py (module level: spawned ranks import it; tests/ is on sys.path)."""

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
    """The events of a real pipeline's fourth step (every message a repeat by then: one transfer on its slot-0
    tag, as the bare pipeline's) and of two bare-pipeline steps, on the same recording transport and chunks."""
    from dualpipe_kernels.benchmarks.compute_floor import bare_pipeline
    from dualpipe_kernels.benchmarks.sleep_stages import sleep_batch, sleep_criterion
    from dualpipe_kernels.runtime import Pipeline
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.schedules.ir import T_PAIR
    from dualpipe_kernels.transport.torch_dist import TorchDistTransport

    sched = build_schedule("dualpipev", world, microbatches)
    log: list[tuple[Any, ...]] = []
    modules = {s: LoggedStage(s, log) for s in sched.stages_of_rank(rank)}
    inner = TorchDistTransport(timeout_s=30.0)
    transport = Recording(inner, log)
    pipe = Pipeline(sched, modules, transport=transport, timeout_s=30.0)
    x = sleep_batch(microbatches, 4096)
    try:
        for _ in range(4):
            log.clear()
            pipe.step(x, labels=(torch.zeros(x.shape[0]),), criterion=sleep_criterion)
        runtime = list(log)
        pairs = sum(a.type is T_PAIR for a in pipe._loop.actions)
        channel = pipe.channel  # the pipeline's block of tags on its group
    finally:
        pipe.close()
    log.clear()
    times = bare_pipeline(rank, world, sched, modules, transport, 4096, 1, channel=channel)
    inner.close()
    return {"times": times, "bare": log, "runtime": runtime, "pairs": pairs}
