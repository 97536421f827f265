"""The gradient reductions of a training step, in one shape: post after a stage's last gradient action, wait
before the optimizer.

Three instances, each built from explicit inputs and each a :class:`GradientReduction`:

* the data-parallel reduction (:class:`~.data_parallel.DataParallelReducer`: the DP group, this rank's
  action list and stage modules), which may fold in DualPipe's mirror copies;
* DualPipe's mirror sum (:class:`~.mirror.MirrorSync`: the wire, the schedule and the stage modules), when
  the DP reduction does not fold it;
* the tied parameters' all-reduce (:class:`~.tied.TiedGradients`: the tie groups, the pipeline group and
  its rank mapping, the stage modules and the action list).

``begin(t0)`` gives one step's part (None: nothing this step, e.g. inside ``Pipeline.no_sync``), whose
``hooks()`` map an action index to what to post once that action is done (the loop's ``done_hooks``) and
whose ``finish()`` waits and writes the results into ``.grad``.  The step runs them in the list's order:
the DP sum first, so the mirror sum and the tie groups add replica-summed gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch.distributed as dist
import torch.nn as nn

from dualpipe_kernels.runtime.data_parallel import DataParallelReducer, ReductionSpan, StepReduction, mirror_dp_groups
from dualpipe_kernels.runtime.mirror import MirrorSync
from dualpipe_kernels.runtime.options import GradientOptions
from dualpipe_kernels.runtime.tied import TiedGradients
from dualpipe_kernels.schedules.ir import Action, Schedule

__all__ = ["GradientReduction", "GradientReductions", "StepPart", "StepReductions", "build_reductions"]


class StepPart(Protocol):
    """One step's share of a reduction."""

    def hooks(self) -> Mapping[int, Callable[[], None]]:
        """Action index -> what to post once that action is done."""
        ...

    def finish(self) -> None:
        """Post what is left, wait, write the reduced gradients into ``.grad``."""
        ...


class GradientReduction(Protocol):
    """A gradient reduction of this rank's stages (see the module docstring)."""

    def begin(self, t0: float) -> StepPart | None:
        """This step's part (its timeline starts at ``t0``); None when it has nothing to do this step."""
        ...


@dataclass
class StepReductions:
    """One training step's reductions, in order."""

    parts: list[StepPart]
    #: the data-parallel reduction's spans (``StepResult.dp_reductions``)
    spans: list[ReductionSpan] = field(default_factory=list)

    def hooks(self) -> dict[int, Callable[[], None]]:
        """Every part's hooks, merged: at one action index, the parts' posts in the list's order."""
        by_index: dict[int, list[Callable[[], None]]] = {}
        for part in self.parts:
            for i, hook in part.hooks().items():
                by_index.setdefault(i, []).append(hook)
        return {i: (hs[0] if len(hs) == 1 else _calls(hs)) for i, hs in by_index.items()}

    def finish(self) -> None:
        for part in self.parts:
            part.finish()


def _calls(hooks: Sequence[Callable[[], None]]) -> Callable[[], None]:
    def run() -> None:
        for h in hooks:
            h()

    return run


@dataclass
class GradientReductions:
    """This rank's gradient reductions: ``dp`` and ``ties`` (kept by name for ``no_sync`` and checkpoints)
    and the list the step runs (:attr:`order`)."""

    dp: DataParallelReducer | None
    ties: TiedGradients
    order: list[GradientReduction]

    def begin(self, t0: float) -> StepReductions:
        parts: list[StepPart] = []
        spans: list[ReductionSpan] = []
        for r in self.order:
            part = r.begin(t0)
            if part is not None:
                parts.append(part)
                if isinstance(part, StepReduction):
                    spans = part.spans  # filled by its finish()
        return StepReductions(parts, spans)

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Steps inside neither reduce over DP (nor fold the mirror sum) nor sum the tie groups."""
        with ExitStack() as stack:
            stack.enter_context(self.ties.pause())
            if self.dp is not None:
                stack.enter_context(self.dp.pause())
            yield


def build_reductions(
    schedule: Schedule,
    rank: int,
    group: dist.ProcessGroup,
    rank_mapping: Sequence[int],
    to_group_rank: Sequence[int],
    modules: Mapping[int, nn.Module],
    actions: Sequence[Action],
    gradients: GradientOptions,
    mirror_sync: MirrorSync,
    tied_parameters: Sequence[Sequence[str]],
    timeout_s: float,
) -> GradientReductions:
    """The reductions of pipeline rank ``rank`` (collective over ``group`` when there are ties or mirror
    copies with a ``dp_group``): DP over ``gradients.dp_group``, ``mirror_sync`` unless DP folds it or
    ``gradients.sync_mirror_grads`` is off, the tie groups of ``tied_parameters``."""
    dp: DataParallelReducer | None = None
    sync_mirrors = gradients.sync_mirror_grads and bool(mirror_sync)
    if gradients.dp_group is not None:
        folded = mirror_dp_groups(schedule, rank, group, to_group_rank, gradients.dp_group) if sync_mirrors else None
        dp = DataParallelReducer(gradients.dp_group, rank, actions, modules, gradients.reduce_op, timeout_s, folded)
    ties = TiedGradients.build(
        tied_parameters,
        rank=rank,
        group=group,
        rank_mapping=rank_mapping,
        to_group_rank=to_group_rank,
        modules=modules,
        actions=actions,
        timeout_s=timeout_s,
        post_early=dp is None,  # with DP: after it, on the replica-summed gradients
    )
    if ties.ties and dp is not None and dp.folds_mirrors:
        raise ValueError(
            "tied parameters with DualPipe's mirror copies and a dp_group are not supported "
            "(the folded mirror reduction would sum them twice); use sync_mirror_grads=False or no dp_group"
        )
    mirror_sync.skip = ties.param_ids()  # a tied parameter's copies are summed by the tie group
    order: list[GradientReduction] = [dp] if dp is not None else []
    if sync_mirrors and not (dp is not None and dp.folds_mirrors):  # folded: also under no_sync()
        order.append(mirror_sync)
    order.append(ties)
    return GradientReductions(dp, ties, order)
