"""memory_gpu: step time and device-resident activation memory of each memory policy on a GPU.

``--ranks`` rank processes (default 4, the issue's 4 ranks x 16 micro-batches;
on one GPU they share it, else rank r uses GPU r mod count) run DualPipeV over
real GPU compute, sending through ``--transport`` (native: the CUDA IPC engine): each chunk is ``depth`` layers of
``tanh(h @ W)`` on one ``[rows, cols]`` block, so every layer saves one block and
its matrix product is what the offload copies must hide behind.

Measured honestly: every weight gradient is allocated (zeros) before the first
step and zeroed in place after each, so the baseline taken before a step
already holds them and a step's peaks above it are activations, reloads,
staging and workspace, not ~gradients.  Per policy (keep, offload and
offload:fp8 by both GPU paths, ``@mapped`` = packed straight into the pinned
arena, recompute, compress:fp8), busiest rank unless said:

* ``peak_saved_bytes``: the runtime's accounting of device-resident saved bytes,
  beside the simulator's ``predicted_peak_saved_bytes`` (schedules/memory_model.py
  on the measured per-stage bytes);
* ``peak_alloc_bytes`` / ``peak_reserved_bytes`` / ``peak_active_bytes``: above the
  step's start, ``torch.cuda.max_memory_allocated``, ``max_memory_reserved`` and
  ``memory_stats()["active_bytes.all.peak"]``, each beside a prediction (keep's
  measured peak minus keep's accounted saved bytes plus the policy's predicted ones);
* ``host_bytes``: bytes copied to the host arena per step, beside the model's;
* ``step_s``: median step time of the slowest rank (min, max beside it), beside
  ``predicted_step_s``: the simulator on keep's in-situ per-action costs (fitted to
  keep's step, as bench memory does) plus the policy's modelled extra, with the
  host link's bandwidth and the fp8 cast's cost per byte measured on this GPU.

Steps of the policies take turns, so a change in the machine's state reaches
every policy alike.  ``bit_exact``: every weight gradient equals keep's (the
lossy casts are compared by their loss).

Targets (reported, not asserted): offload accounted bytes <= 0.5 of keep's,
allocated peak <= 0.7 of keep's, step <= 1.05 of keep's; offload:fp8 step <= 1.03.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

NAME = "memory_gpu"
POLICIES = ("keep", "offload", "offload@mapped", "offload:fp8", "offload:fp8@mapped", "recompute", "compress:fp8")
TARGETS = {"offload": 0.50, "offload:fp8": 0.50, "recompute": 0.40, "compress:fp8": 0.30}  # of keep's saved peak
ALLOC_TARGETS = {"offload": 0.70}  # allocated peak over keep's (reported)
STEP_TARGETS = {"offload": 1.05, "offload:fp8": 1.03}  # step time over keep's (reported, not asserted)


def memory_policy(name: str) -> Any:
    """The runtime policy of a bench name: a policy, or an offload with ``@mapped`` (its GPU path)."""
    from dualpipe_kernels.runtime.memory_plan import MemoryPolicy

    base, at, path = name.partition("@")
    pol = MemoryPolicy.parse(base)
    if not at:
        return pol
    if pol.kind != "offload":
        raise ValueError(f"memory_gpu bench: {name!r}: only an offload policy takes a path (@staging, @mapped)")
    return MemoryPolicy(pol.kind, pol.fmt, pol.min_bytes, pol.lookahead, offload_path=path)


def _base(name: str) -> str:
    return name.partition("@")[0]


__all__ = ["NAME", "GpuMemoryConfig", "add_arguments", "run", "to_markdown", "unavailable"]


def unavailable() -> str | None:
    """None when this machine can run the suite, else a one-line reason."""
    if not torch.cuda.is_available():
        return "needs CUDA: no CUDA GPU is visible (torch.cuda.is_available() is False)"
    return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=None, help="rank processes (default 4; quick 2)")
    p.add_argument("--microbatches", type=int, default=None, help="default 16; quick 8")
    p.add_argument("--rows", type=int, default=None, help="rows of one activation block (default 4096; quick 2048)")
    p.add_argument("--cols", type=int, default=None, help="columns = weight size (default 4096; quick 2048)")
    p.add_argument("--depth", type=int, default=4, help="saved layers per chunk (default 4)")
    p.add_argument("--steps", type=int, default=None, help="timed steps after one warm-up (default 5; quick 3)")
    p.add_argument(
        "--policies", default=None, help=f"comma list (default {','.join(POLICIES)}); keep and recompute always run"
    )
    p.add_argument("--transport", default="auto", choices=("auto", "torch", "native"))
    p.add_argument("--timeout", type=float, default=300.0, help="whole run, seconds (a wait inside: a tenth)")


@dataclass(frozen=True)
class GpuMemoryConfig:
    microbatches: int
    rows: int
    cols: int
    depth: int
    steps: int
    policies: tuple[str, ...]
    transport: str = "auto"
    ranks: int = 2
    device: str = "cuda"  # "cpu" only for the suite's own tests on a machine without a GPU
    timeout_s: float = 300.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GpuMemoryConfig:
        from dualpipe_kernels.benchmarks.common import comma_names, option

        names = comma_names(getattr(args, "policies", None), POLICIES, "policy", NAME)
        for n in names:
            memory_policy(n)  # a bad name fails here, in one line
        cfg = cls(
            microbatches=int(option(args, "microbatches", 16, 8)),
            rows=int(option(args, "rows", 4096, 2048)),
            cols=int(option(args, "cols", 4096, 2048)),
            depth=int(getattr(args, "depth", 4) or 4),
            steps=int(option(args, "steps", 5, 3)),
            # keep and recompute always run: their forwards give the model each chunk's saved and kept bytes
            policies=("keep", *(p for p in names if p != "keep"), *(() if "recompute" in names else ("recompute",))),
            transport=str(getattr(args, "transport", "auto") or "auto"),
            ranks=int(option(args, "ranks", 4, 2)),
            device=str(getattr(args, "device", "cuda") or "cuda"),
            timeout_s=float(getattr(args, "timeout", 300.0) or 300.0),
        )
        if cfg.ranks < 2 or cfg.ranks % 2:
            raise ValueError(f"memory_gpu bench needs an even number of ranks >= 2 (DualPipeV); got {cfg.ranks}")
        if cfg.microbatches < 2 * cfg.ranks or min(cfg.rows, cfg.cols, cfg.depth, cfg.steps) < 1:
            raise ValueError(f"memory_gpu bench needs microbatches >= 2 x ranks and positive sizes; got {cfg}")
        return cfg


class DenseChunk(nn.Module):
    """``depth`` layers of ``tanh(h @ W)``: each saves its ``[rows, cols]`` input for the backward."""

    def __init__(self, cols: int, depth: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(cols, cols, generator=g) / cols**0.5) for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for w in self.weights:
            h = torch.tanh(h @ w)
        return h


def _criterion(out: torch.Tensor, *labels: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _link_and_cast(dev: torch.device) -> tuple[float, float]:
    """(pinned device -> host bytes per second, fp8 pack + unpack seconds per fp32 byte) on ``dev``."""
    import time

    from dualpipe_kernels.kernels import pack, unpack

    src = torch.randn(16 << 20, device=dev)  # 64 MiB
    host = torch.empty(src.numel() * 4, dtype=torch.uint8, pin_memory=True)
    flat = src.view(torch.uint8)
    ts, cs = [], []
    for _ in range(4):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        host.copy_(flat, non_blocking=True)
        torch.cuda.synchronize(dev)
        t1 = time.perf_counter()
        buf, layout = pack([src], dtype=torch.float8_e4m3fn)
        unpack(buf, layout)
        torch.cuda.synchronize(dev)
        ts.append(t1 - t0)
        cs.append(time.perf_counter() - t1)
    return flat.numel() / statistics.median(ts[1:]), statistics.median(cs[1:]) / flat.numel()


def _rank(rank: int, world: int, cfg: GpuMemoryConfig) -> dict[str, Any]:
    import sys
    import time

    import torch.distributed as dist

    from dualpipe_kernels.runtime.executor import Pipeline
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.transport import make_transport

    cuda = cfg.device == "cuda"
    dev = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products: bit-exact comparisons between policies

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def stats() -> tuple[int, int, int]:
        """(allocated, reserved, active) bytes now."""
        if not cuda:
            return 0, 0, 0
        active = torch.cuda.memory_stats(dev).get("active_bytes.all.current", 0)
        return torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev), int(active)

    def peaks() -> tuple[int, int, int]:
        if not cuda:
            return 0, 0, 0
        active = torch.cuda.memory_stats(dev).get("active_bytes.all.peak", 0)
        return torch.cuda.max_memory_allocated(dev), torch.cuda.max_memory_reserved(dev), int(active)

    sched = build_schedule("dualpipev", world, cfg.microbatches)
    x = torch.randn(cfg.microbatches * cfg.rows, cfg.cols, generator=torch.Generator().manual_seed(0)).to(dev)
    runs: dict[str, tuple[Any, dict[int, DenseChunk]]] = {}
    wait_s = max(10.0, cfg.timeout_s / 10)  # a stuck transfer raises, naming it, before the run's limit
    keys = ("times", "alloc", "reserved", "active", "losses", "timelines")
    got: dict[str, dict[str, list[Any]]] = {p: {k: [] for k in keys} for p in cfg.policies}
    try:
        for policy in cfg.policies:
            modules = {s: DenseChunk(cfg.cols, cfg.depth, seed=s).to(dev) for s in sched.stages_of_rank(rank)}
            for m in modules.values():  # gradients live before any baseline: a step's peaks are activations
                for p in m.parameters():
                    p.grad = torch.zeros_like(p)
            transport = make_transport(cfg.transport, None, dev)
            pipe = Pipeline(
                sched,
                modules,
                transport=transport,
                memory_policy=memory_policy(policy),
                timeout_s=wait_s,
                record_timeline=True,
            )
            pipe.activation_memory.track = True
            runs[policy] = (pipe, modules)
        for step in range(cfg.steps + 1):
            for policy, (pipe, modules) in runs.items():
                for m in modules.values():
                    m.zero_grad(set_to_none=False)  # in place: the gradients stay allocated
                sync()
                base = stats()
                if cuda:
                    torch.cuda.reset_peak_memory_stats(dev)
                dist.barrier()
                t0 = time.perf_counter()
                res = pipe.step(x, criterion=_criterion)
                sync()
                dt = time.perf_counter() - t0
                if rank == 0:  # progress on stderr: a run cut short still says how far it got
                    sys.stderr.write(f"memory_gpu: step {step}/{cfg.steps} {policy}: {dt:.3f} s\n")
                if step:
                    top = peaks()
                    got[policy]["times"].append(dt)
                    got[policy]["alloc"].append(top[0] - base[0])
                    got[policy]["reserved"].append(top[1] - base[1])
                    got[policy]["active"].append(top[2] - base[2])
                    got[policy]["timelines"].append((res.timeline, res.step_time_s))
                    if res.loss is not None:
                        got[policy]["losses"].append(float(res.loss))
    finally:
        for pipe, _ in runs.values():
            pipe.close()
    link = _link_and_cast(dev) if cuda else (float("inf"), 0.0)
    out: dict[str, Any] = {"link": link}
    for policy, (pipe, modules) in runs.items():
        mem = pipe.activation_memory
        out[policy] = {
            "peak": mem.last_peak_bytes,
            "host_bytes": mem.host_bytes[-1] if mem.host_bytes else 0,
            "forward_bytes": dict(mem.forward_bytes),
            "forward_peak_bytes": dict(mem.forward_peak_bytes),
            "grads": {s: [w.grad.detach().cpu() for w in m.weights] for s, m in modules.items()},
            **got[policy],
        }
    return out


def _peak_of(got: list[dict[str, Any]], what: str) -> int:
    return max(max(r[what]) for r in got)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dualpipe_kernels.runtime.launch import spawn

    cfg = GpuMemoryConfig.from_args(args)
    reason = unavailable() if cfg.device == "cuda" else None
    if reason:
        raise RuntimeError(f"memory_gpu bench: {reason}")
    from dualpipe_kernels.benchmarks.in_situ_costs import fit_latency, in_situ_costs
    from dualpipe_kernels.benchmarks.memory import chunk_sizes
    from dualpipe_kernels.schedules.costs import CommModel
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.schedules.memory_model import predict

    per_rank = spawn(_rank, cfg.ranks, cfg, timeout_s=cfg.timeout_s)
    sched = build_schedule("dualpipev", cfg.ranks, cfg.microbatches)
    n = sched.num_stages
    # chunk sizes come from the plain policies' forwards (keep's saved, recompute's kept) when they ran
    by_policy = {_base(p): [r[p] for r in per_rank] for p in cfg.policies if "@" not in p}
    keep = [r["keep"] for r in per_rank]
    keep_peak = max(r["peak"] for r in keep)
    keep_top = {w: _peak_of(keep, w) for w in ("alloc", "reserved", "active")}
    keep_steps = [max(ts) for ts in zip(*(r["times"] for r in keep), strict=True)]
    keep_step = statistics.median(keep_steps)
    in_situ = in_situ_costs(zip(*(r["timelines"] for r in keep), strict=True), n)
    in_situ = fit_latency(in_situ, sched, keep_step)
    bandwidth = min(r["link"][0] for r in per_rank)
    cast_s = max(r["link"][1] for r in per_rank)
    keep_pred = None
    rows = []
    for policy in cfg.policies:
        base = _base(policy)
        got = [r[policy] for r in per_rank]
        steps = [max(ts) for ts in zip(*(r["times"] for r in got), strict=True)]
        step = statistics.median(steps)
        peak = max(r["peak"] for r in got)
        top = {w: _peak_of(got, w) for w in ("alloc", "reserved", "active")}
        lossless = not (base.startswith("compress") or ":" in base)
        exact = all(
            all(torch.equal(a, b) for a, b in zip(g["grads"][s], k["grads"][s], strict=True))
            for g, k in zip(got, keep, strict=True)
            for s in k["grads"]
        )
        sizes_from = dict(by_policy)
        sizes_from.setdefault(base, got)
        sizes = chunk_sizes(n, base, sizes_from)
        per = cast_s if base in ("offload:bf16", "offload:fp8", "compress:bf16", "compress:fp8") else 0.0
        pred = predict(
            sched,
            base,
            sizes,
            in_situ.cost_model(),
            CommModel(latency=in_situ.latency_s),
            host_bandwidth=bandwidth,
            compress_s_per_byte=per,
            recompute_s=in_situ.forward_s,
        )
        predicted = float(max(pred.peak_saved_bytes))
        if base == "keep":
            keep_pred = predicted
        # the allocator's peaks beyond the saved activations are the policy-independent part of keep's
        beyond = {w: keep_top[w] - keep_peak for w in keep_top}
        loss = statistics.median([v for r in got for v in r["losses"]] or [float("nan")])
        keep_loss = statistics.median([v for r in keep for v in r["losses"]] or [float("nan")])
        pred_step = float(pred.makespan) + in_situ.fixed_s
        rows.append(
            {
                "policy": policy,
                "offload_path": policy.partition("@")[2] or ("staging" if base.startswith("offload") else None),
                "device": torch.cuda.get_device_name(0) if cfg.device == "cuda" else "cpu",
                "peak_saved_bytes": peak,
                "share_of_keep": peak / keep_peak if keep_peak else None,
                "target_share_of_keep": TARGETS.get(base),
                "predicted_peak_saved_bytes": predicted,
                "measured_over_predicted_peak": peak / predicted if predicted else None,
                "peak_alloc_bytes": top["alloc"],
                "peak_reserved_bytes": top["reserved"],
                "peak_active_bytes": top["active"],
                "predicted_peak_alloc_bytes": predicted + beyond["alloc"],
                "predicted_peak_reserved_bytes": predicted + beyond["reserved"],
                "predicted_peak_active_bytes": predicted + beyond["active"],
                "alloc_share_of_keep": top["alloc"] / keep_top["alloc"] if keep_top["alloc"] else None,
                "reserved_share_of_keep": top["reserved"] / keep_top["reserved"] if keep_top["reserved"] else None,
                "active_share_of_keep": top["active"] / keep_top["active"] if keep_top["active"] else None,
                "target_alloc_share_of_keep": ALLOC_TARGETS.get(base),
                "host_bytes": max(r["host_bytes"] for r in got),
                "predicted_host_bytes": float(max(pred.host_bytes, default=0)),
                "step_s": step,
                "step_s_min": min(steps),
                "step_s_max": max(steps),
                "predicted_step_s": pred_step,
                "measured_over_predicted_step": step / pred_step if pred_step else None,
                "step_over_keep": step / keep_step,
                "target_step_over_keep": STEP_TARGETS.get(base),
                "bit_exact": exact if lossless else None,
                "loss_rel_diff": abs(loss - keep_loss) / abs(keep_loss) if keep_loss else None,
            }
        )
    return {
        "rows": rows,
        "config": asdict(cfg),
        "keep_steps_s": keep_steps,
        "keep_in_situ_costs": in_situ.as_dict(),
        "host_bandwidth_bytes_per_s": bandwidth,
        "fp8_cast_s_per_byte": cast_s,
        "keep_predicted_peak_saved_bytes": keep_pred,
    }


def to_markdown(result: dict[str, Any]) -> str:
    from dualpipe_kernels.benchmarks.common import markdown_table

    cfg = result["config"]
    cols = ["policy", "peak_saved_bytes", "share_of_keep", "target_share_of_keep", "predicted_peak_saved_bytes"]
    cols += ["measured_over_predicted_peak", "peak_alloc_bytes", "predicted_peak_alloc_bytes", "alloc_share_of_keep"]
    cols += ["peak_reserved_bytes", "peak_active_bytes", "host_bytes", "predicted_host_bytes"]
    cols += ["step_s", "step_s_min", "step_s_max", "predicted_step_s", "step_over_keep", "target_step_over_keep"]
    cols += ["bit_exact", "loss_rel_diff"]
    heads = ["policy", "peak saved B", "/ keep", "target", "predicted B", "meas/pred", "peak alloc B", "predicted"]
    heads += ["/ keep", "peak reserved B", "peak active B", "host B/step", "predicted"]
    heads += ["step (s)", "min", "max", "predicted (s)"]
    heads += ["/ keep", "target", "bit-exact", "loss rel diff"]
    lines = [
        f"DualPipeV, {cfg['ranks']} ranks x {cfg['microbatches']} micro-batches; chunk = {cfg['depth']} "
        f"x tanh([{cfg['rows']}, {cfg['cols']}] @ W) fp32, gradients allocated before the baseline.  Peak saved: "
        "runtime accounting, busiest rank; peak alloc / reserved / active: CUDA allocator peaks during the step "
        "above its start, busiest rank; step: median of the slowest rank over the timed steps (min, max beside "
        "it); predicted: the simulator (see the module docstring).",
        "",
        markdown_table(result["rows"], cols, heads),
    ]
    return "\n".join(lines)
