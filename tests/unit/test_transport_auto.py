"""What transport="auto" gives each peer (transport/auto.py), without a GPU: the rule over fake device kinds,
host layouts and group backends, and the debug line that says which transport each peer got and why."""

from __future__ import annotations

import logging

import pytest

from dualpipe_kernels.transport.auto import CUDA_IPC_OFF_REASON, auto_routes, log_routes

TWO_HOSTS = ["a", "a", "b", "b"]  # ranks 0, 1 on host a; 2, 3 on host b


def _kinds(**kw: object) -> dict[int, str]:
    return {p: r.kind for p, r in auto_routes(TWO_HOSTS, 0, **kw).items()}  # type: ignore[arg-type]


def test_cpu_peers_on_this_host_get_the_native_engine_the_others_gloo() -> None:
    assert _kinds(device_type="cpu", backend="gloo", native_built=True, cuda_ipc_allowed=False) == {
        1: "native", 2: "gloo", 3: "gloo"
    }  # fmt: skip
    assert _kinds(device_type="cpu", backend="gloo", native_built=False, cuda_ipc_allowed=False) == {
        1: "gloo", 2: "gloo", 3: "gloo"
    }  # fmt: skip


def test_gpu_peers_over_nccl_in_program_order_until_cuda_ipc_is_allowed() -> None:
    routes = auto_routes(TWO_HOSTS, 0, "cuda", "nccl", native_built=True, cuda_ipc_allowed=False)
    assert {p: r.kind for p, r in routes.items()} == {1: "nccl", 2: "nccl", 3: "nccl"}
    assert CUDA_IPC_OFF_REASON in routes[1].reason  # the same-host peer says why not CUDA IPC
    assert "another host" in routes[2].reason and "program's order" in routes[2].reason
    allowed = _kinds(device_type="cuda", backend="nccl", native_built=True, cuda_ipc_allowed=True)
    assert allowed == {1: "cuda_ipc", 2: "nccl", 3: "nccl"}


def test_gpu_over_a_gloo_group_is_staged_and_says_it_is_the_slow_path() -> None:
    routes = auto_routes(TWO_HOSTS, 2, "cuda", "gloo", native_built=True, cuda_ipc_allowed=True)
    assert {p: r.kind for p, r in routes.items()} == {0: "gloo_staged", 1: "gloo_staged", 3: "cuda_ipc"}
    assert "pinned" in routes[0].reason and "NCCL group" in routes[0].reason


def test_bad_inputs_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="rank 4 is not in a group of 4"):
        auto_routes(TWO_HOSTS, 4, "cpu", "gloo", native_built=True, cuda_ipc_allowed=False)
    with pytest.raises(ValueError, match="serves cpu and cuda"):
        auto_routes(TWO_HOSTS, 0, "xpu", "gloo", native_built=True, cuda_ipc_allowed=False)


def test_the_debug_line_names_each_peer_its_transport_and_why(caplog: pytest.LogCaptureFixture) -> None:
    routes = auto_routes(TWO_HOSTS, 0, "cuda", "nccl", native_built=True, cuda_ipc_allowed=False)
    with caplog.at_level(logging.DEBUG, logger="dualpipe_kernels.transport"):
        log_routes(0, routes)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert lines[0].startswith("rank 0 -> peer rank 1: nccl (same host, but the CUDA IPC engine is off")
    assert lines[1].startswith("rank 0 -> peer rank 2: nccl (another host (b)")
