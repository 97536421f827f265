"""Stage inputs under the memory policies (runtime/memory.py, one process, no pipeline).

* compress: a stage input only the runtime holds (a received tensor) is packed
  at the end of its forward and its storage freed; the backward still gives
  ``.grad`` and the weight gradient (within fp8 error); what the record
  counts falls from the whole input to its packed copy.
* a slice of the caller's batch is left whole and counted by no policy.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dualpipe_kernels.runtime.memory import ActivationMemory
from dualpipe_kernels.runtime.memory_plan import MemoryPolicy


def _run(policy: str, x: torch.Tensor, mb: int = 0) -> tuple[ActivationMemory, nn.Module, int]:
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    am = ActivationMemory(0, {0: MemoryPolicy.parse(policy)}, [], {0: mod}, torch.device("cpu"))
    am.track = True
    sm = am.begin_step(True)
    with am.saving(sm, 0, mb, (x,), lambda: mod(x)):
        y = mod(x)
    held = sm.resident
    am.before_backward(sm, 0, mb)  # recompute replays here
    y.sum().backward()
    am.release(sm, 0, mb)
    am.end_step(sm)
    return am, mod, held


def test_compress_frees_a_received_input_after_its_forward():
    data = torch.randn(32, 64)
    keep_x = data.clone().requires_grad_(True)
    _, keep_mod, keep_held = _run("keep", keep_x)
    x = data.clone().requires_grad_(True)  # like a received input: nothing else holds its storage
    am, mod, held = _run("compress:fp8", x)
    assert x.untyped_storage().nbytes() == 0  # freed; the tensor object stays for its .grad
    assert x.grad is not None
    w, w_keep = mod[0].weight.grad, keep_mod[0].weight.grad
    assert not torch.equal(w, w_keep)  # the weight gradient read the fp8 copy of the input
    # e4m3 keeps 3 mantissa bits: at most 2^-4 relative rounding per element
    for got, ref in ((x.grad, keep_x.grad), (w, w_keep)):
        assert (got - ref).norm() / ref.norm() < 0.0625
    whole = data.numel() * 4
    assert am.forward_peak_bytes[0] - am.forward_bytes[0] == pytest.approx(whole * (1 - 0.25 - 1 / 128), rel=0.01)
    assert held < keep_held


@pytest.mark.parametrize("policy", ["keep", "compress:fp8", "recompute"])
def test_a_slice_of_the_callers_batch_stays_and_counts_nowhere(policy):
    batch = torch.randn(64, 64, requires_grad=False)
    x = batch[:32]
    am, _, _ = _run(policy, x)
    assert x.untyped_storage().nbytes() == batch.numel() * 4
    if policy == "recompute":
        assert am.forward_bytes[0] == 0  # nothing but the (uncounted) input stays after the forward
