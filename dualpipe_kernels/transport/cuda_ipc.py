"""Same-host GPU transport over the native CUDA IPC engine (``dualpipe_kernels._C.cuda``).

Every ordered pair of ranks gets a channel owned by the receiver: a byte ring
of ``num_slots * slot_bytes`` device memory (messages take 256-byte multiples
of it, large ones go in ``slot_bytes`` chunks), shared with the sender through
a CUDA IPC memory handle, with two 64-bit counters after it that the two
processes' streams write and wait on themselves (stream memory operations:
no event crosses processes, no host thread waits for the GPU), plus
shared-memory counters and up to ``max_inflight`` chunk descriptors for the
hosts (protocol: ``csrc/cuda/ipc_engine.h``).  Copies run on the engine's
comm streams (copy engines, no SMs); an engine-owned worker thread enqueues
them, so ``isend``/``irecv`` return at once.  Where CUDA IPC is not
possible the ring lives in pinned host memory instead (``staging="host"``:
D2H into the slot, H2D out of it).  Sends of at least ``direct_min_bytes``
(ipc staging) go zero-copy: the receiver maps the sender's buffer through an
IPC handle and copies straight into its own, one copy instead of two.

Rendezvous goes through a ``torch.distributed`` store (the default group's
store unless one is passed): each receiver publishes the name of its channel's
shared segment, the sender maps it and unlinks the name at once, so no
``/dev/shm`` entry outlives the rendezvous (and a name left by a rank killed
earlier is swept by any engine's start or close).  Where CUDA IPC turns out
not to work between the processes (a ring, event or buffer that cannot be
exported or opened), construction raises :class:`CudaIpcUnavailableError` on
this rank and, through the store, promptly on its peers, so that a caller can
fall back to ``staging="host"``.
Construction is collective: every rank of the group builds its transport in
the same order.

Handles follow DeepEP's event model: ``wait_stream(stream)`` makes a compute
stream wait on the transfer's CUDA event with no host synchronisation (the
host only waits until the engine has queued the copies, which needs the peer's
matching post); ``wait(timeout)`` blocks the host.

Zero-copy memory: the receiver keeps up to ``max_peer_mappings`` (32, at most
64) of the sender's caching-allocator segments mapped across messages, and the
sender keeps each such segment allocated for as long as it is mapped (it holds
the latest tensor sent from it, as torch's own CUDA tensor sharing holds a
shared storage), so the allocator never frees mapped memory (``empty_cache``,
its OOM retry).  The sender makes one IPC handle per segment.  When a new
segment finds every entry in use, the sender asks the receiver to unmap its
least recently used one and sends that message through the ring meanwhile
(``stats()["zero_copy_deferred"]``); once unmapped, the tensor is released.
So up to ``max_peer_mappings`` sent tensors per peer stay allocated after
their sends complete: pass a small ``max_peer_mappings`` or
``direct_min_bytes=0`` where that memory matters.  Views at any offset of a
caching-allocator block go zero-copy; ``stats()`` counts what went which way.

Ownership: a send buffer must not be modified, and a receive buffer not read,
before the handle completes (host: ``wait``; device: ``wait_stream``).  The
engine holds a reference to each tensor until its copies are queued and marks
it with ``record_stream`` for the comm stream, so dropping a tensor early
never lets the caching allocator reuse memory under a copy.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from dualpipe_kernels.transport.base import (
    DEFAULT_TIMEOUT_S,
    Handle,
    Transport,
    TransportError,
    TransportTimeout,
    wait_store_key,
)

__all__ = [
    "CudaIpcHandle",
    "CudaIpcTransport",
    "CudaIpcUnavailableError",
    "STAGINGS",
    "cuda_ipc_available",
    "native_cuda_module",
]

#: "auto": CUDA IPC, falling back to host staging where the receiver cannot export device memory
STAGINGS = ("auto", "ipc", "host")
#: Most sender segments a receiver keeps mapped per channel (the engine's kMaxExports).
MAX_PEER_MAPPINGS = 64
#: Most chunks a sender may publish ahead of the receiver (the engine's kMaxInflight).
MAX_INFLIGHT = 1024
_KEY_PREFIX = "dpk/cuda_ipc"
#: upper bound of the time close() waits for peers to detach (seconds)
_CLOSE_TIMEOUT_S = 30.0


class CudaIpcUnavailableError(TransportError):
    """CUDA IPC does not work between these processes (here or on a peer): host staging may."""


def native_cuda_module() -> ModuleType:
    """``dualpipe_kernels._C.cuda``, or a TransportError that says why it is unavailable."""
    try:
        from dualpipe_kernels import _C
    except ImportError as exc:
        raise TransportError(
            "the native extension dualpipe_kernels._C is not built "
            f"(install with `pip install --no-build-isolation -e .`): {exc}"
        ) from exc
    mod = getattr(_C, "cuda", None)
    if mod is None:
        raise TransportError(
            "dualpipe_kernels._C was built without CUDA support (no nvcc or a CPU-only torch at build time, "
            "or DUALPIPE_KERNELS_CUDA=0); CudaIpcTransport needs a CUDA build"
        )
    return mod


def native_cuda_module_error_type() -> type[RuntimeError]:
    """``_C.IpcUnavailableError``: the engine's "CUDA IPC is not possible here" (a RuntimeError)."""
    from dualpipe_kernels import _C

    return getattr(_C, "IpcUnavailableError", RuntimeError)


def cuda_ipc_available() -> bool:
    """True when the extension has the CUDA engine and a CUDA device is visible."""
    try:
        native_cuda_module()
    except TransportError:
        return False
    return torch.cuda.is_available()


def _validate_options(num_slots: int, slot_bytes: int, staging: str, timeout_s: float, direct_min_bytes: int) -> None:
    if not isinstance(num_slots, int) or not 2 <= num_slots <= 16:
        raise ValueError(f"num_slots must be an int in [2, 16] (double buffering at least), got {num_slots!r}")
    if not isinstance(slot_bytes, int) or slot_bytes <= 0 or slot_bytes % 256:
        raise ValueError(f"slot_bytes must be a positive multiple of 256, got {slot_bytes!r}")
    if staging not in STAGINGS:
        raise ValueError(f"staging must be one of {STAGINGS}, got {staging!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    if not isinstance(direct_min_bytes, int) or direct_min_bytes < 0:
        raise ValueError(f"direct_min_bytes must be an int >= 0 (0: never zero-copy), got {direct_min_bytes!r}")


class CudaIpcHandle(Handle):
    """One posted transfer of a :class:`CudaIpcTransport`."""

    def __init__(self, op: Any, owner: CudaIpcTransport, peer: int, tag: int, what: str, sending: bool) -> None:
        self._op = op  # _C.cuda.IpcOp; it also holds the tensor
        self._owner = owner
        self._peer = peer
        self._tag = tag
        self._what = what
        self._sending = sending

    def _describe(self) -> str:
        verb = "send to" if self._sending else "receive from"
        return f"rank {self._owner.rank}: {verb} peer rank {self._peer} (tag {self._tag}, {self._what or 'transfer'})"

    def _limit(self, timeout: float | None) -> float:
        return self._owner.timeout_s if timeout is None else timeout

    def _timeout_error(self, limit: float) -> TransportTimeout:
        return TransportTimeout(
            f"{self._describe()} timed out after {limit:.3g} s: {self._op.describe()}; "
            f"{self._owner.channel_status(self._peer, outgoing=self._sending)}"
        )

    def _failed(self, exc: RuntimeError) -> BaseException:
        """What a failed transfer raises: the transport's :meth:`~CudaIpcTransport.fail_all` error if it was
        given one (the engine failed the op with its text), else a TransportError naming the transfer."""
        failure = self._owner.failure
        return failure if failure is not None else TransportError(f"{self._describe()} failed: {exc}")

    def wait(self, timeout: float | None = None) -> None:
        limit = self._limit(timeout)
        try:
            done = self._op.wait(limit)
        except RuntimeError as exc:
            raise self._failed(exc) from exc
        if not done:
            raise self._timeout_error(limit)

    def is_completed(self) -> bool:
        try:
            return bool(self._op.query())
        except RuntimeError as exc:
            raise self._failed(exc) from exc

    def wait_stream(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream of the transport's device) wait for the transfer.

        The host blocks only until the engine has queued the copies (bounded by
        the transport's timeout), never for the copies themselves.
        """
        if stream is None:
            stream = torch.cuda.current_stream(self._owner.device)
        limit = self._owner.timeout_s
        try:
            queued = self._op.wait_stream(int(stream.cuda_stream), limit)
        except RuntimeError as exc:
            raise self._failed(exc) from exc
        if not queued:
            raise self._timeout_error(limit)


class CudaIpcTransport(Transport):
    """Point-to-point GPU transport between processes on one host, over CUDA IPC.

    Args:
        group: process group whose ranks are the peers (default: the default
            group); ignored when ``rank``/``world_size``/``store`` are given.
        rank, world_size, store: explicit rendezvous without a process group.
        device: this rank's CUDA device (default: the current device).
        peers: group ranks to open channels with (default: all others); must
            be symmetric (if b is in a's list, a is in b's).
        num_slots, slot_bytes: ring geometry of each incoming channel; a message
            is split into ``slot_bytes`` chunks pipelined over the ring.  Device
            memory used: ``len(peers) * num_slots * slot_bytes``.
        max_inflight: chunks a sender may publish ahead of this receiver's host
            (the descriptor ring, 1..1024; default 256).
        staging: "auto" | "ipc" | "host" (see module docstring).
        direct_min_bytes: sends at least this large go zero-copy where the
            buffer can be exported (ipc staging); 0 turns zero-copy off.
        timeout_s: default for every wait and for the rendezvous.
        key_prefix: store key namespace (default derived from the group name).
    """

    name = "cuda_ipc"

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        store: dist.Store | None = None,
        device: int | str | torch.device | None = None,
        peers: list[int] | None = None,
        num_slots: int = 4,
        slot_bytes: int = 4 << 20,
        staging: str = "auto",
        direct_min_bytes: int = 1 << 20,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        key_prefix: str | None = None,
        max_peer_mappings: int = 32,
        max_inflight: int = 256,
    ) -> None:
        super().__init__(timeout_s=timeout_s)
        if not isinstance(max_inflight, int) or not 1 <= max_inflight <= MAX_INFLIGHT:
            raise ValueError(f"max_inflight must be an int in [1, {MAX_INFLIGHT}], got {max_inflight!r}")
        _validate_options(num_slots, slot_bytes, staging, timeout_s, direct_min_bytes)
        if not isinstance(max_peer_mappings, int) or not 1 <= max_peer_mappings <= MAX_PEER_MAPPINGS:
            raise ValueError(f"max_peer_mappings must be an int in [1, {MAX_PEER_MAPPINGS}], got {max_peer_mappings!r}")
        self._engine: Any = None
        self._failure: BaseException | None = None  # fail_all's error
        mod = native_cuda_module()
        if not torch.cuda.is_available():
            raise TransportError("CudaIpcTransport needs a CUDA device, but torch.cuda.is_available() is False")

        self._group = group
        if rank is None or world_size is None:
            if not dist.is_initialized():
                raise ValueError("pass rank=, world_size= and store=, or initialise torch.distributed first")
            rank = dist.get_rank(group)
            world_size = dist.get_world_size(group)
        if store is None:
            if not dist.is_initialized():
                raise ValueError("store= is required when torch.distributed is not initialised")
            store = dist.distributed_c10d._get_default_store()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        peers = [p for p in range(world_size) if p != rank] if peers is None else sorted(set(peers))
        for p in peers:
            if p == rank or not 0 <= p < world_size:
                raise ValueError(f"peers must be other ranks in [0, {world_size}), got {p} (this rank is {rank})")

        self._rank = rank
        self._peers = frozenset(peers)
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

        group_name = getattr(group, "group_name", "default") if group is not None else "default"
        prefix = key_prefix or f"{_KEY_PREFIX}/{group_name}"
        # Each rank counts its own constructions: construction is collective, so
        # the counts agree and two transports on one store never share keys.
        generation = store.add(f"{prefix}/generation/{rank}", 1)
        self._prefix = f"{prefix}/{generation}"

        self._engine = mod.IpcEngine(
            rank, self.device.index, num_slots, slot_bytes, staging, direct_min_bytes, max_peer_mappings, max_inflight
        )
        try:
            self._rendezvous(store, sorted(peers))
        except BaseException:
            self._engine.close(0.0)
            self._engine = None
            raise

    # -- rendezvous ---------------------------------------------------------

    def _key(self, src: int, dst: int, what: str) -> str:
        return f"{self._prefix}/{src}->{dst}/{what}"

    def _store_wait(self, store: dist.Store, key: str, peer: int, step: str) -> None:
        who = f"rank {self._rank}: CUDA IPC rendezvous with peer rank {peer}"
        wait_store_key(store, key, self.timeout_s, who, step)

    def _rendezvous(self, store: dist.Store, peers: list[int]) -> None:
        eng = self._engine
        unavailable = native_cuda_module_error_type()
        for p in peers:
            store.set(self._key(p, self._rank, "shm"), eng.create_incoming(p))
        for i, p in enumerate(peers):
            key = self._key(self._rank, p, "shm")
            self._store_wait(store, key, p, "the peer's channel")
            try:
                eng.attach_outgoing(p, store.get(key).decode())
            except RuntimeError as exc:
                # Tell every peer still waiting for us at once rather than let it time out.
                kind = CudaIpcUnavailableError if isinstance(exc, unavailable) else TransportError
                why = "unavailable" if kind is CudaIpcUnavailableError else "error"
                for q in peers[i:]:
                    store.set(self._key(self._rank, q, "attached"), f"{why}: rank {self._rank} -> {p}: {exc}")
                raise kind(f"rank {self._rank}: cannot attach to the channel of peer rank {p}: {exc}") from exc
            store.set(self._key(self._rank, p, "attached"), "1")
        for p in peers:
            key = self._key(p, self._rank, "attached")
            self._store_wait(store, key, p, "the peer to attach")
            answer = store.get(key).decode()
            if answer != "1":
                kind = CudaIpcUnavailableError if answer.startswith("unavailable") else TransportError
                raise kind(f"rank {self._rank}: peer rank {p} could not attach: {answer}")
            try:
                eng.finish_incoming(p)
            except RuntimeError as exc:
                kind = CudaIpcUnavailableError if isinstance(exc, unavailable) else TransportError
                raise kind(f"rank {self._rank}: cannot finish the channel from peer rank {p}: {exc}") from exc

    # -- Transport ----------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rank

    def host_channel(self) -> Transport:
        """Message headers are host bytes: they travel on a torch.distributed transport over the same group
        (gloo: itself, host memory; NCCL: its gloo side group), made at the first call (collective: a pipeline
        asks at construction, on every rank).  Needs the process group (not an explicit rank/store)."""
        side: tuple[Transport, Transport] | None = getattr(self, "_host_channel", None)
        if side is None:
            if not dist.is_initialized():
                raise TransportError("CudaIpcTransport: message headers need a torch.distributed group beside it")
            from dualpipe_kernels.transport.torch_dist import TorchDistTransport

            owner = TorchDistTransport(self._group, device=self.device, timeout_s=self.timeout_s,
                                       split_directions=False)  # fmt: skip
            side = (owner, owner.host_channel())
            self._host_channel: tuple[Transport, Transport] | None = side
        return side[1]

    @property
    def peers(self) -> frozenset[int]:
        return self._peers

    def staging_with(self, peer: int, outgoing: bool = True) -> str:
        """The channel's staging, "ipc" or "host", to ``peer`` (outgoing) or from it."""
        return str(self._live_engine().channel_staging(peer, outgoing))

    def channel_status(self, peer: int, outgoing: bool) -> str:
        """One line about the channel (counters, queue, peer process), for error messages."""
        if self._engine is None:
            return "transport closed"
        try:
            return str(self._engine.channel_status(peer, outgoing))
        except (RuntimeError, ValueError) as exc:
            return f"no channel status ({exc})"

    def stats(self) -> dict[str, int]:
        """What the engine did: zero_copy_sends, staged_sends, zero_copy_recvs, staged_recvs,
        mem_handle_exports (one per exported segment), zero_copy_deferred (large sends staged while
        every export entry was in use), exports_released (segments released after the receiver
        unmapped them), peer_mappings_opened, peer_mappings_closed, exports_leaked, events_created (the
        event pool's: made once, not per message), stream_waits (device counter waits enqueued), peers_died."""
        return dict(self._live_engine().stats())

    def signal_mechanism(self) -> str:
        """How the two processes' streams signal each other: "stream memory ops" or "spin kernels"."""
        return str(self._live_engine().signal_mechanism)

    @property
    def fails_waits(self) -> bool:
        """True: :meth:`fail_all` ends blocked waits at once (the engine fails its ops and wakes their waiters)."""
        return True

    @property
    def failure(self) -> BaseException | None:
        """What :meth:`fail_all` was given (None: nothing failed)."""
        return self._failure

    def fail_all(self, error: BaseException) -> None:
        """Every unfinished and later transfer fails with ``error`` (see :meth:`Transport.fail_all`): the engine
        fails its ops, those already enqueued on the comm streams included (their waits raise; the streams stay
        as they are until :meth:`close`), and the header side channel fails its transfers too."""
        if self._failure is not None:
            return
        self._failure = error  # before the engine wakes the waiters: they read it
        if self._engine is not None:
            self._engine.fail_all(str(error))
        side = getattr(self, "_host_channel", None)
        if side is not None:
            side[0].fail_all(error)

    def _live_engine(self) -> Any:
        if self._engine is None:
            raise TransportError(f"rank {self._rank}: CudaIpcTransport is closed")
        return self._engine

    def _post(self, tensor: torch.Tensor, peer: int, tag: int, what: str, sending: bool) -> CudaIpcHandle:
        verb = "isend to" if sending else "irecv from"
        if peer not in self._peers:
            raise ValueError(f"rank {self._rank}: {verb} peer {peer}, which is not one of this transport's peers")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"rank {self._rank}: {verb} peer {peer} ({what}): expected a tensor, got {type(tensor)}")
        if self._failure is not None:
            raise self._failure
        eng = self._live_engine()
        try:
            op = eng.send(tensor, peer, int(tag)) if sending else eng.recv(tensor, peer, int(tag))
        except ValueError as exc:
            raise ValueError(f"rank {self._rank}: {verb} peer {peer} ({what or 'transfer'}): {exc}") from exc
        except RuntimeError as exc:
            if self._failure is not None:  # the engine refuses posts after fail_all with its text
                raise self._failure from None
            raise TransportError(f"rank {self._rank}: {verb} peer {peer} ({what or 'transfer'}) failed: {exc}") from exc
        return CudaIpcHandle(op, self, peer, int(tag), what, sending)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> CudaIpcHandle:
        return self._post(tensor, peer, tag, what, sending=True)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> CudaIpcHandle:
        return self._post(tensor, peer, tag, what, sending=False)

    def close(self) -> None:
        """Fail unfinished transfers, wait (bounded) for peers to detach, free rings, events and streams."""
        side = getattr(self, "_host_channel", None)
        if side is not None:
            self._host_channel = None
            side[0].close()
        eng, self._engine = self._engine, None
        if eng is not None:
            eng.close(min(self.timeout_s, _CLOSE_TIMEOUT_S))
