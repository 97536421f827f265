"""schedules: each schedule's step time, bubble and hidden communication on sleep-timed stages, vs the simulator.

Every rank runs synthetic stage chunks whose forward sleeps F, input-gradient
backward I = B - W and weight-gradient backward W seconds (so ranks sharing a
small CPU do not compete for it) and exchange activations of a set size.  For
each schedule (dualpipev, dualpipe, 1f1b, zb1p) and rank count one pipeline
measures (:mod:`.sleep_runs`), in the same processes:

* ``T_step`` (``measured_s``): the step with real activations (max over
  ranks, median over steps) and its bubble (step minus a rank's busy compute
  time, max over ranks);
* ``T_compute``: the same pipeline with every transfer cut to a few bytes;
* ``T_comm``: the bytes the step moved to its busiest rank, timed on the link
  measured between ranks 0 and 1 (latency + bytes / bandwidth per transfer).

Reported against the simulator (``schedules.simulator``), fed each stage's F,
I and W timed alone in this process before the ranks start (the sleep, its
overshoot and the stage's own tensor work): ``ratio = measured / simulated``
with free communication, and ``simulated_with_comm_s`` with the measured link,
so ``simulated_exposed_comm_s`` is what the schedule itself forces to wait for
transfers and ``exposed_comm_s = T_step - T_compute`` what the run did.
``hidden_comm_share = 1 - exposed_comm_s / T_comm`` (:mod:`.metrics`; null and
flagged as noise when the raw value leaves [0, 1]).

The model is the same for every schedule: ``2 * ranks`` chunks of cost
(F, B, W); a schedule with one stage per rank (1f1b, zb1p) or with two copies of
``ranks`` stages (dualpipe) gets stages of two chunks each.

Side by side (``peers``): the same chunks and costs through
torch.distributed.pipelining's ScheduleDualPipeV and Schedule1F1B; a peer's
``ratio`` is our step time / theirs (below 1: we are faster).

The short-chunk row (1/2/1 ms chunks, where the runtime's own cost shows):
:func:`short_chunk_rows`, with the fields of :mod:`.schedules_short`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Any

from dualpipe_kernels.benchmarks.common import int_list
from dualpipe_kernels.benchmarks.schedules_report import to_markdown, write_plots
from dualpipe_kernels.benchmarks.sleep_runs import SleepRun, nominal_chunks, simulate_sleep

NAME = "schedules"
SCHEDULES = ("dualpipev", "dualpipe", "1f1b", "zb1p")

#: measured / simulated target for DualPipeV 4 ranks x 16 micro-batches (at most 5% over the simulator)
TARGET_RATIO = 1.05
#: the short-chunk row: DualPipeV with F/B/W = 1/2/1 ms chunks, where the runtime's own cost shows
SHORT_CHUNK_S = (0.001, 0.002, 0.001)

__all__ = [
    "NAME",
    "SCHEDULES",
    "SchedulesConfig",
    "add_arguments",
    "run",
    "to_markdown",
    "write_plots",
    "calibrate_chunks",
    "short_chunk_rows",
]


# ---------------------------------------------------------------- configuration
def _name_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in SCHEDULES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"schedules must be among {', '.join(SCHEDULES)}, got {text!r}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dualpipe_kernels.benchmarks.sleep_runs import add_sleep_arguments

    p.add_argument("--schedules", type=_name_list, default=list(SCHEDULES), help="comma list (default all four)")
    p.add_argument("--ranks", type=int_list, default=None, help="comma list of rank counts (default 2,4; quick 2)")
    add_sleep_arguments(p, microbatches=(16, 8))
    p.add_argument(
        "--activation-bytes",
        type=int,
        default=None,
        help="bytes per micro-batch activation (default 262144; quick 16384)",
    )
    p.add_argument("--transport", choices=("auto", "torch", "native"), default="auto")
    p.add_argument("--no-peers", dest="no_peers", action="store_true", help="skip torch.distributed.pipelining")
    p.add_argument(
        "--no-short-chunks",
        dest="no_short",
        action="store_true",
        help="skip the short-chunk row (DualPipeV, 1/2/1 ms chunks, 4 ranks x 16; quick: 2 x 8)",
    )
    p.add_argument(
        "--short-chunks-only",
        dest="short_only",
        action="store_true",
        help="run the short-chunk row alone (no schedule rows, no peers)",
    )
    p.add_argument(
        "--short-launches",
        dest="short_launches",
        type=int,
        default=None,
        help="fresh rank processes for the short-chunk row, each with its own chunk calibration; the row is "
        "the launch of median ratio, with the others' range (default 3; quick 1)",
    )


@dataclass(frozen=True)
class SchedulesConfig:
    """The suite's settings: which schedules on which rank counts, and the sleep run each one gets."""

    schedules: tuple[str, ...]
    ranks: tuple[int, ...]
    peers: bool
    run: SleepRun
    short: bool = True  # also the short-chunk row
    short_only: bool = False  # the short-chunk row alone
    short_launches: int = 3  # launches of the short-chunk row (median and range)

    def short_chunks(self) -> SchedulesConfig:
        """The short-chunk row's settings: DualPipeV, 1/2/1 ms chunks, 4 x 16 (quick: 2 x 8), no peers."""
        f, b, w = SHORT_CHUNK_S
        quick = self.run.microbatches < 16
        run = dataclasses.replace(
            self.run, f_s=f, b_s=b, w_s=w, steps=max(self.run.steps, 2 if quick else 10), floor=True
        )
        ranks = (2,) if quick else (4,)
        return SchedulesConfig(("dualpipev",), ranks, False, run, short=False, short_launches=self.short_launches)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SchedulesConfig:
        """Defaults (full or quick) filled in and checked; ValueError names the bad option."""
        from dualpipe_kernels.schedules.generators import build_schedule

        quick = getattr(args, "quick", False)
        ranks = getattr(args, "ranks", None) or ([2] if quick else [2, 4])
        launches = getattr(args, "short_launches", None)
        cfg = cls(
            schedules=tuple(getattr(args, "schedules", None) or SCHEDULES),
            ranks=tuple(ranks),
            peers=not getattr(args, "no_peers", False),
            run=SleepRun.from_args(args, microbatches=(16, 8), activation_bytes=(1 << 18, 1 << 14)),
            short=not getattr(args, "no_short", False),
            short_only=getattr(args, "short_only", False),
            short_launches=(1 if quick else 3) if launches is None else launches,
        )
        if cfg.short_only and not cfg.short:
            raise ValueError("--short-chunks-only and --no-short-chunks leave nothing to run")
        if cfg.short_launches < 1:
            raise ValueError(f"--short-launches must be >= 1, got {cfg.short_launches}")
        for r in cfg.ranks:
            for s in cfg.schedules:
                build_schedule(s, r, cfg.run.microbatches)  # raises ValueError naming the constraint
        return cfg

    def as_dict(self) -> dict[str, Any]:
        """Flat, JSON-ready: the run's sizes and costs beside the schedules and rank counts."""
        run = {
            k: v for k, v in dataclasses.asdict(self.run).items() if k not in ("schedule", "ranks", "record_timeline")
        }
        return {"schedules": list(self.schedules), "ranks": list(self.ranks), "peers": self.peers, **run}


# ---------------------------------------------------------------- calibration
def calibrate_chunks(cfg: SchedulesConfig) -> dict[int, Any]:
    """``{k: ChunkCosts}`` timed alone, for every stage size (chunks per stage) the configured schedules use."""
    from dualpipe_kernels.benchmarks.sleep_runs import chunks_per_stage
    from dualpipe_kernels.benchmarks.sleep_stages import measure_chunk_costs
    from dualpipe_kernels.schedules.generators import build_schedule

    ks = sorted(
        {chunks_per_stage(build_schedule(s, r, cfg.run.microbatches)) for s in cfg.schedules for r in cfg.ranks}
    )
    # Short chunks (the 1/2/1 ms row) get more rounds: a median of 7 once came out 16% high, the
    # simulated step with it; 31 rounds of such a chunk take about 0.2 s.
    repeats = 3 if cfg.run.steps < 2 else (31 if cfg.run.f_s + cfg.run.b_s < 0.01 else 7)
    return {
        k: measure_chunk_costs(k * cfg.run.f_s, k * cfg.run.b_s, k * cfg.run.w_s, cfg.run.activation_bytes, repeats)
        for k in ks
    }


# ---------------------------------------------------------------- rank worker
def _note(rank: int, text: str) -> None:
    if rank == 0:
        sys.stderr.write(f"  bench schedules: {text}\n")
        sys.stderr.flush()


def _worker(rank: int, world: int, cfg: SchedulesConfig) -> dict[str, Any]:
    """Every schedule's three terms and the peers on ``world`` ranks; returns this rank's raw figures."""
    from dualpipe_kernels.benchmarks.peers import PEERS, torch_schedule_step_times
    from dualpipe_kernels.benchmarks.sleep_runs import measure_sleep_pipeline

    out: dict[str, Any] = {"ours": {}, "peers": {}, "errors": {}}
    for name in cfg.schedules:
        t0 = time.perf_counter()
        try:
            run = dataclasses.replace(cfg.run, schedule=name, ranks=world, record_timeline=(name == "dualpipev"))
            out["ours"][name] = measure_sleep_pipeline(rank, run)
        except Exception as e:  # noqa: BLE001 - one schedule's failure is reported in its row
            out["errors"][name] = f"{type(e).__name__}: {e}".splitlines()[0]
        _note(rank, f"{name} ranks={world} N={cfg.run.microbatches} done in {time.perf_counter() - t0:.1f} s")
    if cfg.peers:
        costs = (cfg.run.f_s, cfg.run.b_s, cfg.run.w_s)
        for peer, (_cls, ours) in PEERS.items():
            if ours not in cfg.schedules:
                continue
            t0 = time.perf_counter()
            try:
                out["peers"][peer] = torch_schedule_step_times(
                    peer,
                    rank,
                    world,
                    cfg.run.microbatches,
                    *costs,
                    cfg.run.activation_bytes,
                    cfg.run.steps,
                    cfg.run.warmup,
                )
            except Exception as e:  # noqa: BLE001 - reported in the peer row
                out["errors"][peer] = f"{type(e).__name__}: {e}".splitlines()[0]
            _note(rank, f"{peer} ranks={world} N={cfg.run.microbatches} done in {time.perf_counter() - t0:.1f} s")
    return out


# ---------------------------------------------------------------- rows
def _per_step_max(per_rank: list[list[float]]) -> list[float]:
    return [max(ts) for ts in zip(*per_rank, strict=False)]


def _schedule_row(
    cfg: SchedulesConfig, name: str, ranks: int, per_rank: list[dict[str, Any]], chunks: dict[int, Any], over: float
) -> dict[str, Any]:
    """One schedule's row: the three measured terms, the metric and the simulator's predictions."""
    from dualpipe_kernels.benchmarks.common import host_cpus, median
    from dualpipe_kernels.benchmarks.sleep_runs import overlap_terms
    from dualpipe_kernels.runtime.timeline import measured_stage_costs
    from dualpipe_kernels.schedules.costs import CommModel
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.schedules.simulator import simulate

    n = cfg.run.microbatches
    sim_res = simulate_sleep(name, ranks, n, chunks)
    sim = float(sim_res.makespan)
    sim_over = float(
        simulate_sleep(name, ranks, n, nominal_chunks(cfg.run.f_s, cfg.run.b_s, cfg.run.w_s, over)).makespan
    )
    sim_nominal = float(simulate_sleep(name, ranks, n, nominal_chunks(cfg.run.f_s, cfg.run.b_s, cfg.run.w_s)).makespan)
    row: dict[str, Any] = {
        "schedule": name,
        "ranks": ranks,
        "microbatches": n,
        "activation_bytes": cfg.run.activation_bytes,
        "simulated_s": sim,
        "bubble_simulated_s": float(sim_res.bubble),
        "simulated_sleep_only_s": sim_over,
        "simulated_nominal_s": sim_nominal,
    }
    err = next((o["errors"][name] for o in per_rank if name in o["errors"]), None)
    if err is not None:
        row.update(measured_s=None, ratio=None, hidden_comm_share=None, exposed_comm_s=None, error=err)
        return row
    ms = [o["ours"][name] for o in per_rank]
    step = _per_step_max([m.times for m in ms])
    t_step = median(step)
    row.update(
        measured_s=t_step,
        ratio=t_step / sim,
        ratio_sleep_only=t_step / sim_over,
        bubble_measured_s=median(max(t - m.busy[k] for m in ms) for k, t in enumerate(step)),
        step_times_s=step,
        # What the ranks ask of the host's CPUs: a rank's compute is a sleep, so on a GPU node's host the
        # CPU time is the runtime's (and the stage's tensor work); ranks sharing a CPU wait for each other.
        rank_cpu_s=max(median(m.cpu_times) for m in ms) if all(m.cpu_times for m in ms) else None,
        host_cpus=host_cpus(),
    )
    terms = overlap_terms(ms)
    row.update(terms)  # t_step_s: the median of the per-step maxima, as measured_s
    if "link_latency_s" in terms:
        comm = CommModel(
            latency=terms["link_latency_s"],
            bandwidth=terms["link_bandwidth_gbps"] * 1e9,
            activation_bytes=cfg.run.activation_bytes,
        )
        with_comm = float(simulate_sleep(name, ranks, n, chunks, comm).makespan)
        row.update(
            simulated_with_comm_s=with_comm,
            simulated_exposed_comm_s=with_comm - sim,
            transfer_over_f=terms["transfer_s"] / cfg.run.f_s,
            compute_over_simulated=terms["t_compute_s"] / sim,
        )
        sched = build_schedule(name, ranks, n)
        probe = measured_stage_costs([e for m in ms for e in m.compute_timeline], sched.num_stages)
        sim_meas = float(simulate(sched, probe.cost_model()).makespan)
        row.update(simulated_measured_costs_s=sim_meas, ratio_measured_costs=t_step / sim_meas)
    return row


def _peer_rows(cfg: SchedulesConfig, ranks: int, per_rank: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list:
    from dualpipe_kernels.benchmarks.common import median
    from dualpipe_kernels.benchmarks.peers import PEERS

    out: list[dict[str, Any]] = []
    base = {"ranks": ranks, "microbatches": cfg.run.microbatches}
    for peer in per_rank[0]["peers"]:
        ours_name = PEERS[peer][1]
        theirs = median(_per_step_max([o["peers"][peer] for o in per_rank]))
        ours = next((r["measured_s"] for r in rows if r["schedule"] == ours_name and r["ranks"] == ranks), None)
        ratio = ours / theirs if ours else None
        out.append({"name": peer, "schedule": ours_name, **base, "step_s": theirs, "ours_step_s": ours, "ratio": ratio})
    for peer, err in per_rank[0]["errors"].items():
        if peer.startswith("torch."):
            none = {"step_s": None, "ours_step_s": None, "ratio": None}
            out.append({"name": peer, "schedule": PEERS[peer][1], **base, **none, "error": err})
    return out


# ---------------------------------------------------------------- the short-chunk row
def short_chunk_rows(cfg: SchedulesConfig) -> list[dict[str, Any]]:
    """The short-chunk rows (:mod:`.schedules_short`): one per rank count of ``cfg`` (the settings of
    :meth:`SchedulesConfig.short_chunks`)."""
    from dualpipe_kernels.benchmarks.schedules_short import bare_fields, floor_fields
    from dualpipe_kernels.benchmarks.sleep_stages import sleep_overshoot
    from dualpipe_kernels.runtime.launch import spawn

    rows = []
    for ranks in cfg.ranks:
        launches = []
        for _ in range(cfg.short_launches):
            over = sleep_overshoot(cfg.run.f_s, repeats=20)
            chunks = calibrate_chunks(cfg)
            per_rank = spawn(_worker, ranks, cfg, timeout_s=600, pg_timeout_s=300)
            row = _schedule_row(cfg, "dualpipev", ranks, per_rank, chunks, over)
            row.pop("step_times_s", None)
            ms = [r["ours"].get("dualpipev") for r in per_rank]
            floor = floor_fields(ms, cfg.run.microbatches, ranks, chunks, row.get("ratio"))
            floor.update(bare_fields(ms, row.get("measured_s"), row.get("simulated_s")))
            launches.append({**row, **floor})
        measured = sorted((r for r in launches if r.get("ratio") is not None), key=lambda r: r["ratio"])
        ratios = [r["ratio"] for r in launches if r.get("ratio") is not None]  # in launch order
        # the launch of median ratio (the lower middle one of an even count)
        row = measured[(len(measured) - 1) // 2] if measured else launches[0]
        rows.append({**row, "f_s": cfg.run.f_s, "b_s": cfg.run.b_s, "w_s": cfg.run.w_s, "launches": len(launches),
                     "ratios": ratios, "ratio_min": min(ratios, default=None),
                     "ratio_max": max(ratios, default=None)})  # fmt: skip
    return rows


# ---------------------------------------------------------------- suite entry points
def run(args: argparse.Namespace) -> dict[str, Any]:
    from dualpipe_kernels.benchmarks.common import Progress
    from dualpipe_kernels.benchmarks.schedules_short import short_targets
    from dualpipe_kernels.benchmarks.sleep_stages import sleep_overshoot
    from dualpipe_kernels.runtime.launch import spawn

    cfg = SchedulesConfig.from_args(args)
    over = sleep_overshoot(cfg.run.f_s, repeats=10 if cfg.run.steps < 2 else 20)
    chunks = calibrate_chunks(cfg) if not cfg.short_only else {}
    rows: list[dict[str, Any]] = []
    peers: list[dict[str, Any]] = []
    timeline: dict[str, Any] | None = None
    main_ranks = () if cfg.short_only else cfg.ranks  # the schedule rows' rank counts
    bar = Progress(len(main_ranks), title="bench schedules")
    if main_ranks:
        bar.note(f"ranks {list(main_ranks)} x schedules {list(cfg.schedules)}, N={cfg.run.microbatches}")
    for ranks in main_ranks:
        per_rank = spawn(_worker, ranks, cfg, timeout_s=900, pg_timeout_s=300)
        for name in cfg.schedules:
            rows.append(_schedule_row(cfg, name, ranks, per_rank, chunks, over))
            if name == "dualpipev" and rows[-1].get("error") is None:
                tl = [e for o in per_rank for e in o["ours"][name].timeline]
                timeline = {"schedule": name, "ranks": ranks, "microbatches": cfg.run.microbatches, "entries": tl}
        peers += _peer_rows(cfg, ranks, per_rank, rows)
        bar.update(f"ranks={ranks} done")
    short_rows = short_chunk_rows(cfg.short_chunks()) if cfg.short else []
    bar.close()
    config = {
        **cfg.as_dict(),
        "sleep_overshoot_s": over,
        "chunk_costs_s": {str(k): dataclasses.asdict(c) for k, c in chunks.items()},
    }
    targets = {**_targets(rows, peers), **short_targets(short_rows)}
    return {
        "rows": rows,
        "peers": peers,
        "short_chunks": short_rows,
        "config": config,
        "targets": targets,
        "timeline": timeline,
    }


def _targets(rows: list[dict[str, Any]], peers: list[dict[str, Any]]) -> dict[str, Any]:
    """The suite's two targets (measured / simulated <= 1.05, faster than torch), where this run measured them."""
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
