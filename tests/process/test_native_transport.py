"""NativeTransport as the runtime sees it: rendezvous, groups, fallback to torch.distributed.

Three spawned processes run every scenario (one group of processes for the
whole file); each rank reports "ok" or its traceback per scenario.  A rank
with a different ``host_id`` stands in for a peer on another host: it must be
reached through torch.distributed while same-host peers go through shared
memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from scenarios import check_scenario, run_module_scenarios

from dualpipe_kernels.runtime.launch import spawn
from dualpipe_kernels.transport import make_transport
from dualpipe_kernels.transport.native import NativeTransport

WORLD = 3
WAIT_S = 30.0


def _data(src: int, dst: int, n: int = 1000) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64) * (src + 1) + 1000 * dst


def _all_pairs(t: NativeTransport, ranks: list[int], me: int) -> None:
    """Every ordered pair of ``ranks`` (group ranks) exchanges a distinct tensor; check each."""
    handles, bufs = [], {}
    for p in ranks:
        if p == me:
            continue
        bufs[p] = torch.empty(1000, dtype=torch.float64)
        handles.append(t.irecv(bufs[p], p, tag=3, what=f"from {p}"))
        handles.append(t.isend(_data(me, p), p, tag=3, what=f"to {p}"))
    for h in handles:
        h.wait()
    for p, b in bufs.items():
        assert torch.equal(b, _data(p, me)), f"rank {me}: wrong data from {p}"


def _make_transport_native(rank: int) -> None:
    with make_transport("native", None, torch.device("cpu"), WAIT_S) as t:
        assert isinstance(t, NativeTransport) and t.name == "native"
        assert t.rank == rank and sorted(t.local_peers) == [p for p in range(WORLD) if p != rank]
        _all_pairs(t, list(range(WORLD)), rank)


def _other_host_falls_back(rank: int) -> None:
    host = "host-b" if rank == 2 else "host-a"
    with NativeTransport(timeout_s=WAIT_S, host_id=host) as t:
        expected_local = {0: (1,), 1: (0,), 2: ()}[rank]
        assert t.local_peers == expected_local, t.local_peers
        _all_pairs(t, list(range(WORLD)), rank)


def _subgroup_uses_group_ranks(rank: int) -> None:
    group = dist.new_group([1, 2])  # collective over the world
    if rank == 0:
        return
    with NativeTransport(group, timeout_s=WAIT_S) as t:
        me = dist.get_rank(group)
        assert t.rank == me == rank - 1
        _all_pairs(t, [0, 1], me)


def _two_transports_do_not_mix(rank: int) -> None:
    a = NativeTransport(timeout_s=WAIT_S)
    b = NativeTransport(timeout_s=WAIT_S)
    try:
        peer = (rank + 1) % WORLD
        src = (rank - 1) % WORLD
        ra, rb = torch.empty(1000, dtype=torch.float64), torch.empty(1000, dtype=torch.float64)
        # Same tag on both transports: they must not see each other's messages.
        hs = [b.irecv(rb, src, tag=1), a.irecv(ra, src, tag=1)]
        hs += [a.isend(_data(rank, peer), peer, tag=1), b.isend(_data(rank, peer) * -1, peer, tag=1)]
        for h in hs:
            h.wait()
        assert torch.equal(ra, _data(src, rank)) and torch.equal(rb, _data(src, rank) * -1)
    finally:
        a.close()
        b.close()


def _rejects_bad_arguments(rank: int) -> None:
    with pytest.raises(ValueError, match="num_slots must be >= 2"):
        NativeTransport(num_slots=1)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        NativeTransport(timeout_s=0)
    with pytest.raises(ValueError, match="recv_poll_ms must be >= 0"):
        NativeTransport(recv_poll_ms=-1.0)
    with pytest.raises(ValueError, match="inline_max_bytes must be in"):
        NativeTransport(slot_bytes=4096, inline_max_bytes=4097)
    with NativeTransport(timeout_s=WAIT_S) as t:
        with pytest.raises(ValueError, match="peer must be another rank"):
            t.isend(torch.zeros(2), WORLD, tag=0)
        with pytest.raises(ValueError, match="CPU tensors"):
            t.isend(torch.zeros(2, device="meta"), (rank + 1) % WORLD, tag=0)


def _finished_transfers_hold_no_tensor(rank: int) -> None:
    """Once a handle has seen its transfer finish, nothing in the transport keeps the tensor alive.

    Otherwise the live-tensor count of a training loop swings with what the
    last step happened to post (the runtime memory test once saw 104 <-> 106).
    The checks are collected and asserted after the scenario's barrier, so a
    failing rank cannot put the ranks' barriers out of step.
    """
    import gc
    import time
    import weakref

    peer, src = (rank + 1) % WORLD, (rank - 1) % WORLD
    problems: list[str] = []
    with NativeTransport(timeout_s=WAIT_S) as t:
        for polled in (False, True):
            out, buf = _data(rank, peer), torch.empty(1000, dtype=torch.float64)
            refs = [weakref.ref(out), weakref.ref(buf)]
            hs = [t.irecv(buf, src, tag=5), t.isend(out, peer, tag=5)]
            for h in hs:
                deadline = time.monotonic() + WAIT_S
                while polled and not h.is_completed() and time.monotonic() < deadline:
                    pass  # completion seen through query(); wait() is then a no-op
                h.wait()
            if not torch.equal(buf, _data(src, rank)):
                problems.append("wrong data")
            del out, buf
            gc.collect()
            if any(r() is not None for r in refs):
                problems.append(f"a finished transfer's tensor is still alive (polled={polled})")
        # A dropped, unwaited receive: the transport keeps its buffer until the transfer finishes.
        # Nobody sends on tag 6 before every rank has checked (else the receive may complete at post).
        buf = torch.empty(1000, dtype=torch.float64)
        ref = weakref.ref(buf)
        t.irecv(buf, src, tag=6)
        del buf
        gc.collect()
        if ref() is None:
            problems.append("a receive buffer died while the engine may still write it")
        dist.barrier()
        t.isend(_data(rank, peer), peer, tag=6).wait()
        dist.barrier()  # every send is in its ring before any rank closes its transport
    assert not problems, f"rank {rank}: {problems}"


def _gathered_send_is_one_message_with_zero_gaps(rank: int) -> None:
    """try_isend_gather writes its pieces into the ring at their offsets (zeros between them) and the peer
    receives them with an ordinary irecv; a peer on another host or a bad piece is declined or named."""
    peer, src = (rank + 1) % WORLD, (rank - 1) % WORLD
    head = torch.arange(4, dtype=torch.int64) + 10 * rank
    body = torch.arange(6, dtype=torch.float32) * (rank + 1)
    with NativeTransport(timeout_s=WAIT_S) as t:
        buf = torch.full((80,), 0xEE, dtype=torch.uint8)
        h = t.irecv(buf, src, tag=9)
        assert t.try_isend_gather([(0, head), (48, body)], 80, peer, tag=9)
        h.wait()
        want = torch.zeros(80, dtype=torch.uint8)
        want[:32] = (torch.arange(4, dtype=torch.int64) + 10 * src).view(torch.uint8)
        want[48:72] = (torch.arange(6, dtype=torch.float32) * (src + 1)).view(torch.uint8)
        assert torch.equal(buf, want), buf
        with pytest.raises(ValueError, match="contiguous CPU"):
            t.try_isend_gather([(0, torch.zeros(4, 4).t())], 80, peer, tag=9)
        with pytest.raises(ValueError, match="outside"):
            t.try_isend_gather([(70, body)], 80, peer, tag=9)
        dist.barrier()
    with NativeTransport(timeout_s=WAIT_S, gather_sends=False) as t:
        assert not t.try_isend_gather([(0, head)], 32, peer, tag=9), "gather_sends=False always declines"
    with NativeTransport(timeout_s=WAIT_S, host_id="host-b" if rank == 2 else "host-a") as t:
        far = 2 if rank != 2 else 0
        assert not t.try_isend_gather([(0, head)], 32, far, tag=9), "a peer on another host has no ring"


def _slot_sized_sends_go_inline_when_asked(rank: int) -> None:
    """The default inline limit follows the CPUs per local rank; with a whole slot inline, a slot-sized send
    is copied by the posting thread (complete when isend returns, not read single-copy) and arrives intact."""
    from dualpipe_kernels.transport import native

    slot = native.DEFAULT_SLOT_BYTES
    peer, src = (rank + 1) % WORLD, (rank - 1) % WORLD
    with NativeTransport(timeout_s=WAIT_S) as t:
        assert t.inline_max_bytes == native.default_inline_max_bytes(WORLD, slot)
    with NativeTransport(timeout_s=WAIT_S, inline_max_bytes=slot) as t:
        out = torch.arange(slot // 4, dtype=torch.float32) + rank
        buf = torch.empty(slot // 4, dtype=torch.float32)
        h = t.irecv(buf, src, tag=3)
        s = t.isend(out, peer, tag=3)
        assert s.is_completed(), "a slot-sized send into a free slot is copied when it is posted"
        h.wait()
        assert torch.equal(buf, torch.arange(slot // 4, dtype=torch.float32) + src)
        assert t.send_stats(peer)["copied_bytes"] == slot
        dist.barrier()


def _message_inline_bytes_is_the_groups_smallest(rank: int) -> None:
    """What a pipeline may send as one gathered message is the same on every rank: the group's smallest
    ``inline_max_bytes``; nothing where a rank does not gather or a peer is on another host."""
    with NativeTransport(timeout_s=WAIT_S, inline_max_bytes=4096 * (rank + 1)) as t:
        assert t.inline_max_bytes == 4096 * (rank + 1) and t.message_inline_bytes == 4096
    with NativeTransport(timeout_s=WAIT_S, gather_sends=rank != 1) as t:
        assert t.message_inline_bytes == 0
    with NativeTransport(timeout_s=WAIT_S, host_id="host-b" if rank == 2 else "host-a") as t:
        assert t.message_inline_bytes == 0, "the torch fallback to another host does not gather"


SCENARIOS: dict[str, Callable[[int], None]] = {
    "make_transport_native": _make_transport_native,
    "other_host_falls_back": _other_host_falls_back,
    "subgroup_uses_group_ranks": _subgroup_uses_group_ranks,
    "two_transports_do_not_mix": _two_transports_do_not_mix,
    "rejects_bad_arguments": _rejects_bad_arguments,
    "finished_transfers_hold_no_tensor": _finished_transfers_hold_no_tensor,
    "gathered_send_is_one_message_with_zero_gaps": _gathered_send_is_one_message_with_zero_gaps,
    "slot_sized_sends_go_inline_when_asked": _slot_sized_sends_go_inline_when_asked,
    "message_inline_bytes_is_the_groups_smallest": _message_inline_bytes_is_the_groups_smallest,
}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(run_module_scenarios, WORLD, __name__, timeout_s=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(results: list[dict[str, Any]], name: str) -> None:
    check_scenario(results, name)


def test_default_spin_follows_cpus_per_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiters spin long only where every local rank has a CPU (LOCAL_WORLD_SIZE, where set, counts them)."""
    from dualpipe_kernels.transport import native

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(native.os, "cpu_count", lambda: 2)
    assert native.default_spin_us(2) == native.SPIN_US_OWN_CORE == 500.0
    assert native.default_spin_us(4) == native.SPIN_US_SHARED == 50.0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 8 ranks over 4 hosts of 2 CPUs
    assert native.default_spin_us(8) == native.SPIN_US_OWN_CORE
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not-a-number")
    assert native.default_spin_us(3) == native.SPIN_US_SHARED


def test_default_inline_limit_follows_cpus_per_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The posting thread copies up to 64 KiB where every local rank has a CPU, a whole slot where they share."""
    from dualpipe_kernels.transport import native

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(native.os, "cpu_count", lambda: 2)
    slot = native.DEFAULT_SLOT_BYTES
    assert native.default_inline_max_bytes(2, slot) == native.INLINE_MAX_BYTES_OWN_CORE == 64 * 1024
    assert native.default_inline_max_bytes(2, 4096) == 4096  # never more than a slot
    assert native.cpus_shared(4) and native.default_inline_max_bytes(4, slot) == slot
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 8 ranks over 4 hosts of 2 CPUs
    assert not native.cpus_shared(8) and native.default_inline_max_bytes(8, slot) == 64 * 1024
