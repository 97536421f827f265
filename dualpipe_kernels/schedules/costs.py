"""Cost and communication models for the schedule simulator.

Costs are plain numbers in one time unit of the caller's choosing (seconds when
combined with a communication model given in seconds and bytes/s).  Pass ints,
dyadic floats or ``fractions.Fraction`` for exact arithmetic: the simulator only
adds, subtracts and takes maxima, so exact inputs give exact results.

Notation (docs/architecture.md): F = forward of one stage chunk, B = full backward,
W = weight-gradient part, I = B - W (input-gradient part), F&B = an overlapped
forward+backward pair run as one unit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from numbers import Real
from typing import TypeAlias

from .ir import Schedule

__all__ = ["CostModel", "CommModel", "StageCosts", "Cost", "Num"]

#: A cost: one number for every stage, or one per stage.
#: A time or byte count: exact (int, Fraction) or float.
Num: TypeAlias = int | float | Fraction
Cost: TypeAlias = Num | Sequence[Num]


@dataclass(frozen=True)
class StageCosts:
    """Costs resolved to one entry per IR stage (index = stage id).

    ``fb[s]`` is the cost of an overlapped pair whose F half runs on stage ``s``
    and whose backward half is a full B; when the backward half is an I the
    pair costs ``fb[s] - w[b_stage]`` (the deferred W is paid later by itself).
    ``fb is None`` (no F&B cost given): a pair costs its halves' sum,
    ``f[f_stage] + b[b_stage]`` (or ``i[b_stage]``).
    """

    f: tuple[Num, ...]
    b: tuple[Num, ...]
    w: tuple[Num, ...]
    i: tuple[Num, ...]
    fb: tuple[Num, ...] | None

    def pair(self, f_stage: int, b_stage: int, full_backward: bool) -> Num:
        """Cost of an F&B pair: F on ``f_stage`` with a B (``full_backward``) or an I on ``b_stage``."""
        if self.fb is None:
            return self.f[f_stage] + (self.b[b_stage] if full_backward else self.i[b_stage])
        return self.fb[f_stage] if full_backward else self.fb[f_stage] - self.w[b_stage]


def _finite(x: Num) -> bool:
    """NaN and +-inf are not costs (an exact int or Fraction always is finite)."""
    return isinstance(x, (int, Fraction)) or math.isfinite(x)


def _per_stage(name: str, value: Cost, schedule: Schedule) -> list[Num]:
    """Expand a scalar or a per-stage sequence to one value per IR stage.

    A sequence may be indexed by IR stage (``len == num_stages``) or, for
    schedules that hold two copies of a model stage (DualPipe), by model stage
    (``len == number of distinct model stages``); copies then share the cost.
    """
    n_stages = schedule.num_stages
    if isinstance(value, (int, float, Fraction, Real)):
        return [value] * n_stages
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"cost {name} must be a number or a sequence of numbers, got {value!r}")
    vals = list(value)
    n_model = len(set(schedule.model_stage))
    if len(vals) == n_stages:
        return vals
    if len(vals) == n_model:
        return [vals[schedule.model_stage[s]] for s in range(n_stages)]
    raise ValueError(
        f"per-stage cost {name} has {len(vals)} entries; need 1, {n_stages} (stages) or {n_model} (model stages)"
    )


@dataclass(frozen=True)
class CostModel:
    """Compute costs per action kind.

    ``fb=None`` means no overlap benefit: a pair costs its F plus its B.  A
    per-stage ``fb`` is indexed by the pair's F stage.  Constraints
    (checked by :meth:`resolve`, each a ValueError naming it): F > 0, B > 0,
    0 < W < B (so I = B - W > 0), max(F, B) <= F&B <= F + B.
    """

    f: Cost = 1
    b: Cost = 2
    w: Cost = 1
    fb: Cost | None = None

    def resolve(self, schedule: Schedule) -> StageCosts:
        f = _per_stage("F", self.f, schedule)
        b = _per_stage("B", self.b, schedule)
        w = _per_stage("W", self.w, schedule)
        given = self.fb is not None
        fb = (
            _per_stage("F&B", self.fb, schedule)
            if self.fb is not None
            else [fs + bs for fs, bs in zip(f, b, strict=True)]
        )
        for s in range(schedule.num_stages):
            where = f" (stage {s})" if not isinstance(self.f, Real) or not isinstance(self.b, Real) else ""
            for name, values in (("F", f), ("B", b), ("W", w), ("F&B", fb)):
                if not _finite(values[s]):
                    raise ValueError(f"cost {name} must be a finite number, got {values[s]}{where}")
            if not f[s] > 0:
                raise ValueError(f"cost F must be > 0, got {f[s]}{where}")
            if not b[s] > 0:
                raise ValueError(f"cost B must be > 0, got {b[s]}{where}")
            if not w[s] > 0:
                raise ValueError(f"cost W must be > 0, got {w[s]}{where}")
            if not w[s] < b[s]:
                raise ValueError(f"cost W must be < B (I = B - W > 0), got W={w[s]} B={b[s]}{where}")
            if not max(f[s], b[s]) <= fb[s] <= f[s] + b[s]:
                raise ValueError(
                    f"cost F&B must satisfy max(F, B) <= F&B <= F + B, got F&B={fb[s]} F={f[s]} B={b[s]}{where}"
                )
        i = [bs - ws for bs, ws in zip(b, w, strict=True)]
        return StageCosts(tuple(f), tuple(b), tuple(w), tuple(i), tuple(fb) if given else None)


@dataclass(frozen=True)
class CommModel:
    """Point-to-point transfer costs.

    A transfer of ``nbytes`` from rank ``src`` to rank ``dst`` occupies the
    directed link ``src -> dst`` for ``nbytes / bandwidth`` and arrives
    ``latency`` after it leaves the link (latency is in flight, not link
    occupancy, so back-to-back transfers pipeline).  Ranks ``r`` and ``q`` share
    a node when ``r // ranks_per_node == q // ranks_per_node``; such pairs use
    ``latency``/``bandwidth``, others ``inter_latency``/``inter_bandwidth``
    (defaulting to the intra-node values).  ``ranks_per_node=None``: one node.

    ``blocking=False`` (async): the sender keeps computing; only the receiver's
    consuming action waits for the arrival.  ``blocking=True``: the sending rank
    is also busy until its transfer arrives (wait-immediately P2P).

    Every transfer carries ``activation_bytes`` (an activation forward, or its
    gradient, which has the same shape, backward).  Units: seconds and bytes/s.
    """

    latency: Num = 0
    bandwidth: Num = math.inf
    activation_bytes: Num = 0
    ranks_per_node: int | None = None
    inter_latency: Num | None = None
    inter_bandwidth: Num | None = None
    blocking: bool = False

    def __post_init__(self) -> None:
        for name in ("latency", "inter_latency"):
            v = getattr(self, name)
            if v is not None and not (v >= 0 and _finite(v)):
                raise ValueError(f"comm {name} must be >= 0 seconds and finite, got {v}")
        for name in ("bandwidth", "inter_bandwidth"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"comm {name} must be > 0 bytes/s, got {v}")
        if not (self.activation_bytes >= 0 and _finite(self.activation_bytes)):
            raise ValueError(f"activation_bytes must be >= 0 and finite, got {self.activation_bytes}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        for bw in (self.bandwidth, self.inter_bandwidth):
            if bw is None or not self.activation_bytes:
                continue
            try:
                finite = _finite(self.activation_bytes / bw)
            except OverflowError:
                finite = False
            if not finite:
                raise ValueError(
                    f"a transfer of {self.activation_bytes:g} bytes at {bw:g} bytes/s takes no finite time; "
                    "use a larger bandwidth or fewer bytes"
                )

    def same_node(self, src: int, dst: int) -> bool:
        rpn = self.ranks_per_node
        return rpn is None or src // rpn == dst // rpn

    def link_time(self, src: int, dst: int) -> tuple[Num, Num]:
        """(link occupancy, latency) of one transfer ``src -> dst``."""
        if self.same_node(src, dst):
            lat, bw = self.latency, self.bandwidth
        else:
            lat = self.latency if self.inter_latency is None else self.inter_latency
            bw = self.bandwidth if self.inter_bandwidth is None else self.inter_bandwidth
        # Keep zero exact (an int) so exact-arithmetic callers stay exact.
        occupancy = self.activation_bytes / bw if self.activation_bytes else 0
        return occupancy, lat

    @property
    def is_free(self) -> bool:
        """True when every transfer takes zero time."""
        lat_inter = self.latency if self.inter_latency is None else self.inter_latency
        return not self.activation_bytes and not self.latency and not lat_inter
