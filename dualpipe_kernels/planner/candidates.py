"""What the planner works with and returns: the cluster, one candidate configuration, the result, its error.

:class:`Cluster` (devices, memory, links) is the input, checked on construction; :class:`Candidate` is a
configuration and, once :mod:`.plan` has evaluated it, its predicted step and memory; :class:`PlanResult`
holds the best candidate, the others shown and :mod:`.explain`'s sentences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Candidate", "Cluster", "PlanError", "PlanResult"]


class PlanError(ValueError):
    """No plan exists; the message names the constraint to relax and by how much."""


@dataclass(frozen=True)
class Cluster:
    """Devices and links.  Bandwidths in bytes/s, latencies in s, memory in bytes per device."""

    devices: int
    devices_per_node: int
    memory_bytes: float
    intra_bandwidth: float = 200e9
    intra_latency: float = 5e-6
    inter_bandwidth: float = 25e9
    inter_latency: float = 10e-6
    host_bandwidth: float = 25e9  # device <-> host, for the offload policy's reloads

    def __post_init__(self) -> None:
        for name in ("devices", "devices_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.devices % self.devices_per_node:
            raise ValueError(
                f"devices ({self.devices}) must be a multiple of devices per node ({self.devices_per_node})"
            )
        for name in ("memory_bytes", "intra_bandwidth", "inter_bandwidth", "host_bandwidth"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        for name in ("intra_latency", "inter_latency"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


@dataclass
class Candidate:
    """One configuration and, once evaluated, its predicted step and memory.

    ``peak_memory_bytes`` is the worst pipeline rank's parameter state + saved activations;
    ``param_state_bytes``/``activation_bytes`` are that rank's parts; ``activation_bytes_per_rank``
    the predicted activation peak of every pipeline rank.
    """

    schedule: str
    pp: int
    dp: int
    microbatches: int
    microbatch_size: int
    memory_policy: str = "keep"
    lower_bound_s: float = 0.0
    simulated_step_s: float | None = None
    pipeline_s: float = 0.0
    compute_s: float = 0.0
    allreduce_s: float = 0.0
    peak_memory_bytes: float = 0.0
    param_state_bytes: float = 0.0
    activation_bytes: float = 0.0
    activation_bytes_per_rank: tuple[float, ...] = ()
    feasible: bool = False
    partition: tuple[int, ...] = ()

    @property
    def bubble_s(self) -> float:
        return self.pipeline_s - self.compute_s

    @property
    def label(self) -> str:
        policy = "" if self.memory_policy == "keep" else f" {self.memory_policy}"
        return f"{self.schedule} pp={self.pp} dp={self.dp} mb={self.microbatches}x{self.microbatch_size}{policy}"

    def to_dict(self) -> dict[str, object]:
        return {
            "schedule": self.schedule,
            "pp": self.pp,
            "dp": self.dp,
            "microbatches": self.microbatches,
            "microbatch_size": self.microbatch_size,
            "memory_policy": self.memory_policy,
            "simulated_step_s": self.simulated_step_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "feasible": self.feasible,
            "partition": list(self.partition),
            "pipeline_s": self.pipeline_s,
            "compute_s": self.compute_s,
            "bubble_s": self.bubble_s,
            "allreduce_s": self.allreduce_s,
            "param_state_bytes": self.param_state_bytes,
            "activation_bytes": self.activation_bytes,
            "activation_bytes_per_rank": list(self.activation_bytes_per_rank),
        }


@dataclass
class PlanResult:
    best: Candidate
    candidates: list[Candidate]
    unit: str
    considered: int
    simulated: int
    elapsed_s: float
    explanation: list[str] = field(default_factory=list)
