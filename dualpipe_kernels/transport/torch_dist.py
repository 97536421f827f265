"""Transport over ``torch.distributed`` point-to-point: gloo (CPU tensors; CUDA ones host-staged) or NCCL.

Peers are *group ranks* of ``group``.  Tags keep several transfers between the
same pair apart; gloo matches on them.  NCCL ignores tags (it matches a pair's
transfers in posting order, both directions on one stream), which the
runtime's early, tag-addressed receives do not follow: over an NCCL group
every transfer therefore goes through :class:`~.ordered.OrderedP2P`, which
numbers a pair's transfers in the order their senders post them and posts
them in that order on both ranks (``ordered=True`` does the same over gloo,
which is how the ordering is tested on CPU).

gloo's send/recv work objects only report completion from ``wait()``
(``is_completed()`` stays False until then), and a gloo wait that times out
closes the connection.  So a gloo transfer whose completion is *polled*
(``is_completed``) is handed to a small pool of daemon *waiter threads* (gloo_waiters.py)
(blocked in C++ with the GIL released), which turns completion into an event
the runtime can poll without blocking: that is what lets it post a data
receive the moment its metadata is in, and free a sent activation the moment
its send is done.  Transfers that are only ever waited on cost no thread.

Over gloo the two directions of a pair use two process groups: transfers to a
higher rank go over ``group``, transfers to a lower rank over a second gloo
group of the same ranks (a gloo backend of its own, made by the first transport
on that group in a process and shared by the later ones: ``split_directions``).  A gloo
transfer is a rendezvous (the receiver's post announces it, the sender's post
announces its data and writes it when the receiver's notice is in, otherwise
gloo's TCP loop thread writes it later), and the loop thread reads a pair's
socket only while it holds the pair's lock, which a post on the rank's own
thread takes too.  On one group a rank's posts to a peer and the messages
arriving from it contend for that one lock and loop thread; with the
directions apart they do not.  DualPipeV 2 x 16 of tiny stages: 32-33 ms per
step -> 21 ms (torch's ``ScheduleDualPipeV`` on the same gloo: 36-42 ms); 1F1B:
19-22 ms -> 14-15 ms, the loop thread's CPU time halved (torch: 12-15 ms).

CUDA tensors over a backend that cannot move them (gloo) are staged through
pinned host buffers: the send copies to the host without blocking the stream
and waits for that copy's event before posting; the receive copies to the
device, without blocking the host, on the stream current when it is waited on.
"auto" never picks this path (an NCCL group does); it is for ``transport="torch"``
on a gloo group, which works on one GPU with several ranks, not for speed.

Shutdown: a waiter thread still blocked in gloo when the interpreter finalizes
would, once its wait returns (the peer exits), be stopped by Python while it
re-takes the GIL inside a C++ frame, and the process aborts ("terminate called
without an active exception").  So :meth:`TorchDistTransport.close` (and an
exit hook for a transport never closed) cancels what is still in flight and
joins the waiters: it times out one receive that nobody sends, which makes gloo
fail every pending transfer of the group's context (the same thing a timed-out
gloo wait always does), so the peers fail at once too instead of at their
timeout.  The group's gloo pairs are closed then, so this runs only when
transfers are still in flight (posted, never seen finished), i.e. after a
failed step.  :meth:`TorchDistTransport.fail_all` (a peer failed) cancels the same way, at once.

Files: the handles in torch_handles.py, the in-order and side-channel views in torch_channels.py, the
further process groups (the downward direction, the side channel, NCCL channels) in torch_groups.py.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dualpipe_kernels.transport.base import (
    DEFAULT_RECV_LOOKAHEAD,
    DEFAULT_TIMEOUT_S,
    Handle,
    Transport,
    TransportError,
    group_store,
    require_process_group,
)
from dualpipe_kernels.transport.gloo_waiters import WaiterPool
from dualpipe_kernels.transport.ordered import OrderedP2P
from dualpipe_kernels.transport.torch_channels import InOrderChannel, SideChannel
from dualpipe_kernels.transport.torch_groups import direction_group
from dualpipe_kernels.transport.torch_handles import WorkHandle

__all__ = ["TorchDistTransport"]

# A tag the runtime never uses (its tags stay below 2**31 - 1: boundary.header.TagSpace): the cancelling receive.
_CANCEL_TAG = 2**31 - 1
_JOIN_S = 5.0  # how long close() waits for cancelled waiters to leave gloo

#: receives posted this many compute actions ahead over gloo (TorchDistTransport.recv_lookahead; why 9, not 8:
#: see there)
GLOO_RECV_LOOKAHEAD = 9


class TorchDistTransport(Transport):
    """Point-to-point over a ``torch.distributed`` process group (default group when ``group`` is None)."""

    name = "torch"

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        ordered: bool | None = None,
        split_directions: bool | None = None,
    ) -> None:
        """``ordered``: sequence every pair's transfers (see ordered.py); default: exactly for NCCL groups.

        ``split_directions`` (default: on for an unordered gloo group of two or more ranks): transfers to a
        lower rank go over a second gloo group of the same ranks (see the module docstring).  Construction
        is then collective over ``group`` the first time in a process: every member builds the transport
        (as a Pipeline does).  The second group is made once per group and shared by its transports.
        """
        super().__init__(timeout_s)
        require_process_group("TorchDistTransport", timeout_s)
        world = dist.group.WORLD
        assert group is not None or world is not None  # require_process_group: a default group exists
        self.group: dist.ProcessGroup = group if group is not None else world  # type: ignore[assignment]
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._rank = dist.get_rank(self.group)
        self._size = dist.get_world_size(self.group)
        nccl = "nccl" in str(dist.get_backend(self.group)).lower()
        if nccl and self.device.type != "cuda":
            raise ValueError(f"an NCCL group moves CUDA tensors; got device {self.device}")
        if nccl and ordered is False:
            raise ValueError("NCCL ignores tags: its transfers must be ordered (ordered=False is gloo only)")
        # gloo moves host memory only: CUDA tensors are staged through the host.
        self.device_native = nccl or self.device.type == "cpu"
        # The waiters' own limit is generous: a caller's wait enforces its timeout.
        self.waiters = WaiterPool(max(timeout_s, 1.0) * 4)
        if split_directions and nccl:
            raise ValueError("split_directions applies to gloo transfers (not NCCL)")
        self._nccl = nccl
        self._ordered_mode = bool(nccl or ordered)
        # The store-sequenced tag layer (ordered.py) for callers that post by tag in any order: made at its first
        # use, so a pipeline that posts in program order (in_order) costs no store traffic and no worker thread.
        self._ordered: OrderedP2P | None = None
        self._ordered_lock = threading.Lock()
        self._side: SideChannel | None = None
        self._in_order: dict[int, InOrderChannel] = {}
        if split_directions is None:
            split_directions = not nccl and self._size > 1
        # Transfers to a lower group rank (None: everything over ``group``).
        self._down: Any = direction_group(self.group, timeout_s) if split_directions else None
        # Transfers posted and not seen finished (one whose handle was dropped unwaited stays counted).
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        self._pinned: list[tuple[Any, torch.Tensor]] = []  # host staging buffers of copies still running
        self._closed = False
        self._failure: BaseException | None = None  # fail_all's error
        # A transport left open at exit is closed before the interpreter finalizes (see the module doc).
        self._exit_hook = _exit_hook(weakref.ref(self))
        atexit.register(self._exit_hook)

    def _sequencer(self) -> OrderedP2P:
        """The store-sequenced tag layer (built at the first tagged transfer of an ordered transport)."""
        with self._ordered_lock:
            if self._ordered is None:
                self._ordered = self._make_ordered(self._nccl)
            return self._ordered

    def _make_ordered(self, nccl: bool) -> OrderedP2P:
        group = self.group

        def post_send(buf: torch.Tensor, peer: int) -> dist.Work:
            work = dist.isend(buf, group=group, group_dst=peer)
            assert work is not None
            return work

        def post_recv(buf: torch.Tensor, peer: int) -> dist.Work:
            work = dist.irecv(buf, group=group, group_src=peer)
            assert work is not None
            return work

        # An NCCL work's completion can be queried; a gloo one's only waited on (by a waiter thread).
        watch = None if nccl else self.waiters.submit
        return OrderedP2P(group_store(group), self._rank, self._size, self.device, post_send, post_recv, watch,
                          self.timeout_s)  # fmt: skip

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def recv_lookahead(self) -> int:
        """Over gloo, 9: a receive posted before its sender's send lets gloo deliver the data at once, and
        the late ones cost its TCP loop thread CPU time on the cores the ranks use (DualPipeV 2 x 16 of tiny
        stages: 920 -> 696 us per action, 2 -> 8).  Over NCCL (ordered posting), the default 2.

        Odd, not 8: the window moves at compute actions, so in a schedule whose steady state repeats a
        short cycle of computes (1F1B: F, B) the lookahead's residue picks the point in the cycle where
        new receives are posted.  With an even lookahead 1F1B posts them right before the compute that
        waits for a receive from the same peer, and gloo then stalls transfers by milliseconds (steps of
        2 x 16 tiny stages: 12.2 ms at 8 against 6.4-6.5 ms at 9, two runs taking turns in one process;
        at 1, 3 and 7 also 4-7 ms, at 2 and 4 14-15 ms).  9 is as fast as 8 within the runs' spread on
        GPipe, ZB1P, ZB-V, interleaved 1F1B, DualPipe and DualPipeV (0.89-1.08 of 8); 7 is not (ZB1P,
        cycle F, I, W: 1.4-1.6 of 8).  Measured, not derived: which point of a cycle gloo dislikes is
        read off these runs, not off gloo's code.  With :attr:`early_small_receives` (on over gloo) the
        window places only the receives of messages above the inline size."""
        return DEFAULT_RECV_LOOKAHEAD if self._nccl else GLOO_RECV_LOOKAHEAD

    @property
    def early_small_receives(self) -> bool:
        """Over gloo, True: a receive posted while transfers from its peer are arriving stalls them (the
        parity finding above was one face of it).  Posting every small repeated receive of a step when it
        starts, steps of 2 x 16 tiny stages, taking turns with the window of 9 in one process (two runs):
        1F1B 0.63-0.65, GPipe 0.52-0.54, ZB1P 0.48-0.89, ZB-V 0.49-0.53, interleaved 1F1B 0.35-0.37,
        DualPipe 0.55-0.59, DualPipeV 0.42-0.60 of the window's step time (on the native transport the
        same change measured 0.98-1.06, so it stays off there).  The buffers are the inline ones (at most
        33 KiB each), so the memory is bounded by the step's message count.  Over NCCL (ordered posting),
        False."""
        return not self._nccl

    @property
    def ordered(self) -> bool:
        """Whether transfers are sequenced per pair (NCCL), not matched by tag."""
        return self._ordered_mode

    @property
    def matches_tags(self) -> bool:
        return not self._ordered_mode

    def in_order(self, channel: int) -> Transport:
        """Posting straight to the backend in call order, per directed pair (see :meth:`Transport.in_order`).

        Over gloo (``ordered=True``) every transfer of ``channel`` carries the tag ``channel + 1`` (0 is the
        sequencing layer's), so gloo matches a channel's transfers in posting order as NCCL does, and two
        channels never meet; transfers to a lower rank go over the second gloo group, as unordered ones do.
        Over NCCL, the first channel made on this transport is ``group`` and each other a communicator of its
        own over the same ranks; transfers to a lower rank go over a second communicator, so a send blocked
        on its receiver never holds back the opposite direction (each communicator carries one direction of
        a pair)."""
        if not self._ordered_mode:
            raise ValueError("in_order applies to an ordered transport (NCCL, or gloo with ordered=True)")
        if channel < 0 or channel + 1 >= _CANCEL_TAG:
            raise ValueError(f"in_order: channel must be in 0..{_CANCEL_TAG - 2}, got {channel}")
        view = self._in_order.get(channel)
        if view is None:
            view = self._in_order[channel] = InOrderChannel(self, channel)
        return view

    def host_channel(self) -> Transport:
        """This transport when it is a tag-matched host wire; else a gloo group of the same ranks beside it
        (headers and the rare message whose layout the receiver did not know, staged through the host)."""
        if self.host_wire and self.matches_tags:
            return self
        if self._side is None:
            self._side = SideChannel(self)
        return self._side

    @property
    def fails_waits(self) -> bool:
        """Unordered (gloo, tag-matched): True, see :meth:`fail_all`.  Ordered (NCCL, or gloo sequenced through
        the store): False; a peer watch waits on its handles in slices."""
        return not self._ordered_mode

    @property
    def failure(self) -> BaseException | None:
        """What :meth:`fail_all` was given (None: nothing failed)."""
        return self._failure

    def fail_all(self, error: BaseException) -> None:
        """Every unfinished and later transfer fails with ``error`` (see :meth:`Transport.fail_all`).

        gloo's wait blocks in C++ with no way to wake it but the work failing, so this cancels the transfers in
        flight the way :meth:`close` does (a receive nobody sends, timed out, fails every pending transfer of the
        group's gloo context): the waits blocked in them raise, and their handles raise ``error`` instead.  It
        costs nothing per transfer (no polling, no waiter thread); the group's pairs are closed afterwards, so
        the transport (and ``group`` for point-to-point) is spent, as after any failed step.  With nothing in
        flight nothing is cancelled: later posts and waits raise ``error``, and the group stays usable.  Ordered: only
        later posts and failing waits raise ``error`` (:attr:`fails_waits` is False)."""
        if self._failure is not None or self._closed:
            return
        self._failure = error  # first: a wait that starts after this raises it (WorkHandle.wait)
        if not self._ordered_mode and (self._in_flight or self.waiters.busy()):
            self._cancel_in_flight()  # nothing in flight: the group's pairs stay open
        elif self._side is not None:
            self._cancel_side()  # the headers' gloo group beside an NCCL one

    def track(self, delta: int) -> None:
        with self._in_flight_lock:
            self._in_flight += delta

    def check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self._size or peer == self._rank:
            raise ValueError(f"rank {self._rank}: bad peer {peer} for {what!r} (group of {self._size})")
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise TransportError(f"rank {self._rank}: transport closed; cannot post {what!r}")

    def stage_send(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the buffer the backend sends, a host staging copy to keep alive until the send completes or None).

        A CUDA tensor over gloo (host staging, only when asked for): copied into pinned host memory without
        blocking the stream, then the host waits for that copy's event alone (gloo reads the bytes at once)."""
        if tensor.device.type == "cpu" or self.device_native:
            return tensor, None
        buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
        buf.copy_(tensor, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(tensor.device))
        copied.synchronize()
        return buf, buf

    def stage_recv(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """(the buffer the backend receives into, the copy into ``tensor`` to run on completion or None).

        A CUDA tensor over gloo: received into pinned host memory, then copied to the device without blocking
        the host, on the stream current when the receive is waited for (what reads the tensor next); the
        pinned buffer is kept until that copy's event has passed."""
        if tensor.device.type == "cpu" or self.device_native:
            return tensor, None
        buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)

        def finish() -> None:
            tensor.copy_(buf, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(tensor.device))
            self._keep_until(done, buf)

        return buf, finish

    def _keep_until(self, event: Any, buf: torch.Tensor) -> None:
        """Hold ``buf`` until ``event`` has passed (drops the pinned buffers whose copies are done)."""
        with self._in_flight_lock:
            self._pinned = [(e, b) for e, b in self._pinned if not e.query()]
            self._pinned.append((event, buf))

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        self.check_peer(peer, what)
        if not tensor.is_contiguous():
            raise ValueError(f"rank {self._rank}: isend needs a contiguous tensor ({what})")
        if self._ordered_mode:
            return self._sequencer().isend(tensor, peer, tag, what)
        buf, keep = self.stage_send(tensor)
        group = self.group if self._down is None or peer > self._rank else self._down
        try:
            # The group's own send (what dist.isend calls after its per-call argument checks).
            work = group.send([buf], peer, tag)
        except RuntimeError as exc:
            if self._failure is not None:  # fail_all closed the pairs meanwhile
                raise self._failure from None
            raise TransportError(f"rank {self._rank} -> peer rank {peer}: posting {what} failed: {exc}") from exc
        assert work is not None
        return WorkHandle(work, self, peer, what, keep=keep)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        self.check_peer(peer, what)
        if not tensor.is_contiguous():
            raise ValueError(f"rank {self._rank}: irecv needs a contiguous tensor ({what})")
        if self._ordered_mode:
            return self._sequencer().irecv(tensor, peer, tag, what)
        buf, finish = self.stage_recv(tensor)
        # The sender's choice: a transfer to the higher of the two ranks goes over ``group``.
        group = self.group if self._down is None or peer < self._rank else self._down
        try:
            work = group.recv([buf], peer, tag)
        except RuntimeError as exc:
            if self._failure is not None:  # fail_all closed the pairs meanwhile
                raise self._failure from None
            raise TransportError(f"rank {self._rank} <- peer rank {peer}: posting {what} failed: {exc}") from exc
        assert work is not None
        return WorkHandle(work, self, peer, what, finish)

    def close(self) -> None:
        """Idempotent.  Transfers still in flight (a failed step) are cancelled: the group's gloo pairs close,
        and peers waiting on them fail at once."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._exit_hook)
        if self._ordered is not None:
            self._ordered.close()
        if self._in_flight or self.waiters.busy():
            self._cancel_in_flight()
        self.waiters.close(_JOIN_S)

    def _cancel_in_flight(self) -> None:
        # gloo answers a receive that times out by failing every pending transfer of the context.
        if self._size < 2:
            return
        peer = (self._rank + 1) % self._size
        try:
            work = dist.irecv(torch.empty(1), group=self.group, group_src=peer, tag=_CANCEL_TAG)
            if work is not None:  # None only when this rank is not in the group
                work.wait(timedelta(milliseconds=1))
        except RuntimeError:
            pass
        if self._down is not None:
            try:
                self._down.recv([torch.empty(1)], peer, _CANCEL_TAG).wait(timedelta(milliseconds=1))
            except RuntimeError:
                pass
        self._cancel_side()

    def _cancel_side(self) -> None:
        if self._side is None or self._size < 2:
            return
        try:
            cancel = self._side.backend.recv([torch.empty(1, device="cpu")], (self._rank + 1) % self._size, _CANCEL_TAG)
            cancel.wait(timedelta(milliseconds=1))
        except RuntimeError:
            pass


def _exit_hook(ref: weakref.ReferenceType[TorchDistTransport]) -> Callable[[], None]:
    def close_at_exit() -> None:
        transport = ref()
        if transport is not None:
            transport.close()

    return close_at_exit
