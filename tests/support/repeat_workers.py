"""Rank functions for tests/process/test_repeat_steps.py (module level: spawned ranks import it by name)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from footprint import live_tensors_and_rss

from dualpipe_kernels.runtime.executor import Pipeline
from dualpipe_kernels.schedules.generators import build_schedule

#: the footprint (live tensors after a full collection, RSS) is taken after each step from this one on, in the
#: run with repeats only: the first steps allocate the pools and tables; a full collection costs ~70 ms a call
FOOTPRINT_FROM = 10


class NoRepeats(dict):  # type: ignore[type-arg]
    """A repeat table that never keeps an entry: every message takes the general protocol."""

    def __setitem__(self, key: object, value: object) -> None:
        return None


class Wide(torch.nn.Module):
    """An elementwise stage: ``tanh(x * w + b)`` over ``width`` features (large activations, few weights)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(width))
        self.b = torch.nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.w + self.b)


def _stages(sched: Any, rank: int, width: int = 8) -> dict[int, torch.nn.Module]:
    out: dict[int, torch.nn.Module] = {}
    for s in sched.stages_of_rank(rank):
        torch.manual_seed(100 + s)
        out[s] = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) if width == 8 else Wide(width)
    return out


def _transport(kind: str, inline_max_bytes: int | None) -> Any:
    if inline_max_bytes is None:
        return kind
    from dualpipe_kernels.transport.native import NativeTransport

    return NativeTransport(inline_max_bytes=inline_max_bytes, timeout_s=60.0)


def long_run(
    rank: int, world_size: int, steps: int, transport: str, width: int = 8, inline_max_bytes: int | None = None
) -> dict[str, Any]:
    """DualPipeV ``steps`` steps with and without repeats: losses, grads, pool/table sizes, live tensors, RSS.

    Live tensors and RSS (repeats on only) are those after each step from :data:`FOOTPRINT_FROM` on.

    ``width``: features per row (8: Linear stages; more: elementwise ones, so messages of 4 x width bytes);
    ``inline_max_bytes``: a native transport built with it (None: ``transport`` by name).
    """
    import dualpipe_kernels.runtime.boundary.repeat as repeat

    torch.use_deterministic_algorithms(True)
    sched = build_schedule("dualpipev", world_size, 8)
    out: dict[str, Any] = {}
    handed = [0]  # messages handed over (repeat._handed_over calls), counted per step below
    real = repeat._handed_over

    def counting(*args: Any) -> Any:
        handed[0] += 1
        return real(*args)

    repeat._handed_over = counting  # type: ignore[assignment]  # (this rank process only; put back below)
    try:
        _long_runs(rank, world_size, steps, transport, width, inline_max_bytes, sched, out, handed)
    finally:
        repeat._handed_over = real  # type: ignore[assignment]
    return out


def _long_runs(
    rank: int,
    world_size: int,
    steps: int,
    transport: str,
    width: int,
    inline_max_bytes: int | None,
    sched: Any,
    out: dict[str, Any],
    handed: list[int],
) -> None:
    """:func:`long_run`'s two runs (repeats off, then on), into ``out``."""
    for repeats in (False, True):
        modules = _stages(sched, rank, width)
        tr = _transport(transport, inline_max_bytes)
        pipe = Pipeline(sched, modules, transport=tr, timeout_s=60.0)
        mem = pipe._layouts
        out["inline_limit"] = mem.inline_max_bytes
        handovers: list[int] = []
        if not repeats:
            mem.repeat_send, mem.repeat_recv = NoRepeats(), NoRepeats()
        losses, tensors, rss, pool, entries = [], [], [], [], []
        try:
            for step in range(steps):
                g = torch.Generator().manual_seed(step % 3)
                x, label = torch.randn(8, width, generator=g), torch.randn(8, width, generator=g)
                handed[0] = 0
                res = pipe.step(x, labels=(label,), criterion=lambda y, t: F.mse_loss(y, t))
                handovers.append(handed[0])
                losses.append({mb: v.item() for mb, v in res.losses.items()})
                if step == 1:
                    out[f"grads/{repeats}"] = {
                        s: [p.grad.clone() for p in m.parameters()]
                        for s, m in modules.items()  # type: ignore[union-attr]
                    }
                if step == steps - 1:  # every message a repeat by then; as bytes, which no live-tensor count sees
                    out[f"grads_last/{repeats}"] = {
                        s: [p.grad.numpy().tobytes() for p in m.parameters()]  # type: ignore[union-attr]
                        for s, m in modules.items()
                    }
                for m in modules.values():
                    m.zero_grad(set_to_none=True)
                if repeats and step >= FOOTPRINT_FROM:
                    live, resident = live_tensors_and_rss()
                    tensors.append(live)
                    rss.append(resident)
                pool.append((mem.pool.allocations, mem.pool.free_bytes()))
                entries.append((len(mem.repeat_send), len(mem.repeat_recv)))
            out[f"{repeats}"] = {"losses": losses, "tensors": tensors, "rss": rss, "pool": pool, "entries": entries,
                                 "handovers": handovers}  # fmt: skip
        finally:
            pipe.close()
            if not isinstance(tr, str):
                tr.close()
        out[f"closed/{repeats}"] = (len(mem.repeat_send), len(mem.repeat_recv), mem.pool.free_bytes())
