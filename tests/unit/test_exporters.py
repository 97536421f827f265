"""Chrome-trace JSON and PNG timelines, from simulated events and from measured (rank, action, start, end) tuples."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from dualpipe_kernels.schedules import build_schedule, parse_action
from dualpipe_kernels.schedules.costs import CommModel, CostModel
from dualpipe_kernels.schedules.plot import plot_comparison, plot_overlay, plot_timeline
from dualpipe_kernels.schedules.simulator import SimEvent, SimResult, simulate
from dualpipe_kernels.schedules.trace import chrome_trace, chrome_trace_compare, to_events, write_chrome_trace


@pytest.fixture(scope="module")
def dualpipev_4x10() -> SimResult:
    comm = CommModel(latency=0.25, activation_bytes=1, bandwidth=4)
    return simulate(build_schedule("dualpipev", 4, 10), CostModel(f=1, b=2, w=1, fb=2.5), comm)


def measured_from(res: SimResult, scale: float = 1.0, shift: float = 0.0) -> list[tuple[int, str, float, float]]:
    """What the runtime records: (rank, action string, start_s, end_s)."""
    return [(e.rank, e.action, shift + float(e.start) * scale, shift + float(e.end) * scale) for e in res.events]


def test_chrome_trace_structure(dualpipev_4x10: SimResult, tmp_path: Path) -> None:
    res = dualpipev_4x10
    path = tmp_path / "trace.json"
    write_chrome_trace(path, res.events, schedule="dualpipev")
    trace = json.loads(path.read_text())
    assert trace["otherData"] == {"schedule": "dualpipev"}  # the format's free-form metadata key
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(res.events)
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {(r, f"rank {r}") for r in range(4)}
    threads = {(e["pid"], e["tid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {(r, t, n) for r in range(4) for t, n in ((0, "compute"), (1, "comm"))}
    for e, ev in zip(xs, res.events, strict=True):
        a = parse_action(e["name"])  # names are the torch notation and parse back
        assert str(a) == ev.action
        assert e["pid"] == ev.rank
        assert e["tid"] == (1 if a.is_comm else 0)
        assert e["ts"] == pytest.approx(float(ev.start) * 1e6)
        assert e["dur"] == pytest.approx(float(ev.end - ev.start) * 1e6) and e["dur"] >= 0
        assert e["args"]["microbatch"] == ev.microbatch and e["args"]["stage"] == ev.stage
    pair = next(e for e in xs if e["cat"] == "F&B")
    assert {"backward_stage", "backward_microbatch"} <= set(pair["args"])
    send = next(e for e in xs if e["cat"] == "SEND_F")
    assert send["args"]["peer"] == send["pid"] + 1  # DualPipeV's first leg goes down the ranks
    # the last compute on every rank ends no later than the makespan
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(float(res.makespan) * 1e6)


def test_measured_tuples_give_the_same_events(dualpipev_4x10: SimResult) -> None:
    res = dualpipev_4x10
    sched = res.lowered_schedule
    stages = [sched.stages_of_rank(r) for r in range(sched.num_ranks)]
    # strings: everything but the comm peer (not part of the string form) comes back
    from_strings = to_events(measured_from(res), stages)
    assert [_key(e) for e in from_strings] == [_key(e) for e in res.events]
    # Action objects (what the runtime holds) carry the peer too: identical events and traces
    actions = [a for acts in sched.actions for a in acts]
    measured = [(e.rank, a, e.start, e.end) for e, a in zip(res.events, actions, strict=True)]
    assert to_events(measured, stages) == res.events
    assert chrome_trace(measured) == chrome_trace(res.events)


def _key(e: SimEvent) -> tuple:
    return (
        e.rank,
        e.action,
        e.kind,
        float(e.start),
        float(e.end),
        e.stage,
        e.microbatch,
        e.track,
        e.stage2,
        e.microbatch2,
        e.chunk,
        e.chunk2,
        e.backward_kind,
    )


def test_chrome_trace_compare_offsets_measured_pids(dualpipev_4x10: SimResult, tmp_path: Path) -> None:
    res = dualpipev_4x10
    measured = measured_from(res, scale=1.1, shift=100.0)
    trace = chrome_trace_compare(res.events, measured)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {**{r: f"simulated rank {r}" for r in range(4)}, **{4 + r: f"measured rank {r}" for r in range(4)}}
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 2 * len(res.events)
    path = tmp_path / "cmp.json"
    write_chrome_trace(path, res.events, measured=measured)
    assert json.loads(path.read_text())["traceEvents"] == json.loads(json.dumps(trace["traceEvents"]))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ((0, "0F0", 2.0, 1.0), "ends before it starts"),
        ((0, "0F0", 1.0), "are \\(rank, action, start, end\\)"),
        ((0, "0X0", 0.0, 1.0), "cannot parse action"),
    ],
)
def test_bad_timeline_entries(entry: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        to_events([entry])


def test_png_timeline_readable_at_8x32(tmp_path: Path) -> None:
    res = simulate(build_schedule("dualpipe", 8, 32), CostModel(f=1, b=2, w=1, fb=2.5))
    path = tmp_path / "d.png"
    fig = plot_timeline(res, path)
    img = mpimg.imread(path)
    assert img.shape[0] > 500 and img.shape[1] > 1000  # width grows with the longest rank list
    ax = fig.axes[0]
    assert ax.get_title().startswith("dualpipe: 8 ranks, 16 stage chunks, 32 micro-batches")
    assert "bubble 4.5 " in ax.get_title()  # (8/2 - 1)(F&B + B - 3W) = 3 * 1.5
    # "readable": most compute boxes (pair halves counted apart) carry their micro-batch number
    boxes = sum(2 if e.kind == "F&B" else 1 for e in res.events if e.track == "compute")
    labels = [t.get_text() for t in ax.texts]
    assert len(labels) >= 0.9 * boxes
    assert all(t.isdigit() and int(t) < 32 for t in labels)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any(t.startswith("F (") for t in legend) and any("F&B" in t for t in legend)
    assert not any("transfer" in t for t in legend)  # no comm cost: no transfer band


def test_comparison_panels_share_time_axis(tmp_path: Path) -> None:
    costs = CostModel(f=2, b=4, w=2, fb=5)
    results = [simulate(build_schedule(name, 4, 8), costs) for name in ("1f1b", "dualpipe")]
    fig = plot_comparison(results, tmp_path / "c.png", "compared")
    assert [ax.get_title().split(":")[0] for ax in fig.axes] == ["1f1b", "dualpipe"]
    assert fig.axes[0].get_xlim() == fig.axes[1].get_xlim()
    assert fig.axes[0].get_xlim()[1] >= float(max(r.makespan for r in results))
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_png_with_comm_band_and_overlay(dualpipev_4x10: SimResult, tmp_path: Path) -> None:
    res = dualpipev_4x10
    fig = plot_timeline(res, tmp_path / "v.png")
    assert any("transfer" in t.get_text() for t in fig.legends[0].get_texts())
    measured = measured_from(res, scale=1.25, shift=7.0)  # a run 25% slower than predicted, offset in time
    fig = plot_overlay(res, measured, tmp_path / "o.png")
    assert fig.axes[0].get_title().endswith("measured / simulated makespan = 1.250")
    assert mpimg.imread(tmp_path / "o.png").shape[1] > 800
    # a timeline of plain tuples plots too
    fig = plot_timeline(measured, tmp_path / "m.png", title="measured")
    assert fig.axes[0].get_title() == "measured"
    with pytest.raises(ValueError, match="empty"):
        plot_timeline([], tmp_path / "e.png")
