"""Rank functions of the memory-policy tests (module level so spawned workers import them by name).

``policy_runs`` trains the same model under every memory policy for every
schedule in one spawned group and returns, per (schedule, policy), the losses
and gradients of each step and the peak resident saved bytes per step; the
parent compares policies with ``keep``.  The stage model has a dropout (the
recompute must replay the same mask), a residual and a view of an activation
saved by autograd (offload must move a storage once).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from footprint import live_tensors_and_rss

DIM = 32
ROWS = 4  # per micro-batch


class DropStage(nn.Module):
    """x [b, DIM] -> x + fc2(dropout(gelu(fc1(x))))[:, :DIM] (fc2 is wider, so a slice of its output is saved)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, 2 * DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(F.gelu(self.fc1(x)), p=0.25, training=True)
        y = self.fc2(h)
        return x + torch.tanh(y[:, :DIM]) * torch.sigmoid(y[:, DIM:])


def _schedule(name: str, ranks: int, microbatches: int) -> Any:
    from dualpipe_kernels.schedules.generators import build_schedule

    return build_schedule(name, ranks, microbatches)


def _stages(schedule: Any, rank: int) -> dict[int, nn.Module]:
    out = {}
    for s in schedule.stages_of_rank(rank):
        torch.manual_seed(100 + schedule.model_stage[s])
        out[s] = DropStage()
    return out


def _batch(n: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(n * ROWS, DIM, generator=g), torch.randn(n * ROWS, DIM, generator=g)


def _policy(name: str) -> Any:
    from dualpipe_kernels.runtime.memory_plan import MemoryPolicy

    pol = MemoryPolicy.parse(name)
    # Tiny test tensors: move everything but parameters and stage inputs.
    return MemoryPolicy(pol.kind, pol.fmt, min_bytes=0, lookahead=pol.lookahead)


def train(
    rank: int, schedule: Any, policy: str, steps: int, zero_bubble: str = "split", timeout_s: float = 30.0
) -> dict[str, Any]:
    """``steps`` training steps (SGD between them) under ``policy``; losses, grads, peaks, arena counters."""
    from dualpipe_kernels.runtime.executor import Pipeline

    modules = _stages(schedule, rank)
    pipe = Pipeline(
        schedule,
        modules,
        transport="torch",
        timeout_s=timeout_s,
        memory_policy=_policy(policy),
        zero_bubble=zero_bubble,
    )
    pipe.activation_memory.track = True  # keep's peak too
    losses, grads = [], []
    try:
        for step in range(steps):
            torch.manual_seed(1234 + step)  # the dropout masks: same on every policy
            x, label = _batch(schedule.num_microbatches, step)
            res = pipe.step(x, labels=(label,), criterion=lambda y, t: F.mse_loss(y, t))
            losses.append({m: v.item() for m, v in sorted(res.losses.items())})
            grads.append({f"{s}.{n}": p.grad.clone() for s, m in modules.items() for n, p in m.named_parameters()})
            with torch.no_grad():
                for m in modules.values():
                    for p in m.parameters():
                        p -= 0.05 * p.grad
                        p.grad = None
    finally:
        pipe.close()
    mem = pipe.activation_memory
    return {
        "losses": losses,
        "grads": grads,
        "peaks": list(mem.peaks),
        "host_bytes": list(mem.host_bytes),
        "arena_allocations": mem.arena.allocations,
        "memory_policy": dict(pipe.memory_policy),
    }


def policy_runs(rank: int, world_size: int, cases: Sequence[tuple[str, int, str, str]], steps: int) -> dict[str, Any]:
    """Rank function: ``cases`` = (schedule, microbatches, policy, zero_bubble); results by ``schedule/policy/zb``."""
    torch.use_deterministic_algorithms(True)
    out: dict[str, Any] = {}
    for name, n, policy, zb in cases:
        sched = _schedule(name, world_size, n)
        out[f"{name}/{policy}/{zb}"] = train(rank, sched, policy, steps, zb)
        dist.barrier()
    return out


def long_offload(rank: int, world_size: int, steps: int, policy: str = "offload") -> dict[str, Any]:
    """``steps`` DualPipeV steps with offload: arena allocations, live tensors and RSS every step."""
    from dualpipe_kernels.runtime.executor import Pipeline

    sched = _schedule("dualpipev", world_size, 8)
    modules = _stages(sched, rank)
    pipe = Pipeline(sched, modules, transport="torch", timeout_s=30.0, memory_policy=_policy(policy))
    pipe.activation_memory.track = True
    tensors, rss = [], []
    try:
        for step in range(steps):
            x, label = _batch(8, step % 3)
            pipe.step(x, labels=(label,), criterion=lambda y, t: F.mse_loss(y, t))
            for m in modules.values():
                m.zero_grad(set_to_none=True)
            live, resident = live_tensors_and_rss()
            tensors.append(live)
            rss.append(resident)
    finally:
        pipe.close()
    mem = pipe.activation_memory
    return {
        "arena_allocations": mem.arena.allocations,
        "arena_bytes": mem.arena.capacity,
        "peaks": list(mem.peaks),
        "tensors": tensors,
        "rss": rss,
    }


def gpt_losses(rank: int, world_size: int, policies: Sequence[str], steps: int) -> dict[str, list[float]]:
    """The demo GPT (small) trained ``steps`` AdamW steps on DualPipeV under each policy; mean loss per step."""
    from dualpipe_kernels.demo_data import SyntheticTokens
    from dualpipe_kernels.models.gpt import GPTConfig, gpt_loss, stage_modules_for
    from dualpipe_kernels.runtime.executor import Pipeline

    n = 4
    sched = _schedule("dualpipev", world_size, n)
    gcfg = GPTConfig(seq_len=8, d_model=16, n_heads=2, n_layers=4)
    out: dict[str, list[float]] = {}
    for policy in policies:
        modules = stage_modules_for(sched, gcfg, 0, rank)
        opt = torch.optim.AdamW([p for m in modules.values() for p in m.parameters()], lr=3e-3, weight_decay=0.0)
        data = SyntheticTokens(gcfg.vocab_size, gcfg.seq_len, 0)
        pipe = Pipeline(sched, modules, transport="torch", timeout_s=30.0, memory_policy=policy)
        losses = []
        try:
            for step in range(steps):
                ids, tgt = data.batch(step, n * 2)
                res = pipe.step(ids, labels=(tgt,), criterion=gpt_loss)
                total = torch.zeros(())
                for v in res.losses.values():
                    total += v
                dist.all_reduce(total)
                losses.append(total.item() / n)
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            pipe.close()
        out[policy] = losses
    return out


def all_checks(
    rank: int, world_size: int, cases: Sequence[tuple[str, int, str, str]], gpt_steps: int, long_steps: int
) -> dict[str, Any]:
    """Every check of tests/process/test_memory_policies.py in one spawned group (process start costs seconds)."""
    return {
        "policies": policy_runs(rank, world_size, cases, steps=2),
        "gpt": gpt_losses(rank, world_size, ["keep", "compress:fp8", "offload:fp8"], gpt_steps),
        "long": long_offload(rank, world_size, long_steps),
    }


def _lane_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("dualpipe-offload", "dualpipe-reload"))]


def _threads_and_fds() -> tuple[int, int]:
    """(OS threads, open file descriptors) of this process."""
    import os

    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def soak(rank: int, world_size: int, policies: Sequence[str], steps: int, every: int) -> dict[str, Any]:
    """``steps`` GPipe steps of 3 micro-batches (SGD between them: cheap steps, and each rank offloads its
    first micro-batch) under each policy in turn, one pipeline each, closed after; every ``every``
    steps: RSS, live tensors, OS threads and fds; also after the pipeline's close."""
    from dualpipe_kernels.runtime.executor import Pipeline

    sched = _schedule("gpipe", world_size, 3)
    out: dict[str, Any] = {}
    for policy in policies:
        modules = _stages(sched, rank)
        pipe = Pipeline(sched, modules, transport="torch", timeout_s=30.0, memory_policy=_policy(policy))
        samples = []
        lane_threads: list[str] = []
        try:
            for step in range(steps):
                torch.manual_seed(step)
                x, label = _batch(3, step % 5)
                pipe.step(x, labels=(label,), criterion=lambda y, t: F.mse_loss(y, t))
                with torch.no_grad():
                    for m in modules.values():
                        for p in m.parameters():
                            p -= 1e-3 * p.grad
                            p.grad = None
                if step == 0:
                    lane_threads = _lane_threads()
                if (step + 1) % every == 0:
                    tensors, rss = live_tensors_and_rss()
                    samples.append((step + 1, rss, tensors, *_threads_and_fds()))
        finally:
            pipe.close()
        mem = pipe.activation_memory
        out[policy] = {
            "samples": samples,
            "history": len(mem.peaks),
            "lane_threads_running": lane_threads,
            "lane_threads_after_close": _lane_threads(),
            "packs": mem.offload_packs,
        }
        del pipe, modules, mem
        dist.barrier()
    return out
