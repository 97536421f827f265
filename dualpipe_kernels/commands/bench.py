"""``dualpipe-kernels bench``: run benchmark suites, write stamped JSON + Markdown + PNG results.

Each suite is one module ``dualpipe_kernels.benchmarks.<name>`` exposing
``NAME``, ``add_arguments(parser)``, ``run(args) -> dict`` (JSON-ready, with a
``"rows"`` list) and ``to_markdown(result) -> str``; optionally
``write_plots(result, out_dir) -> list[path]``.  Adding a suite is adding its
module name to :data:`SUITES`.  A suite whose module cannot be imported is still
listed; running it gives a one-line error naming the import failure.

Common options (every suite and ``all``): ``--json`` (print the result object on
stdout; progress goes to stderr), ``--out DIR`` (default ``bench/results``),
``--quick`` (small sizes, for tests and smoke runs), ``--no-plots``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from dualpipe_kernels.benchmarks.common import DEFAULT_OUT_DIR, plot_bandwidth, write_results

#: Registered suites, in the order ``bench all`` runs them.
SUITES = ("schedules", "overlap", "transport")

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


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    p.add_argument("--out", default=DEFAULT_OUT_DIR, metavar="DIR", help=f"results folder (default {DEFAULT_OUT_DIR})")
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (tests, smoke runs)")
    p.add_argument("--no-plots", dest="no_plots", action="store_true", help="skip the PNG plots")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="run benchmark suites (schedules, overlap, transport, all)",
        description="Run benchmark suites; results go to --out as JSON, Markdown and PNG, stamped with "
        "machine, versions and git revision.",
    )
    sub = p.add_subparsers(
        dest="suite", required=True, metavar="{" + ",".join((*SUITES, "all")) + "}", parser_class=type(p)
    )
    for name in SUITES:
        mod, err = _import_suite(name)
        doc = (mod.__doc__ or "").strip().splitlines()[0] if mod is not None and mod.__doc__ else ""
        sp = sub.add_parser(name, help=doc if mod is not None else f"(unavailable: {err})", conflict_handler="resolve")
        _add_common(sp)
        if mod is not None:
            mod.add_arguments(sp)
        sp.set_defaults(func=run, suite_error=err)
    sa = sub.add_parser("all", help="run every suite in turn")
    _add_common(sa)
    sa.set_defaults(func=run, suite_error=None)


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
    sys.stderr.write(f"bench {name}: wrote {', '.join(result['files'])}\n")
    return result


def run(args: argparse.Namespace) -> int:
    if args.suite != "all":
        if args.suite_error:
            sys.stderr.write(
                f"dualpipe-kernels bench: error: suite {args.suite!r} is unavailable: {args.suite_error}\n"
            )
            return 1
        mod, _ = _import_suite(args.suite)
        assert mod is not None
        result = _run_one(args.suite, mod, args)
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
