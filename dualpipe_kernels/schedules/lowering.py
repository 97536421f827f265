"""Lowering: add the point-to-point communication a compute-only schedule implies.

For every remote need of the dependency program (:class:`~.deps.Program`:
data whose producing stage lives on another rank):

* the producer's rank gets a SEND (``SEND_F`` for an activation, ``SEND_B``
  for an input gradient: :data:`~.deps.TRANSFER`) right after the compute that
  makes it;
* the consumer's rank gets the matching RECV right before the compute that
  reads it (once per datum and rank).

An OVERLAP_F_B pair gets both receives before it (F's, then B's) and both sends
after it (F's, then B's), as the reference sends after its overlapped chunk;
the runtime executes exactly this list and the simulator times it.  A handoff
between two stages on the same rank (the turn of a V) moves no bytes and gets
no action.  ``peer`` is set on every comm action; its stage is the sender's
stage for a SEND and the receiver's stage for a RECV (as in
torch.distributed.pipelining), so ``SEND_F`` of stage ``s`` pairs with
``RECV_F`` of ``next(s)`` for the same micro-batch.
"""

from __future__ import annotations

import dataclasses

from ._program import gc_paused, new_action
from .deps import NUM_KINDS, ROLE_COMPUTE, ROLE_RECV, ROLE_SEND, TRANSFER, DepKind, Program
from .explain import CommPair, comm_pairs
from .ir import Action, ActionType, Schedule

__all__ = ["lower_comms", "lower_program", "lower_rank", "comm_pairs", "CommPair"]


def _moves(prog: Program) -> list[tuple[ActionType, ActionType, list[list[int]]] | None]:
    """Per kind: (SEND type, RECV type, the stage table from producer to consumer); None: the kind never moves."""
    return [
        (*TRANSFER[DepKind(k)], prog.topo.flow_table(k, True)) if DepKind(k) in TRANSFER else None
        for k in range(NUM_KINDS)
    ]


def lower_rank(
    prog: Program, rank: int, out: tuple[list, ...] | None = None, moves: list | None = None
) -> list[Action]:
    """Rank ``rank``'s compute list with its SEND/RECV actions inserted.

    ``out``: five lists to which this rank's lowered program arrays are appended
    (role, local, remote, makes, sends: see :class:`~.deps.Program`).
    ``moves``: :func:`_moves` of ``prog``, when the caller lowers many ranks.
    """
    topo = prog.topo
    N, S, s2r, mbp = topo.num_microbatches, topo.num_stages, topo.stage_to_rank, topo.mb_path
    moves = moves or _moves(prog)
    role, local, remote, makes, sends = (
        prog.role[rank],
        prog.local[rank],
        prog.remote[rank],
        prog.makes[rank],
        prog.sends[rank],
    )
    acts: list[Action] = []
    o_role = bytearray()
    o_local: list[tuple[int, ...]] = []
    o_remote: list[tuple[int, ...]] = []
    o_makes: list[tuple[int, ...]] = []
    o_sends: list[tuple[tuple[int, int], ...]] = []
    received: set[int] = set()
    none: tuple = ()
    for i, a in enumerate(prog.schedule.actions[rank]):
        if role[i] != ROLE_COMPUTE:
            raise ValueError(f"rank {rank}: cannot lower a list that already has comm action {a}")
        for k in remote[i]:
            if k not in received:
                received.add(k)
                kind, rest = divmod(k, S * N)
                st, m = divmod(rest, N)
                mv = moves[kind] or _no_transfer(prog, k)
                acts.append(new_action(mv[1], mv[2][mbp[m]][st], m, (), s2r[st]))
                o_role.append(ROLE_RECV)
                o_local.append(none)
                o_remote.append((k,))
                o_makes.append(none)
                o_sends.append(none)
        acts.append(a)
        o_role.append(ROLE_COMPUTE)
        o_local.append(local[i])
        o_remote.append(remote[i])
        o_makes.append(makes[i])
        o_sends.append(sends[i])
        for k, dst in sends[i]:
            kind, rest = divmod(k, S * N)
            st, m = divmod(rest, N)
            mv = moves[kind] or _no_transfer(prog, k)
            acts.append(new_action(mv[0], st, m, (), dst))
            o_role.append(ROLE_SEND)
            o_local.append((k,))
            o_remote.append(none)
            o_makes.append(none)
            o_sends.append(((k, dst),))
    if out is not None:
        for lst, got in zip(out, (o_role, o_local, o_remote, o_makes, o_sends), strict=True):
            lst.append(got)
    return acts


def _no_transfer(prog: Program, key: int) -> tuple:
    raise ValueError(f"{prog.topo.describe(key)} crosses ranks but its kind has no comm types (deps.TRANSFER)")


def lower_program(program: Program) -> Program:
    """The program of ``program.schedule`` lowered (its ``schedule`` is the lowered copy: see :func:`lower_comms`)."""
    schedule = program.schedule
    if schedule.lowered:
        raise ValueError(f"schedule {schedule.name!r} is already lowered")
    arrays: tuple[list, ...] = ([], [], [], [], [])
    with gc_paused():
        moves = _moves(program)
        lowered = [lower_rank(program, r, arrays, moves) for r in range(schedule.num_ranks)]
    out = dataclasses.replace(schedule, actions=lowered, lowered=True)
    prog = Program.assemble(out, program.topo, arrays)  # type: ignore[arg-type]
    prog.validated = program.validated  # lowering a valid schedule gives a valid one
    return prog


def lower_comms(schedule: Schedule, program: Program | None = None) -> Schedule:
    """A copy of ``schedule`` with comm actions inserted and ``lowered=True``.

    The input must be compute-only (ValueError otherwise).  Compute actions are
    shared with the input (they are immutable).  ``program``: the schedule's
    dependency program when the caller has it already.
    """
    if schedule.lowered:
        raise ValueError(f"schedule {schedule.name!r} is already lowered")
    prog = program if program is not None and program.schedule is schedule else Program(schedule)
    return lower_program(prog).schedule
