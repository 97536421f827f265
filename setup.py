"""Build of dualpipe_kernels._C (the native comm engine) with torch.utils.cpp_extension and ninja.

Install (torch must already be in the environment):
    pip install --no-build-isolation -e .

What gets compiled:
    csrc/*.cpp, csrc/common/*.cpp     always (CPU shared-memory engine, the core both engines share, bindings)
    csrc/cuda/*.cu, csrc/cuda/*.cpp   only in a CUDA build, with -DDUALPIPE_KERNELS_WITH_CUDA

A CUDA build happens when a CUDA toolkit (nvcc under CUDA_HOME) and a CUDA
build of torch are both present, whether or not a GPU is: the decision never
looks at torch.cuda.is_available().

Knobs (environment variables):
    DUALPIPE_KERNELS_CUDA=0|1   force the CPU-only build (0) or require the CUDA build (1: error if impossible)
    CUDA_HOME                   toolkit root (default: /usr/local/cuda when it exists)
    TORCH_CUDA_ARCH_LIST        GPU architectures (default "9.0")
    MAX_JOBS                    parallel compile jobs (default: from cores and available memory)
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = Path("csrc")
DEFAULT_ARCH_LIST = "9.0"
# Rough peak memory of one compile job (nvcc on a .cu file that includes torch headers is the big one).
GIB_PER_JOB = {True: 3.0, False: 1.5}


@dataclass
class BuildPlan:
    """Everything the build decided, for the summary and the Extension."""

    with_cuda: bool
    why: str
    arch_list: str = ""
    jobs: int = 1
    sources: list[str] = field(default_factory=list)


def _log(msg: str) -> None:
    print(f"[dualpipe-kernels build] {msg}", file=sys.stderr, flush=True)


def _version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'^version\s*=\s*"([^"]+)"', text, flags=re.MULTILINE)
    return m.group(1) if m else "0.0.0"


def _default_cuda_home() -> str | None:
    """CUDA_HOME, else /usr/local/cuda if present, else the toolkit holding nvcc on PATH.

    Sets os.environ["CUDA_HOME"] so torch.utils.cpp_extension (which reads it at
    import time) does not fall back to its own guess (/usr/local here, which is wrong).
    """
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not home and Path("/usr/local/cuda").is_dir():
        home = "/usr/local/cuda"
    if not home and (nvcc := shutil.which("nvcc")):
        home = str(Path(nvcc).resolve().parent.parent)
    if home:
        os.environ["CUDA_HOME"] = home
    return home


def _cuda_sources() -> list[str]:
    cuda_dir = CSRC / "cuda"
    if not (ROOT / cuda_dir / "api.h").exists():
        return []
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / cuda_dir).glob("*") if p.suffix in (".cu", ".cpp"))


def _decide_cuda() -> tuple[bool, str]:
    force = os.environ.get("DUALPIPE_KERNELS_CUDA", "").strip()
    if force not in ("", "0", "1"):
        raise SystemExit(f"DUALPIPE_KERNELS_CUDA must be 0 or 1, got {force!r}")
    if force == "0":
        return False, "DUALPIPE_KERNELS_CUDA=0"
    import torch

    home = _default_cuda_home()
    problems = []
    nvcc = Path(home, "bin", "nvcc") if home else None
    if nvcc is None or not nvcc.exists():
        problems.append(f"no nvcc found (CUDA_HOME={home or 'unset'})")
    if torch.version.cuda is None:
        problems.append(f"torch {torch.__version__} is not a CUDA build")
    if not _cuda_sources():
        problems.append("no CUDA sources (csrc/cuda/api.h missing)")
    if problems:
        if force == "1":
            raise SystemExit("DUALPIPE_KERNELS_CUDA=1 but the CUDA build is impossible: " + "; ".join(problems))
        return False, "; ".join(problems)
    how = "forced by DUALPIPE_KERNELS_CUDA=1" if force == "1" else "auto"
    return True, f"{how}: nvcc at {nvcc}, torch {torch.__version__} built for CUDA {torch.version.cuda}"


def _default_jobs(with_cuda: bool) -> int:
    cores = os.cpu_count() or 1
    avail_gib = cores * GIB_PER_JOB[with_cuda]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail_gib = int(line.split()[1]) / 2**20
                break
    except OSError:
        pass
    return max(1, min(cores, int(avail_gib / GIB_PER_JOB[with_cuda])))


def _plan() -> BuildPlan:
    with_cuda, why = _decide_cuda()
    plan = BuildPlan(with_cuda=with_cuda, why=why)
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
        plan.arch_list = os.environ["TORCH_CUDA_ARCH_LIST"]
    if not os.environ.get("MAX_JOBS"):
        os.environ["MAX_JOBS"] = str(_default_jobs(with_cuda))
    plan.jobs = int(os.environ["MAX_JOBS"])
    plan.sources = sorted(str(p.relative_to(ROOT)) for d in (CSRC, CSRC / "common") for p in (ROOT / d).glob("*.cpp"))
    if with_cuda:
        plan.sources += _cuda_sources()
    return plan


def _macro_token(text: str) -> str:
    """A -D value that survives the shell and the variadic stringifier in bindings.cpp."""
    return re.sub(r"[^A-Za-z0-9_.+,-]", ",", text.strip()).strip(",") or "none"


def _extension(plan: BuildPlan):
    import torch
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    defines = [
        f"-DDUALPIPE_KERNELS_VERSION={_macro_token(_version())}",
        f"-DDUALPIPE_KERNELS_TORCH_VERSION={_macro_token(torch.__version__)}",
    ]
    if plan.with_cuda:
        defines += [
            "-DDUALPIPE_KERNELS_WITH_CUDA",
            f"-DDUALPIPE_KERNELS_CUDA_VERSION={_macro_token(torch.version.cuda or 'none')}",
            f"-DDUALPIPE_KERNELS_ARCH_LIST={_macro_token(plan.arch_list)}",
        ]
    # DUALPIPE_KERNELS_DEBUG_INFO=1: line tables (-g1), so addr2line can place a native stack
    # (bench/gpu_diag.sh); the code is the same -O3 code.
    debug = ["-g1"] if os.environ.get("DUALPIPE_KERNELS_DEBUG_INFO", "0") not in ("", "0") else []
    cxx = ["-O3", *debug, "-Wall", "-Wextra", "-Wno-unused-parameter", *defines]
    common = dict(
        name="dualpipe_kernels._C",
        sources=plan.sources,
        include_dirs=[str(ROOT / CSRC)],
        extra_link_args=["-pthread"],
    )
    if plan.with_cuda:
        nvcc = ["-O3", *(f"-Xcompiler={f}" for f in debug), "--expt-relaxed-constexpr", *defines]
        return CUDAExtension(**common, extra_compile_args={"cxx": cxx, "nvcc": nvcc})
    return CppExtension(**common, extra_compile_args={"cxx": cxx})


def _summary(plan: BuildPlan) -> None:
    _log(f"CUDA: {'yes' if plan.with_cuda else 'no'} ({plan.why})")
    if plan.with_cuda:
        _log(f"CUDA_HOME={os.environ.get('CUDA_HOME')}  TORCH_CUDA_ARCH_LIST={plan.arch_list}")
    _log(f"MAX_JOBS={plan.jobs}  sources ({len(plan.sources)}): {' '.join(plan.sources)}")


def _build_ext_class(plan: BuildPlan):
    from torch.utils.cpp_extension import BuildExtension

    class IncrementalBuildExtension(BuildExtension):
        """BuildExtension whose object files live in build/ under the project.

        pip's editable install points build_temp at a fresh temporary directory,
        which would recompile every file (minutes for a .cu) on each install;
        a fixed directory lets ninja rebuild only what changed.
        """

        def finalize_options(self) -> None:
            super().finalize_options()
            flavour = "cuda" if plan.with_cuda else "cpu"
            self.build_temp = str(
                ROOT / "build" / f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}-{flavour}"
            )

    return IncrementalBuildExtension.with_options(use_ninja=True)


def main() -> None:
    plan = _plan()  # sets CUDA_HOME / TORCH_CUDA_ARCH_LIST / MAX_JOBS before cpp_extension is imported
    _summary(plan)
    setup(ext_modules=[_extension(plan)], cmdclass={"build_ext": _build_ext_class(plan)})


if __name__ == "__main__":
    main()
