"""CSV in torch.distributed.pipelining's format (round trip, torch parses it) and the ASCII grid."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest

from dualpipe_kernels.schedules import (
    SCHEDULE_NAMES,
    Schedule,
    build_schedule,
    load_csv,
    lower_comms,
    to_ascii,
    to_csv,
    validate,
)
from dualpipe_kernels.schedules.csv_io import TorchCSVWarning, csv_text, torch_incompatibility

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

CASES = [
    ("dualpipe", 4, 8, None),
    ("dualpipev", 3, 7, None),
    ("dualpipev", 1, 2, None),
    ("1f1b", 3, 5, None),
    ("gpipe", 2, 3, None),
    ("interleaved1f1b", 2, 4, 3),
    ("zb1p", 4, 6, None),
    ("zbv", 3, 4, None),
]


def _same(a: Schedule, b: Schedule, with_name: bool = True) -> None:
    if not with_name:
        b = dataclasses.replace(b, name=a.name)
    assert a == b
    # Schedule equality ignores peers; check them too.
    assert [[x.peer for x in r] for r in a.actions] == [[x.peer for x in r] for r in b.actions]


@pytest.mark.parametrize("name, ranks, n, v", CASES)
def test_round_trip_with_name(tmp_path: Path, name: str, ranks: int, n: int, v: int | None) -> None:
    s = build_schedule(name, ranks, n, v)
    path = tmp_path / "s.csv"
    to_csv(s, path)
    _same(s, load_csv(path, name=name, stages_per_rank=v))


@pytest.mark.parametrize("name, ranks, n, v", CASES)
def test_round_trip_inferring_the_topology(name: str, ranks: int, n: int, v: int | None) -> None:
    s = build_schedule(name, ranks, n, v)
    loaded = load_csv(io.StringIO(csv_text(s)))
    assert loaded.name == "csv"
    _same(s, loaded, with_name=False)  # DualPipe's two directions and copies are recovered too
    validate(loaded)


def test_lowered_round_trip_restores_peers(tmp_path: Path) -> None:
    low = lower_comms(build_schedule("dualpipe", 4, 8))
    path = tmp_path / "low.csv"
    with pytest.warns(TorchCSVWarning, match="second direction"):  # ours reads it back; torch cannot run it
        to_csv(low, path, include_comms=True)
    loaded = load_csv(path, name="dualpipe")
    assert loaded.lowered
    _same(low, loaded)
    validate(loaded)
    # Without include_comms only the compute actions are written.
    assert "SEND" not in csv_text(low)
    with pytest.warns(TorchCSVWarning):
        assert "SEND" in csv_text(low, include_comms=True)


@pytest.mark.filterwarnings("ignore::dualpipe_kernels.schedules.csv_io.TorchCSVWarning")
@pytest.mark.parametrize("name, ranks, n, v", CASES)
def test_torch_parses_every_cell(name: str, ranks: int, n: int, v: int | None) -> None:
    s = build_schedule(name, ranks, n, v)
    rows = [line.split(",") for line in csv_text(lower_comms(s), include_comms=True).splitlines()]
    for row in rows:
        for cell in row:
            action = torch_schedules._Action.from_str(cell)
            assert action is not None and repr(action) == cell


@pytest.mark.parametrize("name, ranks, n, v", [c for c in CASES if c[0] != "dualpipe"])
def test_torch_validator_accepts_single_path_schedules(name: str, ranks: int, n: int, v: int | None) -> None:
    # torch assumes every stage sees every micro-batch: true of all but DualPipe's two directions.
    s = build_schedule(name, ranks, n, v)
    rows = [line.split(",") for line in csv_text(s).splitlines()]
    actions = {r: [torch_schedules._Action.from_str(c) for c in row] for r, row in enumerate(rows)}
    mapping = torch_schedules._validate_schedule(actions, ranks, s.num_stages, n)
    assert mapping == dict(enumerate(s.stage_to_rank))


def test_torch_written_csv_with_empty_cells_loads() -> None:
    # torch writes idle slots as empty cells.
    text = "0F0,,0F1,0B0,0B1\n,1F0,1B0,1F1,1B1\n"
    s = load_csv(io.StringIO(text), name="1f1b")
    assert s.to_strings() == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    validate(s)


def test_bad_csv() -> None:
    with pytest.raises(ValueError, match="row 1 .*column 2"):
        load_csv(io.StringIO("0F0,0B0\n1F0,1B0,1X0\n"))
    with pytest.raises(ValueError, match="stage 0 appears on ranks 0 and 1"):
        load_csv(io.StringIO("0F0,0B0\n0F1,0B1\n"))
    with pytest.raises(ValueError, match="no rows"):
        load_csv(io.StringIO(""))


# ---- ASCII ------------------------------------------------------------------------------


def test_ascii_grid() -> None:
    s = build_schedule("dualpipev", 2, 4)
    text = to_ascii(s)
    lines = text.splitlines()
    assert lines[0] == "dualpipev: 2 ranks, 4 stages, 4 micro-batches"
    assert lines[1].startswith("step   | 0   1   2")
    assert lines[2].split("|")[1].split() == [
        "0F0", "0F1", "0F2", "3F0", "3I0", "3W0", "3F1", "0F3+3B1", "3F2+0B0", "3B2", "3F3+0B1", "3B3",
        "0I2", "0W2", "0I3", "0W3",
    ]  # fmt: skip

    # Columns line up: every row's cells start at the same offsets as the header's.
    def starts(line: str) -> set[int]:
        bar = line.index("|")
        return {i for i in range(bar + 1, len(line)) if line[i] != " " and line[i - 1] == " "}

    assert {line.index("|") for line in lines[1:]} == {7}
    for row in lines[2:]:
        assert starts(row) <= starts(lines[1])


def test_ascii_lowered_and_cut() -> None:
    low = lower_comms(build_schedule("1f1b", 2, 2))
    full = to_ascii(low)
    assert "(lowered)" in full and "SEND_F" in full
    no_comm = to_ascii(low, comms=False)
    assert "SEND" not in no_comm and "RECV" not in no_comm
    cut = to_ascii(low, max_steps=3)
    assert all(line.endswith("...") for line in cut.splitlines()[1:])


def test_every_schedule_prints() -> None:
    for name in SCHEDULE_NAMES:
        s = build_schedule(name, 2, 4)
        assert len(to_ascii(s).splitlines()) == 2 + s.num_ranks


def test_compute_comms_csv_scales_like_torch_and_reads_torch_dumps() -> None:
    low = lower_comms(build_schedule("zb1p", 2, 3))
    rows = [line.split(",") for line in csv_text(low, include_comms=True).splitlines()]
    # REDUCE_GRAD once per stage, right after its last W (where torch divides the gradients by N).
    assert [c for c in rows[0] if "REDUCE" in c] == ["0REDUCE_GRAD"] and rows[0][-1] == "0REDUCE_GRAD"
    assert rows[1][rows[1].index("1W2") + 1] == "1REDUCE_GRAD"
    torch_dump = [["0UNSHARD", *rows[0][:-1], "0RESHARD", "0REDUCE_GRAD"], ["1UNSHARD", *rows[1]]]
    loaded = load_csv(io.StringIO("\n".join(",".join(r) for r in torch_dump)), name="zb1p")
    _same(low, loaded)
    assert torch_incompatibility(build_schedule("dualpipev", 2, 4)) is None
    assert "second direction" in (torch_incompatibility(build_schedule("dualpipe", 2, 4)) or "")
    with pytest.raises(ValueError, match="lowered"):
        csv_text(build_schedule("1f1b", 2, 2), include_comms=True)
