"""The ceilings the ``cuda_ipc`` suite measures its engine against, and the barrier its two ranks meet on.

:class:`BarePingPong`: an interprocess-event ping-pong between the ranks, no engine, rank 1 optionally copying
from rank 0's IPC-mapped buffer (:class:`PeerBuffers`) each round: the bare hop and the bare copy.
:func:`d2d_ms`: the same burst as ``dst.copy_(src)`` within one process.  :class:`SpinBarrier`: two processes
meet on a shared-memory array (a store barrier's 10 ms polls would swamp a burst).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

__all__ = ["BarePingPong", "PeerBuffers", "SpinBarrier", "d2d_ms", "timed_ms"]


class SpinBarrier:
    """Two processes meet on a shared-memory array: each bumps its own slot and spins on the other's."""

    def __init__(self, slots: Any, rank: int, timeout_s: float) -> None:
        self.slots, self.rank, self.timeout_s, self.n = slots, rank, timeout_s, 0

    def __call__(self) -> None:
        self.n += 1
        self.slots[self.rank] = self.n
        deadline = time.monotonic() + self.timeout_s
        spins = 0
        while self.slots[1 - self.rank] < self.n:
            spins += 1
            if spins % 4096 == 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {self.rank}: peer did not reach barrier {self.n} in {self.timeout_s} s")
                time.sleep(0)


def timed_ms(fn: Any) -> float:
    """Milliseconds between two CUDA events around ``fn()`` on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


def d2d_ms(size: int, burst: int, iters: int) -> float:
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up

    def run() -> None:
        for _ in range(burst):
            dst.copy_(src)

    return statistics.median(timed_ms(run) for _ in range(iters))


class PeerBuffers:
    """Rank 0's send buffers for the bare copy rounds, shared with rank 1 through torch's CUDA IPC."""

    def __init__(self, rank: int, share: Any, timeout_s: float) -> None:
        self.rank, self.share, self.timeout_s = rank, share, timeout_s
        self.mine: dict[int, torch.Tensor] = {}

    def get(self, size: int) -> torch.Tensor:
        if self.rank == 0:
            t = torch.full((size,), 7, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            self.mine[size] = t  # alive while rank 1 maps it
            self.share.put(t)
            return t
        got: torch.Tensor = self.share.get(timeout=self.timeout_s)
        return got


class BarePingPong:
    """Interprocess-event ping-pong between the ranks; rank 1 optionally copies from rank 0's buffer each round.

    Round k: rank 0's stream records ``ping`` (after waiting for rank 1's ``pong`` of round k-1); rank 1's
    stream waits for it, copies (if asked), records ``pong``.  A host handshake per round (shared counters)
    makes each ``wait_event`` bind to the record of the same round; the hosts run ahead of the devices, so
    the CUDA-event time is the devices' round trips.
    """

    def __init__(self, rank: int, ping: Any, pong: Any, counters: Any, timeout_s: float, buffers: PeerBuffers) -> None:
        self.rank, self.ping, self.pong, self.c, self.timeout_s = rank, ping, pong, counters, timeout_s
        self.buffers = buffers
        self.round = 0

    def peer_buffer(self, size: int) -> torch.Tensor:
        """Rank 0: a fresh buffer of `size` bytes (all 7), shared; rank 1: that buffer, IPC-mapped."""
        return self.buffers.get(size)

    def _await(self, slot: int, value: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        spins = 0
        while self.c[slot] < value:
            spins += 1
            if spins % 4096 == 0 and time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: bare ping-pong: no round {value} from the peer")

    def run(self, rounds: int, src: torch.Tensor | None = None, dst: torch.Tensor | None = None) -> float:
        """Rank 1 returns the CUDA-event milliseconds of `rounds` rounds; rank 0 returns 0."""
        stream = torch.cuda.current_stream()
        start = end = None
        if self.rank == 1:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for k in range(rounds):
            r = self.round + k + 1
            if self.rank == 0:
                if r > 1:
                    self._await(1, r - 1)  # pong of the previous round recorded
                    stream.wait_event(self.pong)
                self.ping.record(stream)
                self.c[0] = r
            else:
                self._await(0, r)
                stream.wait_event(self.ping)
                if k == 0 and start is not None:
                    start.record(stream)
                if src is not None and dst is not None:
                    dst.copy_(src, non_blocking=True)
                self.pong.record(stream)
                self.c[1] = r
        self.round += rounds
        if self.rank == 0:
            self._await(1, self.round)
            stream.wait_event(self.pong)
            torch.cuda.synchronize()
            return 0.0
        assert start is not None and end is not None
        end.record(stream)
        end.synchronize()
        return float(start.elapsed_time(end))
