"""Profiler: sane times and saved-activation bytes that match a hand count; the layer file round-trips."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dualpipe_kernels.planner import load_layers, param_count_table, profile_layers, save_layers


def _tiny() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(3, 4)


def test_profile_tiny_model_by_hand():
    model, x = _tiny()
    before = [p.detach().clone() for p in model.parameters()]
    table = profile_layers(model, x, repeats=3)
    lin0, relu, lin1 = table.layers
    assert table.microbatch_size == 3 and table.unit == "s"
    # Saved for the backward (fp32, 4 bytes): Linear keeps its input (its weight is a parameter, not
    # counted); ReLU keeps its output.  [3, 4] -> 48 B, [3, 8] -> 96 B, [3, 8] -> 96 B.
    assert (lin0.activation_bytes, relu.activation_bytes, lin1.activation_bytes) == (48, 96, 96)
    assert (lin0.param_bytes, relu.param_bytes, lin1.param_bytes) == ((32 + 8) * 4, 0, (16 + 2) * 4)
    assert (lin0.boundary_bytes, relu.boundary_bytes, lin1.boundary_bytes) == (96, 96, 24)
    for layer in table.layers:
        assert 0 < layer.f_s < 1 and 0 < layer.b_s < 1 and 0 <= layer.w_s <= layer.b_s
    assert relu.w_s == 0 and lin0.w_s > 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_integer_first_input_and_buffers():
    emb = nn.Embedding(10, 4)
    ids = torch.tensor([[1, 2, 3]])
    table = profile_layers([emb, nn.Tanh()], ids, repeats=1)
    assert table.layers[0].activation_bytes == 3 * 8  # the int64 ids the embedding backward needs
    assert table.layers[1].activation_bytes == 3 * 4 * 4  # tanh keeps its output


class _Slow(nn.Module):
    """A layer whose forward sleeps while ``burst`` is on (a burst of load that meets whatever runs then)."""

    def __init__(self, log: list[int], k: int, burst: list[bool]) -> None:
        super().__init__()
        self.lin, self.log, self.k, self.burst = nn.Linear(2, 2), log, k, burst

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(self.k)
        if self.burst[0]:
            import time

            time.sleep(0.02)
        return self.lin(x)


def test_repeats_go_round_the_layers_so_a_burst_lands_on_all_alike():
    """The forwards run chain pass, then round by round (0 1 2, 0 1 2, ...), not layer by layer.

    A burst of load that lasts one round (here: the middle rounds sleep) then
    shifts every layer's median alike; profiled layer by layer, it would
    land on one layer and make the plan move work away from it.
    """
    log: list[int] = []
    burst = [False]
    layers = [_Slow(log, k, burst) for k in range(3)]
    calls = 0

    def count(module, args) -> None:
        nonlocal calls
        calls += 1
        burst[0] = 7 <= calls <= 12  # timed rounds 1 and 2 (calls 1-3: the chain pass; 4-6: the warm-up)

    for m in layers:
        m.register_forward_pre_hook(count)
    table = profile_layers(layers, torch.ones(1, 2), repeats=3)
    assert log == [0, 1, 2] * 5  # the chain pass, the warm-up round, three timed rounds
    f = [layer.f_s for layer in table.layers]
    assert all(x >= 0.02 for x in f), f  # two of three rounds slow for every layer: each median is slow


def test_param_count_fallback():
    model, _ = _tiny()
    table = param_count_table(model)
    assert table.unit == "params"
    assert [x.f_s for x in table.layers] == [40, 0, 18]
    assert [x.b_s for x in table.layers] == [80, 0, 36]


def test_layer_file_round_trip(tmp_path):
    model, x = _tiny()
    table = profile_layers(model, x, repeats=1)
    path = save_layers(table, tmp_path / "layers.json")
    assert load_layers(path) == table
    data = json.loads(path.read_text())
    assert set(data["layers"][0]) == {"name", "f_s", "b_s", "w_s", "activation_bytes", "param_bytes", "boundary_bytes"}
    data["layers"][1]["w_s"] = data["layers"][1]["b_s"] + 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"w_s .* must be <= b_s"):
        load_layers(path)
