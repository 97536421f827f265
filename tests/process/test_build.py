"""The compiled extension: it imports, reports how it was built, and setup.py's CUDA knob behaves.

``_C.has_cuda()`` must be True whenever torch is a CUDA build and nvcc exists
(a GPU is not needed), unless the build was forced CPU-only with
``DUALPIPE_KERNELS_CUDA=0`` in this environment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dualpipe_kernels

ROOT = Path(__file__).resolve().parents[2]


def _toolkit_present() -> bool:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return Path(home, "bin", "nvcc").exists() or shutil.which("nvcc") is not None


def _cuda_expected() -> bool:
    if os.environ.get("DUALPIPE_KERNELS_CUDA") == "0":
        return False
    return torch.version.cuda is not None and _toolkit_present() and (ROOT / "csrc" / "cuda" / "api.h").exists()


def test_extension_imports_and_reports_cuda() -> None:
    from dualpipe_kernels import _C

    assert _C.has_cuda() is _cuda_expected(), (
        f"has_cuda()={_C.has_cuda()} but torch CUDA={torch.version.cuda}, toolkit={_toolkit_present()}, "
        f"DUALPIPE_KERNELS_CUDA={os.environ.get('DUALPIPE_KERNELS_CUDA')!r}: rebuild with "
        "`pip install --no-build-isolation -e .`"
    )
    assert hasattr(_C, "shm") and hasattr(_C.shm, "Engine")
    assert hasattr(_C, "cuda") is _C.has_cuda()


def test_build_info_is_sane() -> None:
    from dualpipe_kernels import _C

    info = _C.build_info()
    assert info["version"] == dualpipe_kernels.__version__
    assert info["torch_version"] == torch.__version__
    assert info["with_cuda"] is _C.has_cuda()
    assert info["cplusplus"] >= 201703
    assert info["compiler"]
    assert "shm" in info["subsystems"]
    assert ("cuda" in info["subsystems"]) is _C.has_cuda()
    if _C.has_cuda():
        assert info["cuda_version"] == torch.version.cuda
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0")
        assert info["cuda_arch_list"].replace(",", " ").split() == arch.replace(";", " ").split()
    else:
        assert info["cuda_version"] == "" and info["cuda_arch_list"] == ""


def test_engine_rejects_bad_geometry() -> None:
    from dualpipe_kernels import _C

    with pytest.raises(ValueError, match="num_slots must be >= 2"):
        _C.shm.Engine(0, num_slots=1)
    with pytest.raises(ValueError, match="slot_bytes must be >= 64"):
        _C.shm.Engine(0, slot_bytes=8)
    with pytest.raises(ValueError, match="rank must be >= 0"):
        _C.shm.Engine(-1)


def _setup_py(env_overrides: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **env_overrides}
    return subprocess.run(
        [sys.executable, "setup.py", "--version"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.timeout(200)
def test_setup_knob_errors_are_clear() -> None:
    forced = _setup_py({"DUALPIPE_KERNELS_CUDA": "1", "CUDA_HOME": "/nonexistent-cuda"})
    assert forced.returncode != 0
    assert "DUALPIPE_KERNELS_CUDA=1 but the CUDA build is impossible" in forced.stderr
    assert "no nvcc found (CUDA_HOME=/nonexistent-cuda)" in forced.stderr
    bad = _setup_py({"DUALPIPE_KERNELS_CUDA": "yes"})
    assert bad.returncode != 0 and "DUALPIPE_KERNELS_CUDA must be 0 or 1" in bad.stderr
    cpu = _setup_py({"DUALPIPE_KERNELS_CUDA": "0"})
    assert cpu.returncode == 0, cpu.stderr
    assert "CUDA: no (DUALPIPE_KERNELS_CUDA=0)" in cpu.stderr and "csrc/shm_channel.cpp" in cpu.stderr
    assert "csrc/common/segment.cpp" in cpu.stderr, "the core both engines share is in every build"


def test_csrc_layout_keeps_files_small_and_device_code_apart() -> None:
    """No C++ source over 500 lines (tests aside), bindings.cpp under 60; only the device layer
    and the bindings include the CUDA runtime, so CMake builds the IPC engine's host logic without it."""
    csrc = ROOT / "csrc"
    sources = [p for p in csrc.rglob("*") if p.suffix in {".cpp", ".h", ".cu"} and "tests" not in p.parts]
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"over 500 lines: {long}"
    assert len((csrc / "bindings.cpp").read_text().splitlines()) < 60
    device_side = {"cuda_runtime.cu", "cuda_bindings.cpp"}
    with_cuda = [p.name for p in sources if "#include <cuda" in p.read_text() and p.name not in device_side]
    assert not with_cuda, f"host logic including cuda_runtime.h: {with_cuda}"
