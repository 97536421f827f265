"""overhead: the runtime's own cost per compute action, on stages that do almost nothing.

Every stage chunk is one ``nn.Linear(8, 8)`` and every micro-batch one 1x8
row, so a step is almost all framework cost plus the latency of the transfers
on the critical path.  Each case runs on the same 2 ranks (spawned, gloo on
127.0.0.1, one thread per rank): our runtime for each schedule on each
transport (``native``, ``torch`` = gloo; ``ordered``: gloo paired in posting order as NCCL is, which the
runtime drives in its program's order; ``native-prev``: the native transport
as the engine was before its small-message paths, with ``recv_poll_ms=0``, whose
receive worker watches every posted receive, ``gather_sends=False`` and the waiters'
old 50 us spin), and
torch.distributed.pipelining's
schedules of the same placement on gloo.  A step's time is the slowest rank's
wall time of that step (every step starts after a barrier); the figure is the
median over the measured steps, with min and max beside it.  The cases take
turns step by step (round k runs step k of every case), so a change in the
machine's load reaches ours and torch's alike.
``per_action_us`` divides it by the compute actions of the busiest rank of our
schedule with the same placement (torch's rows use the same count: same work).
``ratio_to_torch`` is ours-on-gloo / torch-on-gloo per step, per schedule;
``ratio_to_prev`` ours-on-native / ours-on-native-prev.

The ``floor`` rows (impl ``floor``, transport ``none``; ``--no-floor``: none) are
torch's own work with no pipeline around it, measured in the same rounds: each
rank runs its stage modules for its compute actions in its schedule's order,
with no transfers (an F: the module on a fresh leaf input, and the criterion on
a loss stage; a B, an I, or a pair's B half: one ``torch.autograd.backward``
with a ones gradient; a W: nothing, its work was in the I).  It is what a
hand-written loop over the same modules costs at least, so ``over_floor_us``
(our per-action cost minus the floor's, same schedule) is the runtime's own
share of a compute action.

The ``bound`` rows (impl ``bound``, transport ``native`` or ``torch``; with the floor,
overhead_bound.py) are what the schedule itself allows: each op of the floor's work timed by itself (in
the floor's own steps, the same rounds as every case) and the transport's one-way latency of a
runtime-sized message (after the rounds), put through the schedule simulator.  A
runtime that cost nothing would take that long; ``ratio_to_bound`` is our step over it.

Then rank 0 runs the same number of steps of ours on the native transport for
``--profile-schedule`` (default dualpipev) under cProfile; the top entries by
cumulative time go into the results, so the fast-path work is driven by
measurement.  The profiled steps are not the timed ones (cProfile slows them).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from dualpipe_kernels.benchmarks.overhead_baseline import add_baseline, check_tree, run_baseline_launch
from dualpipe_kernels.benchmarks.overhead_bound import (
    WIDTH,
    add_bound,
    bound_rows,
    chunk_stack,
    floor_work,
    measure_latency,
    mse,
    op_costs_from,
)
from dualpipe_kernels.benchmarks.overhead_report import add_floor, add_ratios, case_row, combine_launches, to_markdown

NAME = "overhead"
TRANSPORTS = ("native", "native-prev", "torch", "ordered")
DEFAULT_TRANSPORTS = ("native", "native-prev", "torch")
FULL_SCHEDULES = ("dualpipev", "1f1b", "zb1p", "zbv", "interleaved1f1b", "gpipe", "dualpipe")
QUICK_SCHEDULES = ("dualpipev", "1f1b", "zb1p")
#: torch.distributed.pipelining class -> (its rows' schedule label, our schedule whose selection runs it).  When
#: the label is one of ours (same stage placement) the per-action count and the ratio use ours; otherwise
#: (interleaved zero bubble, which we lack) torch's own count of compute actions in its pipeline_order.
TORCH_PEERS: dict[str, tuple[str, str]] = {
    "ScheduleDualPipeV": ("dualpipev", "dualpipev"),
    "Schedule1F1B": ("1f1b", "1f1b"),
    "ScheduleZBVZeroBubble": ("zbv", "zbv"),
    "ScheduleInterleavedZeroBubble": ("interleavedzb", "zb1p"),
    "ScheduleInterleaved1F1B": ("interleaved1f1b", "interleaved1f1b"),
    "ScheduleGPipe": ("gpipe", "gpipe"),
}

__all__ = ["NAME", "OverheadConfig", "add_arguments", "run", "to_markdown"]


def _schedule_of(case: tuple[str, str, str]) -> str:
    """The schedule label of ``case``'s row: a torch class's own label, else our schedule's name."""
    impl, _, name = case
    return TORCH_PEERS[name][0] if impl == "torch" else name


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedules", default=None, help=f"comma list (default {','.join(FULL_SCHEDULES)}; quick fewer)")
    p.add_argument(
        "--transports",
        default=",".join(DEFAULT_TRANSPORTS),
        help="our transports, comma list (default native,native-prev,torch; native-prev: the native transport as "
        "before its small-message paths, recv_poll_ms=0 and gather_sends=False; ordered: gloo paired in posting "
        "order as NCCL is, driven in the program's order)",
    )
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches (default 16; quick 8)")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 15; quick 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument(
        "--launches", type=int, default=None, help="fresh rank-process sets, medians over them (default 3; quick 1)"
    )
    p.add_argument("--no-torch", dest="no_torch", action="store_true", help="skip torch.distributed.pipelining")
    p.add_argument(
        "--no-floor",
        dest="no_floor",
        action="store_true",
        help="skip the floor rows (torch's own work per rank with no pipeline, transfers or runtime)",
    )
    p.add_argument("--profile-schedule", default="dualpipev", help="schedule profiled on native (default dualpipev)")
    p.add_argument("--profile-top", type=int, default=25, help="profile entries kept (default 25)")
    p.add_argument(
        "--baseline-tree",
        default=None,
        metavar="PATH",
        help="also measure another source tree (e.g. a git worktree of the previous commit, with its compiled "
        "extension) in child processes on PYTHONPATH=PATH, its launches taking turns with these: new/old per case",
    )
    p.add_argument(
        "--no-pin",
        dest="no_pin",
        action="store_true",
        help="leave the rank processes unpinned (default: each rank on its own core, ours and torch's alike)",
    )


@dataclass(frozen=True)
class OverheadConfig:
    schedules: tuple[str, ...]
    transports: tuple[str, ...]
    microbatches: int
    steps: int
    warmup: int
    torch_peers: bool
    profile_schedule: str
    profile_top: int
    ranks: int = 2
    pin: bool = True  # each rank process on its own core (when there are enough)
    launches: int = 3  # fresh sets of rank processes, each measuring every case (medians over them)
    floor: bool = True  # also the floor rows (torch's own work, no pipeline)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OverheadConfig:
        from dualpipe_kernels.benchmarks.common import option

        quick = getattr(args, "quick", False)
        text = getattr(args, "schedules", None) or ",".join(QUICK_SCHEDULES if quick else FULL_SCHEDULES)
        cfg = cls(
            schedules=tuple(s.strip() for s in str(text).split(",") if s.strip()),
            transports=tuple(
                t.strip() for t in str(getattr(args, "transports", ",".join(DEFAULT_TRANSPORTS))).split(",") if t
            ),
            microbatches=int(option(args, "microbatches", 16, 8)),
            steps=int(option(args, "steps", 15, 5)),
            warmup=int(getattr(args, "warmup", 2)),
            torch_peers=not getattr(args, "no_torch", False),
            profile_schedule=str(getattr(args, "profile_schedule", "dualpipev")),
            profile_top=int(getattr(args, "profile_top", 25)),
            pin=not getattr(args, "no_pin", False),
            launches=int(option(args, "launches", 3, 1)),
            floor=not getattr(args, "no_floor", False),
        )
        cfg.check()
        return cfg

    def check(self) -> None:
        """ValueError naming the option for anything that cannot run."""
        from dualpipe_kernels.schedules.generators import SCHEDULE_NAMES, build_schedule

        bad = [s for s in self.schedules if s not in SCHEDULE_NAMES]
        if not self.schedules or bad:
            raise ValueError(f"--schedules must be among {', '.join(SCHEDULE_NAMES)}, got {','.join(self.schedules)}")
        bad = [t for t in self.transports if t not in TRANSPORTS]
        if not self.transports or bad:
            raise ValueError(f"--transports must be among {', '.join(TRANSPORTS)}, got {','.join(self.transports)}")
        if self.steps < 1 or self.warmup < 0 or self.profile_top < 1 or self.launches < 1:
            raise ValueError(
                f"need --steps >= 1, --warmup >= 0, --profile-top >= 1, --launches >= 1; got {self.steps}, "
                f"{self.warmup}, {self.profile_top}, {self.launches}"
            )
        if self.profile_schedule not in SCHEDULE_NAMES:
            raise ValueError(f"--profile-schedule must be among {', '.join(SCHEDULE_NAMES)}")
        for s in {*self.schedules, self.profile_schedule}:
            build_schedule(s, self.ranks, self.microbatches)  # ValueError naming the constraint

    def cases(self) -> list[tuple[str, str, str]]:
        """(impl, transport, schedule or torch class) of every row, in order."""
        ours = [("ours", tr, s) for s in self.schedules for tr in self.transports]
        peers = [("torch", "torch", c) for c, (_, s) in TORCH_PEERS.items() if self.torch_peers and s in self.schedules]
        floors = [("floor", "none", s) for s in self.schedules] if self.floor else []
        return ours + peers + floors


# ---------------------------------------------------------------- rank side
def _timed(n: int, step: Any) -> list[float]:
    import torch.distributed as dist

    times = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    dist.barrier()
    return times


def _our_pipeline(rank: int, cfg: OverheadConfig, schedule: str, transport: str) -> tuple[Any, Any]:
    """(a step callable, a close callable) of ours for ``schedule`` on ``transport`` (``native-prev``: a
    NativeTransport made here, which the close callable closes after the pipeline)."""
    import torch

    from dualpipe_kernels.benchmarks.sleep_runs import chunks_per_stage
    from dualpipe_kernels.runtime import Pipeline
    from dualpipe_kernels.schedules.generators import build_schedule

    sched = build_schedule(schedule, cfg.ranks, cfg.microbatches)
    k = chunks_per_stage(sched)
    owned: Any = None
    if transport == "native-prev":
        from dualpipe_kernels.transport.native import NativeTransport

        owned = NativeTransport(recv_poll_ms=0.0, gather_sends=False, spin_us=50.0)
    elif transport == "ordered":
        from dualpipe_kernels.transport.torch_dist import TorchDistTransport

        owned = TorchDistTransport(ordered=True)  # gloo paired in posting order, as NCCL is: program order
    pipe = Pipeline(sched, {s: chunk_stack(k) for s in sched.stages_of_rank(rank)}, transport=owned or transport)

    def close() -> None:
        try:
            pipe.close()
        finally:
            if owned is not None:
                owned.close()

    x = torch.randn(cfg.microbatches, WIDTH)
    target = torch.zeros(cfg.microbatches, WIDTH)
    return lambda: pipe.step(x, labels=(target,), criterion=mse), close


def _floor_step(rank: int, cfg: OverheadConfig, schedule: str) -> Any:
    """A step callable of torch's own work of this rank in ``schedule`` (overhead_bound.floor_work); its
    ``rounds`` attribute gets each call's per-op times (what the bound rows are made of, measured in the
    same rounds as every other case)."""
    run = floor_work(rank, cfg, schedule)
    rounds: list[list[Any]] = []

    def step() -> None:
        took: list[Any] = []
        run(took)
        rounds.append(took)

    step.rounds = rounds  # type: ignore[attr-defined]
    return step


def _torch_actions(sched: Any, rank: int) -> int | None:
    """Compute actions (F, I, W, B, overlapped F&B) of ``rank`` in torch's ``pipeline_order``; None without one."""
    order = getattr(sched, "pipeline_order", None)
    if not order:
        return None
    compute = {"F", "I", "W", "B", "OVERLAP_F_B"}
    return sum(1 for a in order[rank] if a is not None and a.computation_type.value in compute)


def _torch_step(rank: int, cfg: OverheadConfig, cls_name: str) -> tuple[Any, int | None]:
    """(a step callable of torch.distributed.pipelining's ``cls_name`` on the default (gloo) group, this rank's
    compute actions in torch's own order or None)."""
    import torch
    from torch.distributed import pipelining as pp

    cls = getattr(pp, cls_name, None)
    if cls is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.distributed.pipelining.{cls_name}")
    dev, n, r = torch.device("cpu"), cfg.microbatches, cfg.ranks
    if cls_name in ("Schedule1F1B", "ScheduleGPipe"):  # one stage of two chunks per rank
        stages = [pp.PipelineStage(chunk_stack(2), rank, r, dev)]
        sched: Any = cls(stages[0], n, loss_fn=mse)
    else:
        placement = (
            (rank, 2 * r - 1 - rank) if cls_name in ("ScheduleDualPipeV", "ScheduleZBVZeroBubble") else (rank, rank + r)
        )
        stages = [pp.PipelineStage(chunk_stack(1), s, 2 * r, dev) for s in placement]
        sched = cls(stages, n, loss_fn=mse)
    x, target = torch.randn(n, WIDTH), torch.zeros(n, WIDTH)
    first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)

    def step() -> None:
        sched.step(*((x,) if first else ()), target=target if last else None, losses=[] if last else None)

    return step, _torch_actions(sched, rank)


def _build(rank: int, cfg: OverheadConfig, case: tuple[str, str, str]) -> tuple[Any, int | None, Any]:
    """(a step callable, torch's compute actions of this rank or None, a close callable) of ``case``."""
    impl, transport, name = case
    if impl == "torch":
        step, actions = _torch_step(rank, cfg, name)
        return step, actions, lambda: None
    if impl == "floor":
        return _floor_step(rank, cfg, name), None, lambda: None
    step, close = _our_pipeline(rank, cfg, name, transport)
    return step, None, close


def _measure_all(rank: int, cfg: OverheadConfig) -> dict[str, Any]:
    """Every case's step times, ``{"times", "actions"}`` per case (or its error), with the cases' steps taking
    turns: round k times step k of every case, so a change in the machine's load (two shared cores) reaches
    ours and torch's alike and the ratios between them keep their meaning."""
    out: dict[str, Any] = {}
    built: dict[str, tuple[Any, int | None, Any]] = {}
    for case in cfg.cases():
        key = "/".join(case)
        try:
            built[key] = _build(rank, cfg, case)
        except Exception as e:  # noqa: BLE001 - reported in the row
            out[key] = f"{type(e).__name__}: {e}".splitlines()[0]
    times: dict[str, list[float]] = {k: [] for k in built}
    try:
        for i in range(cfg.warmup + cfg.steps):
            for key, (step, _, _) in list(built.items()):
                try:
                    t = _timed(1, step)[0]
                except Exception as e:  # noqa: BLE001 - reported in the row; the other cases go on
                    out[key] = f"{type(e).__name__}: {e}".splitlines()[0]
                    built.pop(key)[2]()
                    continue
                if i >= cfg.warmup:
                    times[key].append(t)
            if rank == 0:
                sys.stderr.write(f"  bench overhead: round {i + 1}/{cfg.warmup + cfg.steps} done\n")
    finally:
        for key, (step, actions, close) in built.items():
            close()
            out[key] = {"times": times[key], "actions": actions}
            rounds = getattr(step, "rounds", None)  # a floor case: its ops' own times, measured rounds only
            if rounds is not None:
                out[key]["ops"] = op_costs_from(rounds[cfg.warmup :])
    return out


def _profile(rank: int, cfg: OverheadConfig) -> dict[str, list[dict[str, Any]]]:
    """cProfile of rank 0 over ``steps`` steps (after the warm-up) of ours on native: the top entries by
    cumulative time (``"cumulative"``) and by own time (``"self"``); empty lists on other ranks."""
    import cProfile
    import pstats

    step, close = _our_pipeline(rank, cfg, cfg.profile_schedule, "native")
    try:
        _timed(cfg.warmup, step)
        prof = cProfile.Profile()

        def profiled() -> None:  # only Pipeline.step is profiled, not the barriers between steps
            if rank == 0:
                prof.enable()
            try:
                step()
            finally:
                prof.disable()

        _timed(cfg.steps, profiled)
    finally:
        close()
    if rank != 0:
        return {"cumulative": [], "self": []}
    stats: dict[Any, Any] = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    # this module's own frames (the step wrapper) only wrap Pipeline.step
    items = [kv for kv in stats.items() if not kv[0][0].endswith("benchmarks/overhead.py")]
    return {"cumulative": _top(items, 3, cfg), "self": _top(items, 2, cfg)}


def _top(items: list[Any], field: int, cfg: OverheadConfig) -> list[dict[str, Any]]:
    """The ``profile_top`` pstats entries with the largest ``field`` (2: own time, 3: cumulative), JSON-ready."""
    top = sorted(items, key=lambda kv: kv[1][field], reverse=True)[: cfg.profile_top]
    return [
        {
            "function": f"{_short(fn)}:{line}({func})",
            "ncalls": nc,
            "tottime_s": tt,
            "cumtime_s": ct,
            "tottime_per_step_ms": tt / cfg.steps * 1e3,
            "cumtime_per_step_ms": ct / cfg.steps * 1e3,
        }
        for (fn, line, func), (_cc, nc, tt, ct, _callers) in top
    ]


def _short(path: str) -> str:
    """A profiled file relative to its package root (``dualpipe_kernels/...``, ``torch/...``)."""
    for root in ("dualpipe_kernels/", "site-packages/"):
        i = path.rfind(root)
        if i >= 0:
            return path[i + (len(root) if root == "site-packages/" else 0) :]
    return path


def _worker(rank: int, world: int, cfg: OverheadConfig, profile: bool = True) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    if cfg.pin:
        from dualpipe_kernels.benchmarks.common import pin_to_core

        pin_to_core(rank)  # before any transport starts its threads: they inherit the core
    out = _measure_all(rank, cfg)
    if cfg.floor:
        out["bound"] = measure_latency(rank, cfg)
    if not profile:
        return out
    try:
        out["profile"] = _profile(rank, cfg)
    except Exception as e:  # noqa: BLE001 - reported in the result
        out["profile"] = f"{type(e).__name__}: {e}".splitlines()[0]
    return out


# ---------------------------------------------------------------- parent side
def run(args: argparse.Namespace) -> dict[str, Any]:
    from dualpipe_kernels.benchmarks.common import Progress
    from dualpipe_kernels.runtime.launch import spawn

    cfg = OverheadConfig.from_args(args)
    tree = check_tree(args.baseline_tree) if getattr(args, "baseline_tree", None) else None
    bar = Progress(1, title="bench overhead")
    bar.note(f"{len(cfg.cases())} cases, {cfg.ranks} ranks x {cfg.microbatches} micro-batches, {cfg.steps} steps")
    t0 = time.perf_counter()
    launches: list[list[dict[str, Any]]] = []
    old: list[list[dict[str, Any]]] = []
    for k in range(cfg.launches):  # the first launch also profiles
        if tree is not None and k % 2 == 1:  # new, old, old, new, ...: neither always goes first
            old.append(run_baseline_launch(tree, cfg))
        per_rank = spawn(_worker, cfg.ranks, cfg, k == 0, timeout_s=900, pg_timeout_s=300, threads=1)
        rows = [case_row(case, _schedule_of(case), cfg.ranks, cfg.microbatches, per_rank) for case in cfg.cases()]
        if cfg.floor:
            rows += bound_rows(cfg, per_rank)
        add_ratios(rows)
        launches.append(rows)
        if k == 0:
            prof = per_rank[0]["profile"]
        if tree is not None and k % 2 == 0:
            old.append(run_baseline_launch(tree, cfg))
    rows = combine_launches(launches)
    add_floor(rows)
    add_bound(rows)
    if tree is not None:
        add_baseline(rows, launches, old)
    bar.update(f"done in {time.perf_counter() - t0:.1f} s")
    bar.close()
    result: dict[str, Any] = {"rows": rows, "config": asdict(cfg)}
    if tree is not None:
        result["baseline_tree"] = str(tree)
    if isinstance(prof, str):
        result.update(profile=[], profile_self=[], profile_error=prof)
    else:
        result.update(profile=prof["cumulative"], profile_self=prof["self"])
    result["profile_case"] = {
        "impl": "ours",
        "transport": "native",
        "schedule": cfg.profile_schedule,
        "rank": 0,
        "steps": cfg.steps,
    }
    return result
