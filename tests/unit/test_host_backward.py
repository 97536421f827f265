"""zero_bubble.host_backward_full (the autograd engine called directly for host stages) and the choice of
full_backward_for: the same gradients, bit for bit, as backward_full, and the wrapper kept wherever it matters."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge

from dualpipe_kernels.runtime.zero_bubble import backward_full, full_backward_for, host_backward_full


def _grads(run: object, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    y = model(x)
    g = torch.randn_like(y)
    run([(get_gradient_edge(y), g)])  # type: ignore[operator]
    loss = model(x).square().mean()  # a second graph, a scalar root with a None grad: the public path
    run([(get_gradient_edge(loss), None)])  # type: ignore[operator]
    return [x.grad, *(p.grad for p in model.parameters())]  # type: ignore[list-item]


def test_host_backward_gives_backward_fulls_gradients_bit_for_bit() -> None:
    for seed in range(3):
        want, got = _grads(backward_full, seed), _grads(host_backward_full, seed)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    torch.manual_seed(0)
    ref = _grads(lambda roots: torch.autograd.backward([e for e, _ in roots], [g for _, g in roots]), 0)
    assert ref[0] is not None and ref[0].abs().sum() > 0
    assert all(torch.equal(a, b) for a, b in zip(ref, _grads(host_backward_full, 0), strict=True))
    host_backward_full([])  # nothing to do: no error


def test_full_backward_for_keeps_the_wrapper_off_host_and_under_debug_logging() -> None:
    assert full_backward_for([nn.Linear(2, 2)]) is host_backward_full
    on_meta = nn.Linear(2, 2, device="meta")
    assert full_backward_for([nn.Linear(2, 2), on_meta]) is backward_full
    log = logging.getLogger("torch.autograd.graph")
    level = log.level
    log.setLevel(logging.DEBUG)
    try:
        assert full_backward_for([nn.Linear(2, 2)]) is backward_full
    finally:
        log.setLevel(level)


@pytest.mark.parametrize("buffers", [False, True])
def test_full_backward_for_reads_buffers_too(buffers: bool) -> None:
    m = nn.BatchNorm1d(3) if buffers else nn.Identity()
    assert full_backward_for([m]) is host_backward_full
    if buffers:
        m.register_buffer("elsewhere", torch.zeros(1, device="meta"))
        assert full_backward_for([m]) is backward_full
