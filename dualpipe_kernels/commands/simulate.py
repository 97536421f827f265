"""``dualpipe-kernels simulate``: build a schedule, simulate it, print and export.

Contract (docs/architecture.md)::

    dualpipe-kernels simulate --schedule NAME --ranks R --microbatches N [--stages-per-rank V]
        [--f F --b B --w W --fb FB] [--comm-latency S --comm-bandwidth BYTES_PER_S --activation-bytes N]
        [--json] [--trace FILE.json] [--png FILE.png] [--csv FILE.csv]

Extras: ``--ranks-per-node``, ``--inter-latency``, ``--inter-bandwidth``,
``--blocking-comm``, ``--ascii`` (force the grid), ``--events`` (events in JSON),
``--memory-policy P`` (with ``--activation-bytes``/``--saved-bytes``, ``--kept-bytes``,
``--host-bandwidth``, ``--compress-cost``, ``--reload-lookahead``): peak saved bytes per
rank under P, and P's time cost in the makespan (JSON: ``memory_policy``,
``peak_saved_bytes_per_rank``, ``peak_saved_bytes``).
Costs are in seconds when combined with comm settings (latency in s,
bandwidth in bytes/s); otherwise in any unit.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from ..schedules.costs import CommModel, CostModel, Num
from ..schedules.generators import SCHEDULE_NAMES, build_schedule
from ..schedules.limits import check_schedule_size
from ..schedules.memory_model import MEMORY_POLICIES, ChunkBytes, peak_saved_bytes, policy_costs
from ..schedules.simulator import SimResult, reference_bubble, simulate
from ..schedules.validate import validate
from .argtypes import parse_float, parse_int
from .outputs import check_output_file

_ASCII_MAX_STEPS = 50  # print the grid only when every rank's list is this short (or with --ascii)
_PROGRESS_FROM = 20_000  # ranks x micro-batches from which the stages of the run are reported on stderr (~1 s)


def _progress(on: bool, line: str) -> None:
    if on:
        sys.stderr.write(f"simulate: {line}\n")
        sys.stderr.flush()


def _number(text: str) -> Num:
    """A finite number: an int when the text is integral (so JSON stays exact), else a float."""
    value = _bandwidth(text)
    if math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _bandwidth(text: str) -> Num:
    """Like :func:`_number`, but 'inf' is allowed (an unlimited link)."""
    value = parse_float(text)
    if math.isnan(value):
        raise argparse.ArgumentTypeError("NaN is not a valid number")
    if math.isfinite(value) and value == int(value) and "." not in text and "e" not in text.lower():
        return int(value)
    return value


def _nonnegative(text: str) -> Num:
    """A finite number >= 0."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_bandwidth(text: str) -> Num:
    """A number > 0 bytes/s ('inf': an unlimited link)."""
    value = _bandwidth(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 bytes/s, got {text}")
    return value


def _count(minimum: int) -> Any:
    def parse(text: str) -> int:
        value = parse_int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text}")
        return value

    return parse


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulate a pipeline schedule with a cost model",
        description="Build a schedule, validate it, simulate it, print a summary (or --json) and export.",
    )
    p.add_argument("--schedule", required=True, choices=SCHEDULE_NAMES)
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--stages-per-rank", type=int, default=None, help="interleaved1f1b chunks per rank (default 2)")
    costs = p.add_argument_group("compute costs (per stage chunk)")
    costs.add_argument("--f", type=_number, default=1, help="forward (default 1)")
    costs.add_argument("--b", type=_number, default=2, help="full backward (default 2)")
    costs.add_argument("--w", type=_number, default=1, help="weight-gradient part of B (default 1)")
    costs.add_argument("--fb", type=_number, default=None, help="overlapped F&B pair (default F + B)")
    comm = p.add_argument_group("communication")
    comm.add_argument("--comm-latency", type=_number, default=0, help="seconds per transfer (intra-node)")
    comm.add_argument("--comm-bandwidth", type=_bandwidth, default=math.inf, help="bytes/s (intra-node; inf: free)")
    comm.add_argument("--activation-bytes", type=_number, default=0, help="bytes per transfer")
    comm.add_argument("--ranks-per-node", type=int, default=None, help="default: all ranks on one node")
    comm.add_argument("--inter-latency", type=_number, default=None, help="seconds (default: --comm-latency)")
    comm.add_argument("--inter-bandwidth", type=_bandwidth, default=None, help="bytes/s (default: --comm-bandwidth)")
    comm.add_argument("--blocking-comm", action="store_true", help="a send blocks its rank until it arrives")
    mem = p.add_argument_group("activation memory (schedules/memory_model.py)")
    mem.add_argument("--memory-policy", choices=MEMORY_POLICIES, default=None, help="print peak saved bytes per rank")
    mem.add_argument(
        "--saved-bytes",
        type=_nonnegative,
        default=None,
        help="saved bytes of a chunk per micro-batch (default: activation)",
    )
    mem.add_argument(
        "--kept-bytes", type=_nonnegative, default=0, help="of those, bytes that never move (stage inputs)"
    )
    mem.add_argument(
        "--host-bandwidth", type=_positive_bandwidth, default=math.inf, help="offload host link, bytes/s (> 0)"
    )
    mem.add_argument("--compress-cost", type=_nonnegative, default=0, help="compress: seconds per saved byte (>= 0)")
    mem.add_argument(
        "--reload-lookahead", type=_count(0), default=2, help="offload: computes a reload runs ahead (>= 0)"
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--events", action="store_true", help="with --json: include every event")
    out.add_argument("--ascii", action="store_true", help="always print the ASCII grid")
    out.add_argument("--trace", metavar="FILE.json", help="write a chrome trace (Perfetto)")
    out.add_argument("--png", metavar="FILE.png", help="write a PNG timeline")
    out.add_argument("--csv", metavar="FILE.csv", help="write the compute-only schedule as CSV")
    p.set_defaults(func=run)


def _summary(res: SimResult, ref: Num | None) -> str:
    lines = [
        f"{res.schedule}: {res.ranks} ranks, {res.stages} stages, {res.microbatches} micro-batches",
        f"  makespan {float(res.makespan):g}; busiest rank computes {float(max(res.busy_per_rank)):g} "
        f"({float(max(res.busy_per_rank) / res.makespan):.1%} of makespan)",
        f"  bubble (max idle over ranks) {float(res.bubble):g} = {res.bubble_ratio:.1%} of makespan; "
        f"idle share of all rank-time {res.idle_ratio:.1%}",
    ]
    if ref is not None:
        ratio = f"{float(res.bubble / ref):.3f}" if ref else ("1.000" if res.bubble == 0 else "inf")
        lines.append(f"  reference-table bubble {float(ref):g}; simulated / reference = {ratio}")
    lines.append(
        f"  peak activations {res.peak_activations} chunks (per rank {res.peak_activations_per_rank}); "
        f"params {res.params_per_rank} chunks per rank"
    )
    lines.append(f"  p2p: {res.num_transfers} transfers, {float(res.p2p_bytes):g} bytes")
    return "\n".join(lines)


def _finite_or_none(x: Num | None) -> Num | None:
    """JSON has no infinity: an unlimited bandwidth is written as null."""
    return None if x is None or math.isinf(x) else x


def _check_outputs(args: argparse.Namespace) -> None:
    """Every export path is writable, before the simulation runs (ValueError: exit 2, one line)."""
    for option, path in (("--trace", args.trace), ("--png", args.png), ("--csv", args.csv)):
        if path:
            check_output_file(path, option)


def _export(args: argparse.Namespace, schedule: Any, res: SimResult) -> dict[str, str]:
    """Write the requested files; return ``{kind: path}`` of what was written."""
    written: dict[str, str] = {}
    if args.trace:
        from ..schedules.trace import write_chrome_trace

        write_chrome_trace(
            args.trace, res.events, schedule=res.schedule, ranks=res.ranks, microbatches=res.microbatches
        )
        written["trace"] = args.trace
    if args.png:
        from ..schedules.plot import plot_timeline

        plot_timeline(res, args.png)
        written["png"] = args.png
    if args.csv:
        from ..schedules.csv_io import to_csv, torch_incompatibility

        to_csv(schedule, args.csv)
        written["csv"] = args.csv
        reason = torch_incompatibility(schedule)
        if reason is not None:
            print(f"note: torch.distributed.pipelining cannot run {args.csv}: {reason}", file=sys.stderr)
    return written


def run(args: argparse.Namespace) -> int:
    _check_outputs(args)
    check_schedule_size(args.ranks, args.microbatches * (args.stages_per_rank or 1))
    long_run = args.ranks * args.microbatches >= _PROGRESS_FROM
    _progress(long_run, f"building {args.schedule} for {args.ranks} ranks x {args.microbatches} micro-batches")
    schedule = build_schedule(args.schedule, args.ranks, args.microbatches, args.stages_per_rank)
    _progress(long_run, "validating")
    program = validate(schedule)  # simulate() below reuses it instead of validating again
    cost = CostModel(f=args.f, b=args.b, w=args.w, fb=args.fb)
    comm = CommModel(
        latency=args.comm_latency,
        bandwidth=args.comm_bandwidth,
        activation_bytes=args.activation_bytes,
        ranks_per_node=args.ranks_per_node,
        inter_latency=args.inter_latency,
        inter_bandwidth=args.inter_bandwidth,
        blocking=args.blocking_comm,
    )
    memory: dict[str, Any] | None = None
    if args.memory_policy is not None:
        saved = args.activation_bytes if args.saved_bytes is None else args.saved_bytes
        sizes = ChunkBytes(saved, args.kept_bytes)
        cost = policy_costs(
            schedule, cost, args.memory_policy, sizes, args.host_bandwidth, args.compress_cost, args.reload_lookahead
        )
        peaks = peak_saved_bytes(schedule, args.memory_policy, sizes, args.reload_lookahead)
        memory = {"memory_policy": args.memory_policy, "peak_saved_bytes_per_rank": peaks}
        memory["peak_saved_bytes"] = max(peaks)
    _progress(long_run, "simulating")
    res = simulate(schedule, cost, comm, program=program)
    if not math.isfinite(float(res.makespan)):
        raise ValueError(
            f"the costs overflow: the simulated makespan is {float(res.makespan)} (a float holds at most 1.8e308); "
            "use smaller costs, byte counts or a larger bandwidth"
        )
    ref = reference_bubble(schedule.name, schedule.num_ranks, cost)

    # Exports first, so a --json consumer sees complete files once the JSON is printed.
    written = _export(args, schedule, res)
    for kind, path in written.items():
        print(f"wrote {kind} {path}", file=sys.stderr)

    if args.json:
        d = res.to_dict(events=args.events)
        d["stages_per_rank"] = res.params_per_rank
        d["reference_bubble"] = None if ref is None else (ref if isinstance(ref, int) else float(ref))
        d["written"] = written
        d["costs"] = {"f": args.f, "b": args.b, "w": args.w, "fb": args.f + args.b if args.fb is None else args.fb}
        d["comm"] = {
            "latency": args.comm_latency,
            "bandwidth": _finite_or_none(args.comm_bandwidth),
            "inter_latency": args.inter_latency,
            "inter_bandwidth": _finite_or_none(args.inter_bandwidth),
            "activation_bytes": args.activation_bytes,
            "ranks_per_node": args.ranks_per_node,
            "blocking": args.blocking_comm,
        }
        if memory is not None:
            d.update(memory)
        sys.stdout.write(json.dumps(d, allow_nan=False) + "\n")  # strict JSON: no NaN/Infinity
        return 0

    print(_summary(res, ref))
    if memory is not None:
        shown = ", ".join(f"{float(x):g}" for x in memory["peak_saved_bytes_per_rank"])
        print(f"  memory policy {args.memory_policy}: peak saved bytes per rank [{shown}] (makespan includes its cost)")
    longest = max(len(list(schedule.compute_actions(r))) for r in range(schedule.num_ranks))
    if args.ascii or longest <= _ASCII_MAX_STEPS:
        from ..schedules.ascii import to_ascii

        print(to_ascii(schedule, comms=False))
    return 0
