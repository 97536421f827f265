"""``dualpipe-kernels demo``: train a small GPT with a pipeline schedule on local processes.

Starts one process per rank (gloo on CPU; with GPUs, one rank per GPU over
NCCL), trains :mod:`dualpipe_kernels.models.gpt` on the synthetic token stream
of :mod:`dualpipe_kernels.demo_data` for a few steps and prints per step: loss,
step time, measured bubble against the simulator's, share of communication
hidden and peak activation memory.  The first step is checked bit-exact (every
micro-batch loss and every parameter gradient, ``torch.equal``) against the same
model run in one process, micro-batch by micro-batch.

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

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["add_parser", "run", "DemoConfig", "run_demo"]

_SCHEDULES = ("dualpipev", "dualpipe", "1f1b", "gpipe", "interleaved1f1b", "zb1p", "zbv")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="train a small GPT on local processes with DualPipeV (or another schedule)",
        description="Train a small GPT on local processes (CPU/gloo, or one GPU per rank over NCCL); check the "
        "first step bit-exact against one process; print loss, step time, bubble (measured vs simulated), "
        "communication hidden and peak activation memory per step.",
    )
    p.add_argument("--ranks", type=int, default=None, help="pipeline ranks (default 2 on CPU, one per GPU)")
    p.add_argument("--schedule", choices=_SCHEDULES, default="dualpipev")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default 4 x ranks)")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--transport", choices=("auto", "torch", "native"), default="auto")
    p.add_argument(
        "--boundary-format",
        default="none",
        help="how stage-boundary messages travel: none (default), packed (lossless, one message), bf16, fp8; "
        "or 'activations,gradients' (e.g. fp8,bf16). Lossy formats skip the bit-exact verdict in the exit status",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch (default 4)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default max(4, model stages))")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument(
        "--probe-steps", type=int, default=2, help="steps with transfers cut to a few bytes, for T_compute (default 2)"
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA when a GPU is visible, else CPU processes; on CUDA ranks share the GPUs round-robin",
    )
    p.add_argument(
        "--compare", choices=_SCHEDULES, default=None, help="also run this schedule on the same model and data"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (progress stays on stderr)")
    p.set_defaults(func=run)


# ---------------------------------------------------------------- configuration
@dataclass(frozen=True)
class DemoConfig:
    """Checked demo settings (see ``add_parser`` for each option's meaning)."""

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


def _config(args: argparse.Namespace) -> DemoConfig:
    """Checked settings; ValueError (one line, exit 2) for impossible options."""
    import torch

    from dualpipe_kernels.models.gpt import GPTConfig
    from dualpipe_kernels.runtime.boundary.codec import boundary_format
    from dualpipe_kernels.schedules.generators import build_schedule

    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if args.device == "cuda" and not cuda:
        raise ValueError("--device cuda needs a CUDA GPU; none is visible")
    use_cuda = args.device == "cuda" or (args.device == "auto" and cuda)
    # On CUDA several ranks may share one GPU (rank r uses GPU r % count): two processes on one GPU still
    # exercise the CUDA IPC transport.
    ranks = args.ranks if args.ranks is not None else (max(2, torch.cuda.device_count()) if use_cuda else 2)
    if ranks < 1:
        raise ValueError(f"--ranks must be >= 1, got {ranks}")
    if ranks > 64:
        raise ValueError(f"--ranks must be <= 64 for local processes, got {ranks}")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.probe_steps < 1:
        raise ValueError(f"--probe-steps must be >= 1, got {args.probe_steps}")
    for name in ("batch_size", "seq_len", "d_model"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be a finite number > 0, got {args.lr}")
    n = args.microbatches if args.microbatches is not None else 4 * ranks
    sched = build_schedule(args.schedule, ranks, n)  # ValueError naming the schedule's constraint
    n_model = len(set(sched.model_stage))
    layers = args.layers if args.layers is not None else max(4, n_model)
    if layers < n_model:
        raise ValueError(f"--layers {layers} is fewer than the {n_model} model stages of {args.schedule}")
    heads = 4 if args.d_model % 4 == 0 else 1
    model = GPTConfig(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_heads=heads, n_layers=layers)
    return DemoConfig(
        schedule=args.schedule,
        ranks=ranks,
        microbatches=n,
        steps=args.steps,
        probe_steps=args.probe_steps,
        transport=args.transport,
        boundary_format=str(boundary_format(args.boundary_format)),  # ValueError names the bad format
        seed=args.seed,
        batch_size=args.batch_size,
        lr=args.lr,
        device="cuda" if use_cuda else "cpu",
        model=model,
    )


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


def _share_cell(share: float | None, raw: float | None) -> str:
    """The "comm hidden" cell: the share, ``noise*`` when the raw value left [0, 1], ``-`` when nothing moved."""
    if share is not None:
        return f"{share:.2f}"
    return "-" if raw is None else "noise*"


def _print_table(res: dict[str, Any]) -> None:
    """The demo's result for a reader: every figure with its unit and what it is measured against."""
    print(
        f"dualpipe-kernels demo: {res['schedule']}, {res['ranks']} ranks ({res['device']}), {res['stages']} "
        f"stages, {res['microbatches']} micro-batches x {res['batch_size']} sequences x "
        f"{res['model']['seq_len']} tokens, transport {res['transport']}, boundary format {res['boundary_format']}"
    )
    print(f"{'':27}{' bubble: idle time (ms) ':-^36}")
    print(
        f"{'step':<5} {'loss':>7} {'step (ms)':>11}  {'measured':>10} {'simulator':>10} {'measured/sim':>14}"
        f"  {'comm hidden':>11}  {'peak saved activations':>22}"
    )
    bs = res["bubble_simulated"] * 1e3
    for k in range(res["steps"]):
        bm = res["bubble_measured"][k] * 1e3
        ratio = f"{bm / bs:.2f}x" if bs > 0 else "-"
        hid = _share_cell(res["hidden_comm_share"][k], res["hidden_comm_share_raw"][k])
        print(
            f"{k + 1:<5} {res['losses'][k]:>7.4f} {res['step_times_s'][k] * 1e3:>11.1f}  {bm:>10.2f} {bs:>10.2f} "
            f"{ratio:>14}  {hid:>11}  {res['peak_activation_bytes'][k] / 2**20:>18.2f} MiB"
        )
    verdict = (
        "yes"
        if res["bit_exact_first_step"]
        else (
            f"NO (losses equal: {res['first_step_losses_equal']}, "
            f"largest gradient difference {res['first_step_max_abs_grad_diff']:.3g})"
        )
    )
    print(f"first step bit-exact against the same model in one process (every loss and gradient): {verdict}")
    print(
        "bubble: the longest time a rank sat idle in the step; the simulator's is predicted from the per-stage "
        "compute times measured on step 1 (measured/sim 1.10x = 10% more idle time than predicted)."
    )
    t_comm = res["t_comm_s"]
    shares = [s for s in res["hidden_comm_share"] if s is not None]
    raws = [r for r, s in zip(res["hidden_comm_share_raw"], res["hidden_comm_share"], strict=True) if s is None]
    print(
        "comm hidden: the share of the step's transfers that ran behind compute, 1 - (step - T_compute) / T_comm, "
        f"with T_compute = {res['t_compute_s'] * 1e3:.1f} ms (the same step with every transfer cut to a few bytes) "
        f"and T_comm = {'-' if t_comm is None else f'{t_comm * 1e3:.2f} ms'} (the step's transfers alone)."
    )
    if any(r is not None for r in raws):
        print(
            f"* noise: the transfers ({t_comm * 1e3:.2f} ms) are smaller than the step time's run-to-run spread, so "
            "their hidden share cannot be told apart here; `dualpipe-kernels bench overlap` measures it with larger "
            "messages."
        )
    elif not shares:
        print("comm hidden is '-': nothing moved between processes.")
    sim_exp = res.get("simulated_exposed_comm_s")
    if sim_exp is not None:
        print(f"the simulator, given the measured link, predicts {sim_exp * 1e3:.2f} ms of exposed communication.")
    print(f"total run time {res['wall_s']:.1f} s.")


def run(args: argparse.Namespace) -> int:
    from dualpipe_kernels.runtime.launch import RanksFailed

    cfg = _config(args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        if getattr(args, "compare", None):
            from dualpipe_kernels.commands.demo_compare import run_compare

            return run_compare(cfg, args.compare, args.json)
        res = run_demo(cfg)
    except (RanksFailed, TrainingDiverged) as e:
        sys.stderr.write(f"dualpipe-kernels demo: failed: {e}\n")
        return 1
    if args.json:
        print(json.dumps(res))
    else:
        _print_table(res)
    # bf16/fp8 boundaries change the numbers by design: only the lossless formats must match one process
    lossless = all(f in ("none", "packed") for f in cfg.boundary_format.split(","))
    return 0 if res["bit_exact_first_step"] or not lossless else 1
