"""What transport="auto" gives each peer (transport/auto.py), without a GPU: the rule over fake device kinds,
host layouts and group backends, the debug line that says which transport each peer got and why, and
``make_transport("auto")`` building what the rule picks (a one-process gloo group, host ids stood in for)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dualpipe_kernels.transport import auto, make_transport, native_available, per_peer
from dualpipe_kernels.transport.auto import AUTO_BUILDS, CUDA_IPC_OFF_REASON, auto_routes, auto_transport, log_routes
from dualpipe_kernels.transport.hosts import host_id

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


# ---- what make_transport("auto") builds is what the rule picks ---------------------------------------------


def _pick(hosts: list[str], device_type: str, **kw: bool) -> str:
    return auto_transport(hosts, 0, device_type, "nccl" if device_type == "cuda" else "gloo", **kw)[0]


def test_the_rule_picks_one_transport_for_the_whole_group() -> None:
    assert _pick(TWO_HOSTS, "cpu", native_built=True, cuda_ipc_allowed=False) == "native"
    # no shared host: the engine still (it sends other-host peers through torch), as every rank decides
    assert _pick(["a", "b", "c"], "cpu", native_built=True, cuda_ipc_allowed=False) == "native"
    assert _pick(TWO_HOSTS, "cpu", native_built=False, cuda_ipc_allowed=False) == "torch"
    assert _pick(["a"], "cpu", native_built=True, cuda_ipc_allowed=False) == "native"  # one rank: its own host
    assert _pick(TWO_HOSTS, "cuda", native_built=True, cuda_ipc_allowed=False) == "torch"  # NCCL in program order
    assert _pick(["a", "a"], "cuda", native_built=True, cuda_ipc_allowed=True) == "cuda_ipc"
    assert _pick(TWO_HOSTS, "cuda", native_built=True, cuda_ipc_allowed=True) == "routed"
    assert _pick(["a", "b"], "cuda", native_built=True, cuda_ipc_allowed=True) == "torch"  # no same-host peer
    # a rank with no same-host peer decides as the others do (the engines' set-up is collective)
    kind, routes = auto_transport(["a", "a", "b"], 2, "cpu", "gloo", native_built=True, cuda_ipc_allowed=False)
    assert kind == "native" and {r.kind for r in routes.values()} == {"gloo"}
    assert set(AUTO_BUILDS) == {"native", "torch", "cuda_ipc", "routed"}


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A one-process gloo group (the default group), destroyed afterwards."""
    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _build_auto(monkeypatch: pytest.MonkeyPatch, hosts: list[str]) -> tuple[str, str]:
    """make_transport("auto") on CPU with the host exchange answering ``hosts``: (what the rule picks, what was
    built)."""
    monkeypatch.setattr(per_peer, "exchange_hosts", lambda group, rank, world, host, timeout_s: list(hosts))
    picked = auto_transport(hosts, 0, "cpu", "gloo", native_built=native_available("cpu"), cuda_ipc_allowed=False)
    built = make_transport("auto", None, torch.device("cpu"), 10.0)
    try:
        return picked[0], built.name
    finally:
        built.close()


def test_make_transport_builds_what_the_rule_picks(one_rank_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = "native" if native_available("cpu") else "torch"
    assert _build_auto(monkeypatch, ["a"]) == (engine, engine)
    assert _build_auto(monkeypatch, ["a", "b"]) == (engine, engine)  # the engine routes the other host itself


def test_make_transport_follows_the_rule_not_a_rule_of_its_own(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    asked: list[tuple[str, ...]] = []

    def rule(hosts: Sequence[str], rank: int, device_type: str, backend: str, **kw: bool) -> tuple[str, dict]:
        asked.append((*hosts, device_type, backend))
        return "torch", auto_routes(hosts, rank, device_type, backend, **kw)

    monkeypatch.setattr(auto, "auto_transport", rule)
    with caplog.at_level(logging.DEBUG, logger="dualpipe_kernels.transport"):
        t = make_transport("auto", None, torch.device("cpu"), 10.0)
    try:
        assert t.name == "torch" and asked == [(host_id(), "cpu", "gloo")]
    finally:
        t.close()
    with pytest.raises(ValueError, match=r"picked 'carrier pigeon'; make_transport builds one of"):
        monkeypatch.setattr(auto, "auto_transport", lambda *a, **kw: ("carrier pigeon", {}))
        make_transport("auto", None, torch.device("cpu"), 10.0)
