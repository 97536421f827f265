"""Where offloaded activations live: a host arena, a side stream, and one entry per offloaded storage.

On a GPU the arena is pinned and copies run on a side stream ordered by
events (the compute stream never waits on the host).  On CPU the same code
runs with an accounting arena: the offload copies into it on a worker thread
(the CPU's side stream: the compute thread goes on, and waits for a copy only
when the backward reads it; one forward's copies go to the worker as one job
when the forward ends, so a chunk that saves twenty tensors costs one thread
hand-off, not twenty), a reload only marks the bytes resident again and
the backward reads the arena (valid until the next step's reset), so the
offload/reload scheduling and the resident-byte accounting are tested without
a GPU.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HostArena", "SideStream", "Offloaded", "storage_ptr", "storage_bytes"]

_ALIGN = 64


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


class HostArena:
    """One host buffer for a step's offloaded bytes: a bump allocator, reset per step.

    The first step (size unknown) uses one-off buffers and measures what it
    needed; the next reset allocates the arena once with that size.  A later
    step that needs more grows it (``allocations`` counts every allocation).
    The arena owns its buffer; slices handed out are valid until the next reset.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buffer: torch.Tensor | None = None
        self.offset = 0
        self.needed = 0
        self.allocations = 0

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def reset(self) -> None:
        if self.needed > self.capacity:
            self.buffer = torch.empty(self.needed, dtype=torch.uint8, pin_memory=self.pin)
            self.allocations += 1
        self.offset = 0
        self.needed = 0

    def alloc(self, nbytes: int) -> torch.Tensor:
        start = -(-self.offset // _ALIGN) * _ALIGN
        end = start + nbytes
        self.offset = self.needed = end
        if end <= self.capacity:
            return self.buffer[start:end]  # type: ignore[index]
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)


#: seconds a backward waits for a CPU offload copy before it names the failure
COPY_TIMEOUT_S = 120.0


class SideStream:
    """The copy stream of a CUDA device, or on CPU one worker thread that runs copies in order
    (both created on first use; the thread ends when this object is collected)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._last: Future[Any] | None = None
        self._batch: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._batch_done: Future[Any] | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Future[Any]:
        """``dst.copy_(src)`` on the worker thread, in the batch that :meth:`flush` hands over (the batch holds
        ``src`` until it has run); the returned future is the batch's: done once every copy in it is."""
        self._batch.append((dst, src))
        if self._batch_done is None:
            self._batch_done = Future()
        return self._batch_done

    def flush(self) -> None:
        """Hand the copies batched so far to the worker thread, as one job (they run in order)."""
        if not self._batch:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dualpipe-offload")
            weakref.finalize(self, self._pool.shutdown, wait=False)
        batch, done = self._batch, self._batch_done
        self._batch, self._batch_done = [], None
        assert done is not None
        self._pool.submit(_copy_all, batch, done)
        self._last = done

    def drain(self) -> None:
        """Wait for every copy started so far (they run in order: the last one is enough)."""
        self.flush()
        if self._last is not None:
            wait_copy(self._last, "a previous step's offload copy")
            self._last = None


def _copy_all(batch: list[tuple[torch.Tensor, torch.Tensor]], done: Future[Any]) -> None:
    """The worker's job: every ``dst.copy_(src)`` of one batch, then ``done`` (its result, or the error)."""
    try:
        for dst, src in batch:
            dst.copy_(src)
    except BaseException as exc:  # noqa: BLE001 - the waiter re-raises it
        done.set_exception(exc)
    else:
        done.set_result(None)


def wait_copy(job: Future[Any], what: str) -> None:
    try:
        job.result(timeout=COPY_TIMEOUT_S)
    except TimeoutError as exc:
        raise TimeoutError(f"offload: {what} did not finish within {COPY_TIMEOUT_S} s (worker thread stuck?)") from exc


@dataclass
class Offloaded:
    """One offloaded storage: ``host`` (arena slice), ``source`` (device storage, until the
    forward ends), ``device`` (reloaded bytes, from the reload until the record's release)."""

    nbytes: int
    host: torch.Tensor
    source: torch.Tensor | None
    device: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    copying: Future[Any] | None = None  # CPU: the device->host copy on the worker thread

    @classmethod
    def start(cls, t: torch.Tensor, arena: HostArena, side: SideStream) -> Offloaded:
        """Start the device->host copy of ``t``'s whole storage (views of it share the entry)."""
        src = _bytes_of(t.untyped_storage(), t.device)
        host = arena.alloc(src.numel())
        event = copying = None
        if side.cuda and t.device.type == "cuda":
            s = side.stream()
            s.wait_stream(torch.cuda.current_stream(t.device))  # the forward made t on the compute stream
            with torch.cuda.stream(s):
                host.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(s)
            src.record_stream(s)  # the allocator keeps the source until the copy is done
        else:
            copying = side.copy(host, src)
        return cls(src.numel(), host, src, event=event, copying=copying)

    def release_source(self, side: SideStream) -> bool:
        """Drop the device source (end of the forward); True if it was held."""
        held = self.source is not None
        self.source = None
        return held

    def start_reload(self, side: SideStream, device: torch.device) -> bool:
        """Start the host->device copy; True if it started now (False: already reloaded or never left)."""
        if self.device is not None or self.source is not None:
            return False
        if side.cuda:
            buf = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
            s = side.stream()
            s.wait_stream(torch.cuda.current_stream(device))  # buf's memory may still be in use there
            with torch.cuda.stream(s):
                buf.copy_(self.host, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(s)
            buf.record_stream(s)
        else:
            # CPU: the arena is already in the memory the tensors are read from, so the "reload" is
            # the accounting alone (the bytes count as resident again), not a second host copy.
            buf = self.host
        self.device = buf
        return True

    def view(self, dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> torch.Tensor:
        """The saved tensor, as a view of the resident bytes (the source, or the reloaded copy)."""
        flat = self.source if self.source is not None else self.device
        if flat is None:
            raise RuntimeError("offloaded activation read before its reload was started (or after its release)")
        if self.source is None and self.event is not None:
            torch.cuda.current_stream(flat.device).wait_event(self.event)
        if self.source is None and self.copying is not None:
            wait_copy(self.copying, f"the copy of {self.nbytes} offloaded bytes")
            self.copying = None
        # ``flat`` may be a slice of the arena: its start (in bytes, 64-aligned) shifts the view's offset.
        start = flat.storage_offset() // dtype.itemsize + offset
        return torch.empty(0, dtype=dtype, device=flat.device).set_(flat.untyped_storage(), start, size, stride)
