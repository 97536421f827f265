"""schedules: measured step time and bubble of each schedule on sleep-timed stages, against the simulator.

Every rank runs synthetic stage chunks whose forward sleeps F, input-gradient
backward I = B - W and weight-gradient backward W seconds (so ranks sharing a
small CPU do not compete for it) and exchange activations of a set size.  For
each schedule (dualpipev, dualpipe, 1f1b, zb1p) and rank count the suite
measures the step time (max over ranks, median over steps) and the bubble
(makespan minus a rank's busy compute time, max over ranks) and compares them
with ``schedules.simulator`` fed no communication cost and the stage costs
measured alone: each stage's F, I and W timed in this process before the ranks
start (the sleep, its overshoot and the stage's own tensor work).  The ratio
measured / simulated is then what communication and the runtime add.

The model is the same for every schedule: ``2 * ranks`` chunks of cost
(F, B, W); a schedule with one stage per rank (1f1b, zb1p) or with two copies of
``ranks`` stages (dualpipe) gets stages of two chunks each.

``hidden_comm_share`` = (T_compute + T_comm - T_step) / T_comm, where T_compute
is the simulated step with free communication, T_comm the measured step of the
same schedule with zero-cost stages (communication and runtime overhead alone)
and T_step the measured step: 1 means every transfer hid behind compute.

Side by side (``peers``): the same chunks and costs through
torch.distributed.pipelining's ScheduleDualPipeV and Schedule1F1B; a peer's
``ratio`` is our step time / theirs (below 1: we are faster).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

NAME = "schedules"
SCHEDULES = ("dualpipev", "dualpipe", "1f1b", "zb1p")

#: measured / simulated target for DualPipeV 4 ranks x 16 micro-batches (issue 5)
TARGET_RATIO = 1.05

__all__ = [
    "NAME",
    "SCHEDULES",
    "add_arguments",
    "run",
    "to_markdown",
    "write_plots",
    "chunks_per_stage",
    "simulate_sleep",
    "calibrate_chunks",
    "measure_ours",
]


# ---------------------------------------------------------------- arguments
def _int_list(text: str) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _name_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in SCHEDULES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"schedules must be among {', '.join(SCHEDULES)}, got {text!r}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedules", type=_name_list, default=list(SCHEDULES), help="comma list (default all four)")
    p.add_argument("--ranks", type=_int_list, default=None, help="comma list of rank counts (default 2,4; quick 2)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default 16; quick 8)")
    p.add_argument("--f-ms", type=float, default=None, help="forward of one chunk, ms (default 10; quick 2)")
    p.add_argument("--b-ms", type=float, default=None, help="full backward of one chunk, ms (default 20; quick 4)")
    p.add_argument("--w-ms", type=float, default=None, help="weight-gradient part of B, ms (default 10; quick 2)")
    p.add_argument(
        "--activation-bytes",
        type=int,
        default=None,
        help="bytes per micro-batch activation (default 262144; quick 16384)",
    )
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 3; quick 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--transport", choices=("auto", "torch", "native"), default="auto")
    p.add_argument("--no-peers", dest="no_peers", action="store_true", help="skip torch.distributed.pipelining")


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults (full or quick) filled in and checked; ValueError names the bad option."""
    q = bool(getattr(args, "quick", False))

    def pick(name: str, full: Any, quick: Any) -> Any:
        v = getattr(args, name, None)
        return v if v is not None else (quick if q else full)

    cfg = {
        "schedules": list(getattr(args, "schedules", None) or SCHEDULES),
        "ranks": pick("ranks", [2, 4], [2]),
        "microbatches": pick("microbatches", 16, 8),
        "f_s": pick("f_ms", 10.0, 2.0) / 1e3,
        "b_s": pick("b_ms", 20.0, 4.0) / 1e3,
        "w_s": pick("w_ms", 10.0, 2.0) / 1e3,
        "activation_bytes": pick("activation_bytes", 1 << 18, 1 << 14),
        "steps": pick("steps", 3, 1),
        "warmup": int(getattr(args, "warmup", 1)),
        "transport": getattr(args, "transport", "auto"),
        "peers": not getattr(args, "no_peers", False),
    }
    if not (cfg["f_s"] > 0 and cfg["b_s"] > 0 and 0 < cfg["w_s"] < cfg["b_s"]):
        raise ValueError(f"costs need F > 0, B > 0 and 0 < W < B, got F={args.f_ms} B={args.b_ms} W={args.w_ms} ms")
    if cfg["steps"] < 1 or cfg["warmup"] < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {cfg['steps']}, {cfg['warmup']}")
    if cfg["activation_bytes"] < 4:
        raise ValueError(f"--activation-bytes must be >= 4, got {cfg['activation_bytes']}")
    from dualpipe_kernels.schedules.generators import build_schedule

    for r in cfg["ranks"]:
        for s in cfg["schedules"]:
            build_schedule(s, r, cfg["microbatches"])  # raises ValueError naming the constraint
    return cfg


# ---------------------------------------------------------------- model and simulation
def chunks_per_stage(schedule: Any) -> int:
    """Chunks of the common ``2 * ranks``-chunk model in one stage of ``schedule``."""
    n_model = len(set(schedule.model_stage))
    return (2 * schedule.num_ranks) // n_model


def simulate_sleep(
    name: str,
    ranks: int,
    microbatches: int,
    f_s: float,
    b_s: float,
    w_s: float,
    overshoot_s: float = 0.0,
    chunk_costs: dict[int, Any] | None = None,
) -> Any:
    """SimResult of ``name`` on the common model with free communication (F&B = F + B: no overlap hook).

    Costs, in order of preference:

    * ``chunk_costs``: ``{k: ChunkCosts}``, the measured cost of a stage of
      ``k`` chunks timed alone (``sleep_stages.measure_chunk_costs``); the
      stage of this schedule has ``chunks_per_stage`` chunks.  B = I + W.
    * otherwise the nominal ``k * (f_s, b_s, w_s)`` plus ``overshoot_s``, what each
      ``time.sleep`` adds on this machine (F and W are one sleep each, B two).
    """
    from dualpipe_kernels.benchmarks.sleep_stages import ChunkCosts
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.schedules.simulator import simulate

    sched = build_schedule(name, ranks, microbatches)
    k = chunks_per_stage(sched)
    costs = chunk_costs[k] if chunk_costs is not None else ChunkCosts.nominal(k * f_s, k * b_s, k * w_s, overshoot_s)
    return simulate(sched, costs.cost_model())


def calibrate_chunks(cfg: dict[str, Any]) -> dict[int, Any]:
    """``{k: ChunkCosts}`` for every stage size (chunks per stage) the configured schedules use."""
    from dualpipe_kernels.benchmarks.sleep_stages import measure_chunk_costs
    from dualpipe_kernels.schedules.generators import build_schedule

    ks = sorted(
        {
            chunks_per_stage(build_schedule(name, ranks, cfg["microbatches"]))
            for name in cfg["schedules"]
            for ranks in cfg["ranks"]
        }
    )
    repeats = 3 if cfg["steps"] < 2 else 7
    return {
        k: measure_chunk_costs(k * cfg["f_s"], k * cfg["b_s"], k * cfg["w_s"], cfg["activation_bytes"], repeats)
        for k in ks
    }


def _chunk_costs_from_config(c: dict[str, Any]) -> dict[int, Any] | None:
    from dualpipe_kernels.benchmarks.sleep_stages import ChunkCosts

    raw = c.get("chunk_costs_s")
    return {int(k): ChunkCosts(**v) for k, v in raw.items()} if raw else None


def _pipeline_cls() -> Any:
    from dualpipe_kernels.runtime import Pipeline

    return Pipeline


def measure_ours(
    name: str,
    rank: int,
    ranks: int,
    microbatches: int,
    f_s: float,
    b_s: float,
    w_s: float,
    activation_bytes: int,
    steps: int,
    warmup: int,
    transport: str = "auto",
    record_timeline: bool = False,
    device: str = "cpu",
) -> dict[str, Any]:
    """Run ``name`` on this rank's sleep chunks with our runtime; return per-step wall times (s) and busy time (s).

    Must run inside a rank process whose default group holds the ``ranks`` pipeline ranks.
    Returns ``{"times": [...], "busy": [...], "timeline": [...]}`` for the measured steps;
    ``timeline`` is the last measured step's ``(rank, action, start_s, end_s)`` list when recorded.
    """
    import torch
    import torch.distributed as dist

    from dualpipe_kernels.benchmarks.sleep_stages import SleepStage, sleep_batch, sleep_criterion
    from dualpipe_kernels.schedules.generators import build_schedule

    sched = build_schedule(name, ranks, microbatches)
    k = chunks_per_stage(sched)
    modules = {s: SleepStage(k * f_s, k * b_s, k * w_s).to(device) for s in sched.stages_of_rank(rank)}
    pipe = _pipeline_cls()(sched, modules, transport=transport, record_timeline=True)
    x = sleep_batch(microbatches, activation_bytes).to(device)
    labels = torch.zeros(x.shape[0], device=device)
    times: list[float] = []
    busy: list[float] = []
    timeline: list[Any] = []
    try:
        for step in range(warmup + steps):
            dist.barrier()
            t0 = time.perf_counter()  # wall time around step(), as for the torch peers
            res = pipe.step(x, labels=(labels,), criterion=sleep_criterion)
            dt = time.perf_counter() - t0
            if step < warmup:
                continue
            times.append(dt)
            busy.append(busy_time(res.timeline))
            if record_timeline:
                timeline = [(int(r), str(a), float(t0), float(t1)) for r, a, t0, t1 in res.timeline]
        dist.barrier()
    finally:
        pipe.close()
    return {"times": times, "busy": busy, "timeline": timeline}


def schedule_entries(timeline: Any) -> list[tuple[int, Any, float, float]]:
    """The entries of a measured timeline that are schedule actions, parsed: ``(rank, Action, start_s, end_s)``.

    The runtime may also record its own bookkeeping spans (e.g. ``SYNC_MIRROR_GRADS``); they are left out.
    """
    from dualpipe_kernels.schedules.ir import parse_action

    out = []
    for r, a, t0, t1 in timeline:
        if isinstance(a, str):
            try:
                a = parse_action(a)
            except ValueError:
                continue
        out.append((int(r), a, float(t0), float(t1)))
    return out


def busy_time(timeline: Any) -> float:
    """Seconds spent computing: compute actions (F, B, I, W, F&B) minus the receive waits inside them.

    A compute action waits for its input (or output gradient) when it starts or,
    for an F&B pair, between its halves; the runtime records that wait as a
    RECV entry nested in the compute entry.  It is idle time, not compute.
    """
    entries = schedule_entries(timeline)
    total = 0.0
    by_rank: dict[int, list[tuple[float, float]]] = {}
    for r, a, t0, t1 in entries:
        if a.is_compute:
            total += t1 - t0
            by_rank.setdefault(r, []).append((t0, t1))
    for r, a, t0, t1 in entries:
        if a.is_compute or not a.type.name.startswith("RECV"):
            continue
        for c0, c1 in by_rank.get(r, ()):
            total -= max(0.0, min(t1, c1) - max(t0, c0))
    return total


# ---------------------------------------------------------------- rank worker
def _note(rank: int, text: str) -> None:
    if rank == 0:
        sys.stderr.write(f"  bench schedules: {text}\n")
        sys.stderr.flush()


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Every schedule, its comm-only twin and the peers on ``world`` ranks; returns this rank's raw times."""
    from dualpipe_kernels.benchmarks.peers import PEERS, torch_schedule_step_times

    n, steps, warm = cfg["microbatches"], cfg["steps"], cfg["warmup"]
    costs = (cfg["f_s"], cfg["b_s"], cfg["w_s"])
    out: dict[str, Any] = {"ours": {}, "comm_only": {}, "peers": {}, "errors": {}}
    for name in cfg["schedules"]:
        t0 = time.perf_counter()
        try:
            out["ours"][name] = measure_ours(
                name,
                rank,
                world,
                n,
                *costs,
                cfg["activation_bytes"],
                steps,
                warm,
                cfg["transport"],
                record_timeline=(name == "dualpipev"),
            )
            out["comm_only"][name] = measure_ours(
                name, rank, world, n, 0.0, 0.0, 0.0, cfg["activation_bytes"], steps, warm, cfg["transport"]
            )
        except Exception as e:  # noqa: BLE001 - one schedule's failure is reported in its row
            out["errors"][name] = f"{type(e).__name__}: {e}".splitlines()[0]
        _note(rank, f"{name} ranks={world} N={n} done in {time.perf_counter() - t0:.1f} s")
    if cfg["peers"]:
        for peer, (_cls, ours) in PEERS.items():
            if ours not in cfg["schedules"]:
                continue
            t0 = time.perf_counter()
            try:
                out["peers"][peer] = torch_schedule_step_times(
                    peer, rank, world, n, *costs, cfg["activation_bytes"], steps, warm
                )
            except Exception as e:  # noqa: BLE001 - reported in the peer row
                out["errors"][peer] = f"{type(e).__name__}: {e}".splitlines()[0]
            _note(rank, f"{peer} ranks={world} N={n} done in {time.perf_counter() - t0:.1f} s")
    return out


def _per_step_max(per_rank: list[list[float]]) -> list[float]:
    return [max(ts) for ts in zip(*per_rank, strict=False)]


# ---------------------------------------------------------------- suite entry points
def run(args: argparse.Namespace) -> dict[str, Any]:
    from dualpipe_kernels.benchmarks.common import Progress, median
    from dualpipe_kernels.benchmarks.sleep_stages import sleep_overshoot
    from dualpipe_kernels.runtime.launch import spawn

    cfg = _resolve(args)
    cfg["sleep_overshoot_s"] = over = sleep_overshoot(cfg["f_s"], repeats=10 if cfg["steps"] < 2 else 20)
    chunks = calibrate_chunks(cfg)
    cfg["chunk_costs_s"] = {str(k): dataclasses.asdict(c) for k, c in chunks.items()}
    rows: list[dict[str, Any]] = []
    peers: list[dict[str, Any]] = []
    timeline: dict[str, Any] | None = None
    bar = Progress(len(cfg["ranks"]), title="bench schedules")
    bar.note(f"ranks {cfg['ranks']} x schedules {cfg['schedules']}, N={cfg['microbatches']}")
    for ranks in cfg["ranks"]:
        per_rank = spawn(_worker, ranks, cfg, timeout_s=900, pg_timeout_s=300)
        n = cfg["microbatches"]
        for name in cfg["schedules"]:
            sim = simulate_sleep(name, ranks, n, cfg["f_s"], cfg["b_s"], cfg["w_s"], chunk_costs=chunks)
            sim_over = simulate_sleep(name, ranks, n, cfg["f_s"], cfg["b_s"], cfg["w_s"], over)
            row: dict[str, Any] = {
                "schedule": name,
                "ranks": ranks,
                "microbatches": n,
                "simulated_s": float(sim.makespan),
                "bubble_simulated_s": float(sim.bubble),
                "simulated_sleep_only_s": float(sim_over.makespan),
                "simulated_nominal_s": float(
                    simulate_sleep(name, ranks, n, cfg["f_s"], cfg["b_s"], cfg["w_s"]).makespan
                ),
            }
            err = next((o["errors"][name] for o in per_rank if name in o["errors"]), None)
            if err is not None:
                row.update(measured_s=None, ratio=None, hidden_comm_share=None, error=err)
                rows.append(row)
                continue
            step = _per_step_max([o["ours"][name]["times"] for o in per_rank])
            bubbles = [max(t - o["ours"][name]["busy"][k] for o in per_rank) for k, t in enumerate(step)]
            comm = median(_per_step_max([o["comm_only"][name]["times"] for o in per_rank]))
            t_step = median(step)
            row.update(
                measured_s=t_step,
                ratio=t_step / float(sim.makespan),
                ratio_sleep_only=t_step / float(sim_over.makespan),
                bubble_measured_s=median(bubbles),
                comm_only_s=comm,
                hidden_comm_share=(float(sim.makespan) + comm - t_step) / comm if comm > 0 else None,
                step_times_s=step,
            )
            rows.append(row)
            if name == "dualpipev" and (timeline is None or ranks >= timeline["ranks"]):
                tl = [e for o in per_rank for e in o["ours"][name]["timeline"]]
                timeline = {"schedule": name, "ranks": ranks, "microbatches": n, "entries": tl}
        for peer in per_rank[0]["peers"]:
            from dualpipe_kernels.benchmarks.peers import PEERS

            ours_name = PEERS[peer][1]
            theirs = median(_per_step_max([o["peers"][peer] for o in per_rank]))
            ours = next((r["measured_s"] for r in rows if r["schedule"] == ours_name and r["ranks"] == ranks), None)
            peers.append(
                {
                    "name": peer,
                    "schedule": ours_name,
                    "ranks": ranks,
                    "microbatches": n,
                    "step_s": theirs,
                    "ours_step_s": ours,
                    "ratio": ours / theirs if ours else None,
                }
            )
        for o in per_rank[:1]:
            for peer, err in o["errors"].items():
                if peer.startswith("torch."):
                    peers.append(
                        {
                            "name": peer,
                            "schedule": peer,
                            "ranks": ranks,
                            "microbatches": n,
                            "step_s": None,
                            "ours_step_s": None,
                            "ratio": None,
                            "error": err,
                        }
                    )
        bar.update(f"ranks={ranks} done")
    bar.close()
    return {
        "rows": rows,
        "peers": peers,
        "config": {
            k: cfg[k]
            for k in (
                "schedules",
                "ranks",
                "microbatches",
                "f_s",
                "b_s",
                "w_s",
                "activation_bytes",
                "steps",
                "warmup",
                "transport",
                "sleep_overshoot_s",
                "chunk_costs_s",
            )
        },
        "targets": _targets(rows, peers),
        "timeline": timeline,
    }


def _targets(rows: list[dict[str, Any]], peers: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 5's two targets, where this run measured them."""
    out: dict[str, Any] = {}
    for r in rows:
        if r["schedule"] == "dualpipev" and r["ranks"] == 4 and r["microbatches"] == 16 and r.get("ratio"):
            out["dualpipev_4x16_measured_over_simulated"] = r["ratio"]
            out["dualpipev_4x16_target"] = TARGET_RATIO
            out["dualpipev_4x16_met"] = r["ratio"] <= TARGET_RATIO
    for p in peers:
        if p["name"] == "torch.ScheduleDualPipeV" and p.get("ratio"):
            out[f"dualpipev_vs_torch_{p['ranks']}x{p['microbatches']}_ratio"] = p["ratio"]
            out[f"dualpipev_vs_torch_{p['ranks']}x{p['microbatches']}_faster"] = p["ratio"] < 1
    return out


def _costs_text(c: dict[str, Any]) -> str:
    parts = []
    for k, v in sorted((c.get("chunk_costs_s") or {}).items()):
        ms = ", ".join(f"{name.upper()}={v[name] * 1e3:.2f}" for name in ("f", "i", "w"))
        parts.append(f"{k} chunk{'s' if int(k) > 1 else ''}/stage: {ms} ms")
    return "; ".join(parts) or "not measured"


def to_markdown(result: dict[str, Any]) -> str:
    from dualpipe_kernels.benchmarks.common import markdown_table

    c = result.get("config", {})
    head = (
        f"Sleep-timed stages: F={c.get('f_s', 0) * 1e3:g} ms, B={c.get('b_s', 0) * 1e3:g} ms, "
        f"W={c.get('w_s', 0) * 1e3:g} ms per chunk (2 x ranks chunks), {c.get('activation_bytes')} bytes per "
        f"activation, transport {c.get('transport')}, median of {c.get('steps')} steps. "
        "ratio = measured / simulated step time; the simulator gets each stage's F, I, W timed alone in one "
        f"process ({_costs_text(c)}) and free communication, so the ratio is what communication and the "
        "runtime add. 'sleep only': the simulator fed the nominal sleeps plus the measured overshoot of "
        f"time.sleep ({c.get('sleep_overshoot_s', 0) * 1e6:.0f} us) instead."
    )
    t1 = markdown_table(
        result["rows"],
        [
            "schedule",
            "ranks",
            "microbatches",
            "measured_s",
            "simulated_s",
            "ratio",
            "ratio_sleep_only",
            "bubble_measured_s",
            "bubble_simulated_s",
            "comm_only_s",
            "hidden_comm_share",
            "error",
        ],
        [
            "schedule",
            "ranks",
            "N",
            "measured (s)",
            "simulated (s)",
            "measured/simulated",
            "measured/simulated (sleep only)",
            "bubble measured (s)",
            "bubble simulated (s)",
            "comm alone (s)",
            "comm hidden",
            "error",
        ],
    )
    parts = [head, "", t1]
    if result.get("peers"):
        parts += [
            "",
            "Side by side with torch.distributed.pipelining (same chunks, same costs); "
            "ratio = ours / theirs (below 1: we are faster).",
            "",
            markdown_table(
                result["peers"],
                ["name", "schedule", "ranks", "microbatches", "step_s", "ours_step_s", "ratio", "error"],
                ["peer", "our schedule", "ranks", "N", "their step (s)", "our step (s)", "ours/theirs", "error"],
            ),
        ]
    return "\n".join(parts)


def write_plots(result: dict[str, Any], out_dir: str | os.PathLike[str]) -> list[Path]:
    """``schedules_bubble.png`` (bubble vs ranks, measured vs simulated) and the DualPipeV timeline overlay."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    paths: list[Path] = []
    rows = [r for r in result["rows"] if r.get("bubble_measured_s") is not None]
    if rows:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, name in enumerate(sorted({r["schedule"] for r in rows})):
            rs = sorted((r for r in rows if r["schedule"] == name), key=lambda r: r["ranks"])
            colour = f"C{i}"
            ax.plot(
                [r["ranks"] for r in rs],
                [r["bubble_measured_s"] * 1e3 for r in rs],
                "o-",
                color=colour,
                label=f"{name} measured",
            )
            ax.plot(
                [r["ranks"] for r in rs],
                [r["bubble_simulated_s"] * 1e3 for r in rs],
                "x--",
                color=colour,
                label=f"{name} simulated",
            )
        ax.set_xlabel("ranks")
        ax.set_ylabel("bubble: max over ranks of idle time per step (ms)")
        ax.set_xticks(sorted({r["ranks"] for r in rows}))
        ax.set_title("bubble vs ranks: measured (solid), simulated (dashed)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
        fig.tight_layout()
        p = out / "schedules_bubble.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    tl = result.get("timeline")
    if tl and tl.get("entries"):
        from dualpipe_kernels.schedules.plot import plot_overlay
        from dualpipe_kernels.schedules.trace import write_chrome_trace

        c = result["config"]
        sim = simulate_sleep(
            tl["schedule"],
            tl["ranks"],
            tl["microbatches"],
            c["f_s"],
            c["b_s"],
            c["w_s"],
            c.get("sleep_overshoot_s", 0),
            chunk_costs=_chunk_costs_from_config(c),
        )
        entries = [(r, str(a), t0, t1) for r, a, t0, t1 in schedule_entries(tl["entries"])]
        p = out / "schedules_timeline.png"
        fig = plot_overlay(
            sim,
            entries,
            p,
            title=f"{tl['schedule']} {tl['ranks']}x{tl['microbatches']}: simulated (fill), measured (outline)",
        )
        plt.close(fig)
        paths.append(p)
        tp = out / "schedules_timeline_trace.json"
        write_chrome_trace(tp, sim.events, measured=entries)
        paths.append(tp)
    return paths
