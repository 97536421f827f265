"""kernels: pack/unpack bandwidth per format, size and tensor count, vs a plain copy and vs unfused torch.

For every format (``packed`` lossless, ``bf16``, ``fp8``), input dtype (fp32, bf16,
fp16: ``--dtypes``), total size (bytes of the inputs) and number of tensors (the size split evenly), three things are
timed in the same run on the same device:

* ours: :func:`dualpipe_kernels.kernels.pack` into a preallocated buffer (and
  :func:`unpack` into preallocated tensors): one Triton launch on a GPU, the torch
  fallback on CPU (the row's ``backend`` says which);
* copy: ``dst.copy_(src)`` of the same number of input bytes (the bandwidth ceiling);
* torch: the unfused way, ``torch.cat`` of the flattened tensors then the cast
  (fp8: blockwise absmax, divide, cast), and for unpack ``split`` then cast/copy.

Bandwidth counts the bytes each operation must move (read + written): for pack,
the inputs plus the packed buffer; for unpack the reverse; for the copy twice its
size.  ``ours`` and ``torch`` move the same logical bytes, so ``ours_vs_torch`` is
a speed ratio; ``ours_vs_copy`` is the fraction of the copy's bandwidth reached.
Each figure is a median over samples (each sample repeats the call until it has
moved about 64 MiB); ``ours_spread`` is (max - min) / median of ours.  ``ours_us`` is one call's time
from that median and ``ours_host_us`` the host's time per call with no device wait: on a GPU, where the
host's reaches the call's, the launch path sets the figure, not the kernel.  The calls repeat on the same
tensors, so after the first a launch reuses its table on the device (``pack_triton._TABLES``); a call
on tensors at new addresses also stages the table through pinned memory and copies it (a few us more).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from dualpipe_kernels.benchmarks.common import Progress, int_list, markdown_table
from dualpipe_kernels.kernels import pack, resolve_backend, unpack
from dualpipe_kernels.kernels.layout import LayoutCache
from dualpipe_kernels.kernels.pack_torch import dequantize_fp8, quantize_fp8

NAME = "kernels"
KIB, MIB = 1024, 1024 * 1024
FORMATS = {"packed": None, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
#: input dtypes (``--dtypes``): fp32 and the activations' bf16 / fp16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUICK_DTYPES = ("fp32", "bf16")
DEFAULT_SIZES = (64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)
#: a GPU-less run stops at 64 MiB by default (the fallback on two shared cores takes seconds per call above it)
CPU_MAX_SIZE = 64 * MIB
QUICK_SIZES = (64 * KIB, 1 * MIB)
DEFAULT_COUNTS = (1, 8, 64)
QUICK_COUNTS = (1, 8)
#: bytes moved per timed sample (small sizes repeat the call within one sample)
SAMPLE_BYTES = 64 * MIB

__all__ = ["NAME", "add_arguments", "run", "to_markdown", "write_plots"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma list among {','.join(FORMATS)}")
    p.add_argument(
        "--dtypes",
        default=None,
        help=f"input dtypes, comma list among {','.join(DTYPES)} (default all; quick: fp32,bf16)",
    )
    p.add_argument(
        "--sass",
        action="store_true",
        help="no timing: compile every launch variant for sm_90 (no GPU needed) with the installed Triton and with "
        "the GPU machine's (a side directory, see --other-triton), and report registers per thread, programs per "
        "SM and SASS instructions per element of the fast path",
    )
    p.add_argument(
        "--other-triton",
        default="auto",
        help="with --sass: a directory holding another Triton to compile with too; 'auto' (default): "
        "$DUALPIPE_TRITON_DIR or ~/.cache/dualpipe-kernels/triton-3.6.0, pip-installed there when missing; 'none'",
    )
    p.add_argument(
        "--sizes", type=int_list, default=None, help="total input bytes, comma list (default 64 KiB .. 256 MiB)"
    )
    p.add_argument("--max-size", type=int, default=None, help="drop sizes above this (default: 64 MiB on CPU)")
    p.add_argument("--num-tensors", type=int_list, default=None, help="tensors per pack, comma list (default 1,8,64)")
    p.add_argument("--samples", type=int, default=None, help="timed samples per figure (default 7; quick 3)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when present")
    p.add_argument(
        "--variants",
        type=_variants,
        default=None,
        help="Triton launch shapes to compare, ROWSxPROGRAMS[g] comma list (rows of 128 per block, programs per SM; "
        "a trailing g: the one generic kernel instead of the variant compiled for each launch's table), "
        "e.g. 16x32,16x32g,16x8: each is timed (ours only) at the sizes >= 64 MiB, after the main table",
    )


def _variants(text: str) -> list[tuple[int, int, bool]]:
    """argparse type: ``16x8,32x4g`` -> [(16, 8, False), (32, 4, True)] (rows a power of two, positive
    programs; True: the generic kernel)."""
    out = []
    for part in text.split(","):
        spec = part.strip().lower()
        generic = spec.endswith("g")
        try:
            rows, progs = (int(x) for x in spec.removesuffix("g").split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--variants: {part!r} is not ROWSxPROGRAMS[g] (e.g. 16x8)") from None
        if rows < 1 or rows & (rows - 1) or progs < 1:
            raise argparse.ArgumentTypeError(f"--variants: {part!r}: rows must be a power of two, programs >= 1")
        out.append((rows, progs, generic))
    return out


def _min_calls(device: torch.device) -> int:
    """Calls per timed sample at least: on a GPU 10 back to back, so a call's host work overlaps the previous
    call's kernel (ours and torch's alike); on CPU one."""
    return 10 if device.type == "cuda" else 1


def _ours(ts: list[torch.Tensor], dtype: torch.dtype | None) -> tuple[Any, int, dict[str, Callable[[], Any]]]:
    """(the layout, bytes read + written by one call, ``{"pack": call, "unpack": call}``) of our kernels on
    ``ts``, packing through a layout cache as the runtime does (the layout is planned once per signature)."""
    cache = LayoutCache()
    buf, layout = pack(ts, dtype, cache=cache)
    outs = [torch.empty_like(t) for t in ts]
    moved = sum(t.numel() * t.element_size() for t in ts) + layout.nbytes
    calls = {"pack": lambda: pack(ts, dtype, out=buf, cache=cache), "unpack": lambda: unpack(buf, layout, out=outs)}
    return layout, moved, calls


def _variant_rows(cfg: dict[str, Any], timer: Any, copies: dict[int, float]) -> list[dict[str, Any]]:
    """Ours at each launch shape of ``--variants`` (Triton on a GPU only), sizes >= 64 MiB, 1 and most tensors."""
    from dualpipe_kernels.kernels import pack_triton as pt

    device, samples, out = cfg["device"], cfg["samples"], []
    saved = (pt.rows_override, pt.PROGRAMS_PER_SM, pt.specialize)
    sizes = [s for s in cfg["sizes"] if s >= 64 * MIB]
    counts = sorted({1, max(cfg["counts"])})
    try:
        for rows, progs, generic in cfg["variants"]:
            pt.rows_override, pt.PROGRAMS_PER_SM, pt.specialize = rows, progs, not generic
            for size in sizes:
                for count in counts:
                    for fmt in cfg["formats"]:
                        _, moved, calls = _ours(_inputs(size, count, device), FORMATS[fmt])
                        for kernel, fn in calls.items():
                            gbps, spread = _measure(fn, moved, samples, timer, _min_calls(device))
                            name = f"{rows}x{progs}{'g' if generic else ''}"
                            out.append({"variant": name, "kernel": kernel, "format": fmt,
                                        "num_tensors": count, "bytes": size, "ours_gbps": gbps,
                                        "ours_vs_copy": gbps / copies[size], "ours_spread": spread})  # fmt: skip
    finally:
        pt.rows_override, pt.PROGRAMS_PER_SM, pt.specialize = saved
    return out


def _config(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(getattr(args, "quick", False))
    fmts = [f.strip() for f in str(args.formats).split(",") if f.strip()]
    if not fmts or any(f not in FORMATS for f in fmts):
        raise ValueError(f"--formats must be among {','.join(FORMATS)}, got {args.formats}")
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    sizes = args.sizes or list(QUICK_SIZES if quick else DEFAULT_SIZES)
    max_size = args.max_size if args.max_size is not None else (CPU_MAX_SIZE if device.type == "cpu" else None)
    sizes = [s for s in sizes if max_size is None or s <= max_size]
    if not sizes:
        raise ValueError(f"no size left at or below --max-size {max_size}")
    counts = args.num_tensors or list(QUICK_COUNTS if quick else DEFAULT_COUNTS)
    samples = args.samples if args.samples is not None else (3 if quick else 7)
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    variants = getattr(args, "variants", None) or []
    given = getattr(args, "dtypes", None)
    dnames = [d.strip() for d in (given or ",".join(QUICK_DTYPES if quick else DTYPES)).split(",") if d.strip()]
    if not dnames or any(d not in DTYPES for d in dnames):
        raise ValueError(f"--dtypes must be among {','.join(DTYPES)}, got {given}")
    return {
        "dtypes": dnames,
        "formats": fmts,
        "device": device,
        "sizes": sizes,
        "counts": counts,
        "samples": samples,
        "variants": variants,
    }


# ---------------------------------------------------------------- timing
def _sampler(device: torch.device) -> Callable[[Callable[[], Any], int], float]:
    """``time(fn, calls)``: seconds per call of ``fn`` over ``calls`` calls (device-synchronised)."""

    def cpu(fn: Callable[[], Any], calls: int) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls

    def cuda(fn: Callable[[], Any], calls: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls

    return cuda if device.type == "cuda" else cpu


def _measure(
    fn: Callable[[], Any], moved: int, samples: int, timer: Callable[..., float], min_calls: int = 1
) -> tuple[float, float]:
    """(median GB/s, spread = (max - min) / median of the per-call times) of ``fn`` moving ``moved`` bytes.

    Each sample times at least ``min_calls`` calls back to back (on a GPU: 10, so that a call's host work
    overlaps the previous call's kernel, as in a training step, for ours and torch's alike)."""
    calls = max(min_calls, min(200, SAMPLE_BYTES // max(moved, 1)))
    timer(fn, 1)  # warm-up (Triton compiles on the first call)
    times = [timer(fn, calls) for _ in range(samples)]
    med = statistics.median(times)
    return moved / med / 1e9, (max(times) - min(times)) / med


def _host_us(fn: Callable[[], Any], device: torch.device, calls: int = 20, samples: int = 3) -> float:
    """Microseconds of host time per call of ``fn``: the calls back to back with no device wait, median of
    ``samples`` rounds.  On a GPU, a call whose host time reaches its device time cannot keep the device busy
    (the launch path, not the kernel, sets the figure); on the CPU it is the whole call."""
    times = []
    for _ in range(samples):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(times) * 1e6


# ---------------------------------------------------------------- the unfused torch way
def _torch_pack(ts: list[torch.Tensor], dtype: torch.dtype | None) -> Any:
    flat = torch.cat([t.reshape(-1) for t in ts])
    if dtype is None:
        return flat
    if dtype == torch.bfloat16:
        return flat.to(torch.bfloat16)
    return quantize_fp8(flat)


def _torch_unpack(packed: Any, ts: list[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
    sizes = [t.numel() for t in ts]
    if dtype is None:
        return [p.clone() for p in torch.split(packed, sizes)]
    if dtype == torch.bfloat16:
        return [p.to(torch.float32) for p in torch.split(packed, sizes)]
    return list(torch.split(dequantize_fp8(*packed), sizes))


# ---------------------------------------------------------------- one configuration
def _inputs(total: int, count: int, device: torch.device, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """``count`` tensors of ``dtype`` of ``total`` bytes in all (the last takes the remainder)."""
    n = max(count, total // dtype.itemsize)
    sizes = [n // count] * (count - 1) + [n - n // count * (count - 1)]
    g = torch.Generator(device=device).manual_seed(count)
    return [torch.randn(s, generator=g, device=device).to(dtype) for s in sizes]


def _rows_for(
    fmt: str, total: int, count: int, cfg: dict[str, Any], timer: Any, copy: Any, dname: str = "fp32"
) -> list[dict[str, Any]]:
    device, samples, dtype = cfg["device"], cfg["samples"], FORMATS[fmt]
    ts = _inputs(total, count, device, DTYPES[dname])
    in_bytes = sum(t.numel() * t.element_size() for t in ts)
    layout, moved, our_calls = _ours(ts, dtype)
    packed_torch = _torch_pack(ts, dtype)
    torch_calls = {"pack": lambda: _torch_pack(ts, dtype), "unpack": lambda: _torch_unpack(packed_torch, ts, dtype)}
    k = _min_calls(device)
    figures = {
        kernel: (_measure(fn, moved, samples, timer, k), _measure(torch_calls[kernel], moved, samples, timer, k))
        for kernel, fn in our_calls.items()
    }
    host = {kernel: _host_us(fn, device) for kernel, fn in our_calls.items()}
    rows = []
    for kernel, ((ours, spread), (theirs, _)) in figures.items():
        rows.append(
            {
                "kernel": kernel,
                "format": fmt,
                "dtype": dname,
                "num_tensors": count,
                "bytes": in_bytes,
                "wire_bytes": layout.nbytes,
                "ours_gbps": ours,
                "copy_gbps": copy,
                "torch_gbps": theirs,
                "ours_vs_copy": ours / copy,
                "ours_vs_torch": ours / theirs,
                "ours_spread": spread,
                # per call: the device's time (from the bandwidth) and the host's (launch path included)
                "ours_us": moved / ours / 1e3,
                "ours_host_us": host[kernel],
                "device": cfg["device_name"],
                "backend": cfg["backend"],
            }
        )
    return rows


def _copy_gbps(total: int, cfg: dict[str, Any], timer: Any) -> float:
    src = torch.randn(total // 4, device=cfg["device"])
    dst = torch.empty_like(src)
    k = _min_calls(cfg["device"])
    return _measure(lambda: dst.copy_(src), 2 * src.numel() * 4, cfg["samples"], timer, k)[0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = _config(args)
    device = cfg["device"]
    backend = resolve_backend(device)
    cfg["backend"] = "triton" if backend == "triton" else "torch fallback"
    cfg["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if device.type == "cpu":
        torch.set_num_threads(1)  # one core, as the ratios against the copy assume; the machine is shared
    timer = _sampler(device)
    if getattr(args, "sass", False):
        return _sass(cfg, str(getattr(args, "other_triton", "auto")))
    combos = [(s, c, f, d) for s in cfg["sizes"] for c in cfg["counts"] for f in cfg["formats"] for d in cfg["dtypes"]]
    bar = Progress(len(combos), "bench kernels")
    rows: list[dict[str, Any]] = []
    copies: dict[int, float] = {}
    for size, count, fmt, dname in combos:
        if size not in copies:
            copies[size] = _copy_gbps(size, cfg, timer)
        rows += _rows_for(fmt, size, count, cfg, timer, copies[size], dname)
        bar.update(f"{fmt} {dname} x{count} {size} B")
    bar.close()
    variants: list[dict[str, Any]] = []
    if cfg.get("variants"):
        if backend != "triton" or device.type != "cuda":
            sys.stderr.write("bench kernels: --variants needs the Triton kernels on a GPU; skipped\n")
        else:
            for size in cfg["sizes"]:
                if size >= 64 * MIB and size not in copies:
                    copies[size] = _copy_gbps(size, cfg, timer)
            variants = _variant_rows(cfg, timer, copies)
    if device.type == "cpu":
        sys.stderr.write("bench kernels: no GPU: timing the torch fallback on CPU (one thread)\n")
    return {
        "rows": rows,
        "variants": variants,
        "device": cfg["device_name"],
        "backend": cfg["backend"],
        "config": {k: v for k, v in cfg.items() if k in ("formats", "dtypes", "sizes", "counts", "samples")},
        "note": "GB/s = bytes read + written per second; copy = dst.copy_(src) of the input size; "
        "torch = torch.cat + cast (unpack: split + cast), unfused",
    }


def _sass(cfg: dict[str, Any], other: str) -> dict[str, Any]:
    """``--sass``: the offline sm_90 analysis (:mod:`dualpipe_kernels.kernels.offline`) under the installed Triton
    and, when it can be had, the GPU machine's."""
    from dualpipe_kernels.kernels import offline

    fmts = tuple(cfg["formats"])
    rows = offline.analyse(fmts, workers=min(8, os.cpu_count() or 1))
    tritons = [rows[0]["triton_version"]] if rows else []
    path = None if other == "none" else (offline.triton_dir() if other == "auto" else other)
    if other not in ("auto", "none") and not os.path.isdir(other):
        raise ValueError(f"--other-triton {other}: not a directory")
    if path is None and other == "auto":
        sys.stderr.write(f"bench kernels --sass: Triton {offline.GPU_TRITON} could not be installed; skipped\n")
    if path is not None and offline.GPU_TRITON not in tritons:
        more = offline.analyse_with(path, fmts)
        rows += more
        tritons += [more[0]["triton_version"]] if more else []
    return {"rows": rows, "mode": "sass", "triton_versions": tritons, "target": "sm_90 (cuda 90), 4 warps",
            "note": "registers per thread and programs of 4 warps per SM of each launch variant; "
            "sass_per_element: SASS instructions of the fast path's loop per element a thread converts "
            "(contiguous variants)"}  # fmt: skip


def to_markdown(result: dict[str, Any]) -> str:
    if result.get("mode") == "sass":
        cols = ["kernel", "format", "variant", "contiguous", "triton_version", "registers", "programs_per_sm",
                "sass_per_element"]  # fmt: skip
        return "\n".join([f"Offline build for {result.get('target')}, Triton {', '.join(result['triton_versions'])}.",
                          "", markdown_table(result["rows"], cols), "", str(result.get("note", ""))])  # fmt: skip
    cols = ["kernel", "format", "dtype", "num_tensors", "bytes", "wire_bytes", "ours_gbps", "copy_gbps", "torch_gbps",
            "ours_vs_copy", "ours_vs_torch", "ours_spread", "ours_us", "ours_host_us"]  # fmt: skip
    heads = ["kernel", "format", "input dtype", "tensors", "input bytes", "wire bytes", "ours GB/s",
             "copy GB/s (ceiling)", "torch cat+cast GB/s", "ours / copy", "ours / torch", "spread", "us / call",
             "host us / call"]  # fmt: skip
    head = f"Device: {result.get('device')}; backend: {result.get('backend')}."
    if result.get("device") == "cpu":
        head += " No GPU: these are the torch fallback's figures on one CPU thread, not the Triton kernel's."
    parts = [head, "", markdown_table(result["rows"], cols, heads), "", str(result.get("note", ""))]
    if result.get("variants"):
        vcols = ["variant", "kernel", "format", "num_tensors", "bytes", "ours_gbps", "ours_vs_copy", "ours_spread"]
        vheads = ["rows x programs/SM (g: generic)", "kernel", "format", "tensors", "input bytes", "ours GB/s",
                  "ours / copy", "spread"]  # fmt: skip
        parts += ["", "Launch shapes (--variants):", "", markdown_table(result["variants"], vcols, vheads)]
    return "\n".join(parts)


def write_plots(result: dict[str, Any], out_dir: Any) -> list[Any]:
    """``kernels_bandwidth.png``: GB/s vs input size, ours and torch per kernel and format (most tensors)."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.get("rows", []) if r.get("dtype", "fp32") == "fp32"]  # the plot: fp32 inputs
    if not rows or result.get("mode") == "sass":
        return []
    most = max(r["num_tensors"] for r in rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, kernel in zip(axes, ("pack", "unpack"), strict=True):
        mine = [r for r in rows if r["kernel"] == kernel and r["num_tensors"] == most]
        for fmt in FORMATS:
            pts = sorted((r["bytes"], r["ours_gbps"], r["torch_gbps"]) for r in mine if r["format"] == fmt)
            if pts:
                xs, ours, theirs = zip(*pts, strict=True)
                line = ax.plot(xs, ours, marker="o", label=f"ours {fmt}")[0]
                ax.plot(xs, theirs, linestyle=":", color=line.get_color(), label=f"torch {fmt}")
        copies = sorted({(r["bytes"], r["copy_gbps"]) for r in mine})
        if copies:
            ax.plot(*zip(*copies, strict=True), color="black", linestyle="--", label="copy (ceiling)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("input bytes (fp32 inputs)")
        ax.set_title(f"{kernel}, {most} tensors, {result.get('backend')}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s (read + written)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    path = Path(out_dir) / "kernels_bandwidth.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
