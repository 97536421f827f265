"""Rank functions for tests/test_repeat_steps.py (module level: spawned ranks import it; tests/ is on sys.path)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from footprint import live_tensors_and_rss

from dualpipe_kernels.runtime.executor import Pipeline
from dualpipe_kernels.schedules.generators import build_schedule


class NoRepeats(dict):  # type: ignore[type-arg]
    """A repeat table that never keeps an entry: every message takes the general protocol."""

    def __setitem__(self, key: object, value: object) -> None:
        return None


def _stages(sched: Any, rank: int) -> dict[int, torch.nn.Module]:
    out = {}
    for s in sched.stages_of_rank(rank):
        torch.manual_seed(100 + s)
        out[s] = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    return out


def long_run(rank: int, world_size: int, steps: int, transport: str) -> dict[str, Any]:
    """DualPipeV ``steps`` steps with and without repeats: losses, grads, pool/table sizes, live tensors, RSS."""
    torch.use_deterministic_algorithms(True)
    sched = build_schedule("dualpipev", world_size, 8)
    out: dict[str, Any] = {}
    for repeats in (False, True):
        modules = _stages(sched, rank)
        pipe = Pipeline(sched, modules, transport=transport, timeout_s=60.0)
        mem = pipe._layouts
        if not repeats:
            mem.repeat_send, mem.repeat_recv = NoRepeats(), NoRepeats()
        losses, tensors, rss, pool, entries = [], [], [], [], []
        try:
            for step in range(steps):
                g = torch.Generator().manual_seed(step % 3)
                x, label = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
                res = pipe.step(x, labels=(label,), criterion=lambda y, t: F.mse_loss(y, t))
                losses.append({mb: v.item() for mb, v in res.losses.items()})
                if step == 1:
                    out[f"grads/{repeats}"] = {
                        s: [p.grad.clone() for p in m.parameters()]
                        for s, m in modules.items()  # type: ignore[union-attr]
                    }
                for m in modules.values():
                    m.zero_grad(set_to_none=True)
                live, resident = live_tensors_and_rss()
                tensors.append(live)
                rss.append(resident)
                pool.append((mem.pool.allocations, mem.pool.free_bytes()))
                entries.append((len(mem.repeat_send), len(mem.repeat_recv)))
            out[f"{repeats}"] = {"losses": losses, "tensors": tensors, "rss": rss, "pool": pool, "entries": entries}
        finally:
            pipe.close()
        out[f"closed/{repeats}"] = (len(mem.repeat_send), len(mem.repeat_recv), mem.pool.free_bytes())
    return out
