"""``dualpipe-kernels plan``: choose schedule, PP x DP and micro-batches for a model on a cluster.

Contract (docs/architecture.md)::

    dualpipe-kernels plan --layers costs.json --devices 16 --devices-per-node 8 --memory-gb 80
        --global-batch 1024 [--json]

``--json`` prints ``{"best": {..., "partition": [...]}, "candidates": [{"schedule", "pp", "dp",
"microbatches", "microbatch_size", "memory_policy", "simulated_step_s", "peak_memory_bytes",
"feasible"}, ...]}`` plus ``explanation``, ``unit``, ``considered``, ``simulated``,
``elapsed_s`` (and ``layers_file`` with ``--profile``).  ``--profile`` measures the demo GPT
(or ``--model module:factory``) first and writes its layer table beside ``--out``
(``<out>.layers.json``; ``plan.layers.json`` without ``--out``).  Bad input: status 2, one line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from .argtypes import parse_float, parse_int
from .outputs import check_output_file

_GB = 1e9


def _finite(kind: str, minimum: float, strict: bool) -> Any:
    def parse(text: str) -> float:
        v = parse_float(text)
        if not math.isfinite(v) or (v <= minimum if strict else v < minimum):
            raise argparse.ArgumentTypeError(
                f"{kind} must be a finite number {'>' if strict else '>='} {minimum:g}, got {text}"
            )
        return v

    return parse


def _positive_int(text: str) -> int:
    v = parse_int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def add_parser(subparsers: Any) -> None:
    from ..planner.stages import PLAN_SCHEDULES

    p = subparsers.add_parser(
        "plan",
        help="plan schedule, PP x DP and micro-batches under a memory budget",
        description="Search schedules, PP/DP degrees and micro-batching with the simulator; print the best plans.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--layers", help="per-layer cost table (JSON, see docs/architecture.md)")
    src.add_argument("--profile", action="store_true", help="profile the demo GPT (or --model) first")
    p.add_argument("--model", default=None, help="module:factory for --profile (returns layers or (layers, sample))")
    p.add_argument("--repeats", type=_positive_int, default=5, help="profiling repeats (median)")
    p.add_argument("--devices", type=_positive_int, required=True)
    p.add_argument("--devices-per-node", type=_positive_int, default=None, help="default: all devices on one node")
    p.add_argument("--memory-gb", type=_finite("--memory-gb", 0, True), required=True, help="per device, 1 GB = 1e9 B")
    p.add_argument("--global-batch", type=_positive_int, required=True, help="samples per step")
    p.add_argument("--intra-bandwidth-gbps", type=_finite("bandwidth", 0, True), default=200.0, help="GB/s")
    p.add_argument("--intra-latency-us", type=_finite("latency", 0, False), default=5.0)
    p.add_argument("--inter-bandwidth-gbps", type=_finite("bandwidth", 0, True), default=25.0, help="GB/s")
    p.add_argument("--inter-latency-us", type=_finite("latency", 0, False), default=10.0)
    p.add_argument(
        "--state-multiplier",
        type=_finite("--state-multiplier", 1, False),
        default=4.0,
        help="bytes held per parameter byte (params + grads + Adam moments: 4)",
    )
    p.add_argument("--schedules", default=",".join(PLAN_SCHEDULES), help="comma-separated subset to search")
    p.add_argument("--pp", default=None, help="comma-separated PP degrees to search (default: every divisor)")
    p.add_argument(
        "--memory-policy",
        default="auto",
        choices=("auto", "keep", "recompute", "offload", "offload:bf16", "offload:fp8"),
        help="activation memory policy of every stage; auto searches keep, recompute, offload and its casts "
        "(offload:bf16, offload:fp8: a cheaper host link for the same device bytes)",
    )
    p.add_argument("--host-bandwidth-gbps", type=_finite("bandwidth", 0, True), default=25.0, help="offload link, GB/s")
    p.add_argument("--top", type=_positive_int, default=10, help="candidates to list")
    p.add_argument("--out", default=None, help="also write the JSON result here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def _table(args: argparse.Namespace) -> tuple[Any, str | None]:
    from ..planner.layers import load_layers, save_layers

    if args.layers is not None:
        if args.model is not None:
            raise ValueError("--model goes with --profile, not --layers")
        return load_layers(args.layers), None
    from ..planner.targets import profile_target

    table = profile_target(args.model, args.repeats)
    path = _layers_path(args)
    save_layers(table, path)
    return table, str(path)


def _layers_path(args: argparse.Namespace) -> Path:
    """Where ``--profile`` writes its layer table: beside ``--out`` (``plan.layers.json`` without it)."""
    out = Path(args.out) if args.out else Path("plan.json")
    return out.with_name(out.stem + ".layers.json")


class _Progress:
    """Progress lines on stderr for a long search: none in the first 2 s, then at most one per 2 s."""

    def __init__(self, every_s: float = 2.0) -> None:
        import time

        self._clock = time.monotonic
        self._start = self._last = self._clock()
        self._every = every_s

    def __call__(self, line: str) -> None:
        now = self._clock()
        if now - self._start >= self._every and now - self._last >= self._every:
            self._last = now
            sys.stderr.write(f"plan: {line} ({now - self._start:.0f} s)\n")
            sys.stderr.flush()


def _pp_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--pp must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--pp degrees must be >= 1, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    from ..planner.plan import Cluster, plan

    if args.out:  # before any work: a run never ends by failing to save
        check_output_file(args.out, "--out")
    if args.profile:
        check_output_file(str(_layers_path(args)), "--out (its layer table)")
    table, layers_file = _table(args)
    cluster = Cluster(
        devices=args.devices,
        devices_per_node=args.devices_per_node or args.devices,
        memory_bytes=args.memory_gb * _GB,
        intra_bandwidth=args.intra_bandwidth_gbps * _GB,
        intra_latency=args.intra_latency_us * 1e-6,
        inter_bandwidth=args.inter_bandwidth_gbps * _GB,
        inter_latency=args.inter_latency_us * 1e-6,
        host_bandwidth=args.host_bandwidth_gbps * _GB,
    )
    schedules = tuple(s.strip() for s in args.schedules.split(",") if s.strip())
    pp_degrees = _pp_list(args.pp) if args.pp is not None else None
    result = plan(
        table,
        cluster,
        args.global_batch,
        schedules=schedules,
        state_multiplier=args.state_multiplier,
        memory_policy=args.memory_policy,
        top=args.top,
        pp_degrees=pp_degrees,
        progress=_Progress(),
    )
    doc = {
        "best": result.best.to_dict(),
        "candidates": [c.to_dict() for c in result.candidates],
        "explanation": result.explanation,
        "unit": result.unit,
        "considered": result.considered,
        "simulated": result.simulated,
        "elapsed_s": result.elapsed_s,
    }
    if layers_file:
        doc["layers_file"] = layers_file
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    if args.json:
        print(json.dumps(doc))
    else:
        _print_table(result, layers_file)
    return 0


def _print_table(result: Any, layers_file: str | None) -> None:
    unit = result.unit
    head = (
        f"{'schedule':<16}{'pp':>4}{'dp':>6}{'mb x size':>12}{'step ' + unit:>14}"
        f"{'bubble':>11}{'allreduce':>11}{'mem GB':>9}  fits  policy"
    )
    lines = [head, "-" * len(head)]
    for c in result.candidates:
        mb = f"{c.microbatches}x{c.microbatch_size}"
        lines.append(
            f"{c.schedule:<16}{c.pp:>4}{c.dp:>6}{mb:>12}{c.simulated_step_s:>14.5g}{c.bubble_s:>11.4g}"
            f"{c.allreduce_s:>11.4g}{c.peak_memory_bytes / _GB:>9.3g}  {'yes' if c.feasible else 'NO ':<4}"
            f"  {c.memory_policy}"
        )
    lines.append(f"partition (layers per model stage): {list(result.best.partition)}")
    lines.extend(result.explanation)
    lines.append(f"{result.considered} configurations, {result.simulated} simulated, {result.elapsed_s:.2f} s")
    if layers_file:
        lines.append(f"layer table written to {layers_file}")
    sys.stdout.write("\n".join(lines) + "\n")
