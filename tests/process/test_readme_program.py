"""The README's complete program (the block after ``<!-- ci:program -->``) runs on 2 processes under torchrun.

Its printed losses are compared with the same model (``layer`` taken from the
program itself), batch, optimizer and mean loss trained in one process with plain
torch: relative error <= 1e-6 (the pipeline reduces each weight gradient per
micro-batch, then across micro-batches: another summation order than the full batch).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from dualpipe_kernels.runtime import free_port

ROOT = Path(__file__).resolve().parents[2]


def _program() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- ci:program -->\s*```python\n(.*?)```", text, re.S)
    assert m, "README.md has no <!-- ci:program --> python block"
    return m.group(1)


def _one_process_losses(code: str) -> list[float]:
    """The README's ``layer`` from its source, trained on the full batch in one process."""
    fn = next(n for n in ast.parse(code).body if isinstance(n, ast.FunctionDef) and n.name == "layer")
    scope: dict[str, object] = {"torch": torch, "nn": nn}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "README.md", "exec"), scope)  # noqa: S102
    model = nn.Sequential(*[scope["layer"](i) for i in range(8)])  # type: ignore[operator]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1234)
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    out = []
    for _ in range(3):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.timeout(300)
def test_readme_program_on_two_processes(tmp_path: Path) -> None:
    code = _program()
    script = tmp_path / "train.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_port()), str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = [(int(s), float(v)) for s, v in re.findall(r"step (\d+) loss ([0-9.e+-]+)", proc.stdout)]
    assert len(got) == 6, proc.stdout  # 3 steps x 2 ranks: every rank prints the same loss
    want = _one_process_losses(code)
    for step, value in got:
        assert abs(value - want[step]) <= 1e-6 * abs(want[step]), (step, value, want[step])
