"""The pack kernels built for sm_90 without a GPU, with the installed Triton and with the GPU machine's (3.6.0).

Every launch variant (:data:`dualpipe_kernels.kernels.offline.VARIANTS`, pack and unpack, contiguous and strided)
compiles; a launch of one conversion on contiguous tensors holds at most 64 registers a thread (8 programs of 4
warps per multiprocessor); the fast path's loop issues at most 4 SASS instructions per element for a copy, 6 for
bf16, 12 for fp8 pack and 8 for fp8 unpack, and reads no table entry inside its loop over a program's blocks.
The GPU machine's Triton comes from a side directory
(:func:`offline.triton_dir`: ``pip install --no-deps --target ~/.cache/dualpipe-kernels/triton-3.6.0 triton==3.6.0``,
about 10 s, made on first use; ``DUALPIPE_TRITON_DIR`` points elsewhere).
"""

from __future__ import annotations

import os

import pytest

pytestmark = [
    pytest.mark.device_build,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="a compiler run"),
]

BOUNDS = {("packed", "pack"): 4, ("packed", "unpack"): 4, ("bf16", "pack"): 6, ("bf16", "unpack"): 6,
          ("fp8", "pack"): 12, ("fp8", "unpack"): 8}  # fmt: skip


def _check(rows: list[dict], version: str) -> None:
    from dualpipe_kernels.kernels.offline import VARIANTS

    want = {(k, f, n, c) for f, n, _, p2 in VARIANTS for k in ("pack", "unpack") if k == "pack" or not p2
            for c in (True, False)}  # fmt: skip
    assert {(r["kernel"], r["format"], r["variant"], r["contiguous"]) for r in rows} == want
    for r in rows:
        assert r["triton_version"] == version
        assert r["registers"] > 0 and r["programs_per_sm"] >= 2, r
        if r["contiguous"] and r["variant"] != "mixed":
            assert r["registers"] <= 64 and r["programs_per_sm"] >= 8, r
            assert (
                r["sass_per_element"] is not None and 0 < r["sass_per_element"] <= BOUNDS[(r["format"], r["kernel"])]
            ), r
        if r["contiguous"]:  # a program's blocks are all of one tensor: its table row is read before the loop
            assert r["fast_loop_table_loads"] == 0, r


@pytest.mark.timeout(400)
def test_every_variant_within_bounds_under_the_installed_triton() -> None:
    triton = pytest.importorskip("triton")
    from dualpipe_kernels.kernels import offline

    if offline.cuobjdump_path() is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's bundled one)")
    _check(offline.analyse(workers=min(4, os.cpu_count() or 1)), triton.__version__)


@pytest.mark.timeout(600)
def test_every_variant_within_bounds_under_the_gpu_machines_triton() -> None:
    triton = pytest.importorskip("triton")
    from dualpipe_kernels.kernels import offline

    if triton.__version__ == offline.GPU_TRITON:
        pytest.skip(f"the installed Triton is {offline.GPU_TRITON}: the test above covers it")
    path = offline.triton_dir()
    if path is None:
        pytest.skip(f"triton=={offline.GPU_TRITON} could not be pip-installed (no registry?)")
    _check(offline.analyse_with(path, timeout=560), offline.GPU_TRITON)
