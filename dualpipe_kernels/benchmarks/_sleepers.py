"""Sleep-timed synthetic stages for the benchmark suites (fallback until benchmarks.sleep_stages lands).

A stage's forward sleeps F seconds, its input-gradient backward sleeps I = B - W
and its weight-gradient backward sleeps W, so ranks that share a small CPU do
not compete for it and the simulator's cost model is known exactly.  The two
backward halves are separate autograd nodes (``out = input_path(x) +
weight_path(w)``), so both this package's I/W split and
torch.distributed.pipelining's (``stage_backward_input`` /
``stage_backward_weight``) run them separately.

Activations are ``[rows, cols]`` float32 tensors whose per-micro-batch size is
set by the caller; values are zeros (their content does not matter here).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

__all__ = ["SleepStage", "sleep_batch", "sleep_criterion"]


class _InputPath(torch.autograd.Function):
    """Identity-shaped map whose backward sleeps ``i_s`` seconds (the I part)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, i_s: float) -> torch.Tensor:  # type: ignore[override]
        ctx.i_s = i_s
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        if ctx.i_s > 0:
            time.sleep(ctx.i_s)
        return torch.zeros_like(g), None


class _WeightPath(torch.autograd.Function):
    """Broadcast of a one-element weight whose backward sleeps ``w_s`` seconds (the W part)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, like: torch.Tensor, w_s: float) -> torch.Tensor:  # type: ignore[override]
        ctx.w_s = w_s
        return w.detach().expand_as(like).clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        if ctx.w_s > 0:
            time.sleep(ctx.w_s)
        return torch.zeros(1, dtype=g.dtype, device=g.device), None, None


class SleepStage(nn.Module):
    """One stage chunk whose F, I and W sleep ``f_s``, ``b_s - w_s`` and ``w_s`` seconds.

    Input and output: one float32 tensor ``[rows, cols]`` (same shape); the
    output is a new tensor (never a view of the input).
    """

    def __init__(self, f_s: float, b_s: float, w_s: float) -> None:
        super().__init__()
        if min(f_s, b_s, w_s) < 0 or w_s > b_s:
            raise ValueError(f"sleep costs need F, B, W >= 0 and W <= B, got F={f_s} B={b_s} W={w_s}")
        self.f_s, self.i_s, self.w_s = float(f_s), float(b_s - w_s), float(w_s)
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.f_s > 0:
            time.sleep(self.f_s)
        if not torch.is_grad_enabled():
            return torch.zeros_like(x)
        return _InputPath.apply(x, self.i_s) + _WeightPath.apply(self.weight, x, self.w_s)


def sleep_batch(microbatches: int, activation_bytes: int, cols: int = 256) -> torch.Tensor:
    """A full batch whose every micro-batch is one ``[rows, cols]`` float32 block of about ``activation_bytes``."""
    rows = max(1, int(activation_bytes) // (4 * cols))
    return torch.zeros(microbatches * rows, cols)


def sleep_criterion(out: torch.Tensor, *labels: torch.Tensor) -> torch.Tensor:
    """A scalar loss whose gradient reaches every element of ``out`` (labels ignored)."""
    return out.mean()
