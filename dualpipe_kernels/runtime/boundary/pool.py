"""Host receive buffers reused across steps (small boundary messages: runtime/boundary/inline.py)."""

from __future__ import annotations

import torch

__all__ = ["BufferPool"]


class BufferPool:
    """Host uint8 buffers by size, reused across steps (inline receive buffers).

    ``take(n)`` returns a free buffer of ``n`` bytes or a new one; ``give``
    returns it.  At most ``max_per_size`` free buffers are kept per size (the
    receives in flight at once are bounded by the receive window); ``clear``
    drops them all (``Pipeline.close``).  ``allocations``: buffers ever made.
    """

    def __init__(self, max_per_size: int = 64) -> None:
        self.max_per_size = max_per_size
        self.allocations = 0
        #: the free buffers by size (a repeated message's receive takes and gives one inline: no call)
        self.free: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        free = self.free.get(nbytes)
        if free:
            return free.pop()
        self.allocations += 1
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu")

    def give(self, buf: torch.Tensor) -> None:
        free = self.free.setdefault(buf.numel(), [])
        if len(free) < self.max_per_size:
            free.append(buf)

    def free_bytes(self) -> int:
        return sum(b.numel() for bufs in self.free.values() for b in bufs)

    def clear(self) -> None:
        self.free.clear()
