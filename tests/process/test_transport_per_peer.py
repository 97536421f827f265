"""Per-peer transport choice on GPUs (same host: CUDA IPC; other hosts: torch), driven on CPU with fake hosts.

No GPU here: the rule (``peer_routes``) is checked on fake host-id lists, the
router on recording transports, and the whole build (``make_transport``'s
GPU branch, ``_routed_by_host``) on three spawned gloo ranks whose host ids
are faked (``DUALPIPE_KERNELS_HOST_ID``) and whose CUDA IPC transport is
replaced by a CPU stand-in that records the peers it was built for.  The
same path on a real GPU runs in tests/process/test_transport_per_peer_gpu.py.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from dualpipe_kernels.runtime import spawn
from dualpipe_kernels.transport import Handle, Transport
from dualpipe_kernels.transport.hosts import HOST_ID_ENV
from dualpipe_kernels.transport.per_peer import RoutedTransport, peer_routes

HOSTS = ["nodeA", "nodeA", "nodeB"]  # group ranks 0 and 1 share a host; rank 2 is alone


def test_same_host_peers_get_the_native_transport_of_their_device() -> None:
    assert peer_routes(HOSTS, 0, "cuda") == {1: "cuda_ipc", 2: "torch"}
    assert peer_routes(HOSTS, 2, "cuda") == {0: "torch", 1: "torch"}
    assert peer_routes(HOSTS, 1, "cpu") == {0: "native", 2: "torch"}
    assert peer_routes(["h"] * 4, 3, "cuda") == {0: "cuda_ipc", 1: "cuda_ipc", 2: "cuda_ipc"}
    # A build without the engine for this device: everything through torch.
    assert peer_routes(HOSTS, 0, "cuda", native=False) == {1: "torch", 2: "torch"}
    # torchrun's two "nodes" on one machine are different hosts (hosts.py), so they take the torch path.
    assert peer_routes(["m/node0", "m/node0", "m/node1", "m/node1"], 1, "cuda") == {
        0: "cuda_ipc",
        2: "torch",
        3: "torch",
    }


def test_bad_inputs_name_the_problem() -> None:
    with pytest.raises(ValueError, match="rank 3 is not in a group of 3"):
        peer_routes(HOSTS, 3, "cuda")
    with pytest.raises(ValueError, match="no same-host transport for device type 'xpu'"):
        peer_routes(HOSTS, 0, "xpu")


class _Recording(Transport):
    def __init__(self, name: str) -> None:
        super().__init__(1.0)
        self.name, self.posts, self.closed = name, [], False

    @property
    def rank(self) -> int:
        return 0

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        self.posts.append(("send", peer, tag))
        return None  # type: ignore[return-value]

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        self.posts.append(("recv", peer, tag))
        return None  # type: ignore[return-value]

    def close(self) -> None:
        self.closed = True


def test_the_router_posts_each_peer_to_its_transport_and_closes_both() -> None:
    ipc, remote = _Recording("cuda_ipc"), _Recording("torch")
    t = RoutedTransport(0, peer_routes(HOSTS, 0, "cuda"), {"cuda_ipc": ipc, "torch": remote}, 5.0)
    assert t.name == "cuda_ipc" and t.local_peers == (1,)
    x = torch.zeros(2)
    t.isend(x, 1, 7)
    t.irecv(x, 2, 8)
    t.isend(x, 2, 9)
    assert ipc.posts == [("send", 1, 7)] and remote.posts == [("recv", 2, 8), ("send", 2, 9)]
    with pytest.raises(ValueError, match="peer 5 is not in this group"):
        t.isend(x, 5, 1, "5SEND_F0")
    t.close()
    assert ipc.closed and remote.closed
    with pytest.raises(ValueError, match=r"routes name transports \['cuda_ipc'\] that were not built"):
        RoutedTransport(0, {1: "cuda_ipc"}, {"torch": remote}, 5.0)


# ---- the GPU branch of make_transport, with CUDA IPC stood in for -------------------------------
def _fake_ipc(built: list[Any], works: bool):
    from dualpipe_kernels.transport.torch_dist import TorchDistTransport

    class FakeIpc(TorchDistTransport):
        name = "cuda_ipc"

    def cuda_ipc_or_none(group: Any, device: Any, timeout_s: float, peers: list[int] | None = None):
        built.append(sorted(peers or []))
        return FakeIpc(group, device=torch.device("cpu"), timeout_s=timeout_s) if works else None

    return cuda_ipc_or_none


def _routed_worker(rank: int, world: int, ipc_works: bool) -> dict[str, Any]:
    import dualpipe_kernels.transport as transport
    import dualpipe_kernels.transport.fallback as fallback

    os.environ[HOST_ID_ENV] = HOSTS[rank]
    built: list[Any] = []
    fallback.cuda_ipc_or_none = _fake_ipc(built, ipc_works)
    t = transport._routed_by_host("auto", None, torch.device("cpu"), 30.0)
    assert isinstance(t, RoutedTransport)
    # Everyone sends its rank to everyone; the payload checks that the routes pair up.
    peers = [p for p in range(world) if p != rank]
    bufs = {p: torch.empty(3) for p in peers}
    recvs = [t.irecv(bufs[p], p, 11, f"from {p}") for p in peers]
    sends = [t.isend(torch.full((3,), float(rank)), p, 11, f"to {p}") for p in peers]
    for h in recvs + sends:
        h.wait()
    out = {
        "routes": {p: type(t.transports[k]).__name__ for p, k in t.routes.items()},
        "ipc_peers": built,
        "local_peers": list(t.local_peers),
        "data_ok": all(torch.equal(bufs[p], torch.full((3,), float(p))) for p in peers),
    }
    t.close()
    return out


def test_make_transport_on_gpus_routes_by_host() -> None:
    res = spawn(_routed_worker, 3, True, timeout_s=180)
    assert [r["data_ok"] for r in res] == [True] * 3
    assert res[0]["routes"] == {1: "FakeIpc", 2: "TorchDistTransport"}
    assert res[1]["routes"] == {0: "FakeIpc", 2: "TorchDistTransport"}
    assert res[2]["routes"] == {0: "TorchDistTransport", 1: "TorchDistTransport"}
    # CUDA IPC is built for same-host peers only; the lone rank still takes part in the (collective) vote.
    assert [r["ipc_peers"] for r in res] == [[[1]], [[0]], [[]]]
    assert [r["local_peers"] for r in res] == [[1], [0], []]


def test_when_cuda_ipc_fails_every_peer_goes_through_torch() -> None:
    res = spawn(_routed_worker, 3, False, timeout_s=180)
    assert [r["data_ok"] for r in res] == [True] * 3
    assert all(set(r["routes"].values()) == {"TorchDistTransport"} for r in res)
    assert [r["local_peers"] for r in res] == [[], [], []]
