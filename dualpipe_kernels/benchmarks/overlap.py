"""overlap: share of communication hidden behind compute, per transport, on sleep-timed DualPipeV stages.

For each transport and activation size, three measured DualPipeV steps on the
same ranks and schedule:

* compute alone (T_compute): stages sleep F / I / W, activations of 4 bytes;
* communication alone (T_comm): stages cost nothing, activations of the set size;
* both (T_step): stages sleep and exchange the set size.

``hidden_comm_share`` = (T_compute + T_comm - T_step) / T_comm: 1 when every
transfer hid behind compute, 0 when none did (each figure is a median over
steps of the slowest rank's step time).  ``compute_vs_simulated`` compares
T_compute with the simulator's prediction for the same costs.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

NAME = "overlap"
TRANSPORTS = ("torch", "native")

__all__ = ["NAME", "TRANSPORTS", "add_arguments", "run", "to_markdown"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dualpipe_kernels.benchmarks.schedules import _int_list

    p.add_argument("--transports", default=",".join(TRANSPORTS), help="comma list (default torch,native)")
    p.add_argument(
        "--sizes",
        type=_int_list,
        default=None,
        help="activation bytes per transfer, comma list (default 262144,4194304; quick 65536)",
    )
    p.add_argument("--ranks", type=int, default=2, help="pipeline ranks (default 2)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches (default 8; quick 4)")
    p.add_argument("--f-ms", type=float, default=None, help="forward of one chunk, ms (default 10; quick 2)")
    p.add_argument("--b-ms", type=float, default=None, help="full backward of one chunk, ms (default 20; quick 4)")
    p.add_argument("--w-ms", type=float, default=None, help="weight-gradient part, ms (default 10; quick 2)")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 3; quick 1)")


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    q = bool(getattr(args, "quick", False))

    def pick(name: str, full: Any, quick: Any) -> Any:
        v = getattr(args, name, None)
        return v if v is not None else (quick if q else full)

    transports = [t.strip() for t in str(getattr(args, "transports", ",".join(TRANSPORTS))).split(",") if t.strip()]
    bad = [t for t in transports if t not in TRANSPORTS]
    if not transports or bad:
        raise ValueError(f"--transports must be among {', '.join(TRANSPORTS)}, got {','.join(transports)}")
    cfg = {
        "transports": transports,
        "sizes": pick("sizes", [1 << 18, 1 << 22], [1 << 16]),
        "ranks": int(getattr(args, "ranks", 2)),
        "microbatches": pick("microbatches", 8, 4),
        "f_s": pick("f_ms", 10.0, 2.0) / 1e3,
        "b_s": pick("b_ms", 20.0, 4.0) / 1e3,
        "w_s": pick("w_ms", 10.0, 2.0) / 1e3,
        "steps": pick("steps", 3, 1),
        "warmup": 1,
    }
    if not (cfg["f_s"] > 0 and cfg["b_s"] > 0 and 0 < cfg["w_s"] < cfg["b_s"]):
        raise ValueError("costs need F > 0, B > 0 and 0 < W < B")
    if cfg["steps"] < 1:
        raise ValueError(f"--steps must be >= 1, got {cfg['steps']}")
    from dualpipe_kernels.schedules.generators import build_schedule

    build_schedule("dualpipev", cfg["ranks"], cfg["microbatches"])  # ValueError naming the constraint
    return cfg


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from dualpipe_kernels.benchmarks.schedules import measure_ours

    n, steps, warm = cfg["microbatches"], cfg["steps"], cfg["warmup"]
    costs = (cfg["f_s"], cfg["b_s"], cfg["w_s"])
    out: dict[str, Any] = {}
    for tr in cfg["transports"]:
        try:
            comp = measure_ours("dualpipev", rank, world, n, *costs, 4, steps, warm, tr)["times"]
            for size in cfg["sizes"]:
                comm = measure_ours("dualpipev", rank, world, n, 0.0, 0.0, 0.0, size, steps, warm, tr)["times"]
                both = measure_ours("dualpipev", rank, world, n, *costs, size, steps, warm, tr)["times"]
                out[f"{tr}/{size}"] = {"compute": comp, "comm": comm, "both": both}
                if rank == 0:
                    sys.stderr.write(f"  bench overlap: {tr} {size} bytes done\n")
        except Exception as e:  # noqa: BLE001 - reported in the transport's rows
            out[tr] = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dualpipe_kernels.benchmarks.common import Progress, median
    from dualpipe_kernels.benchmarks.schedules import simulate_sleep
    from dualpipe_kernels.runtime.launch import spawn

    cfg = _resolve(args)
    bar = Progress(1, title="bench overlap")
    bar.note(f"transports {cfg['transports']}, sizes {cfg['sizes']}, dualpipev {cfg['ranks']} ranks")
    t0 = time.perf_counter()
    per_rank = spawn(_worker, cfg["ranks"], cfg, timeout_s=900, pg_timeout_s=300)
    from dualpipe_kernels.benchmarks.sleep_stages import sleep_overshoot

    cfg["sleep_overshoot_s"] = over = sleep_overshoot(cfg["f_s"], repeats=10)
    sim = float(
        simulate_sleep(
            "dualpipev", cfg["ranks"], cfg["microbatches"], cfg["f_s"], cfg["b_s"], cfg["w_s"], over
        ).makespan
    )

    def slowest(key: str, part: str) -> float:
        return median(max(ts) for ts in zip(*(o[key][part] for o in per_rank), strict=False))

    rows: list[dict[str, Any]] = []
    for tr in cfg["transports"]:
        err = next((o[tr]["error"] for o in per_rank if tr in o), None)
        for size in cfg["sizes"]:
            row: dict[str, Any] = {
                "transport": tr,
                "ranks": cfg["ranks"],
                "microbatches": cfg["microbatches"],
                "activation_bytes": size,
                "simulated_compute_s": sim,
            }
            if err is not None or f"{tr}/{size}" not in per_rank[0]:
                row.update(error=err or "not measured", hidden_comm_share=None)
                rows.append(row)
                continue
            tc, tm, ts = (slowest(f"{tr}/{size}", p) for p in ("compute", "comm", "both"))
            row.update(
                compute_s=tc,
                comm_s=tm,
                step_s=ts,
                compute_vs_simulated=tc / sim,
                hidden_comm_share=(tc + tm - ts) / tm if tm > 0 else None,
            )
            rows.append(row)
    bar.update(f"done in {time.perf_counter() - t0:.1f} s")
    bar.close()
    return {"rows": rows, "config": cfg}


def to_markdown(result: dict[str, Any]) -> str:
    from dualpipe_kernels.benchmarks.common import markdown_table

    c = result.get("config", {})
    head = (
        f"DualPipeV, {c.get('ranks')} ranks x {c.get('microbatches')} micro-batches, sleep-timed stages "
        f"F={c.get('f_s', 0) * 1e3:g} ms, B={c.get('b_s', 0) * 1e3:g} ms, W={c.get('w_s', 0) * 1e3:g} ms. "
        "comm hidden = (T_compute + T_comm - T_step) / T_comm (1 = fully hidden); "
        "compute alone is also compared with the simulator's step time."
    )
    table = markdown_table(
        result["rows"],
        [
            "transport",
            "activation_bytes",
            "compute_s",
            "comm_s",
            "step_s",
            "hidden_comm_share",
            "compute_vs_simulated",
            "error",
        ],
        [
            "transport",
            "bytes per transfer",
            "T_compute (s)",
            "T_comm (s)",
            "T_step (s)",
            "comm hidden",
            "T_compute / simulated",
            "error",
        ],
    )
    return head + "\n\n" + table
