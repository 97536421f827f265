"""Boundary communication: post, complete and reap this rank's SEND/RECV actions.

Which rank and which datum each comm action moves is read from the schedule's
dependency program (:class:`~dualpipe_kernels.schedules.deps.Program`): a
RECV's remote need, a SEND's destination.  The transport's message key is the
datum's ``(kind, producer stage, mb)`` (:meth:`Program.tag_key`), so both ends
name a transfer the same way without a rule of their own.

Per step (:class:`BoundaryState`): the receives posted and not yet consumed,
the receives the action list has reached (waited for by the compute that
reads them), and the sends in flight (waited lazily, polled between actions).
Every wait has ``timeout_s``; errors name this pipeline rank, the peer, the
action and the micro-batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dualpipe_kernels.runtime.boundary.codec import BoundaryFormat
from dualpipe_kernels.runtime.boundary.header import TagSpace
from dualpipe_kernels.runtime.boundary.layout_memory import Channels, LayoutMemory, MessageKey
from dualpipe_kernels.runtime.boundary.repeat import SENT, RepeatRecvOp, SmallSend, post_repeat, same_signature
from dualpipe_kernels.runtime.boundary.transfer import BoundaryRecv, BoundarySend
from dualpipe_kernels.schedules.deps import ROLE_RECV, Program
from dualpipe_kernels.schedules.ir import T_RECV_B, T_RECV_F, T_SEND_B, T_SEND_F, Action
from dualpipe_kernels.transport.base import DONE, Transport

__all__ = ["Boundary", "BoundaryState", "Wire", "pair_orders", "pair_order_digest"]


def pair_orders(program: Program) -> dict[tuple[int, int], tuple[MessageKey, ...]]:
    """(sender, receiver) pipeline ranks -> the keys of the messages the sender sends the receiver in a step,
    in the order its action list sends them: the order both ends of a pair post them in on an in-order
    channel (the receiver's receives of one sender, whatever their place in its own list, are posted in it)."""
    out: dict[tuple[int, int], list[MessageKey]] = {}
    for r, actions in enumerate(program.schedule.actions):
        for i, a in enumerate(actions):
            if a.type in (T_SEND_F, T_SEND_B):
                key, dest = program.sends[r][i][0]
                out.setdefault((r, dest), []).append(program.tag_key(key))
    return {pair: tuple(keys) for pair, keys in out.items()}


def pair_order_digest(program: Program) -> str:
    """A short digest of :func:`pair_orders` (compared across ranks at construction)."""
    h = hashlib.blake2b(digest_size=8)
    for pair, keys in sorted(pair_orders(program).items()):
        h.update(repr((pair, keys)).encode())
    return h.hexdigest()


@dataclass
class BoundaryState:
    """One step's transfers on this rank.

    ``recvs``: posted receives not yet waited for, by RECV action index;
    ``reached_f`` / ``reached_b``: RECV_F / RECV_B actions the list has reached,
    ``(stage, mb) -> action index`` (waited for by the compute that reads them);
    ``watch``: posted receives that need :meth:`BoundaryRecv.progress` calls to
    post their data receives (first messages of a key on a transport without
    completion callbacks); ``sends``: sends in flight, in posting order, polled between actions;
    ``small_sends``: inline sends, which hold only their own small copy, waited for at the end.
    """

    forward_only: bool
    recvs: dict[int, BoundaryRecv | RepeatRecvOp] = field(default_factory=dict)
    reached_f: dict[tuple[int, int], int] = field(default_factory=dict)
    reached_b: dict[tuple[int, int], int] = field(default_factory=dict)
    watch: list[BoundaryRecv] = field(default_factory=list)
    sends: list[tuple[BoundarySend, tuple[torch.Tensor, ...]]] = field(default_factory=list)
    small_sends: list[BoundarySend | SmallSend] = field(default_factory=list)
    #: in-order channels: per sender (pipeline rank), how many of its messages this step's receives took
    #: their place for (:func:`pair_orders`)
    cursor: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Route:
    """What one SEND/RECV action moves, resolved once per pipeline: the transport's message key,
    the peer's group rank, the boundary format and the description errors carry."""

    key: tuple[int, int, int]
    peer: int
    fmt: BoundaryFormat
    what: str
    meta_tag: int  # the tag of the message's metadata (slot 0), which an inline message travels under


@dataclass(frozen=True)
class Wire:
    """How this pipeline rank reaches its peers (shared by the boundary transfers and the mirror sync).

    ``to_group_rank[pipeline rank]``: the peer's rank in the process group;
    ``layouts``: message layouts of the previous step (speculative receives, layout_memory.py);
    ``device``: where received tensors go; ``timeout_s``: every wait;
    ``boundary_format``: how stage-boundary messages are encoded (codec.py;
    the end-of-step exchanges always go unpacked).
    """

    rank: int
    transport: Transport
    to_group_rank: Sequence[int]
    tags: TagSpace
    layouts: LayoutMemory
    device: torch.device
    timeout_s: float
    boundary_format: BoundaryFormat = BoundaryFormat()


@dataclass
class Boundary:
    """This rank's stage-boundary transfers over ``wire`` (see the module docstring).

    ``bytes_sent`` / ``messages_sent``: data bytes (packed buffers or tensors, without
    metadata) and messages this rank has sent, per direction (0 activations, 1 gradients).
    """

    wire: Wire
    program: Program
    bytes_sent: list[int] = field(default_factory=lambda: [0, 0])
    messages_sent: list[int] = field(default_factory=lambda: [0, 0])
    _routes: dict[int, _Route] = field(default_factory=dict)
    #: in-order channels (None on a tag-matched wire): RECV action -> (sender, its place in the pair's order),
    #: and per sender this rank's RECV actions in the pair's order
    _place: dict[int, tuple[int, int]] | None = field(default=None, init=False)
    _by_sender: dict[int, list[int]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.channels: Channels = self.wire.layouts.channels(self.wire.transport)
        self._data = self.channels.data  # where repeated messages go (a property: read once)
        # its receives with no handle (the native engine's), when it has them: repeated messages post there
        self._raw = getattr(self._data, "irecv_raw", None)
        if self.channels.ordered is not None:
            self._order_receives()
        for i, a in enumerate(self.actions):  # every route resolved now, not in a step
            if a.type in (T_SEND_F, T_SEND_B, T_RECV_F, T_RECV_B):
                self._route(i)

    def _order_receives(self) -> None:
        """Place each RECV action of this rank in its sender's order (:func:`pair_orders`)."""
        orders = pair_orders(self.program)
        place: dict[int, tuple[int, int]] = {}
        by_sender: dict[int, list[int]] = {}
        index = {src: {k: n for n, k in enumerate(keys)} for (src, dst), keys in orders.items() if dst == self.rank}
        for i, a in enumerate(self.actions):
            if self.program.role[self.rank][i] != ROLE_RECV:
                continue
            key, src = self._recv_source(i)
            n = index.get(src, {}).get(self.program.tag_key(key))
            if n is None:
                raise ValueError(
                    f"pipeline rank {self.rank}: {a} receives a message that pipeline rank {src} never sends"
                )
            place[i] = (src, n)
            by_sender.setdefault(src, []).append(i)
        for src, recvs in by_sender.items():
            recvs.sort(key=lambda i: place[i][1])
            if len(recvs) != len(index[src]):
                raise ValueError(
                    f"pipeline rank {self.rank}: receives {len(recvs)} messages from pipeline rank {src}, "
                    f"which sends it {len(index[src])}"
                )
        self._place, self._by_sender = place, by_sender

    @property
    def rank(self) -> int:
        return self.wire.rank

    @property
    def actions(self) -> list[Action]:
        return self.program.schedule.actions[self.wire.rank]

    def _route(self, i: int) -> _Route:
        """The route of comm action ``i`` (cached: a step's list repeats every step)."""
        route = self._routes.get(i)
        if route is None:
            a = self.actions[i]
            sending = a.type in (T_SEND_F, T_SEND_B)
            key, peer = self.program.sends[self.rank][i][0] if sending else self._recv_source(i)
            arrow = "to" if sending else "from"
            what = f"pipeline rank {self.rank}: {a} (micro-batch {a.microbatch}) {arrow} peer pipeline rank {peer}"
            tag = self.program.tag_key(key)
            w = self.wire
            route = self._routes[i] = _Route(tag, w.to_group_rank[peer], w.boundary_format, what, w.tags.tag(*tag, 0))
        return route

    def _recv_source(self, i: int) -> tuple[int, int]:
        key = self.program.remote[self.rank][i][0]
        return key, self.program.topo.key_rank(key)

    # ---- receives -------------------------------------------------------------
    def post_recv(self, st: BoundaryState, i: int, repeats_only: bool = False) -> None:
        """Post the receive of RECV action ``i`` (once); ``repeats_only``: only if its message repeats the last
        step's small layout (one inline transfer from the buffer pool).

        On an in-order channel, the receives of the same sender that come before ``i`` in its order are
        posted first (each once), so both ends post the pair's transfers in the same order."""
        if i in st.recvs:
            return
        if self._place is not None:
            src, n = self._place[i]
            done = st.cursor.get(src, 0)
            if n < done:
                return  # posted already (and maybe consumed)
            order = self._by_sender[src]
            for m in range(done, n + 1):
                j = order[m]
                if st.forward_only and self.actions[j].type is T_RECV_B:  # no gradients in forward-only
                    continue
                if repeats_only and self.wire.layouts.repeat_recv.get(self._route(j).key) is None:
                    st.cursor[src] = m  # the order stops at the first message that does not repeat
                    return
                self._post_one(st, j, False)
            st.cursor[src] = n + 1
            return
        r = self._routes[i]
        repeat = self.wire.layouts.repeat_recv.get(r.key)
        if repeat is not None:  # _post_one's first case inline (once per receive)
            st.recvs[i] = post_repeat(self.wire.layouts, repeat, self._data, r.peer, r.meta_tag, r.what, self._raw)
        else:
            self._post_one(st, i, repeats_only)

    def _post_one(self, st: BoundaryState, i: int, repeats_only: bool) -> None:
        r = self._routes[i]  # resolved at construction
        w = self.wire
        repeat = w.layouts.repeat_recv.get(r.key)
        if repeat is not None:  # the layout of the last step's message, inline (repeat.py)
            st.recvs[i] = post_repeat(w.layouts, repeat, self._data, r.peer, r.meta_tag, r.what, self._raw)
            return
        if repeats_only:
            return
        # Transport errors already name this rank, the peer, the action and the micro-batch (``what``).
        recv = BoundaryRecv(w.transport, r.peer, w.tags, r.key, r.what, w.device, w.layouts, r.fmt)
        st.recvs[i] = recv
        if recv.needs_progress:
            st.watch.append(recv)

    def post_repeats(self, st: BoundaryState, indices: Sequence[int]) -> None:
        """Post the receives among RECV actions ``indices`` whose message repeats the last step's small
        layout; the others wait for the window."""
        if self.wire.layouts.repeat_recv:
            for i in indices:
                self.post_recv(st, i, repeats_only=True)

    def progress(self, st: BoundaryState) -> None:
        """Post the data receives of watched messages whose metadata is in."""
        st.watch = [r for r in st.watch if not r.progress()]

    def complete_recv(self, st: BoundaryState, i: int) -> list[torch.Tensor | None]:
        """Wait for RECV action ``i``'s data (posting it first if the window has not)."""
        if i not in st.recvs:
            self.post_recv(st, i)
        recv = st.recvs.pop(i)
        w = self.wire
        device = w.device
        if isinstance(recv, RepeatRecvOp):
            if recv.link is None:
                recv.handle.wait(w.timeout_s)
            else:  # a bare engine request (irecv_raw)
                recv.link.wait_raw(recv.handle, w.timeout_s)
            tensors = recv.tensors(w.layouts, device)
            if tensors is not None:
                return tensors
            # The sender's layout changed: the general protocol reads what arrived (a waited request: DONE).
            r = self._routes[i]
            posted = (recv.handle if recv.link is None else DONE, recv.buf)
            recv = BoundaryRecv(w.transport, r.peer, w.tags, r.key, r.what, device, w.layouts, r.fmt, posted)
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        return recv.wait(w.timeout_s, stream)

    # ---- sends --------------------------------------------------------------------
    def send(
        self,
        st: BoundaryState,
        i: int,
        tensors: Sequence[torch.Tensor | None],
        grad_flags: Sequence[bool],
        keep: tuple[torch.Tensor, ...] = (),
    ) -> None:
        """Post SEND action ``i`` of ``tensors``; ``keep``: hook outputs whose storage goes once sent."""
        r = self._routes[i]
        w = self.wire
        repeat = None if keep else w.layouts.repeat_send.get(r.key)
        if repeat is not None and same_signature(repeat.sig, tensors, grad_flags):
            # The layout of the last step's message, which the receiver posted inline (repeat.py).
            small = repeat.post(self._data, tensors, r.peer, r.meta_tag, r.what)
            if small is not SENT:  # delivered already (gathered into the ring): nothing to wait for
                st.small_sends.append(small)
            nbytes = repeat.plan.nbytes
        else:
            send = BoundarySend(w.transport, tensors, grad_flags, r.peer, w.tags, r.key, r.what, w.layouts, r.fmt)
            nbytes = send.data_bytes
            if send.small and not keep:
                # Holds only its own small copy: waited for at the end of the step, never polled (a poll
                # may cost a thread hand-off, e.g. over gloo, for memory that does not matter).
                st.small_sends.append(send)
            else:
                st.sends.append((send, keep))
        self.bytes_sent[r.key[0]] += nbytes
        self.messages_sent[r.key[0]] += 1

    def reap(self, st: BoundaryState, block: bool) -> None:
        """Wait for the completed sends (all of them when ``block``) and release what they held."""
        sends = st.sends
        n = 0
        # Sends complete roughly in posting order: stop polling at the first
        # one still in flight (it is polled again at the next action).
        while n < len(sends) and (block or sends[n][0].is_completed()):
            send, hooked = sends[n]
            send.wait(self.wire.timeout_s)
            for t in hooked:
                # The reference's memory trick: the hook path keeps output tensors
                # (for outputs1), so drop their storage once sent.
                if t is not None and t.requires_grad and t._base is None:
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
            n += 1
        if n:
            del sends[:n]
        if block:
            for small in st.small_sends:
                small.wait(self.wire.timeout_s)
            st.small_sends.clear()

    def check_drained(self, st: BoundaryState) -> None:
        """Every posted receive was consumed (called at the end of a step)."""
        if st.recvs:
            leftovers = [str(self.actions[i]) for i in st.recvs]
            raise RuntimeError(f"pipeline rank {self.rank}: receives posted but never consumed: {leftovers}")
