"""The step's gradient reductions in one shape (runtime/reductions.py): each reduction's step part posts from
the loop's hooks and waits in ``finish``; the step runs the parts in the list's order, hooks of one action
merged in that order, and a reduction with nothing to do this step (paused) has no part.

In-process with recording stand-ins: the three real reductions are exercised across ranks by the process
tests (test_runtime_ppdp.py: DP, the folded mirror sum, tied parameters with DP; test_runtime_models.py:
tied parameters; test_runtime_exact.py: the mirror sum).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dualpipe_kernels.runtime.reductions import GradientReductions, StepReductions
from dualpipe_kernels.runtime.tied import TiedGradients


@dataclass
class _Part:
    name: str
    log: list[str]
    at: tuple[int, ...] = ()

    def hooks(self) -> Mapping[int, Callable[[], None]]:
        return {i: (lambda i=i: self.log.append(f"{self.name} posts after {i}")) for i in self.at}

    def finish(self) -> None:
        self.log.append(f"{self.name} waits")


@dataclass
class _Reduction:
    part: _Part
    paused: bool = False
    began: list[float] = field(default_factory=list)

    def begin(self, t0: float) -> _Part | None:
        self.began.append(t0)
        return None if self.paused else self.part


def test_hooks_of_one_action_run_in_the_lists_order_and_finish_in_order():
    log: list[str] = []
    step = StepReductions([_Part("dp", log, (3, 7)), _Part("mirror", log), _Part("ties", log, (7,))])
    hooks = step.hooks()
    assert sorted(hooks) == [3, 7]
    hooks[7]()
    hooks[3]()
    step.finish()
    assert log == [
        "dp posts after 7",
        "ties posts after 7",
        "dp posts after 3",
        "dp waits",
        "mirror waits",
        "ties waits",
    ]


def test_a_paused_reduction_has_no_part_this_step():
    log: list[str] = []
    first, second = _Reduction(_Part("a", log, (1,)), paused=True), _Reduction(_Part("b", log, (2,)))
    reductions = GradientReductions(None, TiedGradients(0, [], 1.0), [first, second])
    step = reductions.begin(5.0)
    assert first.began == second.began == [5.0]
    assert [p.name for p in step.parts] == ["b"] and sorted(step.hooks()) == [2]
    assert step.spans == []  # no data-parallel part: nothing for StepResult.dp_reductions
    with reductions.pause():  # no DP here: pauses the tie groups
        assert reductions.ties.paused
    assert not reductions.ties.paused
