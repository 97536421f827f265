"""A transformers LM split by integrations.transformers trains on a pipeline as the model does in one process.

Tiny float64 models (tests/support/hf_models.py), 3 SGD steps on local ranks (tests/support/hf_workers.py),
two micro-batch rows each, a padded batch (2-D mask and labels -100 cross the boundaries), compared with the
model's own ``model(..., labels=).loss`` on the same micro-batches in this process: the first step's
micro-batch losses bit-exact, the parameters after 3 steps within 1e-9 relative.  The covering set, in two
spawned groups (each rank imports torch and transformers once):

* 2 ranks: Llama (2 decoder layers) untied and tied on DualPipeV, 1F1B and ZB1P (``from_sequential`` finds
  the tie), and tied on 1F1B with ``build_stage_modules`` + ``tied_parameters=tied_parameter_names(...)``;
* 4 ranks, DualPipeV (8 stages, 6 decoder layers): Mixtral untied (MoE, sliding window) and Qwen3 tied.
"""

from __future__ import annotations

from typing import Any

import hf_workers as hw
import pytest
import torch
from spawn_checks import Check, results, run_checks

from dualpipe_kernels.runtime import spawn

REL = 1e-9

#: the 2-rank cases of each pair of ranks (0-1, 2-3): name -> hw.Case
PAIRS: tuple[dict[str, hw.Case], ...] = tuple(
    {f"llama:{tie}:{s}": ("llama", tie == "tied", s, 2, 4, False) for s in ("dualpipev", "1f1b", "zb1p")}
    for tie in ("untied", "tied")
)
PAIRS[1]["llama:tied:1f1b:declared"] = ("llama", True, "1f1b", 2, 4, True)
FOUR: dict[str, hw.Case] = {
    "mixtral:untied:dualpipev": ("mixtral", False, "dualpipev", 6, 8, False),
    "qwen3:tied:dualpipev": ("qwen3", True, "dualpipev", 6, 8, False),
}
CHECKS: tuple[Check, ...] = (
    ("pairs", hw.train_on_pairs, (PAIRS,)),
    *((name, hw.train, case) for name, case in FOUR.items()),
)


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(run_checks, 4, CHECKS, timeout_s=300)


def _ranks(runs: list[dict[str, Any]], name: str) -> tuple[hw.Case, list[Any]]:
    if name in FOUR:
        return FOUR[name], results(runs, name)
    k = next(k for k, cases in enumerate(PAIRS) if name in cases)
    per_rank = results(runs, "pairs")
    return PAIRS[k][name], [per_rank[2 * k][name], per_rank[2 * k + 1][name]]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", [*(n for cases in PAIRS for n in cases), *FOUR])
def test_training_steps_match_one_process(runs: list[dict[str, Any]], name: str) -> None:
    (family, tied, _, layers, n, _), ranks = _ranks(runs, name)
    ref = hw.reference_run(family, tied, layers, n)

    first = {m: v for r in ranks for m, v in r["losses"][0].items()}
    assert sorted(first) == list(range(n)), f"{name}: losses of micro-batches {sorted(first)}"
    for m, v in first.items():
        assert torch.equal(v, ref["losses"][0][m]), f"{name}: step 0 micro-batch {m} loss {v} != {ref['losses'][0][m]}"

    got: dict[str, torch.Tensor] = {}
    for r in ranks:
        got.update(r["params"])
    assert sorted(got) == sorted(ref["params"]), f"{name}: {sorted(set(got) ^ set(ref['params']))}"
    for k, want in ref["params"].items():
        err = (got[k] - want).abs().max().item() / want.abs().max().item()
        assert err <= REL, f"{name}: {k} differs by {err:.3g} relative after {hw.STEPS} steps"
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert not torch.equal(got[head], hw.make_model(family, tied, layers).state_dict()[head])  # it trained
