"""A Pipeline over a transport that pairs transfers in posting order (NCCL's rule), exercised over gloo with
``ordered=True``: every rank posts each pair's messages in the order the lowered program gives both ends.

The gradients must equal those of the tag-matched torch transport on every schedule (bit for bit: the same
compute on the same bytes), and after the first step a step makes no store operation at all (counted with a
store that wraps the group's).
"""

from __future__ import annotations

from typing import Any

import torch

from dualpipe_kernels.runtime import spawn
from dualpipe_kernels.schedules import SCHEDULE_NAMES

STEPS = 3


def _run(rank: int, world: int, name: str, ordered: bool, counting: Any) -> dict[str, Any]:
    from torch import nn

    from dualpipe_kernels.runtime import Pipeline, WireOptions
    from dualpipe_kernels.schedules import build_schedule
    from dualpipe_kernels.transport.torch_dist import TorchDistTransport

    torch.manual_seed(0)
    schedule = build_schedule(name, world, 4)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(schedule.num_stages)])
    transport: Any = TorchDistTransport(timeout_s=30.0, ordered=True) if ordered else "torch"
    pipe = Pipeline.from_sequential(schedule, model, wire=WireOptions(transport=transport, timeout_s=30.0))
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
    store_ops = []
    losses = []
    for _ in range(STEPS):
        before = counting.ops
        res = pipe.step(x, labels=(y,), criterion=lambda out, t: ((out - t) ** 2).sum())
        store_ops.append(counting.ops - before)
        losses.append(None if res.loss is None else float(res.loss))
    with torch.no_grad():  # forward-only: no gradient messages on either side of a pair
        before = counting.ops
        out = pipe.step(x, labels=(y,), criterion=lambda out, t: ((out - t) ** 2).sum())
        store_ops.append(counting.ops - before)
        losses.append(None if out.loss is None else float(out.loss))
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    pipe.close()
    if ordered:
        transport.close()
    return {"grads": grads, "losses": losses, "store_ops": store_ops}


def _worker(rank: int, world: int) -> dict[str, Any]:
    from store_counting import count_group_stores

    counting = count_group_stores()
    return {
        name: {"ordered": _run(rank, world, name, True, counting), "tags": _run(rank, world, name, False, counting)}
        for name in SCHEDULE_NAMES
    }


def test_in_order_pipeline_matches_tag_matching_on_every_schedule_with_no_store_traffic_per_step() -> None:
    assert len(SCHEDULE_NAMES) == 7
    results = spawn(_worker, 2, timeout_s=600)
    for rank, per_schedule in enumerate(results):
        for name, runs in per_schedule.items():
            ordered, tags = runs["ordered"], runs["tags"]
            assert len(ordered["grads"]) == len(tags["grads"]) > 0, (name, rank)
            for g_o, g_t in zip(ordered["grads"], tags["grads"], strict=True):
                assert torch.equal(g_o, g_t), f"{name} rank {rank}: gradients differ from tag matching"
            assert ordered["losses"] == tags["losses"], (name, rank)
            # The first step may set up side channels; every later step makes no store operation at all.
            assert ordered["store_ops"][1:] == [0] * STEPS, (name, rank, ordered["store_ops"])
