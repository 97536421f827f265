"""overlap: share of communication hidden behind compute, per transport, size and boundary format (sleep stages).

For each transport, activation size and boundary format (``--formats``: how
stage-boundary messages travel, e.g. ``none,fp8``; ``Pipeline(boundary_format=)``)
one DualPipeV pipeline on the same
ranks measures the three terms of :mod:`.metrics` (see :mod:`.sleep_runs`):
``T_step`` (stages sleep F / I / W and exchange the set size), ``T_compute``
(the same pipeline with every transfer cut to a few bytes) and ``T_comm`` (the
step's transfers alone, timed on the link measured in the same processes).
``exposed_comm_s = T_step - T_compute``; ``hidden_comm_share = 1 -
exposed_comm_s / T_comm`` (null, flagged as noise, when the raw value leaves
[0, 1]).  Real and cut steps alternate; ``exposed_comm_paired_s`` is the median
over steps of each real step minus the cut step beside it (a load that changes
during the run cancels in each pair).  Beside it, the simulator's exposed communication for the same step
with the measured link latency and bandwidth: what the schedule itself forces.
Each figure is a median over steps of the slowest rank's step time.  With a
packed format, packing and unpacking run in both ``T_step`` and ``T_compute``
(the probe cuts transfers, not the packing), so ``exposed_comm_s`` is the
communication left exposed; ``t_step_s`` side by side gives the whole effect.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Any

from dualpipe_kernels.benchmarks.sleep_runs import SleepRun
from dualpipe_kernels.runtime.boundary.codec import BOUNDARY_FORMATS

NAME = "overlap"
TRANSPORTS = ("torch", "native")

__all__ = ["NAME", "TRANSPORTS", "OverlapConfig", "add_arguments", "run", "to_markdown"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dualpipe_kernels.benchmarks.common import int_list
    from dualpipe_kernels.benchmarks.sleep_runs import add_sleep_arguments

    p.add_argument("--transports", default=",".join(TRANSPORTS), help="comma list (default torch,native)")
    p.add_argument(
        "--sizes",
        type=int_list,
        default=None,
        help="activation bytes per transfer, comma list (default 1048576,8388608; quick 65536)",
    )
    p.add_argument("--ranks", type=int, default=2, help="pipeline ranks (default 2)")
    p.add_argument(
        "--formats",
        default="none",
        help=f"boundary formats, comma list among {', '.join(BOUNDARY_FORMATS)} (default none; e.g. none,fp8)",
    )
    add_sleep_arguments(p, microbatches=(8, 4))


@dataclass(frozen=True)
class OverlapConfig:
    """The suite's settings: transports, sizes and boundary formats to compare, and the DualPipeV sleep run."""

    transports: tuple[str, ...]
    sizes: tuple[int, ...]
    run: SleepRun
    formats: tuple[str, ...] = ("none",)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OverlapConfig:
        from dualpipe_kernels.schedules.generators import build_schedule

        text = str(getattr(args, "transports", ",".join(TRANSPORTS)))
        transports = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [t for t in transports if t not in TRANSPORTS]
        if not transports or bad:
            raise ValueError(f"--transports must be among {', '.join(TRANSPORTS)}, got {text}")
        text = str(getattr(args, "formats", None) or "none")
        formats = tuple(f.strip() for f in text.split(",") if f.strip())
        bad = [f for f in formats if f not in BOUNDARY_FORMATS]
        if not formats or bad:
            raise ValueError(f"--formats must be among {', '.join(BOUNDARY_FORMATS)}, got {text}")
        quick = getattr(args, "quick", False)
        sizes = getattr(args, "sizes", None) or ([1 << 16] if quick else [1 << 20, 1 << 23])
        run = SleepRun.from_args(args, microbatches=(8, 4), activation_bytes=(sizes[0], sizes[0]))
        run = dataclasses.replace(run, ranks=int(getattr(args, "ranks", 2)))
        cfg = cls(transports, tuple(sizes), run, formats)
        build_schedule("dualpipev", cfg.run.ranks, cfg.run.microbatches)  # ValueError naming the constraint
        return cfg

    def as_dict(self) -> dict[str, Any]:
        """Flat, JSON-ready: the run's costs beside the transports and sizes."""
        skip = ("transport", "activation_bytes", "boundary_format")
        run = {k: v for k, v in dataclasses.asdict(self.run).items() if k not in skip}
        return {"transports": list(self.transports), "sizes": list(self.sizes), "formats": list(self.formats), **run}

    def cases(self) -> list[tuple[str, int, str]]:
        """(transport, size, format) of every row, in order (formats side by side)."""
        return [(tr, size, fmt) for tr in self.transports for size in self.sizes for fmt in self.formats]


def _key(tr: str, size: int, fmt: str) -> str:
    return f"{tr}/{size}/{fmt}"


def _worker(rank: int, world: int, cfg: OverlapConfig) -> dict[str, Any]:
    from dualpipe_kernels.benchmarks.sleep_runs import measure_sleep_pipeline

    out: dict[str, Any] = {}
    for tr, size, fmt in cfg.cases():
        key = _key(tr, size, fmt)
        try:
            run = dataclasses.replace(cfg.run, transport=tr, activation_bytes=size, boundary_format=fmt)
            out[key] = measure_sleep_pipeline(rank, run)
        except Exception as e:  # noqa: BLE001 - reported in the row
            out[key] = f"{type(e).__name__}: {e}".splitlines()[0]
        if rank == 0:
            sys.stderr.write(f"  bench overlap: {tr} {size} bytes {fmt} done\n")
    return out


def _row(
    cfg: OverlapConfig, case: tuple[str, int, str], per_rank: list[Any], sim_free: float, chunks: Any
) -> dict[str, Any]:
    from dualpipe_kernels.benchmarks.sleep_runs import overlap_terms, simulate_sleep
    from dualpipe_kernels.schedules.costs import CommModel

    tr, size, fmt = case
    row: dict[str, Any] = {
        "transport": tr,
        "boundary_format": fmt,
        "ranks": cfg.run.ranks,
        "microbatches": cfg.run.microbatches,
        "activation_bytes": size,
        "simulated_compute_s": sim_free,
    }
    err = next((m for m in (o[_key(*case)] for o in per_rank) if isinstance(m, str)), None)
    if err is not None:
        row.update(error=err, hidden_comm_share=None, exposed_comm_s=None)
        return row
    terms = overlap_terms([o[_key(*case)] for o in per_rank])
    row.update(terms, step_s=terms["t_step_s"])
    if "link_latency_s" in terms:
        # the simulator's activation size: what one transfer of this format really moved
        moved = max((b for o in per_rank for b in o[_key(*case)].received_bytes), default=size)
        link = CommModel(terms["link_latency_s"], terms["link_bandwidth_gbps"] * 1e9, moved)
        row["wire_bytes_per_transfer"] = moved
        with_comm = float(simulate_sleep("dualpipev", cfg.run.ranks, cfg.run.microbatches, chunks, link).makespan)
        row.update(
            simulated_with_comm_s=with_comm,
            simulated_exposed_comm_s=with_comm - sim_free,
            compute_vs_simulated=terms["t_compute_s"] / sim_free,
        )
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dualpipe_kernels.benchmarks.common import Progress
    from dualpipe_kernels.benchmarks.sleep_runs import nominal_chunks, simulate_sleep
    from dualpipe_kernels.benchmarks.sleep_stages import sleep_overshoot
    from dualpipe_kernels.runtime.launch import spawn

    cfg = OverlapConfig.from_args(args)
    bar = Progress(1, title="bench overlap")
    bar.note(
        f"transports {list(cfg.transports)}, sizes {list(cfg.sizes)}, formats {list(cfg.formats)}, "
        f"dualpipev {cfg.run.ranks} ranks"
    )
    t0 = time.perf_counter()
    per_rank = spawn(_worker, cfg.run.ranks, cfg, timeout_s=900, pg_timeout_s=300)
    over = sleep_overshoot(cfg.run.f_s, repeats=10)
    chunks = nominal_chunks(cfg.run.f_s, cfg.run.b_s, cfg.run.w_s, over)
    sim = float(simulate_sleep("dualpipev", cfg.run.ranks, cfg.run.microbatches, chunks).makespan)
    rows = [_row(cfg, case, per_rank, sim, chunks) for case in cfg.cases()]
    bar.update(f"done in {time.perf_counter() - t0:.1f} s")
    bar.close()
    return {"rows": rows, "config": {**cfg.as_dict(), "sleep_overshoot_s": over}}


def to_markdown(result: dict[str, Any]) -> str:
    from dualpipe_kernels.benchmarks.common import markdown_table
    from dualpipe_kernels.benchmarks.metrics import METRIC_SENTENCE, share_text

    c = result.get("config", {})
    head = (
        f"DualPipeV, {c.get('ranks')} ranks x {c.get('microbatches')} micro-batches, sleep-timed stages "
        f"F={c.get('f_s', 0) * 1e3:g} ms, B={c.get('b_s', 0) * 1e3:g} ms, W={c.get('w_s', 0) * 1e3:g} ms. "
        + METRIC_SENTENCE
        + " Real and cut steps alternate; 'exposed, paired': median over steps of real minus the cut step "
        "beside it (steadier under a changing load)."
        + " 'exposed simulated': the simulator with the measured link minus free communication (what the "
        "schedule itself forces); T_compute is also compared with the simulator fed the sleeps."
    )
    rows = [
        {**r, "hidden_text": share_text(r.get("hidden_comm_share"), r.get("hidden_comm_share_raw"))}
        for r in result["rows"]
    ]
    cols = [
        ("transport", "transport"),
        ("activation_bytes", "bytes per transfer"),
        ("boundary_format", "format"),
        ("t_step_s", "T_step (s)"),
        ("t_compute_s", "T_compute (s)"),
        ("t_comm_s", "T_comm (s)"),
        ("exposed_comm_s", "exposed (s)"),
        ("exposed_comm_paired_s", "exposed, paired (s)"),
        ("simulated_exposed_comm_s", "exposed simulated (s)"),
        ("hidden_text", "comm hidden"),
        ("link_bandwidth_gbps", "link GB/s"),
        ("compute_vs_simulated", "T_compute / simulated"),
        ("error", "error"),
    ]
    return head + "\n\n" + markdown_table(rows, [k for k, _ in cols], [h for _, h in cols])
