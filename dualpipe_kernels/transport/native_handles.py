"""What :class:`~dualpipe_kernels.transport.native.NativeTransport` hands back: a posted transfer's handle
and a reserved ring slot to pack into (a send complete when posted gets ``transport.base.DONE``); the errors
of a wait for an engine request."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from dualpipe_kernels.transport.base import Handle, TransportError, TransportTimeout

__all__ = ["HandleOwner", "NativeHandle", "ReservedSlot", "request_error"]


class HandleOwner(Protocol):
    """What a handle needs of its transport (:class:`~dualpipe_kernels.transport.native.NativeTransport`)."""

    timeout_s: float
    #: id(request) -> (request, tensor): transfers the engine may still touch
    _inflight: dict[int, tuple[Any, torch.Tensor]]

    @property
    def rank(self) -> int: ...

    @property
    def failure(self) -> BaseException | None:
        """What :meth:`~dualpipe_kernels.transport.base.Transport.fail_all` was given, or None."""

    def wait_raw(self, request: Any, timeout: float) -> None:
        """Wait for an engine request (:func:`request_error`'s errors); drops it from ``_inflight`` unless it
        timed out (the engine may then still write its tensor)."""


def request_error(exc: Exception, owner: HandleOwner) -> BaseException:
    """What a wait of an engine request that raised ``exc`` raises: TransportTimeout for the engine's
    TimeoutError; for a failed request the transport's failure when ``fail_all`` failed it (the engine
    failed it with that failure's text), else TransportError."""
    if isinstance(exc, TimeoutError):
        return TransportTimeout(str(exc))
    failure = owner.failure
    return failure if failure is not None else TransportError(str(exc))


class NativeHandle(Handle):
    """One posted transfer. Holds the tensor until the transfer completes."""

    def __init__(self, request: Any, tensor: torch.Tensor, owner: HandleOwner) -> None:
        self._request = request
        self._tensor: torch.Tensor | None = tensor
        self._owner = owner

    def wait(self, timeout: float | None = None) -> None:
        try:
            self._owner.wait_raw(self._request, self._owner.timeout_s if timeout is None else timeout)
        except TransportTimeout:
            raise  # still in flight: the engine may write the tensor, which stays held
        except BaseException:
            self._tensor = None  # failed: the owner dropped it from its in-flight table
            raise
        self._tensor = None

    def is_completed(self) -> bool:
        """True once finished, successfully or not (``wait`` then raises the failure)."""
        done = bool(self._request.query())
        if done:
            self._release()
        return done

    def _release(self) -> None:
        """The engine is done with the tensor: neither this handle nor the transport keeps it any longer."""
        if self._tensor is not None:
            self._tensor = None
            self._owner._inflight.pop(id(self._request), None)


class ReservedSlot:
    """One reserved ring slot: write :attr:`tensor`, then :meth:`commit` (publish) or :meth:`abort`.

    ``tensor`` is a 1-D uint8 view of the shared memory the receiver reads; it
    is dropped on commit or abort (the bytes then belong to the ring).  As a
    context manager it commits on a clean exit and aborts on an exception.
    """

    def __init__(self, reservation: Any, owner: HandleOwner) -> None:
        self._reservation = reservation
        self._owner = owner
        self.nbytes = int(reservation.nbytes)
        self.tensor: torch.Tensor | None = (
            torch.frombuffer(reservation, dtype=torch.uint8) if self.nbytes else torch.empty(0, dtype=torch.uint8)
        )

    def commit(self) -> None:
        """Publish the slot as one message; TransportError if the channel was closed or broke meanwhile."""
        self.tensor = None
        try:
            self._reservation.commit()
        except RuntimeError as exc:
            failure = self._owner.failure
            if failure is not None:
                raise failure from None
            raise TransportError(f"rank {self._owner.rank}: {exc}") from None

    def abort(self) -> None:
        """Give the slot back unpublished (idempotent)."""
        self.tensor = None
        self._reservation.abort()

    def __enter__(self) -> ReservedSlot:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
