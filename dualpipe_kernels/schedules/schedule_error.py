"""ScheduleError and the way the validator words a problem: rank, step and the neighbouring actions."""

from __future__ import annotations

from .ir import Action, Schedule

__all__ = ["ScheduleError", "neighbourhood", "fail"]

_NEIGHBOURS = 4  # actions shown on each side of the culprit


class ScheduleError(ValueError):
    """A schedule breaks a rule.  ``rank``/``step``/``action`` locate it (None when global)."""

    def __init__(self, message: str, rank: int | None = None, step: int | None = None, action: object = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.action = action


def neighbourhood(actions: list[Action], step: int, width: int = _NEIGHBOURS) -> str:
    """``actions`` around ``step`` with the culprit in brackets (``step == len`` marks the end)."""
    lo, hi = max(0, step - width), min(len(actions), step + width + 1)
    parts = ["..."] if lo > 0 else []
    for j in range(lo, hi):
        parts.append(f"[{_show(actions[j])}]" if j == step else _show(actions[j]))
    if step >= len(actions):
        parts.append("[<end>]")
    if hi < len(actions):
        parts.append("...")
    return " ".join(parts)


def _show(entry: object) -> str:
    """An entry as the lists print it; a malformed one (a str type, a None) without failing."""
    try:
        return str(entry)
    except Exception:  # noqa: BLE001 - e.g. Action("F", 0, 0): its type has no .value
        if isinstance(entry, Action):
            return f"Action({entry.type!r}, {entry.stage!r}, {entry.microbatch!r})"
        return repr(entry)


def fail(schedule: Schedule, rank: int, step: int, problem: str) -> ScheduleError:
    """The error for ``problem`` at ``rank``'s ``step``, with that rank's neighbourhood."""
    acts = schedule.actions[rank]
    action = acts[step] if step < len(acts) else None
    where = f"rank {rank}, step {step} ({_show(action) if step < len(acts) else 'end of list'})"
    msg = f"{schedule.name}: {where}: {problem}\n  rank {rank}: {neighbourhood(acts, step)}"
    return ScheduleError(msg, rank, step, action)
