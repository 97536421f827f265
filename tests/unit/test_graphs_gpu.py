"""Per-chunk CUDA graphs on a GPU (marked ``gpu``; bench/device_check.sh's ``gpu`` step runs them).

A one-rank, two-stage Linear/GELU pipeline (tests/support/graph_runs.py) trains three steps with
``GraphOptions(enabled=True)`` and without: the first step records, its end captures, the next two
replay.  Bit for bit (tolerance 0): a replay launches the kernels the eager step launched, on the same
data, in the same order.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from graph_runs import same_training, train

from dualpipe_kernels.runtime import GraphOptions, free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ["interleaved1f1b", "zbv"])
def test_capture_and_replay_are_bit_exact_with_eager(name):
    eager = train(name, device="cuda")
    graphed = train(name, GraphOptions(enabled=True), device="cuda")
    status = graphed.pipe.graph_status
    assert {s: st.state for s, st in status.items()} == {0: "captured", 1: "captured"}, status
    assert same_training(graphed, eager)


def test_replays_are_the_schedules_f_and_b_count():
    graphed = train(graphs=GraphOptions(enabled=True), device="cuda")
    plan = graphed.pipe._graphs.plan
    for s, st in graphed.pipe.graph_status.items():
        assert st.graphs == plan.graphs_of(s) and not st.eager_calls
        assert st.replays == {k: 2 * plan.replays[(s, k)] for k in ("F", "B")}  # steps 2 and 3


def test_an_unseen_shape_runs_eager():
    rows = (8, 12, 8)
    eager = train(rows=rows, device="cuda")
    graphed = train(graphs=GraphOptions(enabled=True), rows=rows, device="cuda")
    assert same_training(graphed, eager)
    plan = graphed.pipe._graphs.plan
    for s, st in graphed.pipe.graph_status.items():
        ((reason, n),) = st.eager_calls.items()
        assert "not seen at capture" in reason and n == plan.replays[(s, "F")]
        assert st.replays == {k: plan.replays[(s, k)] for k in ("F", "B")}
