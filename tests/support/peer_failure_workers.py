"""Rank functions of tests/process/test_peer_failures.py (module level: spawned ranks import them by name)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
from torch import nn

from dualpipe_kernels.runtime import Pipeline
from dualpipe_kernels.runtime.options import DiagnosticsOptions, WireOptions
from dualpipe_kernels.schedules.generators import build_schedule

WAIT_S = 60.0  # every wait of a step: a failure that reaches the peers only through it would take this long


class Stage(nn.Module):
    """A linear stage; ``fail_on`` forward calls raise (as a user's bad batch or an OOM would)."""

    def __init__(self, fail_on: int | None = None, die_on: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.calls = 0
        self.fail_on, self.die_on = fail_on, die_on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("stage failed on purpose")
        if self.calls == self.die_on:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tanh(self.lin(x))


def _pipe(rank: int, world: int, stage: Stage, transport: str) -> Pipeline:
    sched = build_schedule("1f1b", ranks=world, microbatches=2 * world)
    return Pipeline(
        sched,
        [stage],
        wire=WireOptions(transport=transport, timeout_s=WAIT_S),
        diagnostics=DiagnosticsOptions(liveness_s=20.0),
    )


def raise_and_live_on(rank: int, world: int, transport: str) -> dict[str, Any]:
    """Rank 1's stage raises in the second step; its process catches it and lives on (sleeping)."""
    pipe = _pipe(rank, world, Stage(fail_on=world * 2 + 1 if rank == 1 else None), transport)
    x, y = torch.randn(4 * world, 8), torch.randn(4 * world, 8)
    loss = nn.functional.mse_loss
    pipe.step(x, labels=(y,), criterion=loss)  # a good step first: the failure is not at the first message
    t0 = time.monotonic()
    try:
        pipe.step(x, labels=(y,), criterion=loss)
        return {"error": None, "after_s": time.monotonic() - t0}
    except Exception as exc:  # noqa: BLE001 - the user's code catches it and the process lives on
        err = {"error": f"{type(exc).__name__}: {exc}", "after_s": time.monotonic() - t0}
    if rank == 1:
        time.sleep(10.0)  # alive and quiet: its peers must not wait for its death or their timeout
    pipe.close()
    return err


def one_killed(rank: int, world: int, transport: str) -> dict[str, Any]:
    """Rank 2 of 4 is killed (SIGKILL) in the second step; every other rank names it."""
    pipe = _pipe(rank, world, Stage(die_on=world * 2 + 1 if rank == 2 else None), transport)
    x, y = torch.randn(4 * world, 8), torch.randn(4 * world, 8)
    loss = nn.functional.mse_loss
    pipe.step(x, labels=(y,), criterion=loss)
    t0 = time.monotonic()
    try:
        pipe.step(x, labels=(y,), criterion=loss)
        return {"error": None, "after_s": time.monotonic() - t0}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "after_s": time.monotonic() - t0}


def reduce_loss_mismatch(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 asks for reduce_loss, rank 1 does not (and goes on to its next step)."""
    sched = build_schedule("1f1b", ranks=world, microbatches=2 * world)
    # rank 0 gives up first: its failure, not rank 1's own timeout, must end rank 1's wait
    pipe = Pipeline(sched, [Stage()], wire=WireOptions(transport="torch", timeout_s=5.0 if rank == 0 else 60.0))
    x, y = torch.randn(4 * world, 8), torch.randn(4 * world, 8)
    t0 = time.monotonic()
    try:
        for _ in range(2):
            pipe.step(x, labels=(y,), criterion=nn.functional.mse_loss, reduce_loss=rank == 0)
        return {"error": None, "after_s": time.monotonic() - t0}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "after_s": time.monotonic() - t0}
    finally:
        pipe.close()
