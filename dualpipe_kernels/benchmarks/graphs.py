"""graphs: per-chunk CUDA graphs on tiny stages, the step's time per compute action with graphs on vs off.

One rank (a spawned process) runs interleaved 1F1B with two stage chunks, each ``--layers`` x
``Linear(W, W) -> GELU`` on micro-batches of ``--rows`` rows: a chunk is a handful of small kernels,
so a step is mostly launch and framework cost, which a graph replay replaces by one launch per chunk
and direction.  Both cases train the same model from the same seed; each runs ``--warmup`` steps (the
first records the shapes, its end captures) and then ``--steps`` timed steps (synchronized around
each step), taking turns step by step so a change of the machine's load reaches both alike.

Rows: ``graphs`` ``off`` / ``on``; ``step_s`` the median step (``step_s_min`` / ``step_s_max``
beside it), ``per_action_us`` it over the rank's compute actions, ``on_over_off`` the on row's
median over the off row's, ``bit_exact`` the two cases' losses and parameters equal after every
step.  ``fallback``: where the on case could not graph a stage, its reason; then the on row carries no
timing (on a machine without a GPU: ``no CUDA device``), since it would time eager again.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

NAME = "graphs"

__all__ = ["NAME", "GraphsConfig", "add_arguments", "run", "to_markdown"]


@dataclass(frozen=True)
class GraphsConfig:
    microbatches: int = 8
    layers: int = 4
    width: int = 64
    rows: int = 4
    warmup: int = 3
    steps: int = 30
    timeout_s: float = 120.0

    @staticmethod
    def from_args(args: argparse.Namespace) -> GraphsConfig:
        quick = bool(getattr(args, "quick", False))
        return GraphsConfig(
            microbatches=args.microbatches,
            layers=args.layers,
            width=args.width,
            rows=args.rows,
            warmup=args.warmup,
            steps=min(args.steps, 5) if quick else args.steps,
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default 8)")
    p.add_argument("--layers", type=int, default=4, help="Linear+GELU layers per stage chunk (default 4)")
    p.add_argument("--width", type=int, default=64, help="features of every Linear (default 64)")
    p.add_argument("--rows", type=int, default=4, help="rows per micro-batch (default 4)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 2: record, capture; default 3)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per case (default 30; --quick 5)")


def _rank(rank: int, world: int, cfg: GraphsConfig) -> dict[str, Any]:
    import torch
    import torch.nn as nn

    from dualpipe_kernels.runtime import GraphOptions, Pipeline
    from dualpipe_kernels.schedules.generators import build_schedule

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = False
    sched = build_schedule("interleaved1f1b", 1, cfg.microbatches, 2)
    actions = sum(len(a.computes()) for a in sched.actions[0])

    def chunk() -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(cfg.layers):
            layers += [nn.Linear(cfg.width, cfg.width), nn.GELU()]
        return nn.Sequential(*layers).to(dev)

    def build(graphs: bool) -> tuple[Pipeline, torch.optim.Optimizer]:
        torch.manual_seed(0)
        mods = {0: chunk(), 1: chunk()}
        pipe = Pipeline(sched, mods, transport="torch", timeout_s=30, graphs=GraphOptions(enabled=graphs))
        return pipe, torch.optim.SGD(pipe.parameters(), lr=1e-3)

    cases = {"off": build(False), "on": build(True)}
    g = torch.Generator().manual_seed(1)
    n = cfg.warmup + cfg.steps
    data = [
        (torch.randn(cfg.rows * cfg.microbatches, cfg.width, generator=g).to(dev),) * 2 for _ in range(n)
    ]  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in cases}
    exact = True
    for i, (x, y) in enumerate(data):
        losses = {}
        for name, (pipe, opt) in cases.items():
            opt.zero_grad()
            if cuda:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            res = pipe.step(x, labels=[y], criterion=nn.functional.mse_loss)
            if cuda:
                torch.cuda.synchronize(dev)
            if i >= cfg.warmup:
                times[name].append(time.perf_counter() - t0)
            opt.step()
            losses[name] = torch.stack([res.losses[m] for m in sorted(res.losses)])
        exact = exact and torch.equal(losses["on"], losses["off"])
    params = [list(p.parameters()) for p, _ in cases.values()]
    exact = exact and all(torch.equal(a, b) for a, b in zip(*params, strict=True))
    status = cases["on"][0].graph_status
    for pipe, _ in cases.values():
        pipe.close()
    reasons = sorted({f"stage {s}: {st.reason}" for s, st in status.items() if st.state != "captured"})
    return {
        "times": times,
        "bit_exact": bool(exact),
        "actions": actions,
        "graphs_captured": sum(st.graphs for st in status.values()),
        "fallback": "; ".join(reasons) or None,
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dualpipe_kernels.runtime.launch import spawn

    cfg = GraphsConfig.from_args(args)
    if cfg.warmup < 2 or cfg.steps < 1:
        raise ValueError(f"graphs bench: --warmup must be >= 2 and --steps >= 1, got {cfg.warmup}, {cfg.steps}")
    (r,) = spawn(_rank, 1, cfg, timeout_s=cfg.timeout_s)
    rows: list[dict[str, Any]] = []
    for name in ("off", "on"):
        ts = r["times"][name]
        timed = name == "off" or r["fallback"] is None
        med = statistics.median(ts) if timed else None
        row: dict[str, Any] = {
            "graphs": name,
            "schedule": "interleaved1f1b",
            "ranks": 1,
            "stages": 2,
            "microbatches": cfg.microbatches,
            "step_s": med,
            "step_s_min": min(ts) if timed else None,
            "step_s_max": max(ts) if timed else None,
            "per_action_us": med / r["actions"] * 1e6 if med is not None else None,
            "device": r["device"],
        }
        if name == "on":
            row["graphs_captured"] = r["graphs_captured"]
            row["fallback"] = r["fallback"]
            row["bit_exact"] = r["bit_exact"]
            row["on_over_off"] = med / rows[0]["step_s"] if med is not None else None
        rows.append(row)
    return {"suite": NAME, "config": asdict(cfg), "rows": rows}


def to_markdown(result: dict[str, Any]) -> str:
    from dualpipe_kernels.benchmarks.common import markdown_table

    cfg = result["config"]
    cols = ["graphs", "step_s", "step_s_min", "step_s_max", "per_action_us", "on_over_off", "graphs_captured"]
    cols += ["bit_exact", "fallback", "device"]
    lines = [
        f"interleaved 1F1B, 1 rank x 2 stage chunks, {cfg['microbatches']} micro-batches of {cfg['rows']} rows; "
        f"chunk = {cfg['layers']} x Linear({cfg['width']}, {cfg['width']}) + GELU.  step: median over "
        f"{cfg['steps']} timed steps (min, max beside it); per action: over the rank's compute actions; "
        "on/off: graphs on over off, same run.",
        "",
        markdown_table(result["rows"], cols),
    ]
    return "\n".join(lines)
