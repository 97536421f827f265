"""A process whose pipeline step failed over the torch transport exits cleanly, never by a signal.

Before the fix, the transport's waiter threads were still blocked in gloo when
the interpreter shut down; when their wait returned (the peer exited) Python
stopped them inside a C++ frame and the process aborted (SIGABRT, exit -6) in
30-100% of runs.  ``failing_exits.py`` runs 25 two-rank failing runs (50 process
exits), half with ``pipe.close()``, half relying on the transport's exit hook.
Before the fix every failing rank 1 of this harness aborted (-6).  Its cost is
the 50 interpreter shutdowns themselves (about 0.8 s of CPU each), which is
where the bug lives, so they are not shortened.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

RUNS = 25  # two ranks each: 50 process exits
PARALLEL = 25  # all at once: the runs mostly wait, and the machine may be shared


@pytest.mark.timeout(600)
def test_fifty_failing_runs_exit_without_a_signal():
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
    proc = subprocess.run(
        [sys.executable, os.path.join(here, "failing_exits.py"), str(RUNS), str(PARALLEL)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    statuses = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(statuses) == 2 * RUNS
    bad = [s for s in statuses if s not in (0, 1)]
    assert not bad, f"{len(bad)} of {len(statuses)} exits were not 0/1 (negative: killed by that signal): {statuses}"
    assert all(s == 1 for s in statuses), f"every rank's step must fail (exit 1): {statuses}"
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
