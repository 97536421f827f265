"""bench overhead ``--baseline-tree PATH``: the same measurement of another source tree, side by side.

The other tree (e.g. a ``git worktree`` of the previous commit, with its compiled extension) runs the same
``bench overhead`` in a child process with ``PYTHONPATH=PATH`` (its own code, rank processes and all), one
launch at a time, taking turns with this tree's launches: new, old, old, new, ... so a change in the
machine's load (two shared cores) reaches both alike.  Every case of a launch is measured as usual; the
ratio new/old of a case is taken per pair of launches (this tree's launch k over the other's launch k),
and its median, min and max over the pairs go into our rows (``ratio_to_baseline``), with the other tree's
step and per-action cost (medians over its launches).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["check_tree", "run_baseline_launch", "add_baseline"]

#: one launch of the other tree: its ranks' start, every case's steps and its cProfile pass
LAUNCH_TIMEOUT_S = 900.0


def check_tree(path: str) -> Path:
    """``path`` as a source tree holding the ``dualpipe_kernels`` package; ValueError naming the option."""
    tree = Path(path).expanduser().resolve()
    if not (tree / "dualpipe_kernels" / "__init__.py").is_file():
        raise ValueError(f"--baseline-tree {path}: no dualpipe_kernels/__init__.py there (give a source tree)")
    if not any(tree.glob("dualpipe_kernels/_C*.so")):
        raise ValueError(
            f"--baseline-tree {path}: its dualpipe_kernels/ has no compiled extension (_C*.so): build it there "
            "or copy this tree's"
        )
    return tree


def _flags(cfg: Any) -> list[str]:
    """The command-line options that make the other tree measure ``cfg``'s cases with one launch."""
    out = [
        "--schedules", ",".join(cfg.schedules),
        "--transports", ",".join(cfg.transports),
        "--microbatches", str(cfg.microbatches),
        "--steps", str(cfg.steps),
        "--warmup", str(cfg.warmup),
        "--launches", "1",
        "--profile-schedule", cfg.profile_schedule,
        "--profile-top", "1",
    ]  # fmt: skip
    if not cfg.torch_peers:
        out.append("--no-torch")
    if not cfg.floor:
        out.append("--no-floor")
    if not cfg.pin:
        out.append("--no-pin")
    return out


def run_baseline_launch(tree: Path, cfg: Any) -> list[dict[str, Any]]:
    """One launch of ``bench overhead`` in ``tree`` (a child process on its code): its rows."""
    with tempfile.TemporaryDirectory(prefix="dualpipe-baseline-") as out:
        cmd = [sys.executable, "-m", "dualpipe_kernels", "bench", "overhead", "--json", "--no-plots", "--out", out]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)}
        try:
            proc = subprocess.run(
                [*cmd, *_flags(cfg)], cwd=tree, env=env, capture_output=True, text=True,
                timeout=LAUNCH_TIMEOUT_S, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"--baseline-tree {tree}: its launch ran past {LAUNCH_TIMEOUT_S:.0f} s") from None
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        raise RuntimeError(f"--baseline-tree {tree}: its bench overhead exited {proc.returncode}: {' | '.join(tail)}")
    rows = json.loads(proc.stdout)["rows"]
    if not isinstance(rows, list):
        raise RuntimeError(f"--baseline-tree {tree}: its bench overhead printed no rows")
    return rows


def _case(row: dict[str, Any]) -> tuple[str, str, str]:
    return row["impl"], row["transport"], row.get("torch_class") or row["schedule"]


def add_baseline(rows: list[dict[str, Any]], new: list[list[dict[str, Any]]], old: list[list[dict[str, Any]]]) -> None:
    """On our rows: ``baseline_step_s`` / ``baseline_per_action_us`` (the other tree's, median over its
    launches) and ``ratio_to_baseline`` (this tree's step over the other's, per pair of launches: median,
    ``_min``, ``_max``, ``baseline_pairs``).  A case the other tree lacks or failed gets no ratio."""
    for row in rows:
        if row["impl"] != "ours" or not row.get("step_s"):
            continue
        case = _case(row)
        pairs: list[tuple[float, dict[str, Any]]] = []
        for mine, theirs in zip(new, old, strict=True):
            a = next((r for r in mine if _case(r) == case and r.get("step_s")), None)
            b = next((r for r in theirs if _case(r) == case and r.get("step_s")), None)
            if a is not None and b is not None:
                pairs.append((a["step_s"] / b["step_s"], b))
        if not pairs:
            continue
        ratios = [p[0] for p in pairs]
        old_steps = [p[1]["step_s"] for p in pairs]
        row.update(
            baseline_step_s=float(statistics.median(old_steps)),
            baseline_per_action_us=float(statistics.median(old_steps)) / row["compute_actions"] * 1e6,
            ratio_to_baseline=float(statistics.median(ratios)),
            ratio_to_baseline_min=min(ratios),
            ratio_to_baseline_max=max(ratios),
            baseline_pairs=len(pairs),
        )
