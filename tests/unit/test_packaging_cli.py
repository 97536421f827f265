"""Packaging and CLI details a user meets first: version, typing marker, metadata, help texts, output errors."""

from __future__ import annotations

import os
import pydoc
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import dualpipe_kernels
from dualpipe_kernels.cli import main
from dualpipe_kernels.runtime import Pipeline

ROOT = Path(__file__).resolve().parents[2]


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"dualpipe-kernels {dualpipe_kernels.__version__}"


def test_typed_marker_and_metadata() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert (ROOT / "dualpipe_kernels" / "py.typed").exists()
    assert "py.typed" in meta["tool"]["setuptools"]["package-data"]["dualpipe_kernels"]
    assert meta["project"]["urls"] and meta["project"]["version"] == dualpipe_kernels.__version__


def test_help_of_pipeline_is_its_own() -> None:
    text = pydoc.render_doc(Pipeline, renderer=pydoc.plaintext)
    assert "scale_grads" in text and "Check the arguments" in text
    assert "Initialize internal Module state" not in text  # nn.Module's __init__ docstring


def test_simulate_unwritable_output_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--schedule", "dualpipev", "--ranks", "2", "--microbatches", "4"]
    assert main([*args, "--png", "/nonexistent/dir/t.png"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "/nonexistent/dir/t.png" in err and "cannot write" in err


def test_simulate_says_what_it_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv, trace = str(tmp_path / "s.csv"), str(tmp_path / "s.json")
    args = ["simulate", "--schedule", "dualpipev", "--ranks", "2", "--microbatches", "4"]
    assert main([*args, "--csv", csv, "--trace", trace, "--json"]) == 0
    out = capsys.readouterr()
    assert f"wrote csv {csv}" in out.err and f"wrote trace {trace}" in out.err
    import json

    assert json.loads(out.out)["written"] == {"trace": trace, "csv": csv}


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "python").glob("*.py")))
def test_examples_help_has_a_description(script: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "python" / script), "--help"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("usage:")
    desc = [ln for ln in lines[1:] if ln.strip() and not ln.startswith(" ")][0]  # first unindented text
    assert not desc.startswith(("options", "positional")), proc.stdout


def test_examples_use_only_the_public_api() -> None:
    """python/ imports only from package __init__s (dualpipe_kernels.X, not dualpipe_kernels.X.private_module)."""
    public = {"dualpipe_kernels", "dualpipe_kernels.runtime", "dualpipe_kernels.schedules", "dualpipe_kernels.models"}
    public |= {"dualpipe_kernels.compat", "dualpipe_kernels.demo_data", "dualpipe_kernels.transport"}
    import ast

    for path in (ROOT / "python").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dualpipe_kernels"):
                assert node.module in public, f"{path.name} imports from {node.module}"
