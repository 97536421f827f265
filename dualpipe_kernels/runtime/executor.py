"""The pipeline: runs this rank's lowered action list for one training or inference step.

The work is split into rooms, each with its own state:

* :mod:`.step`: the step (its arguments split into the compute state, the loop run, the reductions after);
* :mod:`.loop`: the action loop and its window of posted receives;
* :mod:`.compute`: stage compute (F, B, I/W split, F&B pair and the overlap hook);
* :mod:`.boundary`: boundary communication (post, complete, reap);
* :mod:`.reductions`: the step's gradient reductions in one shape, built from explicit inputs:
  :mod:`.data_parallel` (PP x DP), :mod:`.mirror` (DualPipe's mirror sum), :mod:`.tied` (tied parameters);
* :mod:`.loss`: the step's mean loss;
* :mod:`.construction`: checking the modules and mapping given; :mod:`.builders`: cutting a model
  and reading a mesh for :meth:`Pipeline.from_sequential` / :meth:`Pipeline.from_mesh`;
* :mod:`.options`: the configuration, grouped and checked (``Pipeline(..., wire=WireOptions(...))``);
* :mod:`.result`: what a step returns (:class:`StepResult`).

:class:`Pipeline` wires them together once at construction; a step builds the
per-step states, runs the loop and drops them.  What each comm action moves,
and to which rank, is read from the schedule's dependency program
(``schedules.deps.Program``), the same one the validator and simulator read.

Errors name this pipeline rank, the peer pipeline rank, the action and the
micro-batch.  After an error the pipeline refuses further steps (pending
transfers may be left in the process group).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from dualpipe_kernels.runtime.boundary.exchange import Boundary, Wire, pair_order_digest
from dualpipe_kernels.runtime.boundary.header import TagSpace
from dualpipe_kernels.runtime.boundary.inline import INLINE_MAX_BYTES, inline_limit
from dualpipe_kernels.runtime.boundary.layout_memory import LayoutMemory
from dualpipe_kernels.runtime.builders import mesh_groups, sequential_stages
from dualpipe_kernels.runtime.checks import check_stage_devices
from dualpipe_kernels.runtime.compute import StageCompute
from dualpipe_kernels.runtime.construction import check_mapping, check_modules, module_device
from dualpipe_kernels.runtime.fingerprint import Fingerprint, agree, fingerprint, resolved_transport
from dualpipe_kernels.runtime.graph_options import GraphOptions
from dualpipe_kernels.runtime.graphs import GraphStatus, StageGraphs
from dualpipe_kernels.runtime.loop import ActionLoop
from dualpipe_kernels.runtime.loss import LossReduction
from dualpipe_kernels.runtime.memory import ActivationMemory
from dualpipe_kernels.runtime.microbatch import SplitCache
from dualpipe_kernels.runtime.mirror import MirrorSync, mirrors
from dualpipe_kernels.runtime.model_options import ModelOptions
from dualpipe_kernels.runtime.options import (
    GROUP_NAMES,
    SHORTHANDS,
    BoundaryFormatSpec,
    DiagnosticsOptions,
    GradientOptions,
    LayoutOptions,
    MemoryOptions,
    MemoryPolicySpec,
    PipelineOptions,
    WireOptions,
)
from dualpipe_kernels.runtime.peer_watch import PeerWatch, WatchedTransport
from dualpipe_kernels.runtime.reductions import build_reductions
from dualpipe_kernels.runtime.result import StepResult
from dualpipe_kernels.runtime.step import PipelineStep, on_group
from dualpipe_kernels.runtime.zero_bubble import WeightGradStore
from dualpipe_kernels.schedules.deps import Program
from dualpipe_kernels.schedules.ir import Schedule
from dualpipe_kernels.transport import Transport, make_transport
from dualpipe_kernels.transport.base import group_store

__all__ = ["Pipeline", "StepResult"]

_log = logging.getLogger(__name__)  # under "dualpipe_kernels": what each pipeline chose, at debug level


# -------------------------------------------------------------------------------------------------------------


def _lowered_program(schedule: Schedule) -> Program:
    """The validated dependency program of ``schedule`` in its lowered form (lowering it when compute-only).

    Validation is the full validator (O(actions)): a schedule that would compute wrong gradients or
    deadlock raises ScheduleError on every rank, each on its own, before anything runs.
    """
    from dualpipe_kernels.schedules.lowering import lower_program
    from dualpipe_kernels.schedules.validate import validate

    if not isinstance(schedule, Schedule):
        raise ValueError(f"schedule must be a dualpipe_kernels Schedule, got {type(schedule).__name__}")
    program = validate(schedule)
    return program if schedule.lowered else lower_program(program)


class Pipeline(PipelineStep, nn.Module):
    """Runs ``schedule`` on this process's pipeline rank with its stage modules.

    ``schedule``: compute-only (lowered here with ``lower_comms``) or lowered.
    ``modules``: ``{stage: module}`` for ``schedule.stages_of_rank(rank)`` (or a
    sequence in that order).  ``group``: the pipeline's process group (default
    group when None).

    Everything else is keyword-only, grouped in frozen dataclasses
    (runtime/options.py, docs/runtime_options.md): ``layout=LayoutOptions(...)``
    (``rank_mapping``, ``batch_dim``, ``device``), ``wire=WireOptions(...)``
    (``transport``, ``boundary_format``, ``timeout_s``, ``recv_lookahead``,
    ``early_small_receives``, ``inline_limit_bytes``),
    ``gradients=GradientOptions(...)`` (``zero_bubble``, ``sync_mirror_grads``,
    ``scale_grads``, ``dp_group``, ``dp_op``), ``memory=MemoryOptions(policy)``,
    ``diagnostics=DiagnosticsOptions(record_timeline)``,
    ``model_options=ModelOptions(tied_parameters, allow_uneven)`` and
    ``graphs=GraphOptions(...)``.  The flat keywords (``timeout_s=30``,
    ``memory_policy="offload"``...) are shorthands for one field of a group
    (the table ``options.SHORTHANDS``); None leaves the field alone, and a
    shorthand that differs from the field of a group given too is an error.
    ``options``: the resolved :class:`PipelineOptions`.

    In short: ``transport`` "auto" builds what transport/auto.py's rule picks
    (on CPU the native engine when it is built, else torch; a given Transport instance is not closed by :meth:`close`).
    ``boundary_format``: how stage-boundary messages travel (``"none"``,
    ``"packed"``, ``"bf16"``, ``"fp8"``...; runtime/boundary/codec.py).
    ``scale_grads``: seed each micro-batch loss's backward with ``1/N`` (the full
    batch's mean-loss gradients for a mean criterion, as
    torch.distributed.pipelining does); False accumulates the plain sum (the
    DualPipe reference's and ``compat``'s semantics); gradients already in
    ``.grad`` are left alone.  PP x DP: ``dp_group`` is this rank's data-parallel
    group (``group`` then this replica's pipeline group; or :meth:`from_mesh`):
    each stage's gradients are all-reduced over it as soon as its last gradient
    action of the step is done (runtime/data_parallel.py); ``dp_op`` follows
    ``scale_grads``.  DualPipe's mirror copies: one all_reduce over every copy
    of every replica replaces the DP sum and the mirror exchange.  Memory
    policies (runtime/memory_plan.py): the ``memory_policy`` attribute is then
    ``{stage: policy name}``; ``activation_memory.peaks`` the peak
    device-resident saved bytes of every training step.

    Construction is collective: every rank checks its options, lowers and
    validates the schedule, agrees with the others on what must be shared
    (:class:`~dualpipe_kernels.runtime.fingerprint.RanksDisagree` naming the
    field otherwise), sets up the transport and builds its subsystems.  The
    module is an ``nn.Module`` holding the stage modules (``parameters()``,
    ``zero_grad()`` work on it); ``stage_modules`` maps stage -> module.
    """

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
        graphs: GraphOptions | None = None,
        # the flat shorthands: options.SHORTHANDS, in its order (tests/unit/test_builder_signatures.py)
        rank_mapping: Sequence[int] | None = None,
        batch_dim: int | None = None,
        device: torch.device | str | None = None,
        transport: str | Transport | None = None,
        boundary_format: BoundaryFormatSpec = None,
        timeout_s: float | None = None,
        recv_lookahead: int | None = None,
        early_small_receives: bool | None = None,
        zero_bubble: str | None = None,
        sync_mirror_grads: bool | None = None,
        scale_grads: bool | None = None,
        dp_group: dist.ProcessGroup | None = None,
        dp_op: str | None = None,
        memory_policy: MemoryPolicySpec | None = None,
        record_timeline: bool | None = None,
        tied_parameters: Sequence[Sequence[str]] | None = None,
        allow_uneven: bool | None = None,
    ) -> None:
        """Check the arguments and options, lower the schedule, agree across ranks, set up the transport, build the
        subsystems (collective: every rank of the group builds its Pipeline)."""
        given = locals()
        options = PipelineOptions.fold({g: given[g] for g in GROUP_NAMES}, {k: given[k] for k in SHORTHANDS})
        nn.Module.__init__(self)  # the mixins have no state of their own
        self._set_options(options)
        self.program = _lowered_program(schedule)  # validates: a broken schedule fails here, on every rank
        self._place(self.program.schedule, modules, group)
        self._agree()
        self._connect()
        try:
            self._build_subsystems()
        except BaseException:
            self.close()
            raise
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("%s", self._describe())

    # ---- construction, step by step ----------------------------------------
    def _set_options(self, options: PipelineOptions) -> None:
        """Keep the checked options, and each setting as an attribute of its own (read by the step and the
        conveniences)."""
        self.options = options
        #: per-chunk CUDA graphs (runtime/graphs.py; off by default)
        self.graph_options = options.graphs
        #: the model's ties and batch rule (runtime/model_options.py)
        self.model_options = options.model_options
        layout, wire, grads = options.layout, options.wire, options.gradients
        self.batch_dim = layout.batch_dim
        self.timeout_s = wire.timeout_s
        #: how boundary messages travel (part of what every rank must agree on)
        self.boundary_format = wire.format
        self.zero_bubble = grads.zero_bubble
        self.sync_mirror_grads = grads.sync_mirror_grads
        self.scale_grads = grads.scale_grads
        self.dp_group = grads.dp_group
        self.record_timeline = options.diagnostics.record_timeline

    def _place(self, schedule: Schedule, modules: Mapping[int, nn.Module] | Sequence[nn.Module], group: Any) -> None:
        """Who is who: the process group, this process's pipeline rank, its stages, their modules and device."""
        if not dist.is_initialized():
            raise ValueError("Pipeline needs an initialised torch.distributed process group")
        self.group = group if group is not None else dist.group.WORLD
        self.group_rank = dist.get_rank(self.group)
        size = dist.get_world_size(self.group)
        if size != schedule.num_ranks:
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_ranks} ranks but the process group has {size}"
            )
        self.rank_mapping = check_mapping(self.options.layout.rank_mapping, size)
        self.to_group_rank = [0] * size
        for g, p in enumerate(self.rank_mapping):
            self.to_group_rank[p] = g
        self.rank = self.rank_mapping[self.group_rank]
        self.schedule = schedule
        self.stages = schedule.stages_of_rank(self.rank)
        self.options.memory.check_stages(schedule.num_stages)
        # micro-batches whose first / loss stage is on this rank (fixed by the schedule; read every step)
        self._first_mbs = [m for m in range(schedule.num_microbatches) if schedule.path(m)[0] in self.stages]
        self._last_mbs = [m for m in range(schedule.num_microbatches) if schedule.path(m)[-1] in self.stages]
        self._splits = SplitCache()
        self.stage_modules = check_modules(modules, self.stages, self.rank, schedule.name)
        check_stage_devices(self.stage_modules)
        self.stage_module_dict = nn.ModuleDict({str(s): m for s, m in self.stage_modules.items()})
        device = self.options.layout.device
        self.device = torch.device(device) if device is not None else module_device(self.stage_modules)
        if self.device.type == "cuda" and self.device.index is None:
            # Receive buffers may be allocated on a transport thread, whose current device differs.
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _agree(self) -> None:
        """Compare with every rank of the group what must be the same everywhere (collective): the schedule,
        the placement, the transport and the options' shared fields (``PipelineOptions.agreed_fields``)."""
        schedule = self.schedule
        shared, stated = self.options.agreed_fields(schedule.num_stages, bool(mirrors(schedule)))
        transport = resolved_transport(self.options.wire.transport, self.device)
        # the order both ends of each pair post its messages in, on an in-order (NCCL) channel
        shared["pair order"] = pair_order_digest(self.program)
        mine = fingerprint(schedule, self.rank, self.rank_mapping, transport, extra=shared, partial=stated)
        # RanksDisagree on every rank: ranks, field.  The exchange's number is the pipeline's on its group, the
        # same on every rank: its block of tags and its in-order channel (two pipelines' messages never match).
        self.channel = agree(mine, self.group, self.timeout_s, self.rank_mapping)

    def _connect(self) -> None:
        """Set up the transport (collective), the message tags and layouts, and the receive window."""
        wire = self.options.wire
        self.tags = TagSpace(self.schedule.num_stages, self.schedule.num_microbatches, channel=self.channel)
        # Message layouts of the previous step, so receives are posted before the metadata arrives.
        self._layouts = LayoutMemory(inline_max_bytes=INLINE_MAX_BYTES, channel=self.channel)
        on_group(self)
        self._transport = make_transport(wire.transport, self.group, self.device, self.timeout_s)
        self._owns_transport = not isinstance(wire.transport, Transport)
        self._watch: PeerWatch | None = None
        try:
            # A larger inline limit where the transport takes whole larger messages.  Both ends of a message
            # must use the same one (it decides how the message travels): a transport that reports different
            # values on different ranks fails here, on every rank, naming them (RanksDisagree), not at its
            # first large message.
            given = wire.inline_limit_bytes
            self._layouts.inline_max_bytes = given if given is not None else inline_limit(self._transport)
            limit = ("inline message limit (Transport.message_inline_bytes)", str(self._layouts.inline_max_bytes))
            agree(Fingerprint(self.rank, (limit,)), self.group, self.timeout_s, self.rank_mapping)
            diag = self.options.diagnostics
            if diag.watch_peers:
                self._watch = PeerWatch(
                    group_store(self.group),
                    self.rank,
                    self.schedule.num_ranks,
                    key_rank=self.group_rank,
                    poll_s=diag.poll_s,
                    liveness_s=diag.liveness_s,
                    store_host=self.rank_mapping[0],
                )
        except BaseException:
            self.close()
            raise
        self.recv_lookahead = wire.recv_lookahead if wire.recv_lookahead is not None else self._transport.recv_lookahead
        self.early_small_receives = (
            wire.early_small_receives if wire.early_small_receives is not None else self._transport.early_small_receives
        )

    def _build_subsystems(self) -> None:
        """Activation memory, stage compute, boundary messaging, mirror sync, the action loop and the DP
        reducer, each with its own state (see the module docstring)."""
        schedule, opts = self.schedule, self.options
        self._broken: str | None = None
        self.weight_grad_store = WeightGradStore()
        policies = opts.memory.for_stages(self.stages)
        self.memory_policy = {s: p.name for s, p in policies.items()}
        self.activation_memory = ActivationMemory(
            self.rank, policies, schedule.actions[self.rank], self.stage_modules, self.device
        )
        self._compute = StageCompute(
            self.rank,
            self.program.topo,
            self.stage_modules,
            self.weight_grad_store,
            self.zero_bubble,
            self.activation_memory,
        )
        self.overlap_hook = self._compute.overlap_hook
        self._graphs = StageGraphs(
            self.rank, schedule, self.stage_modules, policies, self.graph_options, self.overlap_hook
        )
        self._compute.modules = self._graphs.modules  # the graphed stages' wrappers where they apply
        wire = Wire(
            self.rank,
            # (a WatchedTransport is the transport itself, handles wrapped: the Transport surface by delegation)
            self._transport if self._watch is None else cast(Transport, WatchedTransport(self._transport, self._watch)),
            self.to_group_rank,
            self.tags,
            self._layouts,
            self.device,
            self.timeout_s,
            self.boundary_format,
        )
        self._boundary = Boundary(wire, self.program)
        mirror_sync = MirrorSync(wire, schedule, self.stage_modules)
        self.mirror_of = mirror_sync.mirror_of
        self._loop = ActionLoop(schedule.actions[self.rank], self.recv_lookahead, self.early_small_receives)
        # DP, DualPipe's mirror sum, the tied parameters (runtime/reductions.py): the step runs them in order
        self._reductions = build_reductions(
            schedule, self.rank, self.group, self.rank_mapping, self.to_group_rank, self.stage_modules,
            self._loop.actions, opts.gradients, mirror_sync, self.model_options.tied_parameters, self.timeout_s,
        )  # fmt: skip
        self._dp = self._reductions.dp  # the DP reduction by name (its trigger actions: the PP x DP tests)
        self._loss = LossReduction(self.rank, self.device, self.group, self.dp_group, self.timeout_s, self._watch)

    # ---- introspection: what this pipeline chose ----------------------------
    @property
    def graph_status(self) -> dict[int, GraphStatus]:
        """``{stage: GraphStatus}`` of the stages this rank graphs or runs eager for a reason (empty when
        graphs are off)."""
        return dict(self._graphs.status)

    @property
    def transport_name(self) -> str:
        """The transport actually in use (``"native"``, ``"torch"``, ``"cuda_ipc"``...), never ``"auto"``."""
        return str(self._base_transport().name)

    @property
    def inline_limit_bytes(self) -> int:
        """The data bytes up to which a message with a remembered layout travels as one transfer (the same on
        every rank: ``WireOptions.inline_limit_bytes``, or the transport's choice)."""
        return int(self._layouts.inline_max_bytes)

    def boundary_bytes(self) -> dict[str, tuple[int, int]]:
        """``{"activations" | "gradients": (messages, data bytes)}`` this rank sent so far (metadata excluded)."""
        b = self._boundary
        return {name: (b.messages_sent[d], b.bytes_sent[d]) for d, name in enumerate(("activations", "gradients"))}

    def receive_buffers(self) -> tuple[int, int]:
        """``(allocated, pooled bytes)`` of the pool of small-message receive buffers (runtime/boundary/inline.py):
        buffers ever allocated (flat after the first steps of a training loop) and the bytes held free now."""
        pool = self._layouts.pool
        return pool.allocations, pool.free_bytes()

    def _base_transport(self) -> Transport:
        inner = getattr(self._transport, "inner", None)  # a wrapper (the benchmarks' payload switch) names its inner
        return inner if isinstance(inner, Transport) else self._transport

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
            f"sync_mirror_grads={self.sync_mirror_grads}, overlap hook={'on' if self.overlap_hook else 'off'}"
        )

    # ---- builders: the same option groups as the constructor (tests/unit/test_builder_signatures.py) ----
    @classmethod
    def from_sequential(
        cls,
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
        graphs: GraphOptions | None = None,
    ) -> Pipeline:
        """A pipeline running this rank's share of the full ``model`` (every rank builds the same model).

        ``partition[m]``: number of layers of model stage ``m`` (default: as even
        as possible, earlier stages one layer more).  ``group`` and the option
        groups: as for ``Pipeline`` (runtime/options.py).  The stage modules are
        :func:`build_stage_modules`'s (``StageLayers`` sharing the model's
        layers; a second copy of a model stage held by the same rank is a deep
        copy), so parameter names map back to ``model``'s (``runtime.checkpoint``).
        Parameters shared by identity (an embedding tied to the head) are tie
        groups, added to those ``model_options`` declares.  Example::

            model = nn.Sequential(*layers)  # same seed on every rank
            pipe = Pipeline.from_sequential(build_schedule("dualpipev", 2, 8), model, wire=WireOptions(timeout_s=60))
        """
        mods, found = sequential_stages(schedule, model, partition, group, layout, model_options)
        return cls(
            schedule, mods, group, layout=layout, wire=wire, gradients=gradients, memory=memory,
            diagnostics=diagnostics, model_options=found, graphs=graphs,
        )  # fmt: skip

    @classmethod
    def from_mesh(
        cls,
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
        model_options: ModelOptions | None = None,
        graphs: GraphOptions | None = None,
    ) -> Pipeline:
        """Build from a 2-D ``torch.distributed.DeviceMesh`` with dimensions named ``"pp"`` and ``"dp"``.

        The pipeline group is the mesh's ``"pp"`` group and the data-parallel
        group its ``"dp"`` group (``gradients`` must leave ``dp_group`` unset).
        ``modules``: this rank's stage modules, or the whole ``nn.Sequential``
        (cut as by :meth:`from_sequential`).  The option groups: as for ``Pipeline``.
        """
        group, gradients = mesh_groups(mesh, gradients)
        if isinstance(modules, nn.Sequential):
            modules, model_options = sequential_stages(schedule, modules, partition, group, layout, model_options)
        return cls(
            schedule, modules, group, layout=layout, wire=wire, gradients=gradients, memory=memory,
            diagnostics=diagnostics, model_options=model_options, graphs=graphs,
        )  # fmt: skip

    def close(self) -> None:
        """Release the transport if this pipeline created it (a given Transport stays the caller's). Idempotent."""
        self._layouts.clear()  # pooled receive buffers
        watch, self._watch = getattr(self, "_watch", None), None
        if watch is not None:
            watch.close()
        graphs = getattr(self, "_graphs", None)  # absent when construction failed before it
        if graphs is not None:
            graphs.close()  # the graphs' memory pools
        memory = getattr(self, "activation_memory", None)  # absent when construction failed before it
        if memory is not None:
            memory.close()  # the offload copy lanes' threads
        if self._owns_transport:
            self._transport.close()
