"""Per-peer transports on a real GPU (run by bench/device_check.sh's gpu step).

Three processes on GPU 0 with faked host ids (ranks 0 and 1 on "nodeA", rank 2
on "nodeB"): ``make_transport("native", device=cuda)`` must give CUDA IPC
between ranks 0 and 1 and the torch transport (gloo here, CUDA tensors staged
through the host) to rank 2, and every CUDA tensor must arrive intact.  With
two or more GPUs, the torch transport over NCCL (transfers sequenced per pair,
receives posted out of order) is checked too.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from dualpipe_kernels.runtime import spawn
from dualpipe_kernels.transport.hosts import HOST_ID_ENV

HAS_GPU = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
HOSTS = ["nodeA", "nodeA", "nodeB"]


def _routed_worker(rank: int, world: int) -> dict[str, Any]:
    from dualpipe_kernels.transport import make_transport

    os.environ[HOST_ID_ENV] = HOSTS[rank]
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    t = make_transport("native", None, dev, 20.0)
    peers = [p for p in range(world) if p != rank]
    bufs = {p: torch.empty(1 << 16, device=dev) for p in peers}
    recvs = [t.irecv(bufs[p], p, 5, f"from {p}") for p in peers]
    sends = [t.isend(torch.full((1 << 16,), float(rank), device=dev), p, 5, f"to {p}") for p in peers]
    for h in recvs + sends:
        h.wait()
    torch.cuda.synchronize(dev)
    out = {
        "routes": {p: type(t.transports[k]).__name__ for p, k in t.routes.items()},  # type: ignore[attr-defined]
        "ok": all(bool((bufs[p] == p).all()) for p in peers),
    }
    t.close()
    return out


@pytest.mark.gpu
@requires_gpu
@pytest.mark.timeout(30)
def test_same_host_gpu_peers_use_cuda_ipc_and_other_hosts_torch() -> None:
    res = spawn(_routed_worker, 3, timeout_s=25)
    assert [r["ok"] for r in res] == [True] * 3
    assert res[0]["routes"] == {1: "CudaIpcTransport", 2: "TorchDistTransport"}
    assert res[1]["routes"] == {0: "CudaIpcTransport", 2: "TorchDistTransport"}
    assert res[2]["routes"] == {0: "TorchDistTransport", 1: "TorchDistTransport"}


def _nccl_worker(rank: int, world: int) -> bool:
    from dualpipe_kernels.transport.torch_dist import TorchDistTransport

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    t = TorchDistTransport(device=dev, timeout_s=20.0)
    assert t.ordered
    peer = 1 - rank
    sizes = [3, 1000, 17, 1 << 20]
    bufs = [torch.empty(n, device=dev) for n in sizes]
    recvs = [t.irecv(bufs[k], peer, 10 + k, f"msg {k}") for k in reversed(range(len(sizes)))]  # out of order
    sends = [t.isend(torch.full((n,), float(rank * 100 + k), device=dev), peer, 10 + k) for k, n in enumerate(sizes)]
    for h in recvs + sends:
        h.wait()
    torch.cuda.synchronize(dev)
    t.close()
    return all(bool((bufs[k] == peer * 100 + k).all()) for k in range(len(sizes)))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (one rank per GPU)")
@pytest.mark.timeout(30)
def test_nccl_transfers_pair_up_with_out_of_order_receives() -> None:
    assert spawn(_nccl_worker, 2, backend="nccl", timeout_s=25) == [True, True]
