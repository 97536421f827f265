"""Training runs of a one-rank, two-stage pipeline with and without per-chunk graphs (tests/unit/test_graphs*.py).

The model: stage 0 ``Linear(8, 16) -> GELU``, stage 1 ``Linear(16, 4)``, mean-squared-error loss, SGD.
One process (a gloo group of one), so every boundary is a same-rank handoff and nothing is sent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from dualpipe_kernels.runtime import GraphOptions, Pipeline
from dualpipe_kernels.runtime.graph_capture import Capturer, capturing_with
from dualpipe_kernels.schedules.generators import build_schedule

IN, HID, OUT = 8, 16, 4


def two_stage_modules(device: str = "cpu", stage0: Callable[[], nn.Module] | None = None) -> dict[int, nn.Module]:
    torch.manual_seed(0)
    first = stage0() if stage0 is not None else nn.Sequential(nn.Linear(IN, HID), nn.GELU())
    return {0: first.to(device), 1: nn.Sequential(nn.Linear(HID, OUT)).to(device)}


def batches(rows: Sequence[int], device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(r, IN, generator=g).to(device), torch.randn(r, OUT, generator=g).to(device)) for r in rows]


@dataclass
class Run:
    pipe: Pipeline
    losses: list[torch.Tensor]
    params: list[torch.Tensor]


def train(
    schedule_name: str = "interleaved1f1b",
    graphs: GraphOptions | None = None,
    rows: Sequence[int] = (8, 8, 8),
    capturer: Capturer | None = None,
    device: str = "cpu",
    stage0: Callable[[], nn.Module] | None = None,
    microbatches: int = 4,
    **pipeline_kw: Any,
) -> Run:
    """Train ``len(rows)`` steps (batch ``rows[i]`` rows at step i); losses per step and the final parameters."""
    schedule = build_schedule(schedule_name, 1, microbatches, 2 if schedule_name == "interleaved1f1b" else None)
    mods = two_stage_modules(device, stage0)
    ctx = capturing_with(capturer) if capturer is not None else contextlib.nullcontext()
    with ctx:
        pipe = Pipeline(schedule, mods, transport="torch", timeout_s=10, graphs=graphs, **pipeline_kw)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    try:
        for x, y in batches(rows, device):
            opt.zero_grad()
            res = pipe.step(x, labels=[y], criterion=nn.functional.mse_loss)
            opt.step()
            losses.append(torch.stack([res.losses[m] for m in sorted(res.losses)]))
    finally:
        pipe.close()
    return Run(pipe, losses, [p.detach().clone() for p in pipe.parameters()])


def same_training(a: Run, b: Run) -> bool:
    """Bit for bit: every step's losses and the final parameters."""
    return all(torch.equal(x, y) for x, y in zip(a.losses, b.losses, strict=True)) and all(
        torch.equal(x, y) for x, y in zip(a.params, b.params, strict=True)
    )


def ranks_worker(rank: int, world: int, schedule_name: str, dp: bool) -> dict[str, Any]:
    """One rank of a ``world``-rank pipeline (one Linear(8, 8) + GELU per stage; ``dp``: a 2 x 2 PP x DP
    grid instead, each replica its own batch), trained 3 steps eager and with graphs through
    ``RerunCapture``: whether the two trained bit for bit alike, and the graph status."""
    import torch.distributed as dist
    from graph_capturers import RerunCapture

    pp = world // 2 if dp else world
    pp_rank, replica = rank % pp, rank // pp
    pp_groups = [dist.new_group([r * pp + i for i in range(pp)]) for r in range(world // pp)]
    dp_groups = [dist.new_group([i + r * pp for r in range(world // pp)]) for i in range(pp)]
    group, dp_group = pp_groups[replica], (dp_groups[pp_rank] if dp else None)
    schedule = build_schedule(schedule_name, pp, 4)

    def run(graphs: GraphOptions | None) -> Run:
        mods = {}
        for s in schedule.stages_of_rank(pp_rank):
            torch.manual_seed(100 + s)
            mods[s] = nn.Sequential(nn.Linear(IN, IN), nn.GELU())
        with capturing_with(RerunCapture()):
            pipe = Pipeline(schedule, mods, group, transport="torch", timeout_s=20, graphs=graphs, dp_group=dp_group)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(7 + replica)
        losses = []
        for _ in range(3):
            x, y = torch.randn(8, IN, generator=g), torch.randn(8, IN, generator=g)
            opt.zero_grad()
            res = pipe.step(x, labels=[y], criterion=nn.functional.mse_loss)
            opt.step()
            losses.append(torch.stack([res.losses[m] for m in sorted(res.losses)]) if res.losses else torch.zeros(0))
        pipe.close()
        return Run(pipe, losses, [p.detach().clone() for p in pipe.parameters()])

    eager, graphed = run(None), run(GraphOptions(enabled=True, warmup_iters=1))
    return {
        "same": same_training(graphed, eager),
        "states": {s: st.state for s, st in graphed.pipe.graph_status.items()},
        "replays": {s: dict(st.replays) for s, st in graphed.pipe.graph_status.items()},
        "eager_calls": sum(sum(st.eager_calls.values()) for st in graphed.pipe.graph_status.values()),
    }
