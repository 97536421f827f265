"""PeerWatch: a failure published by one rank, a rank gone silent and a dead store host reach every peer.

The watches share one in-process store (``torch.distributed.HashStore``), as
the ranks of a process group share its TCPStore; each plays one rank.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from dualpipe_kernels.runtime.peer_watch import PeerFailed, PeerWatch
from dualpipe_kernels.transport.base import Handle, TransportError, TransportTimeout


class NeverDone(Handle):
    """A transfer whose peer never comes: every wait runs its whole timeout."""

    def __init__(self) -> None:
        self.calls = 0

    def wait(self, timeout: float | None = None) -> None:
        self.calls += 1
        time.sleep(timeout or 0)
        raise TransportTimeout(f"never done after {timeout} s")

    def is_completed(self) -> bool:
        return False


class Broken(Handle):
    def wait(self, timeout: float | None = None) -> None:
        raise TransportError("connection closed by peer")

    def is_completed(self) -> bool:
        return True


def _until(cond, limit_s: float = 5.0) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit_s, "condition not met in time"
        time.sleep(0.01)
    return time.monotonic() - t0


def _pair(**kw):
    store = dist.HashStore()
    return [PeerWatch(store, r, 2, key_rank=r, poll_s=0.05, **kw) for r in range(2)]


def test_a_published_failure_reaches_the_peer_within_a_second_naming_rank_and_error() -> None:
    w0, w1 = _pair()
    try:
        w1.publish(ValueError("bad batch\nsecond line"))
        took = _until(lambda: w0.failure() is not None)
        assert took < 1.0
        err = w0.failure()
        assert err is not None and err.rank == 1
        assert str(err) == "pipeline rank 0: pipeline rank 1 failed: ValueError: bad batch"
        assert w1.failure() is None  # a rank does not see its own failure as a peer's
    finally:
        w0.close()
        w1.close()


def test_a_wait_for_a_transfer_that_never_comes_ends_at_the_peer_failure_not_the_timeout() -> None:
    w0, w1 = _pair()
    try:
        w1.publish(RuntimeError("stage 3 raised"))
        t0 = time.monotonic()
        with pytest.raises(PeerFailed, match="pipeline rank 1 failed: RuntimeError: stage 3 raised"):
            w0.wait(NeverDone(), 60.0)
        assert time.monotonic() - t0 < 2.0
    finally:
        w0.close()
        w1.close()


def test_a_broken_transfer_is_blamed_on_the_rank_that_failed_first() -> None:
    w0, w1 = _pair()
    try:
        w1.publish(RuntimeError("out of memory"))
        with pytest.raises(PeerFailed, match="rank 1 failed: RuntimeError: out of memory"):
            w0.wait(Broken(), 60.0)
    finally:
        w0.close()
        w1.close()


def test_without_failures_a_wait_times_out_as_before() -> None:
    w0, w1 = _pair()
    try:
        h = NeverDone()
        with pytest.raises(TransportTimeout):
            w0.wait(h, 0.3)
        assert h.calls >= 3  # it waited in slices
        assert w0.failure() is None
    finally:
        w0.close()
        w1.close()


def test_a_rank_gone_silent_is_named_by_the_others() -> None:
    w0, w1 = _pair(liveness_s=0.5)
    try:
        w1._stop.set()  # its thread stops beating as a killed process would; it never says it closed
        w1._thread.join()
        _until(lambda: w0.failure() is not None, 10.0)
        err = w0.failure()
        assert err is not None and err.rank == 1 and "no sign of life" in str(err)
    finally:
        w0.close()


def test_a_closed_rank_is_not_a_failure() -> None:
    w0, w1 = _pair(liveness_s=0.3)
    try:
        w1.close()
        time.sleep(1.0)
        assert w0.failure() is None
    finally:
        w0.close()


class DeadStore:
    """A store whose host died after the watch was built."""

    def __init__(self) -> None:
        self.inner = dist.HashStore()
        self.dead = False

    def __getattr__(self, name: str):
        fn = getattr(self.inner, name)

        def call(*a, **k):
            if self.dead:
                raise RuntimeError("Connection reset by peer")
            return fn(*a, **k)

        return call


def test_a_store_that_stops_answering_names_its_host() -> None:
    store = DeadStore()
    w = PeerWatch(store, 1, 2, poll_s=0.05, store_host=0)
    store.dead = True
    _until(lambda: w.failure() is not None)
    err = w.failure()
    assert err is not None and err.rank == 0 and "store stopped answering" in str(err)
    w.close()


def test_bad_intervals_are_refused() -> None:
    with pytest.raises(ValueError, match="poll_s"):
        PeerWatch(dist.HashStore(), 0, 2, poll_s=1.0, liveness_s=0.5)
