"""Memory policies per stage, and when this rank reloads offloaded activations (read from its lowered list).

A policy says what happens to the tensors autograd saves during a stage's
forward (its *saved activations*), until that micro-batch's backward frees them:

* ``keep``: stay where they are (plain autograd);
* ``recompute``: only the stage's inputs stay; the forward re-runs right before
  the backward (same RNG state) and its saved tensors are used instead;
* ``compress`` (``compress:bf16``, ``compress:fp8``): floating tensors are stored
  packed in bf16 or fp8 (lossy, opt-in) and unpacked when the backward reads them;
* ``offload`` (``offload:bf16``, ``offload:fp8``): storages of at least
  ``min_bytes`` go to a host arena, all of one forward through one pack launch at
  its end (cast to bf16 or fp8 on the way when a format is given: lossy, opt-in,
  the same formats as compress), and come back through one unpack launch
  ``lookahead`` compute actions before the consuming backward.

Parameters (and views of them) and the stage's own inputs never move.
The reload points come from this rank's lowered action list, the same list the
action loop runs and the simulator times: nothing here re-derives the order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from dualpipe_kernels.schedules.ir import Action
from dualpipe_kernels.schedules.memory_model import reload_points

__all__ = ["MemoryPolicy", "OFFLOAD_PATHS", "POLICY_KINDS", "parse_memory_policy", "ReloadPlan"]

POLICY_KINDS = ("keep", "recompute", "compress", "offload")
_FORMATS: dict[str, torch.dtype | None] = {"none": None, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
#: how a GPU offload reaches the pinned arena: ``staging`` packs into a device buffer then copies it to the
#: host in one D2H copy; ``mapped`` packs straight into the pinned arena (mapped into the device's address
#: space).  On CPU both are one pack into the arena.
OFFLOAD_PATHS = ("staging", "mapped")

Key = tuple[int, int]  # (stage, micro-batch)


@dataclass(frozen=True)
class MemoryPolicy:
    """One stage's policy.  ``fmt``: ``bf16``/``fp8`` for compress (default bf16), ``none``
    (default), ``bf16`` or ``fp8`` for offload (the cast of its one pack per forward).
    ``min_bytes``: smaller tensors never move (offload) or stay uncompressed.  ``lookahead``:
    compute actions between the start of a reload and its backward.  ``offload_path``: how a
    GPU offload reaches the pinned arena (:data:`OFFLOAD_PATHS`)."""

    kind: str = "keep"
    fmt: str | None = None
    min_bytes: int = 1024
    lookahead: int = 2
    offload_path: str = "staging"

    def __post_init__(self) -> None:
        if self.kind not in POLICY_KINDS:
            raise ValueError(f"memory policy {self.kind!r} is unknown; choose one of {', '.join(POLICY_KINDS)}")
        if self.fmt is None:
            object.__setattr__(self, "fmt", "bf16" if self.kind == "compress" else "none")
        if self.fmt not in _FORMATS or (self.kind == "compress" and self.fmt == "none"):
            choices = "bf16 or fp8" if self.kind == "compress" else "none, bf16 or fp8"
            raise ValueError(f"memory policy {self.kind} format {self.fmt!r} is unknown; choose {choices}")
        if self.fmt != "none" and self.kind not in ("compress", "offload"):
            raise ValueError(f"memory policy {self.kind} takes no format (got {self.fmt!r})")
        if self.offload_path not in OFFLOAD_PATHS:
            raise ValueError(
                f"memory policy offload_path {self.offload_path!r} is unknown; choose {' or '.join(OFFLOAD_PATHS)}"
            )
        if self.min_bytes < 0 or self.lookahead < 1:
            raise ValueError(
                f"memory policy needs min_bytes >= 0 and lookahead >= 1, got {self.min_bytes}, {self.lookahead}"
            )

    @property
    def dtype(self) -> torch.dtype | None:
        """The cast of compress or offload (None: lossless)."""
        return _FORMATS[self.fmt or "none"]

    @property
    def name(self) -> str:
        """``keep``, ``recompute``, ``offload``, ``offload:bf16``, ``offload:fp8``, ``compress:bf16`` or
        ``compress:fp8``."""
        return self.kind if self.fmt == "none" else f"{self.kind}:{self.fmt}"

    @classmethod
    def parse(cls, value: str | MemoryPolicy) -> MemoryPolicy:
        """A policy from its name (``compress:fp8``) or as given."""
        if isinstance(value, MemoryPolicy):
            return value
        if not isinstance(value, str):
            raise ValueError(f"memory policy must be a name or a MemoryPolicy, got {type(value).__name__}")
        kind, colon, fmt = value.partition(":")
        if colon and (kind not in ("compress", "offload") or fmt not in ("bf16", "fp8")):
            raise ValueError(
                f"memory policy {value!r} is unknown; a format goes with compress or offload: "
                "compress:bf16, compress:fp8, offload:bf16, offload:fp8"
            )
        return cls(kind, fmt or None)


def parse_memory_policy(
    value: str | MemoryPolicy | Mapping[int, str | MemoryPolicy], stages: Sequence[int]
) -> dict[int, MemoryPolicy]:
    """``{stage: policy}`` for this rank's ``stages`` from one policy for all or a per-stage mapping
    (stages it does not name keep their activations)."""
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(stages))
        if unknown:
            raise ValueError(
                f"memory_policy names stage(s) {unknown} that this rank does not hold (it holds {list(stages)})"
            )
        return {s: MemoryPolicy.parse(value.get(s, "keep")) for s in stages}
    pol = MemoryPolicy.parse(value)
    return {s: pol for s in stages}


class ReloadPlan:
    """Where offloaded activations come back on this rank: the rule of
    :func:`~dualpipe_kernels.schedules.memory_model.reload_points` (shared with the
    simulator), indexed by position in this rank's lowered ``actions``.

    ``reload_at[i]``: keys whose reload starts before action ``i`` runs (with ``settle``, every
    compute action is there, most with no key: the offloads of earlier forwards settle there, see
    :meth:`~dualpipe_kernels.runtime.memory.ActivationMemory.at_action`);
    ``resident``: keys consumed so soon after their forward that they never move.
    """

    def __init__(self, actions: Sequence[Action], lookahead: Mapping[int, int], settle: bool = False) -> None:
        at_compute, self.resident = reload_points(actions, lookahead)
        compute_index = [i for i, a in enumerate(actions) if a.is_compute]
        self.reload_at: dict[int, list[Key]] = {i: [] for i in compute_index} if settle else {}
        self.reload_at.update({compute_index[p]: keys for p, keys in at_compute.items()})
