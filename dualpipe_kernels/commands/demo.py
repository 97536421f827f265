"""``dualpipe-kernels demo``: train a small GPT with a pipeline schedule on local processes.

Starts one process per rank (gloo on CPU; with GPUs, one rank per GPU over
NCCL), trains :mod:`dualpipe_kernels.models.gpt` on the synthetic token stream
of :mod:`dualpipe_kernels.demo_data` for a few steps and prints per step: loss,
step time, measured bubble against the simulator's, share of communication
hidden and peak activation memory.  The first step is checked bit-exact (every
micro-batch loss and every parameter gradient, ``torch.equal``) against the same
model run in one process, micro-batch by micro-batch.

The run itself and the definitions of its figures: :mod:`.demo_run`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from dualpipe_kernels.commands.demo_run import DemoConfig, TrainingDiverged, run_demo

__all__ = ["add_parser", "run", "DemoConfig", "TrainingDiverged", "run_demo"]

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
