"""bench overhead's parent side: a case's row from the ranks' step times, the ratios between cases,
the combination of launches, and the Markdown report (the measuring is in overhead.py)."""

from __future__ import annotations

from typing import Any

__all__ = ["case_row", "add_ratios", "add_floor", "combine_launches", "to_markdown"]


def _actions(ranks: int, microbatches: int, schedule: str) -> int:
    """Compute actions of the busiest rank of our ``schedule``."""
    from dualpipe_kernels.schedules.generators import build_schedule

    return max(len(a) for a in build_schedule(schedule, ranks, microbatches).actions)


def case_row(
    case: tuple[str, str, str], schedule: str, ranks: int, microbatches: int, per_rank: list[dict[str, Any]]
) -> dict[str, Any]:
    """The row of ``case`` (impl, transport, schedule or torch class) run as ``schedule`` (ours: the torch
    class's counterpart) on ``ranks`` x ``microbatches``, from every rank's results ``per_rank``."""
    import statistics

    from dualpipe_kernels.schedules.generators import SCHEDULE_NAMES

    impl, transport, name = case
    row: dict[str, Any] = {
        "impl": impl,
        "transport": transport,
        "schedule": schedule,
        "ranks": ranks,
        "microbatches": microbatches,
    }
    if impl == "torch":
        row["torch_class"] = name
    got = [o["/".join(case)] for o in per_rank]
    err = next((g for g in got if isinstance(g, str)), None)
    if err is not None:
        return {**row, "error": err, "step_s": None, "per_action_us": None}
    slowest = [max(ts) for ts in zip(*(g["times"] for g in got), strict=True)]
    step = float(statistics.median(slowest))
    theirs = [g["actions"] for g in got if g["actions"] is not None]
    if theirs:
        row["torch_compute_actions"] = max(theirs)
    if schedule in SCHEDULE_NAMES:
        actions = _actions(ranks, microbatches, schedule)
    elif theirs:
        actions = max(theirs)
    else:
        return {**row, "error": f"no compute-action count for {name}", "step_s": step, "per_action_us": None}
    return {
        **row,
        "step_s": step,
        "step_min_s": min(slowest),
        "step_max_s": max(slowest),
        "compute_actions": actions,
        "per_action_us": step / actions * 1e6,
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``ratio_to_torch`` on our gloo rows: our step / torch's step of the same schedule (both on gloo);
    ``ratio_to_prev`` on our native rows: our step / ours on native-prev of the same schedule;
    ``ratio_to_tags`` on our ordered rows (gloo paired in posting order, as NCCL): our step / ours on the
    tag-matched torch transport of the same schedule."""
    torch_step = {r["schedule"]: r["step_s"] for r in rows if r["impl"] == "torch" and r["step_s"]}
    prev_step = {
        r["schedule"]: r["step_s"]
        for r in rows
        if r["impl"] == "ours" and r["transport"] == "native-prev" and r["step_s"]
    }
    tags_step = {
        r["schedule"]: r["step_s"] for r in rows if r["impl"] == "ours" and r["transport"] == "torch" and r["step_s"]
    }
    for r in rows:
        if r["impl"] == "ours" and r["transport"] == "torch" and r["step_s"] and r["schedule"] in torch_step:
            r["ratio_to_torch"] = r["step_s"] / torch_step[r["schedule"]]
        if r["impl"] == "ours" and r["transport"] == "native" and r["step_s"] and r["schedule"] in prev_step:
            r["ratio_to_prev"] = r["step_s"] / prev_step[r["schedule"]]
        if r["impl"] == "ours" and r["transport"] == "ordered" and r["step_s"] and r["schedule"] in tags_step:
            r["ratio_to_tags"] = r["step_s"] / tags_step[r["schedule"]]


def add_floor(rows: list[dict[str, Any]]) -> None:
    """``floor_us`` and ``over_floor_us`` on our rows: the floor's per-action cost of the same schedule (torch's
    own work, no pipeline) and our per-action cost minus it (the runtime's own share of a compute action)."""
    floor = {r["schedule"]: r["per_action_us"] for r in rows if r["impl"] == "floor" and r.get("per_action_us")}
    for r in rows:
        if r["impl"] == "ours" and r.get("per_action_us") and r["schedule"] in floor:
            r["floor_us"] = floor[r["schedule"]]
            r["over_floor_us"] = r["per_action_us"] - floor[r["schedule"]]


def combine_launches(launches: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per case over the launches: the median of their step medians (min and max over every step),
    and the medians of their ours/torch and native/native-prev ratios with their ranges; an error in any
    launch is the row's."""
    import statistics

    out = []
    for rows in zip(*launches, strict=True):
        err = next((r for r in rows if r.get("error")), None)
        if err is not None:
            out.append(err)
            continue
        row = dict(rows[0])
        step = float(statistics.median(r["step_s"] for r in rows))
        row.update(
            step_s=step,
            step_min_s=min(r["step_min_s"] for r in rows),
            step_max_s=max(r["step_max_s"] for r in rows),
            per_action_us=step / row["compute_actions"] * 1e6,
            launches=len(rows),
        )
        ratios = [r["ratio_to_torch"] for r in rows if r.get("ratio_to_torch") is not None]
        if ratios:
            row.update(ratio_to_torch=float(statistics.median(ratios)), ratio_min=min(ratios), ratio_max=max(ratios))
        prev = [r["ratio_to_prev"] for r in rows if r.get("ratio_to_prev") is not None]
        if prev:
            row.update(
                ratio_to_prev=float(statistics.median(prev)),
                ratio_to_prev_min=min(prev),
                ratio_to_prev_max=max(prev),
            )
        tags = [r["ratio_to_tags"] for r in rows if r.get("ratio_to_tags") is not None]
        if tags:
            row.update(ratio_to_tags=float(statistics.median(tags)), ratio_to_tags_min=min(tags),
                       ratio_to_tags_max=max(tags))  # fmt: skip
        out.append(row)
    return out


def to_markdown(result: dict[str, Any]) -> str:
    from dualpipe_kernels.benchmarks.common import markdown_table

    c = result.get("config", {})
    head = (
        f"{c.get('ranks')} ranks x {c.get('microbatches')} micro-batches, every stage chunk one Linear(8, 8) on "
        f"1x8 rows; median of {c.get('launches', 1)} launches (fresh rank processes) of the median of "
        f"{c.get('steps')} steps of the slowest rank (min, max: over every step). per action: step / compute "
        "actions of the busiest rank. 'ours/torch': our step on gloo over torch's on gloo, per launch, median "
        "(min, max) over the launches; in a launch the cases take turns step by step. 'native/prev': our step "
        "on native over ours on native-prev (the same engine as before its small-message paths: recv_poll_ms=0, "
        "its receive worker watching every receive, gather_sends=False and spin_us=50), per launch, median (min, max). "
        "floor rows: torch's own work of each rank (its stage modules for its compute actions in order: forward, "
        "criterion, one autograd.backward per B or I) with no pipeline, no transfers, no runtime; 'over floor': "
        "our per-action cost minus the floor's of the same schedule. "
        "bound rows: the schedule simulated with each op's torch work timed by itself (the floor's ops, per stage) "
        "and the transport's one-way latency of a runtime-sized message (ping-pong, half the median round trip) "
        "on every transfer: the step of a runtime that costs nothing itself; 'ours/bound': our step over it. "
        + (
            "Each rank process pinned to its own core (ours and torch's alike; --no-pin: not)."
            if c.get("pin")
            else "Rank processes not pinned (--no-pin)."
        )
    )
    cols = [
        ("impl", "impl"),
        ("transport", "transport"),
        ("schedule", "schedule"),
        ("torch_class", "torch class"),
        ("step_s", "step (s)"),
        ("step_min_s", "min (s)"),
        ("step_max_s", "max (s)"),
        ("compute_actions", "actions"),
        ("torch_compute_actions", "torch actions"),
        ("per_action_us", "per action (us)"),
        ("floor_us", "floor (us)"),
        ("over_floor_us", "over floor (us)"),
        ("latency_us", "latency (us)"),
        ("bound_us", "bound (us)"),
        ("ratio_to_bound", "ours/bound"),
        ("ratio_to_torch", "ours/torch"),
        ("ratio_min", "min"),
        ("ratio_max", "max"),
        ("ratio_to_prev", "native/prev"),
        ("ratio_to_prev_min", "min"),
        ("ratio_to_prev_max", "max"),
        ("ratio_to_tags", "ordered/torch"),
        ("baseline_per_action_us", "old per action (us)"),
        ("ratio_to_baseline", "new/old"),
        ("ratio_to_baseline_min", "min"),
        ("ratio_to_baseline_max", "max"),
        ("error", "error"),
    ]
    if not any(r.get("ratio_to_baseline") is not None for r in result["rows"]):
        cols = [c for c in cols if not c[0].startswith(("baseline_", "ratio_to_baseline"))]
    if result.get("baseline_tree"):
        head += (
            f" 'new/old': our step over the same case's in the source tree {result['baseline_tree']} (--baseline-tree: "
            "its launches in child processes on its own code, taking turns with these), per pair of launches, "
            "median (min, max) over the pairs; 'old per action': its per-action cost."
        )
    parts = [head, "", markdown_table(result["rows"], [k for k, _ in cols], [h for _, h in cols])]
    pc = result.get("profile_case", {})
    parts += ["", f"## Profile: ours on native, {pc.get('schedule')}, rank 0, {pc.get('steps')} steps (cProfile)", ""]
    if result.get("profile_error"):
        parts.append(f"profile failed: {result['profile_error']}")
    pcols = [
        ("function", "function"),
        ("ncalls", "calls"),
        ("tottime_s", "tottime (s)"),
        ("cumtime_s", "cumtime (s)"),
        ("tottime_per_step_ms", "own per step (ms)"),
        ("cumtime_per_step_ms", "cum per step (ms)"),
    ]
    keys, heads = [k for k, _ in pcols], [h for _, h in pcols]
    parts += ["By cumulative time:", "", markdown_table(result.get("profile", []), keys, heads)]
    parts += ["", "By own time:", "", markdown_table(result.get("profile_self", []), keys, heads)]
    return "\n".join(parts)
