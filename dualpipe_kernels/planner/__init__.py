"""Planner: profile layers, partition them into stages (exact), search a plan with the simulator.

* :mod:`.layers`: the per-layer cost table and its ``--layers`` JSON format.
* :mod:`.profile`: measure a model's layers on a sample micro-batch (or the parameter-count fallback).
* :mod:`.partition`: exact, placement-aware partition of layers into model stages.
* :mod:`.partition`'s exact searches, one per placement kind: :mod:`.partition_search`.
* :mod:`.candidates`: the cluster, a candidate configuration, the result (what :mod:`.plan` takes and returns).
* :mod:`.plan`: search schedule x PP x DP x micro-batches under a memory budget, ranked by the simulator;
  :mod:`.explain` says why it chose its plan.
"""

from .layers import LayerCost, LayerTable, load_layers, save_layers
from .partition import Partition, Placement, partition_layers, placement_of, stage_modules
from .plan import Candidate, Cluster, PlanError, PlanResult, plan

__all__ = [
    "Candidate",
    "Cluster",
    "LayerCost",
    "LayerTable",
    "Partition",
    "PlanError",
    "PlanResult",
    "Placement",
    "load_layers",
    "param_count_table",
    "partition_layers",
    "placement_of",
    "plan",
    "profile_layers",
    "save_layers",
    "stage_modules",
]

_LAZY = {"profile_layers", "param_count_table"}  # import torch only when profiling


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from . import profile

        return getattr(profile, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
