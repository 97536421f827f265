#!/usr/bin/env python
"""Train a small GPT with DualPipeV: the loop a training framework would write.

Two ways to start it:

    python python/train_gpt_dualpipev.py --ranks 2 --steps 20
        starts 2 local processes itself (CPU by default when no GPU is visible; --device cuda puts the
        ranks on the GPUs round-robin, so two ranks may share one GPU and talk over CUDA IPC)
    torchrun --nproc-per-node 2 python/train_gpt_dualpipev.py --steps 20
        torchrun starts the processes; RANK / WORLD_SIZE / LOCAL_RANK come from the environment

With R ranks the model is cut into 2R stages; rank r holds stages r and 2R-1-r
(the V shape), so the first and the last stage (and the loss) live on rank 0.
Each step: split the batch into micro-batches, run the DualPipeV schedule,
step the optimizer.  Everything is deterministic from --seed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

try:
    import dualpipe_kernels  # noqa: F401
except ImportError:  # run from a checkout without installing: use the repository next to this file
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from dualpipe_kernels.demo_data import SyntheticTokens
from dualpipe_kernels.models import GPTConfig, gpt_loss, stage_modules_for
from dualpipe_kernels.runtime import Pipeline
from dualpipe_kernels.schedules import build_schedule


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="processes to start when not launched by torchrun")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=None, help="default 4 x ranks (DualPipeV needs >= 2 x ranks)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default 2 x ranks, at least 4)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transport", choices=("auto", "torch", "native"), default="auto")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when a GPU is visible")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU; none is visible")
    return args


def train(rank: int, world: int, args: argparse.Namespace) -> list[float]:
    """Run the training loop on this rank (process group already initialised); return the per-step losses."""
    # The transport moves the activations (CUDA IPC between GPU ranks on one host); gloo only coordinates.
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    n = args.microbatches or 4 * world
    schedule = build_schedule("dualpipev", world, n)
    cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers or max(4, 2 * world))
    # This rank's two stage modules {stage index: module}, identical on every run for a given seed.
    modules = {s: m.to(device) for s, m in stage_modules_for(schedule, cfg, args.seed, rank).items()}
    pipe = Pipeline(schedule, modules, transport=args.transport)
    opt = torch.optim.AdamW([p for m in modules.values() for p in m.parameters()], lr=args.lr, weight_decay=0.0)
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, args.seed)
    history: list[float] = []
    try:
        for step in range(args.steps):
            ids, targets = data.batch(step, n * args.batch_size)  # the full batch; the pipeline splits it
            t0 = time.perf_counter()
            # reduce_loss: the step's mean loss on every rank (the loss stage lives on rank 0 only).
            res = pipe.step(ids.to(device), labels=(targets.to(device),), criterion=gpt_loss, reduce_loss=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss = float(res.loss)
            history.append(loss)
            if rank == 0:
                print(f"step {step + 1:3d}  loss {loss:.4f}  {time.perf_counter() - t0:.3f} s", flush=True)
    finally:
        pipe.close()
    return history


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return 0
    from dualpipe_kernels.runtime import spawn

    losses = spawn(train, args.ranks, args, backend="gloo", timeout_s=3600)
    print(f"final loss {losses[0][-1]:.4f} after {args.steps} steps (first {losses[0][0]:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
