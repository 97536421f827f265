"""Tests of the CUDA path of the native comm engine (``_C.cuda`` + ``CudaIpcTransport``).

The GPU tests (marked ``gpu``; skipped when no CUDA device is visible) run two
spawned processes on one GPU that talk over CUDA IPC in three set-ups:
device-memory rings with zero-copy sends from 256 KiB on ("ipc"), the same
with zero-copy off ("ipc-staged"), and pinned host rings ("host"); every payload is
compared bit for bit with the sender's, regenerated from the same seed.  Each
scenario runs on both ranks between store barriers and reports "ok" or a
traceback; one test per scenario asserts it.

The other tests run everywhere: the build has CUDA support whenever torch is
a CUDA build and nvcc exists, and without a GPU every entry point gives a
clear error rather than a crash.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dualpipe_kernels.transport.base import TransportError, TransportTimeout
from dualpipe_kernels.transport.cuda_ipc import CudaIpcTransport, native_cuda_module

HAS_GPU = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")

SLOT_BYTES = 64 * 1024  # small slots so that modest messages wrap the ring many times
NUM_SLOTS = 3
#: 0 B, 1 B, odd, exactly one slot, several slots' worth (wraps the 3-slot ring), 64 MiB
SIZES = [0, 1, 3, 4095, SLOT_BYTES, 5 * SLOT_BYTES + 17, (1 << 20) + 1, 64 << 20]
WAIT_S = 20.0
SPAWN_TIMEOUT_S = 90.0


# ---------------------------------------------------------------------------
# helpers used inside the spawned ranks
# ---------------------------------------------------------------------------


def _payload(nbytes: int, seed: int, dtype: torch.dtype = torch.uint8, device: str = "cuda:0") -> torch.Tensor:
    """Deterministic random bytes viewed as ``dtype`` (nbytes must be a multiple of its size)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).to(device)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads compare equal when their bits do)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8).cpu(), b.reshape(-1).view(torch.uint8).cpu()))


def _barrier(store: dist.Store, name: str, world: int = 2) -> None:
    if store.add(f"barrier/{name}", 1) == world:
        store.set(f"barrier/{name}/done", "1")
    store.wait([f"barrier/{name}/done"], timedelta(seconds=WAIT_S))


def _transfer(
    t: CudaIpcTransport, src: int, nbytes: int, seed: int, tag: int, dtype: torch.dtype = torch.uint8
) -> None:
    """src sends a payload to the other rank, which checks it bit for bit."""
    if t.rank == src:
        t.isend(_payload(nbytes, seed, dtype), 1 - src, tag, what=f"{nbytes} B").wait(WAIT_S)
    else:
        expected = _payload(nbytes, seed, dtype)
        buf = torch.full_like(expected.view(torch.uint8), 0xAB).view(dtype)
        t.irecv(buf, src, tag, what=f"{nbytes} B").wait(WAIT_S)
        assert _bits_equal(buf, expected), f"payload of {nbytes} bytes ({dtype}) from rank {src} differs"


# ---------------------------------------------------------------------------
# scenarios (run on both ranks)
# ---------------------------------------------------------------------------


def sc_sizes(t: CudaIpcTransport) -> None:
    for src in (0, 1):
        for i, n in enumerate(SIZES):
            _transfer(t, src, n, seed=1000 * src + i, tag=i)


def sc_dtypes(t: CudaIpcTransport) -> None:
    cases = [(torch.float32, 4 * 1001), (torch.bfloat16, 2 * 3), (torch.int64, 8 * 40_000), (torch.float16, 2 * 99_999)]
    for i, (dtype, nbytes) in enumerate(cases):
        _transfer(t, i % 2, nbytes, seed=77 + i, tag=10 + i, dtype=dtype)


def sc_many_in_flight(t: CudaIpcTransport) -> None:
    """Six messages each way in flight at once; receives waited in reverse order."""
    peer = 1 - t.rank
    sizes = [100, 70_000, 1, 200_000, 0, 5_000]
    sends = [t.isend(_payload(n, 500 + 10 * t.rank + i), peer, 100 + i) for i, n in enumerate(sizes)]
    bufs = [torch.zeros(n, dtype=torch.uint8, device="cuda:0") for n in sizes]
    recvs = [t.irecv(b, peer, 100 + i) for i, b in enumerate(bufs)]
    for i in reversed(range(len(sizes))):
        recvs[i].wait(WAIT_S)
        assert _bits_equal(bufs[i], _payload(sizes[i], 500 + 10 * peer + i)), f"message {i} differs"
    for h in sends:
        h.wait(WAIT_S)
        assert h.is_completed()


def sc_tags_out_of_order(t: CudaIpcTransport) -> None:
    """Receives posted in the reverse of the send order are matched by tag."""
    sizes = {201: 10, 202: 3 * SLOT_BYTES, 203: 1}
    if t.rank == 0:
        hs = [t.isend(_payload(n, tag), 1, tag) for tag, n in sizes.items()]
        for h in hs:
            h.wait(WAIT_S)
    else:
        bufs = {tag: torch.zeros(n, dtype=torch.uint8, device="cuda:0") for tag, n in sizes.items()}
        hs = {tag: t.irecv(bufs[tag], 0, tag) for tag in sorted(sizes, reverse=True)}
        for tag in sizes:
            hs[tag].wait(WAIT_S)
            assert _bits_equal(bufs[tag], _payload(sizes[tag], tag)), f"tag {tag} differs"


def sc_stream_order(t: CudaIpcTransport) -> None:
    """The send waits for its producer on the caller's stream; wait_stream orders the consumer without a host wait."""
    n = 1 << 20
    if t.rank == 0:
        x = torch.zeros(n, dtype=torch.float32, device="cuda:0")
        torch.cuda._sleep(100_000_000)  # keeps the current stream busy for tens of ms before the fill
        x.fill_(7.0)
        h = t.isend(x, 1, 400)
        h.wait_stream()
        x.fill_(-1.0)  # ordered after the send's copies by wait_stream
        h.wait(WAIT_S)
    else:
        buf = torch.zeros(n, dtype=torch.float32, device="cuda:0")
        h = t.irecv(buf, 0, 400)
        h.wait_stream()  # the consumer below runs after the copy, with no host wait for it
        total = (buf.double() * 2).sum()
        assert total.item() == 14.0 * n, f"consumer saw {total.item()}, expected {14.0 * n}"
        assert h.is_completed()


def sc_drop_early(t: CudaIpcTransport) -> None:
    """Dropping a send tensor right after isend never lets its memory be reused under the copy."""
    n = 4 * SLOT_BYTES
    if t.rank == 0:
        x = _payload(n, 900)
        h = t.isend(x, 1, 500)
        del x
        junk = [torch.full((n,), 0x55, dtype=torch.uint8, device="cuda:0") for _ in range(8)]
        h.wait(WAIT_S)
        del junk
    else:
        torch.cuda._sleep(50_000_000)  # the receive is posted while this stream is still busy
        buf = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
        t.irecv(buf, 0, 500).wait(WAIT_S)
        assert _bits_equal(buf, _payload(n, 900)), "payload was overwritten before it was sent"


def sc_many_allocations(t: CudaIpcTransport) -> None:
    """Sends from 40 separate allocations: zero-copy maps each one, more than the 32 kept mapped (LRU unmapping)."""
    n = 24 << 20  # large enough for the caching allocator to give each tensor its own segment
    if t.rank == 0:
        xs = [torch.full((n,), i % 251, dtype=torch.uint8, device="cuda:0") for i in range(40)]
        for i, x in enumerate(xs + xs[:3]):  # the first three again, after they were unmapped
            t.isend(x, 1, 600 + i).wait(WAIT_S)
    else:
        buf = torch.empty(n, dtype=torch.uint8, device="cuda:0")
        for i in range(43):
            t.irecv(buf, 0, 600 + i).wait(WAIT_S)
            assert bool((buf == (i % 40) % 251).all()), f"message {i} differs"


def sc_timeout(t: CudaIpcTransport) -> None:
    """A receive the peer never sends times out with a message naming rank, peer and transfer."""
    if t.rank == 1:
        h = t.irecv(torch.zeros(8, device="cuda:0"), 0, 999, what="never-sent")
        with pytest.raises(TransportTimeout, match=r"rank 1: receive from peer rank 0 \(tag 999, never-sent\)"):
            h.wait(timeout=0.3)
        assert not h.is_completed()


def sc_mismatch(t: CudaIpcTransport) -> None:
    """Size and dtype mismatches fail the receive clearly; the channel keeps working."""
    if t.rank == 0:
        for tag, x in [(300, torch.ones(16, device="cuda:0")), (301, torch.ones(16, device="cuda:0"))]:
            t.isend(x, 1, tag).wait(WAIT_S)
    else:
        with pytest.raises(TransportError, match="size/dtype mismatch.*expects 128 bytes of Float.*sent 64 bytes"):
            t.irecv(torch.zeros(32, device="cuda:0"), 0, 300).wait(WAIT_S)
        with pytest.raises(TransportError, match="expects 64 bytes of Int.*sent 64 bytes of Float"):
            t.irecv(torch.zeros(16, dtype=torch.int32, device="cuda:0"), 0, 301).wait(WAIT_S)
    _transfer(t, 0, 3 * SLOT_BYTES + 5, seed=302, tag=302)


def sc_bad_input(t: CudaIpcTransport) -> None:
    peer = 1 - t.rank
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        t.isend(torch.zeros(4), peer, 0)
    with pytest.raises(ValueError, match="contiguous"):
        t.irecv(torch.zeros(4, 4, device="cuda:0").t(), peer, 0)
    with pytest.raises(ValueError, match="not one of this transport's peers"):
        t.isend(torch.zeros(4, device="cuda:0"), 7, 0)


SCENARIOS: dict[str, Callable[[CudaIpcTransport], None]] = {
    "sizes": sc_sizes,
    "dtypes": sc_dtypes,
    "many_in_flight": sc_many_in_flight,
    "tags_out_of_order": sc_tags_out_of_order,
    "stream_order": sc_stream_order,
    "drop_early": sc_drop_early,
    "many_allocations": sc_many_allocations,
    "timeout": sc_timeout,
    "mismatch": sc_mismatch,
    "bad_input": sc_bad_input,
}


def _shm_entries(pid: int) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"dpk_cuda_{pid}_*"))


#: set-up name -> (staging, direct_min_bytes)
SETUPS = {"ipc": ("ipc", 256 * 1024), "ipc-staged": ("ipc", 0), "host": ("host", 256 * 1024)}


def _rank_main(rank: int, store_path: str, setup: str, out: Any) -> None:
    """One rank: run every scenario, then close and check that nothing is left in /dev/shm."""
    torch.set_num_threads(1)
    torch.cuda.set_device(0)
    results: dict[str, str] = {}
    staging, direct_min_bytes = SETUPS[setup]
    try:
        store = dist.FileStore(store_path, 2)
        t = CudaIpcTransport(
            rank=rank, world_size=2, store=store, device=0, num_slots=NUM_SLOTS, slot_bytes=SLOT_BYTES,
            staging=staging, direct_min_bytes=direct_min_bytes, timeout_s=WAIT_S,
        )  # fmt: skip
        results["staging"] = t.staging_with(1 - rank)
        for name, fn in SCENARIOS.items():
            _barrier(store, f"{setup}/{name}")
            try:
                fn(t)
                torch.cuda.synchronize()
                results[name] = "ok"
            except Exception:  # noqa: BLE001 - reported to the parent
                results[name] = traceback.format_exc()
        _barrier(store, f"{setup}/close")
        t.close()
        t.close()  # idempotent
        with pytest.raises(TransportError, match="closed"):
            t.isend(torch.zeros(1, device="cuda:0"), 1 - rank, 0)
        left = _shm_entries(os.getpid())
        results["close"] = "ok" if not left else f"left in /dev/shm: {left}"
    except Exception:  # noqa: BLE001
        results["setup"] = traceback.format_exc()
    out.put((rank, results))


def _kill_main(rank: int, store_path: str, setup: str, out: Any) -> None:
    """Rank 0 is SIGKILLed after the rendezvous; rank 1's receive must time out naming it, and close cleanly."""
    torch.set_num_threads(1)
    results: dict[str, str] = {}
    try:
        store = dist.FileStore(store_path, 2)
        t = CudaIpcTransport(rank=rank, world_size=2, store=store, device=0, staging=setup, timeout_s=5.0)
        _barrier(store, "kill/ready")
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        h = t.irecv(torch.zeros(1024, device="cuda:0"), 0, 1, what="from the killed rank")
        with pytest.raises(TransportTimeout, match="peer rank 0"):
            h.wait(timeout=2.0)
        t.close()
        results["kill"] = "ok"
    except Exception:  # noqa: BLE001
        results["kill"] = traceback.format_exc()
    out.put((rank, results))


def _spawn(target: Callable[..., None], tmp_path: Path, setup: str, expect: int) -> tuple[dict[int, dict], list[int]]:
    """Runs ``target`` on ranks 0 and 1; returns the results of the ``expect`` ranks that report, and the pids."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store_path = str(tmp_path / f"store-{setup}-{target.__name__}")
    procs = [ctx.Process(target=target, args=(r, store_path, setup, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    try:
        for _ in range(expect):
            rank, res = out.get(timeout=SPAWN_TIMEOUT_S)
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return results, [p.pid for p in procs if p.pid is not None]


@pytest.fixture(scope="module")
def ipc_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[int, dict]]:
    cache: dict[str, dict[int, dict]] = {}

    def get(setup: str) -> dict[int, dict]:
        if setup not in cache:
            cache[setup], _ = _spawn(_rank_main, tmp_path_factory.mktemp(setup), setup, expect=2)
        return cache[setup]

    return get


# ---------------------------------------------------------------------------
# GPU tests
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@requires_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("setup_name", list(SETUPS))
@pytest.mark.parametrize("scenario", ["setup", *SCENARIOS, "close"])
def test_two_processes_one_gpu(ipc_runs: Callable[[str], dict[int, dict]], setup_name: str, scenario: str) -> None:
    runs = ipc_runs(setup_name)
    assert sorted(runs) == [0, 1], f"ranks that reported: {sorted(runs)}"
    for rank in (0, 1):
        res = runs[rank]
        assert "setup" not in res, f"rank {rank} failed to set up:\n{res['setup']}"
        assert res["staging"] == SETUPS[setup_name][0]
        if scenario != "setup":
            assert res[scenario] == "ok", f"rank {rank}, scenario {scenario}:\n{res[scenario]}"


@pytest.mark.gpu
@requires_gpu
@pytest.mark.timeout(120)
def test_killed_peer_times_out_and_leaves_no_shm(tmp_path: Path) -> None:
    results, pids = _spawn(_kill_main, tmp_path, "auto", expect=1)
    assert results.get(1, {}).get("kill") == "ok", results
    for pid in pids:
        assert not _shm_entries(pid), f"/dev/shm entries of pid {pid} outlived it: {_shm_entries(pid)}"


# ---------------------------------------------------------------------------
# tests that run everywhere
# ---------------------------------------------------------------------------


def _cuda_toolkit_present() -> bool:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return Path(home, "bin", "nvcc").exists() or shutil.which("nvcc") is not None


def test_extension_built_with_cuda_when_toolkit_present() -> None:
    from dualpipe_kernels import _C

    assert _C.has_cuda() == hasattr(_C, "cuda"), "has_cuda() disagrees with the presence of _C.cuda"
    if torch.version.cuda is not None and _cuda_toolkit_present() and os.environ.get("DUALPIPE_KERNELS_CUDA") != "0":
        assert _C.has_cuda(), "torch is a CUDA build and nvcc exists, but _C was built without CUDA"
        assert _C.cuda.compiled_with_cuda is True
        assert _C.cuda.max_slots >= 2
        assert _C.cuda.runtime_version() >= 11000
        assert _C.build_info()["with_cuda"] is True


def test_engine_errors_name_the_call_without_a_gpu() -> None:
    from dualpipe_kernels import _C

    if not _C.has_cuda():
        with pytest.raises(TransportError, match="without CUDA support"):
            native_cuda_module()
        return
    mod = native_cuda_module()
    with pytest.raises(ValueError, match=r"num_slots must be in \[2, 16\]"):
        mod.IpcEngine(0, 0, num_slots=1)
    with pytest.raises(ValueError, match="staging must be"):
        mod.IpcEngine(0, 0, staging="nvlink")
    if mod.device_count() == 0:
        # no driver / no device: a RuntimeError naming the CUDA call, not a crash
        with pytest.raises(RuntimeError, match=r"^cudaGetDeviceCount failed: cudaError\w+"):
            mod.IpcEngine(0, 0)
    else:
        with pytest.raises(ValueError, match="out of range"):
            mod.IpcEngine(0, mod.device_count() + 3)


def test_transport_without_gpu_gives_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from dualpipe_kernels import _C

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    store = dist.HashStore()
    expected = "needs a CUDA device" if _C.has_cuda() else "without CUDA support"
    with pytest.raises(TransportError, match=expected):
        CudaIpcTransport(rank=0, world_size=2, store=store)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_slots": 1}, r"num_slots must be an int in \[2, 16\]"),
        ({"num_slots": 17}, r"num_slots must be an int in \[2, 16\]"),
        ({"slot_bytes": 1000}, "slot_bytes must be a positive multiple of 256"),
        ({"slot_bytes": 0}, "slot_bytes must be a positive multiple of 256"),
        ({"staging": "rdma"}, "staging must be one of"),
        ({"timeout_s": 0}, "timeout_s must be positive"),
        ({"direct_min_bytes": -1}, "direct_min_bytes must be an int >= 0"),
    ],
)
def test_transport_rejects_bad_options(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CudaIpcTransport(rank=0, world_size=2, store=dist.HashStore(), **kwargs)
