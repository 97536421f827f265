"""The stage contract (runtime/stage_io.py, docs/stage_contract.md) and the model options, in one process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from dualpipe_kernels.runtime import StageLayers, split_microbatches
from dualpipe_kernels.runtime.model_options import ModelOptions, model_options
from dualpipe_kernels.runtime.stage_io import call_args, flatten_outputs, is_keys_member
from dualpipe_kernels.runtime.tied import find_ties

DOC = Path(__file__).resolve().parents[2] / "docs" / "stage_contract.md"


def test_the_documented_example_runs() -> None:
    blocks = re.findall(r"<!-- test:run -->\s*```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], str(DOC), "exec"), {"__name__": "stage_contract_example"})


def test_a_dict_message_comes_back_as_keyword_arguments() -> None:
    h, mask = torch.randn(2, 3), torch.tensor([[True, False, True], [True, True, False]])
    members = flatten_outputs({"hidden": h, "attention_mask": mask, "past": None}, stage=0)
    assert len(members) == 4 and is_keys_member(members[-1]) and members[2] is None
    args, kwargs = call_args(list(members))
    assert args == [] and list(kwargs) == ["hidden", "attention_mask", "past"]
    assert kwargs["hidden"] is h and kwargs["attention_mask"] is mask and kwargs["past"] is None
    assert call_args([h, mask]) == ([h, mask], {})  # a tuple stays positional
    assert not is_keys_member(torch.zeros(20, dtype=torch.uint8))
    with pytest.raises(ValueError, match="returned int"):
        flatten_outputs(3, stage=1)


def test_stage_layers_pass_tuples_and_dicts_on() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2, mask

    class ToDict(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"mask": mask, "x": x + 1}

    class Last(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return x.masked_fill(~mask, 0.0)

    x, mask = torch.ones(2, 2), torch.tensor([[True, False], [False, True]])
    out = StageLayers([Pair(), ToDict(), Last()], 0)(x, mask)
    assert torch.equal(out, torch.tensor([[3.0, 0.0], [0.0, 3.0]]))


def test_options_are_checked() -> None:
    assert ModelOptions(tied_parameters=[["0.w", "5.w"]]).tied_parameters == (("0.w", "5.w"),)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 2 distinct names"):
        ModelOptions(tied_parameters=(("0.w",),))
    with pytest.raises(ValueError, match="in tied_parameters groups 0 and 1"):
        ModelOptions(tied_parameters=(("a", "b"), ("b", "c")))
    with pytest.raises(ValueError, match="allow_uneven must be True or False"):
        ModelOptions(allow_uneven=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="both as a keyword and in model_options"):
        model_options(ModelOptions(tied_parameters=(("a", "b"),)), tied_parameters=[("c", "d")])
    assert model_options(None, allow_uneven=True) == ModelOptions(allow_uneven=True)


def test_uneven_split_is_one_line_naming_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"^batch of 30 rows along batch_dim 0 does not divide into 8 micro-batches"):
        split_microbatches((torch.zeros(30, 2),), 8, uneven=False)
    assert [t[0].shape[0] for t in split_microbatches((torch.zeros(30, 2),), 8)] == [4] * 6 + [3] * 2


def test_ties_are_found_by_identity() -> None:
    emb = nn.Embedding(4, 3)
    head = nn.Linear(3, 4, bias=False)
    head.weight = emb.weight
    assert find_ties(nn.Sequential(emb, nn.ReLU(), head)) == (("0.weight", "2.weight"),)
    assert find_ties(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) == ()
