"""Measure each layer of a model on a sample micro-batch: the planner's ``--layers`` table.

Per layer (``nn.Sequential`` or a list of modules, run in order, each on the
previous one's output):

* ``f_s``: forward with autograd recording; ``b_s``: full backward
  (``torch.autograd.grad`` for the input and the parameters at once);
  ``w_s``: the parameters alone (the weight-gradient part, clamped to
  ``b_s``).  Each is the median of ``repeats`` rounds over all the
  layers after one warm-up round; CUDA is synchronised around every timed
  region.
* ``activation_bytes``: bytes autograd saves in the forward
  (``saved_tensors_hooks``), each storage counted once, parameters and
  buffers excluded (they are not per-micro-batch memory).
* ``param_bytes``: the layer's parameters; ``boundary_bytes``: its output.

Without a sample input, :func:`param_count_table` gives the fallback: time
proportional to the parameter count (F = n, B = 2n, W = n, unit ``params``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .layers import LayerCost, LayerTable

__all__ = ["profile_layers", "param_count_table", "saved_activation_bytes"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[..., Any], device: torch.device) -> tuple[float, Any]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def _nbytes(x: Any) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def saved_activation_bytes(layer: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes autograd saves running ``layer(x)`` (each storage once, parameters and buffers excluded)."""
    own = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in own:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    return sum(seen.values()), out


def _grad_input(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    return x.requires_grad_(True) if x.is_floating_point() else x


def _time_once(layer: nn.Module, x: torch.Tensor, device: torch.device) -> tuple[float, float, float]:
    """One forward, one full backward and one weight-only backward of ``layer`` on ``x``, timed."""
    params: list[torch.Tensor] = [p for p in layer.parameters() if p.requires_grad]
    inputs: list[torch.Tensor] = [x] if x.requires_grad else []
    tf, y = _timed(lambda: layer(x), device)
    grad_out = torch.ones_like(y)
    tb, _ = _timed(lambda: torch.autograd.grad(y, inputs + params, grad_out, retain_graph=True), device)
    tw = _timed(lambda: torch.autograd.grad(y, params, grad_out), device)[0] if params else 0.0
    return tf, tb, tw


def profile_layers(
    layers: nn.Sequential | Sequence[nn.Module],
    sample: torch.Tensor,
    repeats: int = 5,
    names: Sequence[str] | None = None,
) -> LayerTable:
    """Profile ``layers`` in order on ``sample`` (one micro-batch; its first dimension is the micro-batch size).

    The repeats go round the layers (every layer once per round), so a burst
    of load on the machine lands on all of them alike instead of inflating
    whichever layer it happened to meet.  The layers' parameters are not
    modified (gradients are returned, not accumulated into ``.grad``).
    """
    mods = list(layers)
    if not mods:
        raise ValueError("no layers to profile")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(names) if names is not None else [f"{i}:{type(m).__name__}" for i, m in enumerate(mods)]
    if len(names) != len(mods):
        raise ValueError(f"{len(names)} names for {len(mods)} layers")
    # the chain once: each layer's input, its saved bytes and its output
    xs, acts, outs = [], [], []
    x = _grad_input(sample)
    for name, layer in zip(names, mods, strict=True):
        act, y = saved_activation_bytes(layer, x)
        if not y.requires_grad:
            raise ValueError(f"layer {name!r}: its output does not require grad; nothing to profile for the backward")
        xs.append(x)
        acts.append(act)
        outs.append(_nbytes(y))
        x = _grad_input(y)
    device = sample.device
    runs: list[list[tuple[float, float, float]]] = [[] for _ in mods]
    for rep in range(repeats + 1):  # round 0 warms up and is dropped
        for k, layer in enumerate(mods):
            t = _time_once(layer, xs[k], device)
            if rep:
                runs[k].append(t)
    rows = []
    for k, layer in enumerate(mods):
        f, b, w = (statistics.median(col) for col in zip(*runs[k], strict=True))
        rows.append(
            LayerCost(
                name=names[k],
                f_s=f,
                b_s=b,
                w_s=min(w, b),
                activation_bytes=float(acts[k]),
                param_bytes=float(sum(_nbytes(p) for p in layer.parameters())),
                boundary_bytes=float(outs[k]),
            )
        )
    return LayerTable(tuple(rows), microbatch_size=int(sample.shape[0]) if sample.dim() else 1)


def param_count_table(layers: nn.Sequential | Sequence[nn.Module], names: Sequence[str] | None = None) -> LayerTable:
    """Fallback without a sample input: costs proportional to parameter count (unit ``params``)."""
    mods = list(layers)
    names = list(names) if names is not None else [f"{i}:{type(m).__name__}" for i, m in enumerate(mods)]
    rows = []
    for name, layer in zip(names, mods, strict=True):
        n = float(sum(p.numel() for p in layer.parameters()))
        nbytes = float(sum(_nbytes(p) for p in layer.parameters()))
        rows.append(LayerCost(name, n, 2 * n, n, 0.0, nbytes, 0.0))
    return LayerTable(tuple(rows), unit="params")
