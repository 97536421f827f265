"""Rank side of the sleep-stage benchmarks: one schedule, the three overlap terms, in one pipeline.

:func:`measure_sleep_pipeline` runs inside a rank process whose default group
holds the pipeline's ranks.  It builds the schedule's sleep chunks
(:mod:`.sleep_stages`) and one :class:`~dualpipe_kernels.runtime.Pipeline` on a
:class:`~.payload.PayloadSwitch` transport, then measures, in this order:

1. ``warmup + steps`` pairs of steps, each a step with real activations
   (``T_step``; its busy time; the last one's timeline and received bytes)
   followed by a step of the same pipeline with transfers cut to a few bytes
   (``T_compute``; the last one's timeline): alternating, both terms see the
   same load of a shared machine;
2. the link between ranks 0 and 1 at the activation size (``T_comm`` is
   then the recorded receives timed on that link);
3. with ``floor``, the ranks' compute without the runtime (:mod:`.compute_floor`), and the bare pipeline:
   the same compute and transfers with no runtime.

Every step starts after a barrier; a step's time is this rank's wall time of
``Pipeline.step``.  The parent takes the slowest rank per step.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "SleepRun",
    "simulate_sleep",
    "nominal_chunks",
    "chunk_costs_from_config",
    "RankMeasurement",
    "add_sleep_arguments",
    "chunks_per_stage",
    "measure_sleep_pipeline",
    "slowest_step_median",
    "comm_alone_s",
    "paired_exposed_s",
    "overlap_terms",
]


@dataclass(frozen=True)
class SleepRun:
    """What to run: schedule, sizes and per-chunk sleeps (seconds).  A suite keeps one as its template and
    ``dataclasses.replace``-s the schedule, ranks, transport or size it varies."""

    microbatches: int
    f_s: float
    b_s: float
    w_s: float
    steps: int
    warmup: int = 1
    activation_bytes: int = 1 << 18
    schedule: str = "dualpipev"
    ranks: int = 2
    transport: str = "auto"
    record_timeline: bool = False
    device: str = "cpu"
    boundary_format: str = "none"
    #: also the compute floor (:mod:`.compute_floor`: the ranks' compute alone, then all at once) and the bare
    #: pipeline (the same compute and transfers, no runtime)
    floor: bool = False

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, microbatches: tuple[int, int], activation_bytes: tuple[int, int]
    ) -> SleepRun:
        """The options of :func:`add_sleep_arguments`, unset ones from (full, quick) defaults; checked."""
        from dualpipe_kernels.benchmarks.common import option

        def pick(name: str, full: Any, quick: Any) -> Any:
            return option(args, name, full, quick)

        run = cls(
            microbatches=int(pick("microbatches", *microbatches)),
            f_s=pick("f_ms", 10.0, 2.0) / 1e3,
            b_s=pick("b_ms", 20.0, 4.0) / 1e3,
            w_s=pick("w_ms", 10.0, 2.0) / 1e3,
            steps=int(pick("steps", 3, 1)),
            warmup=int(pick("warmup", 1, 1)),
            activation_bytes=int(pick("activation_bytes", *activation_bytes)),
            transport=str(getattr(args, "transport", None) or "auto"),
        )
        run.check()
        return run

    def check(self) -> None:
        """ValueError naming the option for impossible costs or counts (the schedule is checked by its builder)."""
        if not (self.f_s > 0 and self.b_s > 0 and 0 < self.w_s < self.b_s):
            raise ValueError(
                f"costs need F > 0, B > 0 and 0 < W < B, got F={self.f_s * 1e3:g} B={self.b_s * 1e3:g} "
                f"W={self.w_s * 1e3:g} ms"
            )
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {self.steps}, {self.warmup}")
        if self.activation_bytes < 4:
            raise ValueError(f"--activation-bytes must be >= 4, got {self.activation_bytes}")


def add_sleep_arguments(p: argparse.ArgumentParser, microbatches: tuple[int, int]) -> None:
    """The sleep-stage options every sleep suite shares; ``microbatches``: its (full, quick) default."""
    full, quick = microbatches
    p.add_argument("--microbatches", type=int, default=None, help=f"micro-batches (default {full}; quick {quick})")
    p.add_argument("--f-ms", type=float, default=None, help="forward of one chunk, ms (default 10; quick 2)")
    p.add_argument("--b-ms", type=float, default=None, help="full backward of one chunk, ms (default 20; quick 4)")
    p.add_argument("--w-ms", type=float, default=None, help="weight-gradient part of B, ms (default 10; quick 2)")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 3; quick 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 1)")


@dataclass
class RankMeasurement:
    """One rank's raw figures (seconds); lists are per measured step."""

    times: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    timeline: list[tuple[int, str, float, float]] = field(default_factory=list)
    compute_times: list[float] = field(default_factory=list)
    compute_timeline: list[tuple[int, str, float, float]] = field(default_factory=list)
    received_bytes: list[int] = field(default_factory=list)
    link: dict[str, Any] | None = None
    #: CPU seconds this rank's process (all its threads) used in each measured real step
    cpu_times: list[float] = field(default_factory=list)
    #: with ``SleepRun.floor``: this rank's compute alone and with every rank at once, per step
    floor_alone: list[float] = field(default_factory=list)
    floor_together: list[float] = field(default_factory=list)
    #: with ``SleepRun.floor``: this rank's steps of the bare pipeline (no runtime: compute_floor.bare_pipeline)
    bare: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def chunks_per_stage(schedule: Any) -> int:
    """Chunks of the common ``2 * ranks``-chunk model in one stage of ``schedule``."""
    n_model = len(set(schedule.model_stage))
    return (2 * schedule.num_ranks) // n_model


def _plain(timeline: Any) -> list[tuple[int, str, float, float]]:
    return [(int(r), str(a), float(t0), float(t1)) for r, a, t0, t1 in timeline]


def _timed_steps(pipe: Any, x: Any, labels: Any, n: int, on_step: Any, cpu: list[float] | None = None) -> list[float]:
    import torch.distributed as dist

    from dualpipe_kernels.benchmarks.sleep_stages import sleep_criterion

    times = []
    for k in range(n):
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()  # wall time around step(), as for the torch peers
        res = pipe.step(x, labels=(labels,), criterion=sleep_criterion)
        times.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.process_time() - c0)
        on_step(k, res)
    return times


def measure_sleep_pipeline(rank: int, run: SleepRun) -> RankMeasurement:
    """The three terms of ``run`` on this rank (see the module docstring)."""
    import torch
    import torch.distributed as dist

    from dualpipe_kernels.benchmarks.payload import PayloadSwitch, link_timing
    from dualpipe_kernels.benchmarks.sleep_stages import SleepStage, sleep_batch
    from dualpipe_kernels.runtime import Pipeline
    from dualpipe_kernels.runtime.timeline import busy_time
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.transport import make_transport

    sched = build_schedule(run.schedule, run.ranks, run.microbatches)
    k = chunks_per_stage(sched)
    dev = torch.device(run.device)
    modules = {s: SleepStage(k * run.f_s, k * run.b_s, k * run.w_s).to(dev) for s in sched.stages_of_rank(rank)}
    switch = PayloadSwitch(make_transport(run.transport, None, dev))
    pipe = Pipeline(sched, modules, transport=switch, record_timeline=True, boundary_format=run.boundary_format)
    x = sleep_batch(run.microbatches, run.activation_bytes).to(dev)
    labels = torch.zeros(x.shape[0], device=dev)
    out = RankMeasurement()
    last = run.warmup + run.steps - 1

    def real_step(i: int, res: Any) -> None:
        if i >= run.warmup:
            out.busy.append(busy_time(res.timeline))
        if i == last:
            out.received_bytes = list(switch.received_bytes)  # this step's receives alone
            if run.record_timeline:
                out.timeline = _plain(res.timeline)
        switch.received_bytes.clear()

    def probe_step(i: int, res: Any) -> None:
        if i == last:
            out.compute_timeline = _plain(res.timeline)

    try:
        switch.received_bytes.clear()
        # Real and cut steps alternate (the same warm-up for both), so the two terms see the same load:
        # measured one run after the other, a load that grows on a shared machine inflated the second.
        for k in range(run.warmup + run.steps):
            switch.tiny = False
            out.times += _timed_steps(pipe, x, labels, 1, lambda _i, res, k=k: real_step(k, res), out.cpu_times)
            switch.tiny = True
            out.compute_times += _timed_steps(pipe, x, labels, 1, lambda _i, res, k=k: probe_step(k, res))
        switch.tiny = False
        out.times, out.compute_times = out.times[run.warmup :], out.compute_times[run.warmup :]
        out.cpu_times = out.cpu_times[run.warmup :]
        link = link_timing(switch.inner, rank, run.ranks, run.activation_bytes, device=dev)
        out.link = asdict(link) if link is not None else None
        if run.floor:
            from dualpipe_kernels.benchmarks.compute_floor import bare_pipeline, compute_floor

            # five steps each (the floor's alone phase runs the ranks one after another)
            out.bare = bare_pipeline(
                rank, run.ranks, sched, modules, switch.inner, run.activation_bytes, min(run.steps, 5)
            )
            out.floor_alone, out.floor_together = compute_floor(
                rank, run.ranks, sched, modules, run.activation_bytes, min(run.steps, 5)
            )
        dist.barrier()
    finally:
        pipe.close()
        switch.close()
    return out


# ---------------------------------------------------------------- parent side
def slowest_step_median(per_rank: list[list[float]]) -> float:
    """Median over steps of the slowest rank's time of that step."""
    import statistics

    return float(statistics.median(max(ts) for ts in zip(*per_rank, strict=True)))


def paired_exposed_s(per_rank: list[RankMeasurement]) -> float:
    """Median over steps k of (slowest rank's real step k - slowest rank's cut step k), in seconds.

    Step k's real and cut runs are adjacent in time, so a machine load that changes during the run
    cancels in each difference; a second estimate of ``exposed_comm_s`` (which is the difference of
    the two medians, the contract), steadier on a shared machine.
    """
    import statistics

    real = [max(ts) for ts in zip(*[m.times for m in per_rank], strict=True)]
    cut = [max(ts) for ts in zip(*[m.compute_times for m in per_rank], strict=True)]
    return float(statistics.median(a - b for a, b in zip(real, cut, strict=True)))


def comm_alone_s(received_per_rank: list[list[int]], link: Any) -> float:
    """``T_comm``: the busiest rank's recorded receives, each timed on the measured link (a ``LinkTiming``)."""
    return max((sum(link.transfer_s(b) for b in rb) for rb in received_per_rank), default=0.0)


def overlap_terms(per_rank: list[RankMeasurement]) -> dict[str, Any]:
    """The overlap metric and the link of one measured schedule (keys of ``OverlapMetric`` plus link figures)."""
    from dualpipe_kernels.benchmarks.metrics import overlap_metric
    from dualpipe_kernels.benchmarks.payload import LinkTiming

    t_step = slowest_step_median([m.times for m in per_rank])
    t_compute = slowest_step_median([m.compute_times for m in per_rank])
    paired = {"exposed_comm_paired_s": paired_exposed_s(per_rank)}
    link_d = next((m.link for m in per_rank if m.link), None)
    if link_d is None:  # one rank: nothing moves between processes, no share to report
        return {**overlap_metric(t_step, t_compute, 0.0).as_dict(), **paired}
    link = LinkTiming(**link_d)
    t_comm = comm_alone_s([m.received_bytes for m in per_rank], link)
    return {
        **overlap_metric(t_step, t_compute, t_comm).as_dict(),
        **paired,
        "link_latency_s": link.latency_s,
        "link_bandwidth_gbps": link.bandwidth_bps / 1e9,
        "transfer_s": link.one_way_s,
        "transfers_per_rank_max": max(len(m.received_bytes) for m in per_rank),
    }


# ---------------------------------------------------------------- the simulator on sleep chunks
def simulate_sleep(name: str, ranks: int, microbatches: int, chunks: dict[int, Any], comm: Any = None) -> Any:
    """SimResult of ``name`` on the common model (F&B = F + B: no overlap hook).

    ``chunks``: ``{k: ChunkCosts}``, the cost of a stage of ``k`` chunks
    (:func:`.schedules.calibrate_chunks` measured, or :func:`nominal_chunks`); the stage of
    this schedule has ``chunks_per_stage`` chunks.  ``comm``: a ``CommModel``
    (default free communication).
    """
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.schedules.simulator import simulate

    sched = build_schedule(name, ranks, microbatches)
    return simulate(sched, chunks[chunks_per_stage(sched)].cost_model(), comm)


def nominal_chunks(f_s: float, b_s: float, w_s: float, overshoot_s: float = 0.0) -> dict[int, Any]:
    """``{k: ChunkCosts}`` of the requested sleeps of one chunk plus what each ``time.sleep`` adds, k = 1, 2."""
    from dualpipe_kernels.benchmarks.sleep_stages import ChunkCosts

    return {k: ChunkCosts.nominal(k * f_s, k * b_s, k * w_s, overshoot_s) for k in (1, 2)}


def chunk_costs_from_config(c: dict[str, Any]) -> dict[int, Any] | None:
    """The ``{k: ChunkCosts}`` a result's ``config["chunk_costs_s"]`` holds (None when absent)."""
    from dualpipe_kernels.benchmarks.sleep_stages import ChunkCosts

    raw = c.get("chunk_costs_s")
    return {int(k): ChunkCosts(**v) for k, v in raw.items()} if raw else None
