"""Why the planner chose its plan: the winner's step broken down, and what the runner-up lost on."""

from __future__ import annotations

from collections.abc import Sequence

from .candidates import Candidate

__all__ = ["explain"]


def _t(x: float, unit: str) -> str:
    return f"{x:.4g} s" if unit == "s" else f"{x:.4g} {unit}"


def _pct(x: float) -> str:
    return f"{x:.1%}" if x >= 0.001 else f"{x:.3%}"


def _breakdown(c: Candidate, unit: str) -> str:
    return (
        f"compute {_t(c.compute_s, unit)}, bubble {_t(c.bubble_s, unit)}, "
        f"DP all-reduce {_t(c.allreduce_s, unit)}, memory {c.peak_memory_bytes / 1e9:.3g} GB"
    )


def _lost_on(best: Candidate, other: Candidate, unit: str) -> str:
    """The step component where ``other`` loses most against ``best``."""
    parts = {
        "compute (slowest rank's work)": other.compute_s - best.compute_s,
        "pipeline bubble": other.bubble_s - best.bubble_s,
        "DP all-reduce": other.allreduce_s - best.allreduce_s,
    }
    what, delta = max(parts.items(), key=lambda kv: kv[1])
    return f"its {what} is {_t(delta, unit)} longer"


def explain(
    best: Candidate, runners_up: Sequence[Candidate], faster_rejected: Sequence[Candidate], budget: float, unit: str
) -> list[str]:
    """A few sentences: the choice, the runner-up's loss, and any faster plan that did not fit."""
    lines = [f"best: {best.label}, step {_t(best.simulated_step_s or 0.0, unit)} ({_breakdown(best, unit)})"]
    if runners_up:
        r = runners_up[0]
        gap = (r.simulated_step_s or 0.0) / (best.simulated_step_s or 1.0) - 1
        if gap <= 0:
            lines.append(f"runner-up {r.label} ties the step; the best needs less memory or fewer stages")
        else:
            lines.append(f"runner-up {r.label} is {_pct(gap)} slower: {_lost_on(best, r, unit)}")
    else:
        lines.append("no other configuration fits")
    if faster_rejected:
        f = faster_rejected[0]
        gain = 1 - (f.simulated_step_s or 0.0) / (best.simulated_step_s or 1.0)
        lines.append(
            f"{f.label} would be {_pct(gain)} faster but needs {f.peak_memory_bytes / 1e9:.3g} GB "
            f"> budget {budget / 1e9:.3g} GB"
        )
    return lines
