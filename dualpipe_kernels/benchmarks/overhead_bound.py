"""bench overhead's ``bound`` rows: the step a runtime with no cost of its own would take on this machine.

Two inputs are measured in the rank processes of a launch:

* each compute action's torch work by itself (:func:`op_costs_from`): the floor case's own steps (the
  rank's stage modules for its compute actions in order, :func:`floor_work`, in the same rounds as every
  other case) read the clock around every forward (with the criterion on a loss stage) and every
  backward; per stage the mean over its micro-batches of each op's median over the measured rounds;
* the transport's one-way latency for a message of the runtime's size (:func:`one_way_latency`): a
  ping-pong between ranks 0 and 1 through the same transport the runtime uses (the one ``bench transport``
  times), half the median round
  trip, for a message of the inline header plus one 1x8 float32 row (what a repeated boundary message is),
  after the rounds.

The parent simulates each schedule with those costs (``schedules.simulator``: an F&B pair costs its F plus
its B, a W nothing, as in the floor, whose I is the full backward) and that latency on every transfer
(:func:`bound_rows`): the makespan is a lower bound for any runtime driving the same torch work over the
same transport on the same cores, since it pays nothing for itself, not even the warm caches' loss of
running between other code.  Our row's ``ratio_to_bound`` is our step over it (>= 1 up to noise).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "WIDTH",
    "chunk_stack",
    "mse",
    "floor_work",
    "LATENCY_OF",
    "op_costs_from",
    "one_way_latency",
    "measure_latency",
    "bound_rows",
    "add_bound",
]

#: our transport -> the transport whose latency bounds it (``ordered`` is gloo too; native-prev is not bounded)
LATENCY_OF = {"native": "native", "torch": "torch", "ordered": "torch"}
_ROUND_TRIPS = 200


WIDTH = 8  # features of every chunk's Linear and of every micro-batch row


def chunk_stack(k: int) -> Any:
    """A stage of ``k`` chunks: ``k`` Linear(8, 8) in a row."""
    import torch.nn as nn

    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(k)])


def mse(out: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.mse_loss(out, target)


def floor_work(rank: int, cfg: Any, schedule: str) -> Callable[[list[Any]], None]:
    """``run(took)``: torch's own work of this rank in ``schedule`` once, its stage modules (the
    runtime's) for its compute actions in order with no pipeline: an F is the module on a fresh leaf input
    (and the criterion on a loss stage); a B, an I or a pair's B half one ``torch.autograd.backward`` with a
    ones gradient; a W nothing (its work was in the I).  ``took`` gets
    ``((stage, micro-batch, is_forward), seconds)`` per op."""
    import torch

    from dualpipe_kernels.benchmarks.sleep_runs import chunks_per_stage
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.schedules.ir import T_F, T_W

    sched = build_schedule(schedule, cfg.ranks, cfg.microbatches)
    k = chunks_per_stage(sched)
    modules = {s: chunk_stack(k) for s in sched.stages_of_rank(rank)}
    first_in = torch.randn(1, WIDTH)
    row, target, ones = torch.randn(1, WIDTH), torch.zeros(1, WIDTH), torch.ones(1, WIDTH)
    work = [c for a in sched.actions[rank] for c in a.computes() if c.type is not T_W]  # a pair: F half, B half
    clock = time.perf_counter

    def run(took: list[Any]) -> None:
        outs: dict[tuple[int, int], Any] = {}
        for a in work:
            key = (a.stage, a.microbatch)
            t0 = clock()
            if a.type is T_F:
                x = first_in if sched.is_first_stage(*key) else row.detach().requires_grad_(True)
                y = modules[a.stage](x)
                outs[key] = mse(y, target) if sched.is_loss_stage(*key) else y
            else:  # B or I: the full backward (a W's work is in it)
                y = outs.pop(key)
                torch.autograd.backward(y, None if y.dim() == 0 else ones)
            took.append(((*key, a.type is T_F), clock() - t0))

    return run


def op_costs_from(rounds: list[list[Any]]) -> dict[int, tuple[float, float]]:
    """``{stage: (F seconds, B seconds)}`` from runs of :func:`floor_work` (each a ``took`` list): per op
    the median over the runs, per stage the mean over its ops."""
    times: dict[tuple[int, int, bool], list[float]] = {}
    for took in rounds:
        for k, dt in took:
            times.setdefault(k, []).append(dt)
    per_stage: dict[int, tuple[list[float], list[float]]] = {}
    for (s, _mb, forward), ts in times.items():
        per_stage.setdefault(s, ([], []))[0 if forward else 1].append(statistics.median(ts))
    return {s: (statistics.fmean(f), statistics.fmean(b)) for s, (f, b) in per_stage.items()}


def one_way_latency(rank: int, transport: str) -> float | None:
    """Half the median round trip of a runtime-sized message between ranks 0 and 1 over ``transport``
    (``native`` or ``torch``; :func:`~.common.pingpong`), collective over the default group; None on the
    other ranks."""
    import torch

    from dualpipe_kernels.benchmarks.common import pingpong
    from dualpipe_kernels.runtime.boundary.inline import META_BYTES
    from dualpipe_kernels.transport import make_transport

    link = make_transport(transport)
    try:
        if rank > 1:
            return None
        out = torch.zeros(META_BYTES + 4 * WIDTH, dtype=torch.uint8)
        back = torch.empty_like(out)
        peer = 1 - rank

        def send(t: torch.Tensor) -> None:
            link.isend(t, peer, 7, "bound ping-pong").wait()

        def recv(t: torch.Tensor) -> None:
            link.irecv(t, peer, 7, "bound ping-pong").wait()

        trips = pingpong(rank, send, recv, out, back, _ROUND_TRIPS)
        return statistics.median(trips) / 2 if rank == 0 else None
    finally:
        link.close()


def _bounded(cfg: Any) -> list[str]:
    """The transports whose latency bounds ``cfg``'s transports (:data:`LATENCY_OF`), once each, in order."""
    return list(dict.fromkeys(LATENCY_OF[t] for t in cfg.transports if t in LATENCY_OF))


def bound_rows(cfg: Any, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One ``bound`` row per (schedule, transport) of ``cfg`` from the ranks' results: the simulated makespan
    (``step_s``) with the op costs of their floor case of the schedule (``"ops"``) and rank 0's latency."""
    from dualpipe_kernels.benchmarks.overhead_report import _actions

    rows = []
    latency = per_rank[0]["bound"].get("latency", {})
    for name in cfg.schedules:
        floors = [o.get(f"floor/none/{name}", "no floor case") for o in per_rank]
        failed = next((f for f in floors if isinstance(f, str)), None)  # the floor's error is the bound's
        for transport in _bounded(cfg):
            row: dict[str, Any] = {"impl": "bound", "transport": transport, "schedule": name, "ranks": cfg.ranks,
                                   "microbatches": cfg.microbatches}  # fmt: skip
            lat = latency.get(transport, "no latency measured")
            err = failed or (lat if isinstance(lat, str) else None)
            if err is None:
                try:
                    step = _simulated_step(cfg, name, [f["ops"] for f in floors], lat)
                except Exception as e:  # noqa: BLE001 - reported in the row
                    err = f"{type(e).__name__}: {e}".splitlines()[0]
            if err is not None:
                rows.append({**row, "error": err, "step_s": None, "per_action_us": None})
                continue
            actions = _actions(cfg.ranks, cfg.microbatches, name)
            rows.append({**row, "step_s": step, "step_min_s": step, "step_max_s": step, "compute_actions": actions,
                         "per_action_us": step / actions * 1e6, "latency_us": lat * 1e6})  # fmt: skip
    return rows


def _simulated_step(cfg: Any, name: str, ops: list[dict[int, tuple[float, float]]], latency: float) -> float:
    """The simulated makespan of schedule ``name`` with the ranks' op costs ``ops`` and ``latency`` per transfer."""
    from dualpipe_kernels.schedules.costs import CommModel, CostModel
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.schedules.simulator import simulate

    sched = build_schedule(name, cfg.ranks, cfg.microbatches)
    costs: dict[int, tuple[float, float]] = {}
    for o in ops:
        costs.update({int(s): fb for s, fb in o.items()})
    f = [costs[s][0] for s in range(sched.num_stages)]
    b = [costs[s][1] for s in range(sched.num_stages)]
    # a W costs nothing (the floor's I is the whole backward); the model wants 0 < W < B
    model = CostModel(f=f, b=b, w=[x * 1e-9 for x in b])
    return float(simulate(sched, model, CommModel(latency=latency)).makespan)


def measure_latency(rank: int, cfg: Any) -> dict[str, Any]:
    """``{"latency": {transport: seconds or an error}}`` (rank 0's; None on the others) for the transports the
    bound rows need, measured after the rounds; collective."""
    latency: dict[str, Any] = {}
    for t in _bounded(cfg):
        try:
            latency[t] = one_way_latency(rank, t)
        except Exception as e:  # noqa: BLE001 - reported in the row
            latency[t] = f"{type(e).__name__}: {e}".splitlines()[0]
    return {"latency": latency}


def add_bound(rows: list[dict[str, Any]]) -> None:
    """``bound_us`` and ``ratio_to_bound`` (our step / the bound's) on our rows whose transport is bounded."""
    bound = {(r["schedule"], r["transport"]): r for r in rows if r["impl"] == "bound" and r.get("per_action_us")}
    for r in rows:
        b = bound.get((r["schedule"], LATENCY_OF.get(r["transport"], "")))
        if r["impl"] == "ours" and r.get("step_s") and b is not None:
            r["bound_us"] = b["per_action_us"]
            r["ratio_to_bound"] = r["step_s"] / b["step_s"]
