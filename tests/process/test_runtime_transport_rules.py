"""The runtime obeys the rules a GPU transport imposes, checked on CPU.

One spawned 2-rank group runs several schedules, two steps each (the second
takes the speculative-receive path), through the real ``Pipeline`` with:

- ``device_kind``: a transport that, like the CUDA IPC binding, refuses every
  tensor not on its device, while torch's default device is "meta" (on a GPU
  the default device, cpu, is not the pipeline's either).  Before the fix the
  runtime posted default-device metadata and placeholders and failed at the
  first post;
- ``rendezvous``: a transport whose sends complete only once the peer posted
  the matching receive (what a CUDA IPC send of >= 1 MiB does), so any wait on
  a send that comes before posting the receive it depends on deadlocks (and
  times out after ``PIPELINE_TIMEOUT_S``).

Each run's losses must equal, bit for bit, those of the same run over the
plain torch transport.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fake_transports import DeviceKindTransport, RendezvousTransport
from toy_models import (
    DIM,
    VOCAB,
    RunConfig,
    build_schedule_for,
    example_criterion,
    make_all_stages,
    make_stage,
    make_tensors,
    rich_criterion,
)

from dualpipe_kernels import compat
from dualpipe_kernels.runtime import Pipeline, spawn
from dualpipe_kernels.schedules.generators import build_schedule
from dualpipe_kernels.transport import Transport
from dualpipe_kernels.transport.torch_dist import TorchDistTransport

SCHEDULES = ["1f1b", "gpipe", "zb1p", "dualpipev", "dualpipe"]
VARIANTS = ["device_kind", "rendezvous"]
MICROBATCHES = 4
PIPELINE_TIMEOUT_S = 20.0


def _batch(step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    n = 2 * MICROBATCHES
    x = torch.randn(n, DIM, generator=g)
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    return (x, ids, torch.randn(n, DIM, generator=g)), torch.randn(n, DIM, generator=g)


def _losses(rank: int, name: str, transport: Transport, default_device: str | None) -> list[list[torch.Tensor]]:
    sched = build_schedule(name, 2, MICROBATCHES)
    modules = {s: make_stage("rich", sched.model_stage[s]) for s in sched.stages_of_rank(rank)}
    batches = [_batch(step) for step in range(2)]
    out = []
    torch.set_default_device(default_device)
    try:
        pipe = Pipeline(sched, modules, transport=transport, timeout_s=PIPELINE_TIMEOUT_S)
        for inputs, labels in batches:
            res = pipe.step(*inputs, labels=(labels,), criterion=rich_criterion)
            out.append([res.losses[m] for m in sorted(res.losses)])
        pipe.close()
    finally:
        torch.set_default_device(None)
    return out


def _compat_loss(rank: int, transport: Transport, default_device: str | None) -> torch.Tensor | None:
    """The reference's API (compat.DualPipeV, 6 chunks) through ``transport``; rank 0's loss."""
    cfg = RunConfig("dualpipev", 2, 6, api="compat", model="example")
    stages = make_all_stages(cfg, build_schedule_for(cfg))
    x, label = make_tensors(cfg.model, cfg.rows, cfg.seed + 1)
    feeds = rank == 0
    torch.set_default_device(default_device)
    try:
        model = compat.DualPipeV((stages[rank], stages[3 - rank]), transport=transport)
        loss, _ = model.step(
            *(x if feeds else (None,)),
            num_chunks=6,
            criterion=example_criterion,
            labels=label if feeds else (None,),
        )
        model.close()
    finally:
        torch.set_default_device(None)
    return loss


def _worker(rank: int, world: int) -> dict[str, str]:
    plain = TorchDistTransport(timeout_s=PIPELINE_TIMEOUT_S)
    acks = TorchDistTransport(dist.new_group(backend="gloo"), timeout_s=PIPELINE_TIMEOUT_S)
    variants: dict[str, tuple[Transport, str | None]] = {
        "device_kind": (DeviceKindTransport(plain, "cpu"), "meta"),
        "rendezvous": (RendezvousTransport(plain, acks), None),
    }
    results: dict[str, str] = {}
    for name in SCHEDULES:
        expected = _losses(rank, name, plain, None)
        for variant, (transport, default_device) in variants.items():
            try:
                got = _losses(rank, name, transport, default_device)
                pairs = [ab for ga, gb in zip(got, expected, strict=True) for ab in zip(ga, gb, strict=True)]
                same = all(torch.equal(a, b) for a, b in pairs)
                results[f"{variant}/{name}"] = "ok" if same else f"losses differ: {got} vs {expected}"
            except Exception:  # noqa: BLE001 - reported per case
                results[f"{variant}/{name}"] = traceback.format_exc()
            dist.barrier()
    expected_loss = _compat_loss(rank, plain, None)
    for variant, (transport, default_device) in variants.items():
        try:
            loss = _compat_loss(rank, transport, default_device)
            same = (loss is None and expected_loss is None) or torch.equal(loss, expected_loss)
            results[f"{variant}/compat"] = "ok" if same else f"loss {loss} vs {expected_loss}"
        except Exception:  # noqa: BLE001 - reported per case
            results[f"{variant}/compat"] = traceback.format_exc()
        dist.barrier()
    plain.close()
    acks.close()
    return results


@pytest.fixture(scope="module")
def rule_results() -> list[dict[str, str]]:
    return spawn(_worker, 2, timeout_s=240)


@pytest.mark.parametrize("schedule", [*SCHEDULES, "compat"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_runtime_obeys_gpu_transport_rules(rule_results: list[dict[str, str]], variant: str, schedule: str) -> None:
    case = f"{variant}/{schedule}"
    for rank, res in enumerate(rule_results):
        assert res[case] == "ok", f"rank {rank}, {case}:\n{res[case]}"


def test_device_kind_transport_refuses_like_the_cuda_binding() -> None:
    """The fake is strict: a host tensor offered to a transport on another device is refused, naming both."""

    class _Never(Transport):
        rank = 0

        def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Any:
            raise AssertionError("must not be reached")

        irecv = isend

    t = DeviceKindTransport(_Never(), "meta")
    with pytest.raises(ValueError, match=r"rank 0: meta data: tensor must be a meta tensor on meta, got one on cpu"):
        t.isend(torch.zeros(2, device="cpu"), 1, 0, "meta data")
