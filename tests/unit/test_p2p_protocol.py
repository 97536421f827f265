"""The stage-boundary protocol of runtime/boundary/transfer.py, in one process over an in-process transport pair.

Covers the speculative receives (first message two-phase, repeated layout
posted before the send, changed layout through placeholders and fresh tags,
disagreeing memories reported), and the device rule: every tensor posted is on
the transport's device even when torch's default device is another one (the
situation of a GPU run, where the default is cpu and the transport is cuda).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from fake_transports import LoopbackPair

from dualpipe_kernels.runtime.boundary.transfer import BoundaryRecv, BoundarySend, LayoutMemory, TagSpace, wire_device
from dualpipe_kernels.transport.base import TransportError

KEY = (0, 1, 2)  # direction, consumer stage, micro-batch
TIMEOUT_S = 5.0


@pytest.fixture
def pair() -> LoopbackPair:
    return LoopbackPair("cpu")


@pytest.fixture
def default_meta() -> Iterator[None]:
    """torch's default device is "meta" inside the test: a tensor created without a device is refused."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def _message(seed: int, rows: int = 3) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=g, device="cpu")
    ids = torch.randint(0, 9, (rows,), generator=g, device="cpu")
    return [x, None, ids, torch.empty(0, 5, device="cpu")]


def _exchange(
    pair: LoopbackPair, tensors: list[torch.Tensor | None], mem_s: LayoutMemory, mem_r: LayoutMemory
) -> tuple[list[torch.Tensor | None], BoundaryRecv]:
    tags = TagSpace(4, 4)
    recv = BoundaryRecv(pair.ends[1], 0, tags, KEY, "recv", torch.device("cpu"), mem_r)
    send = BoundarySend(pair.ends[0], tensors, [True, False, False, False], 1, tags, KEY, "send", mem_s)
    recv.progress()
    got = recv.wait(TIMEOUT_S)
    send.wait(TIMEOUT_S)
    assert send.is_completed()
    assert pair.box.unmatched() == [], "a posted transfer was never matched"
    return got, recv


def _assert_same(got: list[torch.Tensor | None], sent: list[torch.Tensor | None]) -> None:
    assert len(got) == len(sent)
    for g, s in zip(got, sent, strict=True):
        if s is None:
            assert g is None
        else:
            assert g is not None and g.dtype == s.dtype and g.shape == s.shape and torch.equal(g, s)


def _data_recvs_before_first_send(pair: LoopbackPair) -> int:
    """How many data receives (slot > 0) were posted before the first send of the message."""
    n = 0
    for kind, _, _, tag in pair.box.log:
        if kind == "send":
            return n
        n += tag % 64 != 0
    return n


def test_first_message_is_two_phase_then_repeats_go_speculative(pair: LoopbackPair) -> None:
    mem_s, mem_r = LayoutMemory(), LayoutMemory()
    first = _message(1)
    got, _ = _exchange(pair, first, mem_s, mem_r)
    _assert_same(got, first)
    assert got[0] is not None and got[0].requires_grad and got[2] is not None and not got[2].requires_grad
    assert _data_recvs_before_first_send(pair) == 0, "no memory yet: only the metadata receive is posted early"

    pair.box.log.clear()
    second = _message(2)
    got, _ = _exchange(pair, second, mem_s, mem_r)
    _assert_same(got, second)
    # x and ids (the empty tensor moves nothing) were posted with the metadata, before the send.
    assert _data_recvs_before_first_send(pair) == 2
    assert all(tag % 64 < 32 for kind, _, _, tag in pair.box.log if kind == "send"), "data went to fresh tags"


def test_changed_layout_fills_the_speculative_receives_with_placeholders(pair: LoopbackPair) -> None:
    mem_s, mem_r = LayoutMemory(), LayoutMemory()
    _exchange(pair, _message(1, rows=3), mem_s, mem_r)
    pair.box.log.clear()
    changed = _message(2, rows=5)
    got, _ = _exchange(pair, changed, mem_s, mem_r)
    _assert_same(got, changed)
    sent_slots = sorted(tag % 64 for kind, _, _, tag in pair.box.log if kind == "send")
    assert sent_slots == [0, 1, 3, 32, 34], "metadata, two placeholders, two fresh tensors"
    # ...and the memories moved on together: the next message of this layout is speculative again.
    pair.box.log.clear()
    again = _message(3, rows=5)
    got, _ = _exchange(pair, again, mem_s, mem_r)
    _assert_same(got, again)
    assert sorted(tag % 64 for kind, _, _, tag in pair.box.log if kind == "send") == [0, 1, 3]


def test_disagreeing_memories_are_reported(pair: LoopbackPair) -> None:
    mem_s, mem_r = LayoutMemory(), LayoutMemory()
    _exchange(pair, _message(1), mem_s, mem_r)
    tags = TagSpace(4, 4)
    # The sender forgot (as if its previous step failed): it sends fresh, the receiver posted speculatively.
    recv = BoundaryRecv(pair.ends[1], 0, tags, KEY, "recv", torch.device("cpu"), mem_r)
    BoundarySend(pair.ends[0], _message(2), [True, False, False, False], 1, tags, KEY, "send", LayoutMemory())
    with pytest.raises(TransportError, match="disagree on the remembered layout"):
        recv.wait(TIMEOUT_S)


@pytest.mark.usefixtures("default_meta")
def test_every_tensor_posted_is_on_the_transport_device(pair: LoopbackPair) -> None:
    """Metadata, placeholders and receive buffers never land on torch's default device."""
    mem_s, mem_r = LayoutMemory(), LayoutMemory()
    for seed, rows in [(1, 3), (2, 3), (3, 6)]:  # two-phase, speculative, placeholders + fresh
        msg = _message(seed, rows)
        got, _ = _exchange(pair, msg, mem_s, mem_r)
        _assert_same(got, msg)


def test_wire_device_follows_what_the_transport_moves() -> None:
    """CUDA IPC: its device; torch over gloo staging CUDA tensors: the host; no declared device: the host."""

    class _Declared:
        def __init__(self, **attrs: object) -> None:
            self.__dict__.update(attrs)

    cuda = torch.device("cuda", 1)
    assert wire_device(_Declared(device=cuda)) == cuda  # type: ignore[arg-type]
    assert wire_device(_Declared(device=cuda, device_native=False)) == torch.device("cpu")  # type: ignore[arg-type]
    assert wire_device(_Declared(device=torch.device("cpu"), device_native=True)) == torch.device("cpu")  # type: ignore[arg-type]
    assert wire_device(_Declared()) == torch.device("cpu")  # type: ignore[arg-type]


# ---- small messages in one transfer (runtime/boundary/inline.py) ---------------------------------------------


def _sends(pair: LoopbackPair) -> list[int]:
    return sorted(tag % 64 for kind, _, _, tag in pair.box.log if kind == "send")


def _exchange_as(
    pair: LoopbackPair, tensors: list[torch.Tensor | None], mem_s: LayoutMemory, mem_r: LayoutMemory, fmt: str
) -> list[torch.Tensor | None]:
    tags = TagSpace(4, 4)
    flags = [t is not None and t.is_floating_point() for t in tensors]
    recv = BoundaryRecv(pair.ends[1], 0, tags, KEY, "recv", torch.device("cpu"), mem_r, fmt)
    send = BoundarySend(pair.ends[0], tensors, flags, 1, tags, KEY, "send", mem_s, fmt)
    got = recv.wait(TIMEOUT_S)
    send.wait(TIMEOUT_S)
    assert pair.box.unmatched() == [], "a posted transfer was never matched"
    return got


def test_repeated_small_layout_travels_as_one_transfer(pair: LoopbackPair) -> None:
    mem_s, mem_r = LayoutMemory(inline_max_bytes=4096), LayoutMemory(inline_max_bytes=4096)
    _assert_same(_exchange(pair, _message(1), mem_s, mem_r)[0], _message(1))  # no memory yet: two-phase
    for seed in (2, 3, 4):
        pair.box.log.clear()
        msg = _message(seed)
        got, _ = _exchange(pair, msg, mem_s, mem_r)
        _assert_same(got, msg)
        assert got[0] is not None and got[0].requires_grad and got[2] is not None and not got[2].requires_grad
        assert _sends(pair) == [0], "metadata and data in one transfer"
        assert [k for k, *_ in pair.box.log] == ["recv", "send"], "one receive, posted before the send"
    assert mem_r.pool.allocations == 1, "the receive buffer is reused from the pool"


def test_inline_layout_change_goes_to_fresh_tags_then_inline_again(pair: LoopbackPair) -> None:
    mem_s, mem_r = LayoutMemory(inline_max_bytes=4096), LayoutMemory(inline_max_bytes=4096)
    _exchange(pair, _message(1, rows=3), mem_s, mem_r)
    _exchange(pair, _message(2, rows=3), mem_s, mem_r)
    pair.box.log.clear()
    changed = _message(3, rows=5)
    got, _ = _exchange(pair, changed, mem_s, mem_r)
    _assert_same(got, changed)
    assert _sends(pair) == [0, 32, 34], "the posted buffer (metadata, zeros), then two fresh tensors"
    pair.box.log.clear()
    again = _message(4, rows=5)
    got, _ = _exchange(pair, again, mem_s, mem_r)
    _assert_same(got, again)
    assert _sends(pair) == [0]


def test_messages_over_the_inline_limit_keep_separate_transfers(pair: LoopbackPair) -> None:
    mem_s, mem_r = LayoutMemory(inline_max_bytes=16), LayoutMemory(inline_max_bytes=16)
    for seed in (1, 2):
        pair.box.log.clear()
        msg = _message(seed)
        _assert_same(_exchange(pair, msg, mem_s, mem_r)[0], msg)
    assert _sends(pair) == [0, 1, 3], "metadata plus speculative data transfers"


@pytest.mark.parametrize("fmt", ["none", "packed", "bf16", "fp8"])
def test_inline_messages_equal_the_general_protocol_bit_for_bit(fmt: str) -> None:
    g = torch.Generator().manual_seed(7)
    msgs = [
        [torch.randn(3, 130, generator=g), None, torch.randint(0, 9, (3,), generator=g), torch.randn(2, 2, 2).bool()]
        for _ in range(3)
    ]
    results = []
    for limit in (0, 1 << 20):
        pair = LoopbackPair("cpu")
        mem_s, mem_r = LayoutMemory(inline_max_bytes=limit), LayoutMemory(inline_max_bytes=limit)
        got = [_exchange_as(pair, msgs[0], mem_s, mem_r, fmt)]
        pair.box.log.clear()
        got += [_exchange_as(pair, m, mem_s, mem_r, fmt) for m in msgs[1:]]
        # the repeats: one transfer each inline, metadata + data (per tensor under none) otherwise
        assert (_sends(pair) == [0, 0]) if limit else len(_sends(pair)) >= 4
        results.append(got)
    for plain, inline in zip(*results, strict=True):
        for a, b in zip(plain, inline, strict=True):
            assert (a is None and b is None) or (
                a is not None and b is not None and a.dtype == b.dtype and torch.equal(a, b)
            )
