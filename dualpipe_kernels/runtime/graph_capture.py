"""Capture and replay of one stage's forward and backward graphs (one slot of the capture plan).

A :class:`GraphSlot` owns static input buffers (the stage's inputs are copied in before each forward
replay), the forward graph's outputs and saved activations (in the slot's pool, rewritten by each
replay), static incoming-gradient buffers and the backward graph's gradients.  What a replay returns
is a copy: the forward's outputs go to a send that may still be in flight when the slot's next
forward replays, and the input gradients likewise.

:class:`Capturer` is how graphs are made: :class:`CudaCapturer` (torch.cuda.CUDAGraph, warm-up on a
side stream) is the one the runtime uses; tests pass their own to exercise the slot logic and the
fallbacks on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.nn as nn

from dualpipe_kernels.runtime.zero_bubble import current_store

__all__ = [
    "Capturer",
    "CudaCapturer",
    "Replayable",
    "GraphSlot",
    "replay_forward",
    "warm_up",
    "capturing_with",
    "current_capturer",
]

# The capturer that pipelines built in this context use (None: CudaCapturer); see capturing_with.
_CAPTURER: contextvars.ContextVar[Capturer | None] = contextvars.ContextVar("dualpipe_kernels_capturer", default=None)


class Replayable(Protocol):
    def replay(self) -> None: ...


class Capturer(Protocol):
    """Makes graphs.  ``device_type``: the device the stages' tensors must be on."""

    device_type: str

    def unavailable(self) -> str | None:
        """Why no graph can be made in this process (None: they can)."""
        ...

    def new_pool(self) -> Any:
        """A fresh memory pool handle (one per slot)."""
        ...

    def warm_up(self, fn: Callable[[], None], iters: int) -> None:
        """Run ``fn`` ``iters`` times where a capture's lazy initialisation may happen."""
        ...

    def capture(self, fn: Callable[[], None], pool: Any) -> Replayable:
        """Capture ``fn`` into a graph that allocates from ``pool``; raises where capture is impossible."""
        ...


class CudaCapturer:
    """torch.cuda.CUDAGraph capture; warm-ups on a side stream."""

    device_type = "cuda"

    def __init__(self, error_mode: str = "thread_local") -> None:
        self.error_mode = error_mode

    def unavailable(self) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device (torch.cuda.is_available() is False)"
        return None

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def warm_up(self, fn: Callable[[], None], iters: int) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(iters):
                fn()
        torch.cuda.current_stream().wait_stream(side)

    def capture(self, fn: Callable[[], None], pool: Any) -> Replayable:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=self.error_mode):
            fn()
        return graph


@contextlib.contextmanager
def capturing_with(capturer: Capturer) -> Iterator[None]:
    """Pipelines constructed inside this block make their graphs with ``capturer`` (another capture
    backend; the tests' way to run the slot logic and the capture failures without a GPU)."""
    token = _CAPTURER.set(capturer)
    try:
        yield
    finally:
        _CAPTURER.reset(token)


def current_capturer(error_mode: str) -> Capturer:
    """The capturer of this context: the one :func:`capturing_with` set, else a :class:`CudaCapturer`."""
    given = _CAPTURER.get()
    return given if given is not None else CudaCapturer(error_mode)


def _outputs(out: Any) -> tuple[torch.Tensor, ...]:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def warm_up(capturer: Capturer, module: nn.Module, sample: Sequence[torch.Tensor], iters: int) -> None:
    """``iters`` eager forward+backward runs of ``module`` on copies of ``sample``, through
    ``torch.autograd.grad`` (nothing accumulates into ``.grad``); the module's buffers (running
    statistics) are put back afterwards, so the warm-up leaves no trace in the training."""
    params = [p for p in module.parameters() if p.requires_grad]
    saved = [(b, b.detach().clone()) for b in module.buffers()]

    def once() -> None:
        ins = [x.detach().clone().requires_grad_(x.requires_grad) for x in sample]
        outs = [o for o in _outputs(module(*ins)) if o.requires_grad]
        wrt = [x for x in ins if x.requires_grad] + params
        if outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)

    try:
        capturer.warm_up(once, iters)
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


class GraphSlot:
    """One slot: a forward graph and a backward graph of ``module`` for inputs shaped like ``sample``.

    ``busy``: between a forward replay and the end of its backward (or of its deferred weight-gradient
    accumulation); a forward that finds its slot busy runs eager (the plan says it cannot happen).
    """

    def __init__(self, module: nn.Module, sample: Sequence[torch.Tensor], capturer: Capturer, pool: Any) -> None:
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.static_in = [x.detach().clone().requires_grad_(x.requires_grad) for x in sample]
        self.in_req = [x for x in self.static_in if x.requires_grad]
        self.capturer, self.pool = capturer, pool
        self.out: tuple[torch.Tensor, ...] = ()
        self.grads: tuple[torch.Tensor | None, ...] = ()
        self.grad_in: list[torch.Tensor] = []
        self.diff: list[int] = []
        self.fwd: Replayable | None = None
        self.bwd: Replayable | None = None
        self.busy = False
        self.forward_replays = 0
        self.backward_replays = 0

    def capture(self) -> None:
        """Capture the forward, then the backward (raises what the capture raises)."""

        def forward() -> None:
            self.out = _outputs(self.module(*self.static_in))

        self.fwd = self.capturer.capture(forward, self.pool)
        self.diff = [i for i, o in enumerate(self.out) if o.requires_grad]
        self.grad_in = [torch.zeros_like(self.out[i]) for i in self.diff]
        wrt = self.in_req + self.params
        if not self.diff or not wrt:
            return

        def backward() -> None:
            outs = [self.out[i] for i in self.diff]
            # retain_graph: the graph is replayed again and again; its saved tensors stay in the slot's pool
            self.grads = torch.autograd.grad(outs, wrt, self.grad_in, retain_graph=True, allow_unused=True)

        self.bwd = self.capturer.capture(backward, self.pool)

    def backward_grads(self, grads: Sequence[torch.Tensor | None]) -> tuple[list[Any], list[Any]]:
        """Replay the backward for the outputs' incoming ``grads``: (per static input: its gradient or
        None, per parameter: the slot's gradient buffer or None)."""
        assert self.bwd is not None
        for buf, i in zip(self.grad_in, self.diff, strict=True):
            g = grads[i]
            if g is None:
                buf.zero_()
            else:
                buf.copy_(g)
        self.bwd.replay()
        self.backward_replays += 1
        n = len(self.in_req)
        it = iter(self.grads[:n])
        ins = [(None if (g := next(it)) is None else g.clone()) if x.requires_grad else None for x in self.static_in]
        return ins, list(self.grads[n:])


def _accumulate(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], slot: GraphSlot) -> None:
    """Add ``grads`` into the parameters' ``.grad`` as AccumulateGrad would (a copy when there is none)."""
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            if g is None:
                continue
            if p.grad is None:
                p.grad = torch.empty_like(p).copy_(g)
            else:
                p.grad.add_(g)
    slot.busy = False


class _Replay(torch.autograd.Function):
    """The autograd node of a replayed stage: inputs and parameters in, the forward graph's outputs out."""

    @staticmethod
    def forward(ctx: Any, slot: GraphSlot, n_in: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for buf, x in zip(slot.static_in, tensors[:n_in], strict=True):
            buf.copy_(x)
        assert slot.fwd is not None
        slot.fwd.replay()
        slot.forward_replays += 1
        outs = tuple(o.detach().clone() for o in slot.out)
        ctx.slot = slot
        ctx.n_in = n_in
        diff = set(slot.diff)
        ctx.mark_non_differentiable(*(o for i, o in enumerate(outs) if i not in diff))
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        slot: GraphSlot = ctx.slot
        ins, pgrads = slot.backward_grads(grads)
        store = current_store()
        if store is not None and store.enabled and any(g is not None for g in pgrads):
            # an I: the weight gradients join the .grad at this micro-batch's W, in the schedule's order
            # (the slot stays busy until then: the plan keeps it so)
            store.put(lambda: _accumulate(slot.params, pgrads, slot))
            pout: list[Any] = [None] * len(pgrads)
        else:
            pout = pgrads  # AccumulateGrad copies them (the slot holds a reference)
            slot.busy = False
        return (None, None, *ins, *pout)


def replay_forward(slot: GraphSlot, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The stage's outputs for ``inputs``, by the slot's graphs (the backward replays through autograd)."""
    slot.busy = slot.bwd is not None
    out = _Replay.apply(slot, len(inputs), *inputs, *slot.params)
    return tuple(out)
