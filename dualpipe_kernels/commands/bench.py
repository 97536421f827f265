"""``dualpipe-kernels bench``: run benchmark suites, write stamped JSON + Markdown + PNG results.

Each suite is one module ``dualpipe_kernels.benchmarks.<name>`` exposing
``NAME``, ``add_arguments(parser)``, ``run(args) -> dict`` (JSON-ready, with a
``"rows"`` list) and ``to_markdown(result) -> str``; optionally
``write_plots(result, out_dir) -> list[path]``.  Adding a suite is adding its
module name to :data:`SUITES`.  Suite modules are imported only when their suite
is parsed or run; one that cannot be imported is still listed, and running it
gives a one-line error naming the import failure.

Common options (every suite and ``all``): ``--json`` (print the result object on
stdout; progress goes to stderr), ``--out DIR`` (default: a fresh folder
``./dualpipe-bench-<suite>-<date>-<time>/`` that the run names on stderr, so a
run never writes over earlier results, the repository's ``bench/results``
included), ``--quick`` (small sizes, for tests and smoke runs), ``--no-plots``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from dualpipe_kernels.benchmarks.common import plot_bandwidth, write_results
from dualpipe_kernels.commands.outputs import check_output_dir

#: Registered suites, in the order ``bench all`` runs them, with their ``bench --help`` line (kept here so
#: listing them imports nothing).  Registering a suite is one line here.
SUITES: dict[str, str] = {
    "schedules": "step time, bubble and hidden comm of each schedule on sleep-timed stages vs the simulator and torch",
    "overlap": "share of communication hidden behind compute, per transport and activation size",
    "transport": "point-to-point bandwidth and latency: native shared memory vs gloo vs a cross-core copy",
    "moe": "DualPipeV F&B overlap with expert all_to_all: ours (hook on/off) vs torch vs the reference, by a2a size",
    "engine": "schedule engine speed: build + validate + simulate DualPipeV 64 ranks x 1024 micro-batches",
    "kernels": "pack/unpack bandwidth (lossless, bf16, fp8) vs a same-size copy and unfused torch cat + cast",
    "cuda_ipc": "CUDA IPC between two processes on one GPU vs a same-GPU copy: GB/s, us per message, overlap",
    "overhead": "runtime cost per compute action on tiny Linear stages: ours (native, gloo) vs torch, cProfile",
    "memory": "peak saved-activation bytes and step time of each memory policy vs the simulator's prediction",
    "memory_gpu": "memory policies on a GPU (2 ranks, real matrix products): offload's step time and memory vs keep",
    "graphs": "per-chunk CUDA graphs on tiny stages: time per compute action with graphs on vs off (CPU: the reason)",
}

_COMMON = ("json", "out", "quick", "no_plots")


def _import_suite(name: str) -> tuple[ModuleType | None, str | None]:
    """(module, None) or (None, a one-line reason it cannot be used)."""
    try:
        mod = importlib.import_module(f"dualpipe_kernels.benchmarks.{name}")
    except Exception as e:  # noqa: BLE001 - any import failure becomes a clear message at run time
        return None, f"{type(e).__name__}: {e}".splitlines()[0]
    missing = [a for a in ("add_arguments", "run", "to_markdown") if not hasattr(mod, a)]
    if missing:
        return None, f"module dualpipe_kernels.benchmarks.{name} lacks {', '.join(missing)}"
    return mod, None


def _unavailable(mod: ModuleType, args: argparse.Namespace | None = None) -> str | None:
    """A suite that needs hardware this machine lacks says why in ``unavailable()`` (it is skipped, not failed).

    A suite whose needs depend on its options (``cuda_ipc --fake-device`` runs without a GPU) takes them as
    ``unavailable(args)``.
    """
    check = getattr(mod, "unavailable", None)
    if check is None:
        return None
    takes_args = bool(inspect.signature(check).parameters)
    return check(args) if takes_args and args is not None else check()


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="results folder (default: a new folder ./dualpipe-bench-SUITE-DATE-TIME/, named on stderr)",
    )
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (tests, smoke runs)")
    p.add_argument("--no-plots", dest="no_plots", action="store_true", help="skip the PNG plots")


def _lazy_parser_class(base: type[argparse.ArgumentParser]) -> type[argparse.ArgumentParser]:
    """A parser class that imports its suite and adds the suite's options only when it is used.

    Building the CLI therefore imports no suite (and no torch): ``dualpipe-kernels simulate`` stays
    fast, and a suite that cannot be imported fails only when someone runs it, with a clear message.
    """

    class _SuiteParser(base):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, suite_name: str | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._suite_name = suite_name
            self._loaded = suite_name is None

        def _load(self) -> None:
            if self._loaded:
                return
            self._loaded = True
            mod, err = _import_suite(self._suite_name or "")
            if mod is not None:
                mod.add_arguments(self)
            self.set_defaults(suite_error=err)

        def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
            self._load()
            return super().parse_known_args(args, namespace)

        def format_help(self) -> str:
            self._load()
            return super().format_help()

    return _SuiteParser


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help=f"run benchmark suites ({', '.join(SUITES)}, all)",
        description="Run benchmark suites; results go to --out as JSON, Markdown and PNG, stamped with "
        "machine, versions and git revision.",
    )
    sub = p.add_subparsers(
        dest="suite",
        required=True,
        metavar="{" + ",".join((*SUITES, "all")) + "}",
        parser_class=_lazy_parser_class(type(p)),
    )
    for name in SUITES:
        sp = sub.add_parser(name, help=SUITES[name], conflict_handler="resolve", suite_name=name)
        _add_common(sp)
        sp.set_defaults(func=run, suite_error=None)
    sa = sub.add_parser("all", help="run every suite in turn")
    _add_common(sa)
    sa.set_defaults(func=run, suite_error=None)


def fresh_out_dir(suite: str, parent: str = "") -> str:
    """Create and return a new folder ``dualpipe-bench-<suite>-<YYYYmmdd-HHMMSS>[-N]`` in ``parent`` (default:
    the working directory), never one that exists: a second run in the same second gets ``-2``, and so on."""
    base = os.path.join(parent, f"dualpipe-bench-{suite}-{time.strftime('%Y%m%d-%H%M%S')}")
    path, n = base, 1
    while True:
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            n += 1
            path = f"{base}-{n}"
        except OSError as exc:
            raise ValueError(f"--out (default) {path}: cannot create it: {exc.strerror or exc}") from None


def _suite_args(mod: ModuleType, common: argparse.Namespace) -> argparse.Namespace:
    """The suite's own defaults, with the common options of ``bench all`` laid over them."""
    p = argparse.ArgumentParser(add_help=False, conflict_handler="resolve")
    _add_common(p)
    mod.add_arguments(p)
    ns = p.parse_args([])
    for k in _COMMON:
        setattr(ns, k, getattr(common, k))
    ns.suite = getattr(mod, "NAME", mod.__name__.rsplit(".", 1)[-1])
    return ns


def _plots(name: str, mod: ModuleType, result: dict[str, Any], out: Path) -> list[Path]:
    if hasattr(mod, "write_plots"):
        return [Path(p) for p in mod.write_plots(result, out)]
    if name == "transport":
        p = plot_bandwidth(result, out / "transport_bandwidth.png")
        return [p] if p is not None else []
    return []


def _run_one(name: str, mod: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    result = mod.run(args)
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise RuntimeError(f"bench suite {name!r} returned no 'rows' list")
    out = Path(args.out)
    files = write_results(name, result, mod.to_markdown(result), out)
    if not args.no_plots:
        try:
            files += _plots(name, mod, result, out)
        except Exception as e:  # noqa: BLE001 - a failed plot must not lose the numbers already written
            sys.stderr.write(f"bench {name}: plot failed: {type(e).__name__}: {e}\n")
    result["files"] = [str(f) for f in files]
    sys.stderr.write(f"bench {name}: done in {time.perf_counter() - t0:.0f} s, wrote {', '.join(result['files'])}\n")
    return result


def run(args: argparse.Namespace) -> int:
    if args.suite != "all" and args.suite_error:
        sys.stderr.write(f"dualpipe-kernels bench: error: suite {args.suite!r} is unavailable: {args.suite_error}\n")
        return 1
    mod: ModuleType | None = None
    if args.suite != "all":
        mod, _ = _import_suite(args.suite)
        assert mod is not None
        skip = _unavailable(mod, args)
        if skip:
            sys.stderr.write(f"dualpipe-kernels bench {args.suite}: skipped: {skip}\n")
            return 0
    if args.out is None:
        args.out = fresh_out_dir(args.suite)
        sys.stderr.write(f"dualpipe-kernels bench {args.suite}: results go to {args.out}/ (--out DIR to choose)\n")
    check_output_dir(args.out, "--out")  # before any suite runs: results are never lost to a bad folder
    if mod is not None:
        from dualpipe_kernels.runtime.launch import RanksFailed

        try:
            result = _run_one(args.suite, mod, args)
        except RanksFailed as e:  # the per-rank errors, without the parent's traceback
            sys.stderr.write(f"dualpipe-kernels bench {args.suite}: failed: {e}\n")
            return 1
        if args.json:
            print(json.dumps(result, default=str))
        else:
            print(mod.to_markdown(result))
        return 0

    results: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for name in SUITES:
        mod, err = _import_suite(name)
        if mod is None:
            failed[name] = f"unavailable: {err}"
            sys.stderr.write(f"bench all: skipping {name}: {failed[name]}\n")
            continue
        skip = _unavailable(mod)
        if skip:
            sys.stderr.write(f"bench all: skipping {name}: {skip}\n")
            continue
        try:
            results[name] = _run_one(name, mod, _suite_args(mod, args))
        except Exception as e:  # noqa: BLE001 - one broken suite must not hide the others' results
            failed[name] = f"{type(e).__name__}: {e}".splitlines()[0]
            sys.stderr.write(f"bench all: {name} failed: {failed[name]}\n")
            continue
        if not args.json:
            print(mod.to_markdown(results[name]) + "\n")
    if args.json:
        print(json.dumps({"suites": results, "failed": failed}, default=str))
    return 1 if failed else 0
