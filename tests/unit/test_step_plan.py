"""The step's per-action plan: an I directly followed by its own W runs as one B, and the mean loss of a
step is worked out only when it is read (the runs themselves are compared bit for bit with one process in
tests/process/test_runtime_exact.py)."""

from __future__ import annotations

import torch

from dualpipe_kernels.runtime.loop import HANDLERS, ActionLoop, fused_input_weight
from dualpipe_kernels.runtime.result import StepResult
from dualpipe_kernels.schedules.dualpipe import dualpipe, dualpipev
from dualpipe_kernels.schedules.ir import ActionType
from dualpipe_kernels.schedules.lowering import lower_program
from dualpipe_kernels.schedules.validate import validate


def _lowered(make, ranks: int, n: int):
    return lower_program(validate(make(ranks, n))).schedule


def test_fused_pairs_are_exactly_the_adjacent_i_w_of_one_stage_and_microbatch():
    seen = 0
    for make, ranks in ((dualpipev, 2), (dualpipev, 4), (dualpipe, 4)):
        sched = _lowered(make, ranks, 16)
        for r in range(ranks):
            acts = sched.actions[r]
            fused = set(fused_input_weight(acts))
            for i in range(len(acts) - 1):
                a, b = acts[i], acts[i + 1]
                own_w = a.type is ActionType.I and b.type is ActionType.W
                own_w = own_w and (a.stage, a.microbatch) == (b.stage, b.microbatch)
                assert (i in fused) == own_w, (make.__name__, ranks, r, str(a), str(b))
            seen += len(fused)
    assert seen > 0  # the zero-bubble tails of these schedules end in I W pairs (DualPipeV 2x16: 0I14, 0I15)


def test_the_loop_runs_a_fused_i_as_b_and_its_w_as_nothing():
    acts = _lowered(dualpipev, 2, 16).actions[0]
    loop = ActionLoop(acts, recv_lookahead=2)
    assert [str(acts[i]) for i in loop.fused] == ["0I14", "0I15"]
    for i in loop.fused:
        assert loop.types[loop.type_index[i]] is ActionType.B
        assert loop.type_index[i + 1] == len(loop.types)  # the no-op slot
    unfused = [i for i, a in enumerate(acts) if a.type is ActionType.I and i not in loop.fused]
    assert unfused and all(loop.types[loop.type_index[i]] is ActionType.I for i in unfused)
    assert HANDLERS[ActionType.I] is not HANDLERS[ActionType.B]


def test_the_mean_loss_is_worked_out_once_and_only_when_read():
    calls = []
    losses = {0: torch.tensor(1.0), 1: torch.tensor(2.5)}

    def mean() -> torch.Tensor:
        calls.append(1)
        return torch.stack(list(losses.values())).double().mean().float()

    res = StepResult(losses=losses, outputs=None, timeline=[], step_time_s=0.0, loss_of=mean)
    assert calls == []
    assert res.loss is not None and res.loss.item() == 1.75
    assert res.loss.item() == 1.75 and calls == [1]
    assert StepResult(losses={}, outputs=None, timeline=[], step_time_s=0.0).loss is None
