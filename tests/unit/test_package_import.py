"""``from dualpipe_kernels import _C`` works without importing torch first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_extension_imports_before_torch():
    if not list((REPO / "dualpipe_kernels").glob("_C*.so")):
        pytest.skip("the extension is not built in this checkout")
    p = _python("from dualpipe_kernels import _C; import sys; print('torch' in sys.modules, hasattr(_C, 'shm'))")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "True"]


def test_package_import_stays_torch_free_and_names_unknown_attributes():
    p = _python("import sys, dualpipe_kernels as d; print('torch' in sys.modules); d.nope")
    assert p.stdout.split() == ["False"]
    assert "has no attribute 'nope'" in p.stderr
