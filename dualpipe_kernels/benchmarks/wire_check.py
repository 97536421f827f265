"""wire_check: the GPU wire, checked on one GPU (bench/device_check.sh's ``wire`` step).

Two ranks on GPU 0 (gloo group; the wire is the transport named: ``native`` = the CUDA IPC engine,
``auto``), DualPipeV over small MLP stages, three training steps:

* step 1 against one process running the same micro-batches in the schedule's order
  (``runtime.reference.run_reference``): every loss and gradient ``torch.equal``;
* step 3 under ``torch.profiler`` (CPU and CUDA): the synchronizing CUDA calls
  (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``) and device-to-host copies,
  counted in the whole step and inside the message path (the profiler ranges of SEND/RECV actions).

``python -m dualpipe_kernels.benchmarks.wire_check --transports native,auto`` prints one JSON object; ``--dry``
checks the arguments and prints what it would run (for machines without a GPU); ``--device cpu`` runs the
same on CPU (its test: tests/process/test_wire_check.py).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

_SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
_COMM = re.compile(r"(SEND|RECV)_[FB]")
WIDTH, MICROBATCHES, STEPS = 64, 8, 3


def _stages(schedule: Any, rank: int, device: Any) -> dict[int, Any]:
    import torch

    out = {}
    for s in schedule.stages_of_rank(rank):
        torch.manual_seed(100 + schedule.model_stage[s])
        out[s] = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()).to(device)
    return out


def _criterion(out: Any, y: Any) -> Any:
    return ((out - y) ** 2).mean()


def _counts(prof: Any) -> dict[str, int]:
    """Synchronizing calls and D2H copies in the profiled step; those inside SEND/RECV action ranges."""
    events = list(prof.events())
    comm = [(e.time_range.start, e.time_range.end, e.thread) for e in events if _COMM.search(e.name or "")]

    def in_comm(e: Any) -> bool:
        return any(s <= e.time_range.start and e.time_range.end <= t and e.thread == th for s, t, th in comm)

    syncs = [e for e in events if e.name in _SYNC]
    d2h = [e for e in events if "DtoH" in (e.name or "") or "Device -> Pinned" in (e.name or "")]
    return {
        "syncs_in_step": len(syncs),
        "syncs_on_message_path": sum(in_comm(e) for e in syncs),
        "d2h_in_step": len(d2h),
        "d2h_on_message_path": sum(in_comm(e) for e in d2h),
        "message_path_ranges": len(comm),
    }


def _rank(rank: int, world: int, transport: str, device: str) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from dualpipe_kernels.runtime import Pipeline
    from dualpipe_kernels.runtime.reference import run_reference
    from dualpipe_kernels.schedules.generators import build_schedule

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sched = build_schedule("dualpipev", world, MICROBATCHES)
    modules = _stages(sched, rank, dev)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2 * MICROBATCHES, WIDTH, generator=g).to(dev)
    y = torch.randn(2 * MICROBATCHES, WIDTH, generator=g).to(dev)
    pipe = Pipeline(sched, modules, transport=transport, device=dev, timeout_s=60.0)
    out: dict[str, Any] = {"transport_used": pipe.transport_name}
    first = pipe.step(x, labels=(y,), criterion=_criterion)
    grads = {f"{s}.{n}": p.grad.detach().clone() for s, m in modules.items() for n, p in m.named_parameters()}
    # one process, the whole schedule's micro-batches in its order, from the same initial weights
    ref_modules = {s: m for s, m in _stages(sched, 0, dev).items()}
    for r in range(1, world):
        ref_modules.update(_stages(sched, r, dev))
    ref_losses = run_reference(ref_modules, sched, (x,), (y,), _criterion, scale_grads=True)
    out["bit_exact_losses"] = all(torch.equal(first.losses[m], ref_losses[m].detach()) for m in first.losses)
    out["bit_exact_grads"] = all(
        torch.equal(grads[f"{s}.{n}"], p.grad) for s in modules for n, p in ref_modules[s].named_parameters()
    )
    pipe.step(x, labels=(y,), criterion=_criterion)
    sync()
    with profile(activities=activities) as prof:
        pipe.step(x, labels=(y,), criterion=_criterion)
        sync()  # after the step, outside every action range: lets the profiler see the copies
    out.update(_counts(prof))
    pipe.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wire_check", description=__doc__.splitlines()[0])
    p.add_argument("--transports", default="native,auto", help="comma list of transports (default native,auto)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the same run on CPU (a test)")
    p.add_argument("--dry", action="store_true", help="check the arguments, print what would run, exit 0")
    args = p.parse_args(argv)
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    bad = [t for t in transports if t not in ("auto", "native", "torch")]
    if not transports or bad:
        p.error(f"--transports: expected auto, native or torch, got {args.transports!r}")
    if args.dry:
        print(json.dumps({"dry": True, "would_run": transports, "ranks": 2, "device": args.device}))
        return 0
    from dualpipe_kernels.runtime.launch import spawn_outcomes

    result: dict[str, Any] = {}
    for t in transports:
        outcomes = spawn_outcomes(_rank, 2, t, args.device, timeout_s=120.0)
        result[t] = [o.value if o.ok else {"error": str(o.error)} for o in outcomes]
    print(json.dumps(result, indent=2, default=str))
    ok = all(
        "error" not in r and r["bit_exact_losses"] and r["bit_exact_grads"] for rs in result.values() for r in rs
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
