"""Per-chunk graphs across ranks, on CPU processes: cross-rank boundaries and a PP x DP grid.

Each rank trains its stages three steps eager and three with ``GraphOptions(enabled=True)`` through the
tests' rerun capture backend (tests/support/graph_capturers.py: the replay path with real results on
CPU tensors); the two runs must agree bit for bit on every rank (same ops in the same order: tolerance 0),
with every stage captured and replaying.
"""

from __future__ import annotations

import pytest
from graph_runs import ranks_worker

from dualpipe_kernels.runtime import spawn


@pytest.mark.parametrize("schedule, world, dp", [("dualpipev", 2, False), ("1f1b", 2, False), ("zb1p", 4, True)])
def test_graphed_ranks_train_bit_exact_with_eager(schedule, world, dp):
    results = spawn(ranks_worker, world, schedule, dp, timeout_s=240)
    for rank, r in enumerate(results):
        assert r["same"], f"rank {rank}: graphed training differs from eager"
        assert set(r["states"].values()) == {"captured"} and r["eager_calls"] == 0, (rank, r)
        assert all(v["F"] > 0 and v["B"] > 0 for v in r["replays"].values()), (rank, r)
