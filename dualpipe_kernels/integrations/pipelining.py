"""torch.distributed.pipelining drop-in: torch's schedule classes, run by :class:`dualpipe_kernels.runtime.Pipeline`.

Code written for torch's schedules runs by changing one import::

    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV
    # becomes
    from torch.distributed.pipelining import PipelineStage
    from dualpipe_kernels.integrations.pipelining import ScheduleDualPipeV

``ScheduleDualPipeV``, ``ScheduleZBVZeroBubble`` and ``ScheduleInterleaved1F1B`` take
``(stages, n_microbatches, loss_fn=None, args_chunk_spec=None, kwargs_chunk_spec=None,
output_merge_spec=None, scale_grads=True, ...)`` as torch's multi-stage schedules do;
``Schedule1F1B`` and ``ScheduleGPipe`` take ``(stage, n_microbatches, ...)`` as torch's
single-stage ones.  A stage is a torch ``PipelineStage`` (its ``submod``, ``stage_index``,
``num_stages``, ``device`` and ``group`` are read; torch's own send/receive machinery in it is
not used) or, instead of the list, this rank's ``{stage index: module}`` (``build_stage_modules``).
``step(*args, target=None, losses=None, return_outputs=True, loss_kwargs=None, arg_mbs=None,
kwarg_mbs=None, target_mbs=None)`` and ``eval(...)`` behave as torch's:

* inputs and targets are split by torch's own splitter (``args_chunk_spec``, the target along
  dim 0), or given per micro-batch (``arg_mbs`` / ``target_mbs``);
* ``loss_fn(output, target, **loss_kwargs)`` per micro-batch on the last stage, where
  ``output`` is the last stage's output (a tensor, or a tuple when it returns several);
* ``losses`` (a list) is filled on the rank holding the last stage with the ``n_microbatches``
  losses in micro-batch order; other ranks' lists are left alone;
* the return value is the last stage's outputs merged by ``output_merge_spec`` on the rank
  holding the last stage when ``return_outputs``, else None;
* ``scale_grads=True`` gives the gradients of the mean of the micro-batch losses, False their sum;
* without ``loss_fn``, and in ``eval``, the step runs forwards only; ``step`` under
  ``torch.no_grad()`` with a ``loss_fn`` is a RuntimeError, as in torch.

The F&B overlap: a stage module whose class defines ``overlapped_forward_backward``
(docs/runtime.md) runs its DualPipeV pairs through it; torch runs a pair as F then B unless a
custom function is registered.  Differences (docs/integrations.md): the constructor is
collective (it builds the ``Pipeline``: every rank of the group constructs its schedule);
keyword inputs (``**kwargs``, non-empty ``kwarg_mbs``) need ``keyword_inputs=True`` (then each
stage module is wrapped so that the micro-batch's index rides along its boundaries and picks its
keyword arguments, and the overlap hook is not used); ``losses`` holds detached tensors;
``scale_grads`` seeds each micro-batch's backward with ``1/n`` instead of dividing ``.grad``
after the step, so gradients already in ``.grad`` are not divided; ``register_custom_function``
is refused (define the hook instead).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining.microbatch import (
    TensorChunkSpec,
    _split_tensor,
    merge_chunks,
    split_args_kwargs_into_chunks,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.pipelining.stage import _PipelineStageBase

from dualpipe_kernels.runtime import (
    DiagnosticsOptions,
    GradientOptions,
    GraphOptions,
    LayoutOptions,
    MemoryOptions,
    ModelOptions,
    Pipeline,
    WireOptions,
)
from dualpipe_kernels.schedules import build_schedule

__all__ = [
    "ScheduleDualPipeV",
    "ScheduleZBVZeroBubble",
    "ScheduleInterleaved1F1B",
    "Schedule1F1B",
    "ScheduleGPipe",
    "SCHEDULES",
    "get_schedule_class",
]

StageArg = _PipelineStageBase | nn.Module
StagesArg = Sequence[_PipelineStageBase] | Mapping[int, nn.Module]


def _stage_modules(
    stages: StagesArg, group: dist.ProcessGroup | None, who: str
) -> tuple[dict[int, nn.Module], int | None, dist.ProcessGroup | None, torch.device | None]:
    """``({stage: module}, num_stages or None, group, device)`` of torch stages or of our modules."""
    if isinstance(stages, Mapping):
        if not stages or not all(isinstance(k, int) and isinstance(m, nn.Module) for k, m in stages.items()):
            raise ValueError(f"{who}: stages as a mapping must be {{stage index: nn.Module}}, non-empty")
        return dict(stages), None, group, None
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not stages:
        raise ValueError(f"{who}: stages must be a non-empty list of PipelineStage, got {type(stages).__name__}")
    bad = [type(s).__name__ for s in stages if not isinstance(s, _PipelineStageBase)]
    if bad:
        raise ValueError(f"{who}: every stage must be a torch PipelineStage, got {bad}")
    nums = {s.num_stages for s in stages}
    groups = {id(s.group) for s in stages}
    if len(nums) != 1 or len(groups) != 1:
        raise ValueError(f"{who}: the stages disagree on num_stages {sorted(nums)} or on their process group")
    if group is not None and group is not stages[0].group:
        raise ValueError(f"{who}: group= differs from the stages' own process group")
    modules = {s.stage_index: s.submod for s in stages}
    if len(modules) != len(stages):
        raise ValueError(f"{who}: stage indices repeat: {[s.stage_index for s in stages]}")
    return modules, nums.pop(), stages[0].group, torch.device(stages[0].device)


class _Keyworded(nn.Module):
    """A stage module that also takes torch's per-micro-batch keyword inputs: its inputs end with the
    micro-batch's index (a 0-d int64 tensor that rides along every boundary, no gradient), which picks the
    keyword arguments of ``table[0]`` (the step's ``kwarg_mbs``, on every rank).  The last stage drops it."""

    def __init__(self, inner: nn.Module, last: bool, table: list[list[dict[str, Any]]]) -> None:
        super().__init__()
        self.inner, self.last, self.table = inner, last, table

    def forward(self, *args: Any) -> Any:
        *inputs, index = args
        out = self.inner(*inputs, **self.table[0][int(index)])
        if self.last:
            return out
        return (*out, index) if isinstance(out, (tuple, list)) else (out, index)


@dataclass(frozen=True)
class _Groups:
    """The option groups a drop-in passes through to its Pipeline as given."""

    wire: WireOptions | None
    memory: MemoryOptions | None
    diagnostics: DiagnosticsOptions | None
    model_options: ModelOptions | None
    graphs: GraphOptions | None


class _DropIn:
    """What every drop-in schedule shares: the Pipeline it runs on and torch's ``step`` / ``eval``."""

    #: this package's schedule name (schedules.build_schedule)
    NAME: ClassVar[str]
    #: stages per rank the schedule needs (None: any, the interleaved schedule's V)
    PER_RANK: ClassVar[int | None]
    #: the default of the constructor's ``keyword_inputs``
    KEYWORD_INPUTS: ClassVar[bool] = False
    #: Pipeline's option groups set from torch's arguments, and why; the constructors take the others
    FIXED_OPTION_GROUPS: ClassVar[dict[str, str]] = {
        "layout": "the device is the stages' (PipelineStage.device)",
        "gradients": "scale_grads is torch's own argument",
    }

    _pipe: Pipeline

    def _build(
        self,
        stages: StagesArg,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None,
        output_merge_spec: Any,
        scale_grads: bool,
        group: dist.ProcessGroup | None,
        groups: _Groups,
        keyword_inputs: bool | None,
    ) -> None:
        who = type(self).__name__
        if not isinstance(n_microbatches, int) or isinstance(n_microbatches, bool) or n_microbatches < 1:
            raise ValueError(f"{who}: n_microbatches must be an int >= 1, got {n_microbatches!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise ValueError(f"{who}: loss_fn must be callable or None, got {type(loss_fn).__name__}")
        if not dist.is_initialized():
            raise ValueError(f"{who} needs an initialised torch.distributed process group")
        modules, num_stages, group, device = _stage_modules(stages, group, who)
        world = dist.get_world_size(group)
        per_rank = len(modules)
        if self.PER_RANK is not None and per_rank != self.PER_RANK:
            raise ValueError(f"{who} needs {self.PER_RANK} stage(s) per rank, got {per_rank}: {sorted(modules)}")
        if num_stages is not None and num_stages != world * per_rank:
            raise ValueError(
                f"{who}: num_stages {num_stages} but {world} ranks x {per_rank} stage(s) per rank = {world * per_rank}"
            )
        v = None if self.PER_RANK is not None else per_rank
        schedule = build_schedule(self.NAME, world, n_microbatches, v)
        rank = dist.get_rank(group)
        want = sorted(schedule.stages_of_rank(rank))
        if sorted(modules) != want:
            raise ValueError(f"{who}: rank {rank} holds stages {want} in this schedule, got stages {sorted(modules)}")
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._has_backward = loss_fn is not None
        self.scale_grads = scale_grads
        self._args_chunk_spec = args_chunk_spec
        self._kwargs_chunk_spec = kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        self._num_stages = schedule.num_stages
        self.pp_group_size = world
        self.rank = rank
        self._holds_first = 0 in modules
        self._holds_last = schedule.num_stages - 1 in modules
        self._keywords = self.KEYWORD_INPUTS if keyword_inputs is None else bool(keyword_inputs)
        self._table: list[list[dict[str, Any]]] = [[{} for _ in range(n_microbatches)]]
        self._index_device = device if device is not None else torch.device("cpu")
        if self._keywords:
            last = schedule.num_stages - 1
            modules = {s: _Keyworded(m, s == last, self._table) for s, m in modules.items()}
        self._pipe = Pipeline(
            schedule,
            modules,
            group,
            layout=LayoutOptions(device=device),
            wire=groups.wire,
            gradients=GradientOptions(scale_grads=scale_grads),
            memory=groups.memory,
            diagnostics=groups.diagnostics,
            model_options=groups.model_options,
            graphs=groups.graphs,
        )
        # torch's schedules own nothing to release; this one owns a transport: released with the object
        self._finalizer = weakref.finalize(self, self._pipe.close)

    @property
    def pipeline(self) -> Pipeline:
        """The :class:`~dualpipe_kernels.runtime.Pipeline` running the steps."""
        return self._pipe

    def close(self) -> None:
        """Release the pipeline's transport now (else when the schedule is garbage-collected). Idempotent."""
        self._finalizer()

    def register_custom_function(self, computation_type: Any, custom_function: Any) -> None:
        raise ValueError(
            f"{type(self).__name__}: custom action functions are not supported; for the F&B overlap define the "
            "classmethod overlapped_forward_backward on the stage modules' class (docs/runtime.md)"
        )

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        arg_mbs: list[tuple[Any, ...]] | None = None,
        kwarg_mbs: list[dict[str, Any]] | None = None,
        target_mbs: list[Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One step, as torch's ``step``: the last stage's merged outputs on its rank (``return_outputs``), else
        None; ``losses`` filled there."""
        who = type(self).__name__
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError(f"{who}.step() needs gradients enabled (not under torch.no_grad()); call eval()")
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list but got a {type(losses)}")
        arg_split, kw_split, target_split = self._microbatches(args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
        if self._keywords:
            self._table[0] = kw_split
            arg_split = [(*a, torch.tensor(m, device=self._index_device)) for m, a in enumerate(arg_split)]
        criterion = self._criterion(loss_kwargs) if self._holds_last and self._loss_fn is not None else None
        labels = [(t,) for t in target_split] if criterion is not None and target_split is not None else None
        if criterion is not None and labels is None:
            raise ValueError(f"{who}: rank {self.rank} holds the last stage and loss_fn is set: step() needs target")
        if self._holds_last and losses is not None and self._loss_fn is None:
            raise RuntimeError(f"Expecting {self._n_microbatches} losses but got 0 (no loss_fn)")
        try:
            with torch.set_grad_enabled(self._has_backward and torch.is_grad_enabled()):
                res = self._pipe.step(
                    microbatches=arg_split if self._holds_first else None,
                    microbatch_labels=labels,
                    criterion=criterion,
                    return_outputs=return_outputs and self._holds_last,
                )
        finally:
            self._table[0] = [{} for _ in range(self._n_microbatches)]  # the step's keyword inputs are not kept
        if self._holds_last and losses is not None:
            losses.clear()
            losses.extend(res.losses[m] for m in range(self._n_microbatches))
        if not (self._holds_last and return_outputs) or res.outputs is None:
            return None
        outs = [res.outputs[m] for m in range(self._n_microbatches)]
        chunks = [o[0] if len(o) == 1 else o for o in outs]
        return merge_chunks(chunks, self._output_merge_spec)

    def eval(self, *args: Any, **kwargs: Any) -> Any:
        """One forward-only step (torch's ``eval``): same arguments as :meth:`step`."""
        has_backward, self._has_backward = self._has_backward, False
        try:
            with torch.no_grad():
                return self.step(*args, **kwargs)
        finally:
            self._has_backward = has_backward

    def _criterion(self, loss_kwargs: dict[str, Any] | None) -> Callable[..., torch.Tensor]:
        """Our runtime's ``criterion(*outputs, *labels)`` as torch's ``loss_fn(output, target, **loss_kwargs)``."""
        loss_fn, extra = self._loss_fn, dict(loss_kwargs or {})
        assert loss_fn is not None

        def criterion(*outputs_and_target: Any) -> torch.Tensor:
            *outs, tgt = outputs_and_target
            return loss_fn(outs[0] if len(outs) == 1 else tuple(outs), tgt, **extra)

        return criterion

    def _microbatches(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: Any,
        arg_mbs: list[tuple[Any, ...]] | None,
        kwarg_mbs: list[dict[str, Any]] | None,
        target_mbs: list[Any] | None,
    ) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]], list[Any] | None]:
        """Per micro-batch positional inputs, keyword inputs and targets, split as torch splits them (its own
        splitter)."""
        n, who = self._n_microbatches, type(self).__name__
        if not self._keywords and (kwargs or any(kwarg_mbs or ())):
            names = sorted(kwargs) or sorted({k for mb in kwarg_mbs or () for k in mb})
            raise ValueError(
                f"{who}: keyword stage inputs {names} need the schedule built with keyword_inputs=True "
                "(every rank alike: each stage then gets its micro-batch's keyword arguments)"
            )
        for name, mbs in (("arg_mbs", arg_mbs), ("kwarg_mbs", kwarg_mbs), ("target_mbs", target_mbs)):
            if mbs is not None and (not isinstance(mbs, list) or len(mbs) != n):
                raise ValueError(f"{name} must be a list of {n} micro-batches, got {type(mbs).__name__}")
        pre_split = any(m is not None for m in (arg_mbs, kwarg_mbs, target_mbs))
        if pre_split and (args or target is not None):
            raise ValueError("When using pre-split inputs, pass them through arg_mbs=/target_mbs=, not args/target")
        if pre_split:
            if arg_mbs is not None and not all(isinstance(a, tuple) for a in arg_mbs):
                raise TypeError("arg_mbs must be a list of tuples")
            if kwarg_mbs is not None and not all(isinstance(k, dict) for k in kwarg_mbs):
                raise TypeError("kwarg_mbs must be a list of dicts")
            args_out = list(arg_mbs) if arg_mbs is not None else [() for _ in range(n)]
            return args_out, list(kwarg_mbs) if kwarg_mbs is not None else [{} for _ in range(n)], target_mbs
        if args or kwargs:
            arg_split, kw_split = split_args_kwargs_into_chunks(
                args, kwargs, n, self._args_chunk_spec, self._kwargs_chunk_spec
            )
        else:
            arg_split, kw_split = [() for _ in range(n)], [{} for _ in range(n)]
        targets = list(_split_tensor(target, TensorChunkSpec(0), n)) if target is not None else None
        return [tuple(a) for a in arg_split], [dict(k) for k in kw_split], targets


class _Multi(_DropIn, PipelineScheduleMulti):
    """A multi-stage schedule: torch's ``PipelineScheduleMulti`` constructor."""

    def __init__(
        self,
        stages: StagesArg,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        *,
        group: dist.ProcessGroup | None = None,
        wire: WireOptions | None = None,
        memory: MemoryOptions | None = None,
        diagnostics: DiagnosticsOptions | None = None,
        model_options: ModelOptions | None = None,
        graphs: GraphOptions | None = None,
        keyword_inputs: bool | None = None,
    ) -> None:
        """torch's arguments; ``backward_requires_autograd`` must be True (the backward is autograd's) and
        ``defer_pp_recv`` is accepted (receives are posted ahead by the runtime).  Keyword-only extras:
        ``group`` (with a ``{stage: module}`` mapping), the Pipeline's option groups ``wire``, ``memory``,
        ``diagnostics``, ``model_options`` and ``graphs`` (the others come from torch's arguments),
        ``keyword_inputs`` (True: ``step`` takes keyword stage inputs, given to every stage of each micro-batch,
        as torch does; default the class's ``KEYWORD_INPUTS``, False)."""
        if not backward_requires_autograd:
            raise ValueError(f"{type(self).__name__}: backward_requires_autograd=False is not supported")
        self._build(
            stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec, scale_grads,
            group, _Groups(wire, memory, diagnostics, model_options, graphs), keyword_inputs,
        )  # fmt: skip

    def _step_microbatches(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{type(self).__name__} runs whole steps: call step()")


class _Single(_DropIn, PipelineScheduleSingle):
    """A single-stage schedule: torch's ``PipelineScheduleSingle`` constructor."""

    def __init__(
        self,
        stage: StageArg,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        *,
        group: dist.ProcessGroup | None = None,
        wire: WireOptions | None = None,
        memory: MemoryOptions | None = None,
        diagnostics: DiagnosticsOptions | None = None,
        model_options: ModelOptions | None = None,
        graphs: GraphOptions | None = None,
        keyword_inputs: bool | None = None,
    ) -> None:
        """torch's arguments; ``stage`` a PipelineStage or this rank's module (its stage index is the rank)."""
        if isinstance(stage, _PipelineStageBase):
            stages: StagesArg = [stage]
        elif isinstance(stage, nn.Module):
            if not dist.is_initialized():
                raise ValueError(f"{type(self).__name__} needs an initialised torch.distributed process group")
            stages = {dist.get_rank(group): stage}
        else:
            raise ValueError(f"{type(self).__name__}: stage must be a PipelineStage or an nn.Module")
        self._build(
            stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec, scale_grads,
            group, _Groups(wire, memory, diagnostics, model_options, graphs), keyword_inputs,
        )  # fmt: skip

    def _step_microbatches(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{type(self).__name__} runs whole steps: call step()")

    def _get_pipeline_order(self) -> None:
        return None


class ScheduleDualPipeV(_Multi):
    """DualPipeV (2 stages per rank in a V: rank r holds stages r and 2R-1-r), with the F&B overlap hook."""

    NAME, PER_RANK = "dualpipev", 2


class ScheduleZBVZeroBubble(_Multi):
    """ZB-V (2 stages per rank in a V), zero-bubble I/W split."""

    NAME, PER_RANK = "zbv", 2


class ScheduleInterleaved1F1B(_Multi):
    """Interleaved 1F1B: stage s on rank s % R, any number of stages per rank."""

    NAME, PER_RANK = "interleaved1f1b", None


class Schedule1F1B(_Single):
    """1F1B, one stage per rank."""

    NAME, PER_RANK = "1f1b", 1


class ScheduleGPipe(_Single):
    """GPipe, one stage per rank."""

    NAME, PER_RANK = "gpipe", 1


#: torch's schedule names (as ``torch.distributed.pipelining.schedules.get_schedule_class`` spells them) -> ours
SCHEDULES: dict[str, type[_DropIn]] = {
    "DualPipeV": ScheduleDualPipeV,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "1F1B": Schedule1F1B,
    "GPipe": ScheduleGPipe,
}


def get_schedule_class(schedule_name: str) -> type[_DropIn]:
    """The drop-in class for torch's schedule name (case-insensitive, as torch's ``get_schedule_class``)."""
    by_lower = {k.lower(): v for k, v in SCHEDULES.items()}
    if not isinstance(schedule_name, str) or schedule_name.lower() not in by_lower:
        raise ValueError(f"unknown schedule name {schedule_name!r}; this package runs {sorted(SCHEDULES)}")
    return by_lower[schedule_name.lower()]
