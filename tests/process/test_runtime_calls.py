"""The runtime's own Python per compute action: fewer than 20 function calls on the fast path.

DualPipeV 2 ranks x 16 micro-batches, one Linear(8, 8) per stage, one step after three (every message
repeats its layout): Python function calls counted with ``sys.setprofile`` (``call`` events) over the step,
by where they go (tests/support/call_counting.py): the runtime's own (the package less its transport layer),
the transport layer (transport/, the peer watch), the rest (torch's modules and autograd, the criterion).
Divided by the rank's compute actions (F, B, I, W, F&B pairs), as ``bench overhead`` divides its time.
"""

from __future__ import annotations

import pytest

RUNTIME_CALLS_MAX = 20  # per compute action


@pytest.mark.parametrize("transport", ["native", "torch"])
def test_the_runtime_makes_fewer_than_20_python_calls_per_compute_action(transport: str) -> None:
    from call_counting import count_step

    from dualpipe_kernels.runtime.launch import spawn

    for rank, out in enumerate(spawn(count_step, 2, transport, 16, timeout_s=180.0)):
        counts, actions = out["counts"], out["compute_actions"]
        per_action = {layer: n / actions for layer, n in counts.items()}
        assert out["losses"] == (16 if rank == 0 else 0) and actions > 16
        # the count sees the step: every compute action runs runtime Python, and torch's module calls run too
        assert per_action["runtime"] >= 3 and per_action["other"] >= 1, per_action
        assert per_action["runtime"] < RUNTIME_CALLS_MAX, (
            f"rank {rank} over {transport}: {per_action['runtime']:.1f} Python calls of the runtime per compute "
            f"action (transport layer {per_action['transport']:.1f}, torch and the caller {per_action['other']:.1f})"
        )
