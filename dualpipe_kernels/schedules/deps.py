"""The dependency program: what every action needs and produces, in one place.

The validator's dry run, the lowering pass, both simulator engines and the
runtime read the arrays of :class:`Program`; none of them writes a data rule
of its own.  Data comes in kinds (:class:`DepKind`), each of one
``(stage, micro-batch)``:

* ``ACT``: the activation a stage's F produces;
* ``GRAD``: the input gradient a stage's B (or I) produces;
* ``WPEND``: the weight-gradient work an I leaves for its W;
* ``WDONE``: the weight gradient W accumulated (nobody reads it: a second W collides).

Rules (:data:`RULES`, ``prev``/``next`` along the micro-batch's path):

* ``F(s, m)`` needs ``ACT(prev(s, m), m)`` (nothing on the path's first stage), makes ``ACT(s, m)``;
* ``B(s, m)`` / ``I(s, m)`` need ``ACT(s, m)`` and, unless ``s`` is the loss
  stage of ``m``, ``GRAD(next(s, m), m)``; they make ``GRAD(s, m)`` (an I also ``WPEND(s, m)``);
* ``W(s, m)`` needs ``WPEND(s, m)`` and makes ``WDONE(s, m)``.

An action with sub-actions (``OVERLAP_F_B``) needs and makes the union of its
halves'.  A need is *remote* when its producing stage lives on another rank:
the lowering pass puts a RECV right before the consumer and a SEND right after
the producer (:data:`TRANSFER` names the comm types of each kind), the
simulator adds a transfer and the runtime moves the bytes.

One integer encoding of data: ``key = (kind * S + stage) * N + mb``
(:meth:`Topology.key`).  A new action kind is one :class:`Rule` in
:data:`RULES` (see docs/adding_an_action.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from ._program import gc_paused
from .ir import T_B, T_F, T_I, T_W, Action, ActionType, Schedule
from .topology import COMM_KIND as _COMM_KIND
from .topology import NO_STAGE as _NONE
from .topology import NUM_KINDS, TRANSFER, Dep, DepKind, Topology

__all__ = [
    "DepKind",
    "NUM_KINDS",
    "Dep",
    "Rule",
    "RULES",
    "TRANSFER",
    "Topology",
    "Program",
    "ProgramError",
    "ROLE_COMPUTE",
    "ROLE_SEND",
    "ROLE_RECV",
    "dependency_keys",
    "produced_keys",
    "dependencies",
]


# ---- the rules ---------------------------------------------------------------

KindStages = tuple[tuple[DepKind, int], ...]
"""``(kind, stage)`` pairs of data of the action's own micro-batch."""


class Rule(NamedTuple):
    """One compute kind's entry in the program.

    ``needs(topo, path, stage)`` / ``makes(topo, path, stage)``: the data an
    action of ``stage`` (its micro-batch on ``path``) reads / produces.
    ``cost(stage_costs, stage)``: its duration in the simulator
    (``StageCosts`` from schedules.costs).  ``live``: activations it allocates
    (+1) or frees (-1), for the simulator's peak count.
    """

    needs: Callable[[Topology, int, int], KindStages]
    makes: Callable[[Topology, int, int], KindStages]
    cost: Callable[[Any, int], Any]
    live: int = 0


def _f_needs(topo: Topology, p: int, s: int) -> KindStages:
    prev = topo.prev[p][s]
    return () if prev == _NONE else ((DepKind.ACT, prev),)


def _b_needs(topo: Topology, p: int, s: int) -> KindStages:
    nxt = topo.next[p][s]
    own = ((DepKind.ACT, s),)
    return own if nxt == _NONE else (*own, (DepKind.GRAD, nxt))


RULES: dict[ActionType, Rule] = {
    T_F: Rule(_f_needs, lambda topo, p, s: ((DepKind.ACT, s),), lambda sc, s: sc.f[s], +1),
    T_B: Rule(_b_needs, lambda topo, p, s: ((DepKind.GRAD, s),), lambda sc, s: sc.b[s], -1),
    T_I: Rule(_b_needs, lambda topo, p, s: ((DepKind.GRAD, s), (DepKind.WPEND, s)), lambda sc, s: sc.i[s], -1),
    T_W: Rule(
        lambda topo, p, s: ((DepKind.WPEND, s),), lambda topo, p, s: ((DepKind.WDONE, s),), lambda sc, s: sc.w[s]
    ),
}
"""Compute kind -> its rule.  Constant in the library; a test may add an entry (monkeypatch)."""

_COMM_IDS = frozenset(id(t) for t in _COMM_KIND)  # identity test: an enum's __hash__ is Python code (hot path)

ROLE_COMPUTE, ROLE_SEND, ROLE_RECV = 0, 1, 2


class ProgramError(ValueError):
    """An action the program cannot place: ``rank``/``step`` locate it in the given lists."""

    def __init__(self, message: str, rank: int, step: int) -> None:
        super().__init__(f"rank {rank}, step {step}: {message}")
        self.problem = message
        self.rank = rank
        self.step = step


_Entry = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # key bases: local needs, remote needs, makes
Keys = tuple[int, ...]
Sends = tuple[tuple[int, int], ...]


def _shift(bases: tuple[int, ...], mb: int) -> tuple[int, ...]:
    """``bases`` plus ``mb`` (the keys of one micro-batch); unrolled for the usual 0-2 entries (hot path)."""
    n = len(bases)
    if n == 0:
        return ()
    if n == 1:
        return (bases[0] + mb,)
    if n == 2:
        return (bases[0] + mb, bases[1] + mb)
    return tuple(b + mb for b in bases)


class Program:
    """Per rank, per action of ``schedule`` (compute-only or lowered): the data keys it needs and makes.

    ``role[r][i]``: ROLE_COMPUTE, ROLE_SEND or ROLE_RECV.
    ``local[r][i]``: keys read that rank ``r`` produces itself (a SEND: the key it sends);
    ``remote[r][i]``: keys read from another rank (a RECV: the key it receives; a compute of a
    lowered schedule: the keys its RECVs took in);
    ``makes[r][i]``: keys produced;
    ``sends[r][i]``: ``(key, destination rank)`` for each made key another rank reads (a SEND: its transfer).
    Raises :class:`ProgramError` for an action out of range, off its path, on the wrong rank,
    or of a kind with no rule.  ``validated``: True once :func:`~.validate.validate` passed it.
    """

    __slots__ = ("schedule", "topo", "role", "local", "remote", "makes", "sends", "validated", "_cache", "_rules")

    def __init__(self, schedule: Schedule, rules: Mapping[ActionType, Rule] | None = None) -> None:
        self.schedule = schedule
        self.validated = False  # set by schedules.validate.validate() once the whole schedule passed
        self.topo = Topology(schedule)
        self._rules = RULES if rules is None else rules
        self._cache: dict[tuple[int, int, int], _Entry] = {}  # (id(kind), path, stage) -> entry
        R = schedule.num_ranks
        self.role: list[bytearray] = []
        self.local: list[list[tuple[int, ...]]] = []
        self.remote: list[list[tuple[int, ...]]] = []
        self.makes: list[list[tuple[int, ...]]] = []
        dest = [_NONE] * self.topo.num_keys
        self.sends: list[list[tuple[tuple[int, int], ...]]] = []
        with gc_paused():
            for r in range(R):
                self._build_rank(r, dest)
            for r in range(R):
                self.sends.append(self._rank_sends(r, dest))

    @classmethod
    def assemble(
        cls,
        schedule: Schedule,
        topo: Topology,
        arrays: tuple[list[bytearray], list[list[Keys]], list[list[Keys]], list[list[Keys]], list[list[Sends]]],
    ) -> Program:
        """A program from arrays a pass has already derived (the lowering's: no second walk of the rules)."""
        prog = cls.__new__(cls)
        prog.schedule, prog.topo, prog.validated = schedule, topo, False
        prog._rules, prog._cache = RULES, {}
        prog.role, prog.local, prog.remote, prog.makes, prog.sends = arrays
        return prog

    # ---- building --------------------------------------------------------
    def _entry(self, t: Any, p: int, s: int, r: int, i: int) -> _Entry:
        rule = self._rules.get(t)
        if rule is None:
            raise ProgramError(f"no dependency rule for action kind {t}", r, i)
        topo = self.topo
        S, N, s2r = topo.num_stages, topo.num_microbatches, topo.stage_to_rank
        needs = rule.needs(topo, p, s)
        local = tuple([(kind * S + st) * N for kind, st in needs if s2r[st] == r])
        remote = tuple([(kind * S + st) * N for kind, st in needs if s2r[st] != r])
        e = (local, remote, tuple([(kind * S + st) * N for kind, st in rule.makes(topo, p, s)]))
        self._cache[(id(t), p, s)] = e
        return e

    def _check_place(self, c: Action, r: int, i: int) -> int:
        """The path of plain action ``c``'s micro-batch, after checking ``c`` may run on rank ``r``."""
        topo, s, m = self.topo, c.stage, c.microbatch
        if not 0 <= m < topo.num_microbatches:
            raise ProgramError(f"micro-batch {m} out of range 0..{topo.num_microbatches - 1}", r, i)
        p = topo.mb_path[m]
        if not (0 <= s < topo.num_stages and topo.on_path[p][s]):
            raise ProgramError(f"stage {s} is not on micro-batch {m}'s path {self.schedule.paths[p]}", r, i)
        if topo.stage_to_rank[s] != r:
            raise ProgramError(f"stage {s} lives on rank {topo.stage_to_rank[s]}, not on rank {r}", r, i)
        return p

    def _build_rank(self, r: int, dest: list[int]) -> None:
        role = bytearray()
        local: list[tuple[int, ...]] = []
        remote: list[tuple[int, ...]] = []
        makes: list[tuple[int, ...]] = []
        cache = self._cache
        topo = self.topo
        S, N, mbp, on_path, s2r = topo.num_stages, topo.num_microbatches, topo.mb_path, topo.on_path, topo.stage_to_rank
        for i, a in enumerate(self.schedule.actions[r]):
            t = a.type
            if id(t) in _COMM_IDS:
                key, _ = self.transfer(a, r, i)
                is_send = _COMM_KIND[t][1]
                role.append(ROLE_SEND if is_send else ROLE_RECV)
                local.append((key,) if is_send else ())
                remote.append(() if is_send else (key,))
                makes.append(())
                continue
            # Hot path (10^5-10^6 actions, most of DualPipe's are pairs): placement checked inline,
            # rules looked up per (kind, path, stage), keys = the cached bases + the micro-batch.
            lo: tuple[int, ...] = ()
            re: tuple[int, ...] = ()
            mk: tuple[int, ...] = ()
            for c in a.sub_actions or (a,):
                s, m = c.stage, c.microbatch
                if not (0 <= m < N and 0 <= s < S and on_path[mbp[m]][s] and s2r[s] == r):
                    self._check_place(c, r, i)
                ct, p = c.type, mbp[m]
                e0, e1, e2 = cache.get((id(ct), p, s)) or self._entry(ct, p, s, r, i)
                if e0:
                    lo += (e0[0] + m,) if len(e0) == 1 else _shift(e0, m)
                if e1:
                    re += (e1[0] + m,) if len(e1) == 1 else _shift(e1, m)
                if e2:
                    mk += (e2[0] + m,) if len(e2) == 1 else _shift(e2, m)
            for k in re:
                if dest[k] != r:
                    if dest[k] != _NONE:
                        raise ProgramError(f"{topo.describe(k)} is read on ranks {dest[k]} and {r}", r, i)
                    dest[k] = r
            role.append(ROLE_COMPUTE)
            local.append(lo)
            remote.append(re)
            makes.append(mk)
        self.role.append(role)
        self.local.append(local)
        self.remote.append(remote)
        self.makes.append(makes)

    def _rank_sends(self, r: int, dest: list[int]) -> list[tuple[tuple[int, int], ...]]:
        out: list[tuple[tuple[int, int], ...]] = []
        append = out.append
        none = ()
        for kind, loc, mk in zip(self.role[r], self.local[r], self.makes[r], strict=True):
            if not mk:
                append(((loc[0], self._send_dest(loc[0])),) if kind == ROLE_SEND else none)
                continue
            # dest[k] is never rank r itself for a key r makes: only remote needs set it
            got = [(k, dest[k]) for k in mk if dest[k] != _NONE and dest[k] != r]
            append(tuple(got) if got else none)
        return out

    def _send_dest(self, key: int) -> int:
        return self.topo.stage_to_rank[self.consumer_stage(key)]

    def consumer_stage(self, key: int) -> int:
        """The stage on the far side of a transfer of ``key`` (the stage of its RECV); -1: none."""
        d = self.topo.unkey(key)
        return self.topo.flow(d.kind, self.topo.mb_path[d.microbatch], d.stage, towards_consumer=True)

    # ---- comm actions ------------------------------------------------------
    def transfer(self, a: Action, r: int, i: int) -> tuple[int, int]:
        """(data key, the other stage) of comm action ``a`` at rank ``r``, step ``i``; ProgramError if impossible.

        A SEND's stage is the producer's, a RECV's the consumer's (torch's notation).
        """
        kind, is_send = _COMM_KIND[a.type]
        self._check_place(a, r, i)
        topo = self.topo
        other = topo.comm_other_stage(a)
        if other == _NONE:
            raise ProgramError("no neighbour stage to exchange with at this end of the path", r, i)
        orank = topo.stage_to_rank[other]
        if orank == r:
            raise ProgramError(f"neighbour stage {other} is on the same rank: no transfer needed", r, i)
        if a.peer is not None and a.peer != orank:
            raise ProgramError(f"peer is {a.peer}, but stage {other} lives on rank {orank}", r, i)
        return topo.key(kind, a.stage if is_send else other, a.microbatch), other

    def comm_action(self, key: int, send: bool, stage: int, peer: int) -> Action:
        """The SEND (at the producer, ``stage`` = its stage) or RECV (``stage`` = the consumer's) moving ``key``."""
        d = self.topo.unkey(key)
        types = TRANSFER.get(d.kind)
        if types is None:
            raise ValueError(f"{self.topo.describe(key)} has no transfer type (add one to TRANSFER)")
        return Action(types[0] if send else types[1], stage, d.microbatch, (), peer)

    def tag_key(self, key: int) -> tuple[int, int, int]:
        """``(kind, producer stage, mb)``: the transport's message key of one transfer (runtime/p2p TagSpace)."""
        d = self.topo.unkey(key)
        return int(d.kind), d.stage, d.microbatch

    def counts(self, done: bytearray) -> list[int]:
        """Keys marked in ``done`` (one byte per key), per DepKind."""
        SN = self.topo.num_stages * self.topo.num_microbatches
        return [done.count(1, k * SN, (k + 1) * SN) for k in range(NUM_KINDS)]


# ---- one-off queries (tests, docs) -----------------------------------------------


def dependency_keys(topo: Topology, action: Action) -> list[Dep]:
    """The data ``action`` needs before it can start (the union of its halves' for a pair); [] for a comm action."""
    out: list[Dep] = []
    for c in action.computes():
        rule = RULES.get(c.type)
        if rule is not None:
            out += [Dep(k, s, c.microbatch) for k, s in rule.needs(topo, topo.mb_path[c.microbatch], c.stage)]
    return out


def produced_keys(action: Action, topo: Topology | None = None) -> list[Dep]:
    """The data ``action`` makes available when it finishes."""
    out: list[Dep] = []
    for c in action.computes():
        rule = RULES.get(c.type)
        if rule is not None:
            p = topo.mb_path[c.microbatch] if topo is not None else 0
            out += [Dep(k, s, c.microbatch) for k, s in rule.makes(topo, p, c.stage)]  # type: ignore[arg-type]
    return out


def dependencies(schedule: Schedule, action: Action) -> list[Action]:
    """The compute actions ``action`` depends on, as actions (``F``, ``B``/``I``).

    Whether a gradient comes from a B or an I is read from the owning rank's
    list, so one call costs O(that list): use :class:`Program` in loops.
    """
    topo = Topology(schedule)
    out: list[Action] = []
    for dep in dependency_keys(topo, action):
        if dep.kind is DepKind.ACT:
            out.append(Action(T_F, dep.stage, dep.microbatch))
            continue
        kind = T_I if dep.kind is DepKind.WPEND else T_B
        for a in schedule.actions[schedule.stage_to_rank[dep.stage]]:
            for c in a.computes():
                if c.type in (T_B, T_I) and c.stage == dep.stage and c.microbatch == dep.microbatch:
                    kind = c.type
        out.append(Action(kind, dep.stage, dep.microbatch))
    return out
