"""Bench suite ``cuda_ipc``: CUDA IPC point-to-point between two processes on one GPU, against its bare ceiling.

Two spawned ranks share GPU 0; rank 0 sends, rank 1 receives.  They meet on a
shared-memory spin barrier (both leave it within microseconds; a store
barrier's 10 ms polls would swamp a burst).  Per message size, one row:

- ``engine_gbps``: a burst of messages over ``CudaIpcTransport``, timed on
  rank 1 with CUDA events from just before it posts the burst's receives to
  the moment its stream has waited for all of them (``wait_stream``, no host
  sync): end to end, the sender's side included.
- ``bare_gbps``: the same number of rounds of the bare ceiling, no engine: an
  interprocess-event ping-pong in which rank 1 copies the message from rank
  0's IPC-mapped buffer (what zero-copy can reach on this hardware).
- ``copy_gbps``: the same burst as ``dst.copy_(src)`` within one process.
- ``engine_over_bare`` (judged at >= 64 MiB: target >= 0.85).
- ``host_us_per_msg``: host time per message (posting on both ranks, plus
  rank 1's ``wait_stream`` calls), apart from ``device_us_per_msg`` (CUDA-event
  time per message of the burst).
- ``hop_us``: the bare context hop, measured once: an interprocess-event
  ping-pong with no copy, per one-way hop.  Small messages are judged against
  it (256 B: device time per message <= 2 x the hop).

Plus the compute + transfer overlap row (a bf16 matmul loop alone, the
transfer alone, both together: ``both / longer`` <= 1.1).  Every received
buffer of every burst is checked.

``--fake-device`` needs no GPU: it runs the engine's host path over the fake
device layer (both ends in this process; copies move no bytes while timed)
and reports host microseconds per message (post + completion) for 256 B and
1 MiB messages (target <= 10 us).
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import time
import traceback
from typing import Any

import torch

from dualpipe_kernels.benchmarks.cuda_ipc_bare import BarePingPong, PeerBuffers, SpinBarrier, d2d_ms, timed_ms
from dualpipe_kernels.benchmarks.cuda_ipc_report import to_markdown as to_markdown  # the report of this suite

NAME = "cuda_ipc"
#: engine / bare ceiling, judged from BANDWIDTH_MIN_SIZE on
BANDWIDTH_TARGET = 0.85
BANDWIDTH_MIN_SIZE = 64 << 20
#: small messages: device time per message <= SMALL_TARGET x the bare context hop
SMALL_MSG_BYTES = 256
SMALL_TARGET = 2.0
OVERLAP_TARGET = 1.1
#: host cost over the fake device, per message (post + completion)
FAKE_TARGET_US = 10.0
FAKE_SIZES = (256, 1 << 20)
#: payload moved per burst, so that smaller messages are timed over many of them
BURST_BYTES = 512 << 20
MAX_BURST, MIN_BURST = 256, 4
#: distinct buffers per burst on each side (each checked)
BUFFERS = 4
HOP_ROUNDS = 64
OVERLAP_MSG_BYTES = 64 << 20
MATMUL_N = 8192


def unavailable(args: argparse.Namespace | None = None) -> str | None:
    """None when this machine can run the suite (as asked), else a one-line reason."""
    from dualpipe_kernels.transport import TransportError
    from dualpipe_kernels.transport.cuda_ipc import native_cuda_module

    fake = bool(getattr(args, "fake_device", False))
    if not fake and not torch.cuda.is_available():
        return "needs CUDA: no CUDA GPU is visible (torch.cuda.is_available() is False); --fake-device needs none"
    try:
        native_cuda_module()
    except TransportError as exc:
        return f"needs CUDA: {exc}".splitlines()[0]
    return None


def _size(text: str) -> int:
    """'4K', '256M', '1G' or a plain byte count."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-size", type=_size, default=256, help="smallest message of the sweep (default 256 B)")
    p.add_argument("--max-size", type=_size, default=256 << 20, help="largest message (default 256M)")
    p.add_argument("--iters", type=int, default=7, help="timed bursts per size (median)")
    p.add_argument("--slot-bytes", type=_size, default=4 << 20)
    p.add_argument("--num-slots", type=int, default=4)
    p.add_argument("--max-inflight", type=int, default=256, help="chunks a sender may publish ahead of the receiver")
    p.add_argument("--staging", choices=("auto", "ipc", "host"), default="auto")
    p.add_argument("--direct-min-bytes", type=_size, default=1 << 20, help="zero-copy from this size on (0: never)")
    p.add_argument("--overlap-bytes", type=_size, default=16 << 30, help="bytes of the overlap transfer")
    p.add_argument("--overlap-reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds for the whole run and for each wait")
    p.add_argument(
        "--fake-device",
        action="store_true",
        help="no GPU: the engine's host path over the fake device layer, host us per message for 256 B and 1 MiB",
    )


def sizes_between(lo: int, hi: int) -> list[int]:
    """lo, 16 lo, 256 lo, ... and hi itself (256 B .. 256 MiB: 256 B, 4K, 64K, 1M, 16M, 256M); 64 MiB when in range."""
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 16
    if lo <= BANDWIDTH_MIN_SIZE <= hi and BANDWIDTH_MIN_SIZE not in out:
        out.append(BANDWIDTH_MIN_SIZE)
    if not out or max(out) != hi:
        out.append(hi)
    return sorted(set(out))


def burst_count(size: int) -> int:
    return max(MIN_BURST, min(MAX_BURST, BURST_BYTES // size))


# ---------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------


def _burst(
    t: Any, rank: int, size: int, count: int, tag0: int, barrier: SpinBarrier, iters: int
) -> tuple[list[float], list[float]]:
    """``iters`` timed bursts of ``count`` messages 0 -> 1 (plus a warm-up).

    Returns (device ms per burst: rank 1 only, host seconds per burst spent posting (and on rank 1 in
    wait_stream)).  Message i goes from sender buffer i % k (bytes all i % k + 1) to receiver buffer i % k;
    every receiver buffer is zeroed before a burst and checked after it.
    """
    k = min(count, BUFFERS)
    device_ms: list[float] = []
    host_s: list[float] = []
    if rank == 0:
        bufs = [torch.full((size,), j + 1, dtype=torch.uint8, device="cuda") for j in range(k)]
        torch.cuda.synchronize()
        for it in range(iters + 1):
            barrier()
            h0 = time.perf_counter()
            hs = [t.isend(bufs[i % k], 1, tag0 + i, what=f"{size} B message {i}") for i in range(count)]
            if it > 0:
                host_s.append(time.perf_counter() - h0)
            for h in hs:
                h.wait()
        return device_ms, host_s
    bufs = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(k)]
    for it in range(iters + 1):
        for b in bufs:
            b.zero_()
        torch.cuda.synchronize()
        barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        h0 = time.perf_counter()
        hs = [t.irecv(bufs[i % k], 0, tag0 + i, what=f"{size} B message {i}") for i in range(count)]
        for h in hs:
            h.wait_stream()
        spent = time.perf_counter() - h0
        end.record()
        end.synchronize()
        ms = float(start.elapsed_time(end))
        bad = [j for j, b in enumerate(bufs) if not bool((b == j + 1).all())]
        if bad:
            raise AssertionError(f"{size}-byte messages: receive buffers {bad} of {k} differ from the sender's")
        if it > 0:
            device_ms.append(ms)
            host_s.append(spent)
    return device_ms, host_s


def _row(
    t: Any, bare: BarePingPong, rank: int, size: int, barrier: SpinBarrier, iters: int, tag0: int, out: Any
) -> dict[str, Any] | None:
    count = burst_count(size)
    device_ms, host_s = _burst(t, rank, size, count, tag0, barrier, iters)
    # the bare ceiling, same rounds: rank 1 copies from rank 0's IPC-mapped buffer
    barrier()
    src = bare.peer_buffer(size)  # rank 0 makes and shares it, rank 1 maps it
    if rank == 0:
        out.put(("sender_host_s", size, statistics.median(host_s)))
        bare.run(count)  # warm-up
        for _ in range(iters):
            bare.run(count)
        return None
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    bare.run(count, src, dst)
    bare_ms = statistics.median(bare.run(count, src, dst) for _ in range(iters))
    if not bool((dst == 7).all()):
        raise AssertionError(f"bare ceiling, {size} B: the copy from the peer's buffer differs from what it holds")
    del src
    engine_ms, base_ms = statistics.median(device_ms), d2d_ms(size, count, iters)
    payload = size * count
    return {
        "size_bytes": size,
        "messages": count,
        "engine_gbps": payload / engine_ms / 1e6,
        "bare_gbps": payload / bare_ms / 1e6,
        "copy_gbps": payload / base_ms / 1e6,
        "engine_over_bare": bare_ms / engine_ms,
        "receiver_host_us_per_msg": statistics.median(host_s) * 1e6 / count,
        "device_us_per_msg": engine_ms * 1e3 / count,
        "bare_us_per_msg": bare_ms * 1e3 / count,
        "buffers_checked": min(count, BUFFERS) * (iters + 1),
    }


def _overlap(t: Any, rank: int, barrier: SpinBarrier, args: argparse.Namespace) -> dict[str, Any]:
    """Compute alone, transfer alone, both together (rank 1 measures; rank 0 only sends)."""
    messages = max(2, args.overlap_bytes // OVERLAP_MSG_BYTES)
    bufs = [torch.full((OVERLAP_MSG_BYTES,), j + 1, dtype=torch.uint8, device="cuda") for j in range(2)]
    tag0 = 1 << 20
    if rank == 0:
        for _ in range(2 * args.overlap_reps + 1):  # transfer alone (with a warm-up), then together
            barrier()
            hs = [t.isend(bufs[i % 2], 1, tag0 + i) for i in range(messages)]
            for h in hs:
                h.wait()
        return {}

    def receive() -> list[Any]:
        return [t.irecv(bufs[i % 2], 0, tag0 + i) for i in range(messages)]

    def check() -> None:
        bad = [j for j, b in enumerate(bufs) if not bool((b == j + 1).all())]
        if bad:
            raise AssertionError(f"overlap transfer: receive buffers {bad} differ from the sender's")

    a = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    one_mm = statistics.median(timed_ms(lambda: [torch.mm(a, b) for _ in range(4)]) for _ in range(3)) / 4
    transfer = []
    for i in range(args.overlap_reps + 1):
        for buf in bufs:
            buf.zero_()
        torch.cuda.synchronize()
        barrier()
        ms = timed_ms(lambda: [h.wait_stream() for h in receive()])
        check()
        if i > 0:
            transfer.append(ms)
    transfer_ms = statistics.median(transfer)
    count = max(1, round(transfer_ms / one_mm))
    compute_ms = statistics.median(
        timed_ms(lambda: [torch.mm(a, b) for _ in range(count)]) for _ in range(args.overlap_reps)
    )

    def together() -> None:
        hs = receive()
        for _ in range(count):  # queued on the compute stream while the copies run on the engine's streams
            torch.mm(a, b)
        for h in hs:
            h.wait_stream()

    both = []
    for _ in range(args.overlap_reps):
        for buf in bufs:
            buf.zero_()
        torch.cuda.synchronize()
        barrier()
        both.append(timed_ms(together))
        check()
    both_ms = statistics.median(both)
    ratio = both_ms / max(compute_ms, transfer_ms)
    return {
        "transfer_bytes": messages * OVERLAP_MSG_BYTES,
        "matmuls": count,
        "matmul_n": MATMUL_N,
        "compute_ms": compute_ms,
        "transfer_ms": transfer_ms,
        "both_ms": both_ms,
        "ratio": ratio,
        "target": OVERLAP_TARGET,
        "pass": ratio <= OVERLAP_TARGET,
    }


def _rank_main(rank: int, slots: Any, rounds: Any, share: Any, events: Any, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    torch.cuda.set_device(0)
    try:
        barrier = SpinBarrier(slots, rank, args.timeout)
        # the bare ceiling's events: rank 0 makes both and hands them over (torch pickles their IPC handles)
        if rank == 0:
            ping, pong = torch.cuda.Event(interprocess=True), torch.cuda.Event(interprocess=True)
            ping.record()
            pong.record()
            torch.cuda.synchronize()
            events.put((ping, pong))
        else:
            ping, pong = events.get(timeout=args.timeout)
        peer = PeerBuffers(rank, share, args.timeout)
        bare = BarePingPong(rank, ping, pong, rounds, args.timeout, peer)
        barrier()
        # the context hop: ping-pong with no copy (warm-up, then timed)
        bare.run(8)
        hop_ms = statistics.median(bare.run(HOP_ROUNDS) for _ in range(3))
        hop_us = hop_ms * 1e3 / (2 * HOP_ROUNDS)

        t = _make_transport(rank, args)
        rows = []
        for i, size in enumerate(sizes_between(args.min_size, args.max_size)):
            row = _row(t, bare, rank, size, barrier, args.iters, i << 12, out)
            if row is not None:
                rows.append(row)
            peer.mine.clear()  # rank 0: the bare round's buffer (rank 1 dropped its mapping with its row)
        overlap = _overlap(t, rank, barrier, args)
        stats = t.stats()
        mechanism = t.signal_mechanism()
        barrier()
        staging = t.staging_with(1 - rank)
        t.close()
        if rank == 1:
            out.put(("result", {"rows": rows, "hop_us": hop_us, "overlap": overlap, "staging": staging,
                                "stats": stats, "signal_mechanism": mechanism}))  # fmt: skip
        else:
            out.put(("sender_stats", stats))
        barrier()
    except Exception:  # noqa: BLE001 - reported to the parent
        out.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def _make_transport(rank: int, args: argparse.Namespace) -> Any:
    """The transport over a FileStore in a folder both ranks know (the rendezvous only; no barrier uses it)."""
    import torch.distributed as dist

    from dualpipe_kernels.transport.cuda_ipc import CudaIpcTransport

    store = dist.FileStore(args.store_path, 2)
    return CudaIpcTransport(
        rank=rank, world_size=2, store=store, device=0, num_slots=args.num_slots, slot_bytes=args.slot_bytes,
        staging=args.staging, direct_min_bytes=args.direct_min_bytes, timeout_s=args.timeout,
        max_inflight=args.max_inflight,
    )  # fmt: skip


def _spawn_pair(args: argparse.Namespace, store_dir: str) -> dict[str, Any]:
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    out, share, events = ctx.Queue(), ctx.Queue(), ctx.Queue()
    slots, rounds = ctx.RawArray("q", 2), ctx.RawArray("q", 2)
    args.store_path = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(target=_rank_main, args=(r, slots, rounds, share, events, args, out), daemon=True) for r in range(2)
    ]
    for p in procs:
        p.start()
    result: dict[str, Any] = {}
    sender_host: dict[int, float] = {}
    deadline = time.monotonic() + args.timeout
    try:
        while "rows" not in result or "sender_stats" not in result:
            left = deadline - time.monotonic()
            if left <= 0:
                result = {"error": f"no result within --timeout {args.timeout:.0f} s"}
                break
            try:
                kind, *payload = out.get(timeout=left)
            except queue.Empty:
                continue
            if kind == "error":
                result = {"error": payload[0]}
                break
            if kind == "sender_host_s":
                sender_host[payload[0]] = payload[1]
            elif kind == "sender_stats":
                result["sender_stats"] = payload[0]
            else:
                result.update(payload[0])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if "error" in result:
        raise RuntimeError(f"bench cuda_ipc failed: {result['error']}")
    for row in result["rows"]:
        sent = sender_host.get(row["size_bytes"], 0.0) * 1e6 / row["messages"]
        row["sender_host_us_per_msg"] = sent
        row["host_us_per_msg"] = sent + row["receiver_host_us_per_msg"]
        row["hop_us"] = result["hop_us"]
    return result


def _run_fake(args: argparse.Namespace) -> dict[str, Any]:
    from dualpipe_kernels.transport.cuda_ipc import native_cuda_module

    mod = native_cuda_module()
    messages = 64 if args.quick else 256
    bursts = 3 if args.quick else max(3, args.iters)
    rows = mod.fake_host_cost(
        list(FAKE_SIZES), messages, bursts, args.num_slots, args.slot_bytes, args.direct_min_bytes, args.max_inflight
    )
    for r in rows:
        r["pass"] = r["host_us_per_msg"] <= FAKE_TARGET_US
    return {
        "mode": "fake-device",
        "device": "fake device (host memory; copies move no bytes while timed)",
        "host_cpus": os.cpu_count(),
        "num_slots": args.num_slots,
        "slot_bytes": args.slot_bytes,
        "direct_min_bytes": args.direct_min_bytes,
        "max_inflight": args.max_inflight,
        "rows": rows,
        "target_host_us_per_msg": FAKE_TARGET_US,
        "host_pass": all(r["pass"] for r in rows),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name, default in (("fake_device", False), ("max_inflight", 256), ("num_slots", 4), ("slot_bytes", 4 << 20),
                          ("direct_min_bytes", 1 << 20), ("iters", 7)):  # fmt: skip
        if not hasattr(args, name):
            setattr(args, name, default)
    reason = unavailable(args)
    if reason is not None:
        raise RuntimeError(reason)
    if args.fake_device:
        return _run_fake(args)
    if args.quick:
        args.min_size, args.max_size = min(args.min_size, 256), min(args.max_size, 64 << 20)
        args.iters, args.overlap_reps = min(args.iters, 3), min(args.overlap_reps, 2)
        args.overlap_bytes = min(args.overlap_bytes, 1 << 30)
    if not 0 < args.min_size <= args.max_size or args.iters < 1 or args.overlap_reps < 1:
        raise ValueError("need 0 < --min-size <= --max-size, --iters >= 1 and --overlap-reps >= 1")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dpk-bench-ipc-") as tmp:
        res = _spawn_pair(args, tmp)
    rows = res["rows"]
    big = [r for r in rows if r["size_bytes"] >= BANDWIDTH_MIN_SIZE]
    small = [r for r in rows if r["size_bytes"] == SMALL_MSG_BYTES]
    hop = res["hop_us"]
    return {
        "mode": "gpu",
        "device": torch.cuda.get_device_name(0),
        "staging_requested": args.staging,
        "staging": res["staging"],
        "signal_mechanism": res["signal_mechanism"],
        "num_slots": args.num_slots,
        "slot_bytes": args.slot_bytes,
        "direct_min_bytes": args.direct_min_bytes,
        "max_inflight": args.max_inflight,
        "iters": args.iters,
        "rows": rows,
        "hop_us": hop,
        "bandwidth_min_size": BANDWIDTH_MIN_SIZE,
        "bandwidth_target_ratio": BANDWIDTH_TARGET,
        "engine_over_bare_min": min((r["engine_over_bare"] for r in big), default=None),
        "bandwidth_pass": bool(big) and all(r["engine_over_bare"] >= BANDWIDTH_TARGET for r in big),
        "small_msg_bytes": SMALL_MSG_BYTES,
        "small_over_hop": small[0]["device_us_per_msg"] / hop if small and hop > 0 else None,
        "small_target": SMALL_TARGET,
        "small_pass": bool(small) and hop > 0 and small[0]["device_us_per_msg"] <= SMALL_TARGET * hop,
        "overlap": res["overlap"],
        "engine_stats": {"sender": res["sender_stats"], "receiver": res["stats"]},
    }
