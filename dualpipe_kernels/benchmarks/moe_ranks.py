"""Rank side of the ``moe`` benchmark: the process groups, the chunk costs alone, and each contender's steps.

Layout: ``pp * ep`` processes; process ``g`` is pipeline rank ``g // ep`` and
expert rank ``g % ep``.  Each pipeline group (same expert rank) runs one
DualPipeV pipeline of ``2 * pp`` MoE chunks (:mod:`.moe_block`) on its own
data; each expert group (same pipeline rank) holds the same stages and
exchanges their tokens.  :func:`rank_main` measures, for every all_to_all size
of the sweep, in the same processes:

* the chunk costs alone on the expert group, pipelines idle: F, a full B, the
  I/W split of B, a sequential pair (F of one chunk then B of another), the
  overlapped pair (the hook), one all_to_all (each posted after a compute
  phase's sleep, as a chunk posts it);
* per contender (``CONTENDERS``), ``warmup + steps`` pipeline steps (each after
  a barrier of all processes; a step's time is this process's wall time of it;
  our Pipeline's also their timelines, for the in-situ costs the suite feeds
  the simulator) and, at the first size, the first step's gradients.

Contenders: ``ours`` (our Pipeline, chunks with the overlap hook),
``ours-hook-off`` (the same chunks without it: a pair runs F then B) and
``torch.ScheduleDualPipeV`` (torch.distributed.pipelining, its default
OVERLAP_F_B: F then B) and ``dropin.ScheduleDualPipeV`` (torch's program with the class from
dualpipe_kernels.integrations.pipelining, over the hooked chunks), all from the same weights and data.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dualpipe_kernels.benchmarks.moe_block import (
    ExpertGroup,
    MoEChunk,
    OverlappedMoEChunk,
    init_chunk,
    moe_criterion,
)
from dualpipe_kernels.benchmarks.sleep_stages import sleep_seconds

__all__ = ["CONTENDERS", "MoeRun", "rank_main", "pad_for_bytes"]

CONTENDERS = ("ours", "ours-hook-off", "torch.ScheduleDualPipeV", "dropin.ScheduleDualPipeV")


@dataclass(frozen=True)
class MoeRun:
    """What every rank runs.  Costs in seconds per chunk per micro-batch; ``a2a_bytes``: the sweep (one rank's
    send buffer per all_to_all; the first entry is the few-bytes baseline)."""

    pp: int
    ep: int
    microbatches: int
    rows: int
    cols: int
    f_s: float
    b_s: float
    w_s: float
    a2a_bytes: tuple[int, ...]
    steps: int
    warmup: int
    cost_repeats: int
    transport: str = "auto"
    a2a: str = "native"  # what moves the all_to_all's bytes: "native" (shared memory) or "gloo" (TCP loopback)
    comm_nice: int = 10  # niceness of every thread but the compute thread (0: all equal); see comm_below_compute


def pad_for_bytes(run: MoeRun, a2a_bytes: int) -> int:
    """Pad elements per peer block so one send buffer is about ``a2a_bytes`` (never below the tokens themselves)."""
    per_peer = run.rows // run.ep * run.cols
    return max(0, a2a_bytes // (4 * run.ep) - per_peer)


def _chunks(cls: type[MoEChunk], run: MoeRun, group: ExpertGroup, stages: Sequence[int], e_rank: int) -> dict[int, Any]:
    """This rank's stage chunks, weights from (stage, expert rank): identical for every contender."""
    return {s: init_chunk(cls(run.cols, group, run.f_s, run.b_s, run.w_s), 1000 * s + e_rank) for s in stages}


def _batch(run: MoeRun, e_rank: int) -> torch.Tensor:
    """The full batch of this pipeline replica: small integers, ``[microbatches * rows, cols]``."""
    gen = torch.Generator().manual_seed(17 + e_rank)
    return torch.randint(-2, 3, (run.microbatches * run.rows, run.cols), generator=gen).float()


def _grads(modules: dict[int, Any]) -> dict[str, torch.Tensor]:
    return {
        f"{s}.{n}": p.grad.clone() for s, m in modules.items() for n, p in m.named_parameters() if p.grad is not None
    }


def _zero(modules: dict[int, Any]) -> None:
    for m in modules.values():
        m.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- chunk costs alone
def _per_call_s(setup: Any, fn: Any, repeats: int, group: Any, batch: int = 4, gap_s: float = 0.0) -> float:
    """Median over ``repeats`` rounds (after one warm-up round) of the time per call of ``fn`` run ``batch`` times
    back to back, on states made by ``setup`` before the round (untimed), as a pipeline runs them: the
    barrier that starts a round is paid once per round, not once per call.  ``gap_s``: an untimed sleep
    before each call (what precedes it in a chunk: a compute phase)."""
    per_call = []
    for _ in range(repeats + 1):
        states = [setup() for _ in range(batch)]
        dist.barrier(group=group)
        spent = 0.0
        for st in states:
            if gap_s > 0:
                sleep_seconds(gap_s)
            t0 = time.perf_counter()
            fn(st)
            spent += time.perf_counter() - t0
        per_call.append(spent / batch)
    return statistics.median(per_call[1:])


def chunk_costs(run: MoeRun, group: ExpertGroup, e_rank: int) -> dict[str, float]:
    """F, B, I, W, the sequential and the overlapped pair, one all_to_all: seconds per call on this expert group.

    Every expert rank of the group runs the same calls (the all_to_alls are collectives).  I is a backward
    with the WeightGradStore enabled (the W sleeps deferred), W the store's pop of one I's deferred work.
    """
    from dualpipe_kernels.runtime import WeightGradStore

    m0, m1 = (init_chunk(OverlappedMoEChunk(run.cols, group, run.f_s, run.b_s, run.w_s), k) for k in (1, 2))
    x = _batch(run, e_rank)[: run.rows].requires_grad_(True)
    ones = torch.ones(run.rows, run.cols)
    reps, g = run.cost_repeats, group.group_f
    store, keys = WeightGradStore(), itertools.count()

    def none() -> None:
        return None

    def fwd1() -> Any:
        return m1(x)

    def split_backward(y: Any) -> int:
        key = next(keys)
        with store.bind(), store.enabled_for(True):
            y.backward(ones)
        store.flush(key)
        return key

    def deferred() -> int:
        return split_backward(m1(x))

    def weight(key: int) -> None:
        store.pop(key)

    def hook(y: Any) -> None:
        OverlappedMoEChunk.overlapped_forward_backward(m0, [x], None, [], m1, None, [y], [ones])

    def sequential(y: Any) -> None:
        m0(x)
        y.backward(ones)

    try:
        return {
            "f": _per_call_s(none, lambda _: m0(x), reps, g),
            "b": _per_call_s(fwd1, lambda y: y.backward(ones), reps, g),
            "i": _per_call_s(fwd1, split_backward, reps, g),
            "w": _per_call_s(deferred, weight, reps, g),
            "pair_seq": _per_call_s(fwd1, sequential, reps, g),
            "pair_hook": _per_call_s(fwd1, hook, reps, g),
            # as a chunk runs it: posted right after a compute phase (threads asleep, caches cold)
            "a2a": _per_call_s(none, lambda _: group.exchange(ones, backward=False), reps, g, gap_s=m0.f_phase),
        }
    finally:
        store.clear()


def comm_below_compute(niceness: int) -> int:
    """Give every thread of this process but the calling one (the compute thread) the niceness ``niceness``.

    On a GPU the all_to_all's copies run on copy engines and NICs beside the SMs; here they are CPU
    copies by the communication threads (the native engine's workers and their helpers, gloo's), and
    four processes share two cores.  At equal priority a compute thread that wakes from its sleep waits
    behind them (a 5 ms phase measured 9.6 ms, posting an exchange up to 6.7 ms, with the exchanges
    themselves already done), so the pair measured the scheduler, not the overlap.  With the communication
    threads below the compute thread, they get the cores whenever it sleeps or waits.  Threads started
    later inherit their creator's niceness, so the suite calls this again once they exist.  Linux only
    (``/proc/self/task``; the scheduler's autogroups keep it within this run's processes); returns how
    many threads it set (0 elsewhere, or for ``niceness`` 0).
    """
    import os
    import threading

    if niceness == 0 or not os.path.isdir("/proc/self/task"):
        return 0
    me, done = threading.get_native_id(), 0
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid != me:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
                done += 1
            except (ProcessLookupError, PermissionError):  # gone meanwhile, or a policy forbids it
                pass
    return done


# ---------------------------------------------------------------- contenders
def _timed(step: Any) -> float:
    """One step after a barrier of every process: this process's wall time of it (s)."""
    dist.barrier()
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def _note(rank: int, text: str) -> None:
    if rank == 0:
        sys.stderr.write(f"  bench moe: {text}\n")
        sys.stderr.flush()


class _Ours:
    """Our Pipeline over the pipeline group, chunks with or without the overlap hook."""

    def __init__(self, run: MoeRun, hook: bool, group: ExpertGroup, pp_group: Any, p_rank: int, e_rank: int) -> None:
        from dualpipe_kernels.runtime import Pipeline
        from dualpipe_kernels.schedules.generators import build_schedule

        sched = build_schedule("dualpipev", run.pp, run.microbatches)
        cls = OverlappedMoEChunk if hook else MoEChunk
        self.modules = _chunks(cls, run, group, sched.stages_of_rank(p_rank), e_rank)
        # scale_grads as torch's peer; the timeline (one clock read per action) feeds the in-situ simulation
        self.pipe = Pipeline(
            sched, self.modules, group=pp_group, transport=run.transport, scale_grads=False, record_timeline=True
        )
        self.x = _batch(run, e_rank)
        self.last: tuple[list[Any], float] | None = None  # (timeline entries, step seconds) of the last step

    def step(self) -> None:
        _zero(self.modules)
        res = self.pipe.step(self.x, labels=(), criterion=moe_criterion)
        self.last = (list(res.timeline), float(res.step_time_s))

    def pairs(self) -> int:
        return sum(int(getattr(m, "overlapped_pairs", 0)) for m in self.modules.values())

    def close(self) -> None:
        self.pipe.close()


class _Torch:
    """torch.distributed.pipelining's ScheduleDualPipeV over the pipeline group, the same chunks (no hook); with
    ``dropin``, the same program with the class from dualpipe_kernels.integrations.pipelining (one import
    changed) over the hooked chunks: our runtime, reached the way torch code reaches torch's."""

    def __init__(
        self, run: MoeRun, group: ExpertGroup, pp_group: Any, p_rank: int, e_rank: int, dropin: bool = False
    ) -> None:
        from torch.distributed import pipelining as pp

        cls = getattr(pp, "ScheduleDualPipeV", None)
        if cls is None:
            raise RuntimeError(f"torch {torch.__version__} has no torch.distributed.pipelining.ScheduleDualPipeV")
        stages = [p_rank, 2 * run.pp - 1 - p_rank]  # the V placement
        self.modules = _chunks(OverlappedMoEChunk if dropin else MoEChunk, run, group, stages, e_rank)

        # Static shapes (torch's shape inference would run the all_to_alls); an input that needs a
        # gradient (every stage but the first) says so, or torch sends no gradient back for it.
        def example(grad: bool) -> tuple[torch.Tensor]:
            return (torch.empty(run.rows, run.cols, requires_grad=grad),)

        self.stages = [
            pp.PipelineStage(
                self.modules[s],
                s,
                2 * run.pp,
                torch.device("cpu"),
                input_args=example(s > 0),
                output_args=example(True),
                group=pp_group,
            )
            for s in stages
        ]
        # Our runtime sums micro-batch gradients; so does torch with scale_grads=False.
        if dropin:
            from dualpipe_kernels.integrations.pipelining import ScheduleDualPipeV
            from dualpipe_kernels.runtime.options import WireOptions

            wire = WireOptions(transport=run.transport)
            self.sched = ScheduleDualPipeV(
                self.stages, run.microbatches, loss_fn=moe_criterion, scale_grads=False, wire=wire
            )
        else:
            self.sched = cls(self.stages, run.microbatches, loss_fn=moe_criterion, scale_grads=False)
        self.x = _batch(run, e_rank)
        self.first = any(st.is_first for st in self.stages)
        self.last = any(st.is_last for st in self.stages)

    def step(self) -> None:
        _zero(self.modules)
        args = (self.x,) if self.first else ()
        target = torch.zeros(self.x.shape[0]) if self.last else None
        self.sched.step(*args, target=target, losses=[] if self.last else None)

    def pairs(self) -> int:
        return sum(int(getattr(m, "overlapped_pairs", 0)) for m in self.modules.values())

    def close(self) -> None:
        close = getattr(self.sched, "close", None)
        if close is not None:
            close()


def rank_main(rank: int, world: int, run: MoeRun) -> dict[str, Any]:
    """This process's figures: ``costs[size]``, ``times[contender][size]``, ``grads[contender]``, ``pairs``."""
    from dualpipe_kernels.runtime.groups import pipeline_expert_groups

    if world != run.pp * run.ep:
        raise ValueError(f"moe bench: {world} processes but pp {run.pp} x ep {run.ep} = {run.pp * run.ep}")
    p_rank, e_rank = rank // run.ep, rank % run.ep
    pp_group, g_f, g_b = pipeline_expert_groups(run.pp, run.ep)
    group = ExpertGroup(g_f, g_b, run.ep, native=_a2a_transport(run, g_f))
    contenders: dict[str, _Ours | _Torch] = {
        "ours": _Ours(run, True, group, pp_group, p_rank, e_rank),
        "ours-hook-off": _Ours(run, False, group, pp_group, p_rank, e_rank),
        "torch.ScheduleDualPipeV": _Torch(run, group, pp_group, p_rank, e_rank),
        "dropin.ScheduleDualPipeV": _Torch(run, group, pp_group, p_rank, e_rank, dropin=True),
    }
    out: dict[str, Any] = {
        "costs": [],
        "times": {c: [] for c in contenders},
        "timelines": {c: [] for c, obj in contenders.items() if isinstance(obj, _Ours)},
        "grads": {},
        "pairs": {},
        "p_rank": p_rank,
        "e_rank": e_rank,
    }
    try:
        group.exchange(torch.zeros(run.rows, run.cols), backward=False)  # starts the exchange's threads
        for k, size in enumerate(run.a2a_bytes):
            group.pad_elems = pad_for_bytes(run, size)
            comm_below_compute(run.comm_nice)
            out["costs"].append({"a2a_bytes": group.a2a_bytes(run.rows, run.cols), **chunk_costs(run, group, e_rank)})
            for name, c in contenders.items():
                for j in range(run.warmup):
                    c.step()
                    if k == 0 and j == 0:  # the first step of every contender, from the same weights and data
                        out["grads"][name] = _grads(c.modules)
                out["times"][name].append([])
                if name in out["timelines"]:
                    out["timelines"][name].append([])
            out["comm_threads_lowered"] = comm_below_compute(run.comm_nice)  # the pipelines' threads too
            # Contenders take turns step by step, so a change of the machine's load hits them alike.
            for _ in range(run.steps):
                for name, c in contenders.items():
                    out["times"][name][k].append(_timed(c.step))
                    if isinstance(c, _Ours) and c.last is not None:
                        out["timelines"][name][k].append(c.last)
            _note(
                rank,
                f"a2a {out['costs'][k]['a2a_bytes']} B: "
                + ", ".join(f"{n} {statistics.median(out['times'][n][k]):.3f} s" for n in contenders),
            )
        out["pairs"] = {name: c.pairs() for name, c in contenders.items()}
        dist.barrier()
    finally:
        for c in contenders.values():
            c.close()
        group.close()
    return out


def _a2a_transport(run: MoeRun, expert_group: Any) -> Any:
    """The expert group's NativeTransport for ``run.a2a == "native"`` (collective over the group), else None."""
    if run.a2a == "gloo":
        return None
    if run.a2a != "native":
        raise ValueError(f"moe bench: all_to_all backend must be 'native' or 'gloo', got {run.a2a!r}")
    from dualpipe_kernels.transport.native import NativeTransport

    return NativeTransport(expert_group)
