"""Tiny transformers decoder LMs (random weights, no download, float64) and their batches, for the
integrations.transformers tests (tests/unit and tests/process) and the ranks those spawn.

Every family of ``integrations.transformers.SUPPORTED_MODEL_TYPES``: hidden 16, vocabulary 64, 4 heads,
``layers`` decoder layers (default 3); Mistral, Mixtral and Qwen3-MoE with a 4-token sliding window, Qwen2
with sliding-window layers after the first (``layer_types`` mixed), so both mask functions are exercised.
The experts run transformers' ``eager`` implementation: its default ``grouped_mm`` takes no float64 on CPU.
"""

from __future__ import annotations

from typing import Any

import torch

V, T = 64, 10

_COMMON: dict[str, Any] = {
    "vocab_size": V,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "experts_implementation": "eager",
}
_MOE = {"moe_intermediate_size": 16, "num_experts_per_tok": 2}

#: family -> (config class name, its extra arguments)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 4}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4}),
    "qwen2_moe": ("Qwen2MoeConfig", {**_MOE, "num_experts": 4, "shared_expert_intermediate_size": 16}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {**_MOE, "num_experts": 4, "head_dim": 8, "use_sliding_window": True, "sliding_window": 4},
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            **_MOE,
            "num_key_value_heads": 4,  # its attention (MLA) has as many key/value heads as query heads
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 8,
            "q_lora_rank": 12,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4,
            "v_head_dim": 4,
        },
    ),
}


def make_config(family: str, tied: bool, layers: int = 3, **extra: Any) -> Any:
    import transformers

    cls_name, kw = FAMILIES[family]
    args = {**_COMMON, **kw, "num_hidden_layers": layers, "tie_word_embeddings": tied, **extra}
    return getattr(transformers, cls_name)(**args)


def make_model(family: str, tied: bool, layers: int = 3, seed: int = 0, **extra: Any) -> Any:
    """The family's ``*ForCausalLM`` in float64, the same weights for the same arguments (every rank)."""
    import transformers

    config = make_config(family, tied, layers, **extra)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).double()


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, labels)``: int64 ``(rows, T)``; odd rows padded after 6 tokens (mask 0,
    label -100), so the 2-D mask is not all ones and the loss skips the padding."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, V, (rows, T), generator=g)
    mask = torch.ones(rows, T, dtype=torch.int64)
    mask[1::2, 6:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels
