"""The NCCL ordering of the torch transport, exercised over gloo (``ordered=True``): tag semantics on top of a
backend that only pairs a pair's transfers in posting order.

In ordered mode every backend transfer uses the same tag, so gloo matches a
pair's transfers purely by posting order, exactly like NCCL: if the two ranks
posted a pair's transfers in different orders, sizes would mismatch (gloo
fails) or data would land in the wrong buffer (the checks below fail).  The
receivers post in orders unlike the senders' (reversed, late, both directions
at once, the same tag twice), which is what the runtime does.

Every check runs in one spawned pair (``spawn_checks``: one after another, the size mismatch last, as it leaves
the pair's gloo transfers failed), so the process start is paid once.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from spawn_checks import Check, results, run_checks

from dualpipe_kernels.runtime import spawn
from dualpipe_kernels.transport.base import TransportError
from dualpipe_kernels.transport.torch_dist import TorchDistTransport

# (tag, numel): rank 0 -> rank 1, in rank 0's posting order; sizes differ so a mismatched pairing shows
TO_ONE = [(5, 3), (3, 1000), (9, 17), (1, 4096), (5, 8)]  # tag 5 twice: received in order
TO_ZERO = [(7, 64), (2, 5), (7, 9)]
# The receivers' posting order: reversed and mixed, the first part before any data is sent, the rest after
# it arrived (the "early" path: staged, copied over when the receive comes).  Receives of one tag are FIFO,
# so the two tag-5 (tag-7) receives keep their message order, as the runtime's do.
RECV_ORDER = {1: ([3, 2, 0], [1, 4]), 0: ([1, 0], [2])}


def _payload(src: int, k: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) + 1000 * src + 100000 * k


def _ordered_worker(rank: int, world: int) -> list[str]:
    t = TorchDistTransport(timeout_s=30.0, ordered=True)
    assert t.ordered
    out, mine, theirs = [], (TO_ONE if rank == 0 else TO_ZERO), (TO_ZERO if rank == 0 else TO_ONE)
    peer = 1 - rank
    before, after = RECV_ORDER[rank]
    bufs = {k: torch.empty(n) for k, (_, n) in enumerate(theirs)}
    recv_handles = {k: t.irecv(bufs[k], peer, theirs[k][0], f"msg {k}") for k in before}
    sends = [t.isend(_payload(rank, k, n), peer, tag, f"msg {k}") for k, (tag, n) in enumerate(mine)]
    time.sleep(0.5)
    for k in after:
        recv_handles[k] = t.irecv(bufs[k], peer, theirs[k][0], f"msg {k}")
    for h in sends:
        h.wait()
    for k, h in recv_handles.items():
        h.wait()
        if not torch.equal(bufs[k], _payload(peer, k, theirs[k][1])):
            out.append(f"message {k} (tag {theirs[k][0]}) has wrong data")
    t.close()
    return out


def test_ordered_transfers_pair_up_whatever_order_receives_are_posted_in(checks: list[dict[str, Any]]) -> None:
    assert results(checks, "ordered") == [[], []]


def _polling_worker(rank: int, world: int) -> bool:
    t = TorchDistTransport(timeout_s=30.0, ordered=True)
    x = torch.full((256,), float(rank))
    got = torch.empty(256)
    r = t.irecv(got, 1 - rank, 4, "poll")
    s = t.isend(x, 1 - rank, 4, "poll")
    deadline = time.monotonic() + 20
    while not (r.is_completed() and s.is_completed()):  # polled, never waited first: the runtime's way
        assert time.monotonic() < deadline, "ordered transfer never reported completion"
        time.sleep(0.001)
    r.wait()
    t.close()
    return bool(torch.equal(got, torch.full((256,), float(1 - rank))))


def test_ordered_handles_report_completion_when_polled(checks: list[dict[str, Any]]) -> None:
    assert results(checks, "polling") == [True, True]


def _mismatch_worker(rank: int, world: int) -> str:
    t = TorchDistTransport(timeout_s=10.0, ordered=True)
    if rank == 0:
        t.isend(torch.ones(10), 1, 3, "ten floats").wait()
        msg = ""
    else:
        try:
            t.irecv(torch.empty(4), 0, 3, "four floats").wait()
            msg = "no error"
        except TransportError as exc:
            msg = str(exc)
    t.close()
    return msg


def test_a_size_mismatch_fails_the_receive_naming_the_tag(checks: list[dict[str, Any]]) -> None:
    _, msg = results(checks, "mismatch")
    assert "tag 3" in msg and "40 bytes" in msg and "16" in msg, msg


def _pipeline_worker(rank: int, world: int, ordered: bool) -> list[list[float]]:
    """Two DualPipeV steps of a small MLP; the gradients, as lists (identical whatever carried them)."""
    from torch import nn

    from dualpipe_kernels.runtime import Pipeline, WireOptions
    from dualpipe_kernels.schedules import build_schedule

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    transport: Any = TorchDistTransport(timeout_s=30.0, ordered=True) if ordered else "torch"
    pipe = Pipeline.from_sequential(
        build_schedule("dualpipev", world, 6), model, wire=WireOptions(transport, timeout_s=30.0)
    )
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        pipe.step(x, labels=(torch.zeros(12, 8),), criterion=lambda out, y: ((out - y) ** 2).sum())
    grads = [p.grad.flatten().tolist() for p in model.parameters() if p.grad is not None]
    pipe.close()
    if ordered:
        transport.close()
    return grads


def test_the_runtime_runs_over_ordered_transfers(checks: list[dict[str, Any]]) -> None:
    """Metadata ahead of data, speculative receives, both directions at once: same gradients as tag matching."""
    ordered = results(checks, "pipeline ordered")
    assert all(len(grads) == 4 for grads in ordered)  # each rank holds two stages: two weights, two biases
    assert ordered == results(checks, "pipeline tagged")


#: (name, worker, its extra arguments), in the order one pair runs them; the mismatch last
_CHECKS: tuple[Check, ...] = (
    ("ordered", _ordered_worker, ()),
    ("polling", _polling_worker, ()),
    ("pipeline ordered", _pipeline_worker, (True,)),
    ("pipeline tagged", _pipeline_worker, (False,)),
    ("mismatch", _mismatch_worker, ()),
)


@pytest.fixture(scope="module")
def checks() -> list[dict[str, Any]]:
    return spawn(run_checks, 2, _CHECKS, timeout_s=240)
