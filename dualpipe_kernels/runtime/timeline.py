"""Measured timeline of one pipeline step.

Each executed action becomes ``(pipeline rank, action string, start_s, end_s)``
with times in seconds (``time.perf_counter``) relative to the start of the
step: compute actions span their compute, ``RECV_*`` actions span the wait for
the data, ``SEND_*`` actions span posting the send.  This is the shape that
``dualpipe_kernels.schedules.trace`` turns into a chrome trace and that can be
laid over the simulator's timeline.  A recorder lives for one step only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["TimelineEntry", "TimelineRecorder"]

TimelineEntry = tuple[int, str, float, float]


class TimelineRecorder:
    """Collects entries for one step; a disabled recorder costs one attribute test per action."""

    def __init__(self, rank: int, enabled: bool) -> None:
        self.rank = rank
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.entries: list[TimelineEntry] = []

    @contextmanager
    def span(self, label: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter() - self.t0
        try:
            yield
        finally:
            self.entries.append((self.rank, label, start, time.perf_counter() - self.t0))

    def add(self, label: str, start_abs: float, end_abs: float) -> None:
        """Record a span measured with absolute ``perf_counter`` values."""
        if self.enabled:
            self.entries.append((self.rank, label, start_abs - self.t0, end_abs - self.t0))
