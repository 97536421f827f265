"""Waiter threads for gloo transfers: completion of a posted transfer as an event that can be polled.

gloo's send/recv work objects report completion only from ``wait()``
(``is_completed()`` stays False until then), and a gloo wait that times out
closes the connection.  :class:`WaiterPool` keeps daemon threads blocked in
``work.wait`` (in C++, the GIL released), one per work in flight, and turns
each completion into a :class:`Completion`: an event, the error the wait
raised, and callbacks run on the waiter thread once it is set.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from dualpipe_kernels.transport.base import TransportError

__all__ = ["Completion", "WaiterPool"]

_MAX_WAITERS = 1024


class Completion:
    """Set by a waiter thread when its work finished (``error`` holds what the wait raised).

    ``callbacks`` run on the waiter thread right after completion (or at once
    when added after it), with the error or None.
    """

    __slots__ = ("event", "error", "callbacks", "lock")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None
        self.callbacks: list[Callable[[BaseException | None], None]] = []
        self.lock = threading.Lock()

    def finish(self, error: BaseException | None) -> None:
        with self.lock:
            self.error = error
            self.event.set()
            callbacks, self.callbacks = self.callbacks, []
        for cb in callbacks:
            cb(error)

    def add_callback(self, cb: Callable[[BaseException | None], None]) -> None:
        with self.lock:
            if not self.event.is_set():
                self.callbacks.append(cb)
                return
        cb(self.error)


class WaiterPool:
    """Daemon threads that block in ``work.wait`` so completion can be polled (they never delay process exit)."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout = timedelta(seconds=timeout_s)
        self._tasks: queue.SimpleQueue[tuple[dist.Work, Completion] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads not blocked in a wait
        self._queued = 0  # works submitted but not yet taken by a thread

    def submit(self, work: dist.Work) -> Completion:
        done = Completion()
        with self._lock:
            # Every queued work needs its own free thread: a work queued behind a
            # blocked one would never be seen complete (and its waiter would hang).
            self._queued += 1
            if self._idle < self._queued:
                if len(self._threads) >= _MAX_WAITERS:
                    raise TransportError(f"more than {_MAX_WAITERS} transfers in flight on one transport")
                t = threading.Thread(target=self._loop, name="dpk-torchdist-waiter", daemon=True)
                self._threads.append(t)
                self._idle += 1
                t.start()
        self._tasks.put((work, done))
        return done

    def _loop(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            with self._lock:
                self._queued -= 1
                self._idle -= 1
            work, done = task
            error: BaseException | None = None
            try:
                work.wait(self._timeout)
            except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits on the handle
                error = exc
            del work, task
            # Idle again before the completion's callbacks settle the handle: close() reads "nothing in
            # flight" and then "no waiter busy", so a thread counted busy after its transfer settled would
            # make it cancel a finished step (closing the group's pairs under the next collective).
            with self._lock:
                self._idle += 1
            try:
                done.finish(error)
            except BaseException:  # noqa: BLE001 - a callback's failure is its owner's to report
                pass

    def busy(self) -> int:
        """Threads blocked in a wait now (or about to be)."""
        with self._lock:
            return len(self._threads) - self._idle + self._queued

    def close(self, join_s: float) -> None:
        """Stop every thread; wait up to ``join_s`` in all for those still inside a wait to return."""
        with self._lock:
            threads = list(self._threads)
        for _ in threads:
            self._tasks.put(None)
        deadline = time.monotonic() + join_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
