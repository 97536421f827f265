"""Rank functions of the lifecycle and error tests: two pipelines in one process, memory, bad input, a dead peer."""

from __future__ import annotations

import gc
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from rank_configs import grads_of
from toy_models import (
    ExitStage,
    RunConfig,
    ViewStage,
    build_schedule_for,
    example_criterion,
    make_all_stages,
    make_tensors,
    mse_criterion,
)


# --------------------------------------------------------------------------------------------
# Two pipelines alive in one process
# --------------------------------------------------------------------------------------------
def _sgd(modules: Sequence[nn.Module], lr: float = 0.125) -> None:
    with torch.no_grad():
        for m in modules:
            for p in m.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
                    p.grad = None


@dataclass
class _PipeUnderTest:
    """A pipeline plus what it needs to take a step; ``record`` collects (losses, grads) per step."""

    step: Callable[[], Any]
    modules: list[nn.Module]
    close: Callable[[], None]
    record: list[Any] = field(default_factory=list)


def _make_native_dualpipev(rank: int, world: int, seed: int, timeout_s: float) -> _PipeUnderTest:
    from dualpipe_kernels.runtime import Pipeline

    cfg = RunConfig("dualpipev", world, 2 * world + 1, seed=seed)
    schedule = build_schedule_for(cfg)
    stages = make_all_stages(cfg, schedule)
    local = {s: stages[s] for s in schedule.stages_of_rank(rank)}
    x, label = make_tensors(cfg.model, cfg.rows, seed + 1)
    pipe = Pipeline(schedule, local, transport="torch", timeout_s=timeout_s)

    def step() -> Any:
        res = pipe.step(*x, labels=label, criterion=mse_criterion)
        return {k: v.clone() for k, v in res.losses.items()}

    return _PipeUnderTest(step, list(local.values()), pipe.close)


def _make_compat_example(rank: int, world: int, seed: int, timeout_s: float) -> _PipeUnderTest:
    from dualpipe_kernels import compat

    cfg = RunConfig("dualpipev", world, 2 * world + 2, api="compat", model="example", seed=seed)
    schedule = build_schedule_for(cfg)
    stages = make_all_stages(cfg, schedule)
    modules = [stages[rank], stages[2 * world - 1 - rank]]
    x, label = make_tensors(cfg.model, cfg.rows, seed + 1)
    model = compat.DualPipeV(modules, timeout_s=timeout_s)

    def step() -> Any:
        loss, _ = model.step(
            *(x if rank == 0 else (None,)),
            num_chunks=cfg.microbatches,
            criterion=example_criterion,
            labels=label if rank == 0 else (None,),
        )
        return loss

    return _PipeUnderTest(step, modules, model.close)


def _run_steps(pipes: Sequence[_PipeUnderTest], steps: int) -> None:
    for _ in range(steps):
        for p in pipes:
            loss = p.step()
            p.record.append((loss, [grads_of(m) for m in p.modules]))
            _sgd(p.modules)


def two_pipelines(rank: int, world_size: int, steps: int = 3, timeout_s: float = 30.0) -> dict[str, Any]:
    """Rank function: a native DualPipeV and a compat DualPipeV (WeightGradStore model), alone then interleaved."""
    makers = (_make_native_dualpipev, _make_compat_example)
    alone = []
    for i, make in enumerate(makers):
        p = make(rank, world_size, 10 + i, timeout_s)
        try:
            _run_steps([p], steps)
        finally:
            p.close()
        alone.append(p.record)
    together = [make(rank, world_size, 10 + i, timeout_s) for i, make in enumerate(makers)]
    try:
        _run_steps(together, steps)
    finally:
        for p in together:
            p.close()
    return {"alone": alone, "together": [p.record for p in together]}


# --------------------------------------------------------------------------------------------
# Error handling
# --------------------------------------------------------------------------------------------
#: every wait inside a bad-input case (seconds)
BAD_INPUT_TIMEOUT_S = 3.0
#: the bad-input cases, in run order (their expectations live in tests/process/test_runtime_errors.py)
BAD_INPUT_CASES = (
    "compat_few_microbatches",
    "compat_wrong_module_count",
    "batch_smaller_than_microbatches",
    "wrong_module_count",
    "no_criterion",
    "view_output",
)


def _bad_input_case(rank: int, world_size: int, case: str, group: Any, timeout_s: float) -> None:
    """One kind of bad input on a DualPipeV over ``group``; returns only if nothing raised."""
    from dualpipe_kernels import compat
    from dualpipe_kernels.runtime import Pipeline

    cfg = RunConfig("dualpipev", world_size, 2 * world_size)
    schedule = build_schedule_for(cfg)
    stages = make_all_stages(cfg, schedule)
    x, label = make_tensors("toy", cfg.rows, 1)
    mine = {s: stages[s] for s in schedule.stages_of_rank(rank)}
    two = (stages[rank], stages[2 * world_size - 1 - rank])
    crit: Any = mse_criterion
    if case == "compat_few_microbatches":  # N < 2 * ranks, same mistake on every rank
        model = compat.DualPipeV(two, process_group=group, timeout_s=timeout_s)
        try:
            model.step(*x, num_chunks=2 * world_size - 1, criterion=crit, labels=label)
        finally:
            model.close()
        return
    if case == "compat_wrong_module_count":  # rank 0 passes one module; the others go on to step
        model = compat.DualPipeV(two[:1] if rank == 0 else two, process_group=group, timeout_s=timeout_s)
        try:
            model.step(*x, num_chunks=cfg.microbatches, criterion=crit, labels=label)
        finally:
            model.close()
        return
    if case == "batch_smaller_than_microbatches":  # rank 0 (which feeds) has fewer rows than micro-batches
        x = tuple(t[: cfg.microbatches - 1] for t in x)
        label = tuple(t[: cfg.microbatches - 1] for t in label)
    elif case == "wrong_module_count":  # rank 0 forgets one of its two stages
        if rank == 0:
            mine = dict(list(mine.items())[:1])
    elif case == "no_criterion":  # rank 0 holds the loss stage
        crit = None
    elif case == "view_output":  # stage 2 (rank 1, sends to stage 3 on rank 0) returns a view of its input
        if 2 in mine:
            mine[2] = ViewStage()
    else:
        raise ValueError(f"unknown bad-input case {case!r}")
    pipe = Pipeline(schedule, mine, group=group, timeout_s=timeout_s)
    try:
        pipe.step(*x, labels=label, criterion=crit)
    finally:
        pipe.close()


def bad_inputs(rank: int, world_size: int, cases: Sequence[str], timeout_s: float) -> dict[str, Any]:
    """Rank function: every bad-input case in turn, each on a fresh process group.

    Returns ``{case: {"error": traceback or None, "elapsed_s": seconds}}``; a
    rank that does not raise has ``error`` None.  A fresh group per case keeps
    transfers left in flight by one failed case away from the next.
    """
    out: dict[str, Any] = {}
    for case in cases:
        group = dist.new_group(list(range(world_size)))
        t0 = time.monotonic()
        err: str | None = None
        try:
            _bad_input_case(rank, world_size, case, group, timeout_s)
        except Exception:  # noqa: BLE001 - the point of the test
            err = traceback.format_exc()
        out[case] = {"error": err, "elapsed_s": time.monotonic() - t0}
        dist.barrier()  # on the default group, untouched by the cases
    return out


def kill_mid_step(rank: int, world_size: int, victim: int, exit_on: int, timeout_s: float) -> float:
    """Rank function: DualPipeV where ``victim``'s first stage exits the process on its ``exit_on``-th forward.

    Survivors return nothing: they must raise; the error is checked by the parent.
    """
    from dualpipe_kernels.runtime import Pipeline

    cfg = RunConfig("dualpipev", world_size, 2 * world_size + 2)
    schedule = build_schedule_for(cfg)
    stages = make_all_stages(cfg, schedule)
    if rank == victim:
        stages[victim] = ExitStage(exit_on)
    x, label = make_tensors("toy", cfg.rows, 1)
    pipe = Pipeline(schedule, {s: stages[s] for s in schedule.stages_of_rank(rank)}, timeout_s=timeout_s)
    t0 = time.monotonic()
    try:
        pipe.step(*x, labels=label, criterion=mse_criterion)
    finally:
        pipe.close()
    return time.monotonic() - t0


# --------------------------------------------------------------------------------------------
# Memory across steps
# --------------------------------------------------------------------------------------------
def live_tensors() -> int:
    """Number of gc-tracked torch.Tensor objects (parameters and grads included)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def many_steps(rank: int, world_size: int, schedule_name: str, api: str, steps: int) -> dict[str, Any]:
    """Rank function: ``steps`` training steps (SGD in between); live tensors and RSS after each."""
    from dualpipe_kernels import compat
    from dualpipe_kernels.runtime import Pipeline

    n = 2 * world_size + 2
    cfg = RunConfig(schedule_name, world_size, n, api=api, model="example" if api == "compat" else "toy")
    schedule = build_schedule_for(cfg)
    stages = make_all_stages(cfg, schedule)
    x, label = make_tensors(cfg.model, 4096, 1)  # ~20 KB per activation: leaking them would show in RSS
    if api == "compat":
        mods = [stages[rank], stages[2 * world_size - 1 - rank]]
        model = compat.DualPipeV(mods, timeout_s=30.0)

        def step() -> None:
            model.step(
                *(x if rank == 0 else (None,)),
                num_chunks=n,
                criterion=example_criterion,
                labels=label if rank == 0 else (None,),
            )

        close = model.close
    else:
        mods = [stages[s] for s in schedule.stages_of_rank(rank)]
        pipe = Pipeline(
            schedule, {s: stages[s] for s in schedule.stages_of_rank(rank)}, timeout_s=30.0, allow_uneven=True
        )  # 4096 rows over 2 * world + 2 micro-batches

        def step() -> None:
            pipe.step(*x, labels=label, criterion=mse_criterion)

        close = pipe.close
    pool: list[int] = []  # small-message receive buffers ever allocated, after each step (native API)
    tensors: dict[int, int] = {}  # step -> live tensors after it (every 5th step: a gc scan costs ~0.1 s)
    rss: list[int] = []
    t0 = time.perf_counter()
    try:
        for i in range(1, steps + 1):
            step()
            _sgd(mods, lr=1e-3)
            if i % 5 == 0:
                tensors[i] = live_tensors()
            rss.append(rss_bytes())
            if api != "compat":
                pool.append(pipe.receive_buffers()[0])
    finally:
        close()
    dist.barrier()
    return {"tensors": tensors, "rss": rss, "pool": pool, "seconds": time.perf_counter() - t0}


def lifecycle(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """Rank function: two pipelines in one process, then ``steps`` steps native and compat (memory)."""
    return {
        "two_pipelines": two_pipelines(rank, world_size),
        "memory_native": many_steps(rank, world_size, "dualpipev", "native", steps),
        "memory_compat": many_steps(rank, world_size, "dualpipev", "compat", steps),
    }
