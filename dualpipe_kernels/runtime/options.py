"""A pipeline's configuration, grouped by what it is about, in frozen dataclasses checked when built.

* :class:`LayoutOptions`: which ranks and tensors are whose (``rank_mapping``, ``batch_dim``, ``device``);
* :class:`WireOptions`: how stage-boundary messages travel (``transport``, ``boundary_format``,
  ``timeout_s``, ``recv_lookahead``, ``early_small_receives``, ``inline_limit_bytes``);
* :class:`GradientOptions`: what the backward produces (``zero_bubble``, ``sync_mirror_grads``,
  ``scale_grads``, ``dp_group``, ``dp_op``);
* :class:`MemoryOptions`: what happens to saved activations (``policy``: one for every stage or per stage);
* :class:`DiagnosticsOptions`: what a step records (``record_timeline``);
* :class:`~dualpipe_kernels.runtime.model_options.ModelOptions` (``model_options``): the model's tied
  parameters and batch rule (``tied_parameters``, ``allow_uneven``);
* :class:`~dualpipe_kernels.runtime.graph_options.GraphOptions` (``graphs``): per-chunk CUDA graphs.

:class:`PipelineOptions` holds one of each (its fields, ``GROUP_NAMES``, are the keywords every builder
takes).  Every field is checked in its
group's ``__post_init__`` (a ValueError naming the field), so a bad value fails
where it is written, before any process group is touched.  Values given in a
loose form are stored normalised: a boundary format name becomes a
:class:`~dualpipe_kernels.runtime.boundary.codec.BoundaryFormat` (parsed once,
here), a memory policy name a :class:`~dualpipe_kernels.runtime.memory_plan.MemoryPolicy`,
``rank_mapping`` a tuple, ``device`` a ``torch.device``, ``dp_op=None`` the op
``scale_grads`` implies.

:meth:`PipelineOptions.fold` is the one place where ``Pipeline``'s flat keyword
shorthands (``Pipeline(sched, mods, timeout_s=30)``), listed in the one table ``SHORTHANDS``, are folded into
the groups, with one conflict rule (a shorthand and its group's field given with different values: a ValueError
naming both).
:meth:`PipelineOptions.agreed_fields` is the one place that says which settings
every rank of a pipeline must share: the construction fingerprint
(runtime/fingerprint.py) is built from it.  A new option goes into a group (or a
new group), gets its check in ``__post_init__`` and, when ranks must agree on
it, a line in that group's ``agreed_fields``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from dualpipe_kernels.runtime.boundary.codec import BoundaryFormat, boundary_format
from dualpipe_kernels.runtime.checks import check_timeout, fold_group
from dualpipe_kernels.runtime.graph_options import GraphOptions
from dualpipe_kernels.runtime.memory_plan import MemoryPolicy, parse_memory_policy
from dualpipe_kernels.runtime.model_options import ModelOptions
from dualpipe_kernels.transport import TRANSPORT_NAMES, Transport

__all__ = [
    "DP_OPS",
    "ZERO_BUBBLE_MODES",
    "LayoutOptions",
    "WireOptions",
    "GradientOptions",
    "MemoryOptions",
    "DiagnosticsOptions",
    "PipelineOptions",
    "GROUP_NAMES",
    "SHORTHANDS",
    "BoundaryFormatSpec",
    "MemoryPolicySpec",
]

#: how the data-parallel gradient reduction combines the replicas
DP_OPS = ("sum", "mean")
#: how zero-bubble schedules split the backward (``split``: I/W autograd split; ``store``: the WeightGradStore)
ZERO_BUBBLE_MODES = ("split", "store")

BoundaryFormatSpec = str | tuple[str, str] | BoundaryFormat | None
"""What ``boundary_format`` takes: a name for both directions, ``"act,grad"``, a pair or a BoundaryFormat."""
MemoryPolicySpec = str | MemoryPolicy | Mapping[int, str | MemoryPolicy]
"""What a memory policy takes: one policy (a name or a MemoryPolicy) for every stage or ``{stage: policy}``."""


def _check_bool(value: object, name: str, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, bool):
        want = "True, False or None" if optional else "True or False"
        raise ValueError(f"{name} must be {want}, got {value!r}")


def _check_int(value: object, name: str, low: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        none = " or None" if optional else ""
        raise ValueError(f"{name} must be an int >= {low}{none}, got {value!r}")


@dataclass(frozen=True)
class LayoutOptions:
    """Which process is which pipeline rank, and where the batch and received tensors go.

    ``rank_mapping[group_rank]``: the pipeline rank of that member of the
    pipeline group (identity when None; a permutation, checked against the
    group's size at construction).  ``batch_dim``: the dimension ``step()``
    splits the full batch along.  ``device``: where received tensors go
    (None: the device of the stage modules' parameters).
    """

    rank_mapping: Sequence[int] | None = None
    batch_dim: int = 0
    device: torch.device | str | None = None

    def __post_init__(self) -> None:
        if self.rank_mapping is not None:
            if isinstance(self.rank_mapping, (str, bytes)) or not isinstance(self.rank_mapping, Sequence):
                raise ValueError(f"rank_mapping must be a sequence of pipeline ranks, got {self.rank_mapping!r}")
            mapping = tuple(self.rank_mapping)
            for r in mapping:
                _check_int(r, "rank_mapping entries", 0)
            if len(set(mapping)) != len(mapping):
                raise ValueError(f"rank_mapping must not repeat a pipeline rank, got {list(mapping)}")
            object.__setattr__(self, "rank_mapping", mapping)
        if isinstance(self.batch_dim, bool) or not isinstance(self.batch_dim, int):
            raise ValueError(f"batch_dim must be an int, got {self.batch_dim!r}")
        if self.device is not None:
            try:
                object.__setattr__(self, "device", torch.device(self.device))
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"device must be a torch.device or a device name, got {self.device!r}") from exc

    def agreed_fields(self) -> dict[str, str]:
        """What every rank must share (the mapping itself is compared as the fingerprint's ``placement``)."""
        return {"batch_dim": str(self.batch_dim)}


@dataclass(frozen=True)
class WireOptions:
    """How stage-boundary messages travel.

    ``transport``: ``"auto"`` (the native engine for same-host peers when it is
    built, else torch), ``"torch"``, ``"native"`` or a Transport instance (not
    closed by ``Pipeline.close``).  ``boundary_format``: ``"none"`` (one transfer
    per tensor), ``"packed"`` (one lossless message), ``"bf16"``, ``"fp8"`` or
    ``"fp8_pow2"``; one name for both directions, or ``"act,grad"`` / a pair / a
    BoundaryFormat (stored as a BoundaryFormat).  ``timeout_s``: every wait.
    ``recv_lookahead``: how many compute actions ahead receives are posted
    (None: the transport's ``recv_lookahead``).  ``early_small_receives``: post
    every receive whose message repeats the last step's small inline layout when
    a step starts (None: the transport's choice).  ``inline_limit_bytes``: the
    data bytes up to which a message with a remembered layout travels as one
    transfer (None: the transport's choice, at least 32 KiB; 0: never inline).
    """

    transport: str | Transport = "auto"
    boundary_format: BoundaryFormatSpec = "none"
    timeout_s: float = 120.0
    recv_lookahead: int | None = None
    early_small_receives: bool | None = None
    inline_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.transport, Transport) and self.transport not in TRANSPORT_NAMES:
            raise ValueError(
                f"transport must be one of {', '.join(TRANSPORT_NAMES)} or a Transport instance, got {self.transport!r}"
            )
        object.__setattr__(self, "boundary_format", boundary_format(self.boundary_format))
        object.__setattr__(self, "timeout_s", check_timeout(self.timeout_s))
        if self.recv_lookahead is not None and (
            isinstance(self.recv_lookahead, bool) or not isinstance(self.recv_lookahead, int)
        ):
            raise ValueError(f"recv_lookahead must be an int >= 1 or None, got {self.recv_lookahead!r}")
        if self.recv_lookahead is not None and self.recv_lookahead < 1:
            raise ValueError(f"recv_lookahead must be >= 1, got {self.recv_lookahead}")
        _check_bool(self.early_small_receives, "early_small_receives", optional=True)
        _check_int(self.inline_limit_bytes, "inline_limit_bytes", 0, optional=True)

    @property
    def format(self) -> BoundaryFormat:
        """``boundary_format`` as parsed (a BoundaryFormat whatever form it was given in)."""
        fmt = self.boundary_format
        assert isinstance(fmt, BoundaryFormat)  # normalised in __post_init__
        return fmt

    def agreed_fields(self) -> dict[str, str]:
        """What every rank must share (the resolved transport is the fingerprint's own field; the inline
        limit is agreed once the transport is up, since by default the transport decides it)."""
        return {"boundary_format": str(self.format)}


@dataclass(frozen=True)
class GradientOptions:
    """What the backward produces and how it is combined.

    ``zero_bubble``: how I/W-split schedules split the backward, ``"split"``
    (autograd-graph split) or ``"store"`` (I runs the full backward with the
    WeightGradStore enabled, W pops the store).  ``sync_mirror_grads``: DualPipe
    only, sum the gradients of the two copies of a model stage at the end of the
    step.  ``scale_grads``: seed each micro-batch loss's backward with ``1/N``
    (the full batch's mean-loss gradients for a mean criterion); False sums over
    micro-batches.  ``dp_group``: this rank's data-parallel group (PP x DP).
    ``dp_op``: ``"mean"`` or ``"sum"`` over the replicas (None: ``"mean"`` with
    ``scale_grads``, else ``"sum"``; stored resolved).
    """

    zero_bubble: str = "split"
    sync_mirror_grads: bool = True
    scale_grads: bool = True
    dp_group: dist.ProcessGroup | None = None
    dp_op: str | None = None

    def __post_init__(self) -> None:
        if self.zero_bubble not in ZERO_BUBBLE_MODES:
            raise ValueError(f"zero_bubble must be 'split' or 'store', got {self.zero_bubble!r}")
        _check_bool(self.sync_mirror_grads, "sync_mirror_grads")
        _check_bool(self.scale_grads, "scale_grads")
        if self.dp_group is not None and not isinstance(self.dp_group, dist.ProcessGroup):
            raise ValueError(f"dp_group must be a torch.distributed ProcessGroup or None, got {self.dp_group!r}")
        op = self.dp_op if self.dp_op is not None else ("mean" if self.scale_grads else "sum")
        if op not in DP_OPS:
            raise ValueError(f"dp_op must be one of {', '.join(DP_OPS)}, got {op!r}")
        object.__setattr__(self, "dp_op", op)

    @property
    def reduce_op(self) -> str:
        """``dp_op`` as resolved (``"sum"`` or ``"mean"``)."""
        return str(self.dp_op)

    def agreed_fields(self, has_mirrors: bool) -> dict[str, str]:
        """What every rank must share: ``has_mirrors`` says whether the schedule holds mirror copies (the
        mirror sum is an exchange, so a flag that only matters with copies is compared only then)."""
        dp = "none" if self.dp_group is None else f"{dist.get_world_size(self.dp_group)} replicas, {self.dp_op}"
        return {
            "sync_mirror_grads": str(self.sync_mirror_grads and has_mirrors),
            "scale_grads": str(self.scale_grads),
            "data_parallel": dp,
        }


@dataclass(frozen=True)
class MemoryOptions:
    """What happens to each stage's saved activations.

    ``policy``: one policy for every stage, or ``{stage: policy}`` naming any
    stages of the schedule (a rank uses the entries of the stages it holds;
    stages not named keep their activations).  A policy is a name (``"keep"``,
    ``"recompute"``, ``"compress"`` / ``"compress:bf16"`` / ``"compress:fp8"``,
    ``"offload"``) or a :class:`MemoryPolicy`; names are stored parsed.  Ranks
    compare the policy of every stage two of them name (``memory_policy[stage s]``).
    """

    policy: MemoryPolicySpec = "keep"

    def __post_init__(self) -> None:
        if isinstance(self.policy, Mapping):
            parsed: dict[int, MemoryPolicy] = {}
            for stage, pol in self.policy.items():
                if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
                    raise ValueError(f"memory_policy: stage keys must be ints >= 0, got {stage!r}")
                parsed[stage] = MemoryPolicy.parse(pol)
            object.__setattr__(self, "policy", MappingProxyType(dict(sorted(parsed.items()))))
        else:
            object.__setattr__(self, "policy", MemoryPolicy.parse(self.policy))

    def for_stages(self, stages: Sequence[int]) -> dict[int, MemoryPolicy]:
        """``{stage: policy}`` for ``stages`` (a rank's own): the mapping's entries, ``keep`` where it has none."""
        if isinstance(self.policy, MemoryPolicy):
            return parse_memory_policy(self.policy, stages)
        assert isinstance(self.policy, Mapping)
        return parse_memory_policy({s: p for s, p in self.policy.items() if s in stages}, stages)

    def check_stages(self, num_stages: int) -> None:
        """ValueError when a per-stage mapping names a stage the schedule does not have."""
        if isinstance(self.policy, Mapping):
            unknown = sorted(s for s in self.policy if s >= num_stages)
            if unknown:
                raise ValueError(
                    f"memory_policy names stage(s) {unknown} but the schedule has stages 0..{num_stages - 1}"
                )

    def stated_fields(self, num_stages: int) -> dict[str, str]:
        """Every stage this rank states a policy for (all of them for one policy), compared stage by stage
        with the ranks that state one too: ranks naming only their own stages never clash."""
        if isinstance(self.policy, MemoryPolicy):
            named: Mapping[int, Any] = dict.fromkeys(range(num_stages), self.policy)
        else:
            assert isinstance(self.policy, Mapping)
            named = self.policy
        return {f"memory_policy[stage {s}]": _describe_policy(p) for s, p in named.items()}


def _describe_policy(p: MemoryPolicy) -> str:
    """A policy's full description (two ranks using the same name with other thresholds differ too)."""
    if p == MemoryPolicy.parse(p.name):
        return p.name
    return f"{p.name} (min_bytes={p.min_bytes}, lookahead={p.lookahead})"


@dataclass(frozen=True)
class DiagnosticsOptions:
    """What a step records besides its results, and how failures spread.

    ``record_timeline``: fill ``StepResult.timeline``.  ``watch_peers``: a rank whose step fails tells the
    others through the group's store, and a rank gone silent for ``liveness_s`` seconds (killed, stopped)
    is named by every other rank (runtime/peer_watch.py); waits then end within ``poll_s`` naming that rank.
    """

    record_timeline: bool = False
    watch_peers: bool = True
    poll_s: float = 0.1
    liveness_s: float = 30.0

    def __post_init__(self) -> None:
        _check_bool(self.record_timeline, "record_timeline")
        _check_bool(self.watch_peers, "watch_peers")
        for name in ("poll_s", "liveness_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"DiagnosticsOptions.{name} must be a finite number of seconds > 0, got {value!r}")
        if not self.poll_s < self.liveness_s:
            raise ValueError(f"DiagnosticsOptions.poll_s ({self.poll_s}) must be below liveness_s ({self.liveness_s})")


_GROUPS: dict[str, type[Any]] = {
    "layout": LayoutOptions,
    "wire": WireOptions,
    "gradients": GradientOptions,
    "memory": MemoryOptions,
    "diagnostics": DiagnosticsOptions,
    "model_options": ModelOptions,
    "graphs": GraphOptions,
}
#: the option groups every builder takes, as keywords: ``Pipeline(..., wire=WireOptions(...))``
GROUP_NAMES = tuple(_GROUPS)
#: flat keyword -> (group, field): Pipeline's shorthands, the one table they are read from
SHORTHANDS = {
    "rank_mapping": ("layout", "rank_mapping"),
    "batch_dim": ("layout", "batch_dim"),
    "device": ("layout", "device"),
    "transport": ("wire", "transport"),
    "boundary_format": ("wire", "boundary_format"),
    "timeout_s": ("wire", "timeout_s"),
    "recv_lookahead": ("wire", "recv_lookahead"),
    "early_small_receives": ("wire", "early_small_receives"),
    "zero_bubble": ("gradients", "zero_bubble"),
    "sync_mirror_grads": ("gradients", "sync_mirror_grads"),
    "scale_grads": ("gradients", "scale_grads"),
    "dp_group": ("gradients", "dp_group"),
    "dp_op": ("gradients", "dp_op"),
    "memory_policy": ("memory", "policy"),
    "record_timeline": ("diagnostics", "record_timeline"),
    "tied_parameters": ("model_options", "tied_parameters"),
    "allow_uneven": ("model_options", "allow_uneven"),
}


@dataclass(frozen=True)
class PipelineOptions:
    """One of each option group: everything a Pipeline is configured with besides its schedule, modules and
    process group."""

    layout: LayoutOptions = field(default_factory=LayoutOptions)
    wire: WireOptions = field(default_factory=WireOptions)
    gradients: GradientOptions = field(default_factory=GradientOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    diagnostics: DiagnosticsOptions = field(default_factory=DiagnosticsOptions)
    model_options: ModelOptions = field(default_factory=ModelOptions)
    graphs: GraphOptions = field(default_factory=GraphOptions)

    def __post_init__(self) -> None:
        for name, cls in _GROUPS.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise ValueError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")

    @classmethod
    def fold(
        cls,
        groups: Mapping[str, object | None],
        shorthands: Mapping[str, object | None],
    ) -> PipelineOptions:
        """The options from the groups given (``{"wire": WireOptions(...) or None, ...}``) and the flat
        shorthands (``{"timeout_s": 30.0 or None, ...}``; None: not given).

        The one conflict rule: a shorthand sets its field in its group (a group left out starts from its
        defaults); a shorthand whose group is given too must agree with the group's field (compared once
        both are normalised), else a ValueError names both.
        """
        unknown = sorted(set(groups) - set(_GROUPS)) + sorted(set(shorthands) - set(SHORTHANDS))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}")
        built = {}
        for name, group_cls in _GROUPS.items():
            flat = {k: (f, shorthands.get(k)) for k, (g, f) in SHORTHANDS.items() if g == name}
            built[name] = fold_group(name, group_cls, groups.get(name), flat)
        return cls(**built)

    def agreed_fields(self, num_stages: int, has_mirrors: bool) -> tuple[dict[str, str], dict[str, str]]:
        """What the ranks of one pipeline must share, as short strings: ``(shared, stated)``, the fields every
        rank has and the fields only some ranks state (per-stage memory policies), compared among those that
        state them.  The construction fingerprint's extra fields (runtime/fingerprint.py)."""
        shared = {
            **self.layout.agreed_fields(),
            **self.wire.agreed_fields(),
            **self.gradients.agreed_fields(has_mirrors),
            **self.model_options.agreed_fields(),
        }
        return shared, self.memory.stated_fields(num_stages)
