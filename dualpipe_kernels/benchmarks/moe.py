"""moe: DualPipeV's F&B overlap with expert-parallel all_to_all, ours against torch and the reference.

``pp x ep`` CPU processes (default 2 x 2 = 4, gloo): each pipeline group runs
DualPipeV over ``2 * pp`` MoE chunks (:mod:`.moe_block`: sleep-timed attention
and expert compute, real dispatch/combine all_to_alls over the expert group,
forward and backward); the rank side is :mod:`.moe_ranks`.  For every
all_to_all size of the sweep, side by side in the same processes, from the
same weights and data:

* ``ours``: our Pipeline; paired chunks run ``overlapped_forward_backward``,
  which interleaves one chunk's backward phases with the other's forward
  phases so every all_to_all is in flight while the other chunk computes;
* ``ours-hook-off``: the same chunks without the hook (a pair runs F then B);
* ``torch.ScheduleDualPipeV``: torch.distributed.pipelining, its default
  OVERLAP_F_B (F then B);
* ``dropin.ScheduleDualPipeV``: the same torch program with the class imported
  from dualpipe_kernels.integrations.pipelining, over the hooked chunks;
* the reference ``dualpipe`` package's DualPipeV when it can run here, else a
  one-line skip saying why (:func:`reference_skip`).

Per row: ``step_s`` (slowest process per step, median over steps; the spread
is ``step_min_s``/``step_max_s``), ``pair_s`` (the pair this contender runs,
timed alone on the expert group: the hook for ``ours``, F then B otherwise)
against ``f_plus_b_s`` (F and B timed alone), ``exposed_a2a_s`` (step time
minus the same contender's step at the sweep's first, few-bytes size),
``simulated_s`` (our simulator, DualPipeV, fed this contender's F, B = I + W,
W and pair costs as measured in situ in its own timed steps, from their
timelines, :mod:`.in_situ_costs`; torch's schedule records no timeline, so its
row, and ``simulated_alone_s`` for every row, use the costs timed alone on the
expert group; free pipeline transfers: the boundary activations are a few KB)
and ``ratio_vs_ours`` (our step time / this one's: below 1, we
are faster).  The first step's gradients of every contender are compared with
``torch.equal``: every value is a small integer, so sums are exact in float32
in any order (``grads``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from dualpipe_kernels.benchmarks.common import comma_ints, markdown_table, option
from dualpipe_kernels.benchmarks.moe_ranks import CONTENDERS, MoeRun

NAME = "moe"

__all__ = ["NAME", "MoeConfig", "add_arguments", "run", "to_markdown", "write_plots", "reference_skip", "TARGETS"]

#: Must-show targets at the size whose all_to_all is closest to a chunk's forward compute.
TARGETS = {
    "pair_over_f_plus_b": 0.65,
    "ours_over_torch": 0.8,
    "ours_over_hook_off": 0.8,
    "ours_vs_simulated": 0.05,
    "dropin_over_torch": 0.8,
}
#: contenders whose pairs run through the overlap hook
HOOKED = ("ours", "dropin.ScheduleDualPipeV")

_FULL_SIZES = (0, 1 << 22, 1 << 23, 1 << 24, 1 << 25, 3 << 24, 1 << 26, 3 << 25, 1 << 27)
_QUICK_SIZES = (0, 1 << 20)


def _size_list(text: str) -> list[int]:
    return comma_ints(text, 0, "byte counts")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp", type=int, default=None, help="pipeline ranks (default 2)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel ranks per pipeline rank (default 2)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches (default 24; quick 4)")
    p.add_argument("--rows", type=int, default=None, help="tokens per micro-batch (default 8)")
    p.add_argument("--cols", type=int, default=None, help="token width (default 16)")
    p.add_argument("--f-ms", type=float, default=None, help="forward compute of one chunk, ms (default 10; quick 4)")
    p.add_argument("--b-ms", type=float, default=None, help="backward compute of one chunk, ms (default 20; quick 8)")
    p.add_argument("--w-ms", type=float, default=None, help="weight-gradient part of B, ms (default 10; quick 4)")
    p.add_argument(
        "--a2a-bytes",
        type=_size_list,
        default=None,
        help="comma list: one rank's send buffer per all_to_all; the smallest is the few-bytes baseline "
        f"(default {','.join(map(str, _FULL_SIZES))}; quick {','.join(map(str, _QUICK_SIZES))})",
    )
    p.add_argument("--steps", type=int, default=None, help="measured steps per contender and size (default 5; quick 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 1)")
    p.add_argument(
        "--cost-repeats", type=int, default=None, help="rounds of each cost timed alone (default 11; quick 2)"
    )
    p.add_argument("--transport", choices=("auto", "torch", "native"), default=None, help="our pipeline transport")
    p.add_argument(
        "--comm-nice",
        type=int,
        default=None,
        help="niceness of each process's communication threads, below its compute thread (default 10; 0: equal)",
    )
    p.add_argument(
        "--a2a",
        choices=("native", "gloo"),
        default=None,
        help="what moves the expert all_to_all's bytes, for every contender: our shared-memory engine "
        "(default) or gloo over TCP loopback",
    )


@dataclass(frozen=True)
class MoeConfig:
    """The suite's settings: the run every rank gets, checked."""

    run: MoeRun

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MoeConfig:
        """Defaults (full or quick) filled in; ValueError naming the bad option."""
        from dualpipe_kernels.schedules.generators import build_schedule

        def pick(name: str, full: Any, quick: Any) -> Any:
            return option(args, name, full, quick)

        sizes = sorted(set(pick("a2a_bytes", _FULL_SIZES, _QUICK_SIZES)))
        run = MoeRun(
            pp=int(pick("pp", 2, 2)),
            ep=int(pick("ep", 2, 2)),
            microbatches=int(pick("microbatches", 24, 4)),
            rows=int(pick("rows", 8, 8)),
            cols=int(pick("cols", 16, 16)),
            f_s=pick("f_ms", 10.0, 4.0) / 1e3,
            b_s=pick("b_ms", 20.0, 8.0) / 1e3,
            w_s=pick("w_ms", 10.0, 4.0) / 1e3,
            a2a_bytes=tuple(sizes),
            steps=int(pick("steps", 5, 1)),
            warmup=int(pick("warmup", 1, 1)),
            cost_repeats=int(pick("cost_repeats", 11, 2)),
            transport=str(pick("transport", "auto", "auto")),
            a2a=str(pick("a2a", "native", "native")),
            comm_nice=int(pick("comm_nice", 10, 10)),
        )
        if not 0 <= run.comm_nice <= 19:
            raise ValueError(f"--comm-nice must be in [0, 19], got {run.comm_nice}")
        if run.pp < 1 or run.ep < 1:
            raise ValueError(f"--pp and --ep must be >= 1, got {run.pp}, {run.ep}")
        if run.rows < 1 or run.cols < 1 or run.rows % run.ep:
            raise ValueError(
                f"--rows must be a positive multiple of --ep ({run.ep}) and --cols >= 1, got {run.rows}, {run.cols}"
            )
        if not (run.f_s > 0 and run.b_s > 0 and 0 < run.w_s < run.b_s):
            raise ValueError(
                f"costs need F > 0, B > 0 and 0 < W < B, got F={run.f_s * 1e3:g} B={run.b_s * 1e3:g} "
                f"W={run.w_s * 1e3:g} ms"
            )
        if run.steps < 1 or run.warmup < 1 or run.cost_repeats < 1:
            raise ValueError(
                f"--steps, --warmup and --cost-repeats must be >= 1 (the first warm-up step is the "
                f"gradient check), got {run.steps}, {run.warmup}, {run.cost_repeats}"
            )
        build_schedule("dualpipev", run.pp, run.microbatches)  # raises ValueError naming the constraint
        return cls(run=run)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self.run)
        d["a2a_bytes"] = list(d["a2a_bytes"])
        d["processes"] = self.run.pp * self.run.ep
        return d


# ---------------------------------------------------------------- the reference
def reference_skip() -> str:
    """Why the reference ``dualpipe`` package's DualPipeV is not a contender in this run (one line).

    It cannot be one on CPU processes: the reference (github deepseek-ai/DualPipe) asserts that its modules
    are on the current CUDA device and allocates its P2P receive buffers with ``device="cuda"``.
    """
    cuda_only = "it is CUDA-only (asserts its modules are on the current CUDA device, receives into 'cuda' buffers)"
    try:
        import dualpipe  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - absent or broken: either way it cannot run
        return (
            f"reference skipped: no `dualpipe` package importable ({type(e).__name__}); and on these CPU "
            f"processes it could not run: {cuda_only}"
        )
    if not hasattr(dualpipe, "DualPipeV"):
        return "reference skipped: the installed `dualpipe` has no DualPipeV (the early DualPipe-only snapshot)"
    return f"reference skipped: this suite runs CPU processes over gloo and the reference's DualPipeV {cuda_only[3:]}"


# ---------------------------------------------------------------- rows
def _costs_at(per_rank: list[dict[str, Any]], k: int) -> dict[str, float]:
    """Median over processes of each cost timed alone at size index ``k``."""
    keys = [key for key in per_rank[0]["costs"][k] if key != "a2a_bytes"]
    out = {key: statistics.median(r["costs"][k][key] for r in per_rank) for key in keys}
    out["a2a_bytes"] = per_rank[0]["costs"][k]["a2a_bytes"]
    return out


def _slowest(per_rank: list[dict[str, Any]], name: str, k: int) -> list[float]:
    """Per measured step, the slowest process's time."""
    return [max(ts) for ts in zip(*(r["times"][name][k] for r in per_rank), strict=True)]


def _simulated(run: MoeRun, c: dict[str, float], pair_s: float) -> tuple[float, float]:
    """(simulated step s, the pair cost fed to it): DualPipeV with F, B = I + W, W and ``pair_s`` clamped into
    the simulator's range [max(F, B), F + B]."""
    from dualpipe_kernels.schedules.costs import CostModel
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.schedules.simulator import simulate

    f, w = c["f"], max(c["w"], 1e-6)
    b = max(c["i"] + c["w"], w + 1e-6)
    fb = min(max(pair_s, f, b), f + b)
    return float(
        simulate(build_schedule("dualpipev", run.pp, run.microbatches), CostModel(f=f, b=b, w=w, fb=fb)).makespan
    ), fb


def _simulated_in_situ(run: MoeRun, per_rank: list[dict[str, Any]], name: str, k: int) -> float | None:
    """The simulator fed the costs ``name``'s own timed steps at size index ``k`` measured in situ
    (:mod:`.in_situ_costs`: each action's span less its receive waits, plus the runtime's gap before it;
    per stage, median over the steps of both pipelines), plus the steps' fixed set-up; None without
    timelines (torch's schedule records none)."""
    from dualpipe_kernels.benchmarks.in_situ_costs import in_situ_costs
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.schedules.simulator import simulate

    steps = []
    for e in range(run.ep):
        ranks = sorted((r for r in per_rank if r["e_rank"] == e), key=lambda r: r["p_rank"])
        got = [r.get("timelines", {}).get(name) for r in ranks]
        if not ranks or any(not g for g in got):
            return None
        for j in range(min(len(g[k]) for g in got)):
            steps.append([g[k][j] for g in got])
    if not steps:
        return None
    sched = build_schedule("dualpipev", run.pp, run.microbatches)
    costs = in_situ_costs(steps, sched.num_stages)
    return float(simulate(sched, costs.cost_model()).makespan) + costs.fixed_s


def _pair_floor(run: MoeRun, c: dict[str, float]) -> float:
    """The shortest a hooked pair can be on CPU processes, the longest of three chains:
    its four all_to_alls back to back (the copies share the cores, and ``a2a`` is measured with every
    process exchanging); its compute (F + B of sleep: both chunks' phases run on the one compute thread);
    and the backward's own chain, which no interleaving shortens: the combine's gradient exchange, the
    expert half of B, the dispatch's gradient exchange, the attention half of B (2 x a2a + B)."""
    return max(4 * c["a2a"], run.f_s + run.b_s, 2 * c["a2a"] + run.b_s)


def _rows(run: MoeRun, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    base = {name: statistics.median(_slowest(per_rank, name, 0)) for name in CONTENDERS}
    rows = []
    for k in range(len(run.a2a_bytes)):
        c = _costs_at(per_rank, k)
        steps = {name: _slowest(per_rank, name, k) for name in CONTENDERS}
        ours = statistics.median(steps["ours"])
        for name in CONTENDERS:
            step = statistics.median(steps[name])
            pair = c["pair_hook"] if name in HOOKED else c["pair_seq"]
            alone, fb = _simulated(run, c, pair)
            in_situ = _simulated_in_situ(run, per_rank, name, k)
            sim = alone if in_situ is None else in_situ
            rows.append(
                {
                    "contender": name,
                    "a2a_bytes": int(c["a2a_bytes"]),
                    "step_s": step,
                    "pair_s": pair,
                    "f_plus_b_s": c["f"] + c["b"],
                    "exposed_a2a_s": step - base[name],
                    "simulated_s": sim,
                    "ratio_vs_ours": ours / step,
                    # extras
                    "step_min_s": min(steps[name]),
                    "step_max_s": max(steps[name]),
                    "pair_over_f_plus_b": pair / (c["f"] + c["b"]),
                    "measured_over_simulated": step / sim,
                    "a2a_s": c["a2a"],
                    "f_s": c["f"],
                    "b_s": c["b"],
                    "i_s": c["i"],
                    "w_s": c["w"],
                    "simulated_alone_s": alone,
                    "simulated_from": "alone" if in_situ is None else "in situ",
                    "alone_over_simulated": step / alone,
                    "simulated_pair_s": fb,
                    "pair_floor_s": _pair_floor(run, c),
                }
            )
    return rows


def _targets(run: MoeRun, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The must-show figures at the size whose all_to_all is closest to one chunk's forward compute."""
    ours = [r for r in rows if r["contender"] == "ours"]
    at = min(ours, key=lambda r: abs(r["a2a_s"] - run.f_s))
    by = {r["contender"]: r for r in rows if r["a2a_bytes"] == at["a2a_bytes"]}
    vals = {
        "pair_over_f_plus_b": at["pair_over_f_plus_b"],
        "ours_over_torch": at["step_s"] / by["torch.ScheduleDualPipeV"]["step_s"],
        "ours_over_hook_off": at["step_s"] / by["ours-hook-off"]["step_s"],
        "ours_vs_simulated": abs(at["measured_over_simulated"] - 1.0),
        "dropin_over_torch": by["dropin.ScheduleDualPipeV"]["step_s"] / by["torch.ScheduleDualPipeV"]["step_s"],
    }
    return {
        "a2a_bytes": at["a2a_bytes"],
        "a2a_s": at["a2a_s"],
        "chunk_forward_compute_s": run.f_s,
        "pair_floor_over_f_plus_b": at["pair_floor_s"] / at["f_plus_b_s"],
        "pair_over_floor": at["pair_s"] / at["pair_floor_s"],
        "values": vals,
        "limits": dict(TARGETS),
        "met": {k: bool(v <= TARGETS[k]) for k, v in vals.items()},
    }


def _grad_check(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Every contender's first-step gradients against ours, with torch.equal, on every process."""
    import torch

    compared, mismatch = 0, None
    for rank, r in enumerate(per_rank):
        ref = r["grads"]["ours"]
        for name in CONTENDERS[1:]:
            got = r["grads"][name]
            if got.keys() != ref.keys():
                mismatch = mismatch or f"process {rank}, {name}: gradients of {sorted(got.keys() ^ ref.keys())}"
                continue
            for key, g in got.items():
                compared += 1
                if not torch.equal(g, ref[key]):
                    diff = float((g - ref[key]).abs().max())
                    mismatch = mismatch or f"process {rank}, {name}: {key} differs by up to {diff:.3g}"
    return {
        "equal": mismatch is None and compared > 0,
        "compared": compared,
        "mismatch": mismatch,
        "rule": "torch.equal: weights and data are small integers, so every sum is exact in any order",
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dualpipe_kernels.benchmarks.moe_ranks import rank_main
    from dualpipe_kernels.runtime import spawn

    cfg = MoeConfig.from_args(args)
    r = cfg.run
    skip = reference_skip()
    sys.stderr.write(f"  bench moe: {r.pp} x {r.ep} = {r.pp * r.ep} processes, {len(r.a2a_bytes)} sizes; {skip}\n")
    per_rank = spawn(rank_main, r.pp * r.ep, r, timeout_s=1200)
    rows = _rows(r, per_rank)
    pairs = {name: sum(p["pairs"][name] for p in per_rank) for name in CONTENDERS}
    return {
        "config": cfg.as_dict(),
        "layout": f"pipeline {r.pp} x expert-parallel {r.ep} = {r.pp * r.ep} CPU processes (gloo)",
        "a2a_backend": r.a2a,
        "comm_threads_lowered": [p.get("comm_threads_lowered", 0) for p in per_rank],
        "rows": rows,
        "grads": _grad_check(per_rank),
        "overlapped_pairs": pairs,
        "reference": {"contender": "dualpipe.DualPipeV", "skipped": skip},
        "targets": _targets(r, rows),
    }


# ---------------------------------------------------------------- report
_COLUMNS = [
    "contender",
    "a2a_bytes",
    "a2a_s",
    "step_s",
    "simulated_s",
    "measured_over_simulated",
    "simulated_alone_s",
    "alone_over_simulated",
    "pair_s",
    "f_plus_b_s",
    "pair_over_f_plus_b",
    "pair_floor_s",
    "exposed_a2a_s",
    "ratio_vs_ours",
]


_A2A_TEXT = {
    "native": "our shared-memory engine (a send and a receive per peer block, one copy each; the own block's "
    "tokens copied locally, its padding not, as on a GPU it crosses no link)",
    "gloo": "gloo over TCP loopback",
}


def to_markdown(result: dict[str, Any]) -> str:
    c, t, g = result["config"], result["targets"], result["grads"]
    lines = [
        f"{result['layout']}; DualPipeV, {c['microbatches']} micro-batches; chunk compute F {c['f_s'] * 1e3:g} ms, "
        f"B {c['b_s'] * 1e3:g} ms (W {c['w_s'] * 1e3:g} ms), sleep-timed; all_to_all: {_A2A_TEXT[c['a2a']]}, "
        "dispatch + combine in forward and backward. `ratio_vs_ours` = our step / theirs (below 1: we are faster); "
        "`exposed_a2a_s` = step minus the same contender at the smallest size; `simulated_s`: our simulator fed "
        "this contender's F, B, W and pair costs measured in situ in its own timed steps (ours, hook off: each "
        "action's span less its receive waits plus the runtime's gap before it; torch records no timeline, so "
        "its row uses the costs timed alone); `simulated_alone_s`: the simulator fed the costs timed alone on "
        "the expert group (all four processes running the same call in step), `alone_over_simulated` = step / "
        "that. `a2a_s`: one all_to_all right after a compute phase's sleep, as a chunk posts it.",
        "",
        markdown_table(result["rows"], _COLUMNS),
        "",
        f"- {result['reference']['skipped']}",
        f"- overlapped pairs run by the hook: {result['overlapped_pairs']}",
        f"- communication threads of each process at niceness {c['comm_nice']}, below its compute thread (threads "
        f"set per process: {result.get('comm_threads_lowered')}): on a GPU the copies do not take the compute's "
        "cores; here, at equal priority, a compute thread woken from its sleep waited behind them",
        f"- first-step gradients equal across contenders: {'yes' if g['equal'] else 'NO'} "
        f"({g['compared']} tensors; {g['rule']}){'' if g['mismatch'] is None else '; ' + g['mismatch']}",
        "- why: in the hook each all_to_all is in flight while the other chunk computes one phase (F/2 or B/2), "
        "and the sequential pairs (hook off, torch) expose all four all_to_alls of a pair at every size. Here an "
        "all_to_all is copies done by the CPU, so a hooked pair takes at least its four all_to_alls back to back "
        "(4 x a2a_s), at least its compute (F + B of sleep) and at least the backward's own chain of two "
        "exchanges and two compute halves (2 x a2a_s + B): below a chunk's compute the all_to_alls hide, "
        "above it the pair is bound by them. The native engine runs a rank's exchanges in posting order, so "
        "the one a compute phase waits for finishes first; gloo over TCP loopback copies each byte in the "
        "kernel on both sides and runs the pair's two in-flight all_to_alls side by side, sharing the cores, "
        "so both finish late (`--a2a gloo`)",
        f"- targets at a2a {t['a2a_bytes']} B (one all_to_all {t['a2a_s'] * 1e3:.3g} ms vs a chunk's forward "
        f"compute {t['chunk_forward_compute_s'] * 1e3:g} ms):",
    ]
    for k, v in t["values"].items():
        lines.append(f"  - {k}: {v:.3f} (target <= {t['limits'][k]}): {'met' if t['met'][k] else 'NOT met'}")
    lines.append(
        f"  - the hooked pair's floor (max(4 x a2a_s, F + B of compute, 2 x a2a_s + B)) is "
        f"{t['pair_floor_over_f_plus_b']:.3f} "
        f"of F + B here; the pair measured {t['pair_over_floor']:.2f} x that floor"
    )
    return "\n".join(lines)


def write_plots(result: dict[str, Any], out_dir: Any) -> list[Any]:
    """``moe_step_vs_a2a.png``: step time against all_to_all size per contender with the simulator's lines (in
    situ; for ours also from the costs timed alone) (top),
    and one all_to_all alone against the compute phases it has to hide behind (bottom)."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cfg = result["rows"], result["config"]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True, height_ratios=(2.2, 1))
    for name, style in zip(CONTENDERS, ("o-", "s-", "^-", "v-"), strict=True):
        pts = sorted((r["a2a_bytes"], r["step_s"], r["simulated_s"]) for r in rows if r["contender"] == name)
        xs = [p[0] for p in pts]
        line = ax.plot(xs, [p[1] for p in pts], style, label=f"{name} (measured)")[0]
        if name in ("ours", "ours-hook-off"):  # torch's pair is F then B, as our hook-off one: the same line
            ax.plot(xs, [p[2] for p in pts], "--", color=line.get_color(), alpha=0.7, label=f"{name} (simulator)")
        if name == "ours":  # the prediction from the costs timed alone, before any step ran
            alone = sorted((r["a2a_bytes"], r["simulated_alone_s"]) for r in rows if r["contender"] == name)
            ax.plot(
                [p[0] for p in alone], [p[1] for p in alone], ":", color=line.get_color(), alpha=0.8,
                label=f"{name} (simulator, costs timed alone)",
            )  # fmt: skip
    ax.set_xscale("symlog", linthresh=max(1, min(r["a2a_bytes"] for r in rows)))
    ax.set_ylabel("step time (s)")
    ax.set_title(
        "DualPipeV + expert all_to_all: F&B overlap hook vs sequential pairs\n"
        "(reference DualPipeV: skipped, the reason is in moe.md)",
        fontsize=9,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ours = sorted((r["a2a_bytes"], r["a2a_s"]) for r in rows if r["contender"] == "ours")
    ax2.plot([p[0] for p in ours], [p[1] * 1e3 for p in ours], "k.-", label="one all_to_all alone")
    ax2.axhline(cfg["f_s"] / 2 * 1e3, color="tab:green", ls=":", label="a forward phase (F/2): hides a backward a2a")
    ax2.axhline(cfg["b_s"] / 2 * 1e3, color="tab:red", ls=":", label="a backward phase (B/2): hides a forward a2a")
    ax2.set_xlabel("bytes per all_to_all (one rank's send buffer)")
    ax2.set_ylabel("ms")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    path = Path(out_dir) / "moe_step_vs_a2a.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
