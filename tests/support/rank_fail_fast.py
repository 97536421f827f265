"""Rank functions of the fail-fast tests (tests/process/test_fail_fast.py): mistakes caught at Pipeline construction.

:func:`fail_fast_cases` runs each case of ``CASES`` on 2 ranks, each on a fresh
process group, with a long pipeline timeout (``TIMEOUT_S``, 60 s): what is
checked is that every rank fails in far less than that.  :func:`error_cases`
runs these and the bad-input cases of tests/process/test_runtime_errors.py in one spawn
(process start costs seconds, a case milliseconds).
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dualpipe_kernels.schedules.generators import build_schedule
from dualpipe_kernels.schedules.ir import Schedule, parse_actions

#: every wait of a fail-fast case: no case may come near it
TIMEOUT_S = 60.0

#: the cases, in run order; see :func:`_case`
CASES = (
    "b_before_f",
    "deleted_backward",
    "deadlock",
    "disagree_microbatches",
    "disagree_schedule",
    "disagree_transport",
    "disagree_inline_limit",
    "disagree_memory_policy",
    "meta_stage",
    "criterion_without_labels",
)


def with_actions(schedule: Schedule, rank_lists: Sequence[str]) -> Schedule:
    """``schedule`` with every rank's action list replaced (compact notation, one string per rank)."""
    return dataclasses.replace(schedule, actions=[parse_actions(text) for text in rank_lists])


def broken_schedule(case: str) -> Schedule:
    """A 2-rank, 2-micro-batch 1F1B broken the way ``case`` says (the validator rejects each)."""
    base = build_schedule("1f1b", 2, 2)  # rank 0: 0F0 0F1 0B0 0B1; rank 1: 1F0 1B0 1F1 1B1
    if case == "b_before_f":  # rank 1 runs 1B0 before 1F0: wrong gradients if it ran
        return with_actions(base, ["0F0 0F1 0B0 0B1", "1B0 1F0 1F1 1B1"])
    if case == "deleted_backward":  # 1B1 is missing: micro-batch 1 never gets its gradient
        return with_actions(base, ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1"])
    if case == "deadlock":  # rank 0 waits for 1B0's gradient before sending 1F1's input, rank 1 the reverse
        return with_actions(base, ["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"])
    raise ValueError(f"not a broken-schedule case: {case!r}")


def _mse(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((out - label) ** 2).mean()


def _case(rank: int, case: str, group: Any, timeout_s: float) -> None:
    """Build (and, where construction passes, step) what ``case`` says; returns only if nothing raised."""
    from dualpipe_kernels.runtime import Pipeline

    transport = "torch"
    if case in ("b_before_f", "deleted_backward", "deadlock"):
        schedule = broken_schedule(case)
    elif case == "disagree_microbatches":
        schedule = build_schedule("1f1b", 2, 4 if rank == 0 else 6)
    elif case == "disagree_schedule":
        schedule = build_schedule("1f1b" if rank == 0 else "gpipe", 2, 4)
    elif case == "disagree_transport":
        schedule, transport = build_schedule("1f1b", 2, 4), ("torch" if rank == 0 else "native")
    else:
        schedule = build_schedule("1f1b", 2, 4)
    stage = nn.Linear(4, 4, device="meta") if case == "meta_stage" else nn.Linear(4, 4)
    if case == "disagree_inline_limit":  # the same transport kind, reporting another limit on each rank
        owned = _Inline(group, 65536 if rank == 0 else 0, timeout_s)
        try:
            Pipeline(schedule, [stage], group=group, transport=owned, timeout_s=timeout_s).close()
        finally:
            owned.close()
        return
    if case == "disagree_memory_policy":  # the whole model's per-stage policies, stage 0's different on rank 1
        policy = {0: "recompute" if rank == 0 else "keep", 1: "keep"}
        Pipeline(schedule, [stage], group=group, transport=transport, timeout_s=timeout_s, memory_policy=policy).close()
        return
    pipe = Pipeline(schedule, [stage], group=group, transport=transport, timeout_s=timeout_s)
    try:
        x, y = torch.randn(8, 4), torch.randn(8, 4)
        labels = () if case == "criterion_without_labels" else (y,)
        pipe.step(x, labels=labels, criterion=_mse)
    finally:
        pipe.close()


def _Inline(group: Any, nbytes: int, timeout_s: float) -> Any:  # noqa: N802 - builds the class below
    """A torch transport that says it takes whole messages of ``nbytes`` (a promise broken across ranks)."""
    from dualpipe_kernels.transport.torch_dist import TorchDistTransport

    class Inline(TorchDistTransport):
        @property
        def message_inline_bytes(self) -> int:
            return nbytes

    return Inline(group, timeout_s=timeout_s)


def fail_fast_cases(rank: int, world_size: int, cases: Sequence[str], timeout_s: float) -> dict[str, Any]:
    """Rank function: ``{case: {"error": traceback or None, "type": exception class name, "elapsed_s": s}}``."""
    out: dict[str, Any] = {}
    for case in cases:
        group = dist.new_group(list(range(world_size)))
        t0 = time.monotonic()
        err: str | None = None
        kind: str | None = None
        try:
            _case(rank, case, group, timeout_s)
        except Exception as exc:  # noqa: BLE001 - the point of the test
            err, kind = traceback.format_exc(), type(exc).__name__
        out[case] = {"error": err, "type": kind, "elapsed_s": time.monotonic() - t0}
        dist.barrier()  # on the default group, untouched by the cases
    return out


def error_cases(
    rank: int, world_size: int, bad_input_cases: Sequence[str], bad_input_timeout_s: float
) -> dict[str, dict[str, Any]]:
    """Rank function: ``{"bad_inputs": rank_lifecycle.bad_inputs(...), "fail_fast": fail_fast_cases(...)}``."""
    from rank_lifecycle import bad_inputs

    return {
        "bad_inputs": bad_inputs(rank, world_size, bad_input_cases, bad_input_timeout_s),
        "fail_fast": fail_fast_cases(rank, world_size, CASES, TIMEOUT_S),
    }
