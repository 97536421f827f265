"""Tests of the CPU shared-memory engine through ``NativeTransport`` between two spawned processes.

Every scenario runs on both ranks of ONE spawned group (process start costs
seconds, a scenario milliseconds); each rank reports "ok" or its traceback per
scenario, and one test per scenario asserts it.  Payloads are random bytes
regenerated from a seed on the receiver and compared bit for bit.  The kill
test has its own group: rank 0 kills itself in the middle of a 64 MiB transfer,
and rank 1 must fail promptly with an error naming it.  Afterwards no
``/dev/shm`` segment created by either process may remain.

Large messages take the single-copy path (the receiver reads the sender's
tensor with process_vm_readv) when the attach-time probe permits it; the size
scenarios run once with it allowed and once with it off (the ring path), and
the kill test kills a ring sender mid-transfer and a single-copy sender whose
descriptor is waiting to be read.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from scenarios import check_scenario, run_scenarios

from dualpipe_kernels.runtime.launch import spawn, spawn_outcomes
from dualpipe_kernels.transport.base import TransportError, TransportTimeout
from dualpipe_kernels.transport.native import SINGLE_COPY_ENV, NativeTransport, load_engine_module

SLOT_BYTES = 64 * 1024
NUM_SLOTS = 3  # an odd count so that chunk indices wrap the ring at shifting offsets
#: 0 B, 1 B, odd, exactly one slot, one slot + 1, several slots' worth (wraps the ring), 1 MiB + 1, 64 MiB
SIZES = [0, 1, 3, 4095, SLOT_BYTES, SLOT_BYTES + 1, 5 * SLOT_BYTES + 17, (1 << 20) + 1, 64 << 20]
WAIT_S = 30.0
SINGLE_COPY_MIN = 256 * 1024
#: around the single-copy threshold, and far above it
SINGLE_COPY_SIZES = [SINGLE_COPY_MIN - 1, SINGLE_COPY_MIN, SINGLE_COPY_MIN + 1, 3 * SINGLE_COPY_MIN + 5, 64 << 20]


def _payload(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _transport(single_copy: bool | None = None) -> NativeTransport:
    return NativeTransport(
        timeout_s=WAIT_S,
        num_slots=NUM_SLOTS,
        slot_bytes=SLOT_BYTES,
        single_copy=single_copy,
        single_copy_min_bytes=SINGLE_COPY_MIN,
    )


def _cross_memory_attach_expected() -> bool:
    """Whether process_vm_readv between two sibling processes must work here: root, or Yama ptrace_scope 0/absent."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read().strip())
    except (OSError, ValueError):
        scope = 0
    return os.geteuid() == 0 or scope == 0


# ---------------------------------------------------------------- scenarios (run on both ranks)


def _sizes_both_directions(rank: int) -> None:
    """Every size, both directions at once; typed views so the dtype check sees real dtypes."""
    peer = 1 - rank
    with _transport() as t:
        for i, n in enumerate(SIZES):
            dtype = torch.float32 if n % 4 == 0 else torch.uint8
            src = _payload(n, seed=1000 * rank + i).view(dtype)
            dst = torch.empty(n, dtype=torch.uint8).view(dtype)
            r = t.irecv(dst, peer, tag=i, what=f"size {n}")
            s = t.isend(src, peer, tag=i, what=f"size {n}")
            s.wait()
            r.wait()
            assert torch.equal(dst.view(torch.uint8), _payload(n, seed=1000 * peer + i)), f"payload of {n} B differs"


def _single_copy_sizes(rank: int, single_copy: bool) -> None:
    """Sizes around the single-copy threshold and 64 MiB, both directions at once, bit for bit, on one path."""
    peer = 1 - rank
    with _transport(single_copy=single_copy) as t:
        if not single_copy:
            assert t.single_copy_peers() == (), t.single_copy_peers()
        elif _cross_memory_attach_expected():
            assert t.single_copy_peers() == (peer,), "the probe should have allowed process_vm_readv here"
        for i, n in enumerate(SINGLE_COPY_SIZES):
            src = _payload(n, seed=7000 * rank + i)
            dst = torch.empty(n, dtype=torch.uint8)
            r = t.irecv(dst, peer, tag=i, what=f"size {n}")
            s = t.isend(src, peer, tag=i, what=f"size {n}")
            s.wait()
            r.wait()
            assert torch.equal(dst, _payload(n, seed=7000 * peer + i)), f"payload of {n} B differs"


def _single_copy_env_off(rank: int) -> None:
    """DUALPIPE_KERNELS_SINGLE_COPY=0 turns the path off (on both ranks here); messages still arrive."""
    old = os.environ.get(SINGLE_COPY_ENV)
    os.environ[SINGLE_COPY_ENV] = "0"
    try:
        t = _transport()
    finally:
        if old is None:
            del os.environ[SINGLE_COPY_ENV]
        else:
            os.environ[SINGLE_COPY_ENV] = old
    with t:
        assert t.single_copy_peers() == ()
        n = 2 * SINGLE_COPY_MIN + 3
        dst = torch.empty(n, dtype=torch.uint8)
        r = t.irecv(dst, 1 - rank, tag=3)
        t.isend(_payload(n, seed=rank), 1 - rank, tag=3).wait()
        r.wait()
        assert torch.equal(dst, _payload(n, seed=1 - rank))


def _single_copy_mismatch(rank: int) -> None:
    """A size mismatch on the single-copy path: the receive tensor is untouched and the waiting sender fails."""
    n = 2 * SINGLE_COPY_MIN
    with _transport(single_copy=True) as t:
        if rank == 0:
            with pytest.raises(TransportError, match="receiver reported"):
                t.isend(_payload(n, seed=3), 1, tag=5, what="big send").wait(10.0)
        else:
            dst = torch.full((n + 8,), 9, dtype=torch.uint8)
            with pytest.raises(TransportError, match="size mismatch") as ei:
                t.irecv(dst, 0, tag=5, what="big recv").wait(10.0)
            assert "big recv" in str(ei.value) and f"{n} B" in str(ei.value), str(ei.value)
            assert bool((dst == 9).all()), "a mismatched receive wrote into the tensor"
        dist.barrier()


def _many_in_flight_out_of_order_waits(rank: int) -> None:
    """40 messages each way posted before any wait; waits in reverse, then shuffled order."""
    peer = 1 - rank
    sizes = [(k * 7919) % (3 * SLOT_BYTES) + k for k in range(40)]
    with _transport() as t:
        recvs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        rh = [t.irecv(b, peer, tag=k) for k, b in enumerate(recvs)]
        srcs = [_payload(n, seed=50_000 * rank + k) for k, n in enumerate(sizes)]
        sh = [t.isend(b, peer, tag=k) for k, b in enumerate(srcs)]
        for h in reversed(rh):
            h.wait()
        order = torch.randperm(len(sh), generator=torch.Generator().manual_seed(rank)).tolist()
        for k in order:
            sh[k].wait()
        for k, (n, b) in enumerate(zip(sizes, recvs, strict=True)):
            assert torch.equal(b, _payload(n, seed=50_000 * peer + k)), f"message {k} ({n} B) differs"
        assert all(h.is_completed() for h in rh + sh)


def _same_tag_fifo_and_tag_matching(rank: int) -> None:
    """Same tag: delivered in posting order. Different tags posted in the opposite order still match (stash)."""
    peer = 1 - rank
    with _transport() as t:
        if rank == 0:
            for k in range(5):
                t.isend(torch.full((1000,), k, dtype=torch.int64), peer, tag=7).wait()
            t.isend(torch.full((3 * SLOT_BYTES,), 1, dtype=torch.uint8), peer, tag=100).wait()
            t.isend(torch.full((10,), 2, dtype=torch.uint8), peer, tag=200).wait()
        else:
            bufs = [torch.empty(1000, dtype=torch.int64) for _ in range(5)]
            hs = [t.irecv(b, peer, tag=7) for b in bufs]
            for h in hs:
                h.wait()
            assert [int(b[0]) for b in bufs] == list(range(5)) and all(bool((b == b[0]).all()) for b in bufs)
            late = torch.empty(3 * SLOT_BYTES, dtype=torch.uint8)
            early = torch.empty(10, dtype=torch.uint8)
            h200 = t.irecv(early, peer, tag=200)  # posted first, but its message comes second
            h100 = t.irecv(late, peer, tag=100)
            h200.wait()
            h100.wait()
            assert bool((late == 1).all()) and bool((early == 2).all())


def _timeout_names_peer_and_transfer(rank: int) -> None:
    """A receive nobody answers times out after the given time, naming peer, tag and label."""
    with _transport() as t:
        if rank == 1:
            h = t.irecv(torch.empty(16), 0, tag=999, what="never sent")
            t0 = time.monotonic()
            with pytest.raises(TransportTimeout) as ei:
                h.wait(0.3)
            took = time.monotonic() - t0
            assert 0.25 <= took < 5.0, took
            msg = str(ei.value)
            assert "rank 0" in msg and "tag 999" in msg and "never sent" in msg, msg
            assert not h.is_completed()
        dist.barrier()


def _mismatch(rank: int, kind: str) -> None:
    """A size or dtype mismatch fails the receive without touching its tensor; the sender learns too."""
    with _transport() as t:
        if rank == 0:
            src = torch.arange(25, dtype=torch.float32)
            t.isend(src, 1, tag=5, what="sender side").wait()
            dist.barrier()  # rank 1 has seen the mismatch
            with pytest.raises(TransportError, match="receiver reported"):
                t.isend(src, 1, tag=6, what="after mismatch").wait(5.0)
        else:
            dst = torch.full(
                (26,) if kind == "size" else (25,), -7.0, dtype=torch.float32 if kind == "size" else torch.int32
            )
            h = t.irecv(dst, 0, tag=5, what="receiver side")
            with pytest.raises(TransportError) as ei:
                h.wait(10.0)
            msg = str(ei.value)
            if kind == "size":
                assert "size mismatch" in msg and "100 B" in msg and "104 B" in msg, msg
            else:
                assert "dtype mismatch" in msg and "float32" in msg and "int32" in msg, msg
            assert "rank 0" in msg and "receiver side" in msg, msg
            assert bool((dst == -7).all()), "a mismatched receive wrote into the tensor"
            dist.barrier()


def _bad_input_and_close(rank: int) -> None:
    t = _transport()
    with pytest.raises(ValueError, match="another rank"):
        t.isend(torch.zeros(4), rank, tag=0)
    with pytest.raises(ValueError, match="contiguous"):
        t.isend(torch.zeros(4, 4).t(), 1 - rank, tag=0)
    pending = t.irecv(torch.zeros(4), 1 - rank, tag=12345)
    t.close()
    t.close()  # idempotent
    with pytest.raises(TransportError, match="closed"):
        pending.wait(5.0)
    with pytest.raises(TransportError, match="closed"):
        t.isend(torch.zeros(4), 1 - rank, tag=0)


def _no_segments_left(rank: int) -> None:
    """Right after construction our ring names are already gone from /dev/shm."""
    with _transport():
        dist.barrier()
        mine = [n for n in load_engine_module().list_segments() if n.startswith(f"dpk-{os.getpid()}-")]
        assert mine == [], mine


SCENARIOS: dict[str, Callable[[int], None]] = {
    "sizes_both_directions": _sizes_both_directions,
    "many_in_flight_out_of_order_waits": _many_in_flight_out_of_order_waits,
    "same_tag_fifo_and_tag_matching": _same_tag_fifo_and_tag_matching,
    "timeout_names_peer_and_transfer": _timeout_names_peer_and_transfer,
    "single_copy_sizes": lambda r: _single_copy_sizes(r, single_copy=True),
    "ring_sizes_single_copy_off": lambda r: _single_copy_sizes(r, single_copy=False),
    "single_copy_env_off": _single_copy_env_off,
    "single_copy_mismatch": _single_copy_mismatch,
    "size_mismatch": lambda r: _mismatch(r, "size"),
    "dtype_mismatch": lambda r: _mismatch(r, "dtype"),
    "bad_input_and_close": _bad_input_and_close,
    "no_segments_left": _no_segments_left,
}


def _run_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    return {"pid": os.getpid(), **run_scenarios(SCENARIOS, rank)}


@pytest.fixture(scope="module")
def scenario_results() -> list[dict[str, Any]]:
    return spawn(_run_scenarios, 2, timeout_s=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(scenario_results: list[dict[str, Any]], name: str) -> None:
    check_scenario(scenario_results, name)


@pytest.mark.timeout(300)
def test_no_segment_outlives_the_processes(scenario_results: list[dict[str, Any]]) -> None:
    pids = {res["pid"] for res in scenario_results}
    left = [n for n in load_engine_module().list_segments() if any(n.startswith(f"dpk-{p}-") for p in pids)]
    assert left == []


# ---------------------------------------------------------------- kill test


def _wait_until_dead(pid: int, timeout_s: float) -> None:
    """Block until process ``pid`` has exited (its /proc entry is gone or it is a zombie)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} still alive after {timeout_s} s")


def _kill_mid_transfer(rank: int, world_size: int, timeout_s: float, single_copy: bool) -> dict[str, Any]:
    t = NativeTransport(
        timeout_s=timeout_s,
        num_slots=NUM_SLOTS,
        slot_bytes=SLOT_BYTES,
        single_copy=single_copy,
        single_copy_min_bytes=SINGLE_COPY_MIN,
    )
    n = 64 << 20
    active = bool(t.single_copy_peers())
    # The store lives in rank 0's process: exchange what is needed while it is alive.
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("kill_test/doomed_pid", str(os.getpid()))
        h = t.isend(_payload(n, seed=1), 1, tag=1)
        if active:
            time.sleep(0.3)  # the descriptor is published; rank 1 reads it only after we are gone
            store.wait(["kill_test/pid_seen"], timedelta(seconds=timeout_s))
        else:
            deadline = time.monotonic() + timeout_s
            while h._request.bytes_done() < 4 * SLOT_BYTES and time.monotonic() < deadline:  # mid-transfer
                time.sleep(0.0005)
        os.kill(os.getpid(), signal.SIGKILL)
    if active:
        # Post the receive only once the sender is really dead (gone or a zombie), however slow it was.
        store.wait(["kill_test/doomed_pid"], timedelta(seconds=timeout_s))
        doomed = int(store.get("kill_test/doomed_pid"))
        store.set("kill_test/pid_seen", "1")
        _wait_until_dead(doomed, timeout_s)
    h = t.irecv(torch.empty(n, dtype=torch.uint8), 0, tag=1, what="doomed")
    t0 = time.monotonic()
    try:
        h.wait()
    except TransportError as exc:
        return {
            "pid": os.getpid(),
            "error": str(exc),
            "type": type(exc).__name__,
            "after_s": time.monotonic() - t0,
            "active": active,
        }
    return {"pid": os.getpid(), "error": None, "active": active}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("single_copy", [False, True], ids=["ring", "single_copy"])
def test_kill_peer_mid_transfer(single_copy: bool) -> None:
    timeout_s = 60.0
    outcomes = spawn_outcomes(_kill_mid_transfer, 2, timeout_s, single_copy, timeout_s=180, pg_timeout_s=30)
    assert not outcomes[0].ok, "rank 0 should have died"
    assert outcomes[1].ok, outcomes[1].error
    res = outcomes[1].value
    assert res["error"] is not None, "the receive completed although the sender was killed"
    assert res["type"] == "TransportError" and "rank 0" in res["error"] and "pid" in res["error"], res
    assert "doomed" in res["error"], res
    if single_copy and _cross_memory_attach_expected():
        assert res["active"] and "single-copy read" in res["error"], res
    assert res["after_s"] < timeout_s / 4, f"dead peer noticed only after {res['after_s']:.1f} s"
    dead_pid = re.search(r"pid (\d+)", res["error"])
    assert dead_pid is not None, res
    pids = (res["pid"], int(dead_pid.group(1)))
    left = [n for n in load_engine_module().list_segments() if any(n.startswith(f"dpk-{p}-") for p in pids)]
    assert left == []


# ---------------------------------------------------------------- killed during the rendezvous

_CREATE_AND_HANG = """
import sys, time
import torch
from dualpipe_kernels import _C
eng = _C.shm.Engine(0)
print(eng.create_send_channel(1), flush=True)  # the peer never maps it: every rank is killed first
time.sleep(600)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("named", [False, True])
def test_rings_of_ranks_killed_in_the_rendezvous_leave_nothing_in_dev_shm(named: bool) -> None:
    """A ring is anonymous (no /dev/shm name) unless DUALPIPE_KERNELS_SHM_NAMED=1; killing its creator
    before any peer mapped it leaves nothing behind (named: the name stays until the next engine's sweep)."""
    import signal
    import subprocess
    import sys

    env = {**os.environ, "DUALPIPE_KERNELS_SHM_NAMED": "1" if named else "0"}
    proc = subprocess.Popen([sys.executable, "-c", _CREATE_AND_HANG], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
        mine = [n for n in load_engine_module().list_segments() if n.startswith(f"dpk-{proc.pid}-")]
        if named:
            assert name.startswith(f"/dpk-{proc.pid}-") and mine == [name[1:]]
        else:
            assert name == f"/proc/{proc.pid}/fd/{name.rsplit('/', 1)[1]}" and mine == []
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    left = [n for n in load_engine_module().list_segments() if n.startswith(f"dpk-{proc.pid}-")]
    if named:
        assert len(left) == 1  # what only a later engine's sweep removes
        load_engine_module().sweep_stale_segments()
        left = [n for n in load_engine_module().list_segments() if n.startswith(f"dpk-{proc.pid}-")]
    assert left == []
