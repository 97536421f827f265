"""bench/device_check.sh on a machine without a GPU: a dry run with an injected fault walks every step.

The fault (``DPK_FAULT_IPC_WAIT=1``: a rank sticks in a wait that never fires) makes the transport step's
tests fail, but within the step's own timeout, with the JUnit XML and the logs still written, and the
output folder holds at most 7 files.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

#: the longest tests of the suite (leave them out with -m "not slow")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["smoke", "build", "gpu", "bench", "transport", "runtime", "wire", "compat", "hostcpu"]


@pytest.mark.timeout(480)
def test_dry_run_with_a_stuck_wait_walks_every_step_and_keeps_its_output(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "DEVICE_CHECK_DRY": "1",
        "DPK_FAULT_IPC_WAIT": "1",
        "PYTHON": sys.executable,
        "TMPDIR": str(tmp_path),
    }
    env.pop("DEVICE_CHECK_STEPS", None)
    proc = subprocess.run(
        ["bash", "bench/device_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=470
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 7, files
    assert {"report.md", "report.json", "logs.tar.gz", "junit-transport.xml"} <= set(files)

    report = json.loads((out / "report.json").read_text())
    steps = {s["step"]: s for s in report["steps"]}
    assert list(steps) == STEPS and all(s["status"] != "skipped" for s in steps.values()), steps
    assert report["total_s"] < 480
    transport = steps["transport"]
    assert transport["status"] == "failed" and transport["seconds"] <= transport["limit_s"], transport

    # The short-chunk row (host CPUs, no GPU needed) is the last step and gets what is left of the budget: on
    # a loaded machine it may not finish inside its cap, so only its having run and been recorded is checked
    # here, and its numbers only when it finished (they are the benchmark's own tests' business).
    hostcpu = steps["hostcpu"]
    assert hostcpu["status"] in ("ok", "timeout", "failed") and hostcpu["seconds"] <= hostcpu["limit_s"] + 10, hostcpu
    short_run = report["bench"].get("schedules_short")
    if hostcpu["status"] == "ok":
        (short,) = short_run["short_chunks"]
        assert (short["ranks"], short["microbatches"]) == (4, 16) and short.get("error") is None
        assert "short chunks on the host CPUs" in (out / "report.md").read_text()

    # the CUDA IPC engine's host cost over the fake device runs without a GPU (a CUDA build of the extension)
    from dualpipe_kernels import _C

    if _C.has_cuda():
        fake = report["bench"]["cuda_ipc_fake"]
        assert fake["mode"] == "fake-device" and [r["size_bytes"] for r in fake["rows"]] == [256, 1 << 20], fake
        assert all(r["verified"] and r["host_us_per_msg"] > 0 for r in fake["rows"])
        assert "host cost over the fake device" in (out / "report.md").read_text()

    # the stuck scenario failed its test (bounded), and the XML says so
    cases = {c.get("name"): c for c in ET.parse(out / "junit-transport.xml").getroot().iter("testcase")}
    harness = cases["test_pair_harness_bounds_a_stuck_scenario_and_runs_the_rest_on_a_fresh_pair"]
    assert harness.find("failure") is not None and "no outcome within" in ET.tostring(harness, encoding="unicode")

    # every step reported as it went, and every log is in the one archive
    for name in STEPS:
        assert f"[device_check] ==== {name}: rc=" in proc.stdout
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
        assert {f"./logs/{n}.log" for n in STEPS} <= names, names
        smoke = tar.extractfile("./logs/smoke.log").read().decode()  # type: ignore[union-attr]
        log = tar.extractfile("./logs/transport.log").read().decode()  # type: ignore[union-attr]
    assert "PYTORCH_CUDA_ALLOC_CONF=" in smoke and ("compute_mode" in smoke or "nvidia-smi: unavailable" in smoke)
    assert "test_pair_harness_bounds_a_stuck_scenario_and_runs_the_rest_on_a_fresh_pair FAILED" in log


def test_step_limits_fit_the_window_and_the_gpu_tests_fit_their_step() -> None:
    """The budget bounds the run (< 8 min); every cap fits in it; the transport tests' bounded runs fit their step."""
    import test_cuda_ipc as ipc

    text = (ROOT / "bench" / "device_check.sh").read_text()
    limits = {k: int(v) for k, v in re.findall(r"^LIMIT_(\w+)=(\d+)$", text, re.M)}
    budget = int(re.search(r"DEVICE_CHECK_BUDGET_S:-(\d+)", text).group(1))  # type: ignore[union-attr]
    assert set(limits) == {s.upper() for s in STEPS} and budget < 480 and max(limits.values()) <= budget
    order = re.findall(r"^run_step (\w+) ", text, re.M)
    assert order == STEPS, order
    # three set-ups and the killed peer, each bounded by its budget (+5 s to stop its processes), leave 30 s
    # for the harness and the CPU tests, so pytest ends (and writes its JUnit XML) before the step's timeout
    gpu_runs = len(ipc.SETUPS) * (ipc.SETUP_BUDGET_S + 5) + ipc.KILL_BUDGET_S + 5
    assert gpu_runs <= limits["TRANSPORT"] - 30
    assert ipc.TEST_TIMEOUT_S > ipc.SETUP_BUDGET_S + 5 and ipc.TEST_TIMEOUT_S < limits["TRANSPORT"]
    # the compat step's two GPU tests, each under its pytest timeout, plus pytest's start
    compat_text = (ROOT / "tests" / "process" / "test_compat.py").read_text()
    marker = re.search(r"timeout\((\d+)\)[^\n]*\n(?:@[^\n]*\n)*def test_compat_on_cuda", compat_text)
    assert marker is not None and 2 * int(marker.group(1)) + 5 <= limits["COMPAT"]
