"""Lowering: add the point-to-point communication a compute-only schedule implies.

For every data dependency (see :mod:`.deps`) whose producer and consumer
stages live on different ranks:

* the producer's rank gets ``SEND_F`` (activation) / ``SEND_B`` (input
  gradient) right after the compute that produces it;
* the consumer's rank gets ``RECV_F`` / ``RECV_B`` right before the compute
  that consumes it.

An OVERLAP_F_B pair gets both receives before it (F's, then B's) and both sends
after it (F's, then B's).  A handoff between two stages on the same rank (the
turn of a V) moves no bytes and gets no action.  ``peer`` is set on every comm
action; its stage is the sender's stage for a SEND and the receiver's stage for
a RECV (as in torch.distributed.pipelining), so ``SEND_F`` of stage ``s``
pairs with ``RECV_F`` of ``next(s)`` for the same micro-batch.
"""

from __future__ import annotations

import dataclasses

from ._program import gc_paused, new_action
from .deps import Topology
from .ir import Action, ActionType, Schedule
from .validate import CommPair, comm_pairs

__all__ = ["lower_comms", "lower_rank", "comm_pairs", "CommPair"]

_F, _B, _I, _W, _PAIR = ActionType.F, ActionType.B, ActionType.I, ActionType.W, ActionType.OVERLAP_F_B
_SEND_F, _RECV_F, _SEND_B, _RECV_B = ActionType.SEND_F, ActionType.RECV_F, ActionType.SEND_B, ActionType.RECV_B
_COMPUTE = (_F, _B, _I, _W)


def lower_rank(topo: Topology, rank: int, actions: list[Action]) -> list[Action]:
    """One rank's compute list with its SEND/RECV actions inserted."""
    s2r, mbp, nxt_t, prv_t = topo.stage_to_rank, topo.mb_path, topo.next, topo.prev
    out: list[Action] = []
    append = out.append

    def recv(c: Action) -> None:
        t, s, m = c.type, c.stage, c.microbatch
        if t is _F:
            src = prv_t[mbp[m]][s]
            if src >= 0 and s2r[src] != rank:
                append(new_action(_RECV_F, s, m, (), s2r[src]))
        elif t is not _W:  # B or I: the gradient comes from the next stage
            src = nxt_t[mbp[m]][s]
            if src >= 0 and s2r[src] != rank:
                append(new_action(_RECV_B, s, m, (), s2r[src]))

    def send(c: Action) -> None:
        t, s, m = c.type, c.stage, c.microbatch
        if t is _F:
            dst = nxt_t[mbp[m]][s]
            if dst >= 0 and s2r[dst] != rank:
                append(new_action(_SEND_F, s, m, (), s2r[dst]))
        elif t is not _W:
            dst = prv_t[mbp[m]][s]
            if dst >= 0 and s2r[dst] != rank:
                append(new_action(_SEND_B, s, m, (), s2r[dst]))

    for a in actions:
        t = a.type
        if t is _PAIR:
            f, b = a.sub_actions
            recv(f)
            recv(b)
            append(a)
            send(f)
            send(b)
        elif t in _COMPUTE:
            recv(a)
            append(a)
            send(a)
        else:
            raise ValueError(f"rank {rank}: cannot lower a list that already has comm action {a}")
    return out


def lower_comms(schedule: Schedule) -> Schedule:
    """A copy of ``schedule`` with comm actions inserted and ``lowered=True``.

    The input must be compute-only (ValueError otherwise).  Compute actions are
    shared with the input (they are immutable).
    """
    if schedule.lowered:
        raise ValueError(f"schedule {schedule.name!r} is already lowered")
    topo = Topology(schedule)
    with gc_paused():
        lowered = [lower_rank(topo, r, acts) for r, acts in enumerate(schedule.actions)]
    return dataclasses.replace(schedule, actions=lowered, lowered=True)
