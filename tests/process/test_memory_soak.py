"""A 300-step soak of every memory policy: RSS, live tensors, threads and fds stay flat (2 CPU ranks).

``memory_workers.soak`` runs GPipe (2 ranks x 3 micro-batches: cheap steps, and
each rank offloads its first micro-batch; the dropout MLP of the policy tests,
~1 KB activations) for ``STEPS`` steps under each
policy in turn and samples the process every ``EVERY`` steps.  After the first
sample (allocator, arena, copy lanes and transport settled):

* RSS grows by at most ``RSS_TOL_BYTES`` = 2 MiB (the per-step history alone
  used to grow without bound; one leaked step's activations would be ~20 KB, 5 MB
  over 250 steps);
* live tensors, OS threads and open fds do not change;
* the pipeline's history holds at most ``HISTORY`` steps, and closing it ends its
  copy lanes' threads (two while an offload pipeline runs, none after its close).
"""

from __future__ import annotations

from typing import Any

import pytest

#: the longest tests of the suite (leave them out with -m "not slow")
pytestmark = pytest.mark.slow

STEPS = 300
EVERY = 50
RSS_TOL_BYTES = 2 << 20
POLICIES = ["keep", "recompute", "compress:bf16", "compress:fp8", "offload", "offload:bf16", "offload:fp8"]


@pytest.fixture(scope="module")
def soaked() -> list[dict[str, Any]]:
    from memory_workers import soak

    from dualpipe_kernels.runtime.launch import spawn

    return spawn(soak, 2, POLICIES, STEPS, EVERY, timeout_s=240.0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", POLICIES)
def test_300_steps_flat(soaked: list[dict[str, Any]], policy: str) -> None:
    from dualpipe_kernels.runtime.memory import HISTORY

    for rank, res in enumerate(soaked):
        run = res[policy]
        samples = run["samples"]
        assert len(samples) == STEPS // EVERY
        first, last = samples[0], samples[-1]
        growth = last[1] - first[1]
        assert growth <= RSS_TOL_BYTES, f"rank {rank} {policy}: RSS grew {growth / 2**20:.2f} MiB: {samples}"
        for what, col in (("live tensors", 2), ("threads", 3), ("fds", 4)):
            assert len({s[col] for s in samples}) == 1, f"rank {rank} {policy}: {what} move: {samples}"
        assert run["history"] == min(STEPS, HISTORY)
        assert run["lane_threads_after_close"] == [], f"rank {rank}: copy lanes outlive the pipeline"
        if policy.startswith("offload"):
            assert run["packs"] > 0
            assert len(run["lane_threads_running"]) == 2, f"rank {rank}: lanes {run['lane_threads_running']}"
