"""Stage compute: forward, backward, the I/W split and the F&B pair (with the overlap hook) on this rank.

Ownership and lifetimes (per step, in :class:`ComputeState`, dropped at the end):

* stage inputs ``(stage, mb)``: micro-batch slices of the caller's tensors on a
  first stage, otherwise tensors a receive produced (leaves with
  ``requires_grad`` when the sender's tensor required grad).  Kept until the
  backward of that (stage, mb) has read their ``.grad``.
* stage outputs: only the autograd *edges* of outputs are kept (enough for
  backward); the tensors themselves go to the ``outbox`` and from there to the
  send in flight, which releases them when it completes (unless autograd saved
  them).  With an ``overlapped_forward_backward`` hook the outputs must be
  handed to the hook, so they are kept in ``hook_outputs`` (the boundary swaps
  their storage for an empty one once sent, the reference's way).

Data a remote rank sends comes in through ``fetch(type, stage, mb)``, given by
the action loop: it completes the receive the list has reached, if any.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from dualpipe_kernels.runtime.checks import call_criterion
from dualpipe_kernels.runtime.memory import ActivationMemory, StepMemory
from dualpipe_kernels.runtime.stage_io import call_args, flatten_outputs
from dualpipe_kernels.runtime.zero_bubble import (
    DeferredWeightGrad,
    ParamEdges,
    WeightGradStore,
    backward_input,
    full_backward_for,
)
from dualpipe_kernels.schedules.deps import DepKind, Topology
from dualpipe_kernels.schedules.ir import T_I, T_RECV_B, T_RECV_F, Action, ActionType

__all__ = ["ComputeState", "StageCompute", "Key"]

Key = tuple[int, int]  # (stage, micro-batch)


_PyFn = torch._C._FunctionBase


def gradient_edge(t: torch.Tensor) -> GradientEdge:
    """``torch.autograd.graph.get_gradient_edge(t)`` for a tensor that requires grad, without its checks
    when ``t`` has a C++ ``grad_fn`` (once per stage output per micro-batch).  Leaves and outputs of Python
    autograd Functions (whose edge needs an ownership token) go through torch's function."""
    fn = t.grad_fn
    if fn is None or isinstance(fn, torch._C._FunctionBase):
        return get_gradient_edge(t)
    return GradientEdge(fn, t.output_nr)


@dataclass
class ComputeState:
    """One step's compute data on this rank (see the module docstring for who owns what)."""

    forward_only: bool
    return_outputs: bool
    criterion: Callable[..., torch.Tensor] | None
    mb_inputs: dict[int, tuple[Any, ...]]
    mb_labels: dict[int, tuple[Any, ...]]
    # Gradient seed of each micro-batch loss: 1/N with Pipeline(scale_grads=True), 1 for the sum.
    loss_scale: float = 1.0
    # Per micro-batch seeds where they differ (allow_uneven: rows / batch rows), and the rows they weight.
    loss_scales: dict[int, float] = field(default_factory=dict)
    loss_rows: dict[int, int] = field(default_factory=dict)
    # Complete the receive of (RECV type, stage, mb) if the list reached it (set by the action loop), called
    # only for a key in ``reached_f`` / ``reached_b`` (the loop's RECV_F / RECV_B actions reached, not yet waited
    # for: the boundary state's own dicts, so a compute tests a key without a call).
    fetch: Callable[[ActionType, int, int], None] = field(default=lambda t, s, mb: None)
    # Complete RECV action i and deliver its data: what fetch does once it has found i (set by the action loop).
    receive: Callable[[int], None] = field(default=lambda i: None)
    reached_f: dict[Key, int] = field(default_factory=dict)
    reached_b: dict[Key, int] = field(default_factory=dict)
    inputs: dict[Key, list[Any]] = field(default_factory=dict)
    roots: dict[Key, list[tuple[GradientEdge, int]]] = field(default_factory=dict)
    loss_tensors: dict[Key, torch.Tensor] = field(default_factory=dict)
    hook_outputs: dict[Key, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    out_grads: dict[Key, list[torch.Tensor | None]] = field(default_factory=dict)
    deferred: dict[Key, DeferredWeightGrad] = field(default_factory=dict)
    # What this rank's SENDs take: activations by (stage, mb) and input gradients by (stage, mb).
    outbox_f: dict[Key, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    outbox_b: dict[Key, list[torch.Tensor | None]] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    # Saved activations under the stages' memory policies (memory.py); set by the pipeline per step.
    mem: StepMemory = field(default_factory=StepMemory)


def _as_tuple(out: Any, stage: int, is_loss: bool = False) -> tuple[Any, ...]:
    """A stage's output as a tuple of members (stage_io.py); a loss stage's go to the criterion positionally."""
    if is_loss and isinstance(out, Mapping):
        raise ValueError(
            f"stage {stage} is a loss stage and returned a dict; return a tensor or a tuple "
            "(criterion(*outputs, *labels) takes them positionally)"
        )
    return flatten_outputs(out, stage)


@dataclass
class StageCompute:
    """Runs this rank's stage modules for F, B, I, W and F&B actions.

    ``zero_bubble``: ``"split"`` (I/W autograd-graph split) or ``"store"``
    (I runs the full backward with the WeightGradStore enabled, W pops it).
    ``overlap_hook``: the stage modules' class defines ``overlapped_forward_backward``.
    ``memory``: the stages' memory policies (default: keep everything, no saved-tensor hooks).
    """

    rank: int
    topo: Topology
    modules: Mapping[int, nn.Module]
    store: WeightGradStore
    zero_bubble: str
    memory: ActivationMemory | None = None
    overlap_hook: bool = field(init=False)
    _hooked_stages: frozenset[int] = field(init=False)
    _seeds: dict[tuple[Any, ...], torch.Tensor] = field(init=False, default_factory=dict)
    _param_edges: ParamEdges = field(init=False, default_factory=ParamEdges)
    # Per (stage, mb) of this rank's stages, resolved once from the topology (set lookups in the step):
    _loss_keys: frozenset[Key] = field(init=False)
    _first_keys: frozenset[Key] = field(init=False)
    _act_next: dict[Key, tuple[int, bool]] = field(init=False)  # the ACT consumer stage, on this rank
    _grad_prev: dict[Key, tuple[int, bool]] = field(init=False)  # the GRAD consumer stage (-1: none), on this rank
    _backward_full: Callable[[Any], None] = field(init=False)  # zero_bubble.full_backward_for these modules

    def __post_init__(self) -> None:
        topo, rank = self.topo, self.rank
        keys = [(s, mb) for s in self.modules for mb in range(topo.num_microbatches)]
        self._loss_keys = frozenset(k for k in keys if topo.is_loss_stage(*k))
        self._first_keys = frozenset(k for k in keys if topo.is_first_stage(*k))
        self._act_next, self._grad_prev = {}, {}
        for k in keys:
            nxt, prv = topo.consumer(DepKind.ACT, *k), topo.consumer(DepKind.GRAD, *k)
            self._act_next[k] = (nxt, topo.stage_to_rank[nxt] == rank)
            self._grad_prev[k] = (prv, prv >= 0 and topo.stage_to_rank[prv] == rank)
        self._backward_full = full_backward_for(self.modules.values())
        types = {type(m) for m in self.modules.values()}
        self.overlap_hook = len(types) == 1 and hasattr(next(iter(types)), "overlapped_forward_backward")
        if self.memory is None:
            self.memory = ActivationMemory(self.rank, {}, (), self.modules, torch.device("cpu"))
        recompute = [s for s, p in self.memory.policies.items() if p.kind == "recompute"]
        # Stages whose policy hooks saved tensors (not keep): the others' forwards skip the hooks' context.
        self._hooked_stages = frozenset(s for s, p in self.memory.policies.items() if p.kind != "keep")
        if self.overlap_hook and recompute:
            raise ValueError(
                f"pipeline rank {self.rank}: memory policy 'recompute' (stages {recompute}) cannot replay a forward "
                "run inside overlapped_forward_backward; use keep, compress or offload for these stages"
            )

    # ---- forward ------------------------------------------------------------
    def _stage_inputs(self, st: ComputeState, s: int, mb: int) -> list[Any]:
        key = (s, mb)
        if key in st.reached_f:
            st.fetch(T_RECV_F, s, mb)
        ins = st.inputs.get(key)
        if ins is not None:
            return ins
        if key in self._first_keys and mb in st.mb_inputs:
            ins = list(st.mb_inputs.pop(mb))
            st.inputs[key] = ins
            return ins
        raise RuntimeError(f"pipeline rank {self.rank}: {s}F{mb} has no inputs (schedule order broken?)")

    def forward(self, st: ComputeState, s: int, mb: int, module_out: Any = None, loss: Any = None) -> None:
        """F of stage ``s`` for ``mb`` (``module_out``/``loss``: already computed by an overlap hook)."""
        key = (s, mb)
        i = st.reached_f.pop(key, None) if st.reached_f else None
        if i is not None:
            st.receive(i)  # fetch inline
        ins = st.inputs.get(key)
        if ins is None:
            ins = self._stage_inputs(st, s, mb)  # a first stage's micro-batch, or an error
        is_loss = key in self._loss_keys
        labels = st.mb_labels.get(mb, ()) if is_loss else ()
        mem = self.memory
        assert mem is not None
        if not st.mem.training or (s not in self._hooked_stages and not mem.track):  # keep: no saved-tensor hooks
            last = ins[-1] if ins else None
            if module_out is None and type(last) is torch.Tensor and last.dtype is not torch.uint8:
                # the common case inline (once per forward): plain tensor inputs (no dict's keys member)
                module_out = self.modules[s](*ins)
                outs = (module_out,) if type(module_out) is torch.Tensor else _as_tuple(module_out, s, is_loss)
                if is_loss:
                    self._loss(st, s, mb, outs, loss)
            else:
                outs = self._run_forward(st, s, mb, ins, module_out, loss, is_loss)
        else:
            replay = None if module_out is not None else self._replay(st, s, ins, labels, is_loss)
            with mem.saving(st.mem, s, mb, (*ins, *labels), replay):
                outs = self._run_forward(st, s, mb, ins, module_out, loss, is_loss)
        if st.forward_only:
            del st.inputs[key]
        if is_loss:
            return
        for i, o in enumerate(outs):
            if o is not None and not isinstance(o, torch.Tensor):
                raise ValueError(
                    f"stage {s} output {i} is a {type(o).__name__}; only tensors and None can cross a boundary"
                )
        if not st.forward_only:
            roots = []  # a loop, not a comprehension: once per forward
            for i, o in enumerate(outs):
                if o is not None and o.requires_grad:
                    fn = o.grad_fn  # gradient_edge(o) inline for a C++ grad_fn
                    cpp = fn is not None and not isinstance(fn, _PyFn)
                    roots.append((GradientEdge(fn, o.output_nr) if cpp else gradient_edge(o), i))
            st.roots[key] = roots
        if self.overlap_hook and not st.forward_only:
            st.hook_outputs[key] = outs  # the hook's outputs1 for this stage's backward
        nxt, local = self._act_next[key]
        if local:
            # Same-rank handoff: cut the graph so each stage backward stays separate.
            handed = []  # a loop, not a comprehension: once per forward
            for o in outs:
                handed.append(None if o is None else o.detach().requires_grad_(o.requires_grad))
            st.inputs[(nxt, mb)] = handed
            return
        for i, o in enumerate(outs):
            if o is not None and o.requires_grad and o._base is not None:
                raise ValueError(
                    f"stage {s} output {i} (micro-batch {mb}) is a view of another tensor (e.g. of its input); "
                    "a stage must return fresh tensors (use .clone() or .contiguous())"
                )
        st.outbox_f[key] = outs

    def _run_forward(
        self, st: ComputeState, s: int, mb: int, ins: list[Any], module_out: Any, loss: Any, is_loss: bool
    ) -> tuple[Any, ...]:
        if module_out is None:
            args, kwargs = call_args(ins)
            module_out = self.modules[s](*args, **kwargs)
        outs = (module_out,) if type(module_out) is torch.Tensor else _as_tuple(module_out, s, is_loss)
        if is_loss:
            self._loss(st, s, mb, outs, loss)
        return outs

    def _replay(
        self, st: ComputeState, s: int, ins: list[Any], labels: tuple[Any, ...], is_loss: bool
    ) -> Callable[[], None]:
        """The stage's forward (and criterion) again, for a recompute: same ops, same saved tensors."""
        module, criterion = self.modules[s], st.criterion

        def replay() -> None:
            args, kwargs = call_args(ins)
            outs = _as_tuple(module(*args, **kwargs), s, is_loss)
            if is_loss and criterion is not None:
                criterion(*outs, *labels)

        return replay

    def _loss(self, st: ComputeState, s: int, mb: int, outs: tuple[Any, ...], loss: Any) -> None:
        key = (s, mb)
        if st.criterion is not None:
            if loss is None:
                where = f"pipeline rank {self.rank}, stage {s}, micro-batch {mb}"
                loss = call_criterion(st.criterion, outs, st.mb_labels.get(mb, ()), where)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"criterion must return a scalar tensor (stage {s}, micro-batch {mb})")
            st.losses[mb] = loss.detach()
            if not st.forward_only:
                st.loss_tensors[key] = loss
                st.roots[key] = [(gradient_edge(loss), -1)] if loss.requires_grad else []
        if st.return_outputs:
            st.outputs[mb] = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)

    # ---- backward -----------------------------------------------------------
    def _grad_roots(self, st: ComputeState, s: int, mb: int) -> list[tuple[GradientEdge, torch.Tensor | None]]:
        key = (s, mb)
        i = st.reached_b.pop(key, None) if st.reached_b else None
        if i is not None:
            st.receive(i)  # fetch inline
        roots = st.roots.pop(key, [])
        out = []  # loops, not comprehensions: once per backward
        if key in self._loss_keys:
            loss = st.loss_tensors.pop(key, None)
            seed = None if loss is None else self._seed(loss, st.loss_scales.get(mb, st.loss_scale))
            for e, _ in roots:
                out.append((e, seed))
            return out
        grads = st.out_grads.pop(key, None)
        if grads is None:
            raise RuntimeError(f"pipeline rank {self.rank}: backward of stage {s} micro-batch {mb} has no output grads")
        n = len(grads)
        for e, i in roots:
            if i < n and grads[i] is not None:
                out.append((e, grads[i]))
        return out

    def _seed(self, loss: torch.Tensor, scale: float) -> torch.Tensor:
        """The gradient seed of ``loss`` (``scale`` everywhere, like ``loss``), one tensor per kind of loss:
        the engine only reads a root's gradient, and the cache's reference keeps it from being stolen as
        a leaf's ``.grad``, so every backward may share it (one tensor op less per micro-batch).  A hook
        that wrote into it in place (its version moved) gets a fresh one next time."""
        k = (loss.dtype, loss.device, loss.shape, scale)
        seed = self._seeds.get(k)
        if seed is None or seed._version:
            seed = self._seeds[k] = torch.full_like(loss, scale, memory_format=torch.contiguous_format)
        return seed

    def _after_backward(self, st: ComputeState, s: int, mb: int) -> None:
        """Hand the stage's input gradients to the previous stage (locally or to the outbox of a SEND_B)."""
        ins = st.inputs.pop((s, mb), [])
        prv, local = self._grad_prev[(s, mb)]
        if prv < 0:
            return
        grads = []  # a loop, not a comprehension: once per backward
        for x in ins:
            grads.append(x.grad if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf else None)
        if local:
            st.out_grads[(prv, mb)] = grads
        else:
            st.outbox_b[(s, mb)] = grads

    def backward(self, st: ComputeState, s: int, mb: int, split: bool) -> None:
        """B (``split=False``) or I of stage ``s`` for ``mb``."""
        if st.hook_outputs:
            st.hook_outputs.pop((s, mb), None)
        roots = self._grad_roots(st, s, mb)
        mem = self.memory
        records = st.mem.records  # empty unless a stage's policy saves through hooks: no call then
        if records:
            mem.before_backward(st.mem, s, mb)  # type: ignore[union-attr]
        store = self.store
        if not split:
            if store.enabled:
                with store.enabled_for(False):
                    self._backward_full(roots)
            else:
                self._backward_full(roots)  # the store is off already: no context to enter
            if records:
                mem.release(st.mem, s, mb)  # type: ignore[union-attr]
        elif self.zero_bubble == "store":
            with store.enabled_for(True):
                self._backward_full(roots)
            store.flush((s, mb))
        else:
            ins = st.inputs.get((s, mb), [])
            leaves = [x for x in ins if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf]
            params = [p for p in self.modules[s].parameters() if p.requires_grad]
            with store.enabled_for(True):
                st.deferred[(s, mb)] = backward_input(roots, leaves, params, self._param_edges(params))
            store.flush((s, mb))
            mem.after_input(st.mem, s, mb)  # type: ignore[union-attr]  # recompute: W recomputes again
        self._after_backward(st, s, mb)

    def weight(self, st: ComputeState, s: int, mb: int) -> None:
        """W of stage ``s`` for ``mb``: the weight-gradient work its I deferred."""
        deferred = st.deferred.pop((s, mb), None)
        if deferred:
            self.memory.before_weight(st.mem, s, mb)  # type: ignore[union-attr]  # what after_input dropped
            deferred.run()
        self.store.pop((s, mb))
        self.memory.release(st.mem, s, mb)  # type: ignore[union-attr]  # the I kept the graph for this W

    # ---- the F&B pair ---------------------------------------------------------
    def pair(self, st: ComputeState, a: Action, after_forward: Callable[[], None] | None = None) -> None:
        """An OVERLAP_F_B pair: through the modules' overlap hook when they have one, else F then B.

        ``after_forward``: called between the halves when they run one after the other (the loop posts the
        forward half's send there); not called on the hook path, whose outputs exist only at its end.
        """
        f, b = a.sub_actions
        mf, mb_ = self.modules[f.stage], self.modules[b.stage]
        # The hook runs a full backward of ``b`` (for an I half, custom autograd
        # functions may still defer their weight work through the store).
        if st.forward_only or not self.overlap_hook or type(mf) is not type(mb_):
            self.forward(st, f.stage, f.microbatch)
            if after_forward is not None:
                after_forward()
            if not st.forward_only:
                self.backward(st, b.stage, b.microbatch, split=b.type is T_I)
            return
        topo = self.topo
        ins0 = self._stage_inputs(st, f.stage, f.microbatch)
        crit0 = st.criterion if topo.is_loss_stage(f.stage, f.microbatch) else None
        labels0 = list(st.mb_labels.get(f.microbatch, ())) if crit0 is not None else []
        kb = (b.stage, b.microbatch)
        if topo.is_loss_stage(b.stage, b.microbatch):
            loss1 = st.loss_tensors.pop(kb, None)
            scale1 = st.loss_scales.get(b.microbatch, st.loss_scale)
            if loss1 is not None and scale1 != 1.0:
                loss1 = loss1 * scale1  # the hook runs loss1.backward(): seed 1/N as _grad_roots does
            outputs1: list[torch.Tensor] = []
            grads1: list[torch.Tensor] = []
            st.roots.pop(kb, None)
        else:
            loss1 = None
            st.fetch(T_RECV_B, b.stage, b.microbatch)
            outs = st.hook_outputs.pop(kb, ())
            g = st.out_grads.pop(kb, None)
            if g is None:
                raise RuntimeError(f"pipeline rank {self.rank}: {b} has no output grads")
            st.roots.pop(kb, None)
            pairs = [(o, gi) for o, gi in zip(outs, g, strict=False) if gi is not None]
            outputs1, grads1 = [o for o, _ in pairs], [gi for _, gi in pairs]
        store, mem = self.store, self.memory
        mem.before_backward(st.mem, *kb)  # type: ignore[union-attr]
        with store.enabled_for(b.type is T_I), mem.saving(st.mem, f.stage, f.microbatch, (*ins0, *labels0), None):  # type: ignore[union-attr]
            hook = type(mf).overlapped_forward_backward  # type: ignore[attr-defined]
            out0, loss0 = hook(mf, ins0, crit0, labels0, mb_, loss1, outputs1, grads1)
        if b.type is T_I:
            store.flush(kb)
        else:
            mem.release(st.mem, *kb)  # type: ignore[union-attr]
        self.forward(st, f.stage, f.microbatch, module_out=out0, loss=loss0)
        self._after_backward(st, b.stage, b.microbatch)
