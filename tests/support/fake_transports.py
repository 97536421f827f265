"""Transports that enforce, on CPU, the two rules the CUDA IPC transport imposes on the runtime.

1. *Device kind*: the CUDA binding accepts only tensors on its device.  On a
   GPU the runtime's device (cuda) differs from torch's default device (cpu),
   so a tensor the runtime creates without naming its device ends up on the
   wrong kind.  ``DeviceKindTransport`` rejects every tensor that is not on its
   declared ``device``; a test then sets torch's default device to something
   else ("meta") around the runtime, which reproduces that situation on a CPU
   machine: any tensor created without a device lands on "meta" and is refused
   with the binding's message.
2. *Rendezvous sends*: a CUDA IPC send of at least ``direct_min_bytes``
   completes only once the receiver has copied it.  ``RendezvousTransport``
   completes a send only after the peer has *posted* the matching receive (the
   receiver acknowledges each post over a second gloo group), so a runtime that
   waits for a send before posting its own receives deadlocks here too.

``LoopbackPair`` is an in-process pair of endpoints (no processes, no
sockets) with the same rendezvous semantics, for protocol tests of runtime/boundary/transfer.py.

Everything is module level so spawned ranks can import it (tests/ is on sys.path).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from dualpipe_kernels.transport.base import Handle, Transport, TransportError, TransportTimeout


def check_device(device: torch.device, tensor: torch.Tensor, rank: int, what: str) -> None:
    """The CUDA binding's check (cuda_bindings.cpp), for a transport declared for ``device``."""
    if tensor.device != device:
        raise ValueError(
            f"rank {rank}: {what or 'transfer'}: tensor must be a {device.type} tensor on {device}, "
            f"got one on {tensor.device}"
        )


class DeviceKindTransport(Transport):
    """Wraps ``inner`` and refuses any tensor not on ``device`` (like the CUDA binding)."""

    name = "device_kind"

    def __init__(self, inner: Transport, device: torch.device | str) -> None:
        super().__init__(inner.timeout_s)
        self.inner = inner
        self.device = torch.device(device)
        self.posted = 0

    @property
    def rank(self) -> int:
        return self.inner.rank

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        check_device(self.device, tensor, self.rank, what)
        self.posted += 1
        return self.inner.isend(tensor, peer, tag, what)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        check_device(self.device, tensor, self.rank, what)
        self.posted += 1
        return self.inner.irecv(tensor, peer, tag, what)


class _Both(Handle):
    """Done when every one of ``parts`` is done (a send: the data and the receiver's acknowledgement)."""

    def __init__(self, *parts: Handle) -> None:
        self._parts = parts

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in self._parts:
            h.wait(None if deadline is None else max(0.001, deadline - time.monotonic()))

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self._parts)


class RendezvousTransport(Transport):
    """Sends over ``data`` that complete only once the peer posted the matching receive.

    ``acks`` is a transport over a second group: a receive posted for ``tag``
    sends a one-word acknowledgement with the same tag, and the send's handle
    also waits for it.  ``device`` (the data transport's) is passed through.
    """

    name = "rendezvous"

    def __init__(self, data: Transport, acks: Transport) -> None:
        super().__init__(data.timeout_s)
        self.data = data
        self.acks = acks
        self.device = getattr(data, "device", torch.device("cpu"))

    @property
    def rank(self) -> int:
        return self.data.rank

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        ack = self.acks.irecv(torch.zeros(1, dtype=torch.int64, device="cpu"), peer, tag, f"{what} (posted-ack)")
        return _Both(self.data.isend(tensor, peer, tag, what), ack)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        ack = self.acks.isend(torch.ones(1, dtype=torch.int64, device="cpu"), peer, tag, f"{what} (posted-ack)")
        return _Both(self.data.irecv(tensor, peer, tag, what), ack)


# ---------------------------------------------------------------------------
# in-process pair
# ---------------------------------------------------------------------------


@dataclass
class _Op:
    tensor: torch.Tensor
    what: str
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class _LoopHandle(Handle):
    def __init__(self, op: _Op, describe: str) -> None:
        self._op = op
        self._describe = describe

    def wait(self, timeout: float | None = None) -> None:
        if not self._op.done.wait(5.0 if timeout is None else timeout):
            raise TransportTimeout(f"{self._describe} timed out after {timeout} s")
        if self._op.error is not None:
            raise self._op.error

    def is_completed(self) -> bool:
        return self._op.done.is_set()


class _Mailbox:
    """Posted sends and receives of a pair, matched by (src, dst, tag); both complete at the match."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sends: dict[tuple[int, int, int], list[_Op]] = {}
        self.recvs: dict[tuple[int, int, int], list[_Op]] = {}
        self.log: list[tuple[str, int, int, int]] = []  # ("send"|"recv", src, dst, tag) in posting order
        self.sent: list[tuple[int, bytes]] = []  # (tag, the bytes as posted) of every send, in posting order

    def post(self, sending: bool, key: tuple[int, int, int], op: _Op) -> None:
        with self.lock:
            self.log.append(("send" if sending else "recv", *key))
            if sending and op.tensor.is_cpu:
                self.sent.append((key[2], op.tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()))
            mine, theirs = (self.sends, self.recvs) if sending else (self.recvs, self.sends)
            waiting = theirs.get(key)
            if not waiting:
                mine.setdefault(key, []).append(op)
                return
            other = waiting.pop(0)
        send, recv = (op, other) if sending else (other, op)
        if send.tensor.shape != recv.tensor.shape or send.tensor.dtype != recv.tensor.dtype:
            err = TransportError(
                f"size/dtype mismatch on tag {key[2]}: sent {send.tensor.dtype}{list(send.tensor.shape)}, "
                f"receive expects {recv.tensor.dtype}{list(recv.tensor.shape)} ({recv.what})"
            )
            send.error = recv.error = err
        else:
            recv.tensor.copy_(send.tensor)
        send.done.set()
        recv.done.set()

    def unmatched(self) -> list[tuple[str, int, int, int]]:
        with self.lock:
            out = [("send", *k) for k, v in self.sends.items() for _ in v]
            return out + [("recv", *k) for k, v in self.recvs.items() for _ in v]


class LoopbackEndpoint(Transport):
    """Rank ``rank`` of a :class:`LoopbackPair` (tensors must be on ``device``)."""

    name = "loopback"

    def __init__(self, box: _Mailbox, rank: int, device: torch.device) -> None:
        super().__init__(5.0)
        self._box = box
        self._rank = rank
        self.device = device

    @property
    def rank(self) -> int:
        return self._rank

    def _post(self, sending: bool, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Handle:
        check_device(self.device, tensor, self._rank, what)
        op = _Op(tensor, what)
        key = (self._rank, peer, tag) if sending else (peer, self._rank, tag)
        self._box.post(sending, key, op)
        verb = "send to" if sending else "receive from"
        return _LoopHandle(op, f"rank {self._rank}: {verb} peer {peer} (tag {tag}, {what})")

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        return self._post(True, tensor, peer, tag, what)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        return self._post(False, tensor, peer, tag, what)


class LoopbackPair:
    """Two in-process endpoints, ranks 0 and 1, sharing one mailbox."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.box = _Mailbox()
        dev = torch.device(device)
        self.ends = (LoopbackEndpoint(self.box, 0, dev), LoopbackEndpoint(self.box, 1, dev))
