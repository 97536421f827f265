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


def test_a_repeated_batch_shape_skips_the_checks_and_splits_the_tensors_passed_now():
    from dualpipe_kernels.runtime.microbatch import SplitCache, split_microbatches

    cache = SplitCache()
    x, y = torch.arange(24.0).reshape(12, 2), torch.arange(12)
    first = cache.split("inputs", (x, "side", y), 4)
    assert cache.hits == 0
    for got, want in zip(first, split_microbatches((x, "side", y), 4), strict=True):
        assert got[1] == "side" and all(torch.equal(a, b) for a, b in zip(got[::2], want[::2], strict=True))
    # the same shapes again, new tensors and another side input: views of these, not of the first batch
    x2, y2, side = torch.randn(12, 2), torch.randint(0, 9, (12,)), object()
    again = cache.split("inputs", (x2, side, y2), 4)
    assert cache.hits == 1
    for m, (a, s, b) in enumerate(again):
        assert a._base is x2 and b._base is y2 and s is side
        assert torch.equal(a, x2[3 * m : 3 * m + 3]) and torch.equal(b, y2[3 * m : 3 * m + 3])
    x2.mul_(2)  # views: the data as it is when the stage reads it
    assert torch.equal(again[0][0], x2[:3])
    # the same tensors once more: still their views
    assert cache.split("inputs", (x2, side, y2), 4)[1][0].data_ptr() == x2[3].data_ptr() and cache.hits == 2
    # labels are their own kind: their first split is checked
    cache.split("labels", (y2,), 4)
    assert cache.hits == 2


def test_a_batch_of_another_shape_is_checked_again():
    import pytest

    from dualpipe_kernels.runtime.microbatch import SplitCache

    cache = SplitCache()
    cache.split("inputs", (torch.zeros(8, 2),), 4)
    with pytest.raises(ValueError, match="smaller than the schedule's 4 micro-batches"):
        cache.split("inputs", (torch.zeros(3, 2),), 4)
    with pytest.raises(ValueError, match="argument 1 has 6 rows"):
        cache.split("inputs", (torch.zeros(8, 2), torch.zeros(6)), 4)
    with pytest.raises(ValueError, match="does not divide"):
        cache.split("inputs", (torch.zeros(10, 2),), 4, uneven=False)
    assert [t[0].shape[0] for t in cache.split("inputs", (torch.zeros(10, 2),), 4)] == [3, 3, 2, 2]
    assert [t[0].shape[0] for t in cache.split("inputs", (torch.ones(10, 2),), 4)] == [3, 3, 2, 2]
    assert cache.hits == 1
