"""Point-to-point bandwidth and latency between two processes: native shared memory vs torch.distributed gloo.

Two spawned CPU processes (one thread each) bounce a message back and forth
(ping-pong) for every size; the one-way time is half the median round trip,
bandwidth = size / one-way time.  Each rank's Python thread is bound to its
own core once the transports are up (``--no-pin`` to let it float; the
engine's and gloo's threads always float), as latency benchmarks bind their
ranks: on a small VM two spinning waiters otherwise often share one core and
a round trip then measures the scheduler.

The ceiling is what any same-host transport must do: a same-size copy whose
source was just written by another core (a thread pinned to one core writes
the buffer, a thread pinned to another copies it out; single torch thread),
measured on rank 0 in the same run (``cross_core_copy_gbps``).  The
single-thread copy of a buffer already in this core's cache
(``memcpy_gbps``, ``dst.copy_(src)``) is a second column only: it swings
with cache residency (e.g. 44 GB/s at 1 MiB in one run, 4.9 GB/s in another).
Every figure is the median over repeats, with the spread (``*_min``,
``*_max``).  Every row carries the ratios the targets are stated in: native /
gloo bandwidth (target >= 5 at >= 1 MiB), native / ceiling
(``native_over_ceiling``, target >= 0.5 at >= 1 MiB) and native / gloo
latency (target <= 0.2 for the smallest size).  For sizes that fit one ring
slot, ``packed_in_place_us`` / ``packed_copy_us`` time a packed message
(``isend_packed`` of four fp32 tensors, unpacked on arrival) with the native
transport packing straight into the reserved ring slot vs packing into a
buffer that the engine copies in (``pack_in_place=False``).  Numbers from a
shared machine are noisy.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from dualpipe_kernels.benchmarks.common import allowed_cpus, markdown_table, pin_to_core, pingpong

NAME = "transport"
KIB = 1024
MIB = 1024 * 1024
#: message sizes of a full run: 4 KiB, 16 KiB, ..., 64 MiB (powers of 4)
DEFAULT_SIZES = tuple(4 * KIB * 4**k for k in range(8))
QUICK_SIZES = (4 * KIB, 64 * KIB, 1 * MIB, 4 * MIB)
#: target thresholds (see the module docstring)
BW_TARGET_SIZE = 1 * MIB
BW_VS_GLOO_TARGET = 5.0
BW_VS_CEILING_TARGET = 0.5
LATENCY_RATIO_TARGET = 0.2
#: bytes moved per size and method (both ways), which sets the repetition count
BYTES_PER_SIZE = 96 * MIB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min-size", type=int, default=None, help="smallest message in bytes (default 4096)")
    parser.add_argument("--max-size", type=int, default=None, help="largest message in bytes (default 64 MiB)")
    parser.add_argument("--max-reps", type=int, default=1000, help="ping-pongs per size at most (default 1000)")
    parser.add_argument("--min-reps", type=int, default=5, help="ping-pongs per size at least (default 5)")
    parser.add_argument("--num-slots", type=int, default=None, help="native ring slots (default: transport default)")
    parser.add_argument(
        "--slot-bytes", type=int, default=None, help="native slot size in bytes (default: transport default)"
    )
    parser.add_argument(
        "--spin-us", type=float, default=None, help="native spin before sleeping, in us (default: transport default)"
    )
    parser.add_argument(
        "--single-copy",
        choices=("auto", "on", "off"),
        default="auto",
        help="native single-copy path for large messages: auto = DUALPIPE_KERNELS_SINGLE_COPY (default on), "
        "off = every message through the ring",
    )
    parser.add_argument(
        "--single-copy-min-bytes",
        type=int,
        default=None,
        help="smallest message that goes single-copy (default: transport default)",
    )
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="do not bind each rank's Python thread to its own core (default: bind, when >= 2 cores)",
    )


@dataclass(frozen=True)
class TransportConfig:
    """The suite's settings: message sizes with their ping-pong counts, and the native engine's options."""

    sizes: tuple[int, ...]
    reps: tuple[int, ...]
    num_slots: int
    slot_bytes: int
    spin_us: float | None
    single_copy: bool | None  # None: the engine's default (DUALPIPE_KERNELS_SINGLE_COPY)
    single_copy_min_bytes: int
    pin: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TransportConfig:
        from dualpipe_kernels.transport.native import (
            DEFAULT_NUM_SLOTS,
            DEFAULT_SINGLE_COPY_MIN_BYTES,
            DEFAULT_SLOT_BYTES,
        )

        quick = bool(getattr(args, "quick", False))
        sizes = list(QUICK_SIZES if quick else DEFAULT_SIZES)
        lo = args.min_size if args.min_size is not None else sizes[0]
        hi = args.max_size if args.max_size is not None else sizes[-1]
        if lo <= 0 or hi < lo:
            raise ValueError(f"need 0 < --min-size <= --max-size, got {lo}, {hi}")
        picked = [s for s in sizes if lo <= s <= hi] or [lo]
        rmin, rmax = (2, 20) if quick else (args.min_reps, args.max_reps)
        if rmin < 1 or rmax < rmin:
            raise ValueError(f"need 1 <= --min-reps <= --max-reps, got {rmin}, {rmax}")
        single_copy = getattr(args, "single_copy", "auto")
        engine = {  # given values are checked here, not replaced by the defaults (a 0 is not "unset")
            "--num-slots": (args.num_slots, 2),
            "--slot-bytes": (args.slot_bytes, 64),
            "--single-copy-min-bytes": (getattr(args, "single_copy_min_bytes", None), 1),
        }
        for option, (value, least) in engine.items():
            if value is not None and value < least:
                raise ValueError(f"{option} must be >= {least}, got {value}")
        if args.spin_us is not None and not (math.isfinite(args.spin_us) and args.spin_us >= 0):
            raise ValueError(f"--spin-us must be a finite number >= 0, got {args.spin_us}")
        min_copy = getattr(args, "single_copy_min_bytes", None)
        return cls(
            sizes=tuple(picked),
            reps=tuple(max(rmin, min(rmax, BYTES_PER_SIZE // (2 * s))) for s in picked),
            num_slots=DEFAULT_NUM_SLOTS if args.num_slots is None else args.num_slots,
            slot_bytes=DEFAULT_SLOT_BYTES if args.slot_bytes is None else args.slot_bytes,
            spin_us=args.spin_us,
            single_copy=None if single_copy == "auto" else single_copy == "on",
            single_copy_min_bytes=DEFAULT_SINGLE_COPY_MIN_BYTES if min_copy is None else min_copy,
            pin=bool(getattr(args, "pin", True)),
        )

    def native_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``NativeTransport`` (options left unset keep the engine's defaults)."""
        kw: dict[str, Any] = {
            "num_slots": self.num_slots,
            "slot_bytes": self.slot_bytes,
            "single_copy_min_bytes": self.single_copy_min_bytes,
        }
        if self.spin_us is not None:
            kw["spin_us"] = self.spin_us
        if self.single_copy is not None:
            kw["single_copy"] = self.single_copy
        return kw


def _packed_pingpong(rank: int, native: Any, peer: int, size: int, reps: int) -> dict[str, Any]:
    """One-way times (us) of a packed message of ``size`` bytes (4 fp32 tensors, lossless): ``isend_packed``
    packing straight into the ring slot vs into a buffer the engine then copies in; the receiver unpacks
    into preallocated tensors.  Both ranks send the same tensors, so rank 0 checks what came back."""
    from dualpipe_kernels.kernels import plan_layout, unpack

    g = torch.Generator().manual_seed(size)
    ts = [torch.randn(size // 16, generator=g) for _ in range(4)]
    layout = plan_layout([(t.dtype, t.shape) for t in ts], "packed")
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    outs = [torch.empty_like(t) for t in ts]

    def send(_: torch.Tensor) -> None:
        native.isend_packed(ts, layout, peer, 3).wait()

    def recv(_: torch.Tensor) -> None:
        native.irecv(buf, peer, 3).wait()
        unpack(buf, layout, out=outs)

    out: dict[str, Any] = {}
    for key, in_place in (("in_place", True), ("copy", False)):
        native.pack_in_place = in_place
        dist.barrier()
        one_way = [t / 2 for t in pingpong(rank, send, recv, buf, buf, reps)]
        if rank == 0:  # (rank 1 echoes and times nothing)
            out[f"packed_{key}_us"] = statistics.median(one_way) * 1e6
            out[f"packed_{key}_bit_exact"] = all(torch.equal(a, b) for a, b in zip(ts, outs, strict=True))
    native.pack_in_place = True
    if rank == 0:
        out["packed_in_place_speedup"] = out["packed_copy_us"] / out["packed_in_place_us"]
    return out


def _memcpy_times(size: int, reps: int) -> list[float]:
    """Times of single-thread copies of ``size`` bytes whose source sits in this core's cache (warm buffers)."""
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.zeros(size, dtype=torch.uint8)
    times = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        dst.copy_(src)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


def _pin_thread_to(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})  # pid 0: on Linux, the calling thread only


def _cross_core_copy_times(size: int, reps: int) -> list[float]:
    """Times of copying ``size`` bytes that a thread on another core has just written (the transport ceiling).

    A writer thread pinned to one allowed core fills the source, then a reader thread pinned to another
    copies it out; only the copy is timed.  With one allowed core both threads share it (noted by the caller).
    """
    cpus = allowed_cpus() if hasattr(os, "sched_setaffinity") else []  # the threads are pinned to two of them
    writer_cpu, reader_cpu = (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)
    src = torch.zeros(size, dtype=torch.uint8)
    dst = torch.zeros(size, dtype=torch.uint8)
    written, copied = threading.Semaphore(0), threading.Semaphore(0)
    times: list[float] = []
    errors: list[BaseException] = []

    def writer() -> None:
        _pin_thread_to(writer_cpu)
        for i in range(reps + 2):
            src.fill_(i & 0xFF)
            written.release()
            if not copied.acquire(timeout=60):
                return

    def reader() -> None:
        try:
            _pin_thread_to(reader_cpu)
            for i in range(reps + 2):
                if not written.acquire(timeout=60):
                    raise TimeoutError("cross-core copy: the writer thread did not write within 60 s")
                t0 = time.perf_counter()
                dst.copy_(src)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
                copied.release()
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(e)
            copied.release()

    threads = [threading.Thread(target=writer, daemon=True), threading.Thread(target=reader, daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    if not times or int(dst[0]) != (reps + 1) & 0xFF:
        raise RuntimeError(f"cross-core copy of {size} B did not complete its {reps} repeats")
    return times


def _spread(prefix: str, size: int, one_way_s: list[float]) -> dict[str, float]:
    """Median bandwidth (GB/s) over repeats and its min-max: ``{prefix}_gbps``, ``_gbps_min``, ``_gbps_max``."""
    med = statistics.median(one_way_s)
    return {
        f"{prefix}_gbps": size / med / 1e9,
        f"{prefix}_gbps_min": size / max(one_way_s) / 1e9,
        f"{prefix}_gbps_max": size / min(one_way_s) / 1e9,
    }


def _worker(rank: int, world_size: int, cfg: TransportConfig) -> list[dict]:
    from dualpipe_kernels.transport.native import NativeTransport

    torch.set_num_threads(1)
    peer = 1 - rank
    native = NativeTransport(timeout_s=120.0, **cfg.native_kwargs())
    single_copy_active = peer in native.single_copy_peers()
    rows = []
    try:
        # One exchange each way first: the engine's worker threads start on first use and must
        # not inherit the pinning below (nor gloo's, started with the process group).
        warm_out, warm_in = torch.zeros(1), torch.zeros(1)
        pingpong(
            rank,
            lambda t: native.isend(t, peer, tag=9).wait(),
            lambda t: native.irecv(t, peer, tag=9).wait(),
            warm_out,
            warm_in,
            0,
        )
        core = pin_to_core(rank) if cfg.pin else None
        for size, n in zip(cfg.sizes, cfg.reps, strict=True):
            out_buf = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
            in_buf = torch.zeros(size, dtype=torch.uint8)
            row: dict[str, Any] = {"size_bytes": size, "reps": n, "pinned_core": core}
            row["native_path"] = "single-copy" if single_copy_active and size >= cfg.single_copy_min_bytes else "ring"

            def nsend(t: torch.Tensor) -> None:
                native.isend(t, peer, tag=1).wait()

            def nrecv(t: torch.Tensor) -> None:
                native.irecv(t, peer, tag=1).wait()

            def gsend(t: torch.Tensor) -> None:
                dist.send(t, dst=peer, tag=2)

            def grecv(t: torch.Tensor) -> None:
                dist.recv(t, src=peer, tag=2)

            dist.barrier()
            native_rtt = pingpong(rank, nsend, nrecv, out_buf, in_buf, n)
            if rank == 0:
                row["native_bit_exact"] = bool(torch.equal(in_buf, out_buf))
            in_buf.zero_()
            dist.barrier()
            gloo_rtt = pingpong(rank, gsend, grecv, out_buf, in_buf, n)
            if rank == 0:
                row["gloo_bit_exact"] = bool(torch.equal(in_buf, out_buf))
            if size <= cfg.slot_bytes and size % 64 == 0:  # a packed message that fits one ring slot
                row.update(_packed_pingpong(rank, native, peer, size, n))
            dist.barrier()  # rank 1 idles while rank 0 measures the ceiling
            if rank == 0:
                rows.append(_figures(row, size, n, native_rtt, gloo_rtt))
            dist.barrier()
    finally:
        native.close()
    return rows


def _figures(row: dict[str, Any], size: int, reps: int, native_rtt: list[float], gloo_rtt: list[float]) -> dict:
    """Rank 0's row: both transports' one-way figures and the two copy references measured now, with ratios."""
    native_s = [t / 2 for t in native_rtt]
    gloo_s = [t / 2 for t in gloo_rtt]
    row.update(_spread("native", size, native_s))
    row.update(_spread("gloo", size, gloo_s))
    row.update(_spread("memcpy", size, _memcpy_times(size, reps)))
    row.update(_spread("cross_core_copy", size, _cross_core_copy_times(size, reps)))
    row.update(
        native_latency_us=statistics.median(native_s) * 1e6,
        native_latency_us_min=min(native_s) * 1e6,
        native_latency_us_max=max(native_s) * 1e6,
        gloo_latency_us=statistics.median(gloo_s) * 1e6,
        gloo_latency_us_min=min(gloo_s) * 1e6,
        gloo_latency_us_max=max(gloo_s) * 1e6,
    )
    row["native_vs_gloo"] = row["native_gbps"] / row["gloo_gbps"]
    row["native_over_ceiling"] = row["native_gbps"] / row["cross_core_copy_gbps"]
    row["gloo_over_ceiling"] = row["gloo_gbps"] / row["cross_core_copy_gbps"]
    row["native_vs_memcpy"] = row["native_gbps"] / row["memcpy_gbps"]
    row["latency_ratio"] = row["native_latency_us"] / row["gloo_latency_us"]
    return row


def _targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    big = [r for r in rows if r["size_bytes"] >= BW_TARGET_SIZE]
    small = min(rows, key=lambda r: r["size_bytes"])
    return {
        "bandwidth_vs_gloo": {
            "target": f">= {BW_VS_GLOO_TARGET} at >= {BW_TARGET_SIZE} B",
            "worst": min((r["native_vs_gloo"] for r in big), default=None),
            "met": bool(big) and all(r["native_vs_gloo"] >= BW_VS_GLOO_TARGET for r in big),
        },
        "bandwidth_vs_ceiling": {
            "target": f">= {BW_VS_CEILING_TARGET} of the cross-core copy at >= {BW_TARGET_SIZE} B",
            "worst": min((r["native_over_ceiling"] for r in big), default=None),
            "met": bool(big) and all(r["native_over_ceiling"] >= BW_VS_CEILING_TARGET for r in big),
        },
        "latency_vs_gloo": {
            "target": f"<= {LATENCY_RATIO_TARGET} at {small['size_bytes']} B",
            "value": small["latency_ratio"],
            "met": small["latency_ratio"] <= LATENCY_RATIO_TARGET,
        },
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the suite in two spawned processes; returns ``{"rows": [...], "targets": {...}, "config": {...}}``."""
    from dualpipe_kernels.runtime.launch import spawn

    cfg = TransportConfig.from_args(args)
    t0 = time.perf_counter()
    rows = spawn(_worker, 2, cfg, timeout_s=600.0)[0]
    return {
        "rows": rows,
        "targets": _targets(rows),
        "config": {
            **asdict(cfg),
            "method": "ping-pong between 2 processes, one-way time = round trip / 2, median (min-max) over "
            "repeats; ceiling = cross-core copy (one thread writes, a thread on another core copies it out), "
            "memcpy = single-thread in-cache torch copy_, both on rank 0 in the same run",
            "threads_per_process": 1,
            "python_thread_pinned": cfg.pin,
        },
        "elapsed_s": time.perf_counter() - t0,
    }


def _with_spread(row: dict[str, Any], key: str) -> str:
    lo, hi = row.get(f"{key}_min"), row.get(f"{key}_max")
    if row.get(key) is None:
        return "-"
    return f"{row[key]:.3g}" + (f" ({lo:.3g}-{hi:.3g})" if lo is not None and hi is not None else "")


def to_markdown(result: dict[str, Any]) -> str:
    spread = ("native_gbps", "gloo_gbps", "cross_core_copy_gbps", "memcpy_gbps", "native_latency_us", "gloo_latency_us")
    rows = [{**r, **{f"{k}_text": _with_spread(r, k) for k in spread}} for r in result["rows"]]
    cols = [
        "size_bytes",
        "native_path",
        "native_gbps_text",
        "gloo_gbps_text",
        "cross_core_copy_gbps_text",
        "native_over_ceiling",
        "native_vs_gloo",
        "memcpy_gbps_text",
        "native_latency_us_text",
        "gloo_latency_us_text",
        "latency_ratio",
        "packed_in_place_us",
        "packed_copy_us",
        "packed_in_place_speedup",
    ]
    heads = [
        "size (B)",
        "native path",
        "native GB/s",
        "gloo GB/s",
        "cross-core copy GB/s (ceiling)",
        "native / ceiling",
        "native / gloo",
        "in-cache copy_ GB/s",
        "native latency (us)",
        "gloo latency (us)",
        "native / gloo latency",
        "packed, in slot (us)",
        "packed, via copy (us)",
        "copy / in slot",
    ]
    lines = ["Medians over repeats, (min-max) in brackets.", "", markdown_table(rows, cols, heads), ""]
    for name, t in result.get("targets", {}).items():
        got = t.get("worst", t.get("value"))
        shown = "-" if got is None else f"{got:.3g}"
        lines.append(f"- {name}: {shown} (target {t['target']}): {'met' if t['met'] else 'NOT met'}")
    cfg = result.get("config", {})
    lines.append(
        f"\nnative ring: {cfg.get('num_slots')} slots x {cfg.get('slot_bytes')} B; single copy from "
        f"{cfg.get('single_copy_min_bytes')} B (when permitted); {cfg.get('method', '')}. "
        "Timings on a shared machine are noisy."
    )
    return "\n".join(lines)
