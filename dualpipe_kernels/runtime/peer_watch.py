"""Failures that spread: a rank whose step fails tells its peers at once, and a rank that dies is named.

Without this, a rank whose step raised (and whose process lives on, because the
user's code caught the error) leaves its peers waiting for their full timeout,
and a killed rank is named by its neighbours only, as "the peer of the
transfer I was waiting for".

Each pipeline has one :class:`PeerWatch`, made collectively at construction
on the process group's store under a prefix of its own (each rank counts the
watches it built on that store; ranks build their pipelines in the same order,
so the counts agree):

- ``publish(exc)``: the failed rank writes ``failed/<rank>`` (its error, one
  line) and bumps ``failures``; done by ``Pipeline.step`` on any exception.
- a daemon thread polls ``failures`` every ``poll_s`` (one store round trip)
  and bumps this rank's ``beat/<rank>``; every ``liveness_s`` it reads the
  other ranks' beats: a rank whose beat has not moved for ``liveness_s`` (killed,
  stopped, or its process gone) is a failure too, named by every rank alike.
  A store that stops answering means its host (group rank 0's process) died.
- on the first failure it sees (a raising rank, a killed or stopped one, a store
  gone) the watch calls ``fail_all(PeerFailed(...))`` on the transports attached
  to it (:meth:`PeerWatch.attach`: the pipeline's), so every wait blocked on them
  raises :class:`PeerFailed` (naming the failed rank and its error) at once, and
  so does every later post.

The runtime's waits go through :class:`WatchedHandle`.  On a transport whose
``fail_all`` ends blocked waits (``Transport.fails_waits``: native, torch over
gloo, CUDA IPC) a wait is a plain ``handle.wait``: no ``is_completed`` probe, no
slicing; the failure comes from inside the transport.  On any other transport
(and for a bare handle given to :meth:`PeerWatch.wait`) the wait runs in slices
of ``poll_s`` and checks for a failure between them.  A wait that fails for
another reason (the peer's end broke) is named after the rank that failed, which
the thread sees within a poll or two.
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import threading
import time
import weakref
from typing import Any

from dualpipe_kernels.transport.base import Handle, TransportTimeout

__all__ = ["PeerFailed", "PeerWatch", "WatchedHandle", "WatchedTransport"]

_PREFIX = "dpk/peerwatch"


class PeerFailed(RuntimeError):
    """Another pipeline rank failed (raised in its step, died or stopped responding)."""

    def __init__(self, rank: int, error: str, seen_by: int) -> None:
        self.rank = rank
        self.error = error
        super().__init__(f"pipeline rank {seen_by}: pipeline rank {rank} failed: {error}")


class PeerWatch:
    """Publishes this rank's failure and watches the others' (see the module docstring).

    ``store``: the process group's store.  ``rank``: this pipeline rank;
    ``world``: the number of pipeline ranks.  ``key_rank``: the rank under
    which this watch counts its generation (the group rank; any value unique
    per process on this store).  ``store_host``: the pipeline rank whose
    process hosts the store (group rank 0's), named when the store stops answering.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        key_rank: int | None = None,
        poll_s: float = 0.1,
        liveness_s: float = 15.0,
        store_host: int = 0,
    ) -> None:
        if not poll_s > 0 or not liveness_s > poll_s:
            raise ValueError(f"PeerWatch needs 0 < poll_s < liveness_s, got poll_s={poll_s} liveness_s={liveness_s}")
        self.rank, self.world, self.store_host = rank, world, store_host
        self.poll_s, self.liveness_s = poll_s, liveness_s
        self._store = store
        gen = store.add(f"{_PREFIX}/gen/{rank if key_rank is None else key_rank}", 1)
        self._prefix = f"{_PREFIX}/{gen}"
        self._failure: PeerFailed | None = None
        self._published = False
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _failure and _targets
        store.add(f"{self._prefix}/beat/{rank}", 1)
        self._host = socket.gethostname()
        store.set(f"{self._prefix}/proc/{rank}", f"{os.getpid()} {self._host}")
        self._local_pids: dict[int, int] = {}  # same-host peers' pids, read once each
        self._targets: list[Any] = []  # transports to fail_all on a failure (guarded by _lock)
        self._thread = threading.Thread(target=self._run, name=f"dpk-peerwatch-{rank}", daemon=True)
        self._thread.start()
        # A process that ends normally (not killed) says so, so that its peers do not take it for dead.
        ref = weakref.ref(self)

        def at_exit() -> None:
            watch = ref()
            if watch is not None:
                watch.close()

        self._atexit = at_exit
        atexit.register(at_exit)

    # ---- this rank --------------------------------------------------------
    def publish(self, exc: BaseException) -> None:
        """Tell every peer that this rank failed with ``exc`` (once; errors of the store are ignored)."""
        if self._published or isinstance(exc, PeerFailed):
            return  # a failure seen from a peer is that peer's to publish, not a new one
        self._published = True
        text = str(exc).strip().splitlines()
        line = f"{type(exc).__name__}: {text[0] if text else ''}"[:400]
        try:
            self._store.set(f"{self._prefix}/failed/{self.rank}", line)
            self._store.add(f"{self._prefix}/failures", 1)
        except Exception:  # noqa: BLE001 - the store's host may be the one that died; nothing more to tell
            pass

    def close(self) -> None:
        """Stop watching (idempotent); peers stop counting this rank's heartbeat."""
        if self._stop.is_set():
            return
        self._stop.set()
        atexit.unregister(self._atexit)
        with self._lock:
            self._targets.clear()  # a failure seen later is no business of the transports any more
        if self._published and self.rank == self.store_host:
            # This process hosts the store: give the peers' threads a few polls to read the failure
            # before a process exit takes the store (and the failure's text) with it.
            time.sleep(3 * self.poll_s)
        try:
            self._store.set(f"{self._prefix}/closed/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - closing after the store's host died
            pass
        self._thread.join(timeout=5.0)

    def attach(self, transport: Any) -> bool:
        """Fail ``transport`` (``fail_all(PeerFailed(...))``) at the first failure of another rank; at once if one
        was seen already.  Returns whether its waits then end by themselves (``transport.fails_waits``): its
        handles need no probe or slicing."""
        with self._lock:
            self._targets.append(transport)
            failure = self._failure
        if failure is not None:
            _fail(transport, failure)
        return bool(getattr(transport, "fails_waits", False))

    # ---- the others -------------------------------------------------------
    def failure(self) -> PeerFailed | None:
        """The first failure of another rank seen so far, or None."""
        with self._lock:
            return self._failure

    def check(self) -> None:
        """Raise :class:`PeerFailed` if another rank has failed."""
        failure = self.failure()
        if failure is not None:
            raise failure

    def wait_plain(self, handle: Handle, timeout_s: float | None) -> None:
        """``handle.wait(timeout_s)`` for a handle of an attached transport whose ``fail_all`` ends blocked waits:
        a failure of another rank ends the wait from inside the transport (raising :class:`PeerFailed`); a
        wait that broke for another reason is named after that failure when the thread sees one."""
        try:
            handle.wait(timeout_s)
        except Exception as exc:
            self.name_failure(exc)
            raise

    def name_failure(self, exc: Exception) -> None:
        """For a plain wait that raised ``exc``: raise the failure of another rank instead when this watch sees
        one (at once for a timeout, within three polls for a broken transfer); return to let ``exc`` stand."""
        if isinstance(exc, PeerFailed):
            return
        if isinstance(exc, TransportTimeout):
            self.check()
            return
        self._blame_failure()

    def wait(self, handle: Handle, timeout_s: float) -> None:
        """``handle.wait(timeout_s)``, but raising :class:`PeerFailed` as soon as another rank has failed: in
        slices of ``poll_s`` (for a handle of a transport that cannot be failed from outside)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                handle.wait(max(0.001, min(left, self.poll_s)))
                return
            except TransportTimeout as exc:
                self.check()
                if left <= self.poll_s:
                    # the transport's message names the last slice's limit: name the whole wait instead
                    text = re.sub(r"timed out after [0-9.]+ s", f"timed out after {timeout_s:.1f} s", str(exc))
                    raise TransportTimeout(text) from None
            except Exception:
                self._blame_failure()
                raise

    def _blame_failure(self) -> None:
        """For a transfer that broke: raise the failure of the rank behind it if one is seen within three polls
        (the thread's view, or a dead process on this host), rather than let the transport's view stand."""
        for _ in range(3):
            self.check()
            self._find_dead_processes()
            self.check()
            time.sleep(self.poll_s)
        self.check()

    def _find_dead_processes(self) -> None:
        """Record as failed a peer on this host whose process is gone (killed: it could not say so itself)."""
        try:
            for r in range(self.world):
                if r == self.rank:
                    continue
                if r not in self._local_pids:
                    key = f"{self._prefix}/proc/{r}"
                    if not self._store.check([key]):
                        continue
                    pid, host = self._store.get(key).decode().split(" ", 1)
                    self._local_pids[r] = int(pid) if host == self._host else 0
                pid = self._local_pids[r]
                if pid and not _alive(pid) and not self._store.check([f"{self._prefix}/closed/{r}"]):
                    why = f"its process (pid {pid}, this host) is gone: killed or crashed"
                    self._set(PeerFailed(r, why, self.rank))
                    # said on its behalf, so every rank names the dead rank (not the neighbour that saw it first)
                    if not self._store.check([f"{self._prefix}/failed/{r}"]):
                        self._store.set(f"{self._prefix}/failed/{r}", why)
                        self._store.add(f"{self._prefix}/failures", 1)
                    return
        except Exception:  # noqa: BLE001 - a store gone is the thread's to report
            return

    def _set(self, failure: PeerFailed) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = failure
            targets = list(self._targets)
        for transport in targets:  # every wait blocked on them raises the failure now
            _fail(transport, failure)

    def _run(self) -> None:
        store, prefix = self._store, self._prefix
        last_beats: dict[int, tuple[int, float]] = {}
        next_liveness = time.monotonic() + self.liveness_s
        while not self._stop.wait(self.poll_s):
            try:
                store.add(f"{prefix}/beat/{self.rank}", 1)
                if store.add(f"{prefix}/failures", 0) > 0:
                    for r in range(self.world):
                        if r != self.rank and store.check([f"{prefix}/failed/{r}"]):
                            self._set(PeerFailed(r, store.get(f"{prefix}/failed/{r}").decode(), self.rank))
                            return
                now = time.monotonic()
                if now < next_liveness:
                    continue
                next_liveness = now + self.poll_s * 5
                self._find_dead_processes()
                if self.failure() is not None:
                    return
                for r in range(self.world):
                    if r == self.rank or store.check([f"{prefix}/closed/{r}"]):
                        continue
                    beat = store.add(f"{prefix}/beat/{r}", 0)
                    seen, since = last_beats.get(r, (-1, now))
                    if beat != seen:
                        last_beats[r] = (beat, now)
                    elif now - since >= self.liveness_s:
                        self._set(
                            PeerFailed(
                                r, f"no sign of life for {now - since:.0f} s (killed, stopped or hung)", self.rank
                            )
                        )
                        return
            except Exception as exc:  # noqa: BLE001 - the store is hosted by group rank 0's process
                if self._stop.is_set():
                    return
                why = f"its store stopped answering ({type(exc).__name__}: {exc})"
                self._set(PeerFailed(self.store_host, why, self.rank))
                return


def _fail(transport: Any, failure: PeerFailed) -> None:
    try:
        transport.fail_all(failure)
    except Exception:  # noqa: BLE001 - best effort: its waits then end at their timeouts or their own errors
        pass


def _alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) still runs: it exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):  # no readable /proc entry: ask the kernel (another user's process counts)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


class WatchedHandle(Handle):
    """A transport handle whose waits end as soon as another rank has failed.

    ``direct`` (its transport's ``fail_all`` ends blocked waits and the watch is attached to it): a wait is
    :meth:`PeerWatch.wait_plain`, nothing more.  Otherwise :meth:`PeerWatch.wait` (slices of ``poll_s``)."""

    __slots__ = ("_direct", "_inner", "_watch")

    def __init__(self, inner: Handle, watch: PeerWatch, direct: bool = False) -> None:
        self._inner = inner
        self._watch = watch
        self._direct = direct

    def wait(self, timeout: float | None = None) -> None:
        if self._direct:
            self._watch.wait_plain(self._inner, timeout)
        elif timeout is None or self._inner.is_completed():
            self._inner.wait(timeout)
        else:
            self._watch.wait(self._inner, timeout)

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def wait_stream(self, stream: Any = None) -> None:
        self._inner.wait_stream(stream)

    def __getattr__(self, name: str) -> Any:  # optional extensions of a transport's handles (add_done_callback)
        return getattr(self._inner, name)


class WatchedTransport:
    """What the boundary messaging of a pipeline sees of its transport: the same transport, with every
    handle it returns wrapped in a :class:`WatchedHandle`.  Everything else is the transport's own.
    The watch is attached to the transport (:meth:`PeerWatch.attach`): a failure fails it."""

    def __init__(self, inner: Any, watch: PeerWatch) -> None:
        self._inner = inner
        self._watch = watch
        self._direct = watch.attach(inner)
        # A gathered send (the native engine's) returns a bool, no handle: the inner's own method, found here
        # once rather than through __getattr__ on every repeated small send.
        gather = getattr(inner, "try_isend_gather", None)
        if gather is not None:
            self.try_isend_gather = gather
        # Receives posted with no handle (the native engine's repeated small ones): posted by the inner's own
        # method, waited through the inner's with the watch's naming of errors.  Only on a direct watch.
        self._wait_raw: Any = None
        if self._direct and getattr(inner, "irecv_raw", None) is not None:
            self.irecv_raw = inner.irecv_raw
            self._wait_raw = inner.wait_raw

    def wait_raw(self, request: Any, timeout: float) -> None:
        """The inner's ``wait_raw``, its errors named as :meth:`PeerWatch.wait_plain` names a handle's."""
        try:
            self._wait_raw(request, timeout)
        except Exception as exc:
            self._watch.name_failure(exc)
            raise

    def _wrap(self, handle: Any) -> Any:
        return WatchedHandle(handle, self._watch, self._direct) if isinstance(handle, Handle) else handle

    def isend(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrap(self._inner.isend(*args, **kwargs))

    def irecv(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrap(self._inner.irecv(*args, **kwargs))

    def isend_packed(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrap(self._inner.isend_packed(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr) or isinstance(attr, type):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._wrap(attr(*args, **kwargs))

        return call
