"""What ``plan --profile`` measures: the demo GPT as a layer list, or a user's ``module:factory``.

A factory is called with no arguments and returns either ``(layers, sample)``
(``layers`` an ``nn.Sequential`` or a list of modules, ``sample`` one
micro-batch for the first layer) or just the layers, which are then costed by
parameter count.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch
from torch import nn

from ..models.gpt import GPTConfig, build_gpt_stages
from .layers import LayerTable
from .profile import param_count_table, profile_layers

__all__ = ["gpt_layers", "load_factory", "profile_target"]


class _Embed(nn.Module):
    def __init__(self, tok: nn.Embedding, pos: nn.Parameter) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = tok, pos

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(ids) + self.pos_emb[: ids.shape[1]]


def gpt_layers(cfg: GPTConfig, microbatch_size: int = 4, seed: int = 0) -> tuple[list[nn.Module], torch.Tensor]:
    """The demo GPT as ``[embedding, block 0..n-1, final norm + head]`` and a sample id batch ``[mbs, T]``."""
    (stage,) = build_gpt_stages(cfg, 1, seed)
    layers: list[nn.Module] = [_Embed(stage.tok_emb, stage.pos_emb), *stage.blocks]
    layers.append(nn.Sequential(stage.ln_f, stage.head))
    sample = torch.randint(
        0, cfg.vocab_size, (microbatch_size, cfg.seq_len), generator=torch.Generator().manual_seed(seed)
    )
    return layers, sample


def load_factory(spec: str) -> object:
    """Import ``module:attr`` and return what calling it gives (ValueError with the reason otherwise)."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"--model must look like module:factory, got {spec!r}")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load model factory {spec!r}: {e}") from None
    return factory()


def profile_target(spec: str | None, repeats: int = 5) -> LayerTable:
    """Profile the demo GPT (``spec`` None) or a factory's model."""
    if spec is None:
        layers, sample = gpt_layers(GPTConfig(n_layers=8))
        names = ["embedding", *(f"block{i}" for i in range(len(layers) - 2)), "head"]
        return profile_layers(layers, sample, repeats, names)
    made = load_factory(spec)
    if isinstance(made, tuple) and len(made) == 2:
        layers, sample = made
        return profile_layers(_as_layers(layers, spec), sample, repeats)
    return param_count_table(_as_layers(made, spec))


def _as_layers(obj: object, spec: str) -> Sequence[nn.Module]:
    if isinstance(obj, nn.Sequential) or (
        isinstance(obj, (list, tuple)) and obj and all(isinstance(m, nn.Module) for m in obj)
    ):
        return list(obj)
    raise ValueError(
        f"model factory {spec!r} must return an nn.Sequential or a list of modules (optionally with a sample)"
    )
