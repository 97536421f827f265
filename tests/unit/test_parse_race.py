"""CPython's AST race (gh-106905) cannot fail a kernel compile: one retry of exactly that SystemError, and the
offline analysis compiles its variants from one thread.

The race itself cannot be provoked on demand (it needs two threads inside ``ast.parse`` at an unlucky moment),
so a stand-in raises the very SystemError CPython raises, once: the call is made a second time and succeeds;
a SystemError with another message, or the race twice, propagates.  The same on the pack kernels' launch path
(a stand-in kernel, no Triton run) and on the offline compile (a stand-in ``triton.compile``).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from dualpipe_kernels.kernels.parse_race import AST_RACE_MESSAGE, is_ast_race, retry_ast_race

RACE = SystemError(AST_RACE_MESSAGE)


class Flaky:
    """Raises each of ``errors`` on successive calls, then returns the call count."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self, *args: object, **kwargs: object) -> int:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.calls


def test_the_race_is_retried_once_and_the_second_call_counts() -> None:
    call = Flaky(SystemError(AST_RACE_MESSAGE))
    assert retry_ast_race(call) == 2 and call.calls == 2


def test_a_call_without_the_race_is_made_once() -> None:
    call = Flaky()
    assert retry_ast_race(call) == 1 and call.calls == 1


@pytest.mark.parametrize(
    "first",
    [SystemError("error return without exception set"), RuntimeError(AST_RACE_MESSAGE)],
    ids=["another SystemError", "the message on another type"],
)
def test_anything_but_that_systemerror_propagates_at_once(first: BaseException) -> None:
    call = Flaky(first)
    with pytest.raises(type(first), match=str(first)):
        retry_ast_race(call)
    assert call.calls == 1
    assert not is_ast_race(first)


def test_the_race_wrapped_by_the_compiler_is_retried_and_another_wrapped_error_is_not() -> None:
    """Triton raises a callee's parse error as a CompilationError ``from`` it: the race under it counts."""

    def wrapped(inner: BaseException) -> RuntimeError:
        try:
            raise RuntimeError("at 12:8: a call to a @triton.jit helper") from inner
        except RuntimeError as err:
            return err

    call = Flaky(wrapped(SystemError(AST_RACE_MESSAGE)))
    assert retry_ast_race(call) == 2 and call.calls == 2
    other = wrapped(SystemError("error return without exception set"))
    call = Flaky(other)
    with pytest.raises(RuntimeError, match="triton.jit helper"):
        retry_ast_race(call)
    assert call.calls == 1 and not is_ast_race(other)


def test_the_race_twice_propagates() -> None:
    call = Flaky(SystemError(AST_RACE_MESSAGE), SystemError(AST_RACE_MESSAGE))
    with pytest.raises(SystemError, match=AST_RACE_MESSAGE):
        retry_ast_race(call)
    assert call.calls == 2


class FlakyKernel:
    """A stand-in for a Triton kernel: ``kernel[grid](...)`` raises the given errors first, then records."""

    def __init__(self, *errors: BaseException) -> None:
        self.launch = Flaky(*errors)

    def __getitem__(self, grid: tuple[int, ...]) -> Flaky:
        return self.launch


def _launch_args() -> tuple[list[torch.Tensor], Any, torch.Tensor]:
    from dualpipe_kernels.kernels import plan_layout

    ts = [torch.arange(300, dtype=torch.float32), torch.ones(7, 5, dtype=torch.float16)]
    layout = plan_layout([(t.dtype, t.shape) for t in ts], "packed")
    return ts, layout, torch.empty(layout.nbytes, dtype=torch.uint8)


@pytest.mark.parametrize("path", ["pack_into", "prepared launch"])
def test_a_first_launch_that_hits_the_race_launches_again(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pt = pytest.importorskip("dualpipe_kernels.kernels.pack_triton")
    kernel = FlakyKernel(SystemError(AST_RACE_MESSAGE))
    monkeypatch.setattr(pt, "_pack_kernel", kernel)
    ts, layout, buf = _launch_args()
    if path == "pack_into":
        pt.pack_into(ts, layout, buf)
    else:
        launch = pt.prepare(ts, layout, buf, True)
        assert launch is not None
        launch(buf)
    assert kernel.launch.calls == 2 and not kernel.launch.errors


def test_a_wrapped_race_of_a_launch_launches_again(monkeypatch: pytest.MonkeyPatch) -> None:
    pt = pytest.importorskip("dualpipe_kernels.kernels.pack_triton")
    try:
        raise RuntimeError("compiling a helper") from SystemError(AST_RACE_MESSAGE)
    except RuntimeError as err:
        kernel = FlakyKernel(err)
    monkeypatch.setattr(pt, "_unpack_kernel", kernel)
    ts, layout, buf = _launch_args()
    pt.unpack_into(buf, layout, ts)
    assert kernel.launch.calls == 2


@pytest.mark.parametrize("path", ["unpack_into", "prepared launch"])
def test_another_systemerror_of_a_launch_propagates(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pt = pytest.importorskip("dualpipe_kernels.kernels.pack_triton")
    kernel = FlakyKernel(SystemError("error return without exception set"))
    monkeypatch.setattr(pt, "_unpack_kernel", kernel)
    ts, layout, buf = _launch_args()
    with pytest.raises(SystemError, match="error return without exception set"):
        if path == "unpack_into":
            pt.unpack_into(buf, layout, ts)
        else:
            launch = pt.prepare(ts, layout, buf, False)
            assert launch is not None
            launch(buf)
    assert kernel.launch.calls == 1


def test_an_offline_compile_that_hits_the_race_compiles_again(monkeypatch: pytest.MonkeyPatch) -> None:
    triton = pytest.importorskip("triton")
    from dualpipe_kernels.kernels import offline

    class Compiled:
        asm = {"cubin": b"", "ttir": ""}

    compile_ = Flaky(SystemError(AST_RACE_MESSAGE))
    monkeypatch.setattr(triton, "compile", lambda *a, **k: (compile_(), Compiled())[1])
    consts = offline._constexprs(2, False, True, 16, 16)
    assert offline.compile_variant(True, consts) is Compiled.asm
    assert compile_.calls == 2


def test_the_offline_analysis_compiles_every_variant_in_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only ``cuobjdump`` (a process) runs on the worker threads; every compile (a parse) runs in this thread."""
    from dualpipe_kernels.kernels import offline

    compiled: list[int] = []
    listed: list[int] = []

    def fake_compiled(fmt: str, name: str, code: int, pow2: bool, pack: bool, contig: bool) -> dict[str, Any]:
        compiled.append(threading.get_ident())
        row = {"format": fmt, "variant": name, "contiguous": contig, "sass_per_element": None}
        return {**row, "_tile": 16, "_fast_cubin": b"x" if contig else None}

    def fake_listing(cubin: bytes, tool: str) -> list[tuple[int, str]]:
        listed.append(threading.get_ident())
        return [(0, "MOV"), (16, "BRA 0x0")]

    monkeypatch.setattr(offline, "_compiled", fake_compiled)
    monkeypatch.setattr(offline, "sass_listing", fake_listing)
    monkeypatch.setattr(offline, "cuobjdump_path", lambda: "cuobjdump")
    rows = offline.analyse(workers=4)
    jobs = sum(2 * (2 if not p2 else 1) for _, _, _, p2 in offline.VARIANTS)
    assert len(rows) == len(compiled) == jobs and len(listed) == jobs // 2
    assert set(compiled) == {threading.get_ident()}
    assert all("_tile" not in r and "_fast_cubin" not in r for r in rows)
    # two instructions in the loop over the 16 x 128 / 128 elements a thread converts per tile
    assert [r["sass_per_element"] for r in rows] == [0.125 if r["contiguous"] else None for r in rows]
