"""`dualpipe-kernels simulate`: the docs/architecture.md contract, exports, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dualpipe_kernels.cli import main
from dualpipe_kernels.schedules import build_schedule, load_csv

REPO = Path(__file__).resolve().parents[2]
CONTRACT_KEYS = {
    "schedule",
    "ranks",
    "stages",
    "microbatches",
    "makespan",
    "bubble",
    "bubble_per_rank",
    "bubble_ratio",
    "peak_activations",
    "peak_activations_per_rank",
    "params_per_rank",
    "p2p_bytes",
}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "dualpipe_kernels", "simulate", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=REPO,
    )


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["simulate", *args, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one JSON object, one line
    return json.loads(out)


def test_json_contract_subprocess() -> None:
    p = run_cli(
        "--schedule",
        "dualpipev",
        "--ranks",
        "4",
        "--microbatches",
        "10",
        "--f",
        "3",
        "--b",
        "5",
        "--w",
        "2",
        "--fb",
        "6",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert CONTRACT_KEYS <= set(d)
    assert (d["schedule"], d["ranks"], d["stages"], d["microbatches"]) == ("dualpipev", 4, 8, 10)
    assert d["bubble"] == 3 * (6 + 5 - 3 * 2) == d["reference_bubble"]
    assert d["bubble"] == max(d["bubble_per_rank"])
    assert d["bubble_ratio"] == pytest.approx(d["bubble"] / d["makespan"])
    assert d["peak_activations"] == 9 and d["peak_activations_per_rank"] == [9] * 4
    assert d["params_per_rank"] == 2 and d["p2p_bytes"] == 0


@pytest.mark.parametrize(
    ("schedule", "ranks", "n", "bubble", "peak", "params"),
    [
        ("1f1b", 4, 8, 3 * 3, 4, 1),
        ("zb1p", 4, 8, 3 * 1, 4, 1),
        ("dualpipe", 4, 8, 1 * 2, 5, 2),
        ("gpipe", 4, 8, 3 * 3, 8, 1),
    ],
)
def test_json_values(
    capsys: pytest.CaptureFixture[str], schedule: str, ranks: int, n: int, bubble: int, peak: int, params: int
) -> None:
    # defaults F=1, B=2, W=1 (F = B - W = W), F&B = F + B = 3: the reference table's regime
    d = run_json(capsys, "--schedule", schedule, "--ranks", str(ranks), "--microbatches", str(n))
    assert (d["bubble"], d["peak_activations"], d["params_per_rank"]) == (bubble, peak, params)


def test_interleaved_stages_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(
        capsys, "--schedule", "interleaved1f1b", "--ranks", "2", "--microbatches", "4", "--stages-per-rank", "3"
    )
    assert d["stages"] == 6 and d["params_per_rank"] == 3


def test_comm_flags_change_the_result(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--schedule", "1f1b", "--ranks", "2", "--microbatches", "2"]
    free = run_json(capsys, *base)
    assert free["makespan"] == 9
    # 2-rank 1F1B: two hops on the critical path, each latency 0.5 + 4 bytes / 8 B/s = 1
    lat = run_json(capsys, *base, "--comm-latency", "0.5", "--comm-bandwidth", "8", "--activation-bytes", "4")
    assert lat["makespan"] == 11 and lat["p2p_bytes"] == 16
    blocking = run_json(capsys, *base, "--comm-latency", "0.5", "--blocking-comm")
    assert blocking["makespan"] == 10.5 and blocking["comm"]["blocking"] is True
    # ranks on separate nodes use the inter-node latency
    inter = run_json(capsys, *base, "--comm-latency", "0.5", "--ranks-per-node", "1", "--inter-latency", "2")
    assert inter["makespan"] == 13


def test_human_summary_and_ascii(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "dualpipev", "--ranks", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "dualpipev: 2 ranks, 4 stages, 4 micro-batches" in out
    assert "simulated / reference = 1.000" in out
    assert "rank 0 |" in out and "rank 1 |" in out  # the ASCII grid


def test_exports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, png, csv = tmp_path / "t.json", tmp_path / "t.png", tmp_path / "t.csv"
    d = run_json(
        capsys,
        "--schedule",
        "dualpipe",
        "--ranks",
        "4",
        "--microbatches",
        "8",
        "--trace",
        str(trace),
        "--png",
        str(png),
        "--csv",
        str(csv),
    )
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" and e["tid"] == 0 for e in events) == sum(
        len(a) for a in build_schedule("dualpipe", 4, 8).actions
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    loaded = load_csv(csv, name="dualpipe")
    assert loaded.actions == build_schedule("dualpipe", 4, 8).actions
    assert d["schedule"] == "dualpipe"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--schedule", "dualpipe", "--ranks", "3", "--microbatches", "12"], "even number of ranks"),
        (["--schedule", "dualpipev", "--ranks", "4", "--microbatches", "6"], "micro-batches >= 2 * ranks"),
        (["--schedule", "1f1b", "--ranks", "2", "--microbatches", "4", "--f", "-1"], "F must be > 0"),
        (["--schedule", "1f1b", "--ranks", "2", "--microbatches", "4", "--w", "3"], "W must be < B"),
        (["--schedule", "1f1b", "--ranks", "2", "--microbatches", "4", "--fb", "9"], "F&B must satisfy"),
        (["--schedule", "1f1b", "--ranks", "2", "--microbatches", "4", "--comm-bandwidth", "0"], "bandwidth must be"),
        (["--schedule", "nope", "--ranks", "2", "--microbatches", "4"], "invalid choice"),
        (["--schedule", "1f1b", "--ranks", "2", "--microbatches", "4", "--f", "abc"], "not a number"),
        (["--schedule", "1f1b", "--ranks", "0", "--microbatches", "4"], "ranks >= 1"),
        (["--ranks", "2", "--microbatches", "4"], "required: --schedule"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:  # argparse errors exit from inside parse_args
        code = main(["simulate", *args])
        raise SystemExit(code)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_bad_arguments_subprocess_no_traceback() -> None:
    for args in (
        ["--schedule", "dualpipe", "--ranks", "3", "--microbatches", "12"],
        ["--schedule", "1f1b", "--ranks", "2", "--microbatches", "4", "--b", "0"],
    ):
        p = run_cli(*args)
        assert p.returncode == 2
        assert p.stdout == "" and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
        assert p.stderr.startswith("dualpipe-kernels simulate: error:")
