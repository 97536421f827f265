"""DualPipe's mirror-gradient sync: the two copies of a model stage end the step with equal gradients.

DualPipe holds each model stage twice (stage ``s`` and its mirror ``t``, on
two ranks or, for DualPipeV's middle, on one).  At the end of a training step
each copy's gradients become the sum of both: on one rank by adding in place,
across ranks by one exchange of a few packed tensors per stage.  One of the step's gradient
reductions (runtime/reductions.py); its inputs are the wire, the schedule and this rank's stage modules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from dualpipe_kernels.runtime.boundary.exchange import Wire
from dualpipe_kernels.runtime.boundary.transfer import BoundaryRecv, BoundarySend
from dualpipe_kernels.schedules.ir import Schedule
from dualpipe_kernels.transport.base import Handle, TransportError

__all__ = ["MirrorSync", "mirrors"]

_DIR_MIRROR = 2  # TagSpace direction of end-of-step exchanges (0 and 1 are the data kinds ACT and GRAD)
_MASK_SLOT = 63  # the TagSpace slot of a mirror exchange's has-grad mask (the message itself uses 0..62)


class _Holding(Handle):
    """A send handle that keeps its host buffer alive until waited for."""

    def __init__(self, inner: Handle, buf: torch.Tensor) -> None:
        self._inner, self._buf = inner, buf

    def wait(self, timeout: float | None = None) -> None:
        self._inner.wait(timeout)

    def is_completed(self) -> bool:
        return self._inner.is_completed()


def mirrors(schedule: Schedule) -> dict[int, int]:
    """stage -> the other stage computing the same model stage (DualPipe's copies); empty when none."""
    by_model: dict[int, list[int]] = {}
    for s, m in enumerate(schedule.model_stage):
        by_model.setdefault(m, []).append(s)
    out: dict[int, int] = {}
    for m, ss in by_model.items():
        if len(ss) > 2:
            raise ValueError(f"model stage {m} has {len(ss)} copies; at most 2 are supported")
        if len(ss) == 2:
            out[ss[0]], out[ss[1]] = ss[1], ss[0]
    return out


@dataclass
class MirrorSync:
    """Sums the gradients of each duplicated model stage this rank holds with its mirror copy."""

    wire: Wire
    schedule: Schedule
    modules: Mapping[int, nn.Module]
    mirror_of: dict[int, int] = field(init=False)
    #: ids of parameters left out (tied parameters: their tie group's all-reduce sums the copies)
    skip: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.mirror_of = mirrors(self.schedule)

    def _params(self, s: int) -> list[nn.Parameter]:
        return [p for p in self.modules[s].parameters() if id(p) not in self.skip]

    def __bool__(self) -> bool:
        return bool(self.mirror_of)

    def begin(self, t0: float) -> _MirrorStep:
        """This step's mirror sum (one of the step's gradient reductions, runtime/reductions.py): nothing to
        post during the step, the exchange at its end (``t0``: the step's start, unused)."""
        return _MirrorStep(self)

    def _local(self, s: int, t: int) -> None:
        params, other = self._params(s), self._params(t)
        if [tuple(p.shape) for p in params] != [tuple(q.shape) for q in other]:
            raise ValueError(f"stages {s} and {t} copy the same model stage but have different parameter shapes")
        for p, q in zip(params, other, strict=False):
            if p.grad is None and q.grad is None:
                continue
            total = _or_zeros(p) + _or_zeros(q)
            p.grad, q.grad = total, total.clone()

    def run(self) -> None:
        """Sum the gradients of the two copies of each duplicated model stage (both copies end equal)."""
        sends: list[tuple[BoundarySend, Handle]] = []
        recvs: list[tuple[int, tuple[BoundaryRecv, torch.Tensor, Handle]]] = []
        local_done: set[int] = set()
        remote: list[tuple[int, int, int]] = []
        for s in sorted(self.modules):
            t = self.mirror_of.get(s)
            if t is None:
                continue
            peer = self.schedule.stage_to_rank[t]
            if peer == self.wire.rank:
                if s not in local_done:
                    local_done.update((s, t))
                    self._local(s, t)
                continue
            remote.append((s, t, peer))
        # Receives in the order their senders send (by the sender's stage), so an in-order channel pairs them.
        for s, t, peer in sorted(remote, key=lambda e: e[1]):
            recvs.append((s, self._recv(s, t, peer)))
        for s, t, peer in remote:
            sends.append(self._send(s, t, peer))
        timeout = self.wire.timeout_s
        for s, (recv, mask, mask_handle) in recvs:
            try:
                mask_handle.wait(timeout)
            except TransportError as exc:
                raise ValueError(f"stage {s}: its mirror copy has different parameters ({exc})") from exc
            theirs = _unpack_grads(self._params(s), mask.tolist(), recv.wait(timeout), s)
            with torch.no_grad():
                for param, grad in theirs:
                    # own + theirs on one side, theirs + own on the other: IEEE addition
                    # commutes, so both copies end bit-identical.
                    param.grad = grad if param.grad is None else param.grad + grad
        for send, mask_send in sends:
            send.wait(timeout)
            mask_send.wait(timeout)

    def _what(self, s: int, t: int) -> str:
        return f"pipeline rank {self.wire.rank}: mirror-gradient exchange of stage {s} with stage {t}"

    def _send(self, s: int, t: int, peer: int) -> tuple[BoundarySend, Handle]:
        """Post this copy's packed gradients to the rank of its mirror ``t``, and which parameters have one
        (host bytes, over the host channel: the receiver reads them on the host)."""
        w = self.wire
        params = self._params(s)
        packed = _pack_grads(params)
        what = f"{self._what(s, t)} (to peer pipeline rank {peer})"
        flags = [False] * len(packed)
        send = BoundarySend(
            w.transport, packed, flags, w.to_group_rank[peer], w.tags, (_DIR_MIRROR, s, 0), what, w.layouts
        )
        mask = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device="cpu")
        host = w.layouts.channels(w.transport).host
        tag = w.tags.tag(_DIR_MIRROR, s, 0, _MASK_SLOT)
        return send, _Holding(host.isend(mask, w.to_group_rank[peer], tag, f"{what} has-grad mask"), mask)

    def _recv(self, s: int, t: int, peer: int) -> tuple[BoundaryRecv, torch.Tensor, Handle]:
        w = self.wire
        what = f"{self._what(s, t)} (from peer pipeline rank {peer})"
        recv = BoundaryRecv(w.transport, w.to_group_rank[peer], w.tags, (_DIR_MIRROR, t, 0), what, w.device, w.layouts)
        mask = torch.empty(len(self._params(s)), dtype=torch.uint8, device="cpu")
        host = w.layouts.channels(w.transport).host
        tag = w.tags.tag(_DIR_MIRROR, t, 0, _MASK_SLOT)
        return recv, mask, host.irecv(mask, w.to_group_rank[peer], tag, f"{what} has-grad mask")


@dataclass
class _MirrorStep:
    """One step's mirror sum: no hook during the loop; :meth:`finish` runs the exchange."""

    sync: MirrorSync

    def hooks(self) -> Mapping[int, Callable[[], None]]:
        return {}

    def finish(self) -> None:
        self.sync.run()


def _or_zeros(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _pack_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """``[one flat buffer per dtype (zeros where no grad)]``: a few tensors per stage (on the parameters'
    device; which parameters have a gradient travels apart, as host bytes)."""
    out: list[torch.Tensor | None] = []
    for dtype in sorted({p.dtype for p in params}, key=str):
        out.append(torch.cat([_or_zeros(p).reshape(-1) for p in params if p.dtype == dtype]))
    return out


def _unpack_grads(
    params: Sequence[torch.Tensor], has: Sequence[int], packed: Sequence[torch.Tensor | None], stage: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of :func:`_pack_grads` against this copy's parameters (``has``: which of the mirror's have a
    gradient): ``(param, its mirror's grad)`` pairs."""
    dtypes = sorted({p.dtype for p in params}, key=str)
    sizes = {d: sum(p.numel() for p in params if p.dtype == d) for d in dtypes}
    flats = dict(zip(dtypes, packed, strict=False))
    if (
        len(has) != len(params)
        or len(packed) != len(dtypes)
        or any(f is None or f.dtype != d or f.numel() != sizes[d] for d, f in flats.items())
    ):
        raise ValueError(
            f"stage {stage}: its mirror copy has different parameters; the two copies of a model stage "
            "must be the same module"
        )
    offsets = dict.fromkeys(dtypes, 0)
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for p, h in zip(params, has, strict=True):
        flat = flats[p.dtype]
        assert flat is not None
        g = flat[offsets[p.dtype] : offsets[p.dtype] + p.numel()].view_as(p)
        offsets[p.dtype] += p.numel()
        if h or p.grad is not None:
            out.append((p, g if h else torch.zeros_like(p)))
    return out
