"""Synthetic pipeline stages whose compute is a sleep of a set length.

Sleeping ranks do not compete for the CPU, so on a small machine the time a
schedule takes depends on its order and on communication only, and the
simulator's cost model is known: F for a forward, I = B - W for the
input-gradient backward, W for the weight-gradient backward (seconds).

The two backward halves are separate autograd nodes, the weight part behind
the input part (``out = input_part(x, weight_part(weight))``: the forward
allocates one activation-sized tensor, its output, so a chunk's own host work
stays small next to its sleeps); the W sleep is deferred through the running
pipeline's WeightGradStore (``runtime.zero_bubble.current_store()``) when the
schedule splits the backward, so the I action sleeps I and the W action W; a
plain full backward sleeps both.

Activations are float32 ``[rows, cols]`` tensors whose size per micro-batch the
caller sets (``sleep_batch``); their values are zeros and do not matter.

``time.sleep`` overshoots by a platform-dependent amount (timer slack,
scheduling); :func:`sleep_overshoot` measures it so a benchmark can report it
and feed the actual durations to the simulator.  Every thread that sleeps
here first sets its timer slack to 1 ns (Linux ``PR_SET_TIMERSLACK``; Linux's
default of 50 us makes a 1 ms sleep last about 1.08 ms on the 2-core machine,
1.03 ms with the tighter slack), so that a sleep stands for a compute of its
requested length as closely as the kernel allows.  Only the sleeping thread's
own wake-ups are affected.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "SleepStage",
    "WeightSleep",
    "sleep_seconds",
    "tight_timer_slack",
    "ChunkCosts",
    "measure_chunk_costs",
    "sleep_batch",
    "sleep_criterion",
    "sleep_overshoot",
    "actual_sleep",
]


_PR_SET_TIMERSLACK = 29
_slack = threading.local()


def tight_timer_slack() -> bool:
    """Set the calling thread's timer slack to 1 ns (Linux; once per thread).  True when it is set."""
    done = getattr(_slack, "done", None)
    if done is None:
        done = False
        if sys.platform.startswith("linux"):
            try:
                done = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(1), 0, 0, 0) == 0
            except (OSError, AttributeError):
                done = False
        _slack.done = done
    return bool(done)


def sleep_seconds(seconds: float) -> None:
    """Sleep ``seconds`` (nothing for zero or less), with the thread's timer slack at 1 ns."""
    if seconds > 0:
        tight_timer_slack()
        time.sleep(seconds)


class _InputPart(torch.autograd.Function):
    """Zeros shaped like ``x``; backward sleeps ``i_s`` seconds and returns zero gradients.

    The chunk's weight part is an input too, so the node runs in every backward,
    also on the first stage, whose input needs no gradient: B costs B on every
    stage, as the simulator assumes.  The weight part's gradient is zero.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, i_s: float) -> torch.Tensor:
        ctx.i_s = i_s
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        sleep_seconds(ctx.i_s)
        gx = torch.zeros_like(grad) if ctx.needs_input_grad[0] else None
        gw = torch.zeros(1, dtype=grad.dtype, device=grad.device) if ctx.needs_input_grad[1] else None
        return gx, gw, None


class WeightSleep(torch.autograd.Function):
    """A one-element weight broadcast to ``like``'s shape; its weight-gradient work sleeps ``w_s`` seconds.

    The runtime computes the gradient of a parameter behind a custom autograd
    function in the I pass (it cannot split such a function's graph), so the W
    sleep goes through the running pipeline's WeightGradStore, as the
    reference's zero-bubble linears do: deferred to the schedule's W action
    when the store is enabled, slept at once otherwise.  The weight's gradient
    is returned at once: zero, or with ``sum_grad`` the sum of the incoming
    gradient (the true gradient of the broadcast; the MoE chunks use it).
    """

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, like: torch.Tensor, w_s: float, sum_grad: bool = False) -> torch.Tensor:
        ctx.w_s = w_s
        ctx.sum_grad = sum_grad
        return weight.detach().expand_as(like).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        from dualpipe_kernels.runtime.zero_bubble import current_store

        w_s = ctx.w_s
        store = current_store()
        if store is not None and store.enabled:
            store.put(lambda: sleep_seconds(w_s))
        else:
            sleep_seconds(w_s)
        if ctx.sum_grad:
            return grad.sum().reshape(1), None, None, None
        return torch.zeros(1, dtype=grad.dtype, device=grad.device), None, None, None


class SleepStage(nn.Module):
    """One stage chunk: forward sleeps ``f_s``, input-gradient backward ``b_s - w_s``, weight-gradient ``w_s``.

    Input and output: one float32 tensor ``[rows, cols]`` (same shape; the output
    is a new tensor, never a view).  Under ``torch.no_grad()`` only the forward
    sleep runs.
    """

    def __init__(self, f_s: float, b_s: float, w_s: float) -> None:
        super().__init__()
        if min(f_s, b_s, w_s) < 0 or w_s > b_s:
            raise ValueError(f"sleep costs need F, B, W >= 0 and W <= B (seconds), got F={f_s} B={b_s} W={w_s}")
        self.f_s, self.i_s, self.w_s = float(f_s), float(b_s - w_s), float(w_s)
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sleep_seconds(self.f_s)
        if not torch.is_grad_enabled():
            return torch.zeros_like(x)
        # The weight part is one element (the weight itself), not a broadcast to x's shape joined to the
        # input part by an add: those were three activation-sized tensors per forward, which at 256 KiB
        # doubled a chunk's own CPU (64 chunk calls: 14-23 ms against 7-11 ms), host work a GPU's compute
        # would not do.
        return _InputPart.apply(x, WeightSleep.apply(self.weight, self.weight, self.w_s), self.i_s)


def sleep_batch(microbatches: int, activation_bytes: int, cols: int = 256) -> torch.Tensor:
    """A full batch whose every micro-batch is one float32 ``[rows, cols]`` block of about ``activation_bytes``.

    ``activation_bytes`` below one row (4 * cols bytes) gives one-element-wide
    rows: ``[microbatches, 1]`` (4 bytes per micro-batch), the "no data" case.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    if activation_bytes < 4 * cols:
        return torch.zeros(microbatches, 1)
    rows = int(activation_bytes) // (4 * cols)
    return torch.zeros(microbatches * rows, cols)


def sleep_criterion(out: torch.Tensor, *labels: torch.Tensor) -> torch.Tensor:
    """A scalar loss whose gradient reaches every element of ``out`` (labels are ignored)."""
    return out.mean()


def sleep_overshoot(seconds: float, repeats: int = 20) -> float:
    """Median of (measured - requested) over ``repeats`` calls of ``time.sleep(seconds)``, in seconds."""
    if seconds <= 0:
        return 0.0
    over = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sleep_seconds(seconds)
        over.append(time.perf_counter() - t0 - seconds)
    return statistics.median(over)


def actual_sleep(seconds: float, overshoot: float) -> float:
    """What a sleep of ``seconds`` really lasts given the measured ``overshoot`` (0 stays 0: no call is made)."""
    return seconds + overshoot if seconds > 0 else 0.0


@dataclass(frozen=True)
class ChunkCosts:
    """What one :class:`SleepStage` chunk really costs on this machine, in seconds (medians).

    ``f``: forward; ``i``: input-gradient backward with the weight part deferred;
    ``w``: the deferred weight part; ``b``: a full backward.  Each is the sleep
    plus its overshoot plus the stage's own tensor work (allocating and filling
    its outputs and gradients, autograd), timed alone in one process.
    """

    f: float
    i: float
    w: float
    b: float

    @classmethod
    def nominal(cls, f_s: float, b_s: float, w_s: float, overshoot_s: float = 0.0) -> ChunkCosts:
        """The requested sleeps plus what each ``time.sleep`` adds (F, I and W are one sleep each, B two)."""
        o = max(0.0, overshoot_s)
        return cls(f=f_s + o, i=b_s - w_s + o, w=w_s + o, b=b_s + 2 * o)

    def cost_model(self) -> Any:
        """The simulator's ``CostModel``: F, B = I + W (what a split backward costs), W; F&B = F + B."""
        from dualpipe_kernels.schedules.costs import CostModel

        return CostModel(f=self.f, b=self.i + self.w, w=self.w)


def measure_chunk_costs(
    f_s: float, b_s: float, w_s: float, activation_bytes: int, repeats: int = 7, cols: int = 256
) -> ChunkCosts:
    """Time a ``SleepStage(f_s, b_s, w_s)`` chunk alone on one micro-batch of ``activation_bytes``.

    This is "compute measured alone": a simulator fed these costs predicts the
    step time of a pipeline whose only extra work is communication and the
    runtime's own bookkeeping, so measured / simulated isolates that extra.
    The I/W split uses a bound ``WeightGradStore`` exactly as the runtime does.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    # One intra-op thread, as every rank runs: with torch's default (one per core) a 256 KiB zeros_like
    # can wait milliseconds at an OpenMP barrier for a descheduled worker thread, which measured the
    # chunks 10-50% slow on the 2-core machine and put the simulator above the measured steps.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure_chunk_costs(f_s, b_s, w_s, activation_bytes, repeats, cols)
    finally:
        torch.set_num_threads(threads)


def _measure_chunk_costs(
    f_s: float, b_s: float, w_s: float, activation_bytes: int, repeats: int, cols: int
) -> ChunkCosts:
    from dualpipe_kernels.runtime.zero_bubble import WeightGradStore

    stage = SleepStage(f_s, b_s, w_s)
    x = sleep_batch(1, activation_bytes, cols).requires_grad_(True)
    ts: dict[str, list[float]] = {"f": [], "i": [], "w": [], "b": []}
    store = WeightGradStore()
    for k in range(repeats + 1):  # the first round warms the allocator and autograd up
        t0 = time.perf_counter()
        y = stage(x)
        t1 = time.perf_counter()
        torch.autograd.backward([y], [torch.zeros_like(y)])
        t2 = time.perf_counter()
        y = stage(x)
        with store.bind():
            store.enabled = True
            t3 = time.perf_counter()
            torch.autograd.backward([y], [torch.zeros_like(y)])
            t4 = time.perf_counter()
            store.enabled = False
            store.flush(k)
        t5 = time.perf_counter()
        store.pop(k)
        t6 = time.perf_counter()
        if k:
            ts["f"].append(t1 - t0)
            ts["b"].append(t2 - t1)
            ts["i"].append(t4 - t3)
            ts["w"].append(t6 - t5)
    x.grad = None
    stage.weight.grad = None
    med = {k: statistics.median(v) for k, v in ts.items()}
    return ChunkCosts(f=med["f"], i=med["i"], w=med["w"], b=med["b"])
