#!/usr/bin/env python
"""Train a small GPT with DualPipeV: the loop a training framework would write.

Two ways to start it:

    python python/train_gpt_dualpipev.py --ranks 2 --steps 20
        starts 2 local processes itself (CPU by default when no GPU is visible; --device cuda puts the
        ranks on the GPUs round-robin, so two ranks may share one GPU and talk over CUDA IPC)
    torchrun --nproc-per-node 2 python/train_gpt_dualpipev.py --steps 20
        torchrun starts the processes; RANK / WORLD_SIZE / LOCAL_RANK come from the environment
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank K --master-addr HOST --master-port P \
        python/train_gpt_dualpipev.py --dp 2 --steps 20
        PP x DP on two nodes (run once per node, K = 0 and 1): 4 processes = 2 pipeline ranks x 2 replicas

With R pipeline ranks the model is cut into 2R stages; rank r holds stages r
and 2R-1-r (the V shape), so the first and the last stage (and the loss) live
on pipeline rank 0.  With --dp D there are D replicas of the pipeline (world
size R x D, global rank = pipeline rank x D + replica): the replicas of one
pipeline rank are neighbours, so on nodes of D processes the gradient
all-reduce (the heavy traffic) stays inside a node and the pipeline's
activations cross nodes (through torch.distributed; same-host peers use the
native engine).  Each step: every replica takes its shard of the global batch
and splits it into micro-batches, runs the DualPipeV schedule (each stage's
gradients are summed over the replicas as soon as its last backward is done),
and steps the optimizer.  Everything is deterministic from --seed.
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
    p.add_argument(
        "--ranks", type=int, default=2, help="pipeline ranks to start (x --dp processes) when not launched by torchrun"
    )
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline (world = PP x DP)")
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
    p.add_argument("--dump-grads", default=None, help="directory: each rank saves its gradients after step 1 there")
    args = p.parse_args(argv)
    if args.dp < 1:
        p.error(f"--dp must be >= 1, got {args.dp}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU; none is visible")
    return args


def pp_dp_groups(world: int, dp: int, device: str) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's pipeline and data-parallel groups (``(None, None)`` without DP: the whole world is one pipeline).

    Global rank = pipeline rank x dp + replica.  Every rank creates every group
    (``new_group`` is collective) in the same order.  The pipeline groups are
    gloo: the runtime's tagged, early receives need a backend that matches by
    tag (NCCL does not; CUDA activations are host-staged to cross nodes, CUDA
    IPC serves same-host peers).  The DP groups use the default backend
    (NCCL on GPUs).
    """
    if dp == 1:
        return None, None
    if world % dp:
        raise SystemExit(f"world size {world} is not divisible by --dp {dp}")
    pp, rank = world // dp, dist.get_rank()
    pp_group = dp_group = None
    for d in range(dp):
        g = dist.new_group([p * dp + d for p in range(pp)], backend="gloo")
        pp_group = g if rank % dp == d else pp_group
    for p in range(pp):
        g = dist.new_group([p * dp + d for d in range(dp)], backend="nccl" if device == "cuda" else "gloo")
        dp_group = g if rank // dp == p else dp_group
    return pp_group, dp_group


def dump_grads(path: str, rank: int, pipe: Pipeline, args: argparse.Namespace) -> None:
    """Save this rank's stage gradients (and which transport serves which pipeline peer) for a test to check."""
    os.makedirs(path, exist_ok=True)
    transport = pipe._transport
    local = list(getattr(transport, "local_peers", ()))
    torch.save(
        {
            "rank": rank,
            "pp_rank": pipe.rank,
            "dp_rank": dist.get_rank(pipe.dp_group) if pipe.dp_group is not None else 0,
            "grads": {s: [p.grad.cpu() for p in m.parameters()] for s, m in pipe.stage_modules.items()},
            "transport": type(transport).__name__,
            "native_peers": local,
            "host_id": os.environ.get("GROUP_RANK"),
            "args": vars(args),
        },
        os.path.join(path, f"rank{rank}.pt"),
    )


def train(rank: int, world: int, args: argparse.Namespace) -> list[float]:
    """Run the training loop on this rank (process group already initialised); return the per-step losses."""
    # The transport moves the activations (CUDA IPC between GPU ranks on one host); gloo only coordinates.
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    pp_group, dp_group = pp_dp_groups(world, args.dp, args.device)
    pp = world // args.dp
    pp_rank, dp_rank = rank // args.dp, rank % args.dp
    n = args.microbatches or 4 * pp
    schedule = build_schedule("dualpipev", pp, n)
    cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers or max(4, 2 * pp))
    # This rank's two stage modules {stage index: module}, identical on every run for a given seed.
    modules = {s: m.to(device) for s, m in stage_modules_for(schedule, cfg, args.seed, pp_rank).items()}
    pipe = Pipeline(schedule, modules, group=pp_group, dp_group=dp_group, transport=args.transport)
    opt = torch.optim.AdamW([p for m in modules.values() for p in m.parameters()], lr=args.lr, weight_decay=0.0)
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, args.seed)
    history: list[float] = []
    try:
        for step in range(args.steps):
            # The global batch; this replica's shard of it goes in, and the pipeline splits that into micro-batches.
            ids, targets = data.batch(step, args.dp * n * args.batch_size)
            rows = slice(dp_rank * n * args.batch_size, (dp_rank + 1) * n * args.batch_size)
            t0 = time.perf_counter()
            # reduce_loss: the step's mean loss on every rank of the pipeline (the loss stage lives on one).
            res = pipe.step(
                ids[rows].to(device), labels=(targets[rows].to(device),), criterion=gpt_loss, reduce_loss=True
            )
            if step == 0 and args.dump_grads:
                dump_grads(args.dump_grads, rank, pipe, args)
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
        dist.init_process_group("cpu:gloo,cuda:nccl" if args.device == "cuda" and args.dp > 1 else "gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return 0
    from dualpipe_kernels.runtime import spawn

    losses = spawn(train, args.ranks * args.dp, args, backend="gloo", timeout_s=3600)
    print(f"final loss {losses[0][-1]:.4f} after {args.steps} steps (first {losses[0][0]:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
