"""The package builds as a user would get it: an sdist that carries csrc/, and a wheel, built from that sdist
with ``pip wheel . --no-deps --no-build-isolation``, that holds the compiled extension and installs.

The wheel is built C++ only (``DUALPIPE_KERNELS_CUDA=0``: no CUDA translation units, which take minutes each on a
small machine); the CUDA build is what the README's install command and tests/process/test_build.py check.  The sdist is
unpacked and the wheel built from it, so a file setup.py needs but the sdist lacks fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
import tomllib

#: the longest tests of the suite (leave them out with -m "not slow")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Path, timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env}, check=False
    )
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sdist")
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(out), str(ROOT)], ROOT, 300)
    (path,) = out.glob("dualpipe_kernels-*.tar.gz")
    return path


def _csrc_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.is_file() and "__" not in p.name)


def test_sdist_carries_the_sources_the_extension_is_built_from(sdist: Path) -> None:
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = [f for f in _csrc_files() if f not in names]
    assert not missing, f"the sdist lacks {missing}"
    for f in ("setup.py", "pyproject.toml", "LICENSE", "README.md", "CMakeLists.txt", "dualpipe_kernels/_C.pyi"):
        assert f in names, f


def test_wheel_built_from_the_sdist_holds_the_extension_and_installs(sdist: Path, tmp_path: Path) -> None:
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    (src,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    wheels = tmp_path / "wheels"
    t0 = time.perf_counter()
    _run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)],
        src,
        600,
        DUALPIPE_KERNELS_CUDA="0",
    )
    print(f"pip wheel (C++ only) took {time.perf_counter() - t0:.0f} s")
    (whl,) = wheels.glob("dualpipe_kernels-*.whl")
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
    assert any(n.startswith("dualpipe_kernels/_C") and n.endswith(".so") for n in names), names
    assert "dualpipe_kernels/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)
    assert any(n.endswith("entry_points.txt") for n in names)

    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(whl)], tmp_path, 300)
    code = (
        "import dualpipe_kernels, torch\n"
        "from dualpipe_kernels import _C\n"
        "from dualpipe_kernels.schedules import build_schedule, simulate, CostModel\n"
        "print(dualpipe_kernels.__file__, _C.has_cuda(), simulate(build_schedule('1f1b', 2, 4), CostModel()).bubble)"
    )
    # PYTHONPATH: the installed wheel only (not this checkout); torch comes from the running environment
    proc = _run([sys.executable, "-c", code], tmp_path, 120, PYTHONPATH=str(site))
    where, has_cuda, bubble = proc.stdout.split()
    assert Path(where).resolve().is_relative_to(site.resolve()), where
    assert has_cuda == "False"  # built with DUALPIPE_KERNELS_CUDA=0
    assert float(bubble) == 3.0  # 1F1B, 2 ranks: (PP - 1)(F + B) with F = 1, B = 2


def test_one_torch_requirement_everywhere() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_dep = [d for d in meta["project"]["dependencies"] if d.startswith("torch")]
    build_file = [ln.strip() for ln in (ROOT / "requirements-build.txt").read_text().splitlines()]
    assert torch_dep == [ln for ln in build_file if ln.startswith("torch")], (torch_dep, build_file)
    assert meta["project"]["license"] == "MIT" and (ROOT / "LICENSE").read_text().startswith("MIT License")
