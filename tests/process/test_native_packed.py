"""Packed sends over the native transport: packed straight into a reserved ring slot (one pass), or not.

Two spawned processes run every scenario; each rank reports "ok" or its traceback.
The sender's engine counters (``NativeTransport.send_stats``) tell which path a
message took: ``reserved_*`` (packed in place, the engine copied nothing) or
``copied_*`` (packed into a buffer, then posted).  The receiver unpacks what
arrived and compares it bit for bit with what a local ``pack`` gives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from scenarios import check_scenario, run_module_scenarios

from dualpipe_kernels.kernels import format_for, pack, plan_layout, unpack
from dualpipe_kernels.runtime.launch import spawn
from dualpipe_kernels.transport import native_available
from dualpipe_kernels.transport.base import TransportError, TransportTimeout
from dualpipe_kernels.transport.native import NativeTransport

pytestmark = pytest.mark.skipif(not native_available(), reason="the native extension is not built")

WORLD = 2
WAIT_S = 30.0
SLOT = 64 * 1024
FORMATS = {"packed": (None, False), "bf16": (torch.bfloat16, False), "fp8": (torch.float8_e4m3fn, False)}
FORMATS["fp8_pow2"] = (torch.float8_e4m3fn, True)


def _tensors(seed: int, rows: int) -> list[torch.Tensor]:
    """A boundary's worth of tensors (the same on both ranks for a seed): strided, mixed dtypes."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, 130, generator=g) * 7).t(),  # non-contiguous fp32, a short last fp8 block
        torch.randn(rows, 3, generator=g).half(),
        torch.randn(5, 129, generator=g).bfloat16(),
        torch.randint(-(2**40), 2**40, (rows,), generator=g),
        torch.rand(33, generator=g) > 0.5,
    ]


def _layout(ts: list[torch.Tensor], fmt: str) -> Any:
    dtype, pow2 = FORMATS[fmt]
    return plan_layout([(t.dtype, t.shape) for t in ts], format_for(dtype, pow2))


def _reference(ts: list[torch.Tensor], fmt: str) -> torch.Tensor:
    dtype, pow2 = FORMATS[fmt]
    return pack(ts, dtype, pow2_scales=pow2, backend="torch")[0]


def _exchange(t: NativeTransport, rank: int, fmt: str, rows: int, tag: int) -> None:
    """Rank 0 sends one packed message to rank 1, which checks its bytes and its unpacked tensors."""
    ts = _tensors(tag, rows)
    layout = _layout(ts, fmt)
    if rank == 0:
        t.isend_packed(ts, layout, 1, tag, f"{fmt} {rows} rows").wait()
        return
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    t.irecv(buf, 0, tag, f"{fmt} {rows} rows").wait()
    ref = _reference(ts, fmt)
    assert torch.equal(buf, ref), f"{fmt}, {rows} rows: the received bytes differ from a local pack"
    outs = unpack(buf, layout)
    if fmt == "packed":
        for x, y in zip(ts, outs, strict=True):
            assert torch.equal(x, y), f"packed: lossless round trip differs ({x.dtype})"
    for i, (x, y) in enumerate(zip(unpack(ref, layout), outs, strict=True)):
        assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)), f"{fmt}: tensor {i}"


def _in_place_below_a_slot_copy_path_above(rank: int) -> None:
    with NativeTransport(timeout_s=WAIT_S, slot_bytes=SLOT) as t:
        for k, fmt in enumerate(FORMATS):
            for rows, in_place in ((20, True), (4000, False)):  # about 12 KiB / up to 2.3 MiB packed
                before = t.send_stats(1) if rank == 0 else None
                _exchange(t, rank, fmt, rows, tag=10 + 2 * k + (rows > 100))
                if rank == 0:
                    after = t.send_stats(1)
                    nbytes = _layout(_tensors(0, rows), fmt).nbytes
                    assert (nbytes <= SLOT) == in_place, (fmt, rows, nbytes)
                    grew = {k2: after[k2] - before[k2] for k2 in after}
                    if in_place:  # one reservation, and not one byte copied by the engine
                        assert grew == {
                            "reserved_bytes": nbytes,
                            "reserved_messages": 1,
                            "copied_bytes": 0,
                            "copied_messages": 0,
                        }, (fmt, grew)
                    else:  # larger than a slot: the buffer path (single-copy or through the ring)
                        assert grew["reserved_messages"] == 0 and grew["copied_messages"] == 1, (fmt, grew)
                dist.barrier()


def _pack_in_place_off_takes_the_copy_path(rank: int) -> None:
    with NativeTransport(timeout_s=WAIT_S, slot_bytes=SLOT, pack_in_place=False) as t:
        _exchange(t, rank, "fp8", 20, tag=40)
        if rank == 0:
            s = t.send_stats(1)
            assert s["reserved_messages"] == 0 and s["copied_messages"] == 1 and s["copied_bytes"] > 0, s


def _full_ring_times_out_naming_the_transfer(rank: int) -> None:
    with NativeTransport(timeout_s=WAIT_S, num_slots=2, slot_bytes=4096) as t:
        if rank == 0:
            for k in range(2):  # nobody receives yet: both slots stay full
                with t.reserve_send(100, 1, 50 + k, "filler", timeout=5.0) as slot:
                    slot.tensor.fill_(k + 1)
            assert t.reserve_send(100, 1, 52, "try", timeout=0) is None
            with pytest.raises(TransportTimeout, match=r"rank 0 send to rank 1 \(tag 52.*'third'.*free ring slot"):
                t.reserve_send(100, 1, 52, "third", timeout=0.2)
            with pytest.raises(ValueError, match="cannot reserve 5000 B in one ring slot of 4096 B"):
                t.reserve_send(5000, 1, 53, "too big", timeout=0)
        dist.barrier()
        if rank == 1:
            for k in range(2):
                buf = torch.empty(100, dtype=torch.uint8)
                t.irecv(buf, 0, 50 + k).wait()
                assert bool((buf == k + 1).all()), f"filler {k}"
        dist.barrier()


def _pack_error_publishes_nothing(rank: int) -> None:
    with NativeTransport(timeout_s=WAIT_S, slot_bytes=SLOT) as t:
        ts = _tensors(60, 20)
        if rank == 0:
            wrong = _layout(_tensors(61, 21), "fp8")  # another signature: refused before the slot is published
            with pytest.raises(ValueError, match="do not match the layout"):
                t.isend_packed(ts, wrong, 1, 60, "mismatch")
            with pytest.raises(RuntimeError, match="boom"), t.reserve_send(64, 1, 60, "raising", timeout=5.0):
                raise RuntimeError("boom")
            assert t.send_stats(1)["reserved_messages"] == 0
        _exchange(t, rank, "fp8", 20, tag=60)  # the next message on that tag is intact


def _closed_transport_refuses(rank: int) -> None:
    t = NativeTransport(timeout_s=WAIT_S, slot_bytes=SLOT)
    slot = t.reserve_send(64, 1 - rank, 70, "held", timeout=5.0)
    assert slot is not None
    t.close()
    with pytest.raises(TransportError, match="closed"):
        slot.commit()
    with pytest.raises(TransportError, match="closed"):
        t.reserve_send(64, 1 - rank, 71, "after close", timeout=0)


SCENARIOS: dict[str, Callable[[int], None]] = {
    "in_place_below_a_slot_copy_path_above": _in_place_below_a_slot_copy_path_above,
    "pack_in_place_off_takes_the_copy_path": _pack_in_place_off_takes_the_copy_path,
    "full_ring_times_out_naming_the_transfer": _full_ring_times_out_naming_the_transfer,
    "pack_error_publishes_nothing": _pack_error_publishes_nothing,
    "closed_transport_refuses": _closed_transport_refuses,
}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(run_module_scenarios, WORLD, __name__, timeout_s=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(results: list[dict[str, Any]], name: str) -> None:
    check_scenario(results, name)
