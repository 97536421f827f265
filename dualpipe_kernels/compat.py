"""Drop-in replacement for the reference DualPipe package (deepseek-ai/DualPipe).

Code written for the reference runs by changing its import::

    from dualpipe import DualPipe, DualPipeV, set_p2p_tensor_shapes, set_p2p_tensor_dtype
    from dualpipe.utils import WeightGradStore, run_backward
    # becomes
    from dualpipe_kernels.compat import (DualPipe, DualPipeV, set_p2p_tensor_shapes, set_p2p_tensor_dtype,
                                         WeightGradStore, run_backward)

Same constructor ``(modules, batch_dim=0, process_group=None, rank_mapping=None)``
and ``step(*inputs, num_chunks=0, criterion=None, labels=[], return_outputs=False)
-> (loss, outputs)`` as the reference, built on :class:`dualpipe_kernels.runtime.Pipeline`:

* ``modules = (module0, module1)``: on pipeline rank ``r`` of ``R``, ``module0`` is
  model stage ``r`` and ``module1`` model stage ``R - 1 - r`` (DualPipe: the second
  copy, run by the reverse direction) or ``2R - 1 - r`` (DualPipeV: the V's way back).
  Both are IR stage ``r`` and ``2R - 1 - r`` of ``build_schedule("dualpipe"|"dualpipev")``.
* DualPipe: the first rank's ``inputs`` feed micro-batches ``0..N/2-1`` and its
  ``labels`` (and returned ``loss``/``outputs``) belong to micro-batches ``N/2..N-1``,
  which enter at the last rank; the last rank the other way round.  Each side's
  batch is split into ``N/2`` micro-batches (``tensor_split`` semantics).
* DualPipeV: the first rank holds the inputs, labels, losses and outputs of all
  ``N`` micro-batches.
* ``loss`` is ``torch.stack`` of the per-micro-batch losses (unscaled, detached),
  ``outputs`` the loss stage's outputs concatenated along ``batch_dim`` (one tensor
  when the stage returns one); other ranks get ``(None, None)``.  Under
  ``torch.no_grad()`` the step is forward-only.
* Gradients of DualPipe's two copies of a stage are *not* summed across mirror
  ranks (``sync_mirror_grads=False``): code written for the reference does that
  itself.

Differences: CPU and CUDA both work (the reference requires CUDA); P2P shapes
and dtype are exchanged at run time, so ``set_p2p_tensor_shapes`` /
``set_p2p_tensor_dtype`` are accepted and only validated; bad input raises
ValueError (the reference asserts).  Keyword-only extras: Pipeline's option
groups ``wire``, ``memory``, ``diagnostics`` and ``graphs`` (the others are the
reference's: ``FIXED_OPTION_GROUPS``), and ``wire``'s shorthands ``transport`` ("auto", the default:
the native engine for same-host peers when built | "torch" | "native" | a
Transport), ``timeout_s`` (every wait) and ``boundary_format`` ("none", the
default | "packed" | "bf16" | "fp8", or one per direction as
``(activations, gradients)``; see ``Pipeline`` and docs/runtime_options.md).

``WeightGradStore``: the reference keeps the zero-bubble weight-gradient queue
in class attributes that user autograd functions call directly
(``WeightGradStore.enabled``, ``WeightGradStore.put(fn)``).  That class-level
call is the one thing the API forces to be reachable without an instance, so
here the class is a facade: every call is routed to the store of the pipeline
whose ``step`` is running in the calling thread (the runtime's per-pipeline
store), and two pipelines in one process never share a queue.  Outside a step
``enabled`` is False, so user functions compute their weight gradient at once,
exactly as the reference does when zero-bubble is off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from dualpipe_kernels.runtime.graph_options import GraphOptions
    from dualpipe_kernels.runtime.options import DiagnosticsOptions, MemoryOptions, WireOptions

__all__ = [
    "DualPipe",
    "DualPipeV",
    "WeightGradStore",
    "set_p2p_tensor_shapes",
    "set_p2p_tensor_dtype",
    "run_backward",
]


# ------------------------------------------------------------------------------------------
# P2P shape/dtype declarations: accepted for compatibility, not needed
# ------------------------------------------------------------------------------------------
def set_p2p_tensor_shapes(shapes: Sequence[Sequence[int]]) -> None:
    """Accepted for compatibility and validated; not needed (shapes travel with the data at run time)."""
    if not isinstance(shapes, (list, tuple)) or not all(
        isinstance(s, (list, tuple, torch.Size)) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes
    ):
        raise ValueError(f"set_p2p_tensor_shapes expects a list of shapes (tuples of ints >= 0), got {shapes!r}")


def set_p2p_tensor_dtype(dtype: torch.dtype) -> None:
    """Accepted for compatibility and validated; not needed (dtypes travel with the data at run time)."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"set_p2p_tensor_dtype expects a torch.dtype, got {dtype!r}")


def run_backward(tensors: Sequence[torch.Tensor], grad_tensors: Sequence[torch.Tensor | None]) -> None:
    """Backward from ``tensors`` seeded with ``grad_tensors``, accumulating into ``.grad`` (the reference's helper).

    Goes through the tensors' autograd edges, not their data, so it works on
    stage outputs whose storage the runtime already freed after sending them
    (as the reference's engine call does); None gradients are skipped.
    """
    from dualpipe_kernels.runtime.zero_bubble import run_backward as _run_backward

    _run_backward(list(tensors), list(grad_tensors))


# ------------------------------------------------------------------------------------------
# WeightGradStore facade
# ------------------------------------------------------------------------------------------
def _active_store() -> Any | None:
    """The weight-gradient store of the pipeline step running in this thread/context, or None."""
    from dualpipe_kernels.runtime.zero_bubble import current_store

    return current_store()


class _QueueView:
    """What the reference's ``WeightGradStore.funcs_queue`` offers callers: ``empty()`` and ``qsize()``."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def qsize(self) -> int:
        return len(self._store)

    def empty(self) -> bool:
        return len(self._store) == 0


class _WeightGradStoreMeta(type):
    """Class-level attributes of the reference's WeightGradStore, routed to the running pipeline's store."""

    @property
    def enabled(cls) -> bool:
        store = _active_store()
        return bool(store is not None and store.enabled)

    @enabled.setter
    def enabled(cls, value: bool) -> None:
        store = _active_store()
        if store is None:
            if value:
                raise RuntimeError("WeightGradStore.enabled can only be set during a pipeline step")
            return
        store.enabled = bool(value)

    @property
    def funcs_queue(cls) -> _QueueView:
        store = _active_store()
        if store is None:
            raise RuntimeError("WeightGradStore.funcs_queue exists only during a pipeline step")
        return _QueueView(store)


class WeightGradStore(metaclass=_WeightGradStoreMeta):
    """The reference's zero-bubble weight-gradient queue, as a facade over the running pipeline's own store.

    User autograd functions call ``WeightGradStore.enabled`` and
    ``WeightGradStore.put(fn)`` in their backward; the runtime flushes and pops.
    See the module docstring for why this is a class-level facade.
    """

    @classmethod
    def _store(cls, what: str) -> Any:
        store = _active_store()
        if store is None:
            raise RuntimeError(f"WeightGradStore.{what}() called outside a pipeline step (check .enabled first)")
        return store

    @classmethod
    def put(cls, func: Callable[[], None]) -> None:
        """Defer ``func`` (a weight-gradient computation) to the schedule's W action."""
        cls._store("put").put(func)

    @classmethod
    def flush(cls) -> None:
        cls._store("flush").flush()

    @classmethod
    def pop(cls) -> None:
        cls._store("pop").pop()

    @classmethod
    def clear(cls) -> None:
        store = _active_store()
        if store is not None:
            store.clear()


# ------------------------------------------------------------------------------------------
# DualPipe / DualPipeV
# ------------------------------------------------------------------------------------------
def _placeholder(t: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = rows
    return t.new_zeros(shape)


def _pad_half(values: Sequence[Any], half: int, first: bool, dim: int) -> tuple[Any, ...]:
    """Full-batch arguments whose ``tensor_split`` into ``2 * half`` gives ``values``' split into ``half``.

    ``first``: ``values`` are micro-batches ``0..half-1`` (placeholder rows after
    them), else ``half..2*half-1`` (placeholder rows before).  With B rows,
    ``q, r = divmod(B, half)``: after, ``half * q`` rows keep the first ``r``
    chunks one row larger; before, ``half * (q + 1)`` rows push the larger
    chunks into the second half.  The placeholder rows are never read: the
    runtime only takes the micro-batches that enter (or end) on this rank.
    """
    out = []
    for v in values:
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            out.append(v)  # side input: every micro-batch gets it
            continue
        q = v.shape[dim] // half
        if first:
            out.append(torch.cat([v, _placeholder(v, half * q, dim)], dim=dim))
        else:
            out.append(torch.cat([_placeholder(v, half * (q + 1), dim), v], dim=dim))
    return tuple(out)


def _gather(chunks: Sequence[Sequence[torch.Tensor]], dim: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The reference's output gathering: concatenate per output index; one output -> a tensor."""
    merged = tuple(torch.cat([c[i] for c in chunks], dim=dim) for i in range(len(chunks[0])))
    return merged[0] if len(merged) == 1 else merged


def _drop_none(values: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(values) if any(v is not None for v in values) else ()


class _DualPipeBase(nn.Module):
    """Shared constructor and step of DualPipe and DualPipeV (``_SCHEDULE`` tells them apart)."""

    _SCHEDULE = ""
    #: Pipeline's option groups this API sets itself (the reference's semantics), and why; it takes the others
    FIXED_OPTION_GROUPS: ClassVar[dict[str, str]] = {
        "layout": "batch_dim and rank_mapping are the reference's own arguments",
        "gradients": "the reference sums the micro-batch losses' gradients and syncs no mirror copies",
        "model_options": "the reference splits any batch and knows no tied parameters",
    }
    _pipe: Any  # the runtime Pipeline for the current num_chunks (kept out of the module tree; see __init__)

    def __init__(
        self,
        modules: Sequence[nn.Module],
        batch_dim: int = 0,
        process_group: dist.ProcessGroup | None = None,
        rank_mapping: Sequence[int] | None = None,
        *,
        wire: WireOptions | None = None,
        memory: MemoryOptions | None = None,
        diagnostics: DiagnosticsOptions | None = None,
        graphs: GraphOptions | None = None,
        transport: Any = None,
        timeout_s: float | None = None,
        boundary_format: Any = None,
    ) -> None:
        super().__init__()
        from dualpipe_kernels.runtime.options import PipelineOptions

        # the option groups (as Pipeline's); ``transport`` / ``timeout_s`` / ``boundary_format``: shorthands
        # of ``wire`` (options.SHORTHANDS), folded by Pipeline's one rule (ValueError naming the field)
        shorthands = {"transport": transport, "timeout_s": timeout_s, "boundary_format": boundary_format}
        groups = {"wire": wire, "memory": memory, "diagnostics": diagnostics, "graphs": graphs}
        self._options = PipelineOptions.fold(groups, shorthands)
        self._wire = self._options.wire
        timeout_s = self._wire.timeout_s
        #: how stage-boundary messages travel (validated here, used by every pipeline built)
        self.boundary_format = self._wire.format
        modules = list(modules)
        if len(modules) != 2 or not all(isinstance(m, nn.Module) for m in modules):
            raise ValueError(
                f"{type(self).__name__} needs exactly two nn.Modules (this rank's two stages), got {len(modules)}"
            )
        self.module = nn.ModuleList(modules)
        self.overlapped_forward_backward = type(modules[0]) is type(modules[1]) and hasattr(
            type(modules[0]), "overlapped_forward_backward"
        )
        self.batch_dim = batch_dim
        self.group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
        self.num_ranks = dist.get_world_size(self.group)
        if rank_mapping is None:
            rank_mapping = list(range(self.num_ranks))
        rank_mapping = list(rank_mapping)
        if sorted(rank_mapping) != list(range(self.num_ranks)):
            raise ValueError(
                f"rank_mapping must be a permutation of 0..{self.num_ranks - 1} (group rank -> pipeline rank), "
                f"got {rank_mapping}"
            )
        self.rank_mapping = rank_mapping
        self.rank = rank_mapping[dist.get_rank(self.group)]
        self.is_first_rank = self.rank == 0
        self.is_last_rank = self.rank == self.num_ranks - 1
        self.transport = self._wire.transport
        self.timeout_s = timeout_s
        # The runtime Pipeline is an nn.Module holding the same stage modules: keep it out of
        # this module's children so state_dict()/parameters() look exactly like the reference's.
        object.__setattr__(self, "_pipe", None)
        self._pipe_chunks = 0
        self._check_group()

    def _check_group(self) -> None:
        """Schedule-specific checks of the group, at construction (subclasses extend)."""

    # -- the runtime pipeline, rebuilt when num_chunks changes (the schedule depends on it) --
    def _pipeline(self, num_chunks: int) -> Any:
        if self._pipe is not None and self._pipe_chunks == num_chunks:
            return self._pipe
        from dualpipe_kernels.runtime import GradientOptions, LayoutOptions, ModelOptions, Pipeline
        from dualpipe_kernels.schedules.generators import build_schedule

        schedule = build_schedule(self._SCHEDULE, self.num_ranks, num_chunks)  # ValueError names the constraint
        s0, s1 = self.rank, 2 * self.num_ranks - 1 - self.rank
        if set(schedule.stages_of_rank(self.rank)) != {s0, s1}:
            raise RuntimeError(
                f"{self._SCHEDULE} schedule puts stages {schedule.stages_of_rank(self.rank)} on rank {self.rank}, "
                f"compat expects ({s0}, {s1})"
            )
        self.close()
        pipe = Pipeline(
            schedule,
            {s0: self.module[0], s1: self.module[1]},
            self.group,
            layout=LayoutOptions(rank_mapping=self.rank_mapping, batch_dim=self.batch_dim),
            wire=self._wire,
            memory=self._options.memory,
            diagnostics=self._options.diagnostics,
            graphs=self._options.graphs,
            # the reference sums the micro-batch losses' gradients, and syncs no mirror copies
            gradients=GradientOptions(sync_mirror_grads=False, scale_grads=False),
            model_options=ModelOptions(allow_uneven=True),  # the reference splits any batch (seeds stay 1)
        )
        object.__setattr__(self, "_pipe", pipe)
        self._pipe_chunks = num_chunks
        return pipe

    def close(self) -> None:
        """Release the transport of the current pipeline (a later step builds a new one)."""
        pipe = self._pipe
        if pipe is not None:
            object.__setattr__(self, "_pipe", None)
            pipe.close()

    def _check_step(self, num_chunks: int, criterion: Callable[..., torch.Tensor] | None) -> None:
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks <= 0:
            raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
        if torch.is_grad_enabled() and criterion is None and self._loss_rank():
            raise ValueError(
                f"{type(self).__name__}.step: training (grad enabled) needs a criterion on pipeline rank {self.rank}, "
                "which computes losses"
            )

    def _loss_rank(self) -> bool:
        raise NotImplementedError

    def _feed(self, inputs: tuple[Any, ...], labels: tuple[Any, ...], num_chunks: int) -> tuple[tuple, tuple, list]:
        """(full-batch inputs, full-batch labels, micro-batches whose loss/outputs this rank returns)."""
        raise NotImplementedError

    def step(
        self,
        *inputs: torch.Tensor | None,
        num_chunks: int = 0,
        criterion: Callable[..., torch.Tensor] | None = None,
        labels: Sequence[torch.Tensor | None] = (),
        return_outputs: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | tuple[torch.Tensor, ...] | None]:
        """Run one training step (or, under ``torch.no_grad()``, inference); see the module docstring.

        Returns ``(loss, outputs)``: ``loss`` the stacked per-micro-batch losses
        (None without a criterion), ``outputs`` the gathered loss-stage outputs
        when ``return_outputs``; both None on ranks that compute no loss.
        """
        self._check_step(num_chunks, criterion)
        pipe = self._pipeline(num_chunks)
        if isinstance(labels, torch.Tensor):
            labels = (labels,)
        full_inputs, full_labels, mine = self._feed(_drop_none(inputs), _drop_none(labels), num_chunks)
        res = pipe.step(*full_inputs, labels=full_labels, criterion=criterion, return_outputs=return_outputs)
        if not mine:
            return None, None
        loss = torch.stack([res.losses[m] for m in mine]) if criterion is not None else None
        outputs = _gather([tuple(res.outputs[m]) for m in mine], self.batch_dim) if return_outputs else None
        return loss, outputs


class DualPipe(_DualPipeBase):
    """The reference's DualPipe (bidirectional, two copies of every model stage); see the module docstring."""

    _SCHEDULE = "dualpipe"

    def _check_group(self) -> None:
        if self.num_ranks % 2:
            raise ValueError(f"DualPipe needs an even number of ranks, the process group has {self.num_ranks}")
        self.is_in_second_half = self.rank >= self.num_ranks // 2
        self.is_middle_rank = self.rank in (self.num_ranks // 2 - 1, self.num_ranks // 2)

    def _check_step(self, num_chunks: int, criterion: Callable[..., torch.Tensor] | None) -> None:
        super()._check_step(num_chunks, criterion)
        if num_chunks % 2 or num_chunks < 2 * self.num_ranks:
            raise ValueError(
                f"DualPipe needs an even num_chunks >= 2 * ranks = {2 * self.num_ranks}, got num_chunks={num_chunks}"
            )

    def _loss_rank(self) -> bool:
        return self.is_first_rank or self.is_last_rank

    def _feed(self, inputs: tuple[Any, ...], labels: tuple[Any, ...], num_chunks: int) -> tuple[tuple, tuple, list]:
        half = num_chunks // 2
        if self.is_first_rank:
            # inputs: micro-batches 0..half-1; labels (and what we return): half..N-1
            return (
                _pad_half(inputs, half, True, self.batch_dim),
                _pad_half(labels, half, False, self.batch_dim),
                list(range(half, num_chunks)),
            )
        if self.is_last_rank:
            return (
                _pad_half(inputs, half, False, self.batch_dim),
                _pad_half(labels, half, True, self.batch_dim),
                list(range(half)),
            )
        return (), (), []


class DualPipeV(_DualPipeBase):
    """The reference's DualPipeV (V shape: rank r holds stages r and 2R-1-r); see the module docstring."""

    _SCHEDULE = "dualpipev"

    def _check_step(self, num_chunks: int, criterion: Callable[..., torch.Tensor] | None) -> None:
        super()._check_step(num_chunks, criterion)
        if num_chunks < 2 * self.num_ranks:
            raise ValueError(f"DualPipeV needs num_chunks >= 2 * ranks = {2 * self.num_ranks}, got {num_chunks}")

    def _loss_rank(self) -> bool:
        return self.is_first_rank

    def _feed(self, inputs: tuple[Any, ...], labels: tuple[Any, ...], num_chunks: int) -> tuple[tuple, tuple, list]:
        if self.is_first_rank:
            return inputs, labels, list(range(num_chunks))
        return (), (), []
