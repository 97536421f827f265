"""What :class:`~dualpipe_kernels.transport.torch_dist.TorchDistTransport` hands back: a gloo transfer's
handle (waited on directly, or through a waiter thread once polled) and an NCCL one."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dualpipe_kernels.transport.base import Handle, TransportError, TransportTimeout
from dualpipe_kernels.transport.gloo_waiters import Completion, WaiterPool

__all__ = ["NcclHandle", "WorkHandle", "WorkOwner", "is_timeout"]


class WorkOwner(Protocol):
    """What a handle needs of its transport (a :class:`~dualpipe_kernels.transport.torch_dist.TorchDistTransport`)."""

    timeout_s: float
    waiters: WaiterPool

    @property
    def rank(self) -> int: ...

    @property
    def failure(self) -> BaseException | None:
        """What :meth:`~dualpipe_kernels.transport.base.Transport.fail_all` was given, or None."""

    def track(self, delta: int) -> None:
        """Count a transfer into (+1) or out of (-1) the transport's transfers in flight."""


def is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


class WorkHandle(Handle):
    """One transfer.  ``finish`` runs once after completion (host-staged receive copies)."""

    def __init__(
        self,
        work: dist.Work,
        owner: WorkOwner,
        peer: int,
        what: str,
        finish: Callable[[], None] | None = None,
        keep: torch.Tensor | None = None,
    ) -> None:
        self._owner = owner
        self._peer = peer
        self._what = what
        self._finish = finish
        self._keep = keep  # a host staging copy that must outlive the send
        self._done = False
        self._work: dist.Work | None = work
        # A gloo work gets a waiter thread the first time someone polls it (a handle only ever waited on
        # directly costs no thread).
        self._completion: Completion | None = None
        self._settled = False  # counted out of the owner's in-flight transfers
        owner.track(+1)

    def _describe(self) -> str:
        return f"rank {self._owner.rank} <-> peer rank {self._peer}: {self._what or 'transfer'}"

    def _settle(self, _error: BaseException | None = None) -> None:
        # Once per handle: its transfer finished (a waiter thread saw it, or a wait returned).
        if not self._settled:
            self._settled = True
            self._owner.track(-1)

    def _watch(self) -> Completion:
        assert self._work is not None
        completion = self._owner.waiters.submit(self._work)
        completion.add_callback(self._settle)
        return completion

    def _complete(self) -> None:
        self._done = True
        self._settle()
        self._keep = None
        self._work = None  # the work object references the tensor
        self._completion = None
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        limit = self._owner.timeout_s if timeout is None else timeout
        if self._completion is not None:
            if not self._completion.event.wait(limit):
                raise TransportTimeout(f"{self._describe()} timed out after {limit:.1f} s")
            exc = self._completion.error
        else:
            assert self._work is not None
            failure = self._owner.failure
            if failure is not None:  # failed before this wait began: fail_all saw this transfer counted in flight
                raise failure
            exc = None
            try:
                self._work.wait(timedelta(seconds=limit))
            except RuntimeError as e:
                exc = e
        if exc is not None:
            failure = self._owner.failure
            if failure is not None:  # fail_all cancelled the group's transfers: the reason is the failure
                raise failure from None
            if is_timeout(exc):
                raise TransportTimeout(f"{self._describe()} timed out after {limit:.1f} s ({exc})") from exc
            raise TransportError(f"{self._describe()} failed: {exc}") from exc
        self._complete()

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self._completion is None:
            self._completion = self._watch()
        return self._completion.event.is_set()

    def add_done_callback(self, fn: Callable[[BaseException | None], None]) -> bool:
        """Run ``fn(error_or_None)`` on a waiter thread once the transfer is done.

        An optional extension of the Handle interface (the runtime checks for
        it): it lets a metadata receive post its data receives the moment it
        completes, without waiting for the main thread (a transport without
        this method is polled between actions instead).  Returns True.
        """
        if self._completion is None:
            if self._done:
                fn(None)
                return True
            self._completion = self._watch()
        self._completion.add_callback(fn)
        return True


class NcclHandle(Handle):
    """An NCCL transfer: completion is polled on the work itself; a wait orders the stream after it."""

    def __init__(self, work: Any, owner: WorkOwner, peer: int, what: str) -> None:
        self._work: Any = work
        self._owner, self._peer, self._what = owner, peer, what

    def is_completed(self) -> bool:
        return self._work is None or bool(self._work.is_completed())

    def wait(self, timeout: float | None = None) -> None:
        self.wait_stream(None)

    def wait_stream(self, stream: torch.cuda.Stream | None = None) -> None:
        if self._work is None:
            return
        try:
            if stream is None:
                self._work.wait()
            else:
                with torch.cuda.stream(stream):
                    self._work.wait()
        except RuntimeError as exc:
            who = f"rank {self._owner.rank} <-> peer rank {self._peer}"
            raise TransportError(f"{who}: {self._what} failed: {exc}") from exc
        self._work = None
