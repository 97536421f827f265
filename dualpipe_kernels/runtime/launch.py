"""Start a group of local worker processes, one per pipeline rank.

Used by ``dualpipe-kernels demo``, the benchmark suites and the multi-process
tests.  Every rank runs ``fn(rank, world_size, *args)`` after joining a gloo
(or NCCL) process group on 127.0.0.1; what ``fn`` returns comes back to the
parent (serialised with ``torch.save``, so tensors are fine).  Nothing is left
behind: the parent always reaps its children, kills the ones still running
after ``timeout_s`` and reports which rank failed how.

A failure ends the run early: once one rank has raised or died, the others get
``failure_grace_s`` seconds to report (a pipeline tells its peers when its
step fails, so they usually end with their own message at once), then the
ones still running are killed and reported as stopped because of that rank.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

__all__ = ["free_port", "spawn", "spawn_outcomes", "RankOutcome", "RanksFailed"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankOutcome:
    """What one rank did: ``value`` if it returned, ``error`` (a formatted traceback) if it raised."""

    rank: int
    ok: bool
    value: Any = None
    error: str | None = None
    exitcode: int | None = None


class RanksFailed(RuntimeError):
    """One or more ranks raised, died or timed out. ``outcomes`` holds every rank's outcome."""

    def __init__(self, outcomes: list[RankOutcome]) -> None:
        self.outcomes = outcomes
        bad = [o for o in outcomes if not o.ok]
        lines = [f"{len(bad)} of {len(outcomes)} ranks failed:"]
        for o in bad:
            last = (o.error or "").strip().splitlines()[-1:] or ["?"]
            lines.append(f"  rank {o.rank} (exit code {o.exitcode}): {last[0]}")
        super().__init__("\n".join(lines))


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    pg_timeout_s: float,
    threads: int,
    env: dict[str, str],
    args: tuple[Any, ...],
    results: mp.Queue[tuple[int, bool, bytes | str]],
) -> None:
    os.environ.update(env)
    forked = start_method() == "forkserver"  # (the caller's environment, handed over in env)
    torch.set_num_threads(threads)
    import torch.distributed as dist

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        value = fn(rank, world_size, *args)
        results.put((rank, True, _dumps(value)))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        results.put((rank, False, f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a dead peer must not turn into a hang here
                pass
        if forked:
            # A forked rank leaves by os._exit, past the interpreter's exit: run the exit hooks here, as a spawned
            # rank's interpreter would (a pipeline left open tells its peers it closed, rather than vanishing)
            atexit._run_exitfuncs()


#: what the fork server imports once, so that a rank forked from it starts without importing torch again
_PRELOAD = ["torch", "torch.distributed"]


def start_method() -> str:
    """How rank processes start: ``DPK_START_METHOD``, ``"spawn"`` (the default) or ``"forkserver"``.

    ``spawn``: a fresh interpreter per rank (~2 s of CPU each, importing torch).  ``forkserver``: ranks are
    forked from one server process that imported torch once (~0.1 s a rank); the environment a rank sees is
    this process's at the call (handed over), but variables torch reads at import are the server's.
    """
    method = os.environ.get("DPK_START_METHOD", "spawn")
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"DPK_START_METHOD must be 'spawn' or 'forkserver', got {method!r}")
    return method



def spawn_outcomes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    pg_timeout_s: float = 120.0,
    threads: int = 1,
    env: dict[str, str] | None = None,
    failure_grace_s: float = 10.0,
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return every rank's outcome.

    ``fn`` must be importable by name (a module-level function). ``timeout_s``
    bounds the whole run: ranks still alive then are killed and reported as
    timed out.  After the first rank fails (raises, or exits without a result)
    the others have ``failure_grace_s`` more seconds; those still running then
    are killed and reported as stopped after that rank's failure.  Never raises
    for a rank's failure; see :func:`spawn`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not failure_grace_s >= 0:
        raise ValueError(f"failure_grace_s must be >= 0 seconds, got {failure_grace_s!r}")
    method = start_method()
    ctx: Any = mp.get_context(method)  # (typed by its method only for a literal)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
        # the fork server's environment is the one it started with: hand this process's environment over
        env = {**os.environ, **(env or {})}
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world_size, port, backend, pg_timeout_s, threads, dict(env or {}), args, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    got: dict[int, tuple[bool, bytes | str]] = {}
    deadline = time.monotonic() + timeout_s
    first_failure: int | None = None  # the rank that failed first (stops the run after failure_grace_s)
    exited_at: dict[int, float] = {}  # when a rank was first seen exited without a result
    stopped_at: float | None = None
    killed: set[int] = set()
    try:
        for p in procs:
            p.start()
        # Drain results while waiting: a child blocks on exit until its queue data is consumed.
        while len(got) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, payload = results.get(timeout=0.05)
                got[rank] = (ok, payload)
                if not ok and first_failure is None:
                    first_failure, stopped_at = rank, time.monotonic() + failure_grace_s
                continue
            except queue.Empty:
                pass
            now = time.monotonic()
            for r, p in enumerate(procs):
                # A rank that exited without a result died (its result, if any, arrives within a moment).
                if r not in got and not p.is_alive() and exited_at.setdefault(r, now) < now - 1.0:
                    if first_failure is None:
                        first_failure, stopped_at = r, now + failure_grace_s
            if stopped_at is not None and now >= stopped_at:
                break  # the others had their grace period after the first failure: stop them
            if all(not p.is_alive() for p in procs):
                # Everyone has exited; collect what is still in flight, then stop.
                try:
                    while True:
                        rank, ok, payload = results.get(timeout=0.2)
                        got[rank] = (ok, payload)
                except queue.Empty:
                    break
    finally:
        for p in procs:
            if p.pid is None:  # p.start() raised for it or an earlier rank: nothing to join, the error propagates
                continue
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())) if len(got) == world_size else 0.5)
        for r, p in enumerate(procs):
            if p.is_alive():
                killed.add(r)
                p.kill()
                p.join(timeout=5.0)
        results.close()
        results.join_thread()

    outcomes: list[RankOutcome] = []
    for r, p in enumerate(procs):
        if r in got:
            ok, payload = got[r]
            if ok:
                outcomes.append(RankOutcome(r, True, value=_loads(payload), exitcode=p.exitcode))  # type: ignore[arg-type]
            else:
                outcomes.append(RankOutcome(r, False, error=str(payload), exitcode=p.exitcode))
        elif r in killed and first_failure is not None:
            outcomes.append(
                RankOutcome(
                    r,
                    False,
                    error=f"rank {r} was stopped {failure_grace_s:.3g} s after rank {first_failure} failed",
                    exitcode=p.exitcode,
                )
            )
        elif time.monotonic() >= deadline:
            outcomes.append(
                RankOutcome(
                    r, False, error=f"rank {r} timed out after {timeout_s:.0f} s and was killed", exitcode=p.exitcode
                )
            )
        else:
            outcomes.append(
                RankOutcome(r, False, error=f"rank {r} died with exit code {p.exitcode}", exitcode=p.exitcode)
            )
    return outcomes


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Like :func:`spawn_outcomes` but return the per-rank values, raising RanksFailed if any rank failed."""
    outcomes = spawn_outcomes(fn, world_size, *args, **kwargs)
    if not all(o.ok for o in outcomes):
        raise RanksFailed(outcomes)
    return [o.value for o in outcomes]
