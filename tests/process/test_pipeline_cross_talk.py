"""Two Pipelines on one process group keep their messages apart, on every transport.

The misuse: rank 0 steps p1 then p2, rank 1 steps p2 then p1.  With the same schedule and shapes, the
messages of one pipeline used to match the other's receives (same tags), and both steps "completed" with
wrong losses.  Now each pipeline has its own tags (and in-order channel), so a crossed order either works
(correct losses) or fails with a clear error that names both pipelines; never wrong numbers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dualpipe_kernels.runtime import spawn

MBS = 4
TIMEOUT_S = 4.0


def _model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2)])


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def _criterion(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _reference_loss(seed: int) -> float:
    """One process, the whole model: the mean over micro-batches of the per-micro-batch loss."""
    model = _model(seed)
    x, y = _data()
    with torch.no_grad():
        losses = [_criterion(model(xm), ym) for xm, ym in zip(x.chunk(MBS), y.chunk(MBS), strict=True)]
    return float(torch.stack(losses).double().mean())


def _crossed(rank: int, world: int, kind: str) -> dict[str, Any]:
    from dualpipe_kernels.runtime import Pipeline, WireOptions
    from dualpipe_kernels.schedules import build_schedule
    from dualpipe_kernels.transport.torch_dist import TorchDistTransport

    schedule = build_schedule("1f1b", world, MBS)
    transports: list[Any] = []
    pipes = []
    for seed in (1, 2):
        transport: Any = kind
        if kind == "ordered":
            transport = TorchDistTransport(timeout_s=TIMEOUT_S, ordered=True)
            transports.append(transport)
        pipes.append(Pipeline.from_sequential(
                schedule, _model(seed), wire=WireOptions(transport=transport, timeout_s=TIMEOUT_S)
            ))
    x, y = _data()
    order = [0, 1] if rank == 0 else [1, 0]
    losses: dict[int, float | None] = {}
    errors: list[str] = []
    for k in order:
        try:
            res = pipes[k].step(x, labels=(y,), criterion=_criterion)
        except Exception as exc:  # noqa: BLE001 - the test reads the message
            errors.append(f"{type(exc).__name__}: {exc}")
            break
        losses[k] = None if res.loss is None else float(res.loss)
    names = [f"pipeline #{getattr(p, 'channel', '?')}" for p in pipes]
    for p in pipes:
        p.close()
    for t in transports:
        t.close()
    return {"losses": losses, "errors": errors, "names": names}


@pytest.mark.parametrize("kind", ["torch", "ordered", "native"])
def test_two_pipelines_stepped_in_crossed_orders_never_give_wrong_losses(kind: str) -> None:
    if kind == "native":
        from dualpipe_kernels.transport import native_available

        assert native_available(), "the native engine must be built for this test (setup.py build_ext)"
    results = spawn(_crossed, 2, kind, timeout_s=300)
    want = {0: _reference_loss(1), 1: _reference_loss(2)}
    for rank, r in enumerate(results):
        for k, loss in r["losses"].items():
            if loss is not None:  # the loss stage is on the last rank
                assert loss == pytest.approx(want[k], rel=1e-6), (kind, rank, k, loss, want[k])
        for err in r["errors"]:
            # (1F1B crossed deadlocks: each rank waits for the other pipeline's messages, and says so)
            assert all(name in err for name in r["names"]), (kind, rank, err)
