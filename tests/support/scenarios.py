"""Run named multi-process scenarios inside one spawned group and report each one's outcome.

A test file with many small multi-process checks spawns its ranks once and runs
every scenario in turn; a failing scenario does not stop the others, and the
parent turns each rank's outcome into one parametrized test.
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist


def run_scenarios(scenarios: Mapping[str, Callable[[int], None]], rank: int) -> dict[str, str]:
    """``{name: "ok" or the traceback}`` of each ``scenarios[name](rank)``, with a barrier after each."""
    out: dict[str, str] = {}
    for name, fn in scenarios.items():
        try:
            fn(rank)
            out[name] = "ok"
        except Exception:  # noqa: BLE001 - reported per scenario
            out[name] = traceback.format_exc()
        dist.barrier()
    return out


def run_module_scenarios(rank: int, world_size: int, module: str) -> dict[str, str]:
    """A spawn target: :func:`run_scenarios` over the ``SCENARIOS`` of the test module named ``module``."""
    return run_scenarios(importlib.import_module(module).SCENARIOS, rank)


def check_scenario(per_rank: Sequence[Mapping[str, Any]], name: str) -> None:
    """Every rank's outcome of scenario ``name`` is "ok" (else the failing rank's traceback)."""
    for rank, res in enumerate(per_rank):
        assert res[name] == "ok", f"rank {rank}:\n{res[name]}"
