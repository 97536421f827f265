"""Our compute_comms CSV run by torch's own ``_PipelineScheduleRuntime`` on 2 processes, and torch's dump read back.

Each rank wraps the stage modules ``build_stage_modules`` gives in torch
``PipelineStage``s, loads the CSV ``to_csv(lower_comms(s), include_comms=True)``
wrote (``format="compute_comms"``: torch runs it as written) and takes one step.
Its gradients equal the full batch's mean-loss gradients within a relative
error of 1e-6 (the file's REDUCE_GRAD makes torch divide by N; without it they
would be N x too large; not bit-exact: the full batch reduces over all rows at
once).  Rank 0 also has torch lower our compute-only CSV and dump it with
UNSHARD/RESHARD/REDUCE_GRAD; ``load_csv`` reads that dump.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from toy_models import make_tensors, mse_criterion, seeded_layer

from dualpipe_kernels.runtime import build_stage_modules, spawn
from dualpipe_kernels.schedules import build_schedule, load_csv, lower_comms, to_csv, validate

LAYERS, ROWS, N = 4, 16, 4  # layers of toy_models.DIM features
NAMES = ("dualpipev", "zb1p", "zbv")  # zbv: its RECV order differs from the SEND order between its ranks


def _layer(i: int) -> nn.Module:
    return seeded_layer(50 + i)  # seeded by index: every rank builds the same layer i


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    (x,), (t,) = make_tensors("toy", ROWS, seed=3)
    return x, t


def _runtime(sched: Any, rank: int) -> tuple[Any, dict[int, Any]]:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    mods = build_stage_modules(sched, _layer, num_layers=LAYERS, rank=rank)
    stages = [PipelineStage(mods[s], s, sched.num_stages, torch.device("cpu")) for s in sorted(mods)]
    return _PipelineScheduleRuntime(stages, N, loss_fn=mse_criterion, scale_grads=True), mods


def _worker(rank: int, world: int, csv_dir: str) -> dict[str, Any]:
    return {name: _run(rank, world, name, csv_dir) for name in NAMES}


def _run(rank: int, world: int, name: str, csv_dir: str) -> dict[str, Any]:
    sched = build_schedule(name, world, N)
    rt, mods = _runtime(sched, rank)
    rt._load_csv(f"{csv_dir}/{name}_comms.csv", format="compute_comms")
    x, t = _batch()
    first, last = 0 in mods, sched.num_stages - 1 in mods
    losses: list[torch.Tensor] = []
    rt.step(*((x,) if first else ()), target=t if last else None, losses=losses if last else None)
    out: dict[str, Any] = {m.full_name(k): p.grad.clone() for m in mods.values() for k, p in m.named_parameters()}
    if rank == 0:
        dump, _ = _runtime(sched, rank)
        dump._load_csv(f"{csv_dir}/{name}_compute.csv", format="compute_only")
        dump._dump_csv(f"{csv_dir}/{name}_torch_dump.csv", format="compute_comms")
    return out


@pytest.fixture(scope="module")
def csv_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One spawn for every schedule: the CSVs written here, the ranks' gradients."""
    path = tmp_path_factory.mktemp("csv")
    for name in NAMES:
        sched = build_schedule(name, 2, N)
        to_csv(lower_comms(sched), path / f"{name}_comms.csv", include_comms=True)
        to_csv(sched, path / f"{name}_compute.csv")
    return path, spawn(_worker, 2, str(path), timeout_s=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
def test_torch_runtime_runs_our_compute_comms_csv(csv_dir: tuple[Path, list[dict[str, Any]]], name: str) -> None:
    tmp_path, ranks = csv_dir
    sched = build_schedule(name, 2, N)
    got = {**ranks[0][name], **ranks[1][name]}
    full = nn.Sequential(*[_layer(i) for i in range(LAYERS)])
    x, t = _batch()
    mse_criterion(full(x), t).backward()
    for k, p in full.named_parameters():
        rel = float((got[k] - p.grad).norm() / p.grad.norm())
        assert rel <= 1e-6, f"{name} {k}: torch's runtime on our CSV is off by {rel:.2e} (N x would be {N - 1})"
    dumped = (tmp_path / f"{name}_torch_dump.csv").read_text()
    assert "REDUCE_GRAD" in dumped  # torch's own dump, with its extra per-stage actions
    loaded = load_csv(tmp_path / f"{name}_torch_dump.csv", name=name)
    assert loaded.lowered and [[str(a) for a in r if a.is_compute] for r in loaded.actions] == [
        [str(a) for a in r] for r in sched.actions
    ]
    validate(loaded)


@pytest.mark.parametrize("name", ["zbv", "dualpipev", "zb1p", "1f1b", "interleaved1f1b", "gpipe"])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_compute_comms_rows_receive_in_the_order_the_peer_sends(name: str, ranks: int) -> None:
    """torch posts transfers untagged: between two ranks the k-th RECV must be the peer's k-th SEND to it."""
    from dualpipe_kernels.schedules.csv_io import schedule_from_rows, schedule_to_rows

    sched = lower_comms(build_schedule(name, ranks, 4 * ranks))
    rows = schedule_to_rows(sched, include_comms=True)
    loaded = schedule_from_rows(rows, name=name)
    validate(loaded)  # still complete and deadlock-free
    sent: dict[tuple[int, int], list[str]] = {}
    got: dict[tuple[int, int], list[str]] = {}
    for r, acts in enumerate(loaded.actions):
        for a in acts:
            if a.type.value.startswith("SEND"):
                sent.setdefault((r, a.peer), []).append(f"{a.type.value[-1]}{a.microbatch}")
            elif a.type.value.startswith("RECV"):
                got.setdefault((a.peer, r), []).append(f"{a.type.value[-1]}{a.microbatch}")
    assert sent == got
