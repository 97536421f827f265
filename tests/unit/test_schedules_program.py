"""The dependency program: one place for what every action needs and makes.

A fake action kind, added by one rule (deps.RULES) and one runtime handler
(runtime.loop.HANDLERS), is honoured by the validator, both simulator engines,
the lowering pass and the runtime.  Also: simulate() rejects impossible
schedules with ValueError and builds its result in O(actions).
"""

from __future__ import annotations

import enum
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dualpipe_kernels.runtime import Pipeline, free_port, loop
from dualpipe_kernels.schedules import (
    CostModel,
    Schedule,
    ScheduleError,
    build_schedule,
    deps,
    lower_comms,
    parse_actions,
    simulate,
    validate,
)
from dualpipe_kernels.schedules.deps import DepKind, Program, Rule
from dualpipe_kernels.schedules.ir import Action


class FakeKind(enum.Enum):
    """An action kind the library does not know: a probe reading its stage's activation."""

    PROBE = "P"

    def __str__(self) -> str:
        return self.value


PROBE_COST = 7


@pytest.fixture
def probe_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    rule = Rule(
        needs=lambda topo, p, s: ((DepKind.ACT, s),),
        makes=lambda topo, p, s: (),
        cost=lambda sc, s: PROBE_COST,
    )
    monkeypatch.setitem(deps.RULES, FakeKind.PROBE, rule)


def _one_rank(order: str) -> Schedule:
    acts = [Action(FakeKind.PROBE, 0, 0) if t == "0P0" else parse_actions(t)[0] for t in order.split()]
    return Schedule("probe", 1, 1, (0,), ((0,),), (0,), [acts])


def _two_rank_with_probe() -> Schedule:
    """1F1B on two ranks, each probing its activation of micro-batch 0 between F and B."""
    r0 = parse_actions("0F0 0F1") + [Action(FakeKind.PROBE, 0, 0)] + parse_actions("0B0 0B1")
    r1 = parse_actions("1F0") + [Action(FakeKind.PROBE, 1, 0)] + parse_actions("1B0 1F1 1B1")
    return Schedule("probe", 2, 2, (0, 1), ((0, 1),), (0, 0), [r0, r1])


def test_unknown_kind_is_refused_without_a_rule() -> None:
    with pytest.raises(ScheduleError, match="no dependency rule for action kind P"):
        validate(_one_rank("0F0 0P0 0B0"))


def test_validator_honours_a_new_kind(probe_rule: None) -> None:
    validate(_one_rank("0F0 0P0 0B0"))
    validate(_two_rank_with_probe())
    with pytest.raises(ScheduleError, match=r"step 0 \(0P0\): deadlock: needs the activation of stage 0"):
        validate(_one_rank("0P0 0F0 0B0"))


def test_simulator_honours_a_new_kind(probe_rule: None) -> None:
    costs = CostModel(f=1, b=2, w=1)
    res = simulate(_one_rank("0F0 0P0 0B0"), costs)
    assert res.makespan == 1 + PROBE_COST + 2 and res.busy_per_rank == [10]
    events = res.lowered_result().events
    assert [(e.action, e.start, e.end) for e in events] == [("0F0", 0, 1), ("0P0", 1, 8), ("0B0", 8, 10)]
    two = _two_rank_with_probe()
    direct, lowered = simulate(two, costs), simulate(lower_comms(two), costs)
    assert direct.makespan == lowered.makespan and direct.busy_per_rank == lowered.busy_per_rank
    plain = simulate(build_schedule("1f1b", 2, 2), costs)
    assert [b - p for b, p in zip(direct.busy_per_rank, plain.busy_per_rank, strict=True)] == [PROBE_COST] * 2
    with pytest.raises(ValueError, match="deadlock"):
        simulate(_one_rank("0P0 0F0 0B0"), costs)


def test_runtime_honours_a_new_kind(probe_rule: None, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, bool, bool]] = []

    def probe(run: Any, i: int, a: Action) -> None:
        key = (a.stage, a.microbatch)
        seen.append((str(a), key in run.cst.roots, key in run.cst.inputs))  # after F, before B

    monkeypatch.setitem(loop.HANDLERS, FakeKind.PROBE, probe)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        pipe = Pipeline(_one_rank("0F0 0P0 0B0"), {0: model}, transport="torch", timeout_s=10)
        out = pipe.step(torch.ones(2, 4), labels=[torch.zeros(2, 4)], criterion=nn.functional.mse_loss)
        pipe.close()
    finally:
        dist.destroy_process_group()
    assert seen == [("0P0", True, True)]
    assert set(out.losses) == {0} and model[0].weight.grad is not None


def test_program_keys_are_the_one_encoding() -> None:
    s = build_schedule("1f1b", 2, 2)
    prog = Program(s)
    topo = prog.topo
    assert prog.makes[0][0] == (topo.key(DepKind.ACT, 0, 0),)
    assert prog.sends[0][0] == ((topo.key(DepKind.ACT, 0, 0), 1),)
    assert prog.remote[1][0] == (topo.key(DepKind.ACT, 0, 0),)
    assert topo.unkey(prog.remote[0][2][0]) == deps.Dep(DepKind.GRAD, 1, 0)  # 0B0 reads stage 1's gradient
    lowered = lower_comms(s)
    assert [str(a) for a in lowered.actions[0][:3]] == ["0F0", "0SEND_F0", "0F1"]


def test_pair_forward_send_comes_right_after_the_pair() -> None:
    """The lowered list (which the runtime runs as is and the simulator times) sends a pair's F output first."""
    low = lower_comms(build_schedule("dualpipev", 4, 8))
    checked = 0
    for acts in low.actions:
        for a, nxt in zip(acts, acts[1:], strict=False):
            f = a.sub_actions[0] if a.sub_actions else None
            if f is not None and any(str(x) == f"{f.stage}SEND_F{f.microbatch}" for x in acts):
                assert str(nxt) == f"{f.stage}SEND_F{f.microbatch}", (a, nxt)
                checked += 1
    assert checked > 0


# ---- simulate() rejects impossible schedules with ValueError ------------------------------------


def _mutated(kind: str) -> Schedule:
    s = build_schedule("1f1b", 2, 2)
    acts = [list(a) for a in s.actions]
    if kind == "b_before_f":
        acts[1] = parse_actions("1B0 1F0 1F1 1B1")
    elif kind == "duplicated":
        acts[0].append(acts[0][0])
    elif kind == "deleted":
        del acts[1][-1]
    elif kind == "stage_out_of_range":
        acts[1][0] = Action(acts[1][0].type, 7, 0)
    elif kind == "microbatch_out_of_range":
        acts[0][0] = Action(acts[0][0].type, 0, 9)
    return Schedule(s.name, s.num_ranks, s.num_microbatches, s.stage_to_rank, s.paths, s.microbatch_path, acts)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("b_before_f", "B comes before the F"),
        ("duplicated", "second F"),
        ("deleted", "missing B"),
        ("stage_out_of_range", "stage 7 is not on micro-batch 0's path"),
        ("microbatch_out_of_range", "micro-batch 9 out of range"),
    ],
)
def test_simulate_rejects_impossible_schedules(kind: str, message: str) -> None:
    bad = _mutated(kind)
    with pytest.raises(ValueError, match=message):
        simulate(bad, CostModel(f=1, b=2, w=1))


def test_validated_fast_path_is_enforced() -> None:
    good, bad = build_schedule("1f1b", 2, 2), _mutated("b_before_f")
    prog = validate(good)
    assert prog.validated and simulate(good, program=prog).makespan > 0
    with pytest.raises(ValueError, match="B comes before the F"):
        simulate(bad, program=prog)  # a program of another schedule does not skip the check
    with pytest.raises(ValueError, match="B comes before the F"):
        simulate(bad, program=Program(bad))  # nor does one that validate() did not pass


# ---- O(actions) end to end -------------------------------------------------------------------------


def _simulate_json_s(ranks: int) -> float:
    s = build_schedule("1f1b", ranks, 1)
    t0 = time.process_time()
    simulate(s, program=validate(s)).to_dict()
    return time.process_time() - t0


def test_simulate_scales_linearly_in_ranks() -> None:
    # 1F1B with one micro-batch: 2 actions per rank.  Quadratic result building (stages_of_rank per
    # rank) made 8x the ranks cost ~64x; linear costs ~8x (bound 20x for a noisy shared machine).
    small = min(_simulate_json_s(2_000) for _ in range(2))
    large = _simulate_json_s(16_000)
    assert large < 20 * small + 0.5, (small, large)
