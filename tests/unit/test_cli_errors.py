"""CLI numbers that are not numbers, and output paths that cannot be written.

Every case: exit status 2, one line on stderr naming the problem, nothing on
stdout, no traceback; an unwritable output is found before any work starts.
The API's cost models refuse inf like NaN.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dualpipe_kernels.cli import main
from dualpipe_kernels.schedules.costs import CommModel, CostModel
from dualpipe_kernels.schedules.generators import build_schedule

REPO = Path(__file__).resolve().parents[2]
BASE = ["simulate", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "4"]


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI in-process; assert exit 2, nothing on stdout and one line on stderr; return that line."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse errors
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, f"exit {code}, stderr:\n{err}"
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "extra",
    [
        ["--f", "inf"],
        ["--b", "inf"],
        ["--w=-inf"],
        ["--fb", "inf"],
        ["--activation-bytes", "inf", "--comm-bandwidth", "inf"],
        ["--comm-latency", "inf"],
        ["--inter-latency", "inf"],
        ["--f", "nan"],
    ],
)
def test_non_finite_numbers_are_refused(capsys, extra):
    err = one_line_error(capsys, [*BASE, *extra, "--json"])
    assert re.search(r"finite|NaN", err), err


def test_unlimited_bandwidth_stays_allowed(capsys):
    assert main([*BASE, "--comm-bandwidth", "inf", "--activation-bytes", "8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["comm"]["bandwidth"] is None


@pytest.mark.parametrize(
    "make",
    [
        lambda: CostModel(f=math.inf).resolve(build_schedule("1f1b", 2, 2)),
        lambda: CostModel(b=[2, math.inf]).resolve(build_schedule("1f1b", 2, 2)),
        lambda: CostModel(fb=math.inf).resolve(build_schedule("1f1b", 2, 2)),
        lambda: CommModel(activation_bytes=math.inf),
        lambda: CommModel(latency=math.inf),
        lambda: CommModel(inter_latency=math.nan),
    ],
)
def test_cost_models_refuse_inf_like_nan(make):
    with pytest.raises(ValueError, match=r"finite"):
        make()


def _blocked_path(tmp_path: Path, name: str) -> str:
    """A path that cannot be written, even by root: its parent is a regular file."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    return str(blocker / name)


@pytest.mark.parametrize("option,name", [("--png", "t.png"), ("--trace", "t.json"), ("--csv", "t.csv")])
def test_unwritable_export_path_is_one_line_before_work(capsys, tmp_path, option, name):
    path = _blocked_path(tmp_path, name)
    # a schedule big enough that simulating it first would take seconds
    argv = ["simulate", "--schedule", "1f1b", "--ranks", "64", "--microbatches", "512", option, path]
    t0 = time.perf_counter()
    err = one_line_error(capsys, argv)
    assert time.perf_counter() - t0 < 1.0, "the path was checked after the work"
    assert option in err and path in err and "cannot write" in err


def test_export_path_that_is_a_directory(capsys, tmp_path):
    err = one_line_error(capsys, [*BASE, "--png", str(tmp_path)])
    assert "is a directory" in err


def test_writable_export_paths_still_work(capsys, tmp_path):
    paths = {opt: str(tmp_path / f"out{ext}") for opt, ext in (("--png", ".png"), ("--trace", ".json"))}
    paths["--csv"] = str(tmp_path / "out.csv")
    argv = [*BASE, "--json"]
    for opt, p in paths.items():
        argv += [opt, p]
    assert main(argv) == 0
    capsys.readouterr()
    assert all(os.path.getsize(p) > 0 for p in paths.values())


def test_bench_unwritable_out_fails_before_running(tmp_path):
    out = _blocked_path(tmp_path, "results")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "dualpipe_kernels", "bench", "schedules", "--quick", "--out", out],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=REPO,
    )
    elapsed = time.perf_counter() - t0
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert "--out" in p.stderr and "cannot write" in p.stderr
    assert p.stdout == ""
    assert elapsed < 30, f"took {elapsed:.1f} s: the suite ran before the check"


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--memory-policy", "offload", "--reload-lookahead", "-3"], "--reload-lookahead"),
        (["--memory-policy", "compress:bf16", "--compress-cost", "-0.0005"], "--compress-cost"),
        (["--activation-bytes", "1e308", "--comm-bandwidth", "1e-10"], "no finite time"),
        (["--memory-policy", "offload", "--host-bandwidth", "0"], "--host-bandwidth"),
        (["--memory-policy", "offload", "--kept-bytes", "-1"], "--kept-bytes"),
        (["--f", "1e308", "--b", "1e308", "--w", "1", "--fb", "1e308"], "overflow"),
    ],
)
def test_numbers_that_would_give_wrong_results_are_refused(capsys, extra, words):
    err = one_line_error(capsys, [*BASE, *extra])
    assert words in err, err


def test_a_schedule_beyond_the_simulator_is_refused_at_once(capsys):
    t0 = time.perf_counter()
    err = one_line_error(capsys, ["simulate", "--schedule", "1f1b", "--ranks", "100000", "--microbatches", "200000"])
    assert time.perf_counter() - t0 < 2 and "at most 200,000" in err, err


def test_png_goes_to_exactly_the_named_path(capsys, tmp_path):
    out = tmp_path / "out"
    assert main([*BASE, "--png", str(out)]) == 0
    capsys.readouterr()
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "out.png").exists()


def _layers_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "layers.json"
    path.write_text(text)
    return str(path)


PLAN = ["--devices", "2", "--memory-gb", "80", "--global-batch", "8"]


def _row(name: str, f_s: str = "1") -> str:
    fields = {"b_s": 2, "w_s": 1, "activation_bytes": 1, "param_bytes": 1, "boundary_bytes": 1}
    return json.dumps({"name": name, **fields})[:-1] + f', "f_s": {f_s}}}'


def test_plan_refuses_a_400_digit_cost_and_deep_nesting(capsys, tmp_path):
    table = '{"layers": [' + _row("x", "1" + "0" * 400) + "]}"
    err = one_line_error(capsys, ["plan", "--layers", _layers_file(tmp_path, table), *PLAN])
    assert "f_s" in err and "401 digits" in err
    deep = '{"layers": ' + "[" * 100_000 + "]" * 100_000 + "}"
    err = one_line_error(capsys, ["plan", "--layers", _layers_file(tmp_path, deep), *PLAN])
    assert "nests too deeply" in err


def test_plan_checks_out_before_work_and_refuses_huge_batches(capsys, tmp_path):
    layers = _layers_file(tmp_path, '{"layers": [' + ",".join(_row(f"b{i}") for i in range(300)) + "]}")
    t0 = time.perf_counter()
    err = one_line_error(capsys, ["plan", "--layers", layers, *PLAN, "--out", "/no/such/dir/x.json"])
    assert time.perf_counter() - t0 < 2 and "--out /no/such/dir/x.json" in err
    err = one_line_error(capsys, ["plan", "--layers", layers, *PLAN[:4], "--global-batch", "1000000000000"])
    assert "at most 16,777,216" in err


def test_demo_refuses_a_non_finite_learning_rate(capsys):
    for lr in ("inf", "nan"):
        err = one_line_error(capsys, ["demo", "--lr", lr])
        assert "--lr must be a finite number > 0" in err, err


def test_bench_transport_refuses_zero_engine_sizes():
    import argparse

    from dualpipe_kernels.benchmarks.transport import TransportConfig, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    for argv, option in ((["--slot-bytes", "0"], "--slot-bytes"), (["--num-slots", "0"], "--num-slots")):
        with pytest.raises(ValueError, match=option):
            TransportConfig.from_args(p.parse_args(argv))
    assert TransportConfig.from_args(p.parse_args(["--slot-bytes", "4096"])).slot_bytes == 4096
