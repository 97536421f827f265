"""Driver of the clean-exit test: many 2-rank runs whose step fails over the torch transport.

``python failing_exits.py RUNS PARALLEL`` prints one JSON line: the exit status
of every rank process (``os.waitstatus_to_exitcode``: negative = killed by that
signal).  torch and the package are imported once here and each rank is a
``fork`` of this process, so a run costs a process group and a step, not an
import; every child still leaves through the interpreter's normal finalization
(``sys.exit``), where the abort this test is about happened.  In each run rank
1's stage raises on its second forward; rank 0 fails naming its peer.  Even
runs close the pipeline, odd runs leave it open (the transport's exit hook).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from dualpipe_kernels.runtime import Pipeline
from dualpipe_kernels.runtime.launch import free_port
from dualpipe_kernels.schedules.generators import build_schedule

TIMEOUT_S = 10.0  # every wait of the step; the failure reaches the peer long before


class FailingStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("stage failed on purpose")
        return self.lin(x)


def rank_main(rank: int, port: int, close: bool) -> int:
    """One rank of one run; returns the exit code (1: the step failed, as it must)."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    module = FailingStage() if rank == 1 else nn.Linear(4, 4)
    pipe = Pipeline(build_schedule("1f1b", 2, 4), [module], transport="torch", timeout_s=TIMEOUT_S)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    try:
        pipe.step(x, labels=(y,), criterion=lambda out, label: ((out - label) ** 2).mean())
    except RuntimeError:
        if close:
            pipe.close()
        return 1
    return 0


def main(runs: int, parallel: int) -> list[int]:
    torch.set_num_threads(1)
    # autograd imports hundreds of modules on its first backward: do it once here, not in every child
    nn.Linear(4, 4)(torch.randn(2, 4)).sum().backward()
    statuses: list[int] = []
    for start in range(0, runs, parallel):
        pids = []
        for run in range(start, min(runs, start + parallel)):
            port = free_port()
            for rank in (0, 1):
                pid = os.fork()
                if pid == 0:
                    # The child leaves through SystemExit and interpreter finalization, as a user's script does.
                    sys.exit(rank_main(rank, port, close=run % 2 == 0))
                pids.append(pid)
        statuses += [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    return statuses


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))))
