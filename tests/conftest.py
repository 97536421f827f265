"""Shared fixtures of the runtime tests.

The suite has two rooms: ``tests/unit`` runs in this process (fast: ``pytest
tests/unit``), ``tests/process`` spawns ranks or other processes.  Helper
modules live in ``tests/support``, which goes on ``sys.path`` so tests and the
spawned worker processes import the rank functions (``rank_configs``,
``rank_lifecycle``) by name (the spawn start method passes ``sys.path`` on).

``spawned_runs(cfg)`` runs every configuration of
``toy_models.configs_for_world(cfg.world)`` in ONE group of spawned
processes, the first time a test asks for that world size, and caches the
per-rank results for the session: process start costs seconds (torch import),
a configuration milliseconds.  ``lifecycle_run`` does the same for the
two-pipelines and memory checks, ``error_runs`` for the bad-input and
fail-fast cases.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import pytest

# CI runs the property tests on a fixed set of examples (reproducible); locally
# hypothesis explores new ones on every run.
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        _hyp_settings.load_profile("ci")
except ImportError:  # hypothesis is a test dependency; conftest must not fail without it
    pass

# Ranks start forked from a server that imported torch once (runtime.launch.start_method): ~0.1 s a rank
# instead of ~2 s of CPU for a fresh interpreter, over a few hundred launches.  Command-line tests run
# as subprocesses inherit it.  DPK_START_METHOD=spawn runs the suite the default way; test_launch_failures
# runs its checks under both.
os.environ.setdefault("DPK_START_METHOD", "forkserver")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
#: the helper modules (toy models, rank functions, fake transports), imported by bare name
SUPPORT_DIR = os.path.join(TESTS_DIR, "support")
if SUPPORT_DIR not in sys.path:
    sys.path.insert(0, SUPPORT_DIR)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of tests/process ``process`` (``-m "not process"`` runs the in-process room only)."""
    for item in items:
        if f"{os.sep}process{os.sep}" in str(item.path):
            item.add_marker(pytest.mark.process)


#: every wait inside a pipeline step (seconds); a configuration that fails costs at most about this
PIPELINE_TIMEOUT_S = 30.0
#: the whole spawned run of one world size
SPAWN_TIMEOUT_S = 300.0


@pytest.fixture(scope="session")
def spawned_runs() -> Callable[[Any], list[dict[str, Any]]]:
    """``get(cfg)``: every process's results of the spawned run (one per world size) that holds ``cfg``."""
    from rank_configs import run_configs
    from toy_models import configs_for_world

    from dualpipe_kernels.runtime.launch import spawn

    cache: dict[int, list[dict[str, Any]] | BaseException] = {}

    def get(cfg: Any) -> list[dict[str, Any]]:
        world = cfg.world
        if world not in cache:
            try:
                cache[world] = spawn(
                    run_configs, world, configs_for_world(world), PIPELINE_TIMEOUT_S, timeout_s=SPAWN_TIMEOUT_S
                )
            except Exception as e:  # noqa: BLE001 - every test of this world size reports it
                cache[world] = e
        got = cache[world]
        if isinstance(got, BaseException):
            raise got
        return got

    return get


#: steps of the memory run (tests/process/test_runtime_memory.py)
LIFECYCLE_STEPS = 50


@pytest.fixture(scope="session")
def lifecycle_run() -> list[dict[str, Any]]:
    """Per-rank results of ``rank_lifecycle.lifecycle`` on 2 ranks: two pipelines, then 50-step memory runs."""
    from rank_lifecycle import lifecycle

    from dualpipe_kernels.runtime.launch import spawn

    return spawn(lifecycle, 2, LIFECYCLE_STEPS, timeout_s=SPAWN_TIMEOUT_S)


@pytest.fixture(scope="session")
def error_runs() -> list[dict[str, Any]]:
    """Per-rank results of ``rank_fail_fast.error_cases`` on 2 ranks: bad inputs, then fail-fast cases (one spawn)."""
    from rank_fail_fast import error_cases
    from rank_lifecycle import BAD_INPUT_CASES, BAD_INPUT_TIMEOUT_S

    from dualpipe_kernels.runtime.launch import spawn

    return spawn(error_cases, 2, BAD_INPUT_CASES, BAD_INPUT_TIMEOUT_S, timeout_s=SPAWN_TIMEOUT_S, pg_timeout_s=120)
