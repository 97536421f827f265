"""What a memory policy costs: peak saved-activation bytes per rank, and time.

Pure Python over the schedule's per-rank action order (the same lists the
runtime runs; a lowered list has the same compute order).  The runtime's
reload points come from :func:`reload_points` here, so the runtime and this
model share one rule.

Lifetimes of one (stage, micro-batch)'s saved activations on its rank, by policy
(``saved``: all of them under keep; ``kept``: what never moves, such as the
stage's inputs and labels; ``compressed``: their packed size):

* keep: ``saved`` from its F until its B (or until its W after an I);
* compress: ``compressed`` over the same span (``in_forward`` at the end of the
  F, when given: a stage input is packed only once the forward is done with it);
* recompute: ``kept`` from the F; ``saved`` during the B/I (which recomputes);
  after an I only ``kept`` again, and ``saved`` from the W (which recomputes
  again: the runtime's graph-split W reads the saved tensors, see
  ``runtime/memory.py``) until it ends;
* offload (``offload:bf16``, ``offload:fp8``): ``saved`` during the F, then
  ``kept``; from the reload (``lookahead`` compute actions before its B/I)
  ``saved`` again (a reload unpacks to the full dtype, so the cast changes no
  device bytes).  Keys consumed within ``max(2, lookahead)`` compute actions of
  their F are never offloaded.  Host bytes: what leaves, times the format's
  ratio (:data:`OFFLOAD_RATIO`), per step (:func:`host_bytes_per_step`).

Time: recompute adds an F to each B, I and W (and to a pair's backward half);
compress adds ``compress_s_per_byte`` per saved byte to F and to the backward;
offload delays a backward only by what its reload (moved bytes times the
format's ratio over the host link, plus ``compress_s_per_byte`` per moved byte
for a cast's unpack) cannot hide behind the ``lookahead`` compute actions before
it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .costs import CommModel, CostModel, Num, StageCosts
from .ir import T_B, T_F, T_I, T_W, Action, Schedule

__all__ = [
    "MEMORY_POLICIES",
    "OFFLOAD_RATIO",
    "ChunkBytes",
    "host_bytes_per_step",
    "offloads",
    "MemoryPrediction",
    "reload_points",
    "peak_saved_bytes",
    "policy_costs",
    "PolicyCostModel",
    "predict",
]

MEMORY_POLICIES = ("keep", "recompute", "compress:bf16", "compress:fp8", "offload", "offload:bf16", "offload:fp8")
#: packed size / fp32 size (fp8: one byte per element plus one 4-byte scale per 128 elements, i.e. per 512
#: fp32 bytes)
COMPRESS_RATIO = {"compress:bf16": 0.5, "compress:fp8": 0.25 + 4 / 512}
#: bytes an offload writes to the host / the fp32 bytes that leave the device (same formats)
OFFLOAD_RATIO = {"offload": 1.0, "offload:bf16": 0.5, "offload:fp8": 0.25 + 4 / 512}


def offloads(policy: str) -> bool:
    """True for ``offload`` and its cast variants."""
    return policy in OFFLOAD_RATIO


Key = tuple[int, int]  # (stage, micro-batch)


@dataclass(frozen=True)
class ChunkBytes:
    """Saved activations of one stage chunk for one micro-batch (bytes).  ``compressed=None``:
    ``kept`` plus the policy's ratio of the rest (fp32 activations).  ``in_forward``: under
    compress, what it holds at the end of the F, before the stage input is packed (None:
    ``compressed``); under offload, what the F holds before its offloaded tensors leave (None:
    ``saved``), which differs from ``saved`` when the stage input is another chunk's saved output
    on the same rank (DualPipeV's turn of the V): keep counts that storage with the chunk that
    saved it, offload with the input of the chunk that keeps it."""

    saved: Num
    kept: Num = 0
    compressed: Num | None = None
    in_forward: Num | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.kept <= self.saved:
            raise ValueError(f"need 0 <= kept bytes <= saved bytes, got kept={self.kept} saved={self.saved}")

    def under(self, policy: str) -> Num:
        """Bytes held from the F on (before any reload or recompute) under ``policy``."""
        if policy == "keep":
            return self.saved
        if policy.startswith("compress"):
            if self.compressed is not None:
                return self.compressed
            return self.kept + COMPRESS_RATIO[policy] * (self.saved - self.kept)
        return self.kept

    def moved(self, policy: str) -> Num:
        """Bytes that leave after the F and come back before the backward (offload), or that are
        dropped and recomputed (recompute)."""
        if offloads(policy) and self.in_forward is not None:
            return self.in_forward - self.kept
        return self.saved - self.kept


def _check_policy(policy: str) -> None:
    if policy not in MEMORY_POLICIES:
        raise ValueError(f"memory policy {policy!r} is unknown; choose one of {', '.join(MEMORY_POLICIES)}")


def _check_lookahead(lookahead: Mapping[int, int] | int) -> None:
    """ValueError unless every reload lookahead is an integer >= 0 (a reload cannot start after its use)."""
    values = [lookahead] if isinstance(lookahead, int) else list(lookahead.values())
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"reload lookahead must be an integer >= 0 compute actions, got {v!r}")


def _computes(actions: Sequence[Action]) -> list[Action]:
    return [a for a in actions if a.is_compute]


def reload_points(
    actions: Sequence[Action], lookahead: Mapping[int, int] | int = 2
) -> tuple[dict[int, list[Key]], set[Key]]:
    """``(reload_at, resident)`` for one rank's list: ``reload_at[p]`` the keys whose reload starts
    before the ``p``-th compute action (counting computes only), ``resident`` the keys never offloaded."""
    _check_lookahead(lookahead)
    fwd: dict[Key, int] = {}
    bwd: dict[Key, int] = {}
    for p, a in enumerate(_computes(actions)):
        for sub in a.computes():
            key = (sub.stage, sub.microbatch)
            if sub.type is T_F:
                fwd[key] = p
            elif sub.type is T_B or sub.type is T_I:
                bwd.setdefault(key, p)
    reload_at: dict[int, list[Key]] = {}
    resident: set[Key] = set()
    for key, q in bwd.items():
        ahead = lookahead if isinstance(lookahead, int) else lookahead.get(key[0], 2)
        if q - fwd.get(key, -1) <= max(2, ahead):
            resident.add(key)
        else:
            reload_at.setdefault(q - ahead, []).append(key)
    return reload_at, resident


def _bytes_of(sizes: ChunkBytes | Sequence[ChunkBytes], stage: int) -> ChunkBytes:
    return sizes if isinstance(sizes, ChunkBytes) else sizes[stage]


def peak_saved_bytes(
    schedule: Schedule, policy: str, sizes: ChunkBytes | Sequence[ChunkBytes], lookahead: int = 2
) -> list[Num]:
    """Peak device-resident saved-activation bytes of every rank (``sizes``: one, or one per stage)."""
    _check_policy(policy)
    peaks: list[Num] = []
    for actions in schedule.actions:
        held: dict[Key, Num] = {}
        now: list[Num] = [0, 0]  # resident, peak

        def add(key: Key, n: Num, held: dict[Key, Num] = held, now: list[Num] = now) -> None:
            held[key] = held.get(key, 0) + n
            now[0] += n
            now[1] = max(now[1], now[0])

        def release(key: Key, held: dict[Key, Num] = held, now: list[Num] = now) -> None:
            now[0] -= held.pop(key, 0)

        moves = offloads(policy)
        reload_at, resident = reload_points(actions, lookahead) if moves else ({}, set())
        reloaded: set[Key] = set()
        for p, a in enumerate(_computes(actions)):
            for key in reload_at.get(p, ()):
                c = _bytes_of(sizes, key[0])
                add(key, c.moved(policy))
                reloaded.add(key)
            for sub in a.computes():
                key = (sub.stage, sub.microbatch)
                c = _bytes_of(sizes, sub.stage)
                if sub.type is T_F:
                    offloaded = moves and key not in resident
                    settled = c.saved if policy == "keep" or offloaded or key in resident else c.under(policy)
                    during = c.in_forward if policy.startswith("compress") and c.in_forward is not None else settled
                    if offloaded:
                        during = c.kept + c.moved(policy)
                    add(key, during)
                    if offloaded:
                        add(key, -c.moved(policy))
                    elif during != settled:
                        add(key, settled - during)
                elif sub.type is T_B or sub.type is T_I:
                    if policy == "recompute" or (moves and key not in resident and key not in reloaded):
                        add(key, c.moved(policy))
                        reloaded.add(key)
                    if sub.type is T_B:
                        release(key)
                    elif policy == "recompute":
                        add(key, -(c.saved - c.kept))  # dropped after the I, recomputed at the W
                elif sub.type is T_W:
                    if policy == "recompute":
                        add(key, c.saved - c.kept)
                    release(key)
        peaks.append(now[1])
    return peaks


def _windows(schedule: Schedule, sc: StageCosts, lookahead: int) -> dict[int, Num]:
    """Per stage: the shortest compute time a reload of that stage has to hide behind."""
    out: dict[int, Num] = {}
    for actions in schedule.actions:
        comps = _computes(actions)
        reload_at, _ = reload_points(actions, lookahead)
        for p, keys in reload_at.items():
            window = sum(_nominal(sc, a) for a in comps[p : p + lookahead])
            for s, _mb in keys:
                out[s] = min(out.get(s, window), window)
    return out


def _nominal(sc: StageCosts, a: Action) -> Num:
    f, b = a.computes()[0], a.computes()[-1]
    if len(a.computes()) == 2:
        return sc.pair(f.stage, b.stage, b.type is T_B)
    table = {T_F: sc.f, T_B: sc.b, T_I: sc.i, T_W: sc.w}.get(a.type)
    return table[a.stage] if table is not None else 0


def policy_costs(
    schedule: Schedule,
    costs: CostModel,
    policy: str,
    sizes: ChunkBytes | Sequence[ChunkBytes],
    host_bandwidth: Num = math.inf,
    compress_s_per_byte: Num = 0,
    lookahead: int = 2,
    recompute_s: Sequence[Num] | None = None,
) -> CostModel:
    """``costs`` with the policy's extra time folded into each stage's F, B, I and W (see the module docstring).

    ``recompute_s``: what re-running a stage's forward costs, per stage (default its F; a measured F
    may also carry the runtime's work around the action, which a replay does not repeat).
    """
    _check_policy(policy)
    _check_lookahead(lookahead)
    if not host_bandwidth > 0:  # NaN fails too
        raise ValueError(f"host bandwidth must be > 0 bytes/s, got {host_bandwidth}")
    if not (compress_s_per_byte >= 0 and math.isfinite(compress_s_per_byte)):
        raise ValueError(f"compress cost must be a finite number >= 0 seconds per byte, got {compress_s_per_byte}")
    sc = costs.resolve(schedule)
    n = schedule.num_stages
    extra_f: list[Num] = [0] * n
    extra_b: list[Num] = [0] * n
    if recompute_s is not None and len(recompute_s) != n:
        raise ValueError(f"recompute_s needs one cost per stage ({n}), got {len(recompute_s)}")
    replay = list(sc.f) if recompute_s is None else list(recompute_s)
    if policy == "recompute":
        extra_b = list(replay)
    elif policy.startswith("compress"):
        extra_f = [_bytes_of(sizes, s).saved * compress_s_per_byte for s in range(n)]
        extra_b = list(extra_f)
    elif offloads(policy) and (host_bandwidth != math.inf or (compress_s_per_byte and policy != "offload")):
        windows = _windows(schedule, sc, lookahead)
        cast_s = compress_s_per_byte if policy != "offload" else 0
        for s, window in windows.items():
            moved = _bytes_of(sizes, s).moved(policy)
            extra_b[s] = max(0, moved * OFFLOAD_RATIO[policy] / host_bandwidth + moved * cast_s - window)
    fb = None if sc.fb is None else [sc.fb[s] + extra_f[s] + extra_b[s] for s in range(n)]
    return PolicyCostModel(
        f=[sc.f[s] + extra_f[s] for s in range(n)],
        b=[sc.b[s] + extra_b[s] for s in range(n)],
        w=list(sc.w),
        fb=fb,
        extra_w=tuple(replay) if policy == "recompute" else (),
    )


@dataclass(frozen=True)
class PolicyCostModel(CostModel):
    """A :class:`CostModel` whose W actions also cost ``extra_w[stage]`` (recompute's second forward).

    ``b``, ``w`` and ``fb`` are those of the plain model with the extra of a
    B (or I) already in ``b`` (so I = B - W carries it too); the extra of a W
    cannot be folded into ``w`` as well, since I = B - W would then lose it.
    """

    extra_w: tuple[Num, ...] = ()

    def resolve(self, schedule: Schedule) -> StageCosts:
        sc = super().resolve(schedule)
        if not self.extra_w:
            return sc
        w = tuple(sc.w[s] + self.extra_w[s] for s in range(schedule.num_stages))
        return _WeightExtraCosts(sc.f, sc.b, w, sc.i, sc.fb, tuple(self.extra_w))


@dataclass(frozen=True)
class _WeightExtraCosts(StageCosts):
    """Resolved costs whose ``w`` carries ``extra_w``, which an F&B pair's I half must not lose."""

    extra_w: tuple[Num, ...] = ()

    def pair(self, f_stage: int, b_stage: int, full_backward: bool) -> Num:
        cost = super().pair(f_stage, b_stage, full_backward)
        # Given F&B costs, an I half costs fb - w: add back the W's extra that ``w`` now holds.
        return cost if full_backward or self.fb is None else cost + self.extra_w[b_stage]


@dataclass(frozen=True)
class MemoryPrediction:
    """The simulator's view of one policy: ``peak_saved_bytes`` per rank and the step's ``makespan``."""

    policy: str
    peak_saved_bytes: list[Num]
    makespan: Num
    extra: dict[str, Num] = field(default_factory=dict)
    host_bytes: list[Num] = field(default_factory=list)  # per rank, per step (0 unless offload)


def predict(
    schedule: Schedule,
    policy: str,
    sizes: ChunkBytes | Sequence[ChunkBytes],
    costs: CostModel | None = None,
    comm: CommModel | None = None,
    host_bandwidth: Num = math.inf,
    compress_s_per_byte: Num = 0,
    lookahead: int = 2,
    recompute_s: Sequence[Num] | None = None,
) -> MemoryPrediction:
    """Peak saved bytes per rank and the simulated step time of ``schedule`` under ``policy``."""
    from .simulator import simulate

    pc = policy_costs(
        schedule, costs or CostModel(), policy, sizes, host_bandwidth, compress_s_per_byte, lookahead, recompute_s
    )
    res = simulate(schedule, pc, comm)
    peaks = peak_saved_bytes(schedule, policy, sizes, lookahead)
    return MemoryPrediction(
        policy, peaks, res.makespan, host_bytes=host_bytes_per_step(schedule, policy, sizes, lookahead)
    )


def host_bytes_per_step(
    schedule: Schedule, policy: str, sizes: ChunkBytes | Sequence[ChunkBytes], lookahead: int = 2
) -> list[Num]:
    """Bytes every rank writes to its host arena per step: the moved bytes of each key it offloads, times
    the format's ratio (0 under a policy that does not offload)."""
    _check_policy(policy)
    if not offloads(policy):
        return [0] * len(schedule.actions)
    out: list[Num] = []
    for actions in schedule.actions:
        reload_at, _ = reload_points(actions, lookahead)
        keys = [key for ks in reload_at.values() for key in ks]
        out.append(sum(_bytes_of(sizes, s).moved(policy) * OFFLOAD_RATIO[policy] for s, _mb in keys))
    return out
