"""CUDA IPC P2P benchmark: two processes on one GPU, against a same-GPU device-to-device copy.

Usage:
    python bench/bench_cuda_ipc.py [--json] [--min-size 4K] [--max-size 256M] [--iters 7]
                                   [--slot-bytes 4M] [--num-slots 4] [--staging ipc] [--timeout 300]

Two spawned ranks share GPU 0 over ``CudaIpcTransport``; rank 0 sends, rank 1
receives and measures.  For each message size (4 KiB .. 256 MiB, doubling by
4x) rank 1 times a burst of messages with CUDA events on its compute stream:
from just before it posts the receives to the moment its stream has waited for
all of them (``wait_stream``, no host sync), i.e. end to end including the
sender's side.  The ceiling, measured in the same run and process, is a burst
of ``dst.copy_(src)`` of the same size on the same GPU.  Reported: GB/s of
both (1 GB = 1e9 bytes of payload), the ratio (target >= 0.8) and the time per
message.  Medians over ``--iters`` bursts.

Overlap: rank 1 runs a bf16 matmul loop on its compute stream while receiving a
long burst; the loop is sized to take about as long as the burst alone.  The
ratio ``both / max(compute alone, transfer alone)`` should be <= 1.1 (the
copies run on copy engines, so they should not slow the matmuls).

Needs a CUDA GPU and a CUDA build of dualpipe_kernels._C.  With --json, one
JSON object goes to stdout (the table to stderr).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BANDWIDTH_TARGET = 0.8
OVERLAP_TARGET = 1.1
#: payload moved per burst, so that small messages are timed over many of them
BURST_BYTES = 512 << 20
MAX_BURST = 64
MIN_BURST = 4
#: overlap burst: this many bytes, in messages of OVERLAP_MSG_BYTES (two destination buffers reused)
OVERLAP_BYTES = 16 << 30
OVERLAP_MSG_BYTES = 64 << 20
MATMUL_N = 8192


def parse_size(text: str) -> int:
    """'4K', '256M', '1G' or a plain byte count."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def sizes_between(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    if out[-1] != hi:
        out.append(hi)
    return out


def burst_for(size: int) -> int:
    return max(MIN_BURST, min(MAX_BURST, BURST_BYTES // size))


class Barrier:
    """Store-based barrier between the two ranks (host only, not timed)."""

    def __init__(self, store: dist.Store, timeout_s: float) -> None:
        self.store, self.n, self.timeout = store, 0, timedelta(seconds=timeout_s)

    def __call__(self) -> None:
        self.n += 1
        key = f"bench/barrier/{self.n}"
        if self.store.add(key, 1) == 2:
            self.store.set(key + "/done", "1")
        self.store.wait([key + "/done"], self.timeout)


def timed(fn: Any) -> float:
    """Milliseconds between two CUDA events around ``fn()`` on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def d2d_ms(size: int, burst: int, iters: int) -> float:
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up

    def run() -> None:
        for _ in range(burst):
            dst.copy_(src)

    return statistics.median(timed(run) for _ in range(iters))


def matmul_loop(a: torch.Tensor, b: torch.Tensor, count: int) -> None:
    for _ in range(count):
        torch.mm(a, b)


def rank_main(rank: int, store_path: str, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    torch.cuda.set_device(0)
    from dualpipe_kernels.transport.cuda_ipc import CudaIpcTransport

    try:
        store = dist.FileStore(store_path, 2)
        barrier = Barrier(store, args.timeout)
        t = CudaIpcTransport(
            rank=rank, world_size=2, store=store, device=0, num_slots=args.num_slots,
            slot_bytes=args.slot_bytes, staging=args.staging, direct_min_bytes=args.direct_min_bytes,
            timeout_s=args.timeout,
        )  # fmt: skip
        rows = []
        for size in sizes_between(args.min_size, args.max_size):
            row = measure_size(t, rank, size, barrier, args)
            if row is not None:
                rows.append(row)
        overlap = run_overlap(t, rank, barrier, args)
        barrier()
        staging = t.staging_with(1 - rank)
        t.close()
        if rank == 1:
            out.put({"rows": rows, "overlap": overlap, "staging": staging})
    except Exception:  # noqa: BLE001 - reported to the parent
        out.put({"error": f"rank {rank}:\n{traceback.format_exc()}"})


def measure_size(t: Any, rank: int, size: int, barrier: Barrier, args: argparse.Namespace) -> dict[str, Any] | None:
    """Bursts of ``size``-byte messages 0 -> 1; rank 1 returns the row (rank 0: None)."""
    peer = 1 - rank
    burst = burst_for(size)
    bufs = [torch.full((size,), rank, dtype=torch.uint8, device="cuda") for _ in range(min(burst, 4))]

    def send_burst() -> None:
        hs = [t.isend(bufs[i % len(bufs)], peer, i) for i in range(burst)]
        for h in hs:
            h.wait()

    def receive_burst() -> None:
        hs = [t.irecv(bufs[i % len(bufs)], peer, i) for i in range(burst)]
        for h in hs:
            h.wait_stream()

    samples = []
    for it in range(args.iters + 1):  # the first burst is a warm-up
        barrier()
        if rank == 0:
            send_burst()
        else:
            ms = timed(receive_burst)
            if it > 0:
                samples.append(ms)
    if rank == 0:
        return None
    if not bool((bufs[0] == 0).all()):
        raise AssertionError(f"received {size}-byte payload differs from the sender's")
    ipc_ms = statistics.median(samples)
    base_ms = d2d_ms(size, burst, args.iters)
    ipc_gbps = size * burst / ipc_ms / 1e6
    d2d_gbps = size * burst / base_ms / 1e6
    return {
        "size_bytes": size,
        "messages": burst,
        "ipc_gbps": ipc_gbps,
        "d2d_gbps": d2d_gbps,
        "ratio": ipc_gbps / d2d_gbps,
        "us_per_msg": ipc_ms * 1e3 / burst,
        "d2d_us_per_copy": base_ms * 1e3 / burst,
    }


def run_overlap(t: Any, rank: int, barrier: Barrier, args: argparse.Namespace) -> dict[str, Any]:
    """compute alone, transfer alone, both together (rank 1 measures; rank 0 only sends)."""
    peer = 1 - rank
    messages = max(2, args.overlap_bytes // OVERLAP_MSG_BYTES)
    bufs = [torch.empty(OVERLAP_MSG_BYTES, dtype=torch.uint8, device="cuda") for _ in range(2)]

    def send_burst() -> None:
        hs = [t.isend(bufs[i % 2], peer, 10_000 + i) for i in range(messages)]
        for h in hs:
            h.wait()

    if rank == 0:
        for _ in range(2 * args.overlap_reps + 1):  # transfer alone (incl. warm-up), then both
            barrier()
            send_burst()
        return {}

    def recv_burst() -> None:
        hs = [t.irecv(bufs[i % 2], peer, 10_000 + i) for i in range(messages)]
        for h in hs:
            h.wait_stream()

    a = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    one_mm = statistics.median(timed(lambda: matmul_loop(a, b, 4)) for _ in range(3)) / 4
    transfer = []
    for i in range(args.overlap_reps + 1):
        barrier()
        ms = timed(recv_burst)
        if i > 0:
            transfer.append(ms)
    transfer_ms = statistics.median(transfer)
    count = max(1, round(transfer_ms / one_mm))
    compute_ms = statistics.median(timed(lambda: matmul_loop(a, b, count)) for _ in range(args.overlap_reps))

    both = []
    for _ in range(args.overlap_reps):
        barrier()

        def together() -> None:
            hs = [t.irecv(bufs[i % 2], peer, 10_000 + i) for i in range(messages)]
            matmul_loop(a, b, count)  # queued on the compute stream while the copies run on the comm stream
            for h in hs:
                h.wait_stream()

        both.append(timed(together))
    both_ms = statistics.median(both)
    longer = max(compute_ms, transfer_ms)
    return {
        "transfer_bytes": messages * OVERLAP_MSG_BYTES,
        "matmuls": count,
        "matmul_n": MATMUL_N,
        "compute_ms": compute_ms,
        "transfer_ms": transfer_ms,
        "both_ms": both_ms,
        "ratio": both_ms / longer,
        "target": OVERLAP_TARGET,
        "pass": both_ms / longer <= OVERLAP_TARGET,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dpk-bench-ipc-") as tmp:
        procs = [
            ctx.Process(target=rank_main, args=(r, os.path.join(tmp, "store"), args, out), daemon=True)
            for r in range(2)
        ]
        for p in procs:
            p.start()
        try:
            result = out.get(timeout=args.timeout)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    if "error" in result:
        raise RuntimeError(result["error"])
    rows = result["rows"]
    big = [r for r in rows if r["size_bytes"] >= (1 << 20)]
    return {
        "benchmark": "cuda_ipc_p2p",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "staging": result["staging"],
        "num_slots": args.num_slots,
        "slot_bytes": args.slot_bytes,
        "direct_min_bytes": args.direct_min_bytes,
        "iters": args.iters,
        "rows": rows,
        "bandwidth_target_ratio": BANDWIDTH_TARGET,
        "bandwidth_ratio_min_ge_1MiB": min((r["ratio"] for r in big), default=None),
        "bandwidth_pass": bool(big) and all(r["ratio"] >= BANDWIDTH_TARGET for r in big),
        "overlap": result["overlap"],
    }


def print_table(res: dict[str, Any], file: Any) -> None:
    print(
        f"CUDA IPC P2P on {res['device']} ({res['staging']} staging, {res['num_slots']} x "
        f"{res['slot_bytes'] >> 10} KiB slots, zero-copy from {res['direct_min_bytes']} B) "
        "vs dst.copy_(src) on the same GPU",
        file=file,
    )
    print(f"{'size':>10} {'msgs':>5} {'ipc GB/s':>10} {'d2d GB/s':>10} {'ipc/d2d':>8} {'us/msg':>9}", file=file)
    for r in res["rows"]:
        print(
            f"{r['size_bytes']:>10} {r['messages']:>5} {r['ipc_gbps']:>10.1f} {r['d2d_gbps']:>10.1f} "
            f"{r['ratio']:>8.2f} {r['us_per_msg']:>9.1f}",
            file=file,
        )
    print(
        f"min ipc/d2d at >= 1 MiB: {res['bandwidth_ratio_min_ge_1MiB']:.2f} (target >= {BANDWIDTH_TARGET}): "
        f"{'PASS' if res['bandwidth_pass'] else 'FAIL'}",
        file=file,
    )
    o = res["overlap"]
    print(
        f"overlap: compute {o['compute_ms']:.1f} ms ({o['matmuls']} x {o['matmul_n']}^3 bf16 matmul), transfer "
        f"{o['transfer_ms']:.1f} ms ({o['transfer_bytes'] >> 20} MiB), both {o['both_ms']:.1f} ms = "
        f"{o['ratio']:.2f} x the longer (target <= {OVERLAP_TARGET}): {'PASS' if o['pass'] else 'FAIL'}",
        file=file,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    p.add_argument("--min-size", type=parse_size, default=4 << 10)
    p.add_argument("--max-size", type=parse_size, default=256 << 20)
    p.add_argument("--iters", type=int, default=7, help="timed bursts per size (median)")
    p.add_argument("--slot-bytes", type=parse_size, default=4 << 20)
    p.add_argument("--num-slots", type=int, default=4)
    p.add_argument("--staging", choices=["auto", "ipc", "host"], default="ipc")
    p.add_argument(
        "--direct-min-bytes", type=parse_size, default=1 << 20, help="zero-copy sends from this size on (0: never)"
    )
    p.add_argument("--overlap-bytes", type=parse_size, default=OVERLAP_BYTES)
    p.add_argument("--overlap-reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run and for each wait")
    args = p.parse_args(argv)
    if not 0 < args.min_size <= args.max_size:
        p.error("need 0 < --min-size <= --max-size")
    if args.iters < 1 or args.overlap_reps < 1:
        p.error("--iters and --overlap-reps must be >= 1")
    if not torch.cuda.is_available():
        print("bench_cuda_ipc: no CUDA GPU visible (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    res = run(args)
    res["wall_s"] = time.perf_counter() - t0
    print_table(res, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
