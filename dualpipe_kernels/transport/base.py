"""The transport interface: how bytes move between pipeline ranks.

The runtime only sees this surface: post a send, post a receive into a tensor
it owns, get a handle back, wait on the handle with a timeout.  Peers are
*group ranks* of the process group the transport was built with (the runtime
translates pipeline ranks through its rank mapping before calling).

Ownership: the tensor given to ``isend`` must stay alive and unmodified until
its handle completes; the tensor given to ``irecv`` is written by the
transport and must not be read before its handle completes.  ``tag``
disambiguates several transfers in flight between the same pair of ranks;
``what`` is a short human label (e.g. ``"3RECV_F7 tensor 0"``) that goes into
every error message.

Completion: a send may complete only once the peer has posted (and, for a
zero-copy CUDA IPC send of at least ``direct_min_bytes``, even copied) the
matching receive.  So "isend -> wait -> irecv" on both ranks of a pair may
deadlock (it does over CUDA IPC above 1 MiB and passes below): a caller posts
every receive a send's completion could depend on before waiting for that
send.  The runtime never waits for a send before posting the receives of the
same exchange (tests/process/test_runtime_transport_rules.py drives it over a
transport whose sends complete only when matched).

Devices: a transport that moves tensors of one device exposes it as
``device`` (CudaIpcTransport: its CUDA device), and every tensor posted to it
must be on that device (the CUDA transport refuses host tensors).  A
transport without ``device``, or whose ``device_native`` is False (torch over
gloo with a CUDA ``device``: it moves host memory and stages device tensors
through it), takes CPU tensors.  The runtime stages the metadata and
everything else it posts accordingly (runtime/boundary/transfer.py ``wire_device``).

Packed sends: ``isend_packed`` packs several tensors into one message of
``layout.nbytes`` uint8 bytes (:func:`dualpipe_kernels.kernels.pack`); the
receiver posts an ordinary ``irecv`` of a uint8 tensor of that size and unpacks
it.  A transport with staging memory of its own overrides it to pack
straight into that memory (one pass over the bytes: NativeTransport packs a
message that fits one ring slot into a reserved slot); the default packs into
a new buffer and sends that (which, on the native transport, the receiver
reads in place when it is at least ``single_copy_min_bytes``).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

__all__ = [
    "DEFAULT_RECV_LOOKAHEAD",
    "Handle",
    "DoneHandle",
    "DONE",
    "Transport",
    "TransportError",
    "TransportTimeout",
    "DEFAULT_TIMEOUT_S",
    "wait_store_key",
    "group_store",
    "check_timeout",
    "finite_timeout",
    "require_process_group",
]
if TYPE_CHECKING:
    from dualpipe_kernels.kernels import PackLayout


DEFAULT_TIMEOUT_S = 120.0
#: compute actions ahead that a pipeline posts its receives on most transports (see Transport.recv_lookahead)
DEFAULT_RECV_LOOKAHEAD = 2


class TransportError(RuntimeError):
    """A transfer failed (peer gone, size/dtype mismatch, ...). The message names rank, peer and transfer."""


class TransportTimeout(TransportError, TimeoutError):
    """A wait ran past its timeout. The message names rank, peer and transfer."""


class Handle(abc.ABC):
    """An in-flight transfer."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until done; raise TransportTimeout after ``timeout`` seconds (None: the transport default)."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """Non-blocking completion test."""

    def wait_stream(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: current) wait for the transfer without blocking the host.

        Transports without device-side events fall back to a host wait.
        """
        self.wait()


class DoneHandle(Handle):
    """A transfer that is complete already: a send that completed when it was posted (its bytes are in the
    ring), a receive that was waited for.  :data:`DONE` is one (it holds nothing)."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


DONE = DoneHandle()


class _HoldingHandle(Handle):
    """A handle that keeps the buffer it sends alive until the transfer is waited for."""

    def __init__(self, inner: Handle, buffer: torch.Tensor) -> None:
        self._inner = inner
        self._buffer: torch.Tensor | None = buffer

    def wait(self, timeout: float | None = None) -> None:
        self._inner.wait(timeout)
        self._buffer = None

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def wait_stream(self, stream: torch.cuda.Stream | None = None) -> None:
        self._inner.wait_stream(stream)


class Transport(abc.ABC):
    """Point-to-point transport between the ranks of one process group."""

    #: short name, e.g. "torch" or "native"
    name: str = "abstract"

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        # Each transport checks > 0 itself; NaN and inf are refused here for all of them.
        self.timeout_s = finite_timeout(timeout_s)

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's rank in the transport's group."""

    @property
    def recv_lookahead(self) -> int:
        """How many compute actions ahead a pipeline on this transport posts its receives unless told
        (``Pipeline(recv_lookahead=...)``).  Default 2: a posted receive holds its buffer from then on, so a
        longer window costs memory; a transport that gains from earlier posting says so here."""
        return DEFAULT_RECV_LOOKAHEAD

    @property
    def early_small_receives(self) -> bool:
        """Whether a pipeline on this transport posts, when a step starts, every receive whose message repeats
        the last step's small layout (one inline transfer of at most 32 KiB of data and its 1 KiB header, from
        the pipeline's buffer pool), unless told (``Pipeline(early_small_receives=...)``).  Default False: the
        receive window posts them; a transport whose transfers suffer from receives posted mid-stream says so
        here."""
        return False

    @property
    def message_inline_bytes(self) -> int:
        """The largest boundary message (its 1 KiB metadata header and its data) that this transport takes as
        one copy on each side when posted at once (a gathered send, ``try_isend_gather``, and an ``irecv``
        copied by the thread that waits), the same on every rank of its group.  A pipeline sends a repeated
        message up to this size as one transfer whatever its data size (runtime/boundary/inline.py).  Default 0: no
        such promise; the pipeline's own limit (32 KiB of data) applies."""
        return 0

    @abc.abstractmethod
    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        """Post an asynchronous send of a contiguous tensor to group rank ``peer``."""

    @abc.abstractmethod
    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        """Post an asynchronous receive into the contiguous tensor ``tensor`` from group rank ``peer``."""

    def isend_packed(
        self, tensors: Sequence[torch.Tensor], layout: PackLayout, peer: int, tag: int, what: str = ""
    ) -> Handle:
        """Post a send of ``tensors`` (one device, any strides) packed as ``layout`` into one uint8 message.

        The tensors are read before this returns (they may change afterwards);
        the receiver gets ``layout.nbytes`` bytes.  Default: pack into a buffer
        owned by the returned handle, then :meth:`isend` it.
        """
        from dualpipe_kernels.kernels import pack_as

        buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=tensors[0].device)
        pack_as(tensors, layout, buffer, what)
        return _HoldingHandle(self.isend(buffer, peer, tag, what), buffer)

    @property
    def host_wire(self) -> bool:
        """Whether the buffers posted to this transport are host memory, which the runtime may read on the host
        without waiting for a device (a message's header inside its data buffer, small messages built and read
        on the host).  Default: the transport declares no ``device``, or its device is the CPU, or it moves host
        memory and stages device tensors (``device_native`` False).  A device wire (CUDA IPC, NCCL) is False: the
        runtime then never reads what it posts or receives on the host, and sends headers over
        :meth:`host_channel`."""
        dev = getattr(self, "device", None)
        return dev is None or not getattr(self, "device_native", True) or torch.device(dev).type == "cpu"

    @property
    def matches_tags(self) -> bool:
        """Whether transfers are matched by tag (gloo, the native engine).  False: the backend pairs a directed
        pair's transfers in posting order (NCCL); a pipeline then posts through :meth:`in_order` in the order its
        program gives both ends, and ``isend`` / ``irecv`` with tags go through a slower sequencing layer."""
        return True

    def in_order(self, channel: int) -> Transport:
        """A transport posting straight to the backend, matched per directed pair in posting order (tags are
        ignored), kept apart from every other ``channel`` number (one per pipeline on the group).  Only for
        transports whose :attr:`matches_tags` is False."""
        raise NotImplementedError(f"{type(self).__name__} matches transfers by tag; it has no in-order channel")

    def host_channel(self) -> Transport:
        """A tag-matched transport of host tensors to the same peers (group ranks): how message headers travel
        when the wire is not host memory or does not match tags (a CPU side channel beside the wire).  Its tags
        are its own.  Default: this transport itself when it is a tag-matched host wire."""
        if self.host_wire and self.matches_tags:
            return self
        raise NotImplementedError(f"{type(self).__name__} has no host channel for message headers")

    @property
    def fails_waits(self) -> bool:
        """Whether :meth:`fail_all` ends the waits blocked on this transport's handles at once (then a pipeline's
        peer watch waits on them plainly, with no probe or slicing).  Default False: ``fail_all`` does nothing and
        the watch waits in slices, checking for a peer's failure between them."""
        return False

    def fail_all(self, error: BaseException) -> None:
        """Make every unfinished and later transfer fail with ``error``: a ``wait`` blocked on one of this
        transport's handles (or its views') raises ``error`` at once, and so does every later post and wait of a
        transfer that had not completed.  Transfers complete before the call stay complete.  Called by a
        pipeline's peer watch when another rank failed (from the watch's thread); the transport stays open
        until :meth:`close`.  Default: nothing (see :attr:`fails_waits`)."""
        return None

    def close(self) -> None:
        """Release buffers, threads and shared segments. Idempotent."""
        return None

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def finite_timeout(timeout_s: Any, what: str = "timeout_s") -> float:
    """``timeout_s`` as a float; ValueError unless it is a finite number (NaN and inf are refused)."""
    try:
        value = float(timeout_s)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of seconds, got {timeout_s!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number of seconds, got {timeout_s!r}")
    return value


def check_timeout(timeout_s: Any, what: str = "timeout_s") -> float:
    """``timeout_s`` as a float; ValueError unless it is a finite number of seconds > 0."""
    value = finite_timeout(timeout_s, what)
    if value <= 0:
        raise ValueError(f"{what} must be > 0, got {timeout_s!r}")
    return value


def require_process_group(who: str, timeout_s: Any) -> None:
    """The checks of a transport over ``torch.distributed``: ValueError naming ``who`` unless a process group
    is initialised, and unless ``timeout_s`` is a finite number of seconds > 0."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError(f"{who} needs an initialised torch.distributed process group")
    check_timeout(timeout_s)


def group_store(group: Any) -> Any:
    """The ``torch.distributed`` store ``group`` was created with (a PrefixStore for subgroups)."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_process_group_store(group)
    except (AttributeError, KeyError):
        return dist.distributed_c10d._get_default_store()


def wait_store_key(store: Any, key: str, timeout_s: float, who: str, step: str) -> None:
    """Wait until ``key`` is set in the rendezvous ``store`` (a ``torch.distributed.Store``).

    On timeout: TransportTimeout "``who`` timed out after T s waiting for ``step`` (store key K)",
    e.g. ``who`` = "rank 1: native transport rendezvous", ``step`` = "peer rank 0's ring name".
    """
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - stores raise several types on timeout
        raise TransportTimeout(
            f"{who} timed out after {timeout_s:.3g} s waiting for {step} (store key {key!r}): {exc}"
        ) from None
