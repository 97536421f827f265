"""transformers: a ``*ForCausalLM`` cut into pipeline layers (docs/integrations.md#transformers).

:func:`split_causal_lm` turns a transformers decoder LM (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE,
Qwen3-MoE, DeepSeek-V3) into an ``nn.Sequential`` of ``2 + num_hidden_layers`` layers that share the model's
modules (no copy) and follow the stage contract (docs/stage_contract.md): each layer's output tuple is the
next one's positional arguments, on one rank or across a stage boundary.

* layer 0, :class:`CausalLMEmbedding` ``(input_ids, attention_mask=None, position_ids=None)``: the token
  embedding and the rotary embedding; returns ``(hidden, cos, sin, position_ids, attention_mask)``.
* layers ``1 .. L``, :class:`CausalLMDecoderLayer`: the model's own decoder layer ``i``.  It builds the
  causal (or sliding-window) mask itself from the carried 2-D ``attention_mask`` and ``position_ids``,
  with the function and arguments the model's forward uses for that layer, so only the small 2-D mask
  (or None) crosses a boundary, not a ``(B, 1, T, T)`` one.  Returns the same five members, ``hidden`` new.
* layer ``L + 1``, :class:`CausalLMHead`: the final norm and ``lm_head``; returns the logits ``(B, T, V)``.

``cos``, ``sin`` (computed without grad), ``position_ids`` (int64) and the mask need no gradient: they cross
boundaries exactly and nothing is sent back for them.  ``tie_word_embeddings=True`` makes ``lm_head.weight``
the embedding's parameter object, so ``Pipeline.from_sequential`` finds the tie by identity;
:func:`tied_parameter_names` gives the same groups for ``Pipeline(..., tied_parameters=...)``.

:func:`causal_lm_loss` is transformers' own shifted cross-entropy (``ForCausalLMLoss``, what
``model(input_ids, labels=labels).loss`` computes for these models).  MoE router auxiliary losses are not
included: the pipeline's loss is the LM loss (with ``output_router_logits=True`` the model's ``.loss`` adds
``router_aux_loss_coef * aux_loss``; ``.loss - router_aux_loss_coef * .aux_loss`` is what compares).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn

from dualpipe_kernels.runtime.tied import find_ties

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CausalLMEmbedding",
    "CausalLMDecoderLayer",
    "CausalLMHead",
    "split_causal_lm",
    "tied_parameter_names",
    "transformers_names",
    "causal_lm_loss",
]

#: ``config.model_type`` of the families whose split tests/unit/test_integrations_transformers.py checks
#: against the model's own forward (loss and gradients)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")

#: what a decoder layer's forward must accept (by name) to be called as the model's forward calls it
_LAYER_ARGS = ("hidden_states", "attention_mask", "position_ids", "position_embeddings")
#: what transformers' mask functions must accept (by name), as in transformers 5.25 (the version tested)
_MASK_ARGS = ("config", "inputs_embeds", "attention_mask", "cache", "position_ids")


class CausalLMEmbedding(nn.Module):
    """Layer 0: ``(input_ids (B, T) int64, attention_mask (B, T) or None, position_ids (B, T) or None)`` ->
    ``(hidden (B, T, D), cos, sin, position_ids, attention_mask)``.

    Without ``position_ids`` they are ``arange(T)`` of shape ``(1, T)``, as the model makes them; ``cos`` /
    ``sin`` are the rotary embedding's ``(B or 1, T, rotary dim)`` in the hidden state's dtype.
    """

    def __init__(self, embed_tokens: nn.Module, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids: Any = None
    ) -> tuple[Any, ...]:
        hidden = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        cos, sin = self.rotary_emb(hidden, position_ids)
        return hidden, cos, sin, position_ids, attention_mask


class CausalLMDecoderLayer(nn.Module):
    """One decoder layer of the model: ``(hidden, cos, sin, position_ids, attention_mask)`` -> the same five,
    ``hidden`` the layer's output.  ``sliding``: the model's forward gives this layer the sliding-window mask."""

    def __init__(self, layer: nn.Module, config: Any, sliding: bool) -> None:
        super().__init__()
        self.layer = layer
        self.config = config
        self.sliding = sliding

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: Any, attention_mask: Any
    ) -> tuple[Any, ...]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        make_mask = create_sliding_window_causal_mask if self.sliding else create_causal_mask
        mask = make_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            cache=None,
            position_ids=position_ids,
        )
        out = self.layer(
            hidden,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=False,
            position_embeddings=(cos, sin),
        )
        if isinstance(out, tuple):  # a decoder layer returning (hidden, attention weights, ...)
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"{type(self.layer).__name__} returned {type(out).__name__}, not the hidden-state tensor "
                "(or a tuple starting with it)"
            )
        return out, cos, sin, position_ids, attention_mask


class CausalLMHead(nn.Module):
    """The last layer: ``(hidden, cos, sin, position_ids, attention_mask)`` -> logits ``(B, T, vocab)``."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: Any, attention_mask: Any
    ) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def _require(owner: Any, attr: str, where: str, kind: str) -> Any:
    got = getattr(owner, attr, None)
    if got is None:
        raise ValueError(f"split_causal_lm: {where} has no {attr} ({kind}); this split needs it")
    return got


def _sliding_layers(config: Any, n: int) -> list[bool]:
    """Per decoder layer: does the model's forward give it the sliding-window mask?  ``config.layer_types``
    when the config has it (Qwen2, Qwen3, Qwen2-MoE), else every layer when ``config.sliding_window`` is set
    (Mistral, Mixtral, Qwen3-MoE), else none (Llama, DeepSeek-V3)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        unknown = sorted({t for t in layer_types[:n] if t not in ("full_attention", "sliding_attention")})
        if unknown or len(layer_types) < n:
            raise ValueError(
                f"split_causal_lm: config.layer_types {list(layer_types)} must name full_attention or "
                f"sliding_attention for each of the {n} decoder layers (unknown: {unknown})"
            )
        return [t == "sliding_attention" for t in layer_types[:n]]
    return [getattr(config, "sliding_window", None) is not None] * n


def _check_layer_signature(layer: nn.Module, index: int) -> None:
    params = inspect.signature(layer.forward).parameters
    missing = [a for a in _LAYER_ARGS if a not in params]
    if missing:
        raise ValueError(
            f"split_causal_lm: decoder layer {index} ({type(layer).__name__}) has forward"
            f"{inspect.signature(layer.forward)}, without the argument(s) {missing}: not a layer signature "
            f"this split knows (it calls layer(hidden_states, attention_mask=, position_ids=, use_cache=False, "
            "position_embeddings=(cos, sin)))"
        )


def _check_mask_functions() -> None:
    import transformers
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    for fn in (create_causal_mask, create_sliding_window_causal_mask):
        missing = [a for a in _MASK_ARGS if a not in inspect.signature(fn).parameters]
        if missing:
            raise ValueError(
                f"split_causal_lm: transformers {transformers.__version__}'s {fn.__name__} takes no {missing}; "
                "this split calls it as transformers 5.25 does (pip install 'dualpipe-kernels[transformers]')"
            )


def split_causal_lm(model: nn.Module, *, allow_unverified: bool = False) -> nn.Sequential:
    """``model`` (a transformers ``*ForCausalLM``) as ``nn.Sequential(embedding, decoder layer 0 .. L-1, head)``.

    The layers share ``model``'s modules and parameters (train the pipeline, the model's weights change).
    Give it to ``Pipeline.from_sequential(schedule, layers)`` or ``build_stage_modules(schedule, layers)``;
    ``StageLayers(list(layers), 0)(input_ids, attention_mask)`` runs it in one process.  Names inside it:
    ``"0.embed_tokens.weight"``, ``"3.layer.self_attn.q_proj.weight"`` (decoder layer 2), ... ;
    :func:`transformers_names` maps them to the model's.  A model whose ``config.model_type`` is not in
    :data:`SUPPORTED_MODEL_TYPES` is refused unless ``allow_unverified=True`` (then compare its loss with
    ``model(input_ids, labels=labels).loss`` yourself).  A missing piece (no ``embed_tokens``, no
    ``rotary_emb``, a decoder layer with another signature) is a ValueError naming it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"split_causal_lm: expected a transformers *ForCausalLM module, got {type(model).__name__}")
    name = type(model).__name__
    config = _require(model, "config", name, "the model's configuration")
    base = _require(model, "model", name, "the decoder stack, model.model")
    lm_head = _require(model, "lm_head", name, "the output projection")
    embed = _require(base, "embed_tokens", f"{name}.model", "the token embedding")
    rotary = _require(base, "rotary_emb", f"{name}.model", "the shared rotary embedding")
    layers = _require(base, "layers", f"{name}.model", "the decoder layers")
    norm = _require(base, "norm", f"{name}.model", "the final norm")
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES and not allow_unverified:
        raise ValueError(
            f"split_causal_lm: {name} (model_type {model_type!r}) is not one of the families this split is "
            f"checked against ({', '.join(SUPPORTED_MODEL_TYPES)}); pass allow_unverified=True to try it "
            "and compare causal_lm_loss over the split with model(input_ids, labels=labels).loss"
        )
    n = int(getattr(config, "num_hidden_layers", len(layers)))
    if n < 1 or n > len(layers):
        raise ValueError(f"split_causal_lm: config.num_hidden_layers={n} but {name}.model.layers has {len(layers)}")
    decoder = list(layers)[:n]
    for i, layer in enumerate(decoder):
        _check_layer_signature(layer, i)
    sliding = _sliding_layers(config, n)
    _check_mask_functions()
    return nn.Sequential(
        CausalLMEmbedding(embed, rotary),
        *(CausalLMDecoderLayer(layer, config, s) for layer, s in zip(decoder, sliding, strict=True)),
        CausalLMHead(norm, lm_head),
    )


def tied_parameter_names(layers: nn.Sequential) -> tuple[tuple[str, ...], ...]:
    """The tie groups of ``layers`` (one parameter under several names), in the layers' names:
    ``(("0.embed_tokens.weight", "<L+1>.lm_head.weight"),)`` for ``tie_word_embeddings=True``, else ``()``.
    For ``Pipeline(schedule, build_stage_modules(schedule, layers), tied_parameters=...)``; ``from_sequential``
    finds the same groups itself."""
    return find_ties(layers)


def transformers_names(model: nn.Module, layers: nn.Sequential) -> dict[str, str]:
    """``{name in layers: name in model}`` for every parameter and buffer of ``layers`` (a tied parameter: the
    model's first name, as ``model.named_parameters()`` gives it), e.g. ``"1.layer.mlp.up_proj.weight"`` ->
    ``"model.layers.0.mlp.up_proj.weight"``: to read a pipeline's ``model_state_dict()`` in the model's names."""
    by_id: dict[int, str] = {}
    for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        by_id.setdefault(id(t), n)
    out: dict[str, str] = {}
    for n, t in [*layers.named_parameters(remove_duplicate=False), *layers.named_buffers(remove_duplicate=False)]:
        if id(t) not in by_id:
            raise ValueError(f"transformers_names: {n} of the layers is not a tensor of the model")
        out[n] = by_id[id(t)]
    return out


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """transformers' causal-LM loss of ``logits (B, T, V)`` against ``labels (B, T)`` int64: labels shifted
    left by one (position ``t`` predicts token ``t + 1``), cross-entropy in float32 averaged over the labels
    that are not ``ignore_index``.  A pipeline's loss is the mean of its micro-batches' losses: the model's
    full-batch loss when each micro-batch has as many labelled tokens (e.g. no ``-100``)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    loss: torch.Tensor = ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1], ignore_index=ignore_index)
    return loss
