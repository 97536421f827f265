"""ASCII grid of a schedule: one row per rank, one column per step of its list.

Columns are list positions, not time (the simulator's timeline has time).  An
OVERLAP_F_B pair prints as ``0F3+7B5``.  Example (DualPipeV, 2 ranks, 4 mbs)::

    step   | 0   1   2   3   4   5   6   7       ...
    rank 0 | 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3+3B1 ...
"""

from __future__ import annotations

from .ir import Action, ActionType, Schedule

__all__ = ["to_ascii", "cell"]


def cell(a: Action) -> str:
    """Short label of one action (the pair as ``F+B``)."""
    if a.type is ActionType.OVERLAP_F_B:
        return "+".join(str(c) for c in a.sub_actions)
    return str(a)


def to_ascii(schedule: Schedule, comms: bool = True, max_steps: int | None = None) -> str:
    """The grid as text, with a header line naming the schedule.

    ``comms=False`` hides SEND/RECV actions of a lowered schedule; ``max_steps``
    cuts each row (a trailing ``...`` marks the cut).
    """
    rows = [[cell(a) for a in acts if comms or a.is_compute] for acts in schedule.actions]
    longest = max((len(r) for r in rows), default=0)
    steps = longest if max_steps is None else min(longest, max_steps)
    widths = [len(str(j)) for j in range(steps)]
    for r in rows:
        for j, text in enumerate(r[:steps]):
            widths[j] = max(widths[j], len(text))
    label_w = len(f"rank {schedule.num_ranks - 1}")
    cut = " ..." if steps < longest else ""
    title = (
        f"{schedule.name}: {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} micro-batches" + (" (lowered)" if schedule.lowered else "")
    )
    lines = [title, f"{'step':<{label_w}} | " + " ".join(f"{j:<{widths[j]}}" for j in range(steps)).rstrip() + cut]
    for rank, r in enumerate(rows):
        body = " ".join(f"{r[j] if j < len(r) else '':<{widths[j]}}" for j in range(steps)).rstrip()
        lines.append(f"{f'rank {rank}':<{label_w}} | {body}" + (cut if len(r) > steps else ""))
    return "\n".join(lines)
