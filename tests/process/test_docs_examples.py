"""The docs' examples run: every ```python block of docs/*.md that follows a ``<!-- test:run -->`` marker.

Each block is a complete program, run as a script in a fresh process (cwd: a temporary folder, this checkout
first on PYTHONPATH).  ``<!-- test:run ranks=N -->`` starts it on N processes with the environment torchrun
gives (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so ``dist.init_process_group("gloo")``
works as written.  A block passes when every process exits with status 0 within the time limit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dualpipe_kernels.runtime import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MARKER = re.compile(r"<!-- test:run(?: ranks=(\d+))? -->\s*\n```python\n(.*?)^```", re.S | re.M)
TIMEOUT_S = 120


def _examples() -> list[tuple[str, int, str]]:
    """(id, ranks, code) of every marked block, in file and page order."""
    out = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        for m in MARKER.finditer(text):
            line = text[: m.start()].count("\n") + 1
            out.append((f"{page.name}:{line}", int(m.group(1) or 1), m.group(2)))
    return out


EXAMPLES = _examples()


def test_the_docs_have_runnable_examples() -> None:
    pages = {e[0].split(":")[0] for e in EXAMPLES}
    assert {"low_level.md", "schedules.md"} <= pages, pages
    low_level = [e for e in EXAMPLES if e[0].startswith("low_level.md")]
    assert len(low_level) >= 3 and any(ranks == 2 for _, ranks, _ in low_level)


def test_an_unmarked_block_is_not_collected() -> None:
    text = "```python\nraise SystemExit(1)\n```\n<!-- test:run ranks=2 -->\n```python\nprint(1)\n```\n"
    assert [(m.group(1), m.group(2)) for m in MARKER.finditer(text)] == [("2", "print(1)\n")]


@pytest.mark.parametrize(("where", "ranks", "code"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_docs_example_runs(where: str, ranks: int, code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("OMP_NUM_THREADS", "1")
    port = str(free_port())
    procs = []
    for rank in range(ranks):
        rank_env = env
        if ranks > 1:
            rank_env = {
                **env,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(ranks),
                "LOCAL_WORLD_SIZE": str(ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                cwd=tmp_path,
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    failures = []
    try:
        for rank, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                failures.append(f"rank {rank}: no exit within {TIMEOUT_S} s")
                continue
            if p.returncode != 0:
                failures.append(f"rank {rank}: exit status {p.returncode}\n{out[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    assert not failures, f"docs/{where} failed:\n" + "\n".join(failures)


def test_every_relative_link_of_the_docs_points_at_a_file() -> None:
    """README.md and docs/*.md: every relative link (``[text](path)``, anchors dropped) names a file or folder
    of the repository, and no page points at an internal design note outside it."""
    broken = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = page.read_text()
        assert "DESIGN.md" not in text and "../shared" not in text, page.name
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
