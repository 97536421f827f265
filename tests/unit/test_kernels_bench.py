"""``dualpipe-kernels bench kernels``: the JSON contract of a quick run, and the files it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = ("kernel", "format", "num_tensors", "bytes", "ours_gbps", "copy_gbps", "torch_gbps", "device")


@pytest.mark.timeout(300)
def test_bench_kernels_quick_json_contract(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = ["bench", "kernels", "--quick", "--samples", "1", "--num-tensors", "1,3", "--json", "--out", str(tmp_path)]
    # (plots on: the PNG is checked below)
    cmd = [sys.executable, "-m", "dualpipe_kernels", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    rows = res["rows"]
    expected = {(k, f, d, n, s) for k in ("pack", "unpack") for f in ("packed", "bf16", "fp8") for d in ("fp32", "bf16")
                for n in (1, 3) for s in (64 * 1024, 1024 * 1024)}  # fmt: skip
    assert {(r["kernel"], r["format"], r["dtype"], r["num_tensors"], r["bytes"]) for r in rows} == expected
    for r in rows:
        assert all(k in r for k in ROW_KEYS), r
        assert all(r[k] > 0 for k in ("ours_gbps", "copy_gbps", "torch_gbps")), r
        assert r["ours_vs_torch"] == pytest.approx(r["ours_gbps"] / r["torch_gbps"])
        # one call's time from the bandwidth, and the host's time per call (on the CPU the whole call:
        # the same order as the timed figure, though from other samples)
        moved = r["bytes"] + r["wire_bytes"]
        assert r["ours_us"] == pytest.approx(moved / r["ours_gbps"] / 1e3)
        # (no ratio between the two: they come from different samples, and a loaded machine skews either)
        assert 0 < r["ours_host_us"] < float("inf")
        want_wire = {"packed": 1.0, "bf16": 0.5, "fp8": 0.26}[r["format"]] * 4 / (4 if r["dtype"] == "fp32" else 2)
        want_wire = 1.0 if r["format"] == "packed" or (r["format"], r["dtype"]) == ("bf16", "bf16") else want_wire
        assert r["wire_bytes"] <= want_wire * r["bytes"] + 16 * r["num_tensors"]
        if r["device"] == "cpu":
            assert r["backend"] == "torch fallback"
    assert "torch fallback" in (tmp_path / "kernels.md").read_text()
    written = json.loads((tmp_path / "kernels.json").read_text())
    assert written["rows"] == rows and "stamp" in written
    assert (tmp_path / "kernels_bandwidth.png").stat().st_size > 0


def test_variants_parse_and_name_a_bad_one() -> None:
    import argparse

    from dualpipe_kernels.benchmarks.kernels import _variants

    assert _variants("16x8, 32X4, 16x32g") == [(16, 8, False), (32, 4, False), (16, 32, True)]
    for bad in ("16", "16x", "12x8", "16x0", "axb"):
        with pytest.raises(argparse.ArgumentTypeError, match="--variants"):
            _variants(bad)


def test_variants_restore_the_launch_shape_and_are_skipped_without_a_gpu(tmp_path: Path) -> None:
    import argparse

    from dualpipe_kernels.benchmarks import kernels as kb
    from dualpipe_kernels.kernels import pack_triton as pt

    before = (pt.rows_override, pt.PROGRAMS_PER_SM, pt.specialize)
    args = argparse.Namespace(quick=True, formats="packed", sizes=[64 << 10], max_size=None, num_tensors=[1],
                              samples=1, device="cpu", variants=[(32, 2, False)])  # fmt: skip
    res = kb.run(args)
    # pack and unpack of fp32 and bf16 inputs (quick); variants need Triton on a GPU
    assert res["variants"] == [] and len(res["rows"]) == 4
    assert (pt.rows_override, pt.PROGRAMS_PER_SM, pt.specialize) == before


@pytest.mark.device_build
@pytest.mark.timeout(300)
def test_bench_kernels_sass_json_rows(tmp_path: Path) -> None:
    """``--sass``: one row per launch variant with the contract's keys (installed Triton only here: the
    GPU machine's is covered by tests/process/test_kernels_offline.py)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    args = ["bench", "kernels", "--sass", "--formats", "packed", "--other-triton", "none", "--json", "--no-plots",
            "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "dualpipe_kernels", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=280)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    keys = {"kernel", "format", "variant", "contiguous", "triton_version", "registers", "programs_per_sm",
            "sass_per_element"}  # fmt: skip
    assert res["mode"] == "sass" and len(res["rows"]) == 12  # fp32, 2-byte, mixed x pack/unpack x contiguous/not
    for r in res["rows"]:
        assert keys <= set(r) and r["format"] == "packed" and r["registers"] > 0
        if r["contiguous"] and r["variant"] != "mixed":
            assert 0 < r["sass_per_element"] <= 4 and r["registers"] <= 64, r
