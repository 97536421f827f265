"""Rank functions of tests/process/test_fail_all.py (module level: spawned ranks import them by name), and the
counting wrapper the unit tests share: how many ``is_completed`` probes a wait costs."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dualpipe_kernels.runtime.peer_watch import PeerFailed, PeerWatch, WatchedTransport
from dualpipe_kernels.transport.base import Handle, Transport, group_store

_DONE = "dpk-test/fail_all/done"
BLOCK_S = 60.0  # the blocked wait's own timeout: a failure that reached it only through this would take a minute


class CountingHandle(Handle):
    """A handle that counts the ``is_completed`` probes made on it (into its transport's ``probes``)."""

    def __init__(self, inner: Handle, owner: CountingTransport) -> None:
        self._inner, self._owner = inner, owner

    def wait(self, timeout: float | None = None) -> None:
        self._inner.wait(timeout)

    def is_completed(self) -> bool:
        self._owner.probes += 1
        return self._inner.is_completed()


class CountingTransport(Transport):
    """``inner`` with its handles counted (see :class:`CountingHandle`); fail_all is the inner one's."""

    name = "counting"

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner.timeout_s)
        self.inner = inner
        self.probes = 0

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def fails_waits(self) -> bool:
        return self.inner.fails_waits

    def fail_all(self, error: BaseException) -> None:
        self.inner.fail_all(error)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        return CountingHandle(self.inner.isend(tensor, peer, tag, what), self)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        return CountingHandle(self.inner.irecv(tensor, peer, tag, what), self)


def seen_at(watch: PeerWatch) -> tuple[list[float], threading.Thread]:
    """A list that gets the time (monotonic) at which ``watch`` first holds a failure (looked at every ms by
    the thread returned with it: join it before reading)."""
    out: list[float] = []

    def look() -> None:
        deadline = time.monotonic() + BLOCK_S
        while watch.failure() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        out.append(time.monotonic())

    thread = threading.Thread(target=look, daemon=True)
    thread.start()
    return out, thread


def _transport(kind: str) -> Transport:
    if kind in ("native", "native-raw"):
        from dualpipe_kernels.transport.native import NativeTransport

        return NativeTransport(timeout_s=30.0)
    from dualpipe_kernels.transport.torch_dist import TorchDistTransport

    return TorchDistTransport(timeout_s=30.0)


def blocked_wait_meets_a_failure(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Ranks 0 and 1 exchange 40 messages through a watched transport (probes counted), then rank 0 blocks in a
    receive rank 1 never sends while rank 1 publishes a failure; rank 0 reports how long after its watch saw the
    failure its wait ended, and what a post after it raised.

    ``native-raw``: the blocked receive is a bare engine request (``irecv_raw`` / ``wait_raw``, how the runtime
    posts its repeated small receives) on a watch over the native transport itself; before the failure rank 0
    also times out such a receive (``raw_timeout``: the error), and after the transport is closed neither rank
    posts one (``raw_after_close``)."""
    base = _transport(kind)
    counting = CountingTransport(base)
    watch = PeerWatch(group_store(None), rank, world, key_rank=rank, poll_s=0.05, liveness_s=30.0)
    wire = WatchedTransport(counting, watch)
    peer = 1 - rank
    out: dict[str, Any] = {"fails_waits": base.fails_waits}
    try:
        for i in range(20):
            got = torch.empty(256)
            recv = wire.irecv(got, peer, i)
            send = wire.isend(torch.full((256,), float(10 * rank + i)), peer, i)
            send.wait(10.0)
            recv.wait(10.0)
            assert got[0].item() == 10 * peer + i
        out["probes"] = counting.probes
        dist.barrier()
        if rank == 1:
            time.sleep(0.5)  # rank 0 is blocked by now
            watch.publish(RuntimeError("stage 1 failed on purpose"))
            # alive until rank 0 is done (through the store: rank 0's fail_all closes the group's gloo pairs)
            group_store(None).wait([_DONE], timedelta(seconds=BLOCK_S))
            return out
        raw = WatchedTransport(base, watch) if kind == "native-raw" else None
        if raw is not None:
            req = raw.irecv_raw(torch.empty(8, dtype=torch.uint8), peer, 998, "a receive never sent")
            try:
                raw.wait_raw(req, 0.2)
                out["raw_timeout"] = None
            except Exception as exc:  # noqa: BLE001 - reported, the test names it
                out["raw_timeout"] = f"{type(exc).__name__}: {exc}"
        seen, looking = seen_at(watch)
        t0 = time.monotonic()
        try:
            if raw is not None:
                raw.wait_raw(raw.irecv_raw(torch.empty(16, dtype=torch.uint8), peer, 999, "blocked"), BLOCK_S)
            else:
                wire.irecv(torch.empty(16), peer, 999).wait(BLOCK_S)
            out["error"] = None
        except PeerFailed as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - reported, the test names it
            out["error"] = f"{type(exc).__name__} (not PeerFailed): {exc}"
        ended = time.monotonic()
        out["waited_s"] = ended - t0
        looking.join(5.0)
        out["after_seen_s"] = ended - seen[0] if seen else None
        try:
            wire.isend(torch.zeros(4), peer, 1000)
            out["later_post"] = None
        except PeerFailed as exc:
            out["later_post"] = f"{type(exc).__name__}: {exc}"
        return out
    finally:
        if rank == 0:
            group_store(None).set(_DONE, "1")
        watch.close()
        base.close()
        if kind == "native-raw":  # a closed transport posts no bare request
            out["raw_after_close"] = base.irecv_raw(torch.empty(8, dtype=torch.uint8), peer, 997)  # type: ignore[attr-defined]
