"""Offload through one pack per forward and one unpack per reload, on two copy lanes (in-process, CPU).

One stage, eight compute actions (F0..F3 then B0..B3: every key offloaded,
reloaded two computes before its backward), driven by hand through
:class:`ActivationMemory` as the action loop drives it.  The stage saves a view
of an activation and one tensor twice.  Checks, against the same stage run
without hooks (plain autograd, the reference):

* gradients bit-exact under ``offload``, within the cast's tolerance under
  ``offload:bf16`` / ``offload:fp8`` (the same bounds as compress's);
* ``kernels.pack`` runs once per offloading forward with one tensor per
  distinct storage (views and a twice-saved tensor share one), and
  ``kernels.unpack`` once per reload (counted on the public API);
* ordering without a GPU: with the offload lane held, the sources stay counted
  (and are what the backward reads) until the pack's event has fired, then
  leave at the next compute action; a reload job waits for the offload event it
  is ordered after; the two lanes are two threads;
* the per-step history is bounded (``HISTORY`` entries).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.nn as nn

from dualpipe_kernels import kernels
from dualpipe_kernels.runtime.memory import HISTORY, ActivationMemory
from dualpipe_kernels.runtime.memory_plan import MemoryPolicy
from dualpipe_kernels.runtime.memory_store import CopyLanes
from dualpipe_kernels.schedules.ir import parse_actions

ACTIONS = parse_actions("0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3")
MBS = 4
ROWS, DIM = 8, 64
#: max |grad - ref| / max |ref| per parameter: fp8 e4m3 (3 mantissa bits, one scale per 128) and bf16
TOL = {"offload": 0.0, "offload:bf16": 0.02, "offload:fp8": 0.15}


class Stage(nn.Module):
    """fc1 -> gelu -> fc2 (wider) -> a view of its output, and ``h * h`` (h saved twice)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, 2 * DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(x))
        y = self.fc2(h * h)
        return torch.tanh(y[:, :DIM]) * torch.sigmoid(y[:, DIM:])


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(ROWS, DIM, generator=g) for _ in range(MBS)]


def _reference() -> dict[str, torch.Tensor]:
    m = Stage()
    for x in _inputs():
        m(x).pow(2).sum().backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def _distinct_storages(m: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(saved tensors, distinct storages among them) of one forward, parameters and the input left out."""
    params = {p.untyped_storage().data_ptr() for p in m.parameters()} | {x.untyped_storage().data_ptr()}
    seen: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x)
    moved = [p for p in seen if p not in params]
    return len(moved), len(set(moved))


class Counting:
    """Wraps kernels.pack / unpack: calls, tensors per pack, an optional gate the pack waits on (the lane)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.packs: list[int] = []
        self.unpacks = 0
        self.gate: threading.Event | None = None
        self.threads: set[str] = set()
        real_pack, real_unpack = kernels.pack, kernels.unpack

        def pack(tensors: Any, *a: Any, **k: Any) -> Any:
            self.threads.add(threading.current_thread().name)
            if self.gate is not None:
                assert self.gate.wait(10.0), "test gate never opened"
            self.packs.append(len(tensors))
            return real_pack(tensors, *a, **k)

        def unpack(*a: Any, **k: Any) -> Any:
            self.threads.add(threading.current_thread().name)
            self.unpacks += 1
            return real_unpack(*a, **k)

        monkeypatch.setattr(kernels, "pack", pack)
        monkeypatch.setattr(kernels, "unpack", unpack)


def _run(mem: ActivationMemory, m: nn.Module, on_action: Any = None) -> list[int]:
    """One step through the actions; the resident bytes before each action."""
    xs = _inputs()
    sm = mem.begin_step(training=True)
    outs: dict[int, torch.Tensor] = {}
    resident = []
    for i, a in enumerate(ACTIONS):
        if on_action is not None:
            on_action(i, sm)
        if i in mem.plan.reload_at:
            mem.at_action(sm, i)
        resident.append(sm.resident)
        if a.type.value == "F":
            with mem.saving(sm, 0, a.microbatch, [xs[a.microbatch]], None):
                outs[a.microbatch] = m(xs[a.microbatch])
        else:
            mem.before_backward(sm, 0, a.microbatch)
            outs.pop(a.microbatch).pow(2).sum().backward()
            mem.release(sm, 0, a.microbatch)
    mem.end_step(sm)
    return resident


def _memory(m: nn.Module, policy: str) -> ActivationMemory:
    pol = MemoryPolicy.parse(policy)
    return ActivationMemory(0, {0: MemoryPolicy(pol.kind, pol.fmt, min_bytes=0)}, ACTIONS, {0: m}, torch.device("cpu"))


@pytest.mark.parametrize("policy", list(TOL))
def test_one_pack_per_forward_one_unpack_per_reload(monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    ref = _reference()
    count = Counting(monkeypatch)
    m = Stage()
    mem = _memory(m, policy)
    try:
        for step in range(2):  # the second step packs into the sized arena
            m.zero_grad(set_to_none=True)
            _run(mem, m)
            worst = max(((p.grad - ref[n]).abs().max() / ref[n].abs().max()).item() for n, p in m.named_parameters())
            assert worst <= TOL[policy], f"step {step}: {policy} gradient off by {worst:.3g} of max"
            if policy == "offload":
                assert all(torch.equal(p.grad, ref[n]) for n, p in m.named_parameters())
    finally:
        mem.close()
    saved, distinct = _distinct_storages(Stage(), _inputs()[0])
    assert saved > distinct >= 3  # the view and the twice-saved h really share storages
    assert count.packs == [distinct] * (2 * MBS), "one pack launch per forward, one tensor per storage"
    assert count.unpacks == 2 * MBS, "one unpack launch per reload"
    assert (mem.offload_packs, mem.reload_unpacks) == (2 * MBS, 2 * MBS)
    assert mem.arena.allocations == 1
    assert {t.split("_")[0] for t in count.threads} == {"dualpipe-offload", "dualpipe-reload"}
    assert list(mem.host_bytes)[0] > 0 and len(set(mem.host_bytes)) == 1
    assert mem.peaks[-1] > 0


def test_host_bytes_of_the_casts_against_lossless(monkeypatch: pytest.MonkeyPatch) -> None:
    got = {}
    for policy in TOL:
        m = Stage()
        mem = _memory(m, policy)
        try:
            _run(mem, m)
        finally:
            mem.close()
        got[policy] = mem.host_bytes[-1]
    assert got["offload:bf16"] <= 0.55 * got["offload"]
    assert got["offload:fp8"] <= 0.30 * got["offload"]  # e4m3 codes + one fp32 scale per 128 + alignment


def test_sources_stay_until_the_pack_has_run_and_reloads_follow_offloads(monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _reference()
    count = Counting(monkeypatch)
    count.gate = threading.Event()
    m = Stage()
    mem = _memory(m, "offload")
    # GPU semantics on CPU: an event is polled, not waited for; the log records the lanes' order.
    mem.lanes = CopyLanes(torch.device("cpu"), threaded=True, wait_to_settle=False)
    mem.lanes.log = []
    held: list[int] = []

    def on_action(i: int, sm: Any) -> None:
        if i == 1:
            held.append(sm.resident)  # F0's sources, its pack blocked
        if i == 2:
            count.gate.set()
            mem.lanes._last["offload"].result(timeout=10.0)  # every pack so far has run

    try:
        resident = _run(mem, m, on_action)
    finally:
        mem.close()
    per_forward = resident[1]
    assert per_forward > 0 and held == [per_forward]
    # F1's pack was blocked as well: before F2 both forwards' sources were still held ...
    assert resident[2] < 2 * per_forward  # ... and leave at action 2, once the packs' events fired
    assert all(torch.equal(p.grad, ref[n]) for n, p in m.named_parameters())
    log = mem.lanes.log
    assert log.index(("submit", "offload")) < log.index(("submit", "reload"))
    assert ("wait", "compute") in log


def test_a_backward_before_the_pack_ran_reads_the_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offload lane held through the whole step: nothing is reloaded, the backward reads the held sources, and
    released groups stay held until their pack has run (then the next step drains them)."""
    ref = _reference()
    count = Counting(monkeypatch)
    count.gate = threading.Event()
    m = Stage()
    mem = _memory(m, "offload")
    mem.lanes = CopyLanes(torch.device("cpu"), threaded=True, wait_to_settle=False)
    try:
        _run(mem, m)
        assert count.unpacks == 0 and len(mem._draining) == MBS
        count.gate.set()
        mem.begin_step(training=True)  # drains the lanes
        assert mem._draining == []
    finally:
        count.gate.set()
        mem.close()
    assert all(torch.equal(p.grad, ref[n]) for n, p in m.named_parameters())


def test_a_reload_job_waits_for_the_offload_event_it_follows() -> None:
    lanes = CopyLanes(torch.device("cpu"))
    gate, order = threading.Event(), []
    try:
        first = lanes.submit("offload", lambda: (gate.wait(10.0), order.append(threading.current_thread().name)))
        second = lanes.submit("reload", lambda: order.append(threading.current_thread().name), after=[first])
        time.sleep(0.05)
        assert not second.done() and order == []
        gate.set()
        lanes.wait(second)
        assert [n.split("_")[0] for n in order] == ["dualpipe-offload", "dualpipe-reload"]
        with pytest.raises(ValueError, match="unknown lane 'h2d'"):
            lanes.submit("h2d", lambda: None)
    finally:
        gate.set()
        lanes.close()


def test_per_step_history_is_bounded() -> None:
    m = Stage()
    mem = _memory(m, "offload")
    for _ in range(HISTORY + 50):
        mem.end_step(mem.begin_step(training=True))
    assert len(mem.peaks) == len(mem.host_bytes) == HISTORY


HAS_GPU = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", ["staging", "mapped"])
@pytest.mark.parametrize("policy", list(TOL))
def test_gpu_paths_two_streams_no_record_stream(monkeypatch: pytest.MonkeyPatch, policy: str, path: str) -> None:
    """On a GPU: both paths give keep's gradients (within the cast's tolerance), one pack / unpack per forward /
    reload, on two side streams that are not the compute stream, without record_stream; nothing stays allocated."""
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_m = Stage().to(dev)
    for x in _inputs():
        ref_m(x.to(dev)).pow(2).sum().backward()
    ref = {n: p.grad.clone() for n, p in ref_m.named_parameters()}

    def no_record_stream(*a: Any, **k: Any) -> None:
        raise AssertionError("record_stream called")

    monkeypatch.setattr(torch.Tensor, "record_stream", no_record_stream)
    count = Counting(monkeypatch)
    m = Stage().to(dev)
    pol = MemoryPolicy.parse(policy)
    mem = ActivationMemory(
        0, {0: MemoryPolicy(pol.kind, pol.fmt, min_bytes=0, offload_path=path)}, ACTIONS, {0: m}, dev
    )
    xs = [x.to(dev) for x in _inputs()]
    try:
        for _ in range(2):
            m.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            sm = mem.begin_step(training=True)
            outs: dict[int, torch.Tensor] = {}
            for i, a in enumerate(ACTIONS):
                if i in mem.plan.reload_at:
                    mem.at_action(sm, i)
                if a.type.value == "F":
                    with mem.saving(sm, 0, a.microbatch, [xs[a.microbatch]], None):
                        outs[a.microbatch] = m(xs[a.microbatch])
                else:
                    mem.before_backward(sm, 0, a.microbatch)
                    outs.pop(a.microbatch).pow(2).sum().backward()
                    mem.release(sm, 0, a.microbatch)
            mem.end_step(sm)
            mem.lanes.drain()
            torch.cuda.synchronize()
            grads = sum(p.grad.numel() * p.grad.element_size() for p in m.parameters())
            assert torch.cuda.memory_allocated() <= base + grads, "sources, staging or reloads outlived the step"
            worst = max(((p.grad - ref[n]).abs().max() / ref[n].abs().max()).item() for n, p in m.named_parameters())
            assert worst <= max(TOL[policy], 1e-6), f"{policy} via {path}: off by {worst:.3g}"
        streams = mem.lanes._streams
        assert set(streams) == {"offload", "reload"}
        assert streams["offload"] != streams["reload"] and torch.cuda.current_stream() not in streams.values()
    finally:
        mem.close()
    assert len(count.packs) == 2 * MBS and count.unpacks <= 2 * MBS
    assert mem.offload_packs == 2 * MBS and mem.reload_unpacks == count.unpacks
