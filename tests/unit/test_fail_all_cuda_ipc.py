"""CudaIpcTransport.fail_all, its Python logic over a fake engine (no GPU here): a wait blocked in the engine
ends within 1 s of the pipeline's watch seeing a peer's failure, raising that failure; later posts raise it
too; a watched wait makes no ``is_completed`` probe.  (The engine's own fail_all runs under ctest:
csrc/tests/test_fail_all.cpp.)"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from fail_all_workers import CountingTransport, seen_at

from dualpipe_kernels.runtime.peer_watch import PeerFailed, PeerWatch, WatchedTransport
from dualpipe_kernels.transport.base import TransportError
from dualpipe_kernels.transport.cuda_ipc import CudaIpcTransport


class FakeOp:
    """An op of the fake engine: done when ``finish`` is called, failed by the engine's fail_all."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._state: str | None = None  # None, "done" or the failure's text

    def settle(self, state: str) -> None:
        with self._cv:
            if self._state is None:
                self._state = state
            self._cv.notify_all()

    def wait(self, timeout_s: float) -> bool:
        with self._cv:
            self._cv.wait_for(lambda: self._state is not None, timeout_s)
            if self._state is None:
                return False
            if self._state != "done":
                raise RuntimeError(self._state)
            return True

    def query(self) -> bool:
        return self._state is not None

    def describe(self) -> str:
        return "fake op"


class FakeEngine:
    """The calls CudaIpcTransport makes of ``_C.cuda.IpcEngine`` on its message path, and fail_all as the C++
    engine does it: every unfinished op fails with the message, and so does every later post."""

    def __init__(self) -> None:
        self.ops: list[FakeOp] = []
        self.failure: str | None = None

    def _post(self) -> FakeOp:
        if self.failure is not None:
            raise RuntimeError(self.failure)
        op = FakeOp()
        self.ops.append(op)
        return op

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> FakeOp:
        return self._post()

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> FakeOp:
        return self._post()

    def fail_all(self, message: str) -> None:
        self.failure = message
        for op in self.ops:
            op.settle(message)

    def channel_status(self, peer: int, outgoing: bool) -> str:
        return "fake channel"

    def close(self, timeout_s: float) -> None:
        self.fail_all("closed")


def _transport() -> tuple[CudaIpcTransport, FakeEngine]:
    t = CudaIpcTransport.__new__(CudaIpcTransport)  # no GPU: the fields __init__ sets, the engine a fake
    engine = FakeEngine()
    t.timeout_s, t._rank, t._peers, t._engine, t._failure = 30.0, 0, frozenset({1}), engine, None
    return t, engine


def test_a_wait_blocked_in_the_engine_ends_at_the_watch_failure_and_raises_it() -> None:
    store = dist.HashStore()
    w0, w1 = (PeerWatch(store, r, 2, key_rank=r, poll_s=0.05) for r in range(2))
    t, engine = _transport()
    counting = CountingTransport(t)
    wire = WatchedTransport(counting, w0)
    try:
        assert t.fails_waits
        for _ in range(10):  # the fast path: plain waits
            h = wire.irecv(torch.empty(4), 1, 3)
            engine.ops[-1].settle("done")
            h.wait(5.0)
        assert counting.probes == 0
        blocked = wire.irecv(torch.empty(4), 1, 4)
        seen, looking = seen_at(w0)
        threading.Timer(0.3, w1.publish, (RuntimeError("out of memory"),)).start()
        t0 = time.monotonic()
        with pytest.raises(PeerFailed, match="pipeline rank 0: pipeline rank 1 failed: RuntimeError: out of memory"):
            blocked.wait(60.0)
        ended = time.monotonic()
        looking.join(5.0)
        assert ended - seen[0] < 1.0 and ended - t0 < 5.0
        assert engine.failure is not None and "pipeline rank 1 failed" in engine.failure
        with pytest.raises(PeerFailed):
            wire.isend(torch.empty(4), 1, 5)
        assert counting.probes == 0
    finally:
        w0.close()
        w1.close()


def test_without_fail_all_a_failed_op_is_a_transport_error_naming_the_transfer() -> None:
    t, engine = _transport()
    h = t.irecv(torch.empty(4), 1, 7, "1RECV_F0")
    engine.ops[-1].settle("peer 1 died")
    with pytest.raises(TransportError, match=r"receive from peer rank 1 \(tag 7, 1RECV_F0\) failed: peer 1 died"):
        h.wait(1.0)
    assert t.failure is None


def test_fail_all_twice_keeps_the_first_error() -> None:
    t, engine = _transport()
    first, second = RuntimeError("first"), RuntimeError("second")
    t.fail_all(first)
    t.fail_all(second)
    assert t.failure is first and engine.failure == "first"
    with pytest.raises(RuntimeError, match="first"):
        t.isend(torch.empty(4), 1, 0)
