"""Worker code of tests/process/test_runtime_boundary_format.py (spawned ranks; importable by name).

``packed_vs_none``: every schedule on 2 ranks, over the torch and native
transports, each run with ``boundary_format`` "none" and "packed": a boundary
of three tensors (hidden with grad, int ids, a float mask without grad),
micro-batches of different sizes, two steps whose shapes differ (speculative
receives, then placeholders).  ``gpt_formats``: the demo's small GPT trained
with "none", "bf16" and "fp8" boundaries; losses per step and the bytes each
rank sent per direction.  ``all_runs``: both in one group of processes (a
process start costs seconds, a run milliseconds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

DIM = 8
VOCAB = 11


class MixStage(nn.Module):
    """``(x [b, DIM] float, ids [b] int64, mask [b, DIM] float) -> (tanh(linear(x) + emb(ids)) * mask, ids, mask)``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.linear = nn.Linear(DIM, DIM)
        self.emb = nn.Embedding(VOCAB, DIM)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.tanh(self.linear(x) + self.emb(ids)) * mask, ids, mask


def _mix_loss(y: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((y - label) ** 2).mean() + ids.float().mean() * 0.0


def _microbatches(n: int, step: int) -> tuple[list[tuple[torch.Tensor, ...]], list[tuple[torch.Tensor]]]:
    """Micro-batch inputs and labels; rows differ between micro-batches and between steps."""
    gen = torch.Generator().manual_seed(100 + step)
    inputs, labels = [], []
    for mb in range(n):
        rows = 2 + (mb + 2 * step) % 3
        x = torch.randn(rows, DIM, generator=gen)
        ids = torch.randint(0, VOCAB, (rows,), generator=gen)
        mask = (torch.rand(rows, DIM, generator=gen) > 0.2).float() * 0.75
        inputs.append((x, ids, mask))
        labels.append((torch.randn(rows, DIM, generator=gen),))
    return inputs, labels


def _run_mix(schedule: Any, rank: int, transport: Any, fmt: str, timeout_s: float) -> dict[str, Any]:
    from dualpipe_kernels.runtime import Pipeline

    mine = schedule.stages_of_rank(rank)
    modules = {s: MixStage(schedule.model_stage[s]) for s in mine}
    n = schedule.num_microbatches
    first = any(schedule.path(m)[0] in mine for m in range(n))
    last = any(schedule.path(m)[-1] in mine for m in range(n))
    pipe = Pipeline(schedule, modules, transport=transport, timeout_s=timeout_s, boundary_format=fmt)
    losses = []
    try:
        for step in range(2):
            mbs, labels = _microbatches(n, step)
            res = pipe.step(
                microbatches=mbs if first else None,
                microbatch_labels=labels if last else None,
                criterion=_mix_loss,
            )
            losses.append({int(m): v.detach() for m, v in res.losses.items()})
        sent = pipe.boundary_bytes()
        fmt_attr = str(pipe.boundary_format)
    finally:
        pipe.close()
    grads = {s: [None if p.grad is None else p.grad.clone() for p in m.parameters()] for s, m in modules.items()}
    return {"losses": losses, "grads": grads, "sent": sent, "format": fmt_attr}


def packed_vs_none(
    rank: int, world_size: int, schedules: Sequence[str], transports: Sequence[str], timeout_s: float
) -> dict[tuple[str, str, str], dict[str, Any]]:
    from dualpipe_kernels.schedules import build_schedule
    from dualpipe_kernels.transport import make_transport

    out = {}
    for kind in transports:
        transport = make_transport(kind, None, torch.device("cpu"), timeout_s)
        try:
            for name in schedules:
                schedule = build_schedule(name, world_size, 4)
                for fmt in ("none", "packed"):
                    out[(name, kind, fmt)] = _run_mix(schedule, rank, transport, fmt, timeout_s)
        finally:
            transport.close()
    return out


def gpt_formats(
    rank: int, world_size: int, formats: Sequence[str], steps: int, timeout_s: float
) -> dict[str, dict[str, Any]]:
    """The demo's GPT on dualpipev, trained ``steps`` steps per format from the same start and data."""
    from dualpipe_kernels.demo_data import SyntheticTokens
    from dualpipe_kernels.models.gpt import GPTConfig, gpt_loss, stage_modules_for
    from dualpipe_kernels.runtime import Pipeline
    from dualpipe_kernels.schedules import build_schedule

    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=32, n_heads=2, n_layers=4, mlp_ratio=2)
    schedule = build_schedule("dualpipev", world_size, 4)
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=0)
    out = {}
    for fmt in formats:
        modules = stage_modules_for(schedule, cfg, seed=0, rank=rank)
        opt = torch.optim.AdamW([p for m in modules.values() for p in m.parameters()], lr=3e-3, weight_decay=0.0)
        pipe = Pipeline(schedule, modules, transport="native", timeout_s=timeout_s, boundary_format=fmt)
        losses = []
        try:
            for step in range(steps):
                ids, tgt = data.batch(step, 4 * 2)
                res = pipe.step(ids, labels=(tgt,), criterion=gpt_loss)
                if res.losses:
                    losses.append(float(torch.stack(list(res.losses.values())).mean()))
                opt.step()
                opt.zero_grad(set_to_none=True)
            out[fmt] = {"losses": losses, "sent": pipe.boundary_bytes()}
        finally:
            pipe.close()
    return out


def compat_formats(rank: int, world_size: int, timeout_s: float) -> dict[str, Any]:
    """compat DualPipeV with ``boundary_format`` "none" and "packed": losses and gradients of one step."""
    from dualpipe_kernels.compat import DualPipeV

    out = {}
    for fmt in ("none", "packed"):
        mods = [MixStage(rank), MixStage(2 * world_size - 1 - rank)]
        model = DualPipeV(mods, boundary_format=fmt, timeout_s=timeout_s)
        try:
            if rank == 0:
                (mbs, labels) = _microbatches(1, 0)
                x, ids, mask = (torch.cat([t] * 4) for t in mbs[0])
                loss, _ = model.step(
                    x, ids, mask, num_chunks=4, criterion=_mix_loss, labels=(torch.cat([labels[0][0]] * 4),)
                )
            else:
                loss, _ = model.step(num_chunks=4)
        finally:
            model.close()
        grads = [None if p.grad is None else p.grad.clone() for m in mods for p in m.parameters()]
        out[fmt] = {"loss": loss, "grads": grads, "format": str(model.boundary_format)}
    return out


def all_runs(
    rank: int, world_size: int, schedules: Sequence[str], transports: Sequence[str], steps: int, timeout_s: float
) -> dict[str, Any]:
    """``{"packed": packed_vs_none(...), "gpt": gpt_formats(none, bf16, fp8), "compat": compat_formats(...)}``."""
    return {
        "packed": packed_vs_none(rank, world_size, schedules, transports, timeout_s),
        "gpt": gpt_formats(rank, world_size, ("none", "bf16", "fp8"), steps, timeout_s),
        "compat": compat_formats(rank, world_size, timeout_s),
    }
