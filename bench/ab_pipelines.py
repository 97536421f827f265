"""Two pipeline settings taking turns step by step in the same rank processes: ``python bench/ab_pipelines.py``.

On a shared machine a setting measured in one launch and another in the next
differ by the machine's phase as much as by the setting (the short-chunk row
moved 20% between launches minutes apart).  Here each rank builds two
pipelines of the same DualPipeV schedule and sleep chunks (1/2/1 ms, the
short-chunk row's), each on its own native transport, and runs their steps in
turns (A B, then B A, ...), so both see the same load.  Printed: per setting the
median step (the slowest rank's) with its quartiles and the busiest rank's CPU
per step, then the median over rounds of the paired difference A - B.

Settings are JSON objects: ``NativeTransport`` keyword arguments, plus, under
``wire``, ``WireOptions`` fields of the pipeline (``inline_limit_bytes``: the
inline data limit, 32768 is the limit without ``Transport.message_inline_bytes``;
``recv_lookahead``, ``early_small_receives``...; an unknown one is an error).
Example (the large-message change)::

    python bench/ab_pipelines.py --a '{"wire": {"inline_limit_bytes": 32768}}' --b '{}' --rounds 24
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> tuple[dict[str, list[float]], dict[str, list[float]], Any]:
    import torch
    import torch.distributed as dist

    from dualpipe_kernels.benchmarks.sleep_stages import SleepStage, sleep_batch, sleep_criterion
    from dualpipe_kernels.runtime import Pipeline, WireOptions
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.transport.native import NativeTransport

    torch.set_num_threads(1)
    sched = build_schedule("dualpipev", world, cfg["microbatches"])
    modules = {s: SleepStage(1e-3, 2e-3, 1e-3) for s in sched.stages_of_rank(rank)}
    pipes: dict[str, Any] = {}
    transports = []
    for name in ("A", "B"):
        kw = dict(cfg[name])
        wire = kw.pop("wire", {})
        tr = NativeTransport(**kw)
        transports.append(tr)
        try:
            options = WireOptions(tr, **wire)
        except TypeError as exc:  # an unknown field
            raise ValueError(f"setting {name}: {exc}") from exc
        pipes[name] = Pipeline(sched, modules, wire=options)
    applied = {
        n: {"inline_limit_bytes": p.inline_limit_bytes, "early_small_receives": p.early_small_receives}
        for n, p in pipes.items()
    }
    x = sleep_batch(cfg["microbatches"], cfg["activation_bytes"])
    labels = torch.zeros(x.shape[0])
    times: dict[str, list[float]] = {"A": [], "B": []}
    cpu: dict[str, list[float]] = {"A": [], "B": []}
    try:
        for k in range(cfg["rounds"] + cfg["warmup"]):
            for name in ("A", "B") if k % 2 == 0 else ("B", "A"):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                pipes[name].step(x, labels=(labels,), criterion=sleep_criterion)
                if k >= cfg["warmup"]:
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
    finally:
        for pipe in pipes.values():
            pipe.close()
        for tr in transports:
            tr.close()
    return times, cpu, applied


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from dualpipe_kernels.runtime.launch import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", default="{}", help="setting A (JSON)")
    p.add_argument("--b", default="{}", help="setting B (JSON)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--activation-bytes", type=int, default=1 << 18)
    p.add_argument("--rounds", type=int, default=24, help="measured rounds (one step of each setting)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    args = p.parse_args(argv)
    cfg = {
        "A": json.loads(args.a),
        "B": json.loads(args.b),
        "microbatches": args.microbatches,
        "activation_bytes": args.activation_bytes,
        "rounds": args.rounds,
        "warmup": args.warmup,
    }
    per_rank = spawn(_worker, args.ranks, cfg, timeout_s=900)
    out: dict[str, Any] = {}
    steps = {n: [max(r[0][n][i] for r in per_rank) for i in range(args.rounds)] for n in ("A", "B")}
    for n in ("A", "B"):
        q = statistics.quantiles(steps[n], n=4) if len(steps[n]) > 1 else [steps[n][0]] * 3
        busiest = statistics.median(max(r[1][n][i] for r in per_rank) for i in range(args.rounds))
        out[n] = {"median_s": statistics.median(steps[n]), "q1_s": q[0], "q3_s": q[2], "busiest_cpu_s": busiest}
        print(
            f"{n} {cfg[n]}: step median {out[n]['median_s'] * 1e3:.1f} ms (quartiles {q[0] * 1e3:.1f}-"
            f"{q[2] * 1e3:.1f}), busiest rank's CPU {busiest * 1e3:.1f} ms per step"
        )
    out["applied"] = [r[2] for r in per_rank]  # per rank: what each pipeline ran with
    out["a_minus_b_s"] = statistics.median(a - b for a, b in zip(steps["A"], steps["B"], strict=True))
    print(f"A - B, median over rounds of the paired difference: {out['a_minus_b_s'] * 1e3:+.2f} ms")
    return out


if __name__ == "__main__":
    main()
