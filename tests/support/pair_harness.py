"""Run named scenarios on a pair of spawned processes, with every wait bounded.

Made for the GPU tests, where one hang must not eat the whole test step:

- each rank reports every scenario's outcome to the parent as soon as it has
  it, on its own pipe with a synchronous write (not a ``multiprocessing.Queue``,
  whose feeder thread dies unflushed with a crashing process), so whatever ran
  before a hang or a crash is kept;
- the parent waits for each scenario at most ``scenario_timeout_s``; a
  scenario without an outcome by then is reported as stuck (one whose rank
  died is reported at once, with the exit code), the pair is
  killed, and a fresh pair (fresh channels, nothing left queued from the
  stuck scenario) runs the remaining scenarios, at most ``max_restarts`` times;
- a pair that fails to set up is not retried, and the caller caches the
  result (every test of that set-up reads the same failure);
- the parent itself only ever waits on the pipes with a timeout, so pytest's
  per-test timeout can always interrupt it and the JUnit XML gets written.

``prepare(rank, setup)`` runs once per process and returns a context (e.g. a
holder for the transport the scenarios share); ``runner(ctx, rank, store,
setup, name)`` runs scenario ``name`` on one rank and raises on failure.  Both
must be module-level functions (they are pickled by name into spawned processes).
With ``FAULT_ENV=1`` in the environment, rank 1 runs the scenario
``FAULT_SCENARIO`` ahead of the first scenario of the first pair: the
runner's model of a wait that never fires.  With ``STACKS_ENV=<seconds>``, a
rank still inside one scenario after that long writes every Python thread's
stack to stderr, and (with ``DUALPIPE_KERNELS_NATIVE_TRACEBACK=1``) every
thread's native stack: what a stuck scenario is blocked in.
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import platform
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

FAULT_ENV = "DPK_FAULT_IPC_WAIT"
FAULT_SCENARIO = "__wait_that_never_fires__"
STACKS_ENV = "DPK_STUCK_STACKS_S"
#: store barriers between scenarios (seconds)
BARRIER_S = 20.0

Runner = Callable[[Any, int, Any, str, str], None]
Prepare = Callable[[int, str], Any]


@dataclass
class PairRun:
    """``results[scenario][rank]``: "ok", a traceback, or why it has no outcome."""

    results: dict[str, dict[int, str]] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)
    restarts: int = 0
    elapsed_s: float = 0.0


def barrier(store: Any, name: str, timeout_s: float = BARRIER_S) -> None:
    if store.add(f"barrier/{name}", 1) == 2:
        store.set(f"barrier/{name}/done", "1")
    store.wait([f"barrier/{name}/done"], timedelta(seconds=timeout_s))


def _child(
    rank: int, runner: Runner, prepare: Prepare, store_path: str, setup: str, names: list[str], first: bool, out: Any
) -> None:
    """``out``: this rank's write end; ``out.send`` has written the outcome into the pipe when it returns."""
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, 2)
        ctx = prepare(rank, setup)
    except Exception:  # noqa: BLE001 - reported to the parent
        out.send((rank, "setup", traceback.format_exc()))
        return
    out.send((rank, "setup", "ok"))
    for i, name in enumerate(names):
        try:
            barrier(store, name)
            if first and i == 0 and rank == 1 and os.environ.get(FAULT_ENV) == "1":
                runner(ctx, rank, store, setup, FAULT_SCENARIO)
            watchdog = None
            if float(os.environ.get(STACKS_ENV, "0") or 0) > 0:
                watchdog = threading.Timer(float(os.environ[STACKS_ENV]), _dump_stacks, (rank, name))
                watchdog.daemon = True
                watchdog.start()
            try:
                runner(ctx, rank, store, setup, name)
            finally:
                if watchdog is not None:
                    watchdog.cancel()
            result = "ok"
        except Exception:  # noqa: BLE001 - reported to the parent
            result = traceback.format_exc()
        out.send((rank, name, result))


def _dump_stacks(rank: int, name: str) -> None:
    """Every Python thread's stack, then (SIGUSR2, handled by the extension's native traceback) every thread's
    native stack, to stderr."""
    print(f"rank {rank}: scenario {name} still running after {os.environ[STACKS_ENV]} s; stacks:", file=sys.stderr)
    sys.stderr.flush()
    faulthandler.dump_traceback(all_threads=True)
    if os.environ.get("DUALPIPE_KERNELS_NATIVE_TRACEBACK", "0") in ("", "0") or platform.machine() != "x86_64":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
        libc.syscall(234, os.getpid(), tid, int(signal.SIGUSR2))  # tgkill(2) on x86_64: one thread's signal
        time.sleep(0.05)  # one stack at a time on stderr


def _stop(procs: Sequence[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


def _collect(
    readers: list[Any],
    want: set[tuple[int, str]],
    got: dict[str, dict[int, str]],
    deadline: float,
    procs: Sequence[Any],
) -> bool:
    """Read outcomes until every (rank, name) of ``want`` arrived (True), or ``deadline`` passed or a rank that
    still owes one died (False; see :func:`_dead`).  ``readers``: the ranks' open read ends (a closed one, whose
    rank exited, is dropped from the list)."""
    while want:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ready = mpc.wait(readers, timeout=min(left, 0.25)) if readers else []
        for conn in ready:
            assert isinstance(conn, mpc.Connection)
            try:
                rank, name, result = conn.recv()
            except EOFError:  # that rank exited; everything it sent before was read first
                readers.remove(conn)
                continue
            got.setdefault(name, {})[rank] = result
            want.discard((rank, name))
        if not ready and _dead(procs, want) and not any(conn.poll() for conn in readers):
            return False
    return not want


def _dead(procs: Sequence[Any], want: set[tuple[int, str]]) -> dict[int, int | None]:
    """The ranks that owe an outcome of ``want`` and whose process has exited (rank -> exit code)."""
    return {r: procs[r].exitcode for r, _ in want if not procs[r].is_alive()}


def run_pair(
    runner: Runner,
    prepare: Prepare,
    setup: str,
    names: Sequence[str],
    tmp_dir: Path,
    *,
    setup_timeout_s: float,
    scenario_timeout_s: float,
    budget_s: float,
    max_restarts: int = 2,
    reporting: Sequence[int] = (0, 1),
) -> PairRun:
    """Run ``names`` in order on ranks 0 and 1 (see the module docstring); ``reporting``: ranks expected to report.

    The whole call takes at most about ``budget_s`` (no restart that could not finish in it).
    """
    run = PairRun(results={n: {} for n in ["setup", *names]})
    t0 = time.monotonic()
    end = t0 + budget_s
    todo = list(names)
    ctx = mp.get_context("spawn")
    while todo:
        pipes = [ctx.Pipe(duplex=False) for _ in range(2)]  # (read end, write end) per rank
        store_path = str(tmp_dir / f"store-{setup}-{run.restarts}")
        args = (runner, prepare, store_path, setup, todo, run.restarts == 0)
        procs = [ctx.Process(target=_child, args=(r, *args, pipes[r][1]), daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        for _, w in pipes:
            w.close()  # the children hold the write ends: a read end sees EOF once its rank exited
        readers = [r for r, _ in pipes]
        run.pids += [p.pid for p in procs if p.pid is not None]
        stuck = None
        try:
            want = {(r, "setup") for r in (0, 1)}
            ok = _collect(readers, want, run.results, min(end, time.monotonic() + setup_timeout_s), procs)
            if not ok or any(v != "ok" for v in run.results["setup"].values()):
                dead = _dead(procs, want)
                for r in (0, 1):
                    why = f"no set-up outcome within {setup_timeout_s:.0f} s"
                    if r in dead:
                        why = f"rank died with exit code {dead[r]} during set-up (a crash: see its stderr)"
                    run.results["setup"].setdefault(r, why)
                break
            for name in todo:
                want = {(r, name) for r in reporting}
                if not _collect(readers, want, run.results, min(end, time.monotonic() + scenario_timeout_s), procs):
                    stuck = name
                    dead = _dead(procs, want)
                    for r in reporting:
                        why = f"no outcome within {scenario_timeout_s:.0f} s (stuck: a wait that never fires?)"
                        if r in dead:
                            why = f"rank died with exit code {dead[r]} during this scenario (a crash: see its stderr)"
                        elif dead:
                            why = f"no outcome: rank {min(dead)} died during this scenario"
                        run.results[name].setdefault(r, why)
                    break
        finally:
            _stop(procs)
            for reader, _ in pipes:
                reader.close()
        if stuck is None or run.restarts >= max_restarts or time.monotonic() + setup_timeout_s > end:
            break
        run.restarts += 1
        todo = todo[todo.index(stuck) + 1 :]
    for name in names:
        for r in reporting:
            run.results[name].setdefault(r, "not run (the pair was stopped earlier)")
    run.elapsed_s = time.monotonic() - t0
    return run
