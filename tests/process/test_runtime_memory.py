"""50 training steps: live tensors and process memory do not grow.

Two ranks run DualPipeV through the native API (toy stages) and through compat
(the reference example's model, WeightGradStore) for 50 steps each on a
4096-row batch (~20 KB per activation) with an SGD update after each step
(``rank_lifecycle.many_steps``, inside the shared ``lifecycle_run``).  After
``WARMUP`` steps (allocator and transport buffers settle):

* the number of gc-tracked torch.Tensor objects (counted every 5th step) is
  the same from step 10 to step 50 (tolerance ``TENSOR_TOL`` = 0);
* RSS grows by at most ``RSS_TOL_BYTES`` = 4 MiB over the remaining 40 steps
  (leaking one step's activations would add ~0.5 MB per step, ~20 MB in all);
* native API: the pool of small-message receive buffers (the activations travel
  inline) stops allocating after the second step.
"""

from __future__ import annotations

import pytest

WARMUP = 10
TENSOR_TOL = 0
RSS_TOL_BYTES = 4 << 20


@pytest.mark.timeout(600)
@pytest.mark.parametrize("api", ["native", "compat"])
def test_no_growth_over_50_steps(api, lifecycle_run):
    for rank, res in enumerate(lifecycle_run):
        run = res[f"memory_{api}"]
        assert len(run["rss"]) == 50
        tensors = [n for step, n in run["tensors"].items() if step >= WARMUP]
        rss = run["rss"][WARMUP - 1 :]
        assert max(tensors) - min(tensors) <= TENSOR_TOL, f"rank {rank}: live tensors per step {run['tensors']}"
        growth = rss[-1] - rss[0]
        assert growth <= RSS_TOL_BYTES, f"rank {rank}: RSS grew {growth / 2**20:.2f} MiB over 40 steps (limit 4 MiB)"
        if api == "native":
            # ~20 KB activations travel inline: their receive buffers come from the pool, allocated in the
            # first steps (the first step of a key is two-phase, the second fills the pool) and then reused.
            pool = run["pool"]
            assert pool[1] > 0 and pool[-1] == pool[1], f"rank {rank}: pool allocations per step {pool}"
