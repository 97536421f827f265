"""The ``schedules`` suite's Markdown table and plots (bubble vs ranks, one measured step over its simulation)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dualpipe_kernels.benchmarks.metrics import METRIC_SENTENCE

__all__ = ["to_markdown", "write_plots", "METRIC_SENTENCE"]


def _costs_text(c: dict[str, Any]) -> str:
    parts = []
    for k, v in sorted((c.get("chunk_costs_s") or {}).items()):
        ms = ", ".join(f"{name.upper()}={v[name] * 1e3:.2f}" for name in ("f", "i", "w"))
        parts.append(f"{k} chunk{'s' if int(k) > 1 else ''}/stage: {ms} ms")
    return "; ".join(parts) or "not measured"


_COLUMNS = (
    ("schedule", "schedule"),
    ("ranks", "ranks"),
    ("microbatches", "N"),
    ("measured_s", "T_step (s)"),
    ("simulated_s", "simulated (s)"),
    ("ratio", "measured/simulated"),
    ("ratio_sleep_only", "measured/simulated (sleep only)"),
    ("bubble_measured_s", "bubble measured (s)"),
    ("bubble_simulated_s", "bubble simulated (s)"),
    ("t_compute_s", "T_compute (s)"),
    ("t_comm_s", "T_comm (s)"),
    ("exposed_comm_s", "exposed comm (s)"),
    ("simulated_exposed_comm_s", "exposed comm simulated (s)"),
    ("hidden_text", "comm hidden"),
    ("error", "error"),
)


def _cpu_text(row: dict[str, Any]) -> str:
    """One sentence on what the row's ranks asked of the host's CPUs."""
    return (
        f"\n{row['ranks']} x {row['microbatches']}: the busiest rank's process used {row['rank_cpu_s'] * 1e3:.1f} ms "
        f"of CPU per step (median; all its threads) in a {row['measured_s'] * 1e3:.1f} ms step, "
        f"{row['ranks']} ranks on {row.get('host_cpus')} CPUs."
    )


def _floor_text(row: dict[str, Any]) -> str:
    """One sentence on the compute floor: the host's share of the row's ratio, before any runtime work."""
    return (
        f"\n{row['ranks']} x {row['microbatches']}, no runtime and no communication: the slowest rank's compute "
        f"took {row['floor_alone_s'] * 1e3:.1f} ms a step alone and {row['floor_together_s'] * 1e3:.1f} ms with "
        f"every rank at once, x{row['floor_inflation']:.3f}: what sharing this host does to the chunks themselves, "
        "a floor under measured / simulated whatever the runtime costs. The chunks alone in this launch cost "
        f"x{row['alone_drift']:.3f} their calibrated costs (the calibration runs before the launch); with both "
        f"taken out, measured / simulated is {row['ratio_runtime']:.3f}: the runtime's work and the waits it causes."
        + (_bare_text(row) if row.get("bare_s") is not None else "")
    )


def _bare_text(row: dict[str, Any]) -> str:
    """One sentence on the bare pipeline: the host's share of the ratio and the runtime's."""
    return (
        " The same chunks and transfers with no runtime (the bare pipeline: each rank's lowered list, each "
        f"transfer one preallocated tensor) took {row['bare_s'] * 1e3:.1f} ms a step, "
        f"x{row['bare_over_simulated']:.3f} the simulated step: what this host gives any runtime; measured / "
        f"bare is {row['measured_over_bare']:.3f}, the runtime's own share."
    )


def _launches_text(row: dict[str, Any]) -> str:
    """One sentence on the row's launches: the median one is shown, here are all."""
    ratios = ", ".join(f"{x:.3f}" for x in row["ratios"])
    return (
        f"\n{row['ranks']} x {row['microbatches']}: {row['launches']} launches (fresh rank processes, each "
        f"calibrated just before), measured / simulated {ratios}; the table shows the median one."
    )


def to_markdown(result: dict[str, Any]) -> str:
    from dualpipe_kernels.benchmarks.common import markdown_table
    from dualpipe_kernels.benchmarks.metrics import share_text

    c = result.get("config", {})
    head = (
        f"Sleep-timed stages: F={c.get('f_s', 0) * 1e3:g} ms, B={c.get('b_s', 0) * 1e3:g} ms, "
        f"W={c.get('w_s', 0) * 1e3:g} ms per chunk (2 x ranks chunks), {c.get('activation_bytes')} bytes per "
        f"activation, transport {c.get('transport')}, median of {c.get('steps')} steps. "
        "ratio = measured / simulated step time; the simulator gets each stage's F, I, W timed alone in one "
        f"process ({_costs_text(c)}) and free communication, so the ratio is what communication and the "
        "runtime add. 'sleep only': the simulator fed the nominal sleeps plus the measured overshoot of "
        f"time.sleep ({c.get('sleep_overshoot_s', 0) * 1e6:.0f} us) instead. 'exposed comm simulated': the "
        "simulator with the link latency and bandwidth measured in the same run, minus free communication. "
        + METRIC_SENTENCE
    )
    rows = [
        {**r, "hidden_text": share_text(r.get("hidden_comm_share"), r.get("hidden_comm_share_raw"))}
        if r.get("error") is None
        else r
        for r in result["rows"]
    ]
    parts = [head, "", markdown_table(rows, [k for k, _ in _COLUMNS], [h for _, h in _COLUMNS])] if rows else []
    if result.get("short_chunks"):
        r0 = result["short_chunks"][0]
        parts += [
            "",
            f"Short chunks (F={r0['f_s'] * 1e3:g} ms, B={r0['b_s'] * 1e3:g} ms, W={r0['w_s'] * 1e3:g} ms per chunk, "
            f"{r0.get('activation_bytes')} bytes per activation), where the runtime's own cost per action shows: "
            "measured / simulated, the simulator fed the chunks timed alone"
            + (" as in the table above" if rows else "")
            + ".",
            "",
            markdown_table(result["short_chunks"], [k for k, _ in _COLUMNS], [h for _, h in _COLUMNS]),
        ]
        parts += [_cpu_text(r) for r in result["short_chunks"] if r.get("rank_cpu_s") is not None]
        parts += [_floor_text(r) for r in result["short_chunks"] if r.get("ratio_runtime") is not None]
        parts += [_launches_text(r) for r in result["short_chunks"] if len(r.get("ratios") or []) > 1]
    if result.get("peers"):
        parts += [
            "",
            "Side by side with torch.distributed.pipelining (same chunks, same costs); "
            "ratio = ours / theirs (below 1: we are faster).",
            "",
            markdown_table(
                result["peers"],
                ["name", "schedule", "ranks", "microbatches", "step_s", "ours_step_s", "ratio", "error"],
                ["peer", "our schedule", "ranks", "N", "their step (s)", "our step (s)", "ours/theirs", "error"],
            ),
        ]
    return "\n".join(parts)


def _bubble_plot(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, name in enumerate(sorted({r["schedule"] for r in rows})):
        rs = sorted((r for r in rows if r["schedule"] == name), key=lambda r: r["ranks"])
        xs = [r["ranks"] for r in rs]
        ax.plot(xs, [r["bubble_measured_s"] * 1e3 for r in rs], "o-", color=f"C{i}", label=f"{name} measured")
        ax.plot(xs, [r["bubble_simulated_s"] * 1e3 for r in rs], "x--", color=f"C{i}", label=f"{name} simulated")
    ax.set_xlabel("ranks")
    ax.set_ylabel("bubble: max over ranks of idle time per step (ms)")
    ax.set_xticks(sorted({r["ranks"] for r in rows}))
    ax.set_title("bubble vs ranks: measured (solid), simulated (dashed)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _timeline_plots(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    from dualpipe_kernels.benchmarks.sleep_runs import chunk_costs_from_config, nominal_chunks, simulate_sleep
    from dualpipe_kernels.runtime.timeline import schedule_entries
    from dualpipe_kernels.schedules.plot import plot_overlay
    from dualpipe_kernels.schedules.trace import write_chrome_trace

    tl = result["timeline"]
    c = result["config"]
    chunks = chunk_costs_from_config(c)
    if chunks is None:
        chunks = nominal_chunks(c["f_s"], c["b_s"], c["w_s"], c.get("sleep_overshoot_s", 0.0))
    sim = simulate_sleep(tl["schedule"], tl["ranks"], tl["microbatches"], chunks)
    entries = [(r, str(a), t0, t1) for r, a, t0, t1 in schedule_entries(tl["entries"])]
    p = out / "schedules_timeline.png"
    title = f"{tl['schedule']} {tl['ranks']}x{tl['microbatches']}: simulated (fill), measured (outline)"
    plt.close(plot_overlay(sim, entries, p, title=title))
    tp = out / "schedules_timeline_trace.json"
    write_chrome_trace(tp, sim.events, measured=entries)
    return [p, tp]


def write_plots(result: dict[str, Any], out_dir: str | os.PathLike[str]) -> list[Path]:
    """``schedules_bubble.png`` (bubble vs ranks, measured vs simulated) and the DualPipeV timeline overlay."""
    out = Path(out_dir)
    paths: list[Path] = []
    rows = [r for r in result["rows"] if r.get("bubble_measured_s") is not None]
    if rows:
        paths.append(_bubble_plot(rows, out / "schedules_bubble.png"))
    tl = result.get("timeline")
    if tl and tl.get("entries"):
        paths += _timeline_plots(result, out)
    return paths
