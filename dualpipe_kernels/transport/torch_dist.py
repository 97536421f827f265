"""Transport over ``torch.distributed`` point-to-point (gloo on CPU, NCCL on GPU).

Peers are *group ranks* of ``group``.  Tags keep several transfers between the
same pair apart (gloo matches on them; NCCL matches in posting order, so with
NCCL both sides must post a pair's transfers in the same order).

CUDA tensors over a backend that cannot move them (gloo) are staged through a
host buffer: the send copies to the host before posting, the receive copies to
the device when it is waited on.  That path blocks the host; it exists so that
the runtime works on one GPU with several ranks, not for speed.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from dualpipe_kernels.transport.base import DEFAULT_TIMEOUT_S, Handle, Transport, TransportError, TransportTimeout

__all__ = ["TorchDistTransport"]


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


class _WorkHandle(Handle):
    """Wraps a ``dist.Work``; ``finish`` runs once after the transfer is complete (host-staged copies)."""

    def __init__(
        self,
        work: dist.Work | None,
        owner: TorchDistTransport,
        peer: int,
        what: str,
        finish: Callable[[], None] | None = None,
        keep: torch.Tensor | None = None,
    ) -> None:
        self._work = work
        self._keep = keep  # a host staging copy that must outlive the send
        self._owner = owner
        self._peer = peer
        self._what = what
        self._finish = finish
        self._done = work is None

    def _describe(self) -> str:
        return f"rank {self._owner.rank} <-> peer rank {self._peer}: {self._what or 'transfer'}"

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        limit = self._owner.timeout_s if timeout is None else timeout
        assert self._work is not None
        try:
            self._work.wait(timedelta(seconds=limit))
        except RuntimeError as exc:
            if _is_timeout(exc):
                raise TransportTimeout(f"{self._describe()} timed out after {limit:.1f} s ({exc})") from exc
            raise TransportError(f"{self._describe()} failed: {exc}") from exc
        self._done = True
        self._keep = None
        self._work = None  # the work object references the tensor
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()

    def is_completed(self) -> bool:
        if self._done:
            return True
        assert self._work is not None
        return bool(self._work.is_completed())

    def wait_stream(self, stream: torch.cuda.Stream | None = None) -> None:
        # NCCL work.wait() without a timeout makes the current stream wait on the
        # transfer's event and returns at once; every other case waits on the host.
        if self._owner.device_native and self._finish is None and not self._done:
            assert self._work is not None
            if stream is not None:
                with torch.cuda.stream(stream):
                    self._work.wait()
            else:
                self._work.wait()
            self._done = True
            return
        self.wait()


class TorchDistTransport(Transport):
    """Point-to-point over a ``torch.distributed`` process group (default group when ``group`` is None)."""

    name = "torch"

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(timeout_s)
        if not dist.is_initialized():
            raise ValueError("TorchDistTransport needs an initialised torch.distributed process group")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.group = group if group is not None else dist.group.WORLD
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._rank = dist.get_rank(self.group)
        self._size = dist.get_world_size(self.group)
        backend = str(dist.get_backend(self.group)).lower()
        # Can the backend move tensors of self.device without a host copy?
        self.device_native = self.device.type == "cpu" or (self.device.type == "cuda" and "nccl" in backend)
        self._closed = False

    @property
    def rank(self) -> int:
        return self._rank

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self._size or peer == self._rank:
            raise ValueError(f"rank {self._rank}: bad peer {peer} for {what!r} (group of {self._size})")
        if self._closed:
            raise TransportError(f"rank {self._rank}: transport closed; cannot post {what!r}")

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        self._check_peer(peer, what)
        if not tensor.is_contiguous():
            raise ValueError(f"rank {self._rank}: isend needs a contiguous tensor ({what})")
        buf = tensor if (tensor.device.type == "cpu" or self.device_native) else tensor.to("cpu")
        try:
            work = dist.isend(buf, group=self.group, group_dst=peer, tag=tag)
        except RuntimeError as exc:
            raise TransportError(f"rank {self._rank} -> peer rank {peer}: posting {what} failed: {exc}") from exc
        return _WorkHandle(work, self, peer, what, keep=None if buf is tensor else buf)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        self._check_peer(peer, what)
        if not tensor.is_contiguous():
            raise ValueError(f"rank {self._rank}: irecv needs a contiguous tensor ({what})")
        staged = not (tensor.device.type == "cpu" or self.device_native)
        buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu") if staged else tensor
        try:
            work = dist.irecv(buf, group=self.group, group_src=peer, tag=tag)
        except RuntimeError as exc:
            raise TransportError(f"rank {self._rank} <- peer rank {peer}: posting {what} failed: {exc}") from exc

        def finish() -> None:
            tensor.copy_(buf)

        return _WorkHandle(work, self, peer, what, finish if staged else None)

    def close(self) -> None:
        self._closed = True
