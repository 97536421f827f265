"""integrations.transformers in one process: each family's split, chained by ``StageLayers``, is the model.

Per family (tests/support/hf_models.py: Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3; tiny, random, float64), tied and untied embeddings: ``causal_lm_loss`` over the chained layers
equals ``model(input_ids, attention_mask=, labels=).loss`` and every parameter's gradient equals the
model's own backward's, both within 1e-12 (they are bit-equal here: the same modules run the same ops).
The batch has padding (a 2-D mask, labels -100), and the sliding-window families see windows of 4 of 10
tokens, so the mask each decoder layer builds is the one the model's forward gives it.  Also: the tie
groups, the names back to the model's, the router aux loss left out, and the errors for what is missing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hf_models import FAMILIES, batch, make_model

from dualpipe_kernels.integrations.transformers import (
    SUPPORTED_MODEL_TYPES,
    causal_lm_loss,
    split_causal_lm,
    tied_parameter_names,
    transformers_names,
)
from dualpipe_kernels.runtime import StageLayers

TOL = 1e-12


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def test_every_supported_family_has_a_tiny_model() -> None:
    assert sorted(FAMILIES) == sorted(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_split_gives_the_models_loss_and_gradients(family: str, tied: bool) -> None:
    model = make_model(family, tied)
    assert model.config.model_type == family
    ids, mask, labels = batch(0, 4)
    want = model(ids, attention_mask=mask, labels=labels).loss
    want.backward()
    want_grads = _grads(model)

    layers = split_causal_lm(model)
    assert len(layers) == model.config.num_hidden_layers + 2
    logits = StageLayers(list(layers), 0)(ids, mask)
    assert logits.shape == (4, ids.shape[1], model.config.vocab_size) and logits.dtype == torch.float64
    got = causal_lm_loss(logits, labels)
    got.backward()
    got_grads = _grads(model)

    assert abs(got.item() - want.item()) <= TOL * abs(want.item()), f"{family}: loss {got.item()} != {want.item()}"
    assert sorted(got_grads) == sorted(want_grads)
    for n, g in want_grads.items():
        assert _rel(got_grads[n], g) <= TOL, f"{family}: gradient of {n} differs by {_rel(got_grads[n], g):.3g}"
    ties = tied_parameter_names(layers)
    last = len(layers) - 1
    assert ties == ((("0.embed_tokens.weight", f"{last}.lm_head.weight"),) if tied else ())


def test_position_ids_given_per_row_and_no_mask() -> None:
    model = make_model("qwen2", tied=False)
    ids, _, _ = batch(1, 3)
    pos = torch.arange(ids.shape[1]).expand(3, -1).contiguous()
    pos[1] += 5  # a row that continues a longer text
    with torch.no_grad():
        want = model(ids, position_ids=pos).logits
        got = StageLayers(list(split_causal_lm(model)), 0)(ids, None, pos)
    assert _rel(got, want) <= TOL


def test_the_router_aux_loss_is_not_in_the_pipeline_loss() -> None:
    model = make_model("mixtral", tied=False, output_router_logits=True, router_aux_loss_coef=0.02)
    ids, mask, labels = batch(2, 4)
    out = model(ids, attention_mask=mask, labels=labels)
    lm_only = out.loss - model.config.router_aux_loss_coef * out.aux_loss
    got = causal_lm_loss(StageLayers(list(split_causal_lm(model)), 0)(ids, mask), labels)
    assert out.aux_loss.item() > 0 and abs(out.loss.item() - got.item()) > 1e-6  # the aux term is there ...
    assert abs(got.item() - lm_only.item()) <= 1e-6 * abs(lm_only.item())  # ... and left out (float32 loss)


def test_names_map_back_to_the_models() -> None:
    model = make_model("deepseek_v3", tied=True, layers=2)
    layers = split_causal_lm(model)
    names = transformers_names(model, layers)
    assert names["0.embed_tokens.weight"] == "model.embed_tokens.weight"
    assert names["3.lm_head.weight"] == "model.embed_tokens.weight"  # tied: the model's first name
    assert names["2.layer.mlp.gate.weight"] == "model.layers.1.mlp.gate.weight"
    assert names["3.norm.weight"] == "model.norm.weight"
    assert set(names.values()) >= {n for n, _ in model.named_parameters()}


def test_a_model_missing_a_piece_is_refused_naming_it() -> None:
    model = make_model("llama", tied=False, layers=2)
    del model.model.rotary_emb
    with pytest.raises(ValueError, match=r"LlamaForCausalLM\.model has no rotary_emb"):
        split_causal_lm(model)
    model = make_model("llama", tied=False, layers=2)
    model.model.embed_tokens = None
    with pytest.raises(ValueError, match=r"has no embed_tokens \(the token embedding\)"):
        split_causal_lm(model)
    with pytest.raises(ValueError, match=r"Sequential has no config"):
        split_causal_lm(nn.Sequential(nn.Linear(2, 2)))


def test_an_unknown_layer_signature_is_refused_naming_the_arguments() -> None:
    class Block(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            return x

    model = make_model("mistral", tied=False, layers=2)
    model.model.layers[1] = Block()
    with pytest.raises(ValueError, match=r"decoder layer 1 \(Block\).*\['hidden_states', 'attention_mask'"):
        split_causal_lm(model)


def test_an_unverified_family_needs_allow_unverified() -> None:
    import transformers

    config = transformers.GemmaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4,
    )  # fmt: skip
    model = transformers.GemmaForCausalLM(config)
    with pytest.raises(ValueError, match=r"\(model_type 'gemma'\) is not one of the families"):
        split_causal_lm(model)
    assert len(split_causal_lm(model, allow_unverified=True)) == 4


def test_mask_functions_of_another_signature_are_refused_naming_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.masking_utils as mu

    def create_causal_mask(config, input_embeds, attention_mask, cache_position, past_key_values):  # older names
        raise AssertionError("not called")

    monkeypatch.setattr(mu, "create_causal_mask", create_causal_mask)
    model = make_model("llama", tied=False, layers=2)
    missing = r"\['inputs_embeds', 'cache', 'position_ids'\]"
    with pytest.raises(ValueError, match=rf"create_causal_mask takes no {missing}.*5\.25"):
        split_causal_lm(model)
