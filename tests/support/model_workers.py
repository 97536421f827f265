"""Rank functions and one-process references for models as users write them (test_runtime_models.py).

The model: a small decoder LM, ``[Embed, Block, Block, Block, Block, Head]``.  ``Embed(ids, attention_mask)``
returns ``(hidden, attention_mask, position_ids, None)``; each ``Block(hidden, attention_mask,
position_ids=None, past=None)`` runs a causal single-head attention that also masks padded keys (a bool
``attention_mask``) and returns the same four members, blocks 1 and 3 as a dict (keyword arguments for the
next layer, across stage boundaries too); ``Head`` returns ``(logits, attention_mask, position_ids)`` so the
last rank sees the masks and ids that travelled.  ``tied=True``: the head's weight is the embedding's.

Every case returns plain data; the test compares it with :func:`reference_run` (one process, the same
micro-batches, ``StageLayers(list(model), 0)`` as the model's forward).
"""

from __future__ import annotations

import copy
import math
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dualpipe_kernels.runtime import (
    GradientOptions,
    ModelOptions,
    Pipeline,
    StageLayers,
    WireOptions,
    build_stage_modules,
)
from dualpipe_kernels.schedules import build_schedule

W60 = WireOptions(timeout_s=60)

V, D, T = 16, 8, 5
LR = 0.1


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[Any, ...]:
        pos = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1).contiguous()
        return self.emb(ids), attention_mask, pos, None


class Block(nn.Module):
    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.pos = nn.Embedding(T, D)
        self.as_dict = as_dict

    def forward(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: Any = None, past: Any = None
    ) -> Any:
        assert attention_mask.dtype == torch.bool and past is None
        x = hidden + self.pos(position_ids) if position_ids is not None else hidden
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D)
        t = hidden.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=hidden.device).tril()
        allowed = causal[None] & attention_mask[:, None, :]
        att = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out = hidden + self.proj(att @ v)
        if self.as_dict:
            return {"hidden": out, "attention_mask": attention_mask, "position_ids": position_ids, "past": None}
        return out, attention_mask, position_ids, None


class Head(nn.Module):
    def __init__(self, tie_to: nn.Embedding | None = None) -> None:
        super().__init__()
        self.weight = tie_to.weight if tie_to is not None else nn.Parameter(torch.randn(V, D) * 0.3)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: Any, past: Any) -> Any:
        return F.linear(hidden, self.weight), attention_mask, position_ids


def make_model(seed: int = 0, tied: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    embed = Embed()
    blocks = [Block(as_dict=i % 2 == 1) for i in range(4)]
    return nn.Sequential(embed, *blocks, Head(embed.emb if tied else None))


def criterion(logits: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, attention_mask, labels)``: ids int64, a bool padding mask (each row 1..T valid tokens)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, V, (rows, T), generator=g)
    lengths = torch.randint(1, T + 1, (rows,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    labels = torch.randint(0, V, (rows, T), generator=g)
    return ids, mask, labels


def canonical_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters, a tied one once under its first name (as checkpoints store it)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out[n] = p.detach().clone()
    return out


def sgd(params: Any) -> None:
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p -= LR * p.grad
                p.grad = None


def reference_run(steps: int, rows: int, n: int, tied: bool, seed: int = 0, weighted: bool = False) -> dict[str, Any]:
    """One process: per step, each micro-batch's loss (seeded 1/n, or rows/B when ``weighted``) backward, SGD."""
    model = make_model(seed, tied)
    full = StageLayers(list(model), 0)
    losses = []
    for step in range(steps):
        ids, mask, labels = batch(step, rows)
        chunks = list(zip(ids.tensor_split(n), mask.tensor_split(n), labels.tensor_split(n), strict=True))
        step_losses = []
        for i, m, lab in chunks:
            loss = criterion(*full(i, m), lab)
            (loss * (i.shape[0] / rows if weighted else 1.0 / n)).backward()
            step_losses.append(loss.detach())
        losses.append(step_losses)
        sgd(model.parameters())
    return {"params": canonical_state(model), "losses": losses}


def full_batch_grads(rows: int, tied: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """One process's gradients of the mean loss over the whole batch (one forward of all rows)."""
    model = make_model(seed, tied)
    ids, mask, labels = batch(0, rows)
    criterion(*StageLayers(list(model), 0)(ids, mask), labels).backward()
    seen: set[int] = set()
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen and p.grad is not None:
            seen.add(id(p))
            out[n] = p.grad.clone()
    return out


def _train(pipe: Pipeline, steps: int, rows: int, n: int) -> dict[str, Any]:
    """``steps`` SGD steps; per step this rank's losses, the last step's outputs' masks/ids and the wire bytes."""
    losses, travelled = [], []
    for step in range(steps):
        ids, mask, labels = batch(step, rows)
        res = pipe.step(ids, mask, labels=(labels,), criterion=criterion, return_outputs=True)
        losses.append({m: v.clone() for m, v in res.losses.items()})
        sgd(pipe.parameters())
        if res.outputs:
            chunks = list(zip(mask.tensor_split(n), strict=True))
            pos = torch.arange(T).expand(rows, -1).tensor_split(n)
            travelled.append(
                all(
                    o[1].dtype == torch.bool
                    and torch.equal(o[1], chunks[m][0])
                    and o[2].dtype == torch.int64
                    and torch.equal(o[2], pos[m])
                    for m, o in res.outputs.items()
                )
            )
    return {
        "losses": losses,
        "travelled_exactly": travelled,
        "params": {k: v.clone() for k, v in pipe.model_state_dict().items()},
        "wire": pipe.boundary_bytes(),
    }


def _case(results: dict[str, Any], key: str, fn: Callable[[], Any], group: Any) -> None:
    try:
        results[key] = fn()
    except Exception:  # noqa: BLE001 - reported to the test, which names the case
        results[key] = {"error": traceback.format_exc()}
    dist.barrier(group=group)


def two_rank_cases(rank: int, world: int) -> dict[str, Any]:
    """Multi-input (every schedule, formats none/packed, lossy bf16/fp8), uneven batches, tied weights (2 ranks)."""
    torch.use_deterministic_algorithms(True)
    out: dict[str, Any] = {}
    rows, n = 8, 4

    def multi(name: str, fmt: str, steps: int) -> Any:
        wire = WireOptions(boundary_format=fmt, timeout_s=60)
        pipe = Pipeline.from_sequential(build_schedule(name, 2, n), make_model(), wire=wire)
        try:
            return _train(pipe, steps, rows, n)
        finally:
            pipe.close()

    for name in ("dualpipev", "1f1b", "zb1p", "dualpipe"):
        for fmt in ("none", "packed"):
            _case(out, f"multi:{name}:{fmt}", lambda name=name, fmt=fmt: multi(name, fmt, 3), None)
    for name in ("dualpipev", "1f1b"):
        for fmt in ("bf16", "fp8"):
            _case(out, f"lossy:{name}:{fmt}", lambda name=name, fmt=fmt: multi(name, fmt, 1), None)

    def uneven(allow: bool) -> Any:
        opts = ModelOptions(allow_uneven=allow)
        pipe = Pipeline.from_sequential(build_schedule("1f1b", 2, 8), make_model(), model_options=opts, wire=W60)
        try:
            ids, mask, labels = batch(0, 30)
            try:
                pipe.step(ids, mask, labels=(labels,), criterion=criterion)
            except ValueError as exc:
                return {"refused": str(exc)}
            by_full = {}
            for m in pipe.stage_modules.values():
                for local, p in m.named_parameters():
                    if p.grad is not None:
                        by_full[m.full_name(local)] = p.grad.clone()
            return {"grads": by_full}
        finally:
            pipe.close()

    _case(out, "uneven:refused", lambda: uneven(False), None)
    _case(out, "uneven:weighted", lambda: uneven(True), None)

    def short_labels() -> Any:
        pipe = Pipeline.from_sequential(build_schedule("1f1b", 2, 4), make_model(), wire=W60)
        try:
            ids, mask, labels = batch(0, 8)
            try:
                pipe.step(ids, mask, labels=(labels[:6],), criterion=criterion)
            except ValueError as exc:
                return {"refused": str(exc)}
            return {"refused": None}
        finally:
            pipe.close()

    _case(out, "short_labels", short_labels, None)

    def tied(name: str, declared: bool) -> Any:
        sched = build_schedule(name, 2, n)
        model = make_model(tied=True)
        if declared:  # each layer a separate object: the tie is the caller's to declare
            mods = build_stage_modules(sched, lambda i: copy.deepcopy(model[i]), num_layers=len(model))
            pipe = Pipeline(sched, mods, tied_parameters=[("0.emb.weight", "5.weight")], timeout_s=60)
        else:
            pipe = Pipeline.from_sequential(sched, model, wire=W60)
        try:
            return _train(pipe, 3, rows, n)
        finally:
            pipe.close()

    for name in ("1f1b", "zb1p", "dualpipe", "dualpipev"):
        _case(out, f"tied:{name}", lambda name=name: tied(name, False), None)
    _case(out, "tied_declared:1f1b", lambda: tied("1f1b", True), None)
    _case(out, "tied_declared:dualpipe", lambda: tied("dualpipe", True), None)
    return out


def four_rank_cases(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """Tied weights on 4 ranks, PP 2 x DP 2 global loss, Adam state saved on 2 ranks and loaded on 4."""
    from dualpipe_kernels.runtime.checkpoint import load_pipeline, save_pipeline

    torch.use_deterministic_algorithms(True)
    out: dict[str, Any] = {}
    rows, n = 16, 8
    # PP 2 x DP 2: pipeline groups {0,1} {2,3}, data-parallel groups {0,2} {1,3}; every rank creates every group,
    # before any pipeline (a plain new_group after the members-only tie groups hung here: see the report).
    pp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]

    def tied(name: str, declared: bool) -> Any:
        sched = build_schedule(name, 4, n)
        model = make_model(tied=True)
        if declared:
            mods = build_stage_modules(sched, lambda i: copy.deepcopy(model[i]), num_layers=len(model))
            pipe = Pipeline(sched, mods, tied_parameters=[("0.emb.weight", "5.weight")], timeout_s=60)
        else:
            pipe = Pipeline.from_sequential(sched, model, wire=W60)
        try:
            return _train(pipe, 3, rows, n)
        finally:
            pipe.close()

    for name in ("1f1b", "zb1p"):
        _case(out, f"tied4:{name}", lambda name=name: tied(name, False), None)
    _case(out, "tied4_declared:zb1p", lambda: tied("zb1p", True), None)

    def ppdp() -> Any:
        grads = GradientOptions(dp_group=dp)
        pipe = Pipeline.from_sequential(build_schedule("1f1b", 2, 4), make_model(), group=pp, gradients=grads, wire=W60)
        try:
            ids, mask, labels = batch(7, 16)  # the global batch; replica r takes rows 8r .. 8r+7
            r = rank // 2
            sl = slice(8 * r, 8 * r + 8)
            res = pipe.step(ids[sl], mask[sl], labels=(labels[sl],), criterion=criterion, reduce_loss=True)
            assert res.loss is not None
            return {"loss": res.loss.clone()}
        finally:
            pipe.close()

    _case(out, "ppdp:loss", ppdp, None)

    def save_on_two() -> Any:
        if rank >= 2:
            return {"skipped": True}
        pipe = Pipeline.from_sequential(build_schedule("1f1b", 2, 4), make_model(tied=True), group=pp, wire=W60)
        opt = torch.optim.Adam(pipe.parameters(), lr=0.01, eps=1e-3)  # eps: k-biases have ~0 gradients
        try:
            for step in range(2):
                ids, mask, labels = batch(step, 8)
                pipe.step(ids, mask, labels=(labels,), criterion=criterion)
                opt.step()
                opt.zero_grad()
            save_pipeline(pipe, ckpt, optimizer=opt)
            return {"saved": True}
        finally:
            pipe.close()

    _case(out, "adam:save2", save_on_two, None)

    def load_on_four() -> Any:
        pipe = Pipeline.from_sequential(build_schedule("1f1b", 4, 4), make_model(seed=9, tied=True), wire=W60)
        opt = torch.optim.Adam(pipe.parameters(), lr=0.5)  # the checkpoint's lr (0.01) replaces it
        try:
            load_pipeline(pipe, ckpt, optimizer=opt)
            ids, mask, labels = batch(2, 8)
            pipe.step(ids, mask, labels=(labels,), criterion=criterion)
            opt.step()
            return {"params": {k: v.clone() for k, v in pipe.model_state_dict().items()}}
        finally:
            pipe.close()

    _case(out, "adam:load4", load_on_four, None)
    return out
