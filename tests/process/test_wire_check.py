"""The GPU wire check (benchmarks/wire_check.py, device_check's ``wire`` step) run on CPU: step 1 bit-exact
against one process, the profiled step's message-path ranges found and its synchronizing calls counted."""

from __future__ import annotations

import json
import subprocess
import sys


def test_wire_check_on_cpu_is_bit_exact_and_finds_the_message_path() -> None:
    cmd = [sys.executable, "-m", "dualpipe_kernels.benchmarks.wire_check", "--device", "cpu", "--transports", "torch"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = json.loads(done.stdout)["torch"]
    assert len(ranks) == 2
    for r in ranks:
        assert r["bit_exact_losses"] and r["bit_exact_grads"], r
        assert r["message_path_ranges"] > 0 and r["syncs_on_message_path"] == 0 and r["d2h_on_message_path"] == 0


def test_wire_check_dry_run_and_bad_arguments() -> None:
    mod = [sys.executable, "-m", "dualpipe_kernels.benchmarks.wire_check"]
    dry = subprocess.run([*mod, "--dry"], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(dry.stdout)["would_run"] == ["native", "auto"]
    bad = subprocess.run([*mod, "--transports", "nccl"], capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "--transports: expected auto, native or torch" in bad.stderr
