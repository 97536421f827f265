"""Per-chunk CUDA graphs, the CPU side: the option's checks, the capture plan of every schedule, every
fallback reachable without a GPU, and training bit for bit against eager.

The graph path itself (static buffers, slots, the replay's autograd node, weight gradients deferred to
the W) runs here through ``graph_capturers.RerunCapture``, a capture backend whose replay runs the
captured function again on the slot's buffers: the results are real, and bit-exact equality with an
eager pipeline (same ops, same order, so tolerance 0) checks the plumbing.  On a GPU the same tests
with CUDAGraph replays are in tests/unit/test_graphs_gpu.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from graph_capturers import ClaimsCuda, RerunCapture
from graph_runs import IN, batches, same_training, train, two_stage_modules

from dualpipe_kernels.runtime import GraphOptions, Pipeline, free_port
from dualpipe_kernels.runtime.graph_capture import capturing_with
from dualpipe_kernels.runtime.graph_plan import capture_plan
from dualpipe_kernels.schedules.generators import SCHEDULE_NAMES, build_schedule
from dualpipe_kernels.schedules.ir import T_B, T_F, T_I, T_W


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# ---- the option ---------------------------------------------------------------------------------------------
def test_graphs_are_off_by_default():
    assert GraphOptions().enabled is False
    run = train(graphs=None, rows=(8,))
    assert run.pipe.graph_status == {} and run.pipe.graph_options == GraphOptions()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"enabled": 1}, r"GraphOptions.enabled must be a bool, got 1"),
        ({"allow_rng": "yes"}, r"GraphOptions.allow_rng must be a bool, got 'yes'"),
        ({"warmup_iters": 0}, r"warmup_iters must be an int >= 1, got 0"),
        ({"warmup_iters": True}, r"warmup_iters must be an int >= 1, got True"),
        (
            {"capture_error_mode": "local"},
            r"capture_error_mode must be one of thread_local, global, relaxed, got 'local'",
        ),
        ({"max_graphs_per_stage": 1}, r"max_graphs_per_stage must be None or an int >= 2 .*got 1"),
    ],
)
def test_bad_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GraphOptions(**kwargs)


def test_the_pipeline_takes_only_a_graph_option_group():
    with pytest.raises(ValueError, match="graphs must be a GraphOptions, got dict"):
        train(graphs={"enabled": True}, rows=(8,))  # type: ignore[arg-type]


# ---- the capture plan ---------------------------------------------------------------------------------------
def _live_peak(schedule, rank, stage):
    """Micro-batches of ``stage`` alive at once: from the F to the last gradient action (B, or W after I)."""
    acts = [c for a in schedule.actions[rank] for c in a.computes() if c.stage == stage]
    has_w = {c.microbatch for c in acts if c.type is T_W}
    live, peak = set(), 0
    for c in acts:
        if c.type is T_F:
            live.add(c.microbatch)
            peak = max(peak, len(live))
        elif c.type is T_W or c.type is T_B or (c.type is T_I and c.microbatch not in has_w):
            live.discard(c.microbatch)
    return peak


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_schedule_gets_a_slot_per_live_microbatch(name):
    ranks = 4
    sched = build_schedule(name, ranks, 8)
    for rank in range(ranks):
        plan = capture_plan(sched, rank)
        acts = [c for a in sched.actions[rank] for c in a.computes()]
        for s in sched.stages_of_rank(rank):
            peak = _live_peak(sched, rank, s)
            assert plan.slots_of(s, None) == peak and plan.graphs_of(s) == 2 * peak
            assert plan.replays[(s, "F")] == sum(1 for c in acts if c.stage == s and c.type is T_F)
            assert plan.replays[(s, "B")] == sum(1 for c in acts if c.stage == s and c.type in (T_B, T_I))
            assert list(plan.forward_order[s]) == [c.microbatch for c in acts if c.stage == s and c.type is T_F]
        # no slot holds two live micro-batches: replaying the plan's order never finds its slot busy
        busy: dict[tuple[int, int], int] = {}
        has_w = {(c.stage, c.microbatch) for c in acts if c.type is T_W}
        for c in acts:
            key = (c.stage, plan.slot_of[(c.stage, c.microbatch)])
            if c.type is T_F:
                assert key not in busy, f"{name} rank {rank}: {c} finds slot {key} held by mb {busy.get(key)}"
                busy[key] = c.microbatch
            elif c.type is T_W or c.type is T_B or (c.type is T_I and (c.stage, c.microbatch) not in has_w):
                del busy[key]
        assert not busy
        # a slot's forward and backward share a pool; slots never do
        assert len(set(plan.pool_of.values())) == len(plan.keys) // 2
        for k in plan.keys:
            twin = next(
                o for o in plan.keys if o != k and (o.stage, o.slot, o.signature) == (k.stage, k.slot, k.signature)
            )
            assert plan.pool_of[k] == plan.pool_of[twin]


def test_plan_of_1f1b_reads_as_written():
    plan = capture_plan(build_schedule("1f1b", 2, 4), 0)
    # rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3: two micro-batches in flight, slots reused in turn
    assert [str(k) for k in plan.keys] == ["0F[slot 0]", "0B[slot 0]", "0F[slot 1]", "0B[slot 1]"]
    assert dict(plan.slot_of) == {(0, 0): 0, (0, 1): 1, (0, 2): 0, (0, 3): 1}
    assert dict(plan.replays) == {(0, "F"): 4, (0, "B"): 4}
    last = capture_plan(build_schedule("1f1b", 2, 4), 1)
    assert len(last.keys) == 2 and set(last.slot_of.values()) == {0}


def test_plan_of_zbv_keeps_a_slot_until_its_w():
    plan = capture_plan(build_schedule("zbv", 1, 4), 0)
    # 0F0 1F0 1I0 1W0 0F1 0I0 0W0 ...: stage 0's micro-batch 0 holds its slot until 0W0, after 0F1
    assert plan.slot_of[(0, 0)] == 0 and plan.slot_of[(0, 1)] == 1 and plan.slot_of[(0, 2)] == 0
    assert plan.slots_of(1, None) == 1 and plan.replays[(1, "B")] == 4


def test_signatures_get_their_own_slots():
    sched = build_schedule("1f1b", 1, 4)
    sigs = {(0, m): ("big" if m < 2 else "small") for m in range(4)}
    plan = capture_plan(sched, 0, sigs)
    assert [(k.kind, k.signature, k.slot) for k in plan.keys] == [
        ("F", "big", 0), ("B", "big", 0), ("F", "small", 0), ("B", "small", 0)
    ]  # fmt: skip
    with pytest.raises(ValueError, match="rank 1 is not a rank of schedule"):
        capture_plan(sched, 1)


# ---- the fallbacks -----------------------------------------------------------------------------------------
def test_no_cuda_falls_back_with_its_reason_and_trains_like_eager(caplog):
    eager = train()
    with caplog.at_level(logging.WARNING, logger="dualpipe_kernels"):
        graphed = train(graphs=GraphOptions(enabled=True))
    assert same_training(graphed, eager)
    st = graphed.pipe.graph_status
    assert {s: (v.state, v.reason) for s, v in st.items()} == {
        s: ("eager", "no CUDA device (torch.cuda.is_available() is False)") for s in (0, 1)
    }
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("dualpipe_kernels")]
    assert sorted(lines) == [f"pipeline rank 0 stage {s}: CUDA graphs off, eager: {st[s].reason}" for s in (0, 1)]


def test_cpu_tensors_fall_back():
    run = train(graphs=GraphOptions(enabled=True), capturer=ClaimsCuda(), rows=(8,))
    assert {v.reason for v in run.pipe.graph_status.values()} == {
        "the stage's tensors are on cpu (graphs capture cuda work only)"
    }


@pytest.mark.parametrize("zero_bubble", ["split", "store"])
@pytest.mark.parametrize("name", ["interleaved1f1b", "zbv", "dualpipev"])
def test_the_graph_path_trains_bit_exact_with_eager(name, zero_bubble):
    eager = train(name, zero_bubble=zero_bubble)
    cap = RerunCapture()
    graphed = train(name, GraphOptions(enabled=True, warmup_iters=2), capturer=cap, zero_bubble=zero_bubble)
    assert same_training(graphed, eager)
    plan = graphed.pipe._graphs.plan
    for s, st in graphed.pipe.graph_status.items():
        assert st.state == "captured" and st.graphs == plan.graphs_of(s) and not st.eager_calls
        # steps 2 and 3 replay: each F and each B-or-I of the schedule once per step
        assert st.replays == {k: 2 * plan.replays[(s, k)] for k in ("F", "B")}
    assert cap.captures == len(plan.keys) and cap.warmups == 2 * 2  # two stages, one signature each
    assert len(cap.pools) == len(plan.keys) // 2


def test_an_unseen_shape_runs_eager_and_the_others_still_replay(caplog):
    rows = (8, 12, 8)  # micro-batches of 2 rows, then 3 (not captured), then 2 again
    eager = train(rows=rows)
    with caplog.at_level(logging.WARNING, logger="dualpipe_kernels"):
        graphed = train(graphs=GraphOptions(enabled=True), rows=rows, capturer=RerunCapture())
    assert same_training(graphed, eager)
    plan = graphed.pipe._graphs.plan
    for s, st in graphed.pipe.graph_status.items():
        assert st.state == "captured"
        assert st.replays == {k: plan.replays[(s, k)] for k in ("F", "B")}  # step 3 only
        ((reason, n),) = st.eager_calls.items()
        assert "not seen at capture" in reason and n == plan.replays[(s, "F")]
    noted = [r.getMessage() for r in caplog.records if "not seen at capture" in r.getMessage()]
    assert len(noted) == 2  # one line per stage


class HostRead(nn.Module):
    """A stage that reads a device value on the host (``.item()``): a stream capture refuses it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(IN, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 if x.abs().max().item() < 100 else 0.5
        return torch.nn.functional.gelu(self.lin(x)) * scale


def test_a_stage_that_reads_the_host_fails_its_capture_and_runs_eager():
    eager = train(stage0=HostRead)
    graphed = train(graphs=GraphOptions(enabled=True), stage0=HostRead, capturer=RerunCapture())
    assert same_training(graphed, eager)
    st = graphed.pipe.graph_status
    assert st[0].state == "eager" and st[0].reason is not None
    assert st[0].reason.startswith("capture raised RuntimeError: CUDA error: operation not permitted when stream is")
    assert st[1].state == "captured"  # the other stage is unaffected


def test_dropout_offload_and_keyword_inputs_fall_back():
    def dropping() -> nn.Module:
        return nn.Sequential(nn.Linear(IN, 16), nn.Dropout(0.1))

    run = train(graphs=GraphOptions(enabled=True), stage0=dropping, capturer=RerunCapture(), rows=(8,))
    assert run.pipe.graph_status[0].reason == (
        "Dropout at '1' draws random numbers (GraphOptions(allow_rng=True) graphs it: replays then draw other "
        "numbers than eager)"
    )
    run = train(graphs=GraphOptions(enabled=True, allow_rng=True), stage0=dropping, capturer=RerunCapture(), rows=(8,))
    assert run.pipe.graph_status[0].state == "captured"
    run = train(graphs=GraphOptions(enabled=True), capturer=RerunCapture(), rows=(8,), memory_policy={0: "offload"})
    assert run.pipe.graph_status[0].reason.startswith("memory policy 'offload' moves saved activations to the host")
    assert run.pipe.graph_status[1].state == "captured"


def test_more_graphs_than_allowed_falls_back():
    run = train(graphs=GraphOptions(enabled=True, max_graphs_per_stage=2), capturer=RerunCapture(), rows=(8, 8))
    # interleaved 1F1B on one rank: stage 0 keeps two micro-batches alive (4 graphs), stage 1 one
    st = run.pipe.graph_status
    assert st[0].reason == "the capture plan needs 4 graphs, more than max_graphs_per_stage=2"
    assert st[1].state == "captured" and st[1].graphs == 2


def test_forward_only_steps_run_eager():
    sched = build_schedule("interleaved1f1b", 1, 4, 2)
    mods = two_stage_modules()
    with capturing_with(RerunCapture()):
        pipe = Pipeline(sched, mods, transport="torch", timeout_s=10, graphs=GraphOptions(enabled=True))
    try:
        for x, y in batches((8, 8)):
            pipe.step(x, labels=[y], criterion=nn.functional.mse_loss)
        before = {s: dict(st.replays) for s, st in pipe.graph_status.items()}
        ((x, y),) = batches((8,))
        with torch.no_grad():
            res = pipe.step(x, labels=[y], criterion=nn.functional.mse_loss)
            want = [
                nn.functional.mse_loss(mods[1](mods[0](xm)), ym) for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True)
            ]
        assert {s: dict(st.replays) for s, st in pipe.graph_status.items()} == before
        assert all(torch.equal(res.losses[m], want[m]) for m in range(4))
    finally:
        pipe.close()
