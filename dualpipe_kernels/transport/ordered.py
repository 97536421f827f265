"""Tag semantics over a backend that matches point-to-point transfers in posting order (NCCL).

NCCL has no tags: between two ranks the k-th send one side posts meets the
k-th receive the other side posts, and both directions of a pair share one
communicator and one stream, so a send that waits for its receive also holds
back everything the pair posts after it.  The runtime posts receives early, by
tag, in its own order (metadata ahead of data, several micro-batches in
flight), which NCCL would pair up wrongly or deadlock on.

So every transfer of a pair (both directions) gets a sequence number when its
*sender* posts it (an atomic counter in the group's store, one per unordered
pair), published with its tag and size; each rank then posts the pair's
operations strictly in sequence order:

* its own sends, by the posting thread as soon as every earlier entry of the
  pair is posted;
* the peer's sends, by one worker thread per peer that waits on the store for
  the next entry and posts the receive at once: into the buffer the runtime
  posted for that tag, or into a staging buffer when the runtime has not
  posted it yet (copied over when it does), so the worker never waits for the
  runtime and no send waits behind a receive that is not posted.

Both ranks thus post the same sequence per pair.  Everything moves as uint8
bytes (sender and receiver agree on the size through the entry; a mismatch
fails the receive naming the tag).  Cost: about five store round trips per
message (counter, entry, the receiver's wait, read and delete), which suits
activation-sized messages, not tiny ones.  CUDA: a send may be posted later
and from the worker thread, so ``isend`` records an event on the caller's
current stream and the posting thread's stream waits for it first (the data
is ready whichever stream wrote it); waiting on a handle makes the caller's
current stream wait for the transfer (NCCL semantics).  A worker that loses
the store (a peer or the store's host died) fails the receives it was
serving, naming the error, instead of leaving them to time out.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from dualpipe_kernels.transport.base import Handle, TransportError, TransportTimeout

__all__ = ["OrderedHandle", "OrderedP2P"]

_JOIN_S = 5.0  # how long close() waits for each worker to leave the store
_CLOSE = "close"  # an entry that ends a pair's sequence (written by close(), never by a sender)
_PREFIX = "dpk/ordered"

Post = Callable[[torch.Tensor, int], Any]  # (uint8 buffer, peer) -> a torch.distributed Work


class OrderedHandle(Handle):
    """One transfer; posted to the backend once the pair's sequence reaches it."""

    def __init__(self, owner: OrderedP2P, peer: int, tag: int, what: str, sending: bool) -> None:
        self._owner, self._peer, self._tag, self._what, self._sending = owner, peer, tag, what, sending
        self._posted = threading.Event()
        self._work: Any = None
        self._finish: Callable[[], None] | None = None
        self._error: BaseException | None = None
        self._watch: Any = None
        self._done = False

    def _describe(self) -> str:
        arrow = "->" if self._sending else "<-"
        return f"rank {self._owner.rank} {arrow} peer rank {self._peer} (tag {self._tag}, {self._what or 'transfer'})"

    def _set(self, work: Any, finish: Callable[[], None] | None = None) -> None:
        self._work, self._finish = work, finish
        self._posted.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._posted.set()

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        limit = self._owner.timeout_s if timeout is None else timeout
        start = time.monotonic()
        if not self._posted.wait(limit):
            raise TransportTimeout(
                f"{self._describe()} timed out after {limit:.1f} s before it was posted: an earlier transfer "
                "of this pair (in the order the senders posted them) is still missing"
            )
        if self._error is not None:
            raise TransportError(f"{self._describe()} failed: {self._error}") from self._error
        left = max(limit - (time.monotonic() - start), 1e-3)
        exc: BaseException | None = None
        if self._watch is not None:  # a waiter thread owns the work's wait now
            if not self._watch.event.wait(left):
                raise TransportTimeout(f"{self._describe()} timed out after {limit:.1f} s")
            exc = self._watch.error
        else:
            try:
                self._work.wait(timedelta(seconds=left))
            except RuntimeError as e:
                exc = e
        if exc is not None:
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise TransportTimeout(f"{self._describe()} timed out after {limit:.1f} s ({exc})") from exc
            raise TransportError(f"{self._describe()} failed: {exc}") from exc
        self._done = True
        self._work = self._watch = None
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()

    def is_completed(self) -> bool:
        if self._done:
            return True
        if not self._posted.is_set():
            return False
        if self._error is not None:
            return True  # wait() raises it
        if self._owner.watch is None:
            return bool(self._work.is_completed())
        if self._watch is None:
            self._watch = self._owner.watch(self._work)
        return self._watch.event.is_set()


class _Pair:
    """One peer's share of the ordering state (guarded by ``lock``)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.lock = threading.Lock()
        self.next_seq = 0  # the next sequence number this rank posts
        self.sends: dict[int, tuple[torch.Tensor, OrderedHandle, Any]] = {}  # seq -> (bytes, handle, CUDA event)
        self.recvs: dict[int, collections.deque[tuple[torch.Tensor, OrderedHandle]]] = {}
        self.early: dict[int, collections.deque[tuple[torch.Tensor, Any]]] = {}  # (staging, work or its error)
        self.failure: BaseException | None = None  # the worker lost the store: every later receive fails


class OrderedP2P:
    """Sequenced point-to-point for the ranks of one group (see the module docstring).

    ``post_send``/``post_recv`` post one uint8 buffer to/from a group rank on
    the backend (tags unused).  ``watch``: None when a posted work's
    ``is_completed()`` can be polled (NCCL); else ``watch(work)`` hands the
    work to a thread that waits on it and returns an object with ``event``
    (set when done) and ``error`` (gloo: its works only finish in ``wait``).  Construction is collective (a generation
    counter in ``store`` keeps two instances' keys apart).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        device: torch.device,
        post_send: Post,
        post_recv: Post,
        watch: Callable[[Any], Any] | None,
        timeout_s: float,
    ) -> None:
        self.store, self.rank, self.world, self.device = store, rank, world, device
        self._post_send, self._post_recv, self.watch, self.timeout_s = post_send, post_recv, watch, timeout_s
        generation = store.add(f"{_PREFIX}/generation/{rank}", 1)
        prefix = f"{_PREFIX}/{generation}"
        self._pairs = {p: _Pair(f"{prefix}/{min(p, rank)}-{max(p, rank)}") for p in range(world) if p != rank}
        self._stop = threading.Event()
        self._workers = [
            threading.Thread(target=self._follow, args=(p,), name=f"dpk-ordered-{rank}<-{p}", daemon=True)
            for p in self._pairs
        ]
        for t in self._workers:
            t.start()

    # ---- posting (runtime thread) --------------------------------------------------
    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> OrderedHandle:
        pair = self._pairs[peer]
        buf = tensor.reshape(-1).view(torch.uint8)
        handle = OrderedHandle(self, peer, tag, what, sending=True)
        ready = None
        if buf.is_cuda:  # the send may be posted from another thread, on another stream
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(buf.device))
        seq = int(self.store.add(f"{pair.key}/count", 1)) - 1
        with pair.lock:
            pair.sends[seq] = (buf, handle, ready)
            self._drain(pair, peer)
        self.store.set(f"{pair.key}/{seq}", f"{self.rank} {tag} {buf.numel()}")
        return handle

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> OrderedHandle:
        pair = self._pairs[peer]
        buf = tensor.reshape(-1).view(torch.uint8)
        handle = OrderedHandle(self, peer, tag, what, sending=False)
        with pair.lock:
            early = pair.early.get(tag)
            if pair.failure is not None and not early:
                handle._fail(pair.failure)
            elif early:
                staging, work = early.popleft()
                if isinstance(work, BaseException):
                    handle._fail(work)
                elif staging.numel() != buf.numel():
                    handle._fail(self._size_error(tag, staging.numel(), buf.numel()))
                else:
                    handle._set(work, functools.partial(_copy, buf, staging))
            else:
                pair.recvs.setdefault(tag, collections.deque()).append((buf, handle))
        return handle

    def _size_error(self, tag: int, sent: int, expected: int) -> TransportError:
        return TransportError(f"rank {self.rank}: message with tag {tag} has {sent} bytes, the receive {expected}")

    def _drain(self, pair: _Pair, peer: int) -> None:
        """Post this rank's own sends that are next in the pair's sequence (caller holds ``pair.lock``)."""
        while pair.next_seq in pair.sends:
            buf, handle, ready = pair.sends.pop(pair.next_seq)
            pair.next_seq += 1
            try:
                if ready is not None:
                    torch.cuda.current_stream(buf.device).wait_event(ready)
                handle._set(self._post_send(buf, peer))
            except Exception as exc:  # noqa: BLE001 - reported through the handle
                handle._fail(exc)

    # ---- following the peer's sends (worker thread) ---------------------------------
    def _follow(self, peer: int) -> None:
        # A store client of its own: a client serialises its calls, and this one blocks in wait().
        store = self.store.clone()
        pair = self._pairs[peer]
        while not self._stop.is_set():
            with pair.lock:
                seq = pair.next_seq
            key = f"{pair.key}/{seq}"
            try:  # close() wakes this wait by writing the key (a long wait logs nothing while idle)
                store.wait([key], timedelta(seconds=max(self.timeout_s, 1.0)))
            except Exception as exc:  # noqa: BLE001 - stores raise several types
                if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                    continue
                self._lost(pair, peer, exc)
                return
            try:
                if not self._step(store, pair, peer, seq, key):
                    return
            except Exception as exc:  # noqa: BLE001 - the store or the backend failed under this worker
                self._lost(pair, peer, exc)
                return

    def _lost(self, pair: _Pair, peer: int, exc: BaseException) -> None:
        if self._stop.is_set():
            return
        error = TransportError(f"rank {self.rank}: ordering of transfers with peer rank {peer} failed: {exc}")
        with pair.lock:
            pair.failure = error
            for waiting in pair.recvs.values():
                for _, handle in waiting:
                    handle._fail(error)
            pair.recvs.clear()

    def _step(self, store: Any, pair: _Pair, peer: int, seq: int, key: str) -> bool:
        """Post entry ``seq`` of the pair if it is the peer's; False when the pair is closed."""
        with pair.lock:
            if pair.next_seq != seq:
                return True  # our own send, already posted by its thread
            entry = store.get(key).decode()
            if entry == _CLOSE:
                return False  # this rank or the peer closed: the pair carries nothing more
            src, tag, nbytes = (int(v) for v in entry.split())
            if src == self.rank:
                return True  # registered before its entry was published: _drain posts it
            self._receive(pair, peer, tag, nbytes)
            store.delete_key(key)
            pair.next_seq += 1
            self._drain(pair, peer)
        return True

    def _receive(self, pair: _Pair, peer: int, tag: int, nbytes: int) -> None:
        waiting = pair.recvs.get(tag)
        if waiting:
            buf, handle = waiting.popleft()
            if buf.numel() != nbytes:
                # Still consume the message (the sequence must advance on both sides), then fail the receive.
                self._post_recv(torch.empty(nbytes, dtype=torch.uint8, device=self.device), peer)
                handle._fail(self._size_error(tag, nbytes, buf.numel()))
                return
            try:
                handle._set(self._post_recv(buf, peer))
            except Exception as exc:  # noqa: BLE001 - reported through the handle
                handle._fail(exc)
            return
        staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        try:
            work: Any = self._post_recv(staging, peer)
        except Exception as exc:  # noqa: BLE001 - handed to the receive that comes for it
            work = exc
        pair.early.setdefault(tag, collections.deque()).append((staging, work))

    def close(self) -> None:
        """Stop the workers: each one's next entry becomes "close" unless a sender wrote it.  Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        for pair in self._pairs.values():
            with pair.lock:
                seq = pair.next_seq
            try:
                self.store.compare_set(f"{pair.key}/{seq}", "", _CLOSE)  # sets only a key that is not there
            except Exception:  # noqa: BLE001 - the store may be gone at exit; the workers are daemons
                pass
        for t in self._workers:
            t.join(_JOIN_S)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)
