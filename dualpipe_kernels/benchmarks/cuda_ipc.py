"""Bench suite ``cuda_ipc``: CUDA IPC point-to-point between two processes on one GPU, against a same-GPU copy.

Two spawned ranks share GPU 0 over ``CudaIpcTransport``; rank 0 sends, rank 1
receives and measures with CUDA events on its compute stream, from just before
it posts a burst of receives to the moment its stream has waited for all of
them (``wait_stream``, no host sync): end to end, the sender's side included.

- Bandwidth (GB/s = 1e9 payload bytes/s) per message size against the ceiling
  measured in the same process: a burst of ``dst.copy_(src)`` of the same size
  on the same GPU.  The target (IPC / copy >= 0.8) is judged at >= 64 MiB only:
  each message costs ~20-50 us of host work, which dominates small messages.
- Host cost per message: a burst of small (256 B) messages, in us per message.
- Compute and transfer together: a bf16 matmul loop sized to take about as
  long as a long transfer, alone and together; ``both / longer`` should stay
  <= 1.1 (copies run on copy engines, not SMs).

Every received buffer of every burst is checked (each sender buffer carries
its own byte value; receive buffers are zeroed before each burst).  Staging
defaults to "auto" (CUDA IPC where it works, pinned host rings otherwise); the
result says which one ran.  Without a CUDA GPU (or a CUDA build of the
extension) the suite is unavailable: :func:`unavailable` says why.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dualpipe_kernels.benchmarks.common import fmt, markdown_table

NAME = "cuda_ipc"
BANDWIDTH_TARGET = 0.8
#: bandwidth is judged from this message size on
BANDWIDTH_MIN_SIZE = 64 << 20
OVERLAP_TARGET = 1.1
LATENCY_MSG_BYTES = 256
LATENCY_BURST = 256
#: payload moved per burst, so that smaller messages are timed over many of them
BURST_BYTES = 512 << 20
MAX_BURST, MIN_BURST = 64, 4
#: distinct buffers per burst on each side (each checked)
BUFFERS = 4
OVERLAP_MSG_BYTES = 64 << 20
MATMUL_N = 8192


def unavailable() -> str | None:
    """None when this machine can run the suite, else a one-line reason."""
    if not torch.cuda.is_available():
        return "needs CUDA: no CUDA GPU is visible (torch.cuda.is_available() is False)"
    from dualpipe_kernels.transport import TransportError
    from dualpipe_kernels.transport.cuda_ipc import native_cuda_module

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
    p.add_argument("--min-size", type=_size, default=64 << 10, help="smallest message of the bandwidth sweep")
    p.add_argument("--max-size", type=_size, default=256 << 20, help="largest message (default 256M)")
    p.add_argument("--iters", type=int, default=7, help="timed bursts per size (median)")
    p.add_argument("--slot-bytes", type=_size, default=4 << 20)
    p.add_argument("--num-slots", type=int, default=4)
    p.add_argument("--staging", choices=("auto", "ipc", "host"), default="auto")
    p.add_argument("--direct-min-bytes", type=_size, default=1 << 20, help="zero-copy from this size on (0: never)")
    p.add_argument("--overlap-bytes", type=_size, default=16 << 30, help="bytes of the overlap transfer")
    p.add_argument("--overlap-reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds for the whole run and for each wait")


def sizes_between(lo: int, hi: int) -> list[int]:
    """lo, 4 lo, 16 lo, ... and hi itself."""
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    if not out or out[-1] != hi:
        out.append(hi)
    return out


class _Barrier:
    """Store barrier between the two ranks (host only, never inside a timed region)."""

    def __init__(self, store: dist.Store, timeout_s: float) -> None:
        self.store, self.n, self.timeout = store, 0, timedelta(seconds=timeout_s)

    def __call__(self) -> None:
        self.n += 1
        key = f"bench/barrier/{self.n}"
        if self.store.add(key, 1) == 2:
            self.store.set(key + "/done", "1")
        self.store.wait([key + "/done"], self.timeout)


def _timed_ms(fn: Any) -> float:
    """Milliseconds between two CUDA events around ``fn()`` on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _d2d_ms(size: int, burst: int, iters: int) -> float:
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up

    def run() -> None:
        for _ in range(burst):
            dst.copy_(src)

    return statistics.median(_timed_ms(run) for _ in range(iters))


def _burst(t: Any, rank: int, size: int, count: int, tag0: int, barrier: _Barrier, iters: int) -> list[float] | None:
    """``iters`` timed bursts of ``count`` messages 0 -> 1 (plus a warm-up); rank 1 returns their times (ms).

    Message i goes from sender buffer i % k (bytes all i % k + 1) to receiver
    buffer i % k; every receiver buffer is zeroed before a burst and checked after it.
    """
    k = min(count, BUFFERS)
    if rank == 0:
        bufs = [torch.full((size,), j + 1, dtype=torch.uint8, device="cuda") for j in range(k)]
        for _ in range(iters + 1):
            barrier()
            hs = [t.isend(bufs[i % k], 1, tag0 + i, what=f"{size} B message {i}") for i in range(count)]
            for h in hs:
                h.wait()
        return None
    bufs = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(k)]
    samples = []
    for it in range(iters + 1):
        for b in bufs:
            b.zero_()
        barrier()

        def receive() -> None:
            hs = [t.irecv(bufs[i % k], 0, tag0 + i, what=f"{size} B message {i}") for i in range(count)]
            for h in hs:
                h.wait_stream()

        ms = _timed_ms(receive)
        bad = [j for j, b in enumerate(bufs) if not bool((b == j + 1).all())]
        if bad:
            raise AssertionError(f"{size}-byte messages: receive buffers {bad} of {k} differ from the sender's")
        if it > 0:
            samples.append(ms)
    return samples


def _bandwidth_row(t: Any, rank: int, size: int, barrier: _Barrier, iters: int) -> dict[str, Any] | None:
    count = max(MIN_BURST, min(MAX_BURST, BURST_BYTES // size))
    samples = _burst(t, rank, size, count, 0, barrier, iters)
    if samples is None:
        return None
    ipc_ms, base_ms = statistics.median(samples), _d2d_ms(size, count, iters)
    ipc_gbps, d2d_gbps = size * count / ipc_ms / 1e6, size * count / base_ms / 1e6
    return {
        "size_bytes": size,
        "messages": count,
        "ipc_gbps": ipc_gbps,
        "d2d_gbps": d2d_gbps,
        "ratio": ipc_gbps / d2d_gbps,
        "us_per_msg": ipc_ms * 1e3 / count,
        "d2d_us_per_copy": base_ms * 1e3 / count,
        "buffers_checked": min(count, BUFFERS) * (iters + 1),
    }


def _overlap(t: Any, rank: int, barrier: _Barrier, args: argparse.Namespace) -> dict[str, Any]:
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
    one_mm = statistics.median(_timed_ms(lambda: [torch.mm(a, b) for _ in range(4)]) for _ in range(3)) / 4
    transfer = []
    for i in range(args.overlap_reps + 1):
        for buf in bufs:
            buf.zero_()
        barrier()
        ms = _timed_ms(lambda: [h.wait_stream() for h in receive()])
        check()
        if i > 0:
            transfer.append(ms)
    transfer_ms = statistics.median(transfer)
    count = max(1, round(transfer_ms / one_mm))
    compute_ms = statistics.median(
        _timed_ms(lambda: [torch.mm(a, b) for _ in range(count)]) for _ in range(args.overlap_reps)
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
        barrier()
        both.append(_timed_ms(together))
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


def _rank_main(rank: int, store_path: str, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    torch.cuda.set_device(0)
    from dualpipe_kernels.transport.cuda_ipc import CudaIpcTransport

    try:
        store = dist.FileStore(store_path, 2)
        barrier = _Barrier(store, args.timeout)
        t = CudaIpcTransport(
            rank=rank, world_size=2, store=store, device=0, num_slots=args.num_slots, slot_bytes=args.slot_bytes,
            staging=args.staging, direct_min_bytes=args.direct_min_bytes, timeout_s=args.timeout,
        )  # fmt: skip
        rows = [_bandwidth_row(t, rank, s, barrier, args.iters) for s in sizes_between(args.min_size, args.max_size)]
        lat = _burst(t, rank, LATENCY_MSG_BYTES, LATENCY_BURST, 1 << 19, barrier, args.iters)
        overlap = _overlap(t, rank, barrier, args)
        store.set(f"bench/stats/{rank}", json.dumps(t.stats()))  # e.g. IPC handles made (one per segment)
        barrier()
        staging = t.staging_with(1 - rank)
        t.close()
        if rank == 1:
            assert lat is not None
            us = statistics.median(lat) * 1e3 / LATENCY_BURST
            stats = {side: json.loads(store.get(f"bench/stats/{r}")) for r, side in enumerate(("sender", "receiver"))}
            out.put({"rows": rows, "latency_us_per_msg": us, "overlap": overlap, "staging": staging, "stats": stats})
    except Exception:  # noqa: BLE001 - reported to the parent
        out.put({"error": f"rank {rank}:\n{traceback.format_exc()}"})


def _spawn_pair(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dpk-bench-ipc-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(r, store, args, out), daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        try:
            result = out.get(timeout=args.timeout)
        except queue.Empty:
            result = {"error": f"no result within --timeout {args.timeout:.0f} s"}
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    if "error" in result:
        raise RuntimeError(f"bench cuda_ipc failed: {result['error']}")
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    if args.quick:
        args.min_size, args.max_size = min(args.min_size, 1 << 20), min(args.max_size, 64 << 20)
        args.iters, args.overlap_reps = min(args.iters, 3), min(args.overlap_reps, 2)
        args.overlap_bytes = min(args.overlap_bytes, 1 << 30)
    if not 0 < args.min_size <= args.max_size or args.iters < 1 or args.overlap_reps < 1:
        raise ValueError("need 0 < --min-size <= --max-size, --iters >= 1 and --overlap-reps >= 1")
    res = _spawn_pair(args)
    big = [r for r in res["rows"] if r["size_bytes"] >= BANDWIDTH_MIN_SIZE]
    return {
        "device": torch.cuda.get_device_name(0),
        "staging_requested": args.staging,
        "staging": res["staging"],
        "num_slots": args.num_slots,
        "slot_bytes": args.slot_bytes,
        "direct_min_bytes": args.direct_min_bytes,
        "iters": args.iters,
        "rows": res["rows"],
        "latency_msg_bytes": LATENCY_MSG_BYTES,
        "latency_us_per_msg": res["latency_us_per_msg"],
        "bandwidth_min_size": BANDWIDTH_MIN_SIZE,
        "bandwidth_target_ratio": BANDWIDTH_TARGET,
        "bandwidth_ratio_min": min((r["ratio"] for r in big), default=None),
        "bandwidth_pass": bool(big) and all(r["ratio"] >= BANDWIDTH_TARGET for r in big),
        "overlap": res["overlap"],
        "engine_stats": res["stats"],
    }


def to_markdown(result: dict[str, Any]) -> str:
    head = (
        f"CUDA IPC point-to-point on {result['device']} ({result['staging']} staging, asked "
        f"{result['staging_requested']}; {result['num_slots']} x {result['slot_bytes'] >> 10} KiB slots, zero-copy "
        f"from {result['direct_min_bytes']} B) vs `dst.copy_(src)` on the same GPU; every receive buffer checked."
    )
    table = markdown_table(
        result["rows"],
        ["size_bytes", "messages", "ipc_gbps", "d2d_gbps", "ratio", "us_per_msg"],
        ["size (B)", "msgs", "IPC GB/s", "copy GB/s", "IPC / copy", "us/msg"],
    )
    ratio = result["bandwidth_ratio_min"]
    verdict = "PASS" if result["bandwidth_pass"] else "FAIL"
    lines = [
        head,
        "",
        table,
        "",
        f"Min IPC / copy at >= {result['bandwidth_min_size'] >> 20} MiB: {fmt(ratio, 3)} "
        f"(target >= {result['bandwidth_target_ratio']}): {verdict}.",
        f"Host cost: {fmt(result['latency_us_per_msg'], 3)} us per {result['latency_msg_bytes']} B message.",
    ]
    o = result["overlap"]
    if o:
        lines.append(
            f"Compute + transfer: compute {fmt(o['compute_ms'], 4)} ms ({o['matmuls']} bf16 matmuls of "
            f"{o['matmul_n']}^3), transfer {fmt(o['transfer_ms'], 4)} ms ({o['transfer_bytes'] >> 20} MiB), both "
            f"{fmt(o['both_ms'], 4)} ms = {fmt(o['ratio'], 3)} x the longer (target <= {o['target']}): "
            f"{'PASS' if o['pass'] else 'FAIL'}."
        )
    return "\n".join(lines)
