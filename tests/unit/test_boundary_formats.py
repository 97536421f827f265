"""Boundary formats (runtime/boundary/codec.py) over the p2p protocol, in one process over a loopback pair.

``packed``: one data transfer per message, bit-exact; ``bf16``/``fp8``: the
tensors that carry gradient come back as the kernels' cast gives them, every
other tensor (ints, masks, float constants with -inf) bit for bit; speculative
receives and changed shapes work as unpacked; the sender's and receiver's
formats must agree; a bad ``boundary_format`` gets a clear error.
"""

from __future__ import annotations

import pytest
import torch
from fake_transports import LoopbackPair

from dualpipe_kernels.kernels import pack, unpack
from dualpipe_kernels.runtime.boundary.codec import BOUNDARY_FORMATS, BoundaryFormat, boundary_format
from dualpipe_kernels.runtime.boundary.transfer import BoundaryRecv, BoundarySend, LayoutMemory, TagSpace
from dualpipe_kernels.transport.base import TransportError

TIMEOUT_S = 5.0
ACT, GRAD = (0, 1, 2), (1, 1, 2)  # message keys: direction, consumer stage, micro-batch
CAST = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def _message(seed: int, rows: int = 3, fill: float = float("-inf")) -> tuple[list[torch.Tensor | None], list[bool]]:
    """Hidden (grad), None, ids, an additive mask of ``fill`` (no grad), an empty tensor, a non-contiguous view."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, 130, generator=g)
    mask = torch.zeros(rows, 7).masked_fill(torch.rand(rows, 7, generator=g) > 0.5, fill)
    ids = torch.randint(0, 9, (rows,), generator=g)
    view = torch.randn(5, rows, generator=g, dtype=torch.float16).t()
    return [h, None, ids, mask, torch.empty(0, 5), view], [True, False, False, False, False, True]


def _exchange(pair, tensors, flags, key, fmt, mem_s, mem_r, recv_fmt=None):
    tags = TagSpace(4, 4)
    recv = BoundaryRecv(pair.ends[1], 0, tags, key, "recv", torch.device("cpu"), mem_r, recv_fmt or fmt)
    send = BoundarySend(pair.ends[0], tensors, flags, 1, tags, key, "send", mem_s, fmt)
    recv.progress()
    got = recv.wait(TIMEOUT_S)
    send.wait(TIMEOUT_S)
    assert pair.box.unmatched() == [], "a posted transfer was never matched"
    return got, send


def _expected(t: torch.Tensor, fmt: str, cast: bool) -> torch.Tensor:
    """What the kernels make of ``t`` in ``fmt`` (itself unless cast)."""
    if fmt in ("none", "packed") or not cast:
        return t
    buf, layout = pack([t], CAST[fmt.removesuffix("_pow2")], pow2_scales=fmt.endswith("_pow2"))
    return unpack(buf, layout)[0]


@pytest.mark.parametrize("fmt", BOUNDARY_FORMATS)
@pytest.mark.parametrize("key", [ACT, GRAD], ids=["activations", "gradients"])
def test_round_trip_over_changing_shapes(fmt: str, key: tuple[int, int, int]) -> None:
    pair, mem_s, mem_r = LoopbackPair("cpu"), LayoutMemory(), LayoutMemory()
    # two-phase, speculative, changed shape (placeholders + fresh), speculative again
    for seed, rows in [(1, 3), (2, 3), (3, 5), (4, 5)]:
        pair.box.log.clear()
        # gradients are all cast (a -inf would not survive fp8): their "mask" is finite
        msg, flags = _message(seed, rows, float("-inf") if key == ACT else -3.0)
        got, send = _exchange(pair, msg, flags, key, fmt, mem_s, mem_r)
        data_sends = [tag % 64 for kind, _, _, tag in pair.box.log if kind == "send" and tag % 64 != 0]
        if fmt != "none" and seed != 3:  # seed 3 adds a placeholder for the remembered layout
            assert len(data_sends) == 1, f"{fmt}: one packed transfer per message, got slots {data_sends}"
        for i, (g, s) in enumerate(zip(got, msg, strict=True)):
            if s is None:
                assert g is None
                continue
            # gradients: everything float is cast; activations: only what requires grad
            cast = key == GRAD or flags[i]
            want = _expected(s.contiguous(), fmt, cast)
            assert g.dtype == s.dtype and g.shape == s.shape, f"tensor {i}"
            assert torch.equal(g, want), f"{fmt} tensor {i} differs"
            assert g.requires_grad == flags[i], f"tensor {i} requires_grad"


def test_fp8_moves_about_a_quarter_of_the_bytes() -> None:
    h = torch.randn(64, 1024)
    sizes = {}
    for fmt in ("none", "bf16", "fp8"):
        pair = LoopbackPair("cpu")
        _, send = _exchange(pair, [h], [True], ACT, fmt, LayoutMemory(), LayoutMemory())
        sizes[fmt] = send.data_bytes
    assert sizes["none"] == h.numel() * 4
    assert sizes["fp8"] <= 0.52 * sizes["bf16"] and sizes["fp8"] <= 0.26 * sizes["none"], sizes


def test_sender_and_receiver_formats_must_agree() -> None:
    pair = LoopbackPair("cpu")
    msg, flags = _message(1)
    with pytest.raises(TransportError, match="boundary format 'fp8'.*'packed'.*same boundary_format"):
        _exchange(pair, msg, flags, ACT, "fp8", LayoutMemory(), LayoutMemory(), recv_fmt="packed")


def test_boundary_format_option_parsing() -> None:
    assert boundary_format(None) == BoundaryFormat("none", "none")
    assert boundary_format("fp8") == BoundaryFormat("fp8", "fp8")
    assert boundary_format("fp8,bf16") == BoundaryFormat("fp8", "bf16")
    assert boundary_format(("packed", "fp8")) == BoundaryFormat("packed", "fp8")
    assert str(BoundaryFormat("fp8", "bf16")) == "fp8,bf16" and str(BoundaryFormat("bf16", "bf16")) == "bf16"
    assert BoundaryFormat("fp8", "bf16").for_direction(2) == "none"
    with pytest.raises(ValueError, match="unknown format 'fp4' for activations; expected one of none, packed"):
        boundary_format("fp4")
    with pytest.raises(ValueError, match="unknown format 'int8' for gradients"):
        boundary_format(("bf16", "int8"))
    with pytest.raises(ValueError, match="expected a format name"):
        boundary_format(8)
    with pytest.raises(ValueError, match="expected a format name"):
        boundary_format("fp8,bf16,none")


def test_pipeline_rejects_a_bad_boundary_format_before_anything_else() -> None:
    from dualpipe_kernels.runtime import Pipeline
    from dualpipe_kernels.schedules import build_schedule

    with pytest.raises(ValueError, match="unknown format 'fp4' for activations"):
        Pipeline(build_schedule("1f1b", 2, 2), {}, boundary_format="fp4")
