"""Smoke-run the python/ example programs for one step each (CPU processes over gloo)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["CUDA_VISIBLE_DEVICES"] = ""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # not under torchrun: the script starts its own processes
    return subprocess.run(
        [sys.executable, str(ROOT / "python" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(300)
def test_train_gpt_dualpipev_one_step() -> None:
    proc = _run("train_gpt_dualpipev.py", "--ranks", "2", "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"step\s+1\s+loss\s+([0-9.]+)", proc.stdout)
    assert m, proc.stdout
    assert abs(float(m.group(1)) - math.log(256)) < 0.2  # untrained: cross-entropy near ln(vocab)
    assert "final loss" in proc.stdout


@pytest.mark.timeout(300)
def test_moe_overlap_matches_non_overlapped_execution() -> None:
    proc = _run("moe_overlap.py", "--steps", "1", "--microbatches", "4")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # every rank ran the hook for its F&B pairs and matched the plain run bit for bit
    assert len(re.findall(r"overlapped pairs run [1-9]\d*, .*bit-exact vs non-overlapped: yes", proc.stdout)) == 4
    assert "overlapped == non-overlapped (losses and every gradient, torch.equal): yes" in proc.stdout
