"""Tests of ``dualpipe_kernels.kernels.pack``: round trips, casts, fp8 error bounds, errors, custom ops.

Three layers:
- the torch fallback (CPU, always in-process);
- the Triton kernels under ``TRITON_INTERPRET=1`` on CPU tensors, compared with the fallback bit for
  bit (``TestTritonInterpreter``).  The variable must be set before triton is imported, so
  ``test_triton_interpreter_suite`` reruns that class in a subprocess that sets it; in the outer
  run the class is skipped with that reason;
- GPU tests (marked ``gpu``): the compiled kernels on CUDA against the fallback on CPU.
"""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from dualpipe_kernels.kernels import pack, plan_layout, unpack
from dualpipe_kernels.kernels.layout import FP8_BLOCK, KIND_FP8, PackLayout

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
HAS_GPU = torch.cuda.is_available()
SIZES = (0, 1, 7, 127, 128, 129, 4097)
FP8 = torch.float8_e4m3fn
FORMATS = {"packed": (None, False), "bf16": (torch.bfloat16, False), "fp8": (FP8, False), "fp8_pow2": (FP8, True)}


# ---------------------------------------------------------------- inputs
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _float(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, spread: float = 4.0) -> torch.Tensor:
    """Random values over several orders of magnitude (exercises every exponent the casts round in)."""
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 9, shape, generator=g).float()) * spread
    return x.to(dtype)


def cases(seed: int = 0) -> dict[str, list[torch.Tensor]]:
    g = _gen(seed)
    out = {f"fp32_{n}": [_float((n,), torch.float32, g)] for n in SIZES}
    out["noncontig_3d"] = [
        _float((5, 9, 33), torch.float32, g)[1:4, ::2, 3:30],
        _float((6, 4, 10), torch.float16, g).permute(2, 0, 1),
        _float((3, 7, 130), torch.bfloat16, g).transpose(0, 2)[::3],
    ]
    out["mixed"] = [
        _float((3, 43), torch.float32, g),
        _float((129,), torch.float16, g),
        _float((2, 2, 65), torch.bfloat16, g),
        torch.randn(4, 3, dtype=torch.float64, generator=g),
        torch.randint(-(2**40), 2**40, (9,), generator=g),
        torch.randint(-100, 100, (3, 5), generator=g, dtype=torch.int32),
        torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
        torch.randint(-100, 100, (6,), generator=g, dtype=torch.int16),
        torch.rand(17, generator=g) > 0.5,
        torch.randn(5, generator=g, dtype=torch.complex64),
        torch.randn(7, generator=g).to(FP8),
        torch.empty(0, 3),
        torch.tensor(2.5),
        torch.zeros(300),
    ]
    out["five_dims"] = [  # more than 4 strided dims after collapsing: gathered through a contiguous copy
        _float((2, 3, 4, 5, 6), torch.float32, g).permute(4, 2, 0, 3, 1),
        torch.randn(2, 3, 2, 3, 4, generator=g, dtype=torch.complex64)[:, ::2, :, ::2, 1:],
    ]
    out["whole_blocks"] = [  # full blocks take the kernels' aligned path; a misaligned start does not
        _float((8192,), torch.float32, g),
        _float((8197,), torch.float16, g),
        _float((2, 4096), torch.bfloat16, g),
        torch.randint(-(2**40), 2**40, (4096,), generator=g),
        torch.rand(4100, generator=g) > 0.5,
        _float((4200,), torch.float32, g)[1:],
    ]
    out["many_64"] = [_float((int(n),), torch.float32, g) for n in torch.randint(0, 300, (64,), generator=g)]
    out["strided_fp32"] = [  # one dtype, strided: the kernel variant with one conversion and index arithmetic
        _float((9, 3000), torch.float32, g).t()[5:],
        _float((4, 6, 700), torch.float32, g)[:, ::2],
        _float((4100,), torch.float32, g),
    ]
    return out


CASES = cases()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (compares -0.0, NaN payloads and bools exactly)."""
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _transposed_empty(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor of ``t``'s shape and dtype whose strides run the other way (a non-contiguous ``out``)."""
    return torch.empty(tuple(reversed(t.shape)), dtype=t.dtype).permute(tuple(reversed(range(t.dim()))))


def _payload(buf: torch.Tensor, layout: PackLayout) -> torch.Tensor:
    return torch.cat([buf[o : o + n] for o, n in layout.regions()])


def _assert_same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert (x.dtype, x.shape) == (y.dtype, y.shape), i
        assert torch.equal(_bits(x), _bits(y)), f"tensor {i} ({x.dtype} {list(x.shape)}) differs"


def _check_fp8_bound(x: torch.Tensor, y: torch.Tensor) -> None:
    """Per block of 128: max |y - x| <= 2^-4 * block absmax, no NaN/inf; all-zero blocks give zeros."""
    x = x.reshape(-1).double()
    y = y.reshape(-1).double()
    assert torch.isfinite(y).all()
    for s in range(0, x.numel(), FP8_BLOCK):
        xb, yb = x[s : s + FP8_BLOCK], y[s : s + FP8_BLOCK]
        amax = xb.abs().max()
        assert (yb - xb).abs().max() <= amax / 16, f"block at {s}: error above 2^-4 x absmax {amax}"
        if amax == 0:
            assert (yb == 0).all()


# ---------------------------------------------------------------- fallback (in-process)
@pytest.mark.parametrize("name", list(CASES))
def test_lossless_round_trip_is_bit_exact(name: str) -> None:
    ts = CASES[name]
    buf, layout = pack(ts)
    assert buf.dtype == torch.uint8 and buf.numel() == layout.nbytes
    _assert_same_bits(unpack(buf, layout), ts)


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_equals_torch_cast(name: str) -> None:
    ts = CASES[name]
    buf, layout = pack(ts, torch.bfloat16)
    back = unpack(buf, layout)
    for t, y, e in zip(ts, back, layout.entries, strict=True):
        cast = t.dtype in (torch.float32, torch.float16)
        want = t.to(torch.bfloat16).to(t.dtype) if cast else t
        assert torch.equal(_bits(y), _bits(want))
        if cast:
            region = buf[e.offset : e.offset + e.nbytes].view(torch.bfloat16)
            assert torch.equal(_bits(region), _bits(t.to(torch.bfloat16)))


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_fp8_error_bound_and_spec(name: str, pow2: bool) -> None:
    ts = CASES[name]
    buf, layout = pack(ts, FP8, pow2_scales=pow2)
    back = unpack(buf, layout)
    for t, y, e in zip(ts, back, layout.entries, strict=True):
        if e.kind != KIND_FP8:
            assert torch.equal(_bits(y), _bits(t))
            continue
        assert y.dtype == t.dtype and y.shape == t.shape
        _check_fp8_bound(t.float(), y.float())
        if t.numel() == 0:
            continue
        # the spec, computed independently: scale = block absmax / 448 (pow2: next power of two)
        x = t.reshape(-1).float()
        blocks = torch.nn.functional.pad(x, (0, -x.numel() % 128)).view(-1, 128)
        scale = blocks.abs().amax(1) / 448
        if pow2:
            scale = torch.where(scale > 0, torch.exp2(torch.ceil(torch.log2(scale))), scale)
        got_scale = buf[e.scale_offset : e.scale_offset + 4 * e.num_scales].view(torch.float32)
        assert torch.equal(got_scale, scale)
        div = torch.where(scale == 0, 1.0, scale)
        want = (blocks / div[:, None]).to(FP8).view(-1)[: x.numel()]
        assert torch.equal(_bits(buf[e.offset : e.offset + e.nbytes]), _bits(want))


def test_fp8_extremes_stay_finite() -> None:
    big = torch.tensor([3.0e38, -3.0e38, 1.0, 0.0] * 40)
    small = torch.tensor([1e-30, -3e-32, 1e-35, 0.0] * 40)
    tiny = torch.tensor([1e-40, -3e-42, 1e-45, 0.0] * 40)  # subnormal fp32: the scale underflows (finite, no bound)
    zero = torch.zeros(256)
    for pow2 in (False, True):
        buf, layout = pack([big, small, zero, -zero, tiny], FP8, pow2_scales=pow2)
        out = unpack(buf, layout)
        assert all(torch.isfinite(y).all() for y in out)
        for x, y in zip([big, small, zero, -zero], out, strict=False):
            _check_fp8_bound(x, y)


def test_out_slot_and_strided_outputs() -> None:
    ts = CASES["mixed"]
    buf, layout = pack(ts)
    slot = torch.full((layout.nbytes + 100,), 7, dtype=torch.uint8)
    view, layout2 = pack(ts, out=slot)
    assert layout2 == layout and view.data_ptr() == slot.data_ptr() and view.numel() == layout.nbytes
    assert torch.equal(_payload(view, layout), _payload(buf, layout))
    assert torch.equal(view, buf)  # padding included
    assert (slot[layout.nbytes :] == 7).all()  # nothing past the layout is written
    outs = [_transposed_empty(t) for t in ts]
    got = unpack(buf, layout, out=outs)
    assert got == outs
    _assert_same_bits(outs, ts)


def test_tensors_requiring_grad_pack_and_unpack_without_autograd() -> None:
    leaf = torch.randn(3, 4, requires_grad=True)
    buf, layout = pack([leaf * 2, leaf], torch.float8_e4m3fn)
    assert not buf.requires_grad
    out = [torch.empty(3, 4, requires_grad=True), torch.empty(3, 4, requires_grad=True)]
    got = unpack(buf, layout, out=out)
    assert got[1].requires_grad and not unpack(buf, layout)[0].requires_grad
    _check_fp8_bound(leaf.detach(), got[1].detach())


def test_bad_inputs_get_clear_errors() -> None:
    x = torch.randn(10)
    with pytest.raises(TypeError, match="tensor 1 has unsupported dtype torch.complex128"):
        pack([x, torch.zeros(2, dtype=torch.complex128)])
    with pytest.raises(ValueError, match="unsupported cast dtype torch.float16"):
        pack([x], torch.float16)
    with pytest.raises(ValueError, match="at least one tensor"):
        pack([])
    with pytest.raises(TypeError, match="list or tuple of tensors"):
        pack(x)
    buf, layout = pack([x, x])
    with pytest.raises(ValueError, match=r"out has 8 bytes, the layout needs 96"):
        pack([x, x], out=torch.empty(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous 1-D torch.uint8"):
        pack([x], out=torch.empty(64, dtype=torch.float32))
    other, _ = pack([x])
    with pytest.raises(ValueError, match=r"has 48 bytes but the layout \(2 tensors, format packed\) describes 96"):
        unpack(other, layout)
    with pytest.raises(ValueError, match=r"out\[1\] is torch.float32 \[11\]"):
        unpack(buf, layout, out=[torch.empty(10), torch.empty(11)])
    with pytest.raises(ValueError, match="out has 1 tensors, the layout 2"):
        unpack(buf, layout, out=[torch.empty(10)])
    with pytest.raises(ValueError, match="overlapping"):
        unpack(buf, layout, out=[torch.empty(10), torch.empty(1).expand(10)])
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        pack([x], backend="cuda")
    with pytest.raises(TypeError, match="layout must be a PackLayout"):
        unpack(buf, layout.encode())


@pytest.mark.skipif(INTERP, reason="checks the error outside the interpreter")
def test_triton_on_cpu_without_the_interpreter_says_how() -> None:
    pytest.importorskip("triton")
    with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1 set before triton is first imported"):
        pack([torch.randn(4)], backend="triton")


def test_custom_ops_opcheck() -> None:
    ts = [torch.randn(3, 5), torch.randint(0, 9, (4,)), torch.randn(130).half()]
    for dtype in (None, torch.bfloat16, FP8):
        buf, layout = pack(ts, dtype)
        code = layout.encode()
        torch.library.opcheck(torch.ops.dualpipe_kernels.pack.default, (ts, code, "torch"))
        torch.library.opcheck(torch.ops.dualpipe_kernels.unpack.default, (buf, code, "torch"))
        out = torch.empty(layout.nbytes, dtype=torch.uint8)
        torch.library.opcheck(torch.ops.dualpipe_kernels.pack_into.default, (ts, code, out, "torch"))
        outs = [torch.empty_like(t) for t in ts]
        torch.library.opcheck(torch.ops.dualpipe_kernels.unpack_into.default, (buf, code, outs, "torch"))


def test_torch_compile_traces_pack_and_unpack() -> None:
    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        buf, layout = pack([a * 2, b], torch.bfloat16)
        x, y = unpack(buf, layout)
        return x + y.float().sum()

    a, b = torch.randn(4, 8), torch.randn(130)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(a, b), step(a, b))

    def into(a: torch.Tensor, slot: torch.Tensor, outs: list[torch.Tensor]) -> torch.Tensor:
        buf, layout = pack([a, a.half()], torch.float8_e4m3fn, out=slot)
        unpack(buf, layout, out=outs)
        return outs[0] * 2

    slot = torch.zeros(1024, dtype=torch.uint8)
    outs = [torch.empty(4, 8), torch.empty(4, 8, dtype=torch.float16)]
    want = into(a, slot.clone(), [o.clone() for o in outs])
    got = torch.compile(into, backend="aot_eager", fullgraph=True)(a, slot, outs)
    assert torch.equal(got, want) and torch.equal(outs[1], unpack(*pack([a.half()], torch.float8_e4m3fn))[0])


# ---------------------------------------------------------------- property tests (fallback)
def _shapes_strategy():  # type: ignore[no-untyped-def]
    from hypothesis import strategies as st

    dims = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)
    dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.uint8])
    return st.lists(st.tuples(dims, dtypes, st.booleans()), min_size=1, max_size=8)


def _make(specs: list, seed: int) -> list[torch.Tensor]:  # type: ignore[type-arg]
    g, out = _gen(seed), []
    for shape, dtype, transpose in specs:
        if dtype.is_floating_point:
            t = _float(shape, dtype, g)
        else:
            t = torch.randint(0, 2 if dtype == torch.bool else 200, shape, generator=g).to(dtype)
        out.append(t.transpose(0, -1) if transpose and t.dim() > 1 else t)
    return out


def test_property_round_trips() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=40, deadline=None)
    @given(_shapes_strategy(), st.sampled_from(list(FORMATS)), st.integers(0, 2**16))
    def check(specs: list, fmt: str, seed: int) -> None:  # type: ignore[type-arg]
        ts = _make(specs, seed)
        dtype, pow2 = FORMATS[fmt]
        buf, layout = pack(ts, dtype, pow2_scales=pow2)
        assert layout == plan_layout([(t.dtype, t.shape) for t in ts], fmt)
        assert all(o % 16 == 0 for o, _ in layout.regions()) and buf.numel() == layout.nbytes
        for t, y, e in zip(ts, unpack(buf, layout), layout.entries, strict=True):
            if fmt == "packed" or not t.dtype.is_floating_point or (fmt == "bf16" and t.dtype == torch.bfloat16):
                assert torch.equal(_bits(y), _bits(t))
            elif fmt == "bf16":
                assert torch.equal(_bits(y), _bits(t.to(torch.bfloat16).to(t.dtype)))
            else:
                assert e.kind == KIND_FP8
                _check_fp8_bound(t.float(), y.float())

    check()


# ---------------------------------------------------------------- Triton (interpreter) == fallback
def _special_values() -> list[torch.Tensor]:
    """Values where rounding is delicate: bf16 and e4m3 ties, carries across powers of two, subnormals."""
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 - 2**-9, 255.5, 3.3895314e38])
    fp8_grid = torch.tensor([125.2, 125.0, 124.0, 120.0, 119.99, 447.0, 440.0, 232.0, 248.0, 0.0, -0.0, 1e-3])
    block = torch.cat([fp8_grid, torch.linspace(-448, 448, 116)])  # absmax 448: scale 1, values are the quotients
    sub = torch.cat([torch.tensor([448.0]), torch.arange(1, 128) * 2**-11])  # e4m3 subnormal range and ties
    return [ties, block, sub, torch.tensor([1e-40, 1e-42, -1e-39] * 43)]


def _triton_vs_fallback(ts: list[torch.Tensor], fmt: str) -> None:
    dtype, pow2 = FORMATS[fmt]
    b_torch, layout = pack(ts, dtype, pow2_scales=pow2, backend="torch")
    b_triton, layout2 = pack(ts, dtype, pow2_scales=pow2, backend="triton")
    assert layout2 == layout
    for o, n in layout.regions():
        assert torch.equal(b_triton[o : o + n], b_torch[o : o + n]), f"region at {o}+{n} differs ({fmt})"
    assert torch.equal(b_triton, b_torch)  # the zero padding too
    _assert_same_bits(unpack(b_torch, layout, backend="triton"), unpack(b_torch, layout, backend="torch"))
    strided = [_transposed_empty(t) for t in ts]
    _assert_same_bits(unpack(b_torch, layout, out=strided, backend="triton"), unpack(b_torch, layout, backend="torch"))


@pytest.mark.skipif(not INTERP, reason="runs in a TRITON_INTERPRET=1 subprocess (test_triton_interpreter_suite)")
class TestTritonInterpreter:
    @pytest.mark.parametrize("fmt", list(FORMATS))
    @pytest.mark.parametrize("name", ["fp32_129", "noncontig_3d", "five_dims", "mixed", "whole_blocks", "many_64"])
    def test_cases(self, name: str, fmt: str) -> None:
        _triton_vs_fallback(CASES[name], fmt)

    @pytest.mark.parametrize("fmt", ["fp8", "fp8_pow2"])
    def test_fp8_in_place_path(self, fmt: str) -> None:
        _triton_vs_fallback(_direct_case(), fmt)

    @pytest.mark.parametrize("fmt", list(FORMATS))
    def test_special_values(self, fmt: str) -> None:
        ts = _special_values()
        halves = [t.clamp(-6e4, 6e4).half() for t in ts[:3]]  # finite in fp16 (inf input is out of scope)
        _triton_vs_fallback(ts + halves + [t.bfloat16() for t in ts[:3]], fmt)

    def test_e4m3_codes_match_torch_cast_exhaustively(self) -> None:
        # every e4m3 code, every midpoint between neighbours and points beside them: one block of scale 1
        vals = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()
        mids = (vals[1:] + vals[:-1]) / 2
        xs = torch.cat([vals, mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9))])
        xs = torch.cat([xs, -xs])
        blocks = [torch.cat([torch.tensor([448.0]), xs[i : i + 127]]) for i in range(0, xs.numel(), 127)]
        _triton_vs_fallback(blocks, "fp8")

    def test_one_launch_for_many_tensors(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from dualpipe_kernels.kernels import pack_triton as pt

        grids: list[tuple[int, ...]] = []

        class Counting:
            def __init__(self, kernel: object) -> None:
                self.kernel = kernel

            def __getitem__(self, grid: tuple[int, ...]) -> object:
                grids.append(grid)
                return self.kernel[grid]  # type: ignore[index]

        monkeypatch.setattr(pt, "_pack_kernel", Counting(pt._pack_kernel))
        monkeypatch.setattr(pt, "_unpack_kernel", Counting(pt._unpack_kernel))
        ts = CASES["many_64"] + CASES["noncontig_3d"] + CASES["mixed"]
        buf, layout = pack(ts, FP8, backend="triton")
        unpack(buf, layout, backend="triton")
        assert len(grids) == 2  # one pack launch, one unpack launch, for 81 tensors

    @pytest.mark.parametrize("iters", [2, 3])
    def test_programs_looping_over_several_blocks_match_the_fallback(
        self, iters: int, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The GPU's launch shape (each program loops over ``iters`` blocks, a tensor's last program over fewer),
        here in the interpreter: tensors of 1, 2 and 5 blocks, small ones between, every format."""
        from dualpipe_kernels.kernels import pack_triton as pt

        monkeypatch.setattr(pt, "iters_override", iters)
        block = pt.rows_per_block(torch.device("cpu")) * 128
        g = _gen(5)
        ts = [_float((block,), torch.float32, g), _float((7,), torch.float16, g),
              _float((2 * block + 3,), torch.float32, g), _float((5 * block // 128, 128), torch.bfloat16, g).t(),
              torch.randint(0, 9, (block + 1,), generator=g, dtype=torch.int32)]  # fmt: skip
        for fmt in FORMATS:
            _triton_vs_fallback(ts, fmt)

    @pytest.mark.parametrize("fmt", list(FORMATS))
    @pytest.mark.parametrize("specialize", [True, False])
    def test_specialised_and_generic_kernels_match_the_fallback(
        self, fmt: str, specialize: bool, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Each launch's variant (one conversion, contiguous or strided, int32 indices) and the generic
        kernel, on tensors of one dtype (strided and contiguous) and on a mixed set."""
        from dualpipe_kernels.kernels import pack_triton as pt

        monkeypatch.setattr(pt, "specialize", specialize)
        g = _gen(7)
        strided = [_float((9, 300), torch.float32, g).t()[5:], _float((4, 6, 70), torch.float32, g)[:, ::2]]
        _triton_vs_fallback(strided, fmt)
        _triton_vs_fallback(strided + [_float((4100,), torch.float32, g)], fmt)
        _triton_vs_fallback(CASES["whole_blocks"], fmt)

    def test_repacking_the_same_tensors_reads_their_new_values(self) -> None:
        """A launch that reuses its table (same addresses) still moves what the tensors hold now."""
        g = _gen(8)
        ts = [_float((4100,), torch.float32, g), _float((3, 70), torch.float32, g).t()]
        buf = torch.empty(pack(ts, torch.bfloat16, backend="torch")[1].nbytes, dtype=torch.uint8)
        outs = [torch.empty_like(t) for t in ts]
        for step in range(3):
            for t in ts:
                t.copy_(_float(tuple(t.shape), torch.float32, g))
            got, layout = pack(ts, torch.bfloat16, out=buf, backend="triton")
            assert torch.equal(got, pack(ts, torch.bfloat16, backend="torch")[0]), step
            unpack(got, layout, out=outs, backend="triton")
            _assert_same_bits(outs, unpack(got, layout, backend="torch"))

    def test_property_triton_matches_fallback(self) -> None:
        from hypothesis import given, settings
        from hypothesis import strategies as st

        @settings(max_examples=12, deadline=None)
        @given(_shapes_strategy(), st.sampled_from(list(FORMATS)), st.integers(0, 2**16))
        def check(specs: list, fmt: str, seed: int) -> None:  # type: ignore[type-arg]
            _triton_vs_fallback(_make(specs, seed), fmt)

        check()


@pytest.mark.skipif(INTERP, reason="this is the outer run")
@pytest.mark.timeout(600)
def test_triton_interpreter_suite() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k", "TestTritonInterpreter"],
        env=env,
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("name", ["fp32_4097", "noncontig_3d", "mixed", "whole_blocks", "many_64", "strided_fp32"])
def test_gpu_triton_matches_cpu_fallback(name: str, fmt: str) -> None:
    dtype, pow2 = FORMATS[fmt]
    ts = CASES[name]
    b_cpu, layout = pack(ts, dtype, pow2_scales=pow2, backend="torch")
    b_gpu, _ = pack([t.cuda() for t in ts], dtype, pow2_scales=pow2, backend="triton")
    assert torch.equal(b_gpu.cpu(), b_cpu)
    back = unpack(b_cpu.cuda(), layout, backend="triton")
    _assert_same_bits([t.cpu() for t in back], unpack(b_cpu, layout, backend="torch"))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_gpu_large_pack_is_one_launch_and_exact() -> None:
    ts = [torch.randn(1 << 22, device="cuda"), torch.randn(3, 1 << 20, device="cuda").t()]
    pack(ts)  # compiles
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        buf, layout = pack(ts)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("pack_kernel" in k for k in kernels) == 1, kernels
    _assert_same_bits([t.cpu() for t in unpack(buf, layout)], [t.cpu() for t in ts])
    assert layout.nbytes == sum(math.ceil(t.numel() * 4 / 16) * 16 for t in ts)


def test_kernel_variant_follows_the_launch_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which kernel a launch compiles: one conversion code or -1 (generic), all contiguous, int32 indices."""
    from dualpipe_kernels.kernels import pack_table as ptab
    from dualpipe_kernels.kernels import pack_triton as pt

    block = 16 * 128

    def variant(ts: list[torch.Tensor], dtype: torch.dtype | None) -> tuple[int, bool, bool]:
        _, layout = pack(ts, dtype, backend="torch")
        return pt._variant(pt._static_table([pt._as_copyable(t) for t in ts], layout, block), block)

    g = _gen(3)
    a, b = _float((300,), torch.float32, g), _float((20, 30), torch.float32, g)
    assert variant([a, b], None) == (ptab.COPY4, True, True)
    assert variant([a, b], torch.bfloat16) == (ptab.BF16_F32, True, True)
    assert variant([a, b.t()], FP8) == (ptab.FP8_F32, False, True)
    assert variant([a, b.half()], None) == (-1, True, True)  # 4- and 2-byte copies: every path
    # a zero-size tensor of another dtype has no blocks, so no program reads its row
    assert variant([a, torch.empty(0, dtype=torch.int16)], None) == (ptab.COPY4, True, True)
    monkeypatch.setattr(pt, "specialize", False)
    assert variant([a, b], None) == (-1, False, False)
    monkeypatch.setattr(pt, "specialize", True)
    # indices past int32: a block index (2^31 elements) or a strided offset
    huge = np.zeros((1, pt._WIDTH), dtype=np.int64)
    huge[0, [4, 5, 18]] = ptab.COPY4, 1, -(-(2**31) // block)
    assert pt._variant(huge, block) == (ptab.COPY4, True, False)
    far = np.zeros((1, pt._WIDTH), dtype=np.int64)
    far[0, [4, 5, 6, 7, 8, 9, 10, 11, 12, 18]] = ptab.COPY4, 0, 1, 1, 2, 0, 0, 0, 2**31, 1
    assert pt._variant(far, block) == (ptab.COPY4, False, False)
    # dim 0 (its size is the element count over the others'): rows of 128 elements 2^29 apart
    rows = np.zeros((1, pt._WIDTH), dtype=np.int64)
    rows[0, [1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 18]] = 4 * 128, ptab.COPY4, 0, 1, 1, 128, 2**29, 0, 0, 1, 1
    assert pt._variant(rows, block) == (ptab.COPY4, False, True)  # 4 rows: last offset 3 * 2^29 + 127 fits
    rows[0, 1] = 5 * 128  # 5 rows: 2^31 + 127 does not
    assert pt._variant(rows, block) == (ptab.COPY4, False, False)


def test_launch_tables_are_reused_for_the_same_addresses() -> None:
    """The table a launch reads is built once per (plan, buffer, tensors' addresses, stream): the same tensors
    packed again reuse it; another buffer, other tensors or another layout build a new one."""
    from dualpipe_kernels.kernels import pack_triton as pt

    g = _gen(4)
    ts = [_float((300,), torch.float32, g), _float((20, 30), torch.float32, g).t()]
    _, layout = pack(ts, None, backend="torch")
    buf, other_buf = torch.empty(layout.nbytes, dtype=torch.uint8), torch.empty(layout.nbytes, dtype=torch.uint8)
    plan = pt._plan(ts, layout, 16, buf.device)
    first = pt._device_table(plan, ts, buf)
    builds = pt.table_builds
    assert pt._device_table(plan, ts, buf) is first and pt.table_builds == builds
    expect = pt._table(plan, ts, buf.data_ptr())
    assert np.array_equal(first.numpy().reshape(expect.shape), expect)
    assert pt._device_table(plan, ts, other_buf) is not first  # the fast-path flags follow the buffer's address
    clones = [t.clone() for t in ts]
    again = pt._device_table(pt._plan(clones, layout, 16, buf.device), clones, buf)
    assert again is not first and pt.table_builds == builds + 2
    assert np.array_equal(again.numpy().reshape(expect.shape)[:, pt._ADDR], [t.data_ptr() for t in clones])
    # a cleared cache builds the same table again
    pt._TABLES.clear()
    rebuilt = pt._device_table(plan, ts, buf)
    assert rebuilt is not first and torch.equal(rebuilt, first) and pt.table_builds == builds + 3


def test_programs_that_fit_a_multiprocessor() -> None:
    from dualpipe_kernels.kernels.cubin import fit_per_sm

    assert fit_per_sm(254, 4) == 2  # the generic kernel's registers: 2 programs of 4 warps
    assert fit_per_sm(64, 4) == 8 and fit_per_sm(72, 4) == 7
    assert fit_per_sm(16, 4) == 16  # then the 2048 threads bound
    assert fit_per_sm(16, 4, max_threads=1536) == 12  # sm_86 / sm_89
    with pytest.raises(ValueError, match="cubin"):
        from dualpipe_kernels.kernels.cubin import registers_per_thread

        registers_per_thread(b"not an elf")


def test_layout_pickles_with_buffer() -> None:
    buf, layout = pack(CASES["mixed"], FP8)
    again = pickle.loads(pickle.dumps(layout))
    _assert_same_bits(unpack(buf, again), unpack(buf, layout))


@pytest.mark.device_build
@pytest.mark.skipif(INTERP, reason="compiles for a GPU target; the interpreter run has no compiler")
@pytest.mark.timeout(90)  # nine builds; device_check's gpu step runs it under its 150 s cap
def test_kernels_compile_for_sm90_with_vector_accesses() -> None:
    """Compiled (not interpreted) Triton, for an H100/H200 target, without a GPU: it builds, and the
    aligned whole-block path moves 16 bytes per access, the masked path stays exact (interpreter tests)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dualpipe_kernels.kernels import pack_table as ptab
    from dualpipe_kernels.kernels import pack_triton as pt
    from dualpipe_kernels.kernels.cubin import fit_per_sm, registers_per_thread

    consts = {"LOG_N": 3, "ROWS": 16, "W": pt._WIDTH}
    generic = {"CODE": -1, "CONTIG": False, "I32": False}
    variants = [(pt._pack_kernel, {"POW2": False, **generic}), (pt._pack_kernel, {"POW2": True, **generic})]
    variants.append((pt._unpack_kernel, generic))
    # what a launch of one dtype compiles: one conversion, contiguous, int32 indices
    for code in (ptab.COPY4, ptab.BF16_F32, ptab.FP8_F32):
        one = {"CODE": code, "CONTIG": True, "I32": True}
        variants += [(pt._pack_kernel, {"POW2": False, **one}), (pt._unpack_kernel, one)]
    # one dtype strided, and mixed dtypes contiguous, both with int32 indices
    for extra in ({"CODE": ptab.COPY4, "CONTIG": False, "I32": True}, {"CODE": -1, "CONTIG": True, "I32": True}):
        variants += [(pt._pack_kernel, {"POW2": False, **extra}), (pt._unpack_kernel, extra)]
    registers = []
    for kernel, extra in variants:
        sig = {"table": "*i64", "buf": "*u8", "n": "i32", "iters": "i32"}
        sig.update(dict.fromkeys({**consts, **extra}, "constexpr"))
        src = ASTSource(
            fn=kernel, signature=sig, constexprs={**consts, **extra}, attrs={(1,): [["tt.divisibility", 16]]}
        )
        try:
            asm = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm
        except RuntimeError as e:  # no CUDA toolchain in this triton build: nothing to check here
            if "ptxas" in str(e) or "cuda" in str(e).lower():
                pytest.skip(f"triton cannot build for CUDA here: {e}")
            raise
        ptx = asm["ptx"]
        assert "ld.global.v4" in ptx and "st.global.v4" in ptx, kernel.__name__
        assert "div.full" not in ptx  # divisions are IEEE (div_rn), as torch's
        registers.append(registers_per_thread(asm["cubin"]))
    # Occupancy: the generic kernel holds ~250 registers a thread (2 programs of 4 warps per multiprocessor);
    # a launch of one dtype, contiguous, compiles to a kernel of which at least 7 programs fit (8 for copies
    # and bf16), which the grid (PROGRAMS_PER_SM) assumes.
    names = ["generic pack", "generic pack pow2", "generic unpack"]
    names += [f"{k} code {c}" for c in (ptab.COPY4, ptab.BF16_F32, ptab.FP8_F32) for k in ("pack", "unpack")]
    names += [f"{k} {what}" for what in ("strided code 2", "mixed contiguous") for k in ("pack", "unpack")]
    print("sm_90 registers per thread:", ", ".join(f"{n} {r}" for n, r in zip(names, registers, strict=True)))
    assert max(registers[9:]) < min(registers[:3]), registers  # int32 indices and fewer paths help here too
    specialised = registers[3:9]
    assert all(fit_per_sm(r, 4) >= 7 for r in specialised), registers
    assert all(fit_per_sm(r, 4) >= 8 for r in specialised[:4]), registers
    assert max(specialised) < min(registers[:3]), registers


# ---------------------------------------------------------------- fp8 in place (large tensors)
def _direct_case() -> list[torch.Tensor]:
    """fp8-cast tensors of at least DIRECT_MIN elements (quantised straight into the buffer) beside small ones."""
    from dualpipe_kernels.kernels.pack_torch import DIRECT_MIN

    g = _gen(11)
    n = DIRECT_MIN
    specials = torch.cat(_special_values())
    return [
        _float((n + 129,), torch.float32, g),
        _float((140, 130), torch.float16, g).t(),  # non-contiguous, a short last block
        _float((2, n // 2), torch.bfloat16, g),
        _float((300,), torch.float32, g),  # small: the batched path, between in-place ones
        torch.zeros(n + 5),  # all-zero blocks
        specials.repeat(n // specials.numel() + 1),  # ties, e4m3 subnormals, fp32-subnormal scales (the clamp)
        torch.randint(-100, 100, (n,), generator=g, dtype=torch.int32),
    ]


@pytest.mark.parametrize("fmt", ["fp8", "fp8_pow2"])
def test_fp8_in_place_path_matches_the_batched_path(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from dualpipe_kernels.kernels import pack_torch

    dtype, pow2 = FORMATS[fmt]
    nan = _float((pack_torch.DIRECT_MIN,), torch.float32, _gen(3))
    nan[5] = float("nan")  # a NaN block: NaN codes take torch's own cast on the way back
    ts = [*_direct_case(), nan]
    buf, layout = pack(ts, dtype, pow2_scales=pow2, backend="torch")
    outs = unpack(buf, layout, backend="torch")
    strided = unpack(buf, layout, out=[_transposed_empty(t) for t in ts], backend="torch")
    monkeypatch.setattr(pack_torch, "DIRECT_MIN", 1 << 62)  # every fp8 tensor through the batched path
    ref, _ = pack(ts, dtype, pow2_scales=pow2, backend="torch")
    assert torch.equal(buf, ref)
    _assert_same_bits(outs, unpack(ref, layout, backend="torch"))
    _assert_same_bits(strided, outs)
    for x, y in zip(ts[:3], outs[:3], strict=True):
        _check_fp8_bound(x.float(), y.float())


@pytest.mark.parametrize("big", [2.0**118, 2.0**120])  # below 2^119: the fp16 route; above: torch's cast
def test_e4m3_fp16_route_equals_torch_cast_times_scale(big: float) -> None:
    from dualpipe_kernels.kernels.pack_torch import _dequantize_into

    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].repeat(64)[: 128 * 100]  # every non-NaN code, whole blocks
    scales = torch.cat([torch.tensor([1.0, big, 3e-39, 1e-45, 0.0, 1.7]), torch.rand(94) * 1e3]).float()
    got = torch.empty(codes.numel())
    _dequantize_into(codes, scales.view(torch.uint8), got)
    want = (codes.view(FP8).float().view(-1, FP8_BLOCK) * scales[:, None]).view(-1)
    assert torch.equal(_bits(got), _bits(want))
