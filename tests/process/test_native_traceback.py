"""DUALPIPE_KERNELS_NATIVE_TRACEBACK=1: native stacks for a crash (then faulthandler's) and on SIGUSR2.

How the H200's crashes were found (docs/history.md, "GPU runs"): a fault inside the extension names its frames, and
a stuck process can be asked for every thread's stack without dying.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch  # noqa: F401  (the extension links against torch's libraries)

from dualpipe_kernels import _C  # noqa: F401  (built by the install step)

_ENV = {**os.environ, "DUALPIPE_KERNELS_NATIVE_TRACEBACK": "1", "PYTHONFAULTHANDLER": "1"}


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=_ENV, capture_output=True, text=True, timeout=120)


def test_a_crash_prints_the_native_stack_then_python_s() -> None:
    r = _run("from dualpipe_kernels import _C\nimport ctypes\nctypes.string_at(0)\n")
    assert r.returncode == -11, r.stderr[-2000:]
    assert "dualpipe_kernels: fatal signal 11 at address" in r.stderr
    assert "_C." in r.stderr and "is loaded at 0x" in r.stderr  # frames and the base addr2line needs
    assert r.stderr.index("native stack") < r.stderr.index("Fatal Python error: Segmentation fault")


def test_sigusr2_prints_this_thread_s_stack_and_the_process_goes_on() -> None:
    r = _run(
        "import os, signal, time\nfrom dualpipe_kernels import _C\n"
        "os.kill(os.getpid(), signal.SIGUSR2)\ntime.sleep(0.2)\nprint('alive')\n"
    )
    assert r.returncode == 0 and r.stdout.strip() == "alive", r.stderr[-2000:]
    assert "dualpipe_kernels: native stack of thread" in r.stderr
