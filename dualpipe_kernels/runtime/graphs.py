"""Per-chunk CUDA graphs of the stage modules (``Pipeline(..., graphs=GraphOptions(enabled=True))``).

At construction every stage module of this rank that can be graphed is wrapped in a
:class:`GraphedStage`; the stage compute calls the wrapper as it would the module.  The first
training step runs eager and records each forward's input signature (shapes, dtypes, requires_grad,
the module's training flag); at its end the capture plan (runtime/graph_plan.py) is made from the
schedule and those signatures, every (stage, signature) is warmed up on a side stream and each slot's
forward and backward graphs are captured.  From the second training step on, a forward whose
micro-batch has the signature it was captured with replays its slot's forward graph, and its backward
(at the B or the I) the backward graph; at an I the weight gradients are deferred to the W through the
pipeline's WeightGradStore, so they join ``.grad`` in the schedule's order, as in an eager step.

Where a stage cannot be graphed it runs eager, with one logged line (logger ``dualpipe_kernels``) and
the reason kept in ``Pipeline.graph_status``: see :func:`stage_fallback` and docs/runtime_options.md.
Forward-only steps (``torch.no_grad()``) always run eager.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from dualpipe_kernels.runtime.graph_capture import Capturer, GraphSlot, current_capturer, replay_forward, warm_up
from dualpipe_kernels.runtime.graph_options import GraphOptions
from dualpipe_kernels.runtime.graph_plan import FORWARD, CapturePlan, Signature, capture_plan
from dualpipe_kernels.runtime.memory_plan import MemoryPolicy
from dualpipe_kernels.schedules.ir import Schedule

__all__ = ["GraphedStage", "StageGraphs", "GraphStatus", "stage_fallback"]

_log = logging.getLogger(__name__)

_RNG_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)

_POLICY_REASONS = {
    "offload": "memory policy 'offload' moves saved activations to the host (a graph keeps them in its pool)",
    "recompute": "memory policy 'recompute' replays the forward eagerly at the backward",
    "compress": "memory policy 'compress' hooks the saved activations (a graph keeps them in its pool)",
}


@dataclass
class GraphStatus:
    """One stage's graphs: ``state`` is ``"eager"`` (``reason`` says why), ``"recording"`` (before the
    first training step ends) or ``"captured"``.  ``graphs``: captured graphs; ``replays``: forward
    and backward replays so far (the backward ones counted at each step's end); ``eager_calls``:
    training forwards that ran eager after capture, by reason."""

    stage: int
    state: str
    reason: str | None = None
    graphs: int = 0
    replays: dict[str, int] = field(default_factory=lambda: {"F": 0, "B": 0})
    eager_calls: dict[str, int] = field(default_factory=dict)


def stage_fallback(
    module: nn.Module, policy: MemoryPolicy, overlap_hook: bool, opts: GraphOptions, capturer: Capturer
) -> str | None:
    """Why a stage cannot be graphed, known at construction (None: it may be)."""
    why = capturer.unavailable()
    if why is not None:
        return why
    if overlap_hook:
        return "the modules' F&B overlap hook (overlapped_forward_backward) runs both halves itself"
    if policy.kind != "keep":
        return _POLICY_REASONS.get(policy.kind, f"memory policy {policy.kind!r}")
    devices = {t.device.type for t in (*module.parameters(), *module.buffers())}
    off = sorted(devices - {capturer.device_type})
    if off:
        return f"the stage's tensors are on {', '.join(off)} (graphs capture {capturer.device_type} work only)"
    if not opts.allow_rng:
        for name, m in module.named_modules():
            if isinstance(m, _RNG_MODULES) and m.p > 0:
                return (
                    f"{type(m).__name__} at {name or 'the stage'!r} draws random numbers "
                    "(GraphOptions(allow_rng=True) graphs it: replays then draw other numbers than eager)"
                )
    return None


def _signature(args: tuple[Any, ...], kwargs: Mapping[str, Any], device_type: str, training: bool) -> Any:
    """The inputs' signature, or a reason string (a ``str``) when these inputs cannot be graphed."""
    if kwargs:
        return "the stage takes keyword arguments (a dict message)"
    sig = []
    for i, x in enumerate(args):
        if not isinstance(x, torch.Tensor):
            return f"input {i} is a {type(x).__name__}, not a tensor"
        if x.device.type != device_type:
            return f"input {i} is on {x.device.type} (graphs capture {device_type} work only)"
        sig.append((tuple(x.shape), str(x.dtype).removeprefix("torch."), x.requires_grad))
    return ((tuple(sig), training),)


class GraphedStage(nn.Module):
    """A stage module behind its graphs: calls run eager until captured, then replay (module docstring)."""

    def __init__(self, stage: int, module: nn.Module, owner: StageGraphs) -> None:
        super().__init__()
        self.inner = module
        self.stage = stage
        self._owner = [owner]  # a list: not an attribute nn.Module would register
        self.status = GraphStatus(stage, "recording")
        self.calls = 0
        self.recorded: dict[int, Signature] = {}
        self.samples: dict[Signature, list[torch.Tensor]] = {}
        self.slots: dict[tuple[Signature, int], GraphSlot] = {}
        self.noted: set[str] = set()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.status.state == "eager" or not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        plan = self._owner[0].plan
        order = plan.forward_order.get(self.stage, ())
        k, self.calls = self.calls, self.calls + 1
        sig = _signature(args, kwargs, self._owner[0].capturer.device_type, self.inner.training)
        if isinstance(sig, str):
            self._owner[0].fall_back(self, sig)
            return self.inner(*args, **kwargs)
        if k >= len(order):
            return self._eager_call(args, "more training forwards in a step than the schedule's F actions")
        mb = order[k]
        if self.status.state == "recording":
            out = self.inner(*args)
            if not (isinstance(out, torch.Tensor) or (isinstance(out, (tuple, list)) and out and all(
                isinstance(o, torch.Tensor) for o in out
            ))):  # fmt: skip
                self._owner[0].fall_back(self, "the stage returns something other than a tensor or tuple of tensors")
                return out
            self.recorded[mb] = sig
            self.samples.setdefault(sig, [x.detach().clone().requires_grad_(x.requires_grad) for x in args])
            self._single = isinstance(out, torch.Tensor)
            return out
        slot = self.slots.get((sig, plan.slot_of.get((self.stage, mb), -1)))
        if slot is None or plan.signature_of.get((self.stage, mb)) != sig:
            return self._eager_call(args, f"micro-batch input signature {sig} not seen at capture")
        if slot.busy:
            return self._eager_call(args, "the slot is still in use (the step's order differs from the plan)")
        outs = replay_forward(slot, args)
        self.status.replays["F"] += 1
        return outs[0] if self._single else outs

    def _eager_call(self, args: tuple[Any, ...], reason: str) -> Any:
        calls = self.status.eager_calls
        calls[reason] = calls.get(reason, 0) + 1
        if reason not in self.noted:
            self.noted.add(reason)
            _log.warning("%s stage %d: %s: this call runs eager", self._owner[0].who, self.stage, reason)
        return self.inner(*args)

    def end_step(self) -> None:
        self.calls = 0
        for slot in self.slots.values():
            slot.busy = False
        self.status.replays["B"] = sum(s.backward_replays for s in self.slots.values())


class StageGraphs:
    """This rank's graphed stages: the wrappers, the capture plan, the capture after the first training step.

    ``modules``: what the stage compute calls (a :class:`GraphedStage` where the stage may be graphed,
    else the module itself).  ``capturer``: how graphs are made (default: ``current_capturer``, a
    CudaCapturer unless ``capturing_with`` set another).
    """

    def __init__(
        self,
        rank: int,
        schedule: Schedule,
        stage_modules: Mapping[int, nn.Module],
        policies: Mapping[int, MemoryPolicy],
        opts: GraphOptions,
        overlap_hook: bool,
        capturer: Capturer | None = None,
    ) -> None:
        self.rank, self.schedule, self.opts = rank, schedule, opts
        self.who = f"pipeline rank {rank}"
        self.capturer: Capturer = capturer if capturer is not None else current_capturer(opts.capture_error_mode)
        self.wrapped: dict[int, GraphedStage] = {}
        self.status: dict[int, GraphStatus] = {}
        self.modules: dict[int, nn.Module] = dict(stage_modules)
        if not opts.enabled:
            return
        for s, m in stage_modules.items():
            why = stage_fallback(m, policies.get(s, MemoryPolicy()), overlap_hook, opts, self.capturer)
            if why is None:
                self.wrapped[s] = self.modules[s] = GraphedStage(s, m, self)
                self.status[s] = self.wrapped[s].status
            else:
                self.status[s] = GraphStatus(s, "eager", why)
                _log.warning("%s stage %d: CUDA graphs off, eager: %s", self.who, s, why)
        self.plan: CapturePlan = capture_plan(schedule, rank, None, opts.warmup_iters, frozenset(self.wrapped))

    def fall_back(self, stage: GraphedStage, reason: str) -> None:
        """Stage ``stage`` runs eager from now on, for ``reason`` (logged once)."""
        stage.status.state, stage.status.reason = "eager", reason
        stage.slots.clear()
        stage.samples.clear()
        _log.warning("%s stage %d: CUDA graphs off, eager: %s", self.who, stage.stage, reason)

    def close(self) -> None:
        """Drop every graph and its memory pool (the status stays, as a record); later calls run eager."""
        for g in self.wrapped.values():
            g.slots.clear()
            g.samples.clear()

    def end_step(self, training: bool) -> None:
        """After a step: reset the per-step counts; after the first training step, capture."""
        recording = [g for g in self.wrapped.values() if g.status.state == "recording"]
        for g in self.wrapped.values():
            if training and g.status.state == "recording" and g.calls != len(self.plan.forward_order[g.stage]):
                self.fall_back(g, f"{g.calls} training forwards in the first step, the schedule has "
                               f"{len(self.plan.forward_order[g.stage])}")  # fmt: skip
            g.end_step()
        if not training or not recording:
            return
        live = [g for g in recording if g.status.state == "recording"]
        signatures = {(g.stage, mb): sig for g in live for mb, sig in g.recorded.items()}
        self.plan = capture_plan(
            self.schedule, self.rank, signatures, self.opts.warmup_iters, frozenset(g.stage for g in live)
        )
        for g in live:
            self._capture(g)

    def _capture(self, g: GraphedStage) -> None:
        plan, limit = self.plan, self.opts.max_graphs_per_stage
        n = plan.graphs_of(g.stage)
        if limit is not None and n > limit:
            self.fall_back(g, f"the capture plan needs {n} graphs, more than max_graphs_per_stage={limit}")
            return
        try:
            with torch.enable_grad():  # captured with autograd on, whatever mode the caller is in
                for sample in g.samples.values():
                    warm_up(self.capturer, g.inner, sample, plan.warmup_iters)
                for key in plan.keys:
                    if key.stage == g.stage and key.kind == FORWARD:
                        slot = GraphSlot(g.inner, g.samples[key.signature], self.capturer, self.capturer.new_pool())
                        slot.capture()
                        g.slots[(key.signature, key.slot)] = slot
        except Exception as exc:  # what capture raises where the stage cannot be captured (host reads...)
            first = str(exc).splitlines()[0] if str(exc) else ""
            self.fall_back(g, f"capture raised {type(exc).__name__}: {first}")
            return
        g.status.state, g.status.graphs = "captured", sum(2 if s.bwd is not None else 1 for s in g.slots.values())
        g.samples.clear()
        _log.info("%s stage %d: CUDA graphs captured: %s", self.who, g.stage, plan.describe(g.stage))
