"""Shared pieces of the benchmark suites: run stamp, results writer, progress bar, medians.

Every result a suite writes carries a *stamp* (machine, library versions, git
revision, date) so a number read months later can be traced to what made it.
A suite's ``run(args)`` returns a JSON-ready dict with a ``"rows"`` list;
:func:`write_results` adds the stamp and writes ``<out>/<suite>.json`` and
``<out>/<suite>.md``.

No module-level mutable state: the progress bar is an object the caller owns.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "DEFAULT_OUT_DIR",
    "Progress",
    "machine_info",
    "stamp",
    "median",
    "timed_median",
    "pingpong",
    "markdown_table",
    "write_results",
    "fmt",
    "plot_bandwidth",
    "ActivationMeter",
    "option",
    "comma_ints",
    "int_list",
    "allowed_cpus",
    "host_cpus",
]

#: Default results folder, relative to the working directory.
DEFAULT_OUT_DIR = os.path.join("bench", "results")


# ---------------------------------------------------------------- stamp
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_names() -> list[str]:
    try:
        import torch

        if torch.cuda.is_available():
            return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a stamp must never fail the run
        pass
    return []


def machine_info() -> dict[str, Any]:
    """CPU model, logical cores, hostname, OS and GPUs (empty list when none)."""
    return {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "hostname": socket.gethostname(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "gpus": _gpu_names(),
    }


def _git_revision() -> str:
    """``git rev-parse HEAD`` of the package's checkout (``+dirty`` when modified), or ``unknown``."""
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
        return str(getattr(mod, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - absent or broken: report None
        return None


def stamp() -> dict[str, Any]:
    """What made a result: machine, torch/triton/package versions, git revision, UTC date."""
    from dualpipe_kernels import __version__

    return {
        "machine": machine_info(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "dualpipe_kernels": __version__,
        "git_revision": _git_revision(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "argv": sys.argv[1:],
    }


# ---------------------------------------------------------------- options
def option(args: Any, name: str, full: Any, quick: Any) -> Any:
    """A suite option: the value given on the command line, else the full-run or (``--quick``) quick default."""
    v = getattr(args, name, None)
    return v if v is not None else (quick if getattr(args, "quick", False) else full)


def comma_names(text: str | None, known: tuple[str, ...], what: str, suite: str) -> tuple[str, ...]:
    """The names of a comma list among ``known`` (all of them when ``text`` is empty); ValueError naming
    ``suite``, the unknown ``what`` and the choices otherwise."""
    if not text:
        return known
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in names if x not in known]
    if bad or not names:
        raise ValueError(f"{suite} bench: unknown {what} {bad or text!r}; choose from {', '.join(known)}")
    return names


def comma_ints(text: str, minimum: int = 1, what: str = "integers") -> list[int]:
    """argparse type body: comma-separated integers, each ``>= minimum``; the error names the text."""
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
    if not vals or min(vals) < minimum:
        bound = f"positive {what}" if minimum == 1 else f"{what} >= {minimum}"
        raise argparse.ArgumentTypeError(f"expected {bound}, got {text!r}")
    return vals


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers."""
    return comma_ints(text)


# ---------------------------------------------------------------- statistics
def median(xs: Iterable[float]) -> float:
    """Median of a non-empty sequence (ValueError names the constraint when empty)."""
    vals = list(xs)
    if not vals:
        raise ValueError("median needs at least one value")
    return float(statistics.median(vals))


def timed_median(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` calls after ``warmup`` untimed ones."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"timed_median needs repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


# ---------------------------------------------------------------- progress
class Progress:
    """A one-line progress bar on stderr (no dependency): ``[#####.....] 5/10 label``.

    On a terminal the line is redrawn in place; otherwise (CI logs, pipes) one
    line is printed per update so the log stays readable.
    """

    def __init__(self, total: int, title: str = "", stream: TextIO | None = None, width: int = 24) -> None:
        self.total = max(1, int(total))
        self.done = 0
        self.title = title
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._t0 = time.perf_counter()

    def _line(self, label: str) -> str:
        filled = int(self.width * self.done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self._t0
        head = f"{self.title}: " if self.title else ""
        return f"{head}[{bar}] {self.done}/{self.total} {elapsed:6.1f}s {label}"

    def update(self, label: str = "", advance: int = 1) -> None:
        """Advance by ``advance`` steps and show ``label`` (what was just finished or is starting)."""
        self.done = min(self.total, self.done + advance)
        self.note(label)

    def note(self, label: str) -> None:
        """Show ``label`` without advancing."""
        line = self._line(label)
        if self._tty:
            self.stream.write("\r\x1b[2K" + line)
            if self.done >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._tty and self.done < self.total:
            self.stream.write("\n")
            self.stream.flush()


# ---------------------------------------------------------------- output
def pingpong(rank: int, send: Any, recv: Any, out_buf: Any, in_buf: Any, reps: int) -> list[float]:
    """Round-trip times in seconds of ``reps`` ping-pongs between ranks 0 and 1 (rank 0 measures: ``send(out_buf)``
    then ``recv(in_buf)``; rank 1 echoes: ``recv(in_buf)`` then ``send(in_buf)``).  Two warm-up rounds first."""
    times = []
    for i in range(reps + 2):
        if rank == 0:
            t0 = time.perf_counter()
            send(out_buf)
            recv(in_buf)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        else:
            recv(in_buf)
            send(in_buf)
    return times


def fmt(value: Any, digits: int = 4) -> str:
    """Format a table cell: floats to ``digits`` significant figures, None as ``-``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.{digits}g}"
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], headers: Sequence[str] | None = None) -> str:
    """A GitHub Markdown table of ``rows`` restricted to ``columns`` (missing cells shown as ``-``)."""
    heads = list(headers) if headers is not None else list(columns)
    if len(heads) != len(columns):
        raise ValueError(f"markdown_table needs one header per column: {len(heads)} headers, {len(columns)} columns")
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _stamp_markdown(st: dict[str, Any]) -> str:
    m = st.get("machine", {})
    gpus = ", ".join(m.get("gpus") or []) or "none"
    return (
        f"Machine: {m.get('cpu_model')} ({m.get('cpu_cores')} cores), host {m.get('hostname')}, GPUs: {gpus}; "
        f"torch {st.get('torch')}, triton {st.get('triton')}; git {st.get('git_revision')}; {st.get('date_utc')}"
    )


def write_results(suite: str, result: dict[str, Any], markdown: str, out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write ``<out_dir>/<suite>.json`` and ``.md`` (stamped); return the paths written.

    ``result`` gains a ``"stamp"`` key (if it has none) and a ``"suite"`` key, in place,
    so the caller can print the same object it wrote.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result.setdefault("suite", suite)
    result.setdefault("stamp", stamp())
    jpath = out / f"{suite}.json"
    mpath = out / f"{suite}.md"
    jpath.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    text = f"# bench {suite}\n\n{_stamp_markdown(result['stamp'])}\n\n{markdown.strip()}\n"
    mpath.write_text(text, encoding="utf-8")
    return [jpath, mpath]


def plot_bandwidth(result: dict[str, Any], path: str | os.PathLike[str]) -> Path | None:
    """Bandwidth vs message size (log-log) from a ``transport`` suite result; None if it has no rows.

    Plots every ``*_gbps`` column of the rows (``native_gbps``, ``gloo_gbps``, ``memcpy_gbps``).
    """
    rows = [r for r in result.get("rows", []) if r.get("size_bytes")]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k for r in rows for k in r if k.endswith("_gbps")})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in keys:
        pts = [(r["size_bytes"], r[k]) for r in rows if isinstance(r.get(k), (int, float)) and r[k] > 0]
        if pts:
            xs, ys = zip(*sorted(pts), strict=False)
            ax.plot(xs, ys, marker="o", label=k.removesuffix("_gbps"))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bandwidth (GB/s)")
    ax.set_title("point-to-point bandwidth vs message size (memcpy = same-process ceiling)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


# ---------------------------------------------------------------- activation memory
class _Saved:
    """What the pack hook stores instead of a saved tensor: the tensor plus a release-on-free callback."""

    __slots__ = ("tensor", "_key", "_meter")

    def __init__(self, tensor: Any, key: int, meter: ActivationMeter) -> None:
        self.tensor, self._key, self._meter = tensor, key, meter

    def __del__(self) -> None:
        self._meter._release(self._key)


class ActivationMeter:
    """Peak bytes of activations saved for backward (autograd's saved tensors), parameters excluded.

    Use ``with meter.track(): ...`` around the forward passes (the hooks are
    thread-local: they see the autograd graphs built on this thread).  A saved
    tensor counts its whole storage once, however many ops save it, from the
    moment it is saved until autograd frees it (after its backward); the peak
    is the most bytes alive at once since :meth:`reset`.
    """

    def __init__(self, exclude: Iterable[Any] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.current = 0
        self.peak = 0

    def reset(self) -> None:
        """Start a new peak from the bytes alive now."""
        self.peak = self.current

    def _pack(self, t: Any) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._exclude or key == 0:
            return t
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [1, storage.nbytes()]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        # Keep a detached alias of a non-leaf: holding the tensor itself would tie its
        # grad_fn to this hook object in a cycle the garbage collector cannot see.
        return _Saved(t if t.is_leaf else t.detach(), key, self)

    @staticmethod
    def _unpack(obj: Any) -> Any:
        return obj.tensor if isinstance(obj, _Saved) else obj

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            self.current -= entry[1]

    def track(self) -> Any:
        """Context manager installing the saved-tensor hooks on this thread."""
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, sorted: its affinity mask where the platform has one, else all."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def host_cpus() -> int:
    """How many CPUs this process may run on (:func:`allowed_cpus`)."""
    return len(allowed_cpus())


def pin_to_core(rank: int) -> int | None:
    """Bind the calling thread to the ``rank``-th allowed core; the core, or None when there are fewer
    than two cores or than ``rank + 1`` (pinning would pile the ranks up) or the platform cannot.

    On Linux the affinity is per thread: threads started afterwards (a transport's) inherit it,
    threads started before keep theirs.  Why benchmarks pin: with busy processes on few cores, a
    transfer's wake-up of a peer may run the woken process on the waker's core and preempt it.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = allowed_cpus()
    if len(cpus) < 2 or rank >= len(cpus):
        return None
    os.sched_setaffinity(0, {cpus[rank]})  # pid 0: on Linux, this thread only
    return cpus[rank]
