"""Where offloaded activations live: a host arena, two copy lanes, and one group per offloading forward.

:class:`OffloadGroup` holds the storages one forward saved that its policy
offloads.  When the forward ends, all of them go to the arena through **one**
``kernels.pack`` launch (cast to bf16 or fp8 on the way under ``offload:bf16`` /
``offload:fp8``), and before the backward they come back through **one**
``kernels.unpack`` launch into fresh device tensors; views of one storage and a
tensor saved twice share the storage's copy.

:class:`CopyLanes` runs that work off the compute stream, on two lanes ordered by
events: ``offload`` (packs) and ``reload`` (unpacks), so a reload the backward
waits for never queues behind the next forward's offloads.  No ``record_stream``:
every tensor a lane reads or writes was allocated on the compute stream and is
held by its group until the lane's event has fired (sources, staging buffers) or
until the compute stream waits on that event (reloaded tensors); arena slices
belong to the pipeline's arena (valid until the next step's reset, which first
drains both lanes).

* CUDA: the lanes are two side streams; ``staging`` packs into a device buffer
  then makes one D2H copy into the pinned arena, ``mapped`` packs straight into
  the pinned arena through its device mapping (unified addressing); reloads
  mirror them (H2D copy then unpack, or unpack straight from the arena).
* CPU: the lanes are two worker threads (a job waits for the events it is
  ordered after, then runs; the events are futures), or inline (``threaded=False``:
  each job runs at once, every event has fired).  The arena is host memory either
  way, so a pack writes into it directly.  Where a GPU polls an event, the CPU
  waits for it (``wait_to_settle``), so the accounting is deterministic; tests turn
  that off to exercise the polling order without a GPU.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from dualpipe_kernels import kernels

__all__ = ["CopyLanes", "HostArena", "OffloadGroup", "LANES", "storage_ptr", "storage_bytes"]

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


#: seconds a wait for a copy lane's job lasts before it names the failure
COPY_TIMEOUT_S = 120.0
#: the two copy lanes
LANES = ("offload", "reload")

Event = Any  # torch.cuda.Event on a GPU, a Future on CPU


def wait_copy(job: Future[Any], what: str) -> None:
    try:
        job.result(timeout=COPY_TIMEOUT_S)
    except TimeoutError as exc:
        raise TimeoutError(f"offload: {what} did not finish within {COPY_TIMEOUT_S} s (worker thread stuck?)") from exc


def _done_future() -> Future[Any]:
    f: Future[Any] = Future()
    f.set_result(None)
    return f


def _run_after(after: Sequence[Future[Any]], work: Callable[[], None]) -> None:
    for e in after:
        wait_copy(e, "an earlier copy this one is ordered after")
    work()


class CopyLanes:
    """Two side lanes of one device, ``offload`` and ``reload`` (see the module docstring).

    :meth:`submit` queues work on a lane after the compute stream's work so far and
    the given events and returns the lane's event for it; :meth:`fired` tells
    whether an event has fired (a GPU polls; a CPU with ``wait_to_settle`` waits);
    :meth:`wait` orders the compute stream after an event; :meth:`drain` waits
    for everything queued.  ``log`` (when a list) gets ``(what, lane)`` per call,
    for tests of the order.
    """

    def __init__(self, device: torch.device, threaded: bool = True, wait_to_settle: bool | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.threaded = threaded
        self.wait_to_settle = (not self.cuda) if wait_to_settle is None else wait_to_settle
        self._streams: dict[str, Any] = {}
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._last: dict[str, Event] = {}
        self.log: list[tuple[str, str]] | None = None

    def _note(self, what: str, lane: str) -> None:
        if self.log is not None:
            self.log.append((what, lane))

    def _stream(self, lane: str) -> Any:
        if lane not in self._streams:
            self._streams[lane] = torch.cuda.Stream(self.device)
        return self._streams[lane]

    def _pool(self, lane: str) -> ThreadPoolExecutor:
        if lane not in self._pools:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dualpipe-{lane}")
            weakref.finalize(self, pool.shutdown, wait=False)
            self._pools[lane] = pool
        return self._pools[lane]

    def submit(self, lane: str, work: Callable[[], None], after: Sequence[Event] = ()) -> Event:
        """Run ``work`` on ``lane`` once the compute stream's work so far and every event in ``after`` are done."""
        if lane not in LANES:
            raise ValueError(f"copy lanes: unknown lane {lane!r}; expected one of {LANES}")
        self._note("submit", lane)
        if self.cuda:
            s = self._stream(lane)
            s.wait_stream(torch.cuda.current_stream(self.device))  # inputs made, outputs allocated there
            for e in after:
                s.wait_event(e)
            with torch.cuda.stream(s):
                work()
                ev: Event = torch.cuda.Event()
                ev.record(s)
        elif self.threaded:
            ev = self._pool(lane).submit(_run_after, list(after), work)
        else:
            for e in after:
                wait_copy(e, "an earlier copy this one is ordered after")
            work()
            ev = _done_future()
        self._last[lane] = ev
        return ev

    def fired(self, ev: Event) -> bool:
        """Has ``ev`` fired?  (A GPU polls; a CPU with ``wait_to_settle`` waits for it.)"""
        if self.cuda:
            return bool(ev.query())
        if self.wait_to_settle or ev.done():
            wait_copy(ev, "an offload copy")  # raises the job's error, if any
            return True
        return False

    def wait(self, ev: Event) -> None:
        """The compute stream goes on only after ``ev`` (a GPU: ordered, not blocking the host)."""
        self._note("wait", "compute")
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(ev)
        else:
            wait_copy(ev, "a reload")

    def drain(self) -> None:
        """Wait for every job queued on both lanes."""
        last, self._last = self._last, {}
        for ev in last.values():
            if self.cuda:
                ev.synchronize()
            else:
                wait_copy(ev, "a previous step's copy")

    def close(self) -> None:
        """Drain, then end the worker threads (a later submit starts new ones)."""
        self.drain()
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.shutdown(wait=True)


class _MappedArray:
    """A pinned host slice as a CUDA array (``__cuda_array_interface__``): under unified addressing the
    device address of pinned memory is its host address, so a kernel writes or reads the arena directly."""

    def __init__(self, host: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {
            "shape": (host.numel(),),
            "typestr": "|u1",
            "data": (host.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


def mapped(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA uint8 tensor over the pinned host slice ``host`` (no copy; valid while ``host`` is)."""
    if not host.is_pinned():
        raise RuntimeError("offload: the mapped path needs a pinned host arena")
    return torch.as_tensor(_MappedArray(host), device=device)


def _flat(storage: torch.UntypedStorage, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    n = storage.nbytes() // dtype.itemsize
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (n,), (1,))


_CASTS = (torch.float32, torch.float16, torch.bfloat16)


class OffloadGroup:
    """The storages one forward offloads: added during the forward, packed at its end in one launch
    (:meth:`launch`), settled when that launch's event fired (:meth:`settle` drops the sources),
    reloaded in one unpack launch (:meth:`reload`), read by the backward (:meth:`flat`).

    ``nbytes``: device bytes of the storages (what leaves and comes back); ``host_bytes``: what
    the pack wrote to the arena.  Each storage is packed whole, as one flat tensor: in its dtype
    when the format casts it (fp32/fp16/bf16 under bf16/fp8, every view of it of that dtype),
    as raw bytes otherwise (lossless: bit for bit).
    """

    def __init__(self, lanes: CopyLanes, dtype: torch.dtype | None, path: str = "staging") -> None:
        self.lanes = lanes
        self.dtype = dtype
        self.path = path
        self.storages: list[torch.UntypedStorage] = []
        self.views: list[set[torch.dtype]] = []  # dtypes each storage was saved as
        self.index: dict[int, int] = {}  # storage address -> position
        self.nbytes = 0
        self.host_bytes = 0
        self.host: torch.Tensor | None = None
        self.layout: Any = None
        self.flat_dtypes: list[torch.dtype] = []
        self.offloaded: Event | None = None
        self.staging: torch.Tensor | None = None  # device buffer of the staging path (until its event)
        self.outs: list[torch.Tensor] | None = None  # reloaded flats
        self.reloaded: Event | None = None
        self.waited = False

    def add(self, t: torch.Tensor) -> int:
        """The position of ``t``'s storage in the group (added on first sight)."""
        ptr = storage_ptr(t)
        i = self.index.get(ptr)
        if i is None:
            i = self.index[ptr] = len(self.storages)
            self.storages.append(t.untyped_storage())
            self.views.append(set())
            self.nbytes += storage_bytes(t)
        self.views[i].add(t.dtype)
        return i

    @property
    def holds_sources(self) -> bool:
        return bool(self.storages)

    def _flat_dtype(self, i: int) -> torch.dtype:
        seen = self.views[i]
        if self.dtype is not None and len(seen) == 1:
            (dt,) = seen
            if dt in _CASTS and self.storages[i].nbytes() % dt.itemsize == 0:
                return dt
        return torch.uint8

    def launch(self, arena: HostArena, cache: Any) -> int:
        """End of the forward: one pack of every storage into the arena, on the offload lane.  Returns the
        bytes written to the host."""
        lanes = self.lanes
        device = lanes.device
        self.flat_dtypes = [self._flat_dtype(i) for i in range(len(self.storages))]
        flats = [_flat(st, dt, device) for st, dt in zip(self.storages, self.flat_dtypes, strict=True)]
        layout = cache.get(flats, kernels.format_for(self.dtype))
        self.layout = layout
        host = self.host = arena.alloc(layout.nbytes)
        self.host_bytes = layout.nbytes
        dtype = self.dtype
        if lanes.cuda and self.path == "staging":
            staging = self.staging = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)

            def work() -> None:
                kernels.pack(flats, dtype, out=staging, cache=cache)
                host.copy_(staging, non_blocking=True)
        else:
            out = mapped(host, device) if lanes.cuda else host

            def work() -> None:
                kernels.pack(flats, dtype, out=out, cache=cache)

        self.offloaded = lanes.submit("offload", work)
        return layout.nbytes

    def settle(self) -> bool:
        """True (once) when the pack's event has fired: the sources and the staging buffer are dropped."""
        if not self.storages or self.offloaded is None or not self.lanes.fired(self.offloaded):
            return False
        self.storages = []
        self.staging = None
        return True

    def reload(self) -> bool:
        """Start the one unpack (on the reload lane, after the pack); True if it started now (False: already
        reloaded, or the sources are still held and are read instead)."""
        if self.outs is not None or self.storages or self.host is None:
            return False
        lanes = self.lanes
        device, layout, host = lanes.device, self.layout, self.host
        outs = self.outs = [torch.empty(e.shape, dtype=e.dtype, device=device) for e in layout.entries]
        if lanes.cuda and self.path == "staging":
            staging = self.staging = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)

            def work() -> None:
                staging.copy_(host, non_blocking=True)
                kernels.unpack(staging, layout, out=outs)
        else:
            src = mapped(host, device) if lanes.cuda else host

            def work() -> None:
                kernels.unpack(src, layout, out=outs)

        self.reloaded = lanes.submit("reload", work, after=[self.offloaded])
        self.waited = False
        return True

    def storage(self, i: int) -> torch.UntypedStorage:
        """Storage ``i`` as the backward reads it: the source while it is held, else its reloaded copy
        (same bytes, or the cast's round trip) once the compute stream waited for the reload."""
        if self.storages:
            return self.storages[i]
        if self.outs is None:
            raise RuntimeError("offloaded activation read before its reload was started (or after its release)")
        if not self.waited:
            self.lanes.wait(self.reloaded)
            self.waited = True
            self.staging = None  # the compute stream is ordered after the reload: its buffer may go
        return self.outs[i].untyped_storage()

    def release(self) -> None:
        """Autograd is done: drop the reloaded tensors (the sources go at :meth:`settle`)."""
        self.outs = None
