"""No host read of a device wire's tensors on the message path: the real Pipeline over a strict CPU transport
that stands for a GPU wire (tests/support/strict_wire.py), on every schedule and every boundary format.

After the first step, a step must not read any tensor it posted to or received from the wire on the host
(``.tolist()``, ``.item()``, ``.cpu()``, ``.numpy()``, ``.to("cpu")``, ``bool()``...) nor synchronize a CUDA
stream, event or device: the headers of messages are host bytes on the host channel.  The gradients must equal
those of the plain torch transport (a host wire) bit for bit, so the strict wire carries the same bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from dualpipe_kernels.runtime import spawn
from dualpipe_kernels.schedules import SCHEDULE_NAMES

FORMATS = ("none", "packed", "bf16", "fp8")
STEPS = 3


def _run(rank: int, world: int, name: str, fmt: str, strict: bool, ordered: bool) -> dict[str, Any]:
    from strict_wire import HostReadGuard, StrictWire
    from torch import nn

    from dualpipe_kernels.runtime import Pipeline, WireOptions
    from dualpipe_kernels.schedules import build_schedule
    from dualpipe_kernels.transport.torch_dist import TorchDistTransport

    torch.manual_seed(0)
    schedule = build_schedule(name, world, 4)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(schedule.num_stages)])
    inner = TorchDistTransport(timeout_s=30.0, ordered=ordered)
    transport: Any = StrictWire(inner) if strict else inner
    pipe = Pipeline.from_sequential(
        schedule, model, wire=WireOptions(transport=transport, timeout_s=30.0, boundary_format=fmt)
    )
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    reads: list[list[str]] = []
    syncs: list[list[str]] = []
    error = None
    try:
        for step in range(STEPS):
            if step == 0 or not strict:
                pipe.step(x, labels=(y,), criterion=lambda out, t: ((out - t) ** 2).sum())
                continue
            guard = HostReadGuard(transport.registry)
            try:
                with guard:
                    pipe.step(x, labels=(y,), criterion=lambda out, t: ((out - t) ** 2).sum())
            finally:
                reads.append(guard.reads)
                syncs.append(guard.syncs)
    except Exception as exc:  # noqa: BLE001 - reported to the test with the reads seen
        error = f"{type(exc).__name__}: {exc}"
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    if error is None:
        pipe.close()
        transport.close()
    return {"grads": grads, "reads": reads, "syncs": syncs, "error": error}


def _worker(rank: int, world: int, cases: list[tuple[str, str, bool]]) -> dict[str, Any]:
    out = {}
    for name, fmt, ordered in cases:
        strict = _run(rank, world, name, fmt, True, ordered)
        out[f"{name}/{fmt}/{'ordered' if ordered else 'tags'}"] = {
            "strict": strict,
            "plain": _run(rank, world, name, fmt, False, False) if strict["error"] is None else None,
        }
    return out


def _check(results: list[dict[str, Any]]) -> None:
    problems = []
    for rank, per_case in enumerate(results):
        for case, runs in per_case.items():
            strict = runs["strict"]
            if strict["error"] is not None:
                problems.append(f"{case} rank {rank}: {strict['error']}")
                continue
            reads = [r for step in strict["reads"] for r in step]
            syncs = [s for step in strict["syncs"] for s in step]
            if reads or syncs:
                problems.append(f"{case} rank {rank}: host reads {reads[:3]}, synchronizes {syncs[:3]}")
            for g_s, g_p in zip(strict["grads"], runs["plain"]["grads"], strict=True):
                if not torch.equal(g_s, g_p):
                    problems.append(f"{case} rank {rank}: gradients differ from the host wire's")
                    break
    assert not problems, "\n".join(problems)


def test_host_read_free_message_path_on_a_device_wire_every_schedule_every_format() -> None:
    assert len(SCHEDULE_NAMES) == 7
    cases = [(name, fmt, False) for name in SCHEDULE_NAMES for fmt in FORMATS]
    _check(spawn(_worker, 2, cases, timeout_s=900))


def test_host_read_free_message_path_on_an_in_order_device_wire() -> None:
    """The same on a device wire that pairs transfers in posting order (NCCL's rule): DualPipeV, every format."""
    cases = [(name, fmt, True) for name in ("dualpipev", "1f1b") for fmt in FORMATS]
    _check(spawn(_worker, 2, cases, timeout_s=600))
