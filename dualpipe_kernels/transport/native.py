"""Native transport: CPU tensors between processes on one host over shared memory (``_C.shm``).

Per directed pair of same-host ranks there is one ring of ``num_slots`` slots of
``slot_bytes`` bytes in a POSIX shared-memory segment; an engine-owned worker
thread per channel copies messages through it (large ones split into slots and
pipelined), so ``isend``/``irecv`` return at once and a receive lands straight
in the caller's tensor.  Small messages (up to ``inline_max_bytes``: 64 KiB, or a
whole slot when ranks share CPUs) are copied by the posting thread and by the
thread that waits for them (see ``recv_poll_ms``), not by the worker, which then
stays off the waiter's core.  Messages between a pair are matched per tag in posting
order (like gloo); a size or dtype mismatch fails with an error naming both
sides and never writes the receive tensor.

Rendezvous goes through the process group's store, so constructing a
NativeTransport is collective over the group: every rank publishes its hostname
and, for each same-host peer, the name of its outgoing ring; the peer maps the
ring and unlinks its name at once, so no ``/dev/shm`` entry outlives the
constructor, even if a process is killed later; a name left by a rank killed
before its peer mapped it is swept when the survivor's engine closes (and at
every engine start).  Peers on another host fall back
to :class:`~dualpipe_kernels.transport.torch_dist.TorchDistTransport`.

Single copy.  A message of at least ``single_copy_min_bytes`` does not go through
the ring: the sender posts a descriptor (pid, address, size) and the receiver
copies the bytes straight from the sender's tensor into its own with
``process_vm_readv`` (Linux cross-memory attach), one copy instead of two; the
send completes once the receiver has read it.  Whether the receiver may read the
sender's memory is probed once per ring at construction (Yama ``ptrace_scope``
or a container policy may forbid it); if not, or if ``single_copy=False`` or the
environment variable ``DUALPIPE_KERNELS_SINGLE_COPY=0``, every message uses the
ring.  :meth:`NativeTransport.single_copy_peers` says which peers got it.

Packed sends in place.  :meth:`NativeTransport.isend_packed` of a message that
fits one ring slot (``slot_bytes``) reserves the next slot of the ring to the
peer (:meth:`NativeTransport.reserve_send`), packs the tensors straight into it
(the slot is a writable uint8 tensor viewing the shared memory; the pack
kernel's ``out=``) and commits it: packing and staging are one pass over the
bytes, and the send is complete on return.  The reservation is only a try: when
sends are queued ahead, the ring is full or the message is larger than a slot,
it packs into a buffer and posts that (the receiver reads a large one in place,
see single copy).  An error while packing gives the slot back unpublished.
:meth:`NativeTransport.send_stats` counts the bytes each path moved;
``pack_in_place=False`` (or ``DUALPIPE_KERNELS_PACK_IN_PLACE=0``) turns it off.

A dead peer (its pid gone) fails the waiting transfer within about
``liveness_interval_s``; a silent one times out after ``timeout_s``.
"""

from __future__ import annotations

import os
import zlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dualpipe_kernels.transport.base import (
    DEFAULT_TIMEOUT_S,
    DONE,
    Handle,
    Transport,
    TransportError,
    TransportTimeout,
    group_store,
    require_process_group,
    wait_store_key,
)
from dualpipe_kernels.transport.hosts import host_id as default_host_id
from dualpipe_kernels.transport.native_defaults import (
    INLINE_MAX_BYTES_OWN_CORE,
    SPIN_US_OWN_CORE,
    SPIN_US_SHARED,
    cpus_shared,
    default_inline_max_bytes,
    default_spin_us,
)
from dualpipe_kernels.transport.native_handles import NativeHandle, ReservedSlot, request_error
from dualpipe_kernels.wire_dtypes import WIRE_DTYPE_CODE, WIRE_DTYPES

if TYPE_CHECKING:
    from collections.abc import Sequence

    from dualpipe_kernels.kernels import PackLayout
    from dualpipe_kernels.transport.torch_dist import TorchDistTransport

__all__ = [
    "NativeTransport",
    "NativeHandle",
    "ReservedSlot",
    "DTYPES",
    "dtype_code",
    "default_spin_us",
    "default_inline_max_bytes",
    "cpus_shared",
    "SPIN_US_OWN_CORE",
    "SPIN_US_SHARED",
    "INLINE_MAX_BYTES_OWN_CORE",
    "load_engine_module",
]

#: dtypes with fixed codes in message headers (the package-wide wire table); others get a stable hash code.
DTYPES = WIRE_DTYPES
DEFAULT_NUM_SLOTS = 8
DEFAULT_SLOT_BYTES = 260 * 1024
#: sends of at least this many bytes are read by the receiver straight from the sender (when permitted)
DEFAULT_SINGLE_COPY_MIN_BYTES = 256 * 1024
#: environment variable: "0" turns the single-copy path off (any other value or unset: on)
SINGLE_COPY_ENV = "DUALPIPE_KERNELS_SINGLE_COPY"
#: environment variable: "0" turns packing into reserved ring slots off (any other value or unset: on)
PACK_IN_PLACE_ENV = "DUALPIPE_KERNELS_PACK_IN_PLACE"
_STORE_PREFIX = "dpk/native"
_MIN_SWEEP = 32  # unwaited finished transfers tolerated in the in-flight table before a sweep


def dtype_code(dtype: torch.dtype) -> int:
    """The int32 code of ``dtype`` carried in every message header."""
    code = WIRE_DTYPE_CODE.get(dtype)
    if code is not None:
        return code
    return len(DTYPES) + zlib.crc32(str(dtype).encode()) % (2**30)


_UINT8_CODE = dtype_code(torch.uint8)


def load_engine_module() -> Any:
    """``dualpipe_kernels._C.shm``, or an ImportError that says how to build it."""
    try:
        from dualpipe_kernels import _C
    except ImportError as exc:
        raise ImportError(
            "dualpipe_kernels._C is not built; install with `pip install --no-build-isolation -e .`"
        ) from exc
    return _C.shm


class NativeTransport(Transport):
    """Shared-memory transport between CPU processes of ``group`` (default: the default group).

    Construction is collective over the group.  ``num_slots`` (>= 2) and
    ``slot_bytes`` size each ring; ``spin_us`` is how long a waiting thread
    spins before it sleeps (the engine's worker threads spin at most 50).  By
    default (None) :func:`default_spin_us`: 500 when this host has a CPU for
    every local rank, long enough to cover a peer's gap between two actions so
    that the sender's write needs no wake-up call, and 50 when ranks share
    CPUs (a spinning waiter would take a core a busy rank needs); ``liveness_interval_s`` how often a sleeping wait
    checks that the peer process still exists.  ``single_copy`` (default: on
    unless ``DUALPIPE_KERNELS_SINGLE_COPY=0``) lets messages of at least
    ``single_copy_min_bytes`` bytes be read by the receiver straight from the
    sender's tensor (see the module docstring).  ``host_id`` names this host
    for grouping peers (default: :func:`~dualpipe_kernels.transport.hosts.host_id`,
    the hostname refined by torchrun's node rank); ranks with different host ids
    talk through torch.distributed.

    ``inline_max_bytes``: sends up to this size are copied into the ring by the
    posting thread when a slot is free at once (the send is then complete), and
    received by the thread that waits for them; larger ones go through the
    engine's worker.  Default (None) :func:`default_inline_max_bytes`: 64 KiB
    when every local rank has a CPU, a whole slot when ranks share CPUs.

    ``recv_poll_ms`` (> 0, the default 20): a receive that fits the inline path
    (at most ``inline_max_bytes``) is copied by the thread that waits for it, which spins
    ``spin_us`` polling the ring, then sleeps on the ring until the sender's
    write wakes it; it hands the receive to the engine's worker thread only for a
    message it cannot copy (split into chunks) or after a whole
    ``liveness_interval_s`` asleep.  The worker looks for small messages nobody
    waits on every ``recv_poll_ms``, so it is neither woken by every message nor
    run on the waiter's core between actions.  ``0``: the worker watches the ring
    for every posted receive (each message wakes it), the engine's behaviour before.
    ``gather_sends`` (default on): :meth:`try_isend_gather` writes a small
    message's pieces straight into the ring (the runtime's repeated boundary
    messages); off, it always declines and the message goes through a buffer.
    """

    name = "native"

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        num_slots: int = DEFAULT_NUM_SLOTS,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        spin_us: float | None = None,
        liveness_interval_s: float = 0.05,
        single_copy: bool | None = None,
        single_copy_min_bytes: int = DEFAULT_SINGLE_COPY_MIN_BYTES,
        host_id: str | None = None,
        pack_in_place: bool | None = None,
        recv_poll_ms: float = 20.0,
        gather_sends: bool = True,
        inline_max_bytes: int | None = None,
    ) -> None:
        super().__init__(timeout_s)
        require_process_group("NativeTransport", timeout_s)
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (double buffering), got {num_slots}")
        if slot_bytes < 64:
            raise ValueError(f"slot_bytes must be >= 64, got {slot_bytes}")
        if single_copy_min_bytes < 1:
            raise ValueError(f"single_copy_min_bytes must be >= 1, got {single_copy_min_bytes}")
        if not recv_poll_ms >= 0:
            raise ValueError(f"recv_poll_ms must be >= 0, got {recv_poll_ms}")
        if inline_max_bytes is not None and not 0 <= inline_max_bytes <= slot_bytes:
            raise ValueError(f"inline_max_bytes must be in [0, slot_bytes = {slot_bytes}], got {inline_max_bytes}")
        if single_copy is None:
            single_copy = os.environ.get(SINGLE_COPY_ENV, "1").strip() != "0"
        if pack_in_place is None:
            pack_in_place = os.environ.get(PACK_IN_PLACE_ENV, "1").strip() != "0"
        self.pack_in_place = bool(pack_in_place)
        self.gather_sends = bool(gather_sends)
        self.slot_bytes = int(slot_bytes)
        shm = load_engine_module()
        self.group = group if group is not None else dist.group.WORLD
        self._rank = dist.get_rank(self.group)
        self._size = dist.get_world_size(self.group)
        #: sends up to this size are copied by the posting thread, receives by the waiting one
        self.inline_max_bytes = (
            default_inline_max_bytes(self._size, slot_bytes) if inline_max_bytes is None else int(inline_max_bytes)
        )
        self._closed = False
        self._failure: BaseException | None = None  # fail_all's error: every unfinished wait and later post raises it
        # Keeps a tensor alive while the engine may touch it, also if the caller drops the handle;
        # an entry goes when its handle sees the transfer finish, or at the next post once finished.
        self._inflight: dict[int, tuple[Any, torch.Tensor]] = {}
        self._sweep_at = _MIN_SWEEP
        self._fallback: TorchDistTransport | None = None
        self._group_inline_bytes = 0  # set by the rendezvous
        self._engine = shm.Engine(
            self._rank,
            num_slots=num_slots,
            slot_bytes=slot_bytes,
            spin_us=default_spin_us(self._size) if spin_us is None else spin_us,
            liveness_interval_s=liveness_interval_s,
            dtype_names=[str(d).removeprefix("torch.") for d in DTYPES],
            single_copy=single_copy,
            single_copy_min_bytes=single_copy_min_bytes,
            recv_poll_ms=recv_poll_ms,
            inline_max_bytes=self.inline_max_bytes,
        )
        try:  # the engine swept stale segments of both engines when it started
            hosts = self._rendezvous(group_store(self.group), host_id or default_host_id())
        except BaseException:
            self._engine.close()
            raise
        self.local_peers = tuple(p for p in range(self._size) if p != self._rank and hosts[p] == hosts[self._rank])
        self._local = frozenset(self.local_peers)
        if len(set(hosts)) > 1:
            # Every rank sees the same host map, so all of them build the fallback (it may be collective).
            from dualpipe_kernels.transport.torch_dist import TorchDistTransport

            self._fallback = TorchDistTransport(self.group, device=torch.device("cpu"), timeout_s=timeout_s)

    # ------------------------------------------------------------------ rendezvous

    def _wait_key(self, store: dist.Store, key: str, step: str) -> bytes:
        wait_store_key(store, key, self.timeout_s, f"rank {self._rank}: native transport rendezvous", step)
        return store.get(key)

    def _rendezvous(self, store: dist.Store, host_id: str) -> list[str]:
        """Exchange host ids and ring names with every same-host peer; returns each rank's host id."""
        # Each rank counts the transports it built on this store; ranks build them in the
        # same order, so the counts agree and two transports never share keys.
        generation = store.add(f"{_STORE_PREFIX}/generation/{self._rank}", 1)
        prefix = f"{_STORE_PREFIX}/{generation}"
        # what this rank takes as one gathered copy (gather_sends off: nothing), published with its host
        store.set(f"{prefix}/host/{self._rank}", f"{self.inline_max_bytes if self.gather_sends else 0} {host_id}")
        entries = [
            self._wait_key(store, f"{prefix}/host/{p}", f"peer rank {p}'s hostname").decode().split(" ", 1)
            for p in range(self._size)
        ]
        hosts = [h for _, h in entries]
        self._group_inline_bytes = min(int(n) for n, _ in entries)
        peers = [p for p in range(self._size) if p != self._rank and hosts[p] == hosts[self._rank]]
        for p in peers:
            store.set(f"{prefix}/ring/{self._rank}to{p}", self._engine.create_send_channel(p))
        for p in peers:
            name = self._wait_key(store, f"{prefix}/ring/{p}to{self._rank}", f"peer rank {p}'s ring name").decode()
            self._engine.attach_recv_channel(p, name)  # maps, then unlinks the name
            store.set(f"{prefix}/mapped/{p}to{self._rank}", "1")
        for p in peers:
            self._wait_key(store, f"{prefix}/mapped/{self._rank}to{p}", f"peer rank {p} to map our ring")
            self._engine.unlink_send_segment(p)  # normally already gone: the peer unlinked it
        return hosts

    # ------------------------------------------------------------------ transfers

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def recv_lookahead(self) -> int:
        """The torch fallback's when some peers are on other hosts (gloo), else the default."""
        return super().recv_lookahead if self._fallback is None else self._fallback.recv_lookahead

    @property
    def early_small_receives(self) -> bool:
        """The torch fallback's when some peers are on other hosts (gloo), else the default (off)."""
        return super().early_small_receives if self._fallback is None else self._fallback.early_small_receives

    @property
    def message_inline_bytes(self) -> int:
        """The smallest ``inline_max_bytes`` of the group's ranks (0 where any has ``gather_sends`` off, or
        when some peers are on other hosts: the torch fallback does not gather)."""
        return self._group_inline_bytes if self._fallback is None else 0

    @property
    def world_size(self) -> int:
        return self._size

    def single_copy_peers(self) -> tuple[int, ...]:
        """Same-host peers to which sends of >= ``single_copy_min_bytes`` go single-copy (their probe succeeded)."""
        return tuple(p for p in self.local_peers if self._engine.single_copy_to(p))

    @property
    def fails_waits(self) -> bool:
        """True: :meth:`fail_all` ends blocked waits at once (the engine's, and the fallback's for other hosts)."""
        return self._fallback is None or self._fallback.fails_waits

    @property
    def failure(self) -> BaseException | None:
        """What :meth:`fail_all` was given (None: nothing failed)."""
        return self._failure

    def fail_all(self, error: BaseException) -> None:
        """Every unfinished and later transfer fails with ``error`` (see :meth:`Transport.fail_all`): the engine
        fails its requests and wakes their waiters, whose ``wait`` then raises ``error``."""
        if self._failure is not None or self._closed:
            return
        self._failure = error  # before the engine wakes the waiters: they read it
        self._engine.fail_all(str(error))
        if self._fallback is not None:
            self._fallback.fail_all(error)

    def _check(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise TransportError(f"rank {self._rank}: native transport is closed; cannot post {what!r}")
        if not 0 <= peer < self._size or peer == self._rank:
            raise ValueError(f"rank {self._rank}: peer must be another rank in [0, {self._size}), got {peer} ({what})")
        if not tensor.is_cpu:
            raise ValueError(
                f"rank {self._rank}: NativeTransport moves CPU tensors, got {tensor.device} ({what}); "
                "use CudaIpcTransport for CUDA tensors"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"rank {self._rank}: tensor must be contiguous ({what})")

    def _track(self, request: Any, tensor: torch.Tensor, is_send: bool) -> NativeHandle:
        # Drop finished transfers whose handles were dropped unwaited: a tensor kept here pins its memory.
        # Swept when the table has doubled since the last sweep (amortised O(1) per post: the runtime
        # waits for nearly everything it posts, so the table stays small).
        if len(self._inflight) >= self._sweep_at:
            for key in [k for k, (r, _t) in self._inflight.items() if r.query()]:
                del self._inflight[key]
            self._sweep_at = max(_MIN_SWEEP, 2 * len(self._inflight))
        # A small send is often done when posted; a receive (its waiter copies it) is kept without asking.
        if not (is_send and request.query()):
            self._inflight[id(request)] = (request, tensor)
        return NativeHandle(request, tensor, self)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        return self._post(True, tensor, peer, tag, what)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        return self._post(False, tensor, peer, tag, what)

    def _post(self, is_send: bool, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Handle:
        """Check, then hand the transfer to the engine (to the fallback for a peer on another host)."""
        if self._closed or self._failure or peer not in self._local or not tensor.is_cpu or not tensor.is_contiguous():
            # Anything unusual (an error to name, a peer on another host): the full checks first.
            self._check(tensor, peer, what)
            assert self._fallback is not None
            return (self._fallback.isend if is_send else self._fallback.irecv)(tensor, peer, tag, what)
        nbytes = tensor.nbytes
        post = self._engine.send if is_send else self._engine.recv
        code = WIRE_DTYPE_CODE.get(tensor.dtype)
        if code is None:
            code = dtype_code(tensor.dtype)
        return self._track(post(peer, tensor.data_ptr(), nbytes, tag, code, what), tensor, is_send)

    def irecv_raw(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Any:
        """:meth:`irecv` of a contiguous host uint8 ``tensor`` from same-host ``peer`` with no handle around the
        engine's request: the request (wait for it with :meth:`wait_raw` only), or None when this receive
        takes :meth:`irecv` (a peer on another host, a closed or failed transport).  The transport holds
        ``tensor`` until the wait returns, as for a handle.  For the runtime's repeated small receives,
        each posted and waited once a step."""
        if self._closed or self._failure is not None or peer not in self._local:
            return None
        req = self._engine.recv(peer, tensor.data_ptr(), tensor.nbytes, tag, _UINT8_CODE, what)
        self._inflight[id(req)] = (req, tensor)
        return req

    def wait_raw(self, request: Any, timeout: float) -> None:
        """Wait for a request of the engine (one of :meth:`irecv_raw`, or a handle's): TransportTimeout, the
        :meth:`fail_all` failure, or TransportError (:func:`~.native_handles.request_error`); a finished one
        leaves the in-flight table."""
        try:
            request.wait(timeout)
        except TimeoutError as exc:
            raise request_error(exc, self) from None
        except RuntimeError as exc:
            self._inflight.pop(id(request), None)
            raise request_error(exc, self) from None
        self._inflight.pop(id(request), None)

    def try_isend_gather(self, pieces: Sequence[tuple[int, torch.Tensor]], nbytes: int, peer: int, tag: int) -> bool:
        """Send one small uint8 message of ``nbytes`` made of ``pieces`` at once, or do nothing.

        ``pieces``: ``(byte offset, tensor)`` in increasing offset order, each a contiguous CPU tensor
        whose bytes go to that offset (the bytes between pieces are zero).  The engine writes them
        straight into the next ring slot to same-host ``peer`` and publishes it when it can do so at
        once (nothing queued ahead, a free slot, at most ``inline_max_bytes``): then the send is
        complete (nothing to wait for or keep) and this returns True.  Otherwise nothing was sent and it
        returns False: post the message with :meth:`isend` (which also reports a closed transport).
        The receiver posts an ordinary ``irecv`` of ``nbytes`` uint8 with the same tag.
        """
        if self._closed or not self.gather_sends or peer not in self._local:
            return False
        spec = []
        for off, t in pieces:
            if not t.is_cpu or not t.is_contiguous():
                raise ValueError(f"rank {self._rank}: gathered pieces must be contiguous CPU tensors (tag {tag})")
            spec.append((off, t.data_ptr(), t.nbytes))
        try:
            return bool(self._engine.try_send_gather(peer, spec, nbytes, tag, _UINT8_CODE))
        except ValueError as exc:  # std::invalid_argument: a piece outside the message
            raise ValueError(f"rank {self._rank}: {exc} (tag {tag}, to peer rank {peer})") from None

    # ------------------------------------------------------------------ packed sends in place

    def reserve_send(
        self, nbytes: int, peer: int, tag: int, what: str = "", timeout: float | None = None
    ) -> ReservedSlot | None:
        """Reserve the next ring slot to same-host ``peer`` for one uint8 message of ``nbytes`` (<= ``slot_bytes``).

        Waits up to ``timeout`` seconds (None: the transport's ``timeout_s``) for the sends
        queued ahead of it and for a free slot, then raises TransportTimeout naming the
        transfer; ``timeout=0`` only tries and returns None when no slot is free at once.
        The receiver posts an ordinary ``irecv`` of ``nbytes`` uint8 with the same tag.
        """
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise TransportError(f"rank {self._rank}: native transport is closed; cannot reserve {what!r}")
        if peer not in self.local_peers:
            raise ValueError(f"rank {self._rank}: peer {peer} is not a same-host peer; no ring to reserve ({what})")
        limit = self.timeout_s if timeout is None else float(timeout)
        try:
            res = self._engine.reserve(
                peer, int(nbytes), tag, dtype_code(torch.uint8), what, max(0.0, limit), limit > 0
            )
        except TimeoutError as exc:
            raise TransportTimeout(str(exc)) from None
        except RuntimeError as exc:
            if self._failure is not None:
                raise self._failure from None
            raise TransportError(str(exc)) from None
        return None if res is None else ReservedSlot(res, self)

    def isend_packed(
        self, tensors: Sequence[torch.Tensor], layout: PackLayout, peer: int, tag: int, what: str = ""
    ) -> Handle:
        """Pack straight into a reserved ring slot when the message fits one and a slot is free at once
        (one pass over the bytes; the send is complete on return); otherwise the base path."""
        if (
            self.pack_in_place
            and not self._closed
            and 0 < layout.nbytes <= self.slot_bytes
            and peer in self.local_peers
            and tensors[0].device.type == "cpu"
        ):
            slot = self.reserve_send(layout.nbytes, peer, tag, what, timeout=0)
            if slot is not None:
                from dualpipe_kernels.kernels import pack_as

                with slot:
                    assert slot.tensor is not None
                    pack_as(tensors, layout, slot.tensor, what)
                return DONE
        return super().isend_packed(tensors, layout, peer, tag, what)

    def send_stats(self, peer: int) -> dict[str, int]:
        """Counters of the ring to same-host ``peer``: ``copied_bytes`` / ``copied_messages`` (posted sends: the
        engine copied the bytes into the ring, or the receiver read them single-copy) and ``reserved_bytes`` /
        ``reserved_messages`` (packed in place into reserved slots, no engine copy)."""
        return {k: int(v) for k, v in self._engine.send_stats(peer).items()}

    def close(self) -> None:
        """Stop the worker threads (unfinished transfers fail), unmap the rings. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._engine.close()
        self._inflight.clear()
        if self._fallback is not None:
            self._fallback.close()
