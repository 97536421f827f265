"""torchtitan's Llama 3 debug model on this package's DualPipeV, through torchtitan's own pipeline functions.

Needs torchtitan 0.3.0, which is not a dependency of this package; a venv of its own that reuses this
environment's torch (no second torch)::

    python3 -m venv /tmp/titan
    echo "$VIRTUAL_ENV/lib/python3.11/site-packages" > /tmp/titan/lib/python3.11/site-packages/shared.pth
    /tmp/titan/bin/pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro
    PYTHONPATH=. /tmp/titan/bin/python scripts/torchtitan_debug_model.py

On 2 local processes (gloo): ``use_dualpipe_kernels()``, then torchtitan's
``_generate_llm_fqn_per_model_part`` / ``_pipeline_module_split`` cut the debug model (6 layers, flex
attention) into 4 stages and ``_build_pipeline_schedule`` with ``pipeline_parallel_schedule="DualPipeV"``
builds the schedule: ours, on torchtitan's V placement.  One forward-only step (``eval``) with what
torchtitan's train step passes (pre-split micro-batches, ``positions`` and ``attention_masks`` as keyword
inputs of every stage, its loss with ``global_valid_tokens``); the logits and the per-micro-batch losses are
compared with the whole model's forward in one process (exit status 1 unless bit-equal).  Forward only:
flex attention has no backward on CPU ("FlexAttention does not support backward on CPU"), and torchtitan
0.3.0's other attention backends are varlen (no CPU kernel) and none for language models (sdpa was removed).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dualpipe_kernels.runtime import spawn

B, T, N = 4, 32, 4  # batch rows, tokens per row, micro-batches


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 2048, (B, T), generator=gen)
    return tokens, torch.randint(0, 2048, (B, T), generator=gen), torch.arange(T).repeat(B, 1)


def build() -> Any:
    from torchtitan.models.llama3 import model_registry

    torch.manual_seed(0)
    model = model_registry("debugmodel").model.build()
    model.init_states(buffer_device=None)
    return model


def loss_fn(pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor) -> tuple[Any, None]:
    """torchtitan's shape of loss: (sum over the micro-batch's tokens / the global count, extras)."""
    loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(), reduction="sum") / global_valid_tokens
    return loss, None


def rank_main(rank: int, world: int) -> dict[str, Any]:
    import torchtitan.distributed.pipeline_parallel as ppmod
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.config import ParallelismConfig

    from dualpipe_kernels.integrations.torchtitan import use_dualpipe_kernels

    use_dualpipe_kernels(["DualPipeV"])
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    tokens, labels, positions = data()
    names = ppmod._generate_llm_fqn_per_model_part(2 * world, 6, 1, 1)
    stages, parts = ppmod._pipeline_module_split(build(), mesh, "DualPipeV", torch.device("cpu"), names)
    par = ParallelismConfig(
        pipeline_parallel_schedule="DualPipeV", pipeline_parallel_degree=world, pipeline_parallel_microbatch_size=B // N
    )
    sched = ppmod._build_pipeline_schedule(parallelism=par, local_batch_size=B, stages=stages, loss_fn=loss_fn)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    kwargs = [
        {"positions": p, "attention_masks": parts[0].get_attention_masks(positions=p)} for p in positions.chunk(N)
    ]
    losses: list[torch.Tensor] | None = [] if last else None
    logits = sched.eval(
        arg_mbs=[(t,) for t in tokens.chunk(N)] if first else None,
        kwarg_mbs=kwargs,
        target_mbs=list(labels.chunk(N)) if last else None,
        losses=losses,
        loss_kwargs={"global_valid_tokens": torch.tensor(float(labels.numel()))},
    )
    out = {
        "class": f"{type(sched).__module__}.{type(sched).__name__}",
        "stages": [s.stage_index for s in stages],
        "logits": logits,
        "losses": None if losses is None else [float(v) for v in losses],
    }
    sched.close()
    dist.barrier()
    return out


def main() -> int:
    tokens, labels, positions = data()
    model = build()
    with torch.no_grad():
        ref = [
            model(t, positions=p, attention_masks=model.get_attention_masks(positions=p))
            for t, p in zip(tokens.chunk(N), positions.chunk(N), strict=True)
        ]
    count = torch.tensor(float(labels.numel()))
    ref_losses = [float(loss_fn(y, lab, count)[0]) for y, lab in zip(ref, labels.chunk(N), strict=True)]
    ok = True
    for r in spawn(rank_main, 2, timeout_s=500):
        line = f"stages {r['stages']}: {r['class']}"
        if r["logits"] is not None:
            full = torch.cat(ref)
            same = torch.equal(r["logits"], full) and r["losses"] == ref_losses
            ok = ok and same
            line += f"; logits {tuple(r['logits'].shape)} and losses bit-equal to one process: {same}"
        print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
