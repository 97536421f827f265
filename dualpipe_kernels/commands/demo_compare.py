"""``dualpipe-kernels demo --compare SCHEDULE``: the demo's schedule and another one on the same model and data.

Both runs train the same GPT (same layers, seed, batches, ranks and
micro-batches); the table puts side by side the median step time, the peak
activation memory per step (the demo's meter, busiest rank), the speedup and
the memory reduction, each measured, with the simulator's prediction beside:
step time simulated from each run's own measured stage costs, memory as the
simulated peak of live stage chunks times the layers per chunk (a chunk of a
schedule with more stages holds fewer layers).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from typing import Any

__all__ = ["run_compare"]


def _summary(res: dict[str, Any]) -> dict[str, Any]:
    from dualpipe_kernels.schedules.costs import CostModel
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.schedules.simulator import simulate

    sched = build_schedule(res["schedule"], res["ranks"], res["microbatches"])
    chunks = max(simulate(sched, CostModel()).peak_activations_per_rank)
    steps = res["step_times_s"][1:] or res["step_times_s"]  # the first step warms up
    sims = res["simulated_step_s"][1:] or res["simulated_step_s"]
    return {
        "schedule": res["schedule"],
        "step_s": statistics.median(steps),
        "predicted_step_s": statistics.median(sims),
        "peak_activation_bytes": max(res["peak_activation_bytes"]),
        # layer-activations of the busiest rank: live chunks x layers per chunk
        "predicted_peak_layers": chunks * res["model"]["n_layers"] / sched.num_stages,
        "final_loss": res["losses"][-1],
        "bit_exact_first_step": res["bit_exact_first_step"],
    }


def run_compare(cfg: Any, other: str, as_json: bool) -> int:
    """Run the demo for ``cfg`` and for ``cfg`` with schedule ``other``; print both and the ratios."""
    from dualpipe_kernels.commands.demo_run import run_demo
    from dualpipe_kernels.schedules.generators import build_schedule

    build_schedule(other, cfg.ranks, cfg.microbatches)  # ValueError (exit 2) if it cannot run this size
    a, b = _summary(run_demo(cfg)), _summary(run_demo(replace(cfg, schedule=other)))
    out = {
        "ranks": cfg.ranks,
        "microbatches": cfg.microbatches,
        "steps": cfg.steps,
        "runs": [a, b],
        "speedup": b["step_s"] / a["step_s"],
        "predicted_speedup": b["predicted_step_s"] / a["predicted_step_s"],
        "memory_reduction": 1 - a["peak_activation_bytes"] / b["peak_activation_bytes"],
        "predicted_memory_reduction": 1 - a["predicted_peak_layers"] / b["predicted_peak_layers"],
    }
    if as_json:
        print(json.dumps(out))
    else:
        print(f"demo --compare: {a['schedule']} vs {b['schedule']}, {cfg.ranks} ranks, {cfg.microbatches} mbs")
        print("schedule         step (s)  predicted (s)  peak act (KiB)  predicted (layer-acts)  final loss  exact")
        for r in (a, b):
            print(
                f"{r['schedule']:<16} {r['step_s']:<9.4f} {r['predicted_step_s']:<14.4f} "
                f"{r['peak_activation_bytes'] / 1024:<15.1f} {r['predicted_peak_layers']:<23.2f} "
                f"{r['final_loss']:<11.4f} {'yes' if r['bit_exact_first_step'] else 'NO'}"
            )
        print(
            f"speedup of {a['schedule']} over {b['schedule']}: {out['speedup']:.3f} "
            f"(predicted {out['predicted_speedup']:.3f}); activation memory reduction "
            f"{out['memory_reduction']:+.1%} (predicted {out['predicted_memory_reduction']:+.1%})"
        )
    return 0 if a["bit_exact_first_step"] and b["bit_exact_first_step"] else 1
