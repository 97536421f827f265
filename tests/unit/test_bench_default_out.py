"""`dualpipe-kernels bench` without --out writes into a fresh folder it names, never into bench/results.

In-process (the engine suite at a tiny size takes well under a second).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dualpipe_kernels.cli import main

ARGV = ["bench", "engine", "--ranks", "2", "--microbatches", "4", "--repeats", "1", "--json", "--no-plots"]


def test_bench_without_out_writes_a_fresh_named_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench" / "results").mkdir(parents=True)  # as in a checkout: must stay untouched
    folders = []
    for _ in range(2):  # two runs in the same second still get two folders
        assert main(ARGV) == 0
        captured = capsys.readouterr()
        res = json.loads(captured.out)
        (written,) = {Path(f).parent for f in res["files"]}
        assert written.name.startswith("dualpipe-bench-engine-"), written
        assert f"results go to {written}" in captured.err  # the run names its folder
        assert (tmp_path / written / "engine.json").is_file() and (tmp_path / written / "engine.md").is_file()
        folders.append(written)
    assert folders[0] != folders[1]
    assert os.listdir(tmp_path / "bench" / "results") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["bench", *(f.name for f in folders)])


def test_bench_with_out_writes_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([*ARGV, "--out", "mine"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["mine"]
    assert (tmp_path / "mine" / "engine.json").is_file()
