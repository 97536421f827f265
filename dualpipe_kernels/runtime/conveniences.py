"""Pipeline conveniences: builders (from an ``nn.Sequential`` or a 2-D mesh), traces, checkpoints,
gradient accumulation, wire counters and a description of what the pipeline chose.

A mixin of :class:`~dualpipe_kernels.runtime.executor.Pipeline`, kept apart from the
construction and the step so each file has one job; it reads the pipeline's attributes
(``schedule``, ``stage_modules``, ``group``, ``_transport``...) and owns no state.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

from dualpipe_kernels.runtime.model_options import ModelOptions
from dualpipe_kernels.runtime.options import (
    DiagnosticsOptions,
    GradientOptions,
    LayoutOptions,
    MemoryOptions,
    WireOptions,
)
from dualpipe_kernels.runtime.result import StepResult
from dualpipe_kernels.runtime.stages import build_stage_modules
from dualpipe_kernels.schedules.ir import Schedule
from dualpipe_kernels.transport import Transport

__all__ = ["PipelineConveniences"]

_P = TypeVar("_P", bound="PipelineConveniences")


class PipelineConveniences:
    """Methods of :class:`Pipeline` beyond construction and the step (see the module docstring)."""

    schedule: Schedule
    stage_modules: dict[int, nn.Module]
    group: Any
    group_rank: int
    to_group_rank: list[int]
    rank: int
    stages: tuple[int, ...]
    zero_bubble: str
    scale_grads: bool
    recv_lookahead: int
    early_small_receives: bool
    sync_mirror_grads: bool
    overlap_hook: bool
    device: torch.device
    record_timeline: bool
    _transport: Transport
    _watch: Any  # runtime.peer_watch.PeerWatch | None
    timeout_s: float
    _dp: Any
    dp_group: Any
    _ties: Any
    _boundary: Any
    _layouts: Any
    _loop: Any

    if TYPE_CHECKING:  # the builders below call ``cls(...)``: Pipeline's constructor (nn.Module's at runtime)

        def __init__(
            self,
            schedule: Schedule,
            modules: Mapping[int, nn.Module] | Sequence[nn.Module],
            group: dist.ProcessGroup | None = None,
            *,
            layout: LayoutOptions | None = None,
            wire: WireOptions | None = None,
            gradients: GradientOptions | None = None,
            memory: MemoryOptions | None = None,
            diagnostics: DiagnosticsOptions | None = None,
            model_options: ModelOptions | None = None,
        ) -> None: ...

    def _describe(self) -> str:
        """One line: what this pipeline runs and what it chose (transport per peer, policies)."""
        t = self._base_transport()
        local = getattr(t, "local_peers", None)  # native: same-host peers; the others go through torch
        single_of = getattr(t, "single_copy_peers", None)
        single = set(single_of()) if callable(single_of) else set()
        kinds = []
        for p in sorted({a.peer for a in self._loop.actions if a.is_comm and a.peer is not None}):
            g = self.to_group_rank[p]
            kind = self.transport_name if local is None or g in local else "torch (other host)"
            kinds.append(f"{p}: {kind}{' single-copy' if g in single else ''}")
        return (
            f"pipeline rank {self.rank} (group rank {self.group_rank}) of {self.schedule.name!r}: stages "
            f"{list(self.stages)}, {len(self._loop.actions)} actions; transport per peer {{{', '.join(kinds)}}}; "
            f"device {self.device}, zero_bubble={self.zero_bubble}, scale_grads={self.scale_grads}, "
            f"recv_lookahead={self.recv_lookahead}, early_small_receives={self.early_small_receives}, "
            f"sync_mirror_grads={self.sync_mirror_grads}, "
            f"overlap hook={'on' if self.overlap_hook else 'off'}"
        )

    def _base_transport(self) -> Transport:
        inner = getattr(self._transport, "inner", None)  # a wrapper (the benchmarks' payload switch) names its inner
        return inner if isinstance(inner, Transport) else self._transport

    @property
    def inline_limit_bytes(self) -> int:
        """The data bytes up to which a message with a remembered layout travels as one transfer (the same on
        every rank: ``WireOptions.inline_limit_bytes``, or the transport's choice)."""
        return int(self._layouts.inline_max_bytes)

    @property
    def transport_name(self) -> str:
        """The transport actually in use (``"native"``, ``"torch"``, ``"cuda_ipc"``...), never ``"auto"``."""
        return str(self._base_transport().name)

    @classmethod
    def from_sequential(
        cls: type[_P],
        schedule: Schedule,
        model: nn.Sequential,
        partition: Sequence[int] | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        layout: LayoutOptions | None = None,
        wire: WireOptions | None = None,
        gradients: GradientOptions | None = None,
        memory: MemoryOptions | None = None,
        diagnostics: DiagnosticsOptions | None = None,
        model_options: ModelOptions | None = None,
    ) -> _P:
        """A pipeline running this rank's share of the full ``model`` (every rank builds the same model).

        ``partition[m]``: number of layers of model stage ``m`` (default: as even
        as possible, earlier stages one layer more).  ``group`` and the option
        groups: as for ``Pipeline`` (runtime/options.py).  The stage modules are
        :func:`build_stage_modules`'s (``StageLayers`` sharing the model's
        layers; a second copy of a model stage held by the same rank is a deep
        copy), so parameter names map back to ``model``'s (``runtime.checkpoint``).
        Example::

            model = nn.Sequential(*layers)  # same seed on every rank
            pipe = Pipeline.from_sequential(build_schedule("dualpipev", 2, 8), model, wire=WireOptions(timeout_s=60))
        """
        from dualpipe_kernels.runtime.tied import find_ties

        mapping = layout.rank_mapping if layout is not None else None
        mods = build_stage_modules(schedule, model, partition=partition, group=group, rank_mapping=mapping)
        # Parameters shared by identity (an embedding tied to the head) are tie groups: their gradient is
        # summed across the ranks holding them.  Ties the caller declares are kept (found ones first).
        opts = model_options if model_options is not None else ModelOptions()
        found = find_ties(model)
        taken = {n for g in found for n in g}
        declared = tuple(g for g in opts.tied_parameters if not set(g) <= taken)
        return cls(
            schedule,
            mods,
            group,
            layout=layout,
            wire=wire,
            gradients=gradients,
            memory=memory,
            diagnostics=diagnostics,
            model_options=dataclasses.replace(opts, tied_parameters=found + declared),
        )

    def write_trace(self, path: str | os.PathLike[str], result: StepResult) -> str | None:
        """Write the measured step ``result`` of every rank as one chrome-trace JSON (open in ui.perfetto.dev).

        Collective over the pipeline group (every rank calls it with its own
        result of the same step); group rank 0 writes ``path`` and returns it,
        the others return None.  Needs ``Pipeline(record_timeline=True)``.
        Each rank's times are relative to its own step start.
        """
        from dualpipe_kernels.schedules.trace import write_chrome_trace

        if not self.record_timeline:
            raise ValueError("write_trace needs a step recorded with Pipeline(record_timeline=True)")
        timelines: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(timelines, list(result.timeline), group=self.group)
        if self.group_rank != 0:
            return None
        merged = [e for t in timelines for e in t]
        write_chrome_trace(path, merged, schedule=self.schedule.name, step_time_s=result.step_time_s)
        return os.fspath(path)

    def model_state_dict(self, full_name: Callable[[int, str], str] | None = None) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the full model's names (``runtime.checkpoint``)."""
        from dualpipe_kernels.runtime.checkpoint import stage_state_dict

        ties = self._ties.canonical() if getattr(self, "_ties", None) is not None else None
        return stage_state_dict(self.schedule, self.stage_modules, full_name, ties)

    @classmethod
    def from_mesh(
        cls: type[_P],
        schedule: Schedule,
        modules: Mapping[int, nn.Module] | Sequence[nn.Module] | nn.Sequential,
        mesh: Any,
        partition: Sequence[int] | None = None,
        *,
        layout: LayoutOptions | None = None,
        wire: WireOptions | None = None,
        gradients: GradientOptions | None = None,
        memory: MemoryOptions | None = None,
        diagnostics: DiagnosticsOptions | None = None,
    ) -> _P:
        """Build from a 2-D ``torch.distributed.DeviceMesh`` with dimensions named ``"pp"`` and ``"dp"``.

        The pipeline group is the mesh's ``"pp"`` group and the data-parallel
        group its ``"dp"`` group (``gradients`` must leave ``dp_group`` unset).
        ``modules``: this rank's stage modules, or the whole ``nn.Sequential``
        (cut as by :meth:`from_sequential`).  The option groups: as for ``Pipeline``.
        """
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if "pp" not in names or "dp" not in names:
            raise ValueError(f"from_mesh needs a DeviceMesh with dimensions 'pp' and 'dp', got names {names}")
        gradients = gradients if gradients is not None else GradientOptions()
        if gradients.dp_group is not None:
            raise ValueError("from_mesh takes the groups from the mesh; leave GradientOptions.dp_group unset")
        group = mesh.get_group("pp")
        gradients = dataclasses.replace(gradients, dp_group=mesh.get_group("dp"))
        if isinstance(modules, nn.Sequential):
            return cls.from_sequential(
                schedule,
                modules,
                partition,
                group=group,
                layout=layout,
                wire=wire,
                gradients=gradients,
                memory=memory,
                diagnostics=diagnostics,
            )
        return cls(
            schedule,
            modules,
            group,
            layout=layout,
            wire=wire,
            gradients=gradients,
            memory=memory,
            diagnostics=diagnostics,
        )

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation with a ``dp_group``: steps inside neither reduce over DP nor fold the mirror sum.

        Each reduction sums the whole ``.grad``, so accumulating over several
        steps reduces only at the last one (as with DDP's ``no_sync``).  The
        tied parameters' all-reduce (runtime/tied.py) pauses too; without a
        ``dp_group`` or ties this changes nothing.
        """
        with self._ties.pause():
            if self._dp is None:
                yield
                return
            with self._dp.pause():
                yield

    def boundary_bytes(self) -> dict[str, tuple[int, int]]:
        """``{"activations" | "gradients": (messages, data bytes)}`` this rank sent so far (metadata excluded)."""
        b = self._boundary
        return {name: (b.messages_sent[d], b.bytes_sent[d]) for d, name in enumerate(("activations", "gradients"))}

    def receive_buffers(self) -> tuple[int, int]:
        """``(allocated, pooled bytes)`` of the pool of small-message receive buffers (runtime/boundary/inline.py):
        buffers ever allocated (flat after the first steps of a training loop) and the bytes held free now."""
        pool = self._layouts.pool
        return pool.allocations, pool.free_bytes()

    def _mean_loss(
        self, losses: Mapping[int, torch.Tensor], reduce: bool, rows: Mapping[int, int] | None = None
    ) -> torch.Tensor | None:
        """Mean of ``losses`` (this rank's, or every rank's with ``reduce``: with a ``dp_group`` every
        replica's too, the global batch's) as a 0-d float32 tensor.  ``rows`` (allow_uneven): each
        micro-batch's loss weighted by its rows, the mean over the batch's rows."""
        # Summed in float64, this rank's and the reduced mean alike (adding the zeros of ranks
        # without losses is exact), so the two agree bit for bit on a rank holding every loss.
        if losses and rows:
            total: torch.Tensor | None = _sum_f64([losses[m].detach().double() * rows[m] for m in losses])
            count = float(sum(rows[m] for m in losses))
        else:
            total, count = (_sum_f64(list(losses.values())) if losses else None), float(len(losses))
        if not reduce:
            return None if total is None else (total / count).float()
        acc = torch.zeros(2, dtype=torch.float64, device=self.device)
        if total is not None:
            acc[0], acc[1] = total, count
        self._all_reduce_loss(acc, self.group)
        if self.dp_group is not None:  # every replica's micro-batches: the global batch's mean
            self._all_reduce_loss(acc, self.dp_group)
        if acc[1].item() == 0:  # no rank had a loss (no criterion, or inference without one)
            return None
        return (acc[0] / acc[1]).float()


    def _all_reduce_loss(self, acc: torch.Tensor, group: Any) -> None:
        """The step's loss all-reduce over the pipeline group.  Only ranks that pass ``reduce_loss=True``
        enter it, so a rank that does not leaves the others waiting: its failure names the likely cause, and
        (through the pipeline's PeerWatch) a peer's failure ends the wait at once, naming that peer."""
        work = dist.all_reduce(acc, group=group, async_op=True)
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0
        try:
            while not work.is_completed():
                if self._watch is not None:
                    self._watch.check()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not complete after {self.timeout_s:.3g} s")
                time.sleep(pause)
                pause = min(0.001, pause + 0.0001)
            work.wait()
        except Exception as exc:
            if type(exc).__name__ == "PeerFailed":
                raise
            raise RuntimeError(
                f"pipeline rank {self.rank}: the step's loss all-reduce (reduce_loss=True) failed: {exc}. "
                "Every rank must pass the same reduce_loss to step(): a rank that passed False does not take part"
            ) from exc


def _sum_f64(values: list[torch.Tensor]) -> torch.Tensor:
    """The float64 sum of one-element tensors.  Scalars of one dtype (the usual case) are stacked first and
    converted once (one op each instead of three per loss: 16 losses, about 100 us -> 15 us); the same values
    are summed in the same order either way."""
    t0 = values[0]
    if all(v.dim() == 0 and v.dtype == t0.dtype for v in values):
        return torch.stack(values).detach().double().sum()
    return torch.stack([v.detach().reshape(()).double() for v in values]).sum()
