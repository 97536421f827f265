"""Every file a doc, a docstring or a comment names exists: the docs (README.md, docs/*.md), the package's
docstrings and comments, csrc/'s comments and the tests' docstrings.

A name with a folder (``runtime/boundary/transfer.py``, ``tests/process/test_demo.py``) must resolve from the
repository root, from ``dualpipe_kernels/``, from ``csrc/`` or from the naming file's folder. A bare name of a
source file (``transfer.py``, ``shm_ring.h``) in the package or csrc/ must be a file of the repository (docs and
tests name users' and temporary files bare, ``train.py``, so only their names with a folder count).
docs/history.md is left out: it tells what the tree was.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_EXT = ("py", "pyi", "md", "cpp", "h", "cu", "cuh", "sh")
_NAME = re.compile(r"(?<![\w./<-])((?:[\w.-]+/)*[\w-]+\.(?:" + "|".join(SOURCE_EXT) + r"))(?![\w/(])")
# Folders that are not this repository's: other projects' trees (torch's, the reference DualPipe's examples/,
# system headers) and placeholders a doc or script fills in (WORK/, OUTDIR/).
_FOREIGN = re.compile(r"^(torch|triton|c10|ATen|pybind11|gtest|sys|linux|examples|site-packages|usr)/|^[A-Z_]+/")
# Headers of the CUDA toolkit a comment may name (they are not in this repository).
_TOOLKIT = {"cuda.h", "cuda_runtime.h", "cuda_runtime_api.h", "cuda_fp8.h", "cuda_bf16.h"}
_SKIP_DIRS = {".git", ".venv", "build", "dist", "__pycache__", ".eggs"}


def _repo_files() -> list[Path]:
    return [p for p in ROOT.rglob("*") if p.is_file() and not (_SKIP_DIRS & set(p.relative_to(ROOT).parts))]


def _python_text(path: Path) -> str:
    """The strings and comments of a Python file (its code names attributes such as ``tape.h``)."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            out.append(tok.string)
    return "\n".join(out)


def _cpp_comments(path: Path) -> str:
    text = path.read_text()
    blocks = re.findall(r"/\*.*?\*/", text, flags=re.S)
    lines = [line.split("//", 1)[1] for line in text.splitlines() if "//" in line and not line.lstrip().startswith("#")]
    return "\n".join(blocks + lines)


def _named(path: Path) -> list[str]:
    rel = path.relative_to(ROOT)
    if path.suffix == ".py":
        text = _python_text(path)
    elif path.suffix in (".cpp", ".h", ".cu", ".cuh"):
        text = _cpp_comments(path)
    else:
        text = path.read_text()
    bare_ok = rel.parts[0] in ("dualpipe_kernels", "csrc")
    names = []
    for m in _NAME.finditer(text):
        name = m.group(1)
        if _FOREIGN.match(name) or name.startswith(".") or name in _TOOLKIT:
            continue
        if "/" not in name and not (bare_ok and name.rsplit(".", 1)[1] != "md"):
            continue
        names.append(name)
    return names


def _exists(name: str, where: Path, basenames: set[str]) -> bool:
    if "/" not in name:
        return name in basenames
    return any((base / name).exists() for base in (ROOT, ROOT / "dualpipe_kernels", ROOT / "csrc", where.parent))


def _scanned() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files = [f for f in files if f.name != "history.md"]
    for top, exts in (("dualpipe_kernels", (".py",)), ("csrc", (".cpp", ".h", ".cu", ".cuh")), ("tests", (".py",))):
        files += sorted(p for p in (ROOT / top).rglob("*") if p.suffix in exts and "__pycache__" not in p.parts)
    return files


def test_the_matcher_finds_paths_and_leaves_code_alone(tmp_path: Path) -> None:
    assert _NAME.findall("see runtime/boundary/transfer.py and (codec.py; x) or `docs/runtime.md`.") == [
        "runtime/boundary/transfer.py",
        "codec.py",
        "docs/runtime.md",
    ]
    assert _NAME.findall("#include <sys/mman.h> and os.path.join") == []
    assert _FOREIGN.match("torch/nn/modules/linear.py") and _FOREIGN.match("WORK/smoke.py")
    src = tmp_path / "m.py"
    src.write_text('"""Names transfer.py."""\nx = tape.h  # and shm_ring.h\n')
    assert _NAME.findall(_python_text(src)) == ["transfer.py", "shm_ring.h"]


def test_every_named_path_exists() -> None:
    basenames = {p.name for p in _repo_files()}
    missing = []
    for f in _scanned():
        for name in _named(f):
            if not _exists(name, f, basenames):
                missing.append(f"{f.relative_to(ROOT)}: {name}")
    assert len(_scanned()) > 100
    assert not missing, "files named that do not exist:\n" + "\n".join(sorted(set(missing)))
