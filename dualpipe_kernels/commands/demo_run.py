"""The demo's training run: rank processes, the first step checked against one process, the figures.

:func:`run_demo` starts one process per rank (gloo on CPU; with GPUs, one rank per GPU, CUDA IPC or host
staging moving the tensors), trains :mod:`dualpipe_kernels.models.gpt` on the synthetic token stream of
:mod:`dualpipe_kernels.demo_data` and returns the figures ``dualpipe-kernels demo`` prints
(:mod:`.demo`).  The first step is checked bit-exact (every micro-batch loss and every parameter gradient,
``torch.equal``) against the same model run in one process, micro-batch by micro-batch.

Definitions (all times in seconds):

* step time: the slowest rank's ``Pipeline.step`` wall time (ranks start each step
  together after a barrier).
* measured bubble: max over ranks of (step time - the rank's busy compute time),
  busy time summed from the runtime's timeline (F, B, I, W, F&B actions).
* simulated bubble: ``schedules.simulator`` fed the per-stage F, B, W and F&B
  costs measured on the first step, with free communication.
* overlap (``runtime.timeline`` / ``benchmarks.metrics``), measured in the same
  processes and pipeline: T_step is a training step; T_compute the median of
  ``--probe-steps`` extra steps of the same pipeline with every transfer cut to
  a few bytes (compute and bookkeeping unchanged; no optimizer step); T_comm
  the bytes the last training step moved to its busiest rank, timed on the
  link measured between ranks 0 and 1.  ``exposed_comm_s = T_step - T_compute``,
  ``hidden_comm_share = 1 - exposed_comm_s / T_comm`` (None, flagged as noise,
  when the raw value leaves [0, 1]); beside it the simulator's exposed
  communication with that link (``simulated_exposed_comm_s``).
* peak activation memory: most bytes of tensors saved for backward alive at once
  on a rank (parameters excluded), max over ranks.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["DemoConfig", "TrainingDiverged", "run_demo"]


# ---------------------------------------------------------------- configuration
@dataclass(frozen=True)
class DemoConfig:
    """Checked demo settings (see ``demo.add_parser`` for each option's meaning)."""

    schedule: str
    ranks: int
    microbatches: int
    steps: int
    probe_steps: int
    transport: str
    boundary_format: str
    seed: int
    batch_size: int
    lr: float
    device: str
    model: Any  # GPTConfig

    def activation_bytes(self) -> int:
        """Bytes of one boundary activation (float32 ``[batch, seq, d_model]``)."""
        return self.batch_size * self.model.seq_len * self.model.d_model * 4


def _simulate(schedule: Any, costs: Any, comm: Any = None) -> Any:
    from dualpipe_kernels.schedules.simulator import simulate

    return simulate(schedule, costs.cost_model(), comm)


# ---------------------------------------------------------------- rank process
def _progress(text: str) -> None:
    sys.stderr.write(f"demo: {text}\n")
    sys.stderr.flush()


def _rank_main(rank: int, world: int, cfg: DemoConfig) -> dict[str, Any]:
    """Train on this rank; return its per-step losses, times, busy times, timelines, first-step grads and the
    overlap probe (T_compute steps, the last step's received bytes, the link to rank 0/1)."""
    import torch
    import torch.distributed as dist

    from dualpipe_kernels.benchmarks.common import ActivationMeter
    from dualpipe_kernels.benchmarks.payload import PayloadSwitch, link_timing
    from dualpipe_kernels.demo_data import SyntheticTokens
    from dualpipe_kernels.models.gpt import gpt_loss, stage_modules_for
    from dualpipe_kernels.runtime import Pipeline
    from dualpipe_kernels.runtime.timeline import busy_time
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.transport import make_transport

    if cfg.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    sched = build_schedule(cfg.schedule, world, cfg.microbatches)
    gcfg = cfg.model
    modules = {s: m.to(dev) for s, m in stage_modules_for(sched, gcfg, cfg.seed, rank).items()}
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    data = SyntheticTokens(gcfg.vocab_size, gcfg.seq_len, cfg.seed)
    meter = ActivationMeter(params)
    out: dict[str, Any] = {"losses": [], "times": [], "busy": [], "timelines": [], "peak_act": [], "grads": {}}
    switch = PayloadSwitch(make_transport(cfg.transport, None, dev))
    pipe = Pipeline(sched, modules, transport=switch, record_timeline=True, boundary_format=cfg.boundary_format)
    out["transport_used"] = pipe.transport_name  # what "auto" became on this rank

    def timed_step(ids: Any, tgt: Any) -> tuple[Any, float]:
        dist.barrier()
        t0 = time.perf_counter()
        res = pipe.step(ids.to(dev), labels=(tgt.to(dev),), criterion=gpt_loss)
        return res, time.perf_counter() - t0

    try:
        for step in range(cfg.steps):
            ids, tgt = data.batch(step, cfg.microbatches * cfg.batch_size)
            meter.reset()
            switch.received_bytes.clear()
            with meter.track():
                res, wall = timed_step(ids, tgt)
            out["received_bytes"] = list(switch.received_bytes)  # the last step's, in the end
            out["losses"].append({int(m): v.detach().cpu() for m, v in res.losses.items()})
            out["times"].append(wall)
            out["busy"].append(busy_time(res.timeline))
            out["timelines"].append([(int(r), str(a), float(t0), float(t1)) for r, a, t0, t1 in res.timeline])
            out["peak_act"].append(int(meter.peak))
            if step == 0:
                out["grads"] = {
                    s: {
                        n: (p.grad.detach().cpu().clone() if p.grad is not None else None)
                        for n, p in m.named_parameters()
                    }
                    for s, m in modules.items()
                }
            opt.step()
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                _progress(f"step {step + 1}/{cfg.steps} done ({wall:.3f} s on rank 0)")
        # T_compute: the same pipeline and batch with every transfer cut to a few bytes; gradients discarded.
        switch.tiny = True
        out["probe_times"] = [timed_step(ids, tgt)[1] for _ in range(cfg.probe_steps)]
        switch.tiny = False
        opt.zero_grad(set_to_none=True)
        link = link_timing(switch.inner, rank, world, cfg.activation_bytes(), device=dev)
        out["link"] = asdict(link) if link is not None else None
    finally:
        pipe.close()
        switch.close()
    return out


# ---------------------------------------------------------------- reference
def _reference_losses(modules: dict[int, Any], schedule: Any, ids: Any, tgt: Any) -> dict[int, Any]:
    """Single-process run of every micro-batch in order: forward through its stages, loss, backward."""
    from dualpipe_kernels.models.gpt import gpt_loss
    from dualpipe_kernels.runtime.reference import run_reference

    # Seeded with 1/N as the demo's Pipeline (scale_grads=True, its default): same gradients bit for bit.
    return run_reference(modules, schedule, (ids,), (tgt,), gpt_loss, scale_grads=True)


def _check_first_step(cfg: DemoConfig, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Compare the pipeline's first-step losses and gradients with one process, bit for bit."""
    import torch

    from dualpipe_kernels.demo_data import SyntheticTokens
    from dualpipe_kernels.models.gpt import stage_modules_for
    from dualpipe_kernels.schedules.generators import build_schedule

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks ran with one thread each: same kernels, same summation order
    try:
        sched = build_schedule(cfg.schedule, cfg.ranks, cfg.microbatches)
        gcfg = cfg.model
        dev = torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")
        mods = {s: m.to(dev) for s, m in stage_modules_for(sched, gcfg, cfg.seed).items()}
        ids, tgt = SyntheticTokens(gcfg.vocab_size, gcfg.seq_len, cfg.seed).batch(0, cfg.microbatches * cfg.batch_size)
        ref = {m: v.detach().cpu() for m, v in _reference_losses(mods, sched, ids.to(dev), tgt.to(dev)).items()}
    finally:
        torch.set_num_threads(threads)
    got: dict[int, Any] = {}
    for o in per_rank:
        got.update(o["losses"][0])
    loss_ok = sorted(got) == sorted(ref) and all(torch.equal(got[m], ref[m]) for m in ref)
    # DualPipe keeps two copies of a model stage and sums their gradients across mirror ranks.
    copies: dict[int, list[int]] = {}
    for s, ms in enumerate(sched.model_stage):
        copies.setdefault(ms, []).append(s)
    ref_grads: dict[int, dict[str, Any]] = {}
    for s, m in mods.items():
        ref_grads[s] = {}
        for name, _p in m.named_parameters():
            g = None
            for c in copies[sched.model_stage[s]]:
                gc = dict(mods[c].named_parameters())[name].grad
                if gc is not None:
                    g = gc.detach().cpu() if g is None else g + gc.detach().cpu()
            ref_grads[s][name] = g
    grads_ok, max_diff, compared = True, 0.0, 0
    for o in per_rank:
        for s, named in o["grads"].items():
            for name, g in named.items():
                r = ref_grads[s][name]
                compared += 1
                if g is None or r is None:
                    grads_ok &= g is None and r is None
                    continue
                if not torch.equal(g, r):
                    grads_ok = False
                    max_diff = max(max_diff, float((g.double() - r.double()).abs().max()))
    return {
        "bit_exact_first_step": bool(loss_ok and grads_ok),
        "first_step_losses_equal": bool(loss_ok),
        "first_step_grads_equal": bool(grads_ok),
        "first_step_grad_tensors": compared,
        "first_step_max_abs_grad_diff": max_diff,
    }


# ---------------------------------------------------------------- driver
def _overlap(cfg: DemoConfig, sched: Any, per_rank: list[dict[str, Any]], times: list[float], costs: Any) -> dict:
    """Per-step overlap metric (T_compute and T_comm shared by the steps) and the simulator's exposed comm."""
    from dualpipe_kernels.benchmarks.metrics import overlap_metric
    from dualpipe_kernels.benchmarks.payload import LinkTiming
    from dualpipe_kernels.benchmarks.sleep_runs import comm_alone_s, slowest_step_median
    from dualpipe_kernels.schedules.costs import CommModel

    t_compute = slowest_step_median([o["probe_times"] for o in per_rank])
    link_d = next((o["link"] for o in per_rank if o.get("link")), None)
    link = LinkTiming(**link_d) if link_d is not None else None
    # One rank moves nothing between processes: T_comm 0, every share null.
    t_comm = comm_alone_s([o["received_bytes"] for o in per_rank], link) if link is not None else 0.0
    metrics = [overlap_metric(t, t_compute, t_comm) for t in times]
    out: dict[str, Any] = {
        "t_compute_s": t_compute,
        "t_comm_s": t_comm,
        "link": link_d,
        "exposed_comm_s": [m.exposed_comm_s for m in metrics],
        "hidden_comm_share": [m.hidden_comm_share for m in metrics],
        "hidden_comm_share_raw": [m.hidden_comm_share_raw for m in metrics],
        "hidden_comm_noise": [m.hidden_comm_noise for m in metrics],
    }
    if link is None:
        return out
    comm = CommModel(latency=link.latency_s, bandwidth=link.bandwidth_bps, activation_bytes=cfg.activation_bytes())
    free = float(_simulate(sched, costs).makespan)
    out["simulated_with_comm_s"] = float(_simulate(sched, costs, comm).makespan)
    out["simulated_exposed_comm_s"] = out["simulated_with_comm_s"] - free
    return out


class TrainingDiverged(RuntimeError):
    """A step's loss is not a finite number (NaN or inf): the demo's training diverged."""


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run the demo described by ``cfg`` (see ``_config``); return the JSON-ready result."""
    from dualpipe_kernels.runtime.launch import spawn
    from dualpipe_kernels.runtime.timeline import measured_stage_costs
    from dualpipe_kernels.schedules.generators import build_schedule

    t_start = time.perf_counter()
    # gloo also on CUDA: the transport moves the tensors (CUDA IPC, or host staging), gloo only coordinates.
    backend = "gloo"
    _progress(
        f"starting {cfg.ranks} rank processes ({backend}, {cfg.device}), {cfg.schedule}, "
        f"{cfg.microbatches} micro-batches, {cfg.steps} steps, transport {cfg.transport}"
    )
    per_rank = spawn(_rank_main, cfg.ranks, cfg, backend=backend, timeout_s=600, pg_timeout_s=300)
    _progress("checking the first step against one process")
    check = _check_first_step(cfg, per_rank)
    sched = build_schedule(cfg.schedule, cfg.ranks, cfg.microbatches)
    losses, times, bub_meas, bub_sim_steps, sim_steps, costs = [], [], [], [], [], []
    for k in range(cfg.steps):
        mb_losses: dict[int, Any] = {}
        for o in per_rank:
            mb_losses.update(o["losses"][k])
        losses.append(float(sum(float(mb_losses[m]) for m in sorted(mb_losses)) / max(1, len(mb_losses))))
        if not math.isfinite(losses[-1]):
            raise TrainingDiverged(
                f"the loss became {losses[-1]} at step {k + 1} of {cfg.steps} (learning rate {cfg.lr:g}): "
                "training diverged; try a smaller --lr"
            )
        t = max(o["times"][k] for o in per_rank)
        times.append(t)
        bub_meas.append(max(t - o["busy"][k] for o in per_rank))
        costs.append(measured_stage_costs([e for o in per_rank for e in o["timelines"][k]], sched.num_stages))
        sim = _simulate(sched, costs[-1])
        sim_steps.append(float(sim.makespan))
        bub_sim_steps.append(float(sim.bubble))
    return {
        "ranks": cfg.ranks,
        "schedule": cfg.schedule,
        "steps": cfg.steps,
        "microbatches": cfg.microbatches,
        "stages": sched.num_stages,
        # The transport the ranks actually used ("auto" resolved); what was asked for beside it.
        "transport": "/".join(sorted({str(o["transport_used"]) for o in per_rank})),
        "transport_requested": cfg.transport,
        "boundary_format": cfg.boundary_format,
        "device": cfg.device,
        "losses": losses,
        "step_times_s": times,
        **check,
        "bubble_measured": bub_meas,
        "bubble_simulated": float(_simulate(sched, costs[0]).bubble),
        "bubble_simulated_per_step": bub_sim_steps,
        "simulated_step_s": sim_steps,
        **_overlap(cfg, sched, per_rank, times, costs[0]),
        "activation_bytes": cfg.activation_bytes(),
        "peak_activation_bytes": [max(o["peak_act"][k] for o in per_rank) for k in range(cfg.steps)],
        "measured_stage_costs_s": costs[0].as_dict(),
        "model": asdict(cfg.model),
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "wall_s": time.perf_counter() - t_start,
    }
