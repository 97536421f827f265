"""The ``cuda_ipc`` bench suite: a clean one-line skip without CUDA, its sweep and report; a quick GPU run."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dualpipe_kernels.benchmarks import cuda_ipc

HAS_GPU = torch.cuda.is_available()


@pytest.mark.skipif(HAS_GPU, reason="checks the machine without a GPU")
def test_without_cuda_the_suite_says_so_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dualpipe_kernels", "bench", "cuda_ipc", "--json", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "skipped: needs CUDA" in lines[0], proc.stderr
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []
    assert cuda_ipc.unavailable() is not None
    with pytest.raises(RuntimeError, match="^needs CUDA"):
        cuda_ipc.run(argparse.Namespace(quick=True))


def test_sweep_sizes_and_size_parsing() -> None:
    assert cuda_ipc.sizes_between(64 << 10, 256 << 20) == [(64 << 10) * 4**i for i in range(7)]
    assert cuda_ipc.sizes_between(3, 40) == [3, 12, 40]
    assert [cuda_ipc._size(s) for s in ("4K", "256MiB", "1G", "100")] == [4096, 256 << 20, 1 << 30, 100]


def test_report_judges_bandwidth_from_64_mib_and_prints_the_host_cost() -> None:
    row = {"messages": 8, "ipc_gbps": 100.0, "d2d_gbps": 200.0, "ratio": 0.5, "us_per_msg": 30.0}
    result = {
        "device": "H200", "staging": "ipc", "staging_requested": "auto", "num_slots": 4, "slot_bytes": 4 << 20,
        "direct_min_bytes": 1 << 20, "rows": [{"size_bytes": 64 << 20, **row}], "bandwidth_min_size": 64 << 20,
        "bandwidth_ratio_min": 0.5, "bandwidth_target_ratio": 0.8, "bandwidth_pass": False,
        "latency_msg_bytes": 256, "latency_us_per_msg": 21.5, "overlap": {},
    }  # fmt: skip
    md = cuda_ipc.to_markdown(result)
    assert "ipc staging, asked auto" in md and "every receive buffer checked" in md
    assert "Min IPC / copy at >= 64 MiB: 0.5 (target >= 0.8): FAIL" in md
    assert "21.5 us per 256 B message" in md


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.timeout(150)
def test_quick_run_on_one_gpu(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dualpipe_kernels", "bench", "cuda_ipc", "--quick", "--json", "--no-plots",
         "--out", str(tmp_path), "--timeout", "120"],
        capture_output=True, text=True, timeout=140,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    res = json.loads(proc.stdout)
    assert res["staging"] in ("ipc", "host") and res["rows"] and res["latency_us_per_msg"] > 0
    assert all(r["buffers_checked"] >= 4 or r["messages"] < 4 for r in res["rows"])
    assert (tmp_path / "cuda_ipc.json").exists() and (tmp_path / "cuda_ipc.md").exists()
