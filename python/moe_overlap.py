#!/usr/bin/env python
"""A MoE-style stage with a custom ``overlapped_forward_backward``, run under DualPipeV.

Layout: ``pp x ep`` processes (default 2 x 2 = 4).  Process ``g`` is pipeline
rank ``p = g // ep`` and expert rank ``e = g % ep``.  Each pipeline group
(same ``e``) runs its own DualPipeV replica on its own data; each expert group
(same ``p``) holds the same stages and shares their experts: a stage's tokens
are dispatched to every expert rank with an all_to_all, each rank runs its own
experts on the tokens routed to them, and a second all_to_all combines the
results.

DualPipeV pairs the forward of one chunk with the backward of the other
(``(0F3;3B1)OVERLAP_F_B``).  When both stage modules of a rank share a class
that defines ``overlapped_forward_backward(module0, inputs0, criterion0,
labels0, module1, loss1, outputs1, output_grads1) -> (outputs0, loss0)``, the
runtime calls it for every pair.  Here it runs chunk 1's backward on a helper
thread while this thread runs chunk 0's forward, so the all_to_alls of one
chunk overlap the other chunk's compute.  Forward all_to_alls use one expert
group and backward ones another, so the two threads never interleave
collectives on one group; every expert rank runs the same schedule, so each
group sees its collectives in the same order everywhere.  Inside the forward,
the dispatch is also issued asynchronously and overlaps the shared expert.

The program then runs the same step without the hook (a subclass that does
not define it) from the same weights and checks that losses and every
gradient are bit-identical (``torch.equal``).

    python python/moe_overlap.py --steps 2            # 4 local CPU processes (gloo)
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Any

try:
    import dualpipe_kernels  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from dualpipe_kernels.runtime import Pipeline, pipeline_expert_groups, run_backward
from dualpipe_kernels.schedules import build_schedule


class _AllToAll(torch.autograd.Function):
    """all_to_all of equal splits along dim 0; forward on ``group_f``, its backward (the same exchange) on ``group_b``.

    ``received`` (optional): a one-element list holding the forward result the caller already exchanged
    asynchronously (a list, not a tensor argument, so autograd does not treat it as an input); the
    function then only wires the gradient.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group_f: Any, group_b: Any, received: list[torch.Tensor] | None
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.group_b = group_b
        if received is not None:
            return received[0]
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group_f)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        out = torch.empty_like(g)
        dist.all_to_all_single(out, g.contiguous(), group=ctx.group_b)
        return out, None, None, None


class MoEStage(nn.Module):
    """``x [B, T, D] -> x + shared(h) + moe(h)`` with ``h = norm(x)``; top-1 routing over ``ep * local_experts``."""

    def __init__(self, d: int, local_experts: int, ep_rank: int, ep_size: int, groups: tuple[Any, Any], seed: int):
        super().__init__()
        self.d, self.local_experts, self.ep_rank, self.ep_size = d, local_experts, ep_rank, ep_size
        self.group_f, self.group_b = groups
        gen = torch.Generator().manual_seed(seed)
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, ep_size * local_experts, bias=False)
        self.shared = nn.Linear(d, d)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(local_experts)
        )
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" not in name:
                    p.normal_(0.0, 0.05, generator=gen)
            # Expert weights differ per expert rank (each rank owns different experts).
            egen = torch.Generator().manual_seed(seed * 101 + ep_rank + 1)
            for p in self.experts.parameters():
                p.normal_(0.0, 0.05, generator=egen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm(x)
        tokens = h.reshape(-1, d)  # [n, D]
        gates = self.router(tokens).softmax(dim=-1)  # [n, E]
        # Dispatch: every expert rank gets every token and all gates (a dense all_to_all keeps shapes static).
        payload = torch.cat([tokens, gates], dim=1).repeat(self.ep_size, 1)  # [ep * n, D + E]
        received = torch.empty_like(payload)
        work = dist.all_to_all_single(received, payload.detach().contiguous(), group=self.group_f, async_op=True)
        shared = self.shared(h)  # overlaps the dispatch in flight
        work.wait()
        recv = _AllToAll.apply(payload, self.group_f, self.group_b, [received])
        rtok, rgate = recv[:, :d], recv[:, d:]
        top = rgate.argmax(dim=-1)
        contrib = torch.zeros_like(rtok)
        for k, expert in enumerate(self.experts):
            e = self.ep_rank * self.local_experts + k
            w = rgate[:, e] * (top == e).to(rgate.dtype)  # gate weight of tokens routed to expert e, else 0
            contrib = contrib + w.unsqueeze(1) * expert(rtok)
        # Combine: send each source rank its tokens' results back, then sum over expert ranks in rank order.
        back = _AllToAll.apply(contrib, self.group_f, self.group_b, None).reshape(self.ep_size, -1, d)
        moe = back[0]
        for r in range(1, self.ep_size):
            moe = moe + back[r]
        return x + shared + moe.reshape(b, t, d)


class OverlappedMoEStage(MoEStage):
    """MoEStage plus the F&B overlap hook the runtime calls for paired chunks."""

    @classmethod
    def overlapped_forward_backward(
        cls,
        module0: nn.Module,
        inputs0: list[torch.Tensor],
        criterion0: Any,
        labels0: list[torch.Tensor],
        module1: nn.Module,
        loss1: torch.Tensor | None,
        outputs1: list[torch.Tensor],
        output_grads1: list[torch.Tensor],
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Chunk 1's backward on a helper thread (its all_to_alls on the backward group) while chunk 0's forward
        (all_to_alls on the forward group) runs here; returns chunk 0's outputs and, on a loss stage, its loss."""
        errors: list[BaseException] = []

        def backward1() -> None:
            try:
                if loss1 is not None:
                    loss1.backward()
                else:
                    # The runtime may have freed the outputs' storage once they were sent (as the
                    # reference does); run_backward goes through their graph edges, not their data.
                    run_backward(outputs1, output_grads1)
            except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
                errors.append(e)

        worker = threading.Thread(target=backward1, name="moe-chunk1-backward")
        worker.start()
        try:
            out = module0(*inputs0)
            outputs0 = [out] if isinstance(out, torch.Tensor) else list(out)
            loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        finally:
            worker.join()
        if errors:
            raise errors[0]
        module0.hook_calls += 1  # type: ignore[operator]
        return outputs0, loss0


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def run_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.steps`` steps with and without the hook from the same weights; compare bit for bit."""
    ep = args.ep
    pp = world // ep
    p_rank, e_rank = rank // ep, rank % ep
    pp_group, ep_f, ep_b = pipeline_expert_groups(pp, ep)
    n = args.microbatches or 4 * pp
    sched = build_schedule("dualpipev", pp, n)
    results: dict[str, Any] = {}
    for cls in (OverlappedMoEStage, MoEStage):
        mods = {
            s: cls(args.d_model, args.local_experts, e_rank, ep, (ep_f, ep_b), seed=args.seed * 1000 + s)
            for s in sched.stages_of_rank(p_rank)
        }
        for m in mods.values():
            m.hook_calls = 0  # type: ignore[assignment]
        pipe = Pipeline(sched, mods, group=pp_group)
        opt = torch.optim.SGD([q for m in mods.values() for q in m.parameters()], lr=0.05)
        losses, grads = [], []
        try:
            for step in range(args.steps):
                gen = torch.Generator().manual_seed(args.seed * 7919 + 31 * step + e_rank)  # data shard per replica
                x = torch.randn(n * args.batch_size, args.seq_len, args.d_model, generator=gen)
                y = torch.randn(n * args.batch_size, args.seq_len, args.d_model, generator=gen)
                res = pipe.step(x, labels=(y,), criterion=mse)
                losses.append({m: v.clone() for m, v in res.losses.items()})
                grads.append(
                    {
                        f"{s}.{k}": q.grad.clone()
                        for s, m in mods.items()
                        for k, q in m.named_parameters()
                        if q.grad is not None
                    }
                )
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            pipe.close()
        results[cls.__name__] = {
            "losses": losses,
            "grads": grads,
            "hook_calls": sum(int(m.hook_calls) for m in mods.values()),
        }
    a, b = results["OverlappedMoEStage"], results["MoEStage"]
    mismatch = _first_mismatch(a, b)
    mean_losses = [float(sum(float(v) for v in la.values()) / len(la)) if la else None for la in a["losses"]]
    return {
        "rank": rank,
        "bit_exact": mismatch is None,
        "mismatch": mismatch,
        "hook_calls": a["hook_calls"],
        "plain_hook_calls": b["hook_calls"],
        "losses": mean_losses,
    }


def _first_mismatch(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """None when every loss and gradient of run ``a`` equals run ``b``'s bit for bit, else where they first differ."""
    losses = _first_difference(a["losses"], b["losses"], "loss of micro-batch")
    return losses or _first_difference(a["grads"], b["grads"], "gradient of")


def _first_difference(xs: list[dict[Any, torch.Tensor]], ys: list[dict[Any, torch.Tensor]], what: str) -> str | None:
    """Where two runs' per-step tensors first differ (which are there, then their bits); None: nowhere."""
    for step, (x, y) in enumerate(zip(xs, ys, strict=False)):
        if x.keys() != y.keys():
            return f"step {step + 1}: {what} {sorted(x.keys() ^ y.keys())[:3]} in one run only"
        for k in x:
            if not torch.equal(x[k], y[k]):
                return f"step {step + 1}: {what} {k} differs by up to {float((x[k] - y[k]).abs().max()):.3g}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="MoE-style overlapped_forward_backward under DualPipeV")
    ap.add_argument("--pp", type=int, default=2, help="pipeline ranks")
    ap.add_argument("--ep", type=int, default=2, help="expert-parallel ranks per pipeline rank")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=None, help="default 4 x pp")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--local-experts", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.pp < 1 or args.ep < 1 or args.steps < 1:
        ap.error("--pp, --ep and --steps must be >= 1")
    from dualpipe_kernels.runtime import spawn

    out = spawn(run_rank, args.pp * args.ep, args, timeout_s=600)
    for o in out:
        losses = ", ".join(f"{v:.5f}" for v in o["losses"] if v is not None) or "(no loss stage here)"
        verdict = "yes" if o["bit_exact"] else f"NO ({o['mismatch']})"
        print(
            f"rank {o['rank']}: overlapped pairs run {o['hook_calls']}, losses {losses}, "
            f"bit-exact vs non-overlapped: {verdict}"
        )
    ok = all(o["bit_exact"] and o["hook_calls"] > 0 and o["plain_hook_calls"] == 0 for o in out)
    print("overlapped == non-overlapped (losses and every gradient, torch.equal):", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
