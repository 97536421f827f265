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

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dualpipe_kernels.runtime.boundary_codec import BoundaryFormat
from dualpipe_kernels.runtime.p2p import BoundaryRecv, BoundarySend, LayoutMemory, TagSpace
from dualpipe_kernels.schedules.deps import Program
from dualpipe_kernels.schedules.ir import T_SEND_B, T_SEND_F, Action, ActionType
from dualpipe_kernels.transport import Transport

__all__ = ["Boundary", "BoundaryState", "RecvKey", "Wire"]

RecvKey = tuple[ActionType, int, int]  # (RECV type, consumer stage, micro-batch)


@dataclass
class BoundaryState:
    """One step's transfers on this rank."""

    forward_only: bool
    recvs: dict[RecvKey, BoundaryRecv] = field(default_factory=dict)  # posted, not yet waited for
    reached: dict[RecvKey, int] = field(default_factory=dict)  # RECVs the list reached -> their index
    sends: list[tuple[BoundarySend, tuple[torch.Tensor, ...]]] = field(default_factory=list)


@dataclass(frozen=True)
class Wire:
    """How this pipeline rank reaches its peers (shared by the boundary transfers and the mirror sync).

    ``to_group_rank[pipeline rank]``: the peer's rank in the process group;
    ``layouts``: message layouts of the previous step (speculative receives, p2p.py);
    ``device``: where received tensors go; ``timeout_s``: every wait;
    ``boundary_format``: how stage-boundary messages are encoded (boundary_codec.py;
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

    @property
    def rank(self) -> int:
        return self.wire.rank

    @property
    def actions(self) -> list[Action]:
        return self.program.schedule.actions[self.wire.rank]

    def _what(self, a: Action, peer: int) -> str:
        arrow = "to" if a.type in (T_SEND_F, T_SEND_B) else "from"
        return f"pipeline rank {self.rank}: {a} (micro-batch {a.microbatch}) {arrow} peer pipeline rank {peer}"

    # ---- receives -------------------------------------------------------------
    def post_recv(self, st: BoundaryState, i: int, skip_grads: bool) -> None:
        """Post the receive of RECV action ``i`` (once; not at all for a gradient when ``skip_grads``)."""
        a = self.actions[i]
        k = (a.type, a.stage, a.microbatch)
        if k in st.recvs or skip_grads:
            return
        key = self.program.remote[self.rank][i][0]
        peer = self.program.topo.key_rank(key)
        w = self.wire
        # Transport errors already name this rank, the peer, the action and the micro-batch (``what``).
        tag, what = self.program.tag_key(key), self._what(a, peer)
        fmt = w.boundary_format.for_direction(tag[0])
        st.recvs[k] = BoundaryRecv(w.transport, w.to_group_rank[peer], w.tags, tag, what, w.device, w.layouts, fmt)

    def progress(self, st: BoundaryState) -> None:
        for r in st.recvs.values():
            r.progress()

    def complete_recv(self, st: BoundaryState, i: int) -> list[torch.Tensor | None]:
        """Wait for RECV action ``i``'s data (posting it first if the window has not)."""
        a = self.actions[i]
        self.post_recv(st, i, skip_grads=False)
        recv = st.recvs.pop((a.type, a.stage, a.microbatch))
        device = self.wire.device
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        return recv.wait(self.wire.timeout_s, stream)

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
        a = self.actions[i]
        key, dst = self.program.sends[self.rank][i][0]
        w = self.wire
        tag, what = self.program.tag_key(key), self._what(a, dst)
        fmt = w.boundary_format.for_direction(tag[0])
        peer = w.to_group_rank[dst]
        send = BoundarySend(w.transport, tensors, grad_flags, peer, w.tags, tag, what, w.layouts, fmt)
        self.bytes_sent[tag[0]] += send.data_bytes
        self.messages_sent[tag[0]] += 1
        st.sends.append((send, keep))

    def reap(self, st: BoundaryState, block: bool) -> None:
        """Wait for the completed sends (all of them when ``block``) and release what they held."""
        pending = []
        stop = False
        for send, hooked in st.sends:
            # Sends complete roughly in posting order: stop polling at the first
            # one still in flight (it is polled again at the next action).
            stop = stop or (not block and not send.is_completed())
            if not stop:
                send.wait(self.wire.timeout_s)
                for t in hooked:
                    # The reference's memory trick: the hook path keeps output tensors
                    # (for outputs1), so drop their storage once sent.
                    if t.requires_grad and t._base is None:
                        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
            else:
                pending.append((send, hooked))
        st.sends = pending

    def check_drained(self, st: BoundaryState) -> None:
        """Every posted receive was consumed (called at the end of a step)."""
        if st.recvs:
            leftovers = [f"{s}{t}{m}" for t, s, m in st.recvs]
            raise RuntimeError(f"pipeline rank {self.rank}: receives posted but never consumed: {leftovers}")
