"""Tests of ``dualpipe_kernels.kernels.layout``: planning, encoding, digests, the signature cache."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

from dualpipe_kernels.kernels.layout import (
    ALIGN,
    FORMATS,
    KIND_BF16,
    KIND_COPY,
    KIND_FP8,
    LayoutCache,
    PackLayout,
    plan_layout,
)

SPECS = [
    (torch.float32, (3, 43)),
    (torch.float16, (129,)),
    (torch.bfloat16, (2, 0, 5)),
    (torch.int64, (9,)),
    (torch.bool, (17,)),
    (torch.float64, ()),
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_plan_regions_are_aligned_disjoint_and_sized(fmt: str) -> None:
    layout = plan_layout(SPECS, fmt)
    regions = layout.regions()
    assert all(o % ALIGN == 0 for o, _ in regions)
    spans = sorted(regions)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:], strict=False))
    assert layout.nbytes % ALIGN == 0 and layout.nbytes >= spans[-1][0] + spans[-1][1]
    kinds = [e.kind for e in layout.entries]
    if fmt == "packed":
        assert kinds == [KIND_COPY] * 6
    elif fmt == "bf16":
        assert kinds == [KIND_BF16, KIND_BF16] + [KIND_COPY] * 4
    else:
        assert kinds == [KIND_FP8] * 3 + [KIND_COPY] * 3
        assert layout.entries[0].num_scales == 2 and layout.entries[1].num_scales == 2


def test_fp8_is_about_a_quarter_of_fp32_and_half_of_bf16() -> None:
    specs = [(torch.float32, (4096, 1024))]
    fp32, bf16, fp8 = (plan_layout(specs, f).nbytes for f in ("packed", "bf16", "fp8"))
    assert fp8 <= 0.26 * fp32 and fp8 <= 0.52 * bf16  # the wire-size targets, scales included


@pytest.mark.parametrize("fmt", FORMATS)
def test_encode_decode_tensor_and_pickle_round_trip(fmt: str) -> None:
    layout = plan_layout(SPECS, fmt)
    assert PackLayout.decode(layout.encode()) == layout
    assert PackLayout.from_tensor(layout.to_tensor()) == layout
    assert pickle.loads(pickle.dumps(layout)) == layout
    raw = layout.to_bytes()
    assert PackLayout.from_bytes(raw) == layout
    assert PackLayout.from_bytes(torch.frombuffer(bytearray(raw), dtype=torch.uint8).numpy().tobytes()) == layout
    with pytest.raises(ValueError, match="not a whole number of int64s"):
        PackLayout.from_bytes(raw[:-3])
    assert len(layout.encode()) < 64  # small enough to send once per signature


def test_digest_is_stable_across_processes_and_distinguishes_layouts() -> None:
    layout = plan_layout(SPECS, "fp8")
    code = "import torch; from dualpipe_kernels.kernels.layout import PackLayout; import sys; "
    code += f"print(PackLayout.decode({layout.encode()!r}).digest)"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert int(other.stdout) == layout.digest
    assert 0 <= layout.digest < 2**63
    digests = {plan_layout(SPECS, f).digest for f in FORMATS}
    digests.add(plan_layout(SPECS[:-1], "fp8").digest)
    assert len(digests) == len(FORMATS) + 1


def test_cache_plans_once_per_signature() -> None:
    cache = LayoutCache()
    a = [torch.zeros(3, 4), torch.zeros(5, dtype=torch.int64)]
    b = [torch.ones(3, 4).t().t(), torch.ones(5, dtype=torch.int64)]  # same dtypes and shapes
    first, new = cache.lookup(a, "bf16")
    assert new and cache.lookup(b, "bf16") == (first, False)
    assert cache.get(b, "bf16") is first and len(cache) == 1
    assert cache.get(a, "fp8") is not first and len(cache) == 2
    assert cache.by_digest(first.digest) is first and cache.by_digest(12345) is None
    received = LayoutCache()
    received.add(PackLayout.from_tensor(first.to_tensor()))
    assert received.get(a, "bf16") == first


@pytest.mark.parametrize(
    "ints, message",
    [
        ([1, 2, 3], "bad magic or too short"),
        ([0x504B, 9, 0, 0], "layout version 9"),
        ([0x504B, 1, 7, 0], "unknown format code 7"),
        ([0x504B, 1, 0, 1, 99, 1, 4], "entry 0 is truncated or has a bad dtype"),
        ([0x504B, 1, 0, 1, 0, 2, 4], "entry 0 has a truncated or negative shape"),
        ([0x504B, 1, 0, 1, 0, 1, 4, 5], "1 trailing ints"),
    ],
)
def test_decode_rejects_malformed_encodings(ints: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PackLayout.decode(ints)


def test_plan_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown format 'fp4'"):
        plan_layout(SPECS, "fp4")
    with pytest.raises(TypeError, match="tensor 1 has unsupported dtype torch.complex128"):
        plan_layout([SPECS[0], (torch.complex128, (2,))])
    with pytest.raises(ValueError, match="1-D int64 tensor"):
        PackLayout.from_tensor(torch.zeros(4))
