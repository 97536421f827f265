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
    # 256 B, 4 KiB, 64 KiB, 1 MiB, 16 MiB, 64 MiB (judged), 256 MiB
    assert cuda_ipc.sizes_between(256, 256 << 20) == [256, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
    assert cuda_ipc.sizes_between(3, 40) == [3, 40]
    assert [cuda_ipc._size(s) for s in ("4K", "256MiB", "1G", "100")] == [4096, 256 << 20, 1 << 30, 100]
    assert cuda_ipc.burst_count(256) == cuda_ipc.MAX_BURST and cuda_ipc.burst_count(256 << 20) == cuda_ipc.MIN_BURST


def test_spin_barrier_lets_two_processes_meet_and_times_out_alone() -> None:
    import multiprocessing as mp

    slots = mp.get_context("spawn").RawArray("q", 2)
    slots[1] = 1  # the peer already arrived at barrier 1
    b = cuda_ipc.SpinBarrier(slots, 0, timeout_s=0.2)
    b()
    assert slots[0] == 1
    with pytest.raises(TimeoutError, match="rank 0: peer did not reach barrier 2"):
        b()


def test_report_judges_engine_against_its_bare_ceiling_and_the_hop() -> None:
    row = {
        "messages": 8, "engine_gbps": 100.0, "bare_gbps": 200.0, "copy_gbps": 1900.0, "engine_over_bare": 0.5,
        "host_us_per_msg": 3.0, "device_us_per_msg": 30.0, "hop_us": 12.0,
    }  # fmt: skip
    result = {
        "mode": "gpu", "device": "H200", "staging": "ipc", "staging_requested": "auto",
        "signal_mechanism": "stream memory ops", "num_slots": 4, "slot_bytes": 4 << 20, "max_inflight": 256,
        "direct_min_bytes": 1 << 20, "rows": [{"size_bytes": 64 << 20, **row}], "hop_us": 12.0,
        "bandwidth_min_size": 64 << 20, "engine_over_bare_min": 0.5, "bandwidth_target_ratio": 0.85,
        "bandwidth_pass": False, "small_msg_bytes": 256, "small_over_hop": 1.5, "small_target": 2.0,
        "small_pass": True, "overlap": {},
    }  # fmt: skip
    md = cuda_ipc.to_markdown(result)
    assert "ipc staging, asked auto; signals: stream memory ops" in md and "every receive buffer checked" in md
    assert "Min engine / bare at >= 64 MiB: 0.5 (target >= 0.85): FAIL" in md
    assert "256 B messages: device time per message / hop = 1.5 (target <= 2.0): PASS" in md
    assert "Context hop (bare interprocess-event ping-pong): 12 us" in md


needs_cuda_build = pytest.mark.skipif(
    cuda_ipc.unavailable(argparse.Namespace(fake_device=True)) is not None,
    reason="needs a CUDA build of the extension (no GPU needed)",
)


@needs_cuda_build
@pytest.mark.timeout(120)
def test_fake_device_host_cost_without_a_gpu(tmp_path: Path) -> None:
    """The engine's host path over the fake device: rows for 256 B and 1 MiB, both checked byte-exact."""
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "dualpipe_kernels", "bench", "cuda_ipc", "--fake-device", "--quick", "--json",
         "--no-plots", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert res["mode"] == "fake-device"
    rows = {r["size_bytes"]: r for r in res["rows"]}
    assert set(rows) == {256, 1 << 20}
    assert rows[1 << 20]["zero_copy"] and not rows[256]["zero_copy"]
    for r in rows.values():
        assert r["verified"] and 0 < r["post_us_per_msg"] <= r["host_us_per_msg"], r
        assert r["pass"] == (r["host_us_per_msg"] <= cuda_ipc.FAKE_TARGET_US)
    assert "Host cost per message (post + completion) <= 10.0 us" in (tmp_path / "cuda_ipc.md").read_text()


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
    assert res["staging"] in ("ipc", "host") and res["rows"] and res["hop_us"] > 0
    keys = {"size_bytes", "messages", "engine_gbps", "bare_gbps", "copy_gbps", "engine_over_bare",
            "host_us_per_msg", "device_us_per_msg", "hop_us"}  # fmt: skip
    assert all(keys <= set(r) for r in res["rows"]), res["rows"][0]
    assert all(r["buffers_checked"] >= 4 or r["messages"] < 4 for r in res["rows"])
    assert (tmp_path / "cuda_ipc.json").exists() and (tmp_path / "cuda_ipc.md").exists()
