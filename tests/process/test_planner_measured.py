"""The planner's predicted peak of saved activations, against the runtime on two CPU processes.

A residual MLP with uneven layers is profiled, planned on 2 devices (one
schedule at a time), and the chosen plan runs one step through
``Pipeline.from_sequential(partition=...)``.  Every tensor autograd saves is
wrapped (``saved_tensors_hooks``) so its storage is counted from the save
until the graph drops it (a view counts its own bytes: micro-batches are views
of the batch); parameters are not counted.  Each rank's measured peak must
be within 10% of the plan's prediction for that rank, for every schedule the
planner searches (ZB1P and DualPipeV included: after an I, what the stage saved
lives until its W, in the runtime and in the memory model alike).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dualpipe_kernels.planner import Cluster, plan, profile_layers
from dualpipe_kernels.runtime import MemoryOptions, Pipeline, WireOptions, spawn
from dualpipe_kernels.schedules import build_schedule

D = 32
WIDTHS = [64, 128, 64, 256, 64, 64]
BATCH = 16
TOLERANCE = 0.10


class _Res(nn.Module):
    """``x + fc2(tanh(fc1(x)))``: saves x, tanh's output; the sum saves nothing (no sharing across layers)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, hidden), nn.Linear(hidden, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_Res(h) for h in WIDTHS])


def _criterion(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).sum()  # saves nothing of its own


class _Live:
    """Bytes of saved storages alive now, and the most seen at once."""

    def __init__(self, skip: set[int]) -> None:
        self.skip, self.refs, self.size, self.now, self.peak = skip, {}, {}, 0, 0

    def pack(self, t: torch.Tensor) -> object:
        # A micro-batch is a view of the whole batch: count the view's bytes, not its storage's.
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key[0] in self.skip:
            return t
        if self.refs.get(key, 0) == 0:
            self.size[key] = t.numel() * t.element_size()
            self.now += self.size[key]
            self.peak = max(self.peak, self.now)
        self.refs[key] = self.refs.get(key, 0) + 1
        return _Box(t, key, self)

    def drop(self, key: tuple[int, int, int]) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.now -= self.size.pop(key)


class _Box:
    """Holds a detached alias: a saved output keeps its ``grad_fn`` (the node that saves it), and a box holding
    the tensor itself would close a cycle through C++ that keeps the graph alive after its last reference."""

    def __init__(self, t: torch.Tensor, key: tuple[int, int, int], live: _Live) -> None:
        self.t, self.key, self.live = t.detach(), key, live

    def __del__(self) -> None:
        self.live.drop(self.key)


def _peak(rank: int, world: int, name: str, microbatches: int, partition: list[int]) -> int:
    model = _model()
    pipe = Pipeline.from_sequential(build_schedule(name, world, microbatches), model, partition=partition,
                                    wire=WireOptions(timeout_s=60.0))  # fmt: skip
    torch.manual_seed(1)
    x, t = torch.randn(BATCH, D), torch.randn(BATCH, D)
    # Not activations: the parameters, and the caller's batch and labels (held by the caller whatever the
    # pipeline saves; the runtime's own accounting counts them under no policy either).
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    live = _Live(skip | {x.untyped_storage().data_ptr(), t.untyped_storage().data_ptr()})
    with torch.autograd.graph.saved_tensors_hooks(live.pack, lambda b: b.t if isinstance(b, _Box) else b):
        pipe.step(x, labels=(t,), criterion=_criterion)
    pipe.close()
    return live.peak


def _worker(rank: int, world: int, plans: list[tuple[str, int, list[int]]]) -> list[int]:
    return [_peak(rank, world, *p) for p in plans]


SCHEDULES = ("1f1b", "zb1p", "interleaved1f1b", "dualpipe", "dualpipev")


@pytest.mark.timeout(300)
def test_predicted_peak_matches_the_runtime() -> None:
    table = profile_layers(_model(), torch.randn(4, D), repeats=1)
    cluster = Cluster(2, 2, 1e9)
    chosen = [
        plan(table, cluster, BATCH, schedules=(n,), pp_degrees=(2,), memory_policy="keep").best for n in SCHEDULES
    ]
    assert all(c.pp == 2 and c.dp == 1 for c in chosen)
    per_rank = spawn(_worker, 2, [(c.schedule, c.microbatches, list(c.partition)) for c in chosen], timeout_s=240)
    for k, c in enumerate(chosen):
        measured = [per_rank[r][k] for r in range(2)]
        predicted = c.activation_bytes_per_rank
        what = f"{c.label} partition {c.partition}: predicted per rank {predicted}, measured {measured}"
        assert all(abs(m - p) <= TOLERANCE * p for m, p in zip(measured, predicted, strict=True)), what


def _policy_peaks(rank: int, world: int, plans: list[tuple[str, int, list[int], str]]) -> list[int]:
    """The runtime's own accounting of device-resident saved bytes (``activation_memory``), per plan."""
    from dualpipe_kernels.runtime.memory_plan import MemoryPolicy

    out = []
    for name, microbatches, partition, policy in plans:
        # min_bytes=0: this model's tensors are smaller than the default offload threshold
        pol = MemoryPolicy(policy, min_bytes=0)
        pipe = Pipeline.from_sequential(build_schedule(name, world, microbatches), _model(), partition=partition,
                                        wire=WireOptions(timeout_s=60.0), memory=MemoryOptions(pol))  # fmt: skip
        pipe.activation_memory.track = True  # count keep too
        torch.manual_seed(1)
        x, t = torch.randn(BATCH, D), torch.randn(BATCH, D)
        pipe.step(x, labels=(t,), criterion=_criterion)
        pipe.close()
        out.append(pipe.activation_memory.last_peak_bytes)
    return out


@pytest.mark.timeout(300)
def test_predicted_peak_per_policy_matches_the_runtime() -> None:
    # recompute and offload hold what the runtime pins (the stage input) plus what comes back; their
    # saved-tensor hooks replace the counter above, so the runtime's own accounting is compared here.
    table = profile_layers(_model(), torch.randn(4, D), repeats=1)
    cluster = Cluster(2, 2, 1e9)
    chosen = []
    for policy in ("recompute", "offload"):
        for n in ("1f1b", "zb1p", "interleaved1f1b", "dualpipev"):
            chosen.append(plan(table, cluster, BATCH, schedules=(n,), pp_degrees=(2,), memory_policy=policy).best)
    assert all(c.memory_policy in ("recompute", "offload") for c in chosen)
    jobs = [(c.schedule, c.microbatches, list(c.partition), c.memory_policy) for c in chosen]
    per_rank = spawn(_policy_peaks, 2, jobs, timeout_s=240)
    for k, c in enumerate(chosen):
        measured = [per_rank[r][k] for r in range(2)]
        predicted = c.activation_bytes_per_rank
        what = f"{c.label} partition {c.partition}: predicted per rank {predicted}, measured {measured}"
        assert all(abs(m - p) <= TOLERANCE * p for m, p in zip(measured, predicted, strict=True)), what
