"""The pack kernels compiled for sm_90 (H100 / H200) without a GPU: registers per thread, SASS per element.

``python -m dualpipe_kernels.kernels.offline --json`` (what ``dualpipe-kernels bench kernels --sass``
runs, once per Triton it finds) compiles every launch variant of :mod:`.pack_triton` with the
installed Triton for ``GPUTarget("cuda", 90, 32)``: pack and unpack, each conversion (by format and
input dtype), contiguous or strided tensors, and the mixed-dtype kernel; int32 indices and a
binary search over up to 32 tensors, as a launch of several tensors compiles them.  For each it reads
the registers a thread holds (:func:`.cubin.registers_per_thread`) and, for contiguous variants, the
SASS instructions per element of the fast path: the kernel is built with the masked path left out
(``TAIL=False``) at one and two tiles per block, and the difference in instructions (``cuobjdump
-sass``, NOPs not counted) is divided by the elements a thread converts in the extra tile, so the
fixed cost (table reads, search, loop) cancels out.  Static counts: what the fast path issues per
element, per block of a whole tensor.  ``fast_loop_table_loads``: reads of the launch table inside the fast
path's loop over a program's blocks (TTIR; 0: the row is read once per program, before the loop).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dualpipe_kernels.kernels.parse_race import retry_ast_race

__all__ = [
    "GPU_TRITON",
    "VARIANTS",
    "analyse",
    "analyse_with",
    "compile_variant",
    "cuobjdump_path",
    "loop_body",
    "sass_instructions",
    "sass_listing",
    "table_loads",
    "triton_dir",
    "main",
]

NUM_WARPS = 4
#: (format, variant name (the tensors' dtype), conversion code, POW2); the mixed kernel has code -1
VARIANTS: tuple[tuple[str, str, int, bool], ...] = (
    ("packed", "fp32", 2, False),
    ("packed", "bf16", 1, False),  # any 2-byte dtype: the same copy
    ("packed", "mixed", -1, False),
    ("bf16", "fp32", 4, False),
    ("bf16", "fp16", 5, False),
    ("fp8", "fp32", 6, False),
    ("fp8", "fp16", 7, False),
    ("fp8", "bf16", 8, False),
    ("fp8", "fp32 pow2", 6, True),
)


def cuobjdump_path() -> str | None:
    """``cuobjdump``: $CUOBJDUMP, the CUDA toolkit's (/usr/local/cuda/bin), the one Triton ships, or PATH's."""
    import triton

    cands = [os.environ.get("CUOBJDUMP", ""), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin")]
    cands[1] = os.path.join(cands[1], "cuobjdump")
    cands.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    for c in cands:
        if c and os.access(c, os.X_OK):
            return c
    return shutil.which("cuobjdump")


def sass_listing(cubin: bytes, tool: str) -> list[tuple[int, str]]:
    """(address, instruction) of a cubin's SASS (``cuobjdump -sass``), NOPs left out."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, timeout=60, check=True).stdout
    found = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", out)
    return [(int(a, 16), i.strip()) for a, i in found if not i.strip().startswith("NOP")]


def sass_instructions(cubin: bytes, tool: str) -> list[str]:
    """The SASS instructions of a cubin, NOPs left out."""
    return [i for _, i in sass_listing(cubin, tool)]


def loop_body(listing: list[tuple[int, str]]) -> list[str]:
    """The instructions of the outermost loop (from the target of the backward branch that spans the most
    code to that branch), or [] when there is no loop."""
    best: tuple[int, int] | None = None
    for addr, ins in listing:
        m = re.search(r"\bBRA(?:\.[A-Z.]+)?\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr and (best is None or addr - int(m.group(1), 16) > best[1] - best[0]):
            best = (int(m.group(1), 16), addr)
    if best is None:
        return []
    return [i for a, i in listing if best[0] <= a <= best[1]]


def table_loads(ttir: str) -> tuple[int, int]:
    """(scalar int64 loads, i.e. reads of the launch table, outside any loop, inside a loop) of a kernel's TTIR
    (``asm["ttir"]``).  The kernels' only scalar int64 loads are table reads (the data moves in tiles)."""
    outside = inside = depth = 0
    loops: list[int] = []  # brace depth at which each enclosing scf.for opened
    for line in ttir.splitlines():
        if re.search(r"=\s*tt\.load\b.*:\s*!tt\.ptr<i64>", line):
            if loops:
                inside += 1
            else:
                outside += 1
        opened = line.count("{") - line.count("}")
        if re.search(r"\bscf\.for\b", line) and opened > 0:
            loops.append(depth)
        depth += opened
        while loops and depth <= loops[-1]:
            loops.pop()
    return outside, inside


def compile_variant(pack: bool, constexprs: dict[str, Any]) -> dict[str, Any]:
    """The compiled kernel's ``asm`` (``ptx``, ``cubin``, ...) for sm_90, without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dualpipe_kernels.kernels.pack_jit import pack_kernel, unpack_kernel

    kernel = pack_kernel if pack else unpack_kernel
    types = {"table": "*i64", "buf": "*u8", "n": "i32", "iters": "i32", "fast_programs": "i32"}
    sig = {name: types.get(name, "constexpr") for name in kernel.arg_names}  # in the parameters' order
    consts = {k: constexprs[k] for k in kernel.arg_names if k not in types}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs={(1,): [["tt.divisibility", 16]]})
    target = GPUTarget("cuda", 90, 32)
    return retry_ast_race(lambda: triton.compile(src, target=target, options={"num_warps": NUM_WARPS}).asm)


def _constexprs(code: int, pow2: bool, contig: bool, rows: int, tile: int, tail: bool = True) -> dict[str, Any]:
    from dualpipe_kernels.kernels import pack_triton as pt

    return {"LOG_N": 5, "ROWS": tile, "SUB": rows // tile, "W": pt._WIDTH, "POW2": pow2, "CODE": code,
            "CONTIG": contig, "I32": True, "HW": True, "TAIL": tail}  # fmt: skip


def _compiled(fmt: str, name: str, code: int, pow2: bool, pack: bool, contig: bool) -> dict[str, Any]:
    """One variant compiled (the full kernel; for a contiguous one also its fast path alone), with what its
    row reads from the compiler's output; ``_fast_cubin`` is left for :func:`_sass_per_element`."""
    import torch
    import triton

    from dualpipe_kernels.kernels import pack_triton as pt
    from dualpipe_kernels.kernels.cubin import fit_per_sm, registers_per_thread

    gpu = torch.device("cuda", 0)
    rows = pt.rows_per_block(gpu, code)
    tile = min(rows, pt.tile_rows(gpu))
    regs = registers_per_thread(compile_variant(pack, _constexprs(code, pow2, contig, rows, tile))["cubin"])
    loop_loads = fast_cubin = None
    if contig:
        # the fast path alone (the masked path left out), one tile per block: its loop runs once per tile
        fast = compile_variant(pack, _constexprs(code, pow2, True, tile, tile, False))
        # a program's blocks are all of one tensor: its table row is read before the loop, never inside it
        loop_loads = table_loads(fast["ttir"])[1]
        fast_cubin = fast["cubin"]
    return {"kernel": "pack" if pack else "unpack", "format": fmt, "variant": name, "contiguous": contig,
            "triton_version": triton.__version__, "registers": regs, "programs_per_sm": fit_per_sm(regs, NUM_WARPS),
            "sass_per_element": None, "rows_per_block": rows, "fast_loop_table_loads": loop_loads,
            "_tile": tile, "_fast_cubin": fast_cubin}  # fmt: skip


def _sass_per_element(row: dict[str, Any], tool: str | None) -> dict[str, Any]:
    """``row`` with ``sass_per_element`` read from its fast path's cubin (``cuobjdump``, a process)."""
    tile, cubin = row.pop("_tile"), row.pop("_fast_cubin")
    if cubin is not None and tool is not None:
        body = loop_body(sass_listing(cubin, tool))
        row["sass_per_element"] = round(len(body) / (tile * 128 / (32 * NUM_WARPS)), 3) if body else None
    return row


def analyse(formats: tuple[str, ...] = ("packed", "bf16", "fp8"), workers: int = 2) -> list[dict[str, Any]]:
    """One row per launch variant of ``formats`` (see the module docstring).

    The variants compile one after another in the calling thread: Triton parses each kernel's source
    as it compiles, and parses from several threads at once can hit CPython's AST race (gh-106905, see
    :mod:`.parse_race`).  Only ``cuobjdump``, which parses nothing in Python, runs on ``workers`` threads."""
    tool = cuobjdump_path()
    jobs = [(f, n, c, p2, pack, contig) for f, n, c, p2 in VARIANTS if f in formats
            for pack in (True, False) if pack or not p2 for contig in (True, False)]  # fmt: skip
    rows = [_compiled(*j) for j in jobs]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as ex:  # cuobjdump runs as a process
        return list(ex.map(lambda r: _sass_per_element(r, tool), rows))


#: the Triton of the GPU machine (the pip wheel that ``bench/device_check.sh`` installs there)
GPU_TRITON = "3.6.0"


def triton_dir(version: str = GPU_TRITON, create: bool = True) -> str | None:
    """A directory holding Triton ``version`` alone (no torch), to put in front of ``PYTHONPATH``:
    ``$DUALPIPE_TRITON_DIR`` if set, else ``~/.cache/dualpipe-kernels/triton-<version>``, made with
    ``python -m pip install --no-deps --target DIR triton==<version>`` when missing (about 10 s and
    0.6 GB from the registry; CI caches the directory).  None when it cannot be made."""
    path = os.environ.get("DUALPIPE_TRITON_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "dualpipe-kernels", f"triton-{version}"
    )
    marker = os.path.join(path, f"triton-{version}.dist-info")
    if os.path.isdir(marker):
        return path
    if not create:
        return None
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", path, f"triton=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return path if proc.returncode == 0 and os.path.isdir(marker) else None


def analyse_with(path: str, formats: tuple[str, ...] = ("packed", "bf16", "fp8"), timeout: float = 300) -> list[dict]:
    """:func:`analyse` in a subprocess whose ``triton`` comes from ``path`` (e.g. :func:`triton_dir`)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, root, os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "dualpipe_kernels.kernels.offline", "--json", "--formats", ",".join(formats)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"offline analysis with the Triton in {path} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", default="packed,bf16,fp8")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    rows = analyse(tuple(f.strip() for f in args.formats.split(",") if f.strip()))
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
