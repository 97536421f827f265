"""Repeated small boundary messages (runtime/boundary/repeat.py), at the level of ``Boundary`` in one process.

Two ``Boundary`` objects (pipeline ranks 0 and 1 of a 1F1B schedule) talk over
an in-process transport pair.  Checked: after one step a message of the same
layout takes the repeat path on both ends (one transfer, no metadata decoded,
the same bytes as the general path), a changed layout falls back to the
general protocol with the buffer that arrived and repeats again afterwards,
grad flags and dtypes count as layout, and closing forgets everything.
"""

from __future__ import annotations

import pytest
import torch
from fake_transports import LoopbackEndpoint, LoopbackPair
from repeat_workers import NoRepeats

import dualpipe_kernels.runtime.boundary.transfer as p2p
from dualpipe_kernels.runtime.boundary.exchange import Boundary, BoundaryState, Wire
from dualpipe_kernels.runtime.boundary.inline import INLINE_MAX_BYTES, META_BYTES
from dualpipe_kernels.runtime.boundary.repeat import RepeatRecvOp, SmallSend
from dualpipe_kernels.runtime.boundary.transfer import LayoutMemory, TagSpace
from dualpipe_kernels.runtime.executor import _lowered_program
from dualpipe_kernels.schedules.generators import build_schedule
from dualpipe_kernels.schedules.ir import T_RECV_F, T_SEND_F
from dualpipe_kernels.transport.base import Handle

TIMEOUT_S = 5.0


class RawEndpoint(LoopbackEndpoint):
    """A loopback end that also posts receives with no handle (``irecv_raw`` / ``wait_raw``, as the native
    engine does for repeated ones): the request is the loopback's own handle; waits through it are counted."""

    def __init__(self, inner: LoopbackEndpoint) -> None:
        super().__init__(inner._box, inner.rank, inner.device)
        self.raw_posts = self.raw_waits = 0

    def irecv_raw(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        self.raw_posts += 1
        return self.irecv(tensor, peer, tag, what)

    def wait_raw(self, request: Handle, timeout: float) -> None:
        self.raw_waits += 1
        request.wait(timeout)


class Ends:
    """Ranks 0 (sender of SEND_F of micro-batch 0) and 1 (its receiver), each with its own layout memory;
    ``raw``: the ends post repeated receives as bare requests (:class:`RawEndpoint`)."""

    def __init__(self, limit: int = INLINE_MAX_BYTES, raw: bool = False) -> None:
        program = _lowered_program(build_schedule("1f1b", 2, 2))
        self.pair = LoopbackPair("cpu")
        if raw:
            self.pair.ends = (RawEndpoint(self.pair.ends[0]), RawEndpoint(self.pair.ends[1]))
        tags = TagSpace(2, 2)
        self.b = [
            Boundary(
                Wire(r, self.pair.ends[r], [0, 1], tags, LayoutMemory(limit), torch.device("cpu"), TIMEOUT_S),
                program,
            )
            for r in (0, 1)
        ]
        acts = [program.schedule.actions[r] for r in (0, 1)]
        self.send_i = next(i for i, a in enumerate(acts[0]) if a.type is T_SEND_F and a.microbatch == 0)
        self.recv_i = next(i for i, a in enumerate(acts[1]) if a.type is T_RECV_F and a.microbatch == 0)

    def exchange(
        self, tensors: list[torch.Tensor | None], flags: list[bool]
    ) -> tuple[list, BoundaryState, BoundaryState]:
        """One step's message: the receiver posts first (as the window does), then the send, then the wait."""
        st_s, st_r = BoundaryState(False), BoundaryState(False)
        self.b[1].post_recv(st_r, self.recv_i)
        posted = st_r.recvs[self.recv_i]
        self.b[0].send(st_s, self.send_i, tensors, flags)
        self.last_posted, self.last_small = posted, list(st_s.small_sends)
        got = self.b[1].complete_recv(st_r, self.recv_i)
        self.b[0].reap(st_s, block=True)
        assert self.pair.box.unmatched() == [], "a posted transfer was never matched"
        return got, st_s, st_r


def _same(got: list[torch.Tensor | None], want: list[torch.Tensor | None], flags: list[bool]) -> None:
    assert len(got) == len(want)
    for g, w, f in zip(got, want, flags, strict=True):
        if w is None:
            assert g is None
            continue
        assert g is not None and g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
        assert g.requires_grad == f and g.is_leaf


def _msg(seed: int, rows: int = 2) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 8, generator=g), None, torch.randint(0, 5, (rows,), generator=g)]


def _count_decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = p2p.decode_meta

    def counting(meta: torch.Tensor):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(meta)

    monkeypatch.setattr(p2p, "decode_meta", counting)
    return calls


def _sends(ends: Ends) -> list[int]:
    return [tag % 64 for kind, _, _, tag in ends.pair.box.log if kind == "send"]


@pytest.mark.parametrize("raw", [False, True], ids=["handle", "raw"])
def test_repeats_take_the_fast_path_on_both_ends(monkeypatch: pytest.MonkeyPatch, raw: bool) -> None:
    ends, flags = Ends(raw=raw), [True, False, False]
    decodes = _count_decodes(monkeypatch)
    for seed in (1, 2):  # first step: two-phase; second: inline through the general path
        _same(ends.exchange(_msg(seed), flags)[0], _msg(seed), flags)
    assert decodes[0] == 2
    for seed in (3, 4, 5):
        ends.pair.box.log.clear()
        got, _, _ = ends.exchange(_msg(seed), flags)
        _same(got, _msg(seed), flags)
        assert isinstance(ends.last_posted, RepeatRecvOp), "the receiver posted from its repeat entry"
        assert len(ends.last_small) == 1 and isinstance(ends.last_small[0], SmallSend)
        assert _sends(ends) == [0], "metadata and data in one transfer"
    assert decodes[0] == 2, "no metadata decoded for a repeated layout"
    assert ends.b[1].wire.layouts.pool.allocations == 1, "one pooled receive buffer, reused"
    if raw:  # the three repeats posted and waited as bare requests (the first two took the general path)
        assert ends.pair.ends[1].raw_posts == ends.pair.ends[1].raw_waits == 3  # type: ignore[attr-defined]
        assert ends.last_posted.link is ends.pair.ends[1]
    assert ends.b[0].messages_sent[0] == 5 and ends.b[0].bytes_sent[0] > 0


def test_repeat_path_moves_the_same_bytes_as_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = [True, False, False]
    wires = []
    for fast in (False, True):
        ends = Ends()
        if not fast:  # no repeat entries: every message takes the general path
            for b in ends.b:
                monkeypatch.setattr(b.wire.layouts, "repeat_send", NoRepeats())
                monkeypatch.setattr(b.wire.layouts, "repeat_recv", NoRepeats())
        for seed in (1, 2, 3, 4):
            ends.exchange(_msg(seed), flags)
        wires.append(list(ends.pair.box.sent))
        monkeypatch.undo()
    assert wires[0] == wires[1]


@pytest.mark.parametrize(
    "change",
    [
        ("rows", lambda seed: _msg(seed, rows=3), [True, False, False], True),
        # the same buffer layout, another header: still one transfer, read by the general path
        ("grad flag", lambda seed: _msg(seed), [False, False, False], False),
        ("dtype", lambda seed: [_msg(seed)[0].double(), None, _msg(seed)[2]], [True, False, False], True),
        ("tensor count", lambda seed: _msg(seed)[:2], [True, False], True),
    ],
    ids=lambda c: c[0] if isinstance(c, tuple) else str(c),
)
@pytest.mark.parametrize("raw", [False, True], ids=["handle", "raw"])
def test_a_changed_layout_falls_back_then_repeats_again(change: tuple, raw: bool) -> None:  # type: ignore[type-arg]
    _, make, new_flags, fresh = change
    ends, flags = Ends(raw=raw), [True, False, False]
    for seed in (1, 2, 3):
        ends.exchange(_msg(seed), flags)
    assert isinstance(ends.last_posted, RepeatRecvOp)
    ends.pair.box.log.clear()
    got, _, _ = ends.exchange(make(4), new_flags)
    _same(got, make(4), new_flags)
    assert isinstance(ends.last_posted, RepeatRecvOp), "posted from the old entry, read by the general path"
    assert ends.last_posted.link is (ends.pair.ends[1] if raw else None), "raw: a bare request, then DONE for it"
    assert not any(isinstance(s, SmallSend) for s in ends.last_small), "the sender took the general path"
    if fresh:
        assert _sends(ends)[0] == 0 and len(_sends(ends)) > 1, "the posted buffer (metadata, zeros), then fresh tags"
    else:
        assert _sends(ends) == [0]
    for seed in (5, 6):  # the new layout: inline through the general path once, then repeats
        ends.pair.box.log.clear()
        got, _, _ = ends.exchange(make(seed), new_flags)
        _same(got, make(seed), new_flags)
        assert _sends(ends) == [0]
    assert isinstance(ends.last_posted, RepeatRecvOp) and isinstance(ends.last_small[0], SmallSend)
    ends.pair.box.log.clear()
    got, _, _ = ends.exchange(_msg(7), flags)  # and back to the first layout
    _same(got, _msg(7), flags)


def test_hook_outputs_still_go_through_the_general_send() -> None:
    ends, flags = Ends(), [True, False, False]
    for seed in (1, 2, 3):
        ends.exchange(_msg(seed), flags)
    st_s, st_r = BoundaryState(False), BoundaryState(False)
    ends.b[1].post_recv(st_r, ends.recv_i)
    msg = _msg(4)
    x = msg[0].clone().requires_grad_(True)
    keep = (x * 1,)
    ends.b[0].send(st_s, ends.send_i, msg, flags, keep)
    assert st_s.sends and not st_s.small_sends, "a send that frees hook outputs is reaped, not a SmallSend"
    _same(ends.b[1].complete_recv(st_r, ends.recv_i), msg, flags)
    ends.b[0].reap(st_s, block=True)
    assert keep[0].numel() == 0, "the hook output's storage is dropped once sent"


def test_clear_forgets_the_repeat_entries() -> None:
    ends, flags = Ends(), [True, False, False]
    for seed in (1, 2, 3):
        ends.exchange(_msg(seed), flags)
    mems = [b.wire.layouts for b in ends.b]
    assert mems[0].repeat_send and mems[1].repeat_recv
    for m in mems:
        m.clear()
    assert not mems[0].repeat_send and not mems[1].repeat_recv
    _same(ends.exchange(_msg(4), flags)[0], _msg(4), flags)  # two-phase again, on both ends


def test_the_sender_writes_repeats_into_one_buffer() -> None:
    ends, flags = Ends(), [True, False, False]
    bufs = []
    for seed in range(1, 7):
        got, _, _ = ends.exchange(_msg(seed), flags)
        _same(got, _msg(seed), flags)
        if ends.last_small and isinstance(ends.last_small[0], SmallSend):
            bufs.append(ends.last_small[0]._buf)
    assert len(bufs) == 4 and all(b is bufs[0] for b in bufs[1:]), "one buffer, written again each step"


def test_a_buffer_still_in_flight_is_not_written_again() -> None:
    """Two messages of one key before either is received (the loopback reads a send's bytes only when it is
    matched): the second one must not overwrite the first one's buffer."""
    ends, flags = Ends(), [True, False, False]
    for seed in (1, 2, 3, 4):
        ends.exchange(_msg(seed), flags)
    st_s = BoundaryState(False)
    ends.b[0].send(st_s, ends.send_i, _msg(5), flags)
    ends.b[0].send(st_s, ends.send_i, _msg(6), flags)
    assert all(isinstance(s, SmallSend) for s in st_s.small_sends)
    got = []
    for _ in range(2):
        st_r = BoundaryState(False)
        ends.b[1].post_recv(st_r, ends.recv_i)
        got.append(ends.b[1].complete_recv(st_r, ends.recv_i))
    ends.b[0].reap(st_s, block=True)
    _same(got[0], _msg(5), flags)
    _same(got[1], _msg(6), flags)


def test_gathered_repeats_move_the_same_bytes_and_a_non_contiguous_tensor_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A transport that gathers (as the native one does: pieces into its ring, zero gaps, ValueError for a
    non-contiguous piece) gets a repeated message's header and tensors as pieces; the bytes on the wire are
    those of the buffer path, and a piece it refuses goes through the buffer path instead."""
    flags = [True, False, False]
    wires, gathered = [], []
    for gather in (False, True):
        ends = Ends()
        if gather:
            end = ends.pair.ends[0]

            def try_isend_gather(
                pieces: list[tuple[int, torch.Tensor]], nbytes: int, peer: int, tag: int, end: LoopbackEndpoint = end
            ) -> bool:
                if any(not t.is_contiguous() for _, t in pieces):
                    raise ValueError("gathered pieces must be contiguous CPU tensors")
                buf = torch.zeros(nbytes, dtype=torch.uint8)
                for off, t in pieces:
                    src = t.reshape(-1).view(torch.uint8)
                    buf[off : off + src.numel()] = src
                end.isend(buf, peer, tag)
                gathered.append(tag)
                return True

            monkeypatch.setattr(end, "try_isend_gather", try_isend_gather, raising=False)
        for seed in (1, 2, 3, 4):  # two steps through the general path, then two repeats
            _same(ends.exchange(_msg(seed), flags)[0], _msg(seed), flags)
        wires.append(list(ends.pair.box.sent))
    assert wires[0] == wires[1]
    assert len(gathered) == 2, "each repeat was gathered"
    msg = _msg(5)
    msg[0] = msg[0].t().contiguous().t()  # same shape, not contiguous: the transport refuses it
    assert msg[0] is not None and not msg[0].is_contiguous()
    _same(ends.exchange(msg, flags)[0], msg, flags)
    assert len(gathered) == 2 and len(ends.last_small) == 1


def test_same_signature_agrees_with_comparing_signatures() -> None:
    """The in-place check is exactly ``signature(...) == sig`` over dtype, shape, grad flag, None and length."""
    from dualpipe_kernels.runtime.boundary.repeat import same_signature, signature

    a, b = torch.zeros(2, 3), torch.zeros(4, dtype=torch.int64)
    base = ([a, None, b], [True, False, False])
    sig = signature(*base)
    variants = [
        base,
        ([a, None, b], [False, False, False]),  # grad flag
        ([a.double(), None, b], [True, False, False]),  # dtype
        ([a.view(3, 2), None, b], [True, False, False]),  # shape
        ([a, b, b], [True, False, False]),  # a tensor where None was
        ([None, None, b], [True, False, False]),  # None where a tensor was
        ([a, None], [True, False]),  # fewer tensors
        ([a, None, b, b], [True, False, False, False]),  # more tensors
        ([a, None, b], [1, 0, 0]),  # truthy flags
    ]
    for tensors, flags in variants:
        assert same_signature(sig, tensors, flags) == (signature(tensors, flags) == sig), (tensors, flags)
    assert same_signature(sig, *base) and not same_signature(sig, [a, None, b], [True])


# ---- large repeats: handed over (the tensor is made on the buffer it arrived in) ----------------------------
def _big(seed: int, cols: int = 8192, extra: bool = False) -> list[torch.Tensor | None]:
    """One 64 KiB tensor (``extra``: and a 16-byte one, which keeps the message from being handed over)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, cols, generator=g), None, torch.randint(0, 5, (2,), generator=g) if extra else None]


def test_large_repeats_are_handed_over_in_a_new_buffer_per_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above HANDOVER_MIN_BYTES a one-tensor repeat is one transfer into a new buffer whose storage is the
    tensor's: no clone, nothing from the pool, not a view (no ``_base``, its own version counter, the
    storage's only holder once read); bit-exact, and the same bytes on the wire as the general path."""
    from dualpipe_kernels.runtime.boundary.repeat import HANDOVER_MIN_BYTES
    from dualpipe_kernels.runtime.memory_records import sole_holder as _sole_holder

    flags = [True, False, False]
    wires, kept = [], []
    for fast in (False, True):
        ends = Ends(limit=1 << 20)
        if not fast:
            for b in ends.b:
                monkeypatch.setattr(b.wire.layouts, "repeat_send", NoRepeats())
                monkeypatch.setattr(b.wire.layouts, "repeat_recv", NoRepeats())
        for seed in range(1, 6):
            ends.pair.box.log.clear()
            got, _, _ = ends.exchange(_big(seed), flags)
            _same(got, _big(seed), flags)
            if fast and seed >= 3:
                assert isinstance(ends.last_posted, RepeatRecvOp) and ends.last_posted.entry.handover
                assert _sends(ends) == [0], "metadata and data in one transfer"
                t = got[0]
                assert t is not None and t._base is None and t.is_contiguous()
                assert t.untyped_storage().nbytes() == META_BYTES + 65536 >= HANDOVER_MIN_BYTES, "header and data"
                ends.last_posted = None  # type: ignore[assignment]  # (the test's own reference to the op)
                assert _sole_holder(t), "nothing but the received tensor holds its storage"
                version = t._version
                t.detach().mul_(1.0)  # an in-place edit moves its own version counter only
                assert t._version == version + 1
                kept.append(t)  # all alive: their buffers cannot be the same memory
        wires.append(list(ends.pair.box.sent))
        if fast:
            assert ends.b[1].wire.layouts.pool.allocations == 1, "only the general path's inline read was pooled"
        monkeypatch.undo()
    assert wires[0] == wires[1]
    assert len({t.data_ptr() for t in kept}) == len(kept) == 3, "a new buffer per message"


def test_a_large_message_of_two_tensors_is_cloned_out_of_the_pool() -> None:
    """Two tensors in one buffer would share a storage: such a message is read as a small one is."""
    ends, flags = Ends(limit=1 << 20), [True, False, False]
    for seed in range(1, 6):
        got, _, _ = ends.exchange(_big(seed, extra=True), flags)
        _same(got, _big(seed, extra=True), flags)
    assert isinstance(ends.last_posted, RepeatRecvOp) and not ends.last_posted.entry.handover
    assert got[0] is not None and got[2] is not None
    assert got[0].untyped_storage().data_ptr() != got[2].untyped_storage().data_ptr()
    assert ends.b[1].wire.layouts.pool.allocations == 1, "one pooled buffer, reused"


def test_a_large_repeat_whose_layout_changed_falls_back_then_is_handed_over_again() -> None:
    ends, flags = Ends(limit=1 << 20), [True, False, False]
    for seed in (1, 2, 3):
        ends.exchange(_big(seed), flags)
    assert isinstance(ends.last_posted, RepeatRecvOp) and ends.last_posted.entry.handover
    for seed, cols in ((4, 8200), (5, 8200), (6, 8200)):
        got, _, _ = ends.exchange(_big(seed, cols), flags)
        _same(got, _big(seed, cols), flags)
    assert isinstance(ends.last_posted, RepeatRecvOp) and ends.last_posted.entry.handover, "the new layout's"
    for seed in (7, 8, 9):  # back to the first layout: the general path once, then handed over again
        got, _, _ = ends.exchange(_big(seed), flags)
        _same(got, _big(seed), flags)
    assert isinstance(ends.last_posted, RepeatRecvOp) and ends.last_posted.entry.handover
    assert got[0] is not None and got[0].untyped_storage().nbytes() == META_BYTES + 65536


def test_handover_needs_host_unpacked_large_messages_with_bytes() -> None:
    from dualpipe_kernels.runtime.boundary.codec import MessageCodec
    from dualpipe_kernels.runtime.boundary.inline import inline_plan
    from dualpipe_kernels.runtime.boundary.repeat import HANDOVER_MIN_BYTES, handover

    cpu, n = torch.device("cpu"), HANDOVER_MIN_BYTES // 4

    def ok(fmt: str, tensors: list[torch.Tensor | None], device: torch.device = cpu) -> bool:
        codec = MessageCodec(fmt, 0)
        layout = codec.layout(tensors, [False] * len(tensors))
        return handover(layout, inline_plan(codec, layout), device)

    assert ok("none", [torch.zeros(n), None])
    assert not ok("none", [torch.zeros(n), torch.zeros(4)]), "two tensors would share one storage"
    assert not ok("none", [torch.zeros(n)], torch.device("cuda", 0)), "read on a device: copied there"
    assert not ok("none", [torch.zeros(n - 4)]), "below HANDOVER_MIN_BYTES: cloned out of a pooled buffer"
    assert not ok("none", [torch.zeros(n), torch.zeros(0, 3)]), "a zero-size tensor has no bytes to view"
    assert not ok("packed", [torch.zeros(n)]), "a packed message is unpacked into new tensors anyway"
