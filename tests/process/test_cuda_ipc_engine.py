"""The CUDA IPC engine's fixes for the first GPU run, and its sweep of stale segments.

CPU tests (run everywhere): a zombie peer counts as dead; the stale sweep removes
segments of both engines (and the names older CUDA builds used); the engine's
"CUDA IPC not possible here" error is a RuntimeError a caller can catch.

GPU tests (marked ``gpu``; skipped without a CUDA device): two spawned ranks on
one GPU check that a view at a non-zero offset goes zero-copy (the engine's
counters say so), that small rings (3 x 64 KiB) carry data exactly while torch
allocates around them, and that closing one rank long before the other frees
everything without leaking or waiting out the timeout. The engine's host protocol
behind these is unit-tested over a fake device in csrc/tests/test_ipc_engine.cpp.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dualpipe_kernels import _C
from dualpipe_kernels.runtime.launch import spawn
from dualpipe_kernels.transport.cuda_ipc import CudaIpcTransport

HAS_GPU = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
WAIT_S = 20.0
SPAWN_TIMEOUT_S = 120.0


# ---------------------------------------------------------------------------
# CPU: liveness, sweep, error type
# ---------------------------------------------------------------------------


def _dead_pid() -> int:
    """The pid of a child that has exited and been reaped."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_zombie_peer_counts_as_dead() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10.0
        reason = _C.process_dead_reason(pid)
        while not reason and time.monotonic() < deadline:  # not reaped: a zombie once it has exited
            time.sleep(0.005)
            reason = _C.process_dead_reason(pid)
        assert reason == "exited (zombie)"
        assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    finally:
        os.waitpid(pid, 0)
    assert _C.process_dead_reason(pid) == "exited"
    assert _C.process_dead_reason(os.getpid()) == ""


def test_sweep_removes_dead_segments_of_both_engines() -> None:
    pid = _dead_pid()
    names = [f"dpk-{pid}-abc-ring-0to1", f"dpk-{pid}-abc-cuda-0to1", f"dpk_cuda_{pid}_0to1_abc"]
    for n in names:
        Path("/dev/shm", n).write_bytes(b"x")
    listed = set(_C.shm.list_segments())
    assert all(n in listed for n in names if Path("/dev/shm", n).exists()), "every name of ours is listed"
    _C.shm.sweep_stale_segments()
    assert not any(Path("/dev/shm", n).exists() for n in names)


def test_ipc_unavailable_error_is_a_runtime_error() -> None:
    assert issubclass(_C.IpcUnavailableError, RuntimeError)


# ---------------------------------------------------------------------------
# GPU: two spawned ranks
# ---------------------------------------------------------------------------


def _transport(rank: int, store: dist.Store, **kw: Any) -> CudaIpcTransport:
    opts: dict[str, Any] = {"num_slots": 3, "slot_bytes": 64 << 10, "direct_min_bytes": 256 << 10}
    opts.update(kw)
    return CudaIpcTransport(rank=rank, world_size=2, store=store, device=0, timeout_s=WAIT_S, **opts)


def _payload(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to("cuda:0")


def sc_view_at_offset(rank: int, store: dist.Store) -> dict[str, Any]:
    t = _transport(rank, store, staging="ipc")
    n, offset = 2 << 20, 12345
    if rank == 0:
        block = torch.zeros(offset + n + 777, dtype=torch.uint8, device="cuda:0")
        view = block[offset : offset + n]
        view.copy_(_payload(n, 5))
        h = t.isend(view, 1, 1)
        h.wait(WAIT_S)
        out = {"zero_copy": bool(h._op.zero_copy), "stats": t.stats()}
    else:
        buf = torch.empty(n, dtype=torch.uint8, device="cuda:0")
        t.irecv(buf, 0, 1).wait(WAIT_S)
        out = {"equal": bool(torch.equal(buf, _payload(n, 5))), "stats": t.stats()}
    dist.barrier()
    t.close()
    return out


def sc_small_rings(rank: int, store: dist.Store) -> dict[str, Any]:
    t = _transport(rank, store, staging="ipc", direct_min_bytes=0)
    keep = [torch.empty(k * 4096 + 512, device="cuda:0") for k in range(1, 40)]  # small blocks all around
    ok = True
    for i, n in enumerate([1, 4095, 64 << 10, (5 << 16) + 17, 1 << 20]):
        x = _payload(n, 100 + i)
        if rank == 0:
            t.isend(x, 1, i).wait(WAIT_S)
        else:
            buf = torch.empty(n, dtype=torch.uint8, device="cuda:0")
            t.irecv(buf, 0, i).wait(WAIT_S)
            ok &= bool(torch.equal(buf, x))
        keep.append(torch.empty(777 * (i + 1), device="cuda:0"))
    t.close()
    return {"equal": ok, "staging": "ipc"}


def sc_teardown_order(rank: int, store: dist.Store) -> dict[str, Any]:
    t = _transport(rank, store, staging="ipc")
    x = _payload(1 << 20, 9)
    if rank == 0:
        t.isend(x, 1, 1).wait(WAIT_S)
    else:
        buf = torch.empty_like(x)
        t.irecv(buf, 0, 1).wait(WAIT_S)
    if rank == 1:
        time.sleep(2.0)  # rank 0 closes first, while rank 1 still maps its ring
    engine = t._engine  # kept to read its counters after close
    start = time.monotonic()
    t.close()
    return {"close_s": time.monotonic() - start, "leaked": engine.stats()["exports_leaked"]}


def _rank_main(rank: int, world_size: int, name: str) -> dict[str, Any]:
    torch.cuda.set_device(0)
    return SCENARIOS[name](rank, dist.distributed_c10d._get_default_store())


SCENARIOS: dict[str, Callable[[int, dist.Store], dict[str, Any]]] = {
    "view_at_offset": sc_view_at_offset,
    "small_rings": sc_small_rings,
    "teardown_order": sc_teardown_order,
}


def _spawn(name: str) -> list[dict[str, Any]]:
    return spawn(_rank_main, 2, name, timeout_s=SPAWN_TIMEOUT_S, pg_timeout_s=60)


@requires_gpu
@pytest.mark.gpu
def test_view_at_offset_goes_zero_copy() -> None:
    r = _spawn("view_at_offset")
    assert r[1]["equal"]
    assert r[0]["zero_copy"], f"a view at offset 12345 must go zero-copy: {r[0]['stats']}"
    assert r[0]["stats"]["zero_copy_sends"] == 1 and r[0]["stats"]["staged_sends"] == 0
    assert r[1]["stats"]["zero_copy_recvs"] == 1


@requires_gpu
@pytest.mark.gpu
def test_small_rings_carry_data_exactly() -> None:
    r = _spawn("small_rings")
    assert r[1]["equal"]


@requires_gpu
@pytest.mark.gpu
def test_closing_one_rank_first_waits_only_for_its_peer() -> None:
    r = _spawn("teardown_order")
    assert r[0]["close_s"] < 15.0, "rank 0 waits for rank 1 to detach (about 2 s), not the full timeout"
    assert r[1]["close_s"] < 5.0, "rank 0 already detached: rank 1 frees at once"
    assert r[0]["leaked"] == 0 and r[1]["leaked"] == 0, "nothing leaked when both detach in time"
