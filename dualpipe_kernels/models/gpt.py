"""A small decoder-only transformer (GPT) split into pipeline stages.

The model: token + position embedding, ``n_layers`` pre-norm blocks (causal
self-attention, GELU MLP), final LayerNorm and an untied LM head.  Split into
``num_stages`` model stages: the embedding sits in the first stage, the blocks
are spread as evenly as possible (earlier stages take the remainder), the final
norm and the head in the last; the loss (:func:`gpt_loss`) is the criterion the
pipeline calls on the last stage.

Shapes (B = sequences in a micro-batch, T = sequence length, D = d_model, V = vocab):
first stage ``ids [B, T] int64 -> hidden [B, T, D]``; middle stages
``hidden -> hidden``; last stage ``hidden -> logits [B, T, V]`` float32.
A single-stage model maps ids to logits.

Initialisation is deterministic and independent of the split: each block and
each of the embedding and the head draws its weights from its own generator
seeded from ``(seed, layer)``, so a model built as 4 stages or as 8 holds the
same numbers.  Attention is written out (no fused kernels) so results depend
only on the ops and the thread count.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPTConfig", "GPTStage", "build_gpt_stages", "gpt_loss", "stage_modules_for", "layer_split"]


@dataclass(frozen=True)
class GPTConfig:
    """Model sizes; defaults give a ~0.3M-parameter model that trains in fp32 on one CPU core."""

    vocab_size: int = 256
    seq_len: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``; ``[B, T, D] -> [B, T, D]``."""

    causal_mask: torch.Tensor  # a buffer (register_buffer), typed for the checker

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d)
        self.out = nn.Linear(cfg.mlp_ratio * d, d)
        mask = torch.triu(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))  # [B, H, T, D/H]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        scores = scores.masked_fill(self.causal_mask[:t, :t], float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPTStage(nn.Module):
    """One model stage: optional embedding, some blocks, optional final norm + head.

    ``layers`` are the global block indices this stage holds (for naming and init only).
    """

    def __init__(self, cfg: GPTConfig, layers: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.first, self.last = first, last
        self.layers = tuple(layers)
        if first:
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Parameter(torch.zeros(cfg.seq_len, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in layers)
        if last:
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            t = x.shape[1]
            x = self.tok_emb(x) + self.pos_emb[:t]
        for blk in self.blocks:
            x = blk(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; ``logits [B, T, V]``, ``targets [B, T]`` int64 -> scalar."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def layer_split(n_layers: int, num_stages: int) -> list[list[int]]:
    """Block indices per stage, as even as possible (earlier stages take the remainder)."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if n_layers < num_stages:
        raise ValueError(f"need at least one block per stage: n_layers={n_layers} < num_stages={num_stages}")
    base, extra = divmod(n_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def _init_(module: nn.Module, gen: torch.Generator) -> None:
    """GPT-2 style init from ``gen``: normal(0, 0.02) weights, zero biases, unit LayerNorm."""
    with torch.no_grad():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, nn.LayerNorm):
                p.fill_(1.0 if name == "weight" else 0.0)
            elif name == "bias":
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)


def _seeded(seed: int, slot: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + slot)


def build_gpt_stages(cfg: GPTConfig, num_stages: int, seed: int = 0) -> list[GPTStage]:
    """The model as ``num_stages`` stage modules (fp32, CPU), initialised deterministically from ``seed``."""
    split = layer_split(cfg.n_layers, num_stages)
    stages = [GPTStage(cfg, split[s], s == 0, s == num_stages - 1) for s in range(num_stages)]
    for st in stages:
        if st.first:
            gen = _seeded(seed, 0)
            _init_(st.tok_emb, gen)
            with torch.no_grad():
                st.pos_emb.normal_(0.0, 0.01, generator=gen)
        for layer, blk in zip(st.layers, st.blocks, strict=False):
            gen = _seeded(seed, 1 + layer)
            for m in blk.modules():
                _init_(m, gen)
        if st.last:
            gen = _seeded(seed, 1 + cfg.n_layers)
            _init_(st.ln_f, gen)
            _init_(st.head, gen)
    return stages


def stage_modules_for(schedule: object, cfg: GPTConfig, seed: int = 0, rank: int | None = None) -> dict[int, GPTStage]:
    """Stage modules for a schedule: ``{IR stage: module}`` (only ``rank``'s stages when given).

    IR stages that are copies of one model stage (DualPipe: ``model_stage[R + s] == s``)
    get independent deep copies with identical weights.
    """
    model_stage: tuple[int, ...] = schedule.model_stage  # type: ignore[attr-defined]
    n_model = len(set(model_stage))
    base = build_gpt_stages(cfg, n_model, seed)
    wanted = schedule.stages_of_rank(rank) if rank is not None else range(len(model_stage))  # type: ignore[attr-defined]
    out: dict[int, GPTStage] = {}
    used: set[int] = set()
    for s in wanted:
        m = model_stage[s]
        out[s] = base[m] if m not in used else copy.deepcopy(base[m])
        used.add(m)
    return out
