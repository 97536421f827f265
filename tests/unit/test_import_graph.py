"""The import graphs of ``dualpipe_kernels.runtime`` and ``dualpipe_kernels.benchmarks``: no cycles, and every
import points down a declared order of layers; and the whole package's graph: no cycle anywhere.

Every ``import`` / ``from ... import`` is read with ``ast``: at module level, inside functions and under
``if TYPE_CHECKING`` alike (a lazy import is still a dependency).  ``from pkg import name`` counts as an import
of ``pkg.name`` when that is a module of the package, else of ``pkg``.  A module may import only modules
listed before it in its package's order (the layers below, bottom first); a module missing from the order
fails the test until it is given a place.  Also checked: neither package imports the layers of the library
above it (the CLI, commands, compat), and no script in bench/ reaches into a private ``_name`` of the package.

Pure source reading: nothing is imported, so this runs in well under a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dualpipe_kernels"
BENCH_SCRIPTS = PACKAGE.parent / "bench"

#: runtime/, bottom first: each module may import only modules listed before it.
RUNTIME_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # leaves: they import no other module of runtime/
    (
        "foundations",
        (
            "checks",
            "peer_watch",
            "model_options",
            "stage_io",
            "construction",
            "groups",
            "launch",
            "microbatch",
            "timeline",
            "memory_plan",
            "memory_store",
            "zero_bubble",
            "graph_options",
            "graph_plan",
            "graph_capture",
            "loss",
        ),
    ),  # fmt: skip
    # the message path (see _BOUNDARY_ORDER)
    ("boundary wing", ()),
    # the configuration, checked (uses the boundary format and the memory policies)
    ("options", ("options",)),
    # what construction and the step are built of
    (
        "subsystems",
        (
            "fingerprint",
            "stages",
            "memory_records",
            "memory",
            "reference",
            "mirror",
            "compute",
            "data_parallel",
            "tied",
            "reductions",
            "builders",
            "checkpoint",
            "graphs",
        ),
    ),  # fmt: skip
    ("step", ("loop", "result")),
    # the Pipeline: its conveniences mixin, its step mixin, then the class
    ("pipeline", ("conveniences", "step", "executor")),
    # the public face: runtime/__init__.py
    ("package", ("",)),
)

#: runtime/boundary/, bottom first (the package's own __init__ first: it holds no code).
_BOUNDARY_ORDER = ("boundary", "boundary.pool", "boundary.header", "boundary.codec", "boundary.inline",
                   "boundary.layout_memory", "boundary.repeat", "boundary.transfer", "boundary.exchange")  # fmt: skip

#: Boundary-internal imports that point up _BOUNDARY_ORDER, tolerated while a rearrangement is under way
#: (empty now: the wing has no upward import and no cycle).  Nothing outside runtime/boundary/ may be added.
_PENDING_BOUNDARY_EDGES: frozenset[tuple[str, str]] = frozenset()

#: benchmarks/, bottom first.  A suite imports its report and its helpers, never the reverse.
BENCHMARKS_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("package", ("",)),  # benchmarks/__init__.py holds no code
    # leaves: shared helpers that import no other benchmark module
    ("foundations", ("common", "metrics", "payload", "sleep_stages", "in_situ_costs")),
    # helpers of several suites
    ("helpers", ("compute_floor", "peers", "moe_block", "sleep_runs", "moe_ranks", "cuda_ipc_bare")),
    # reports and row fields of one suite, and overhead's baseline tree runs (they import no suite)
    # (overhead_bound: the bound rows, and the floor's work they time)
    (
        "reports",
        (
            "overhead_report",
            "overhead_bound",
            "overhead_baseline",
            "schedules_report",
            "schedules_short",
            "cuda_ipc_report",
        ),
    ),
    # the suites (memory_gpu extends memory)
    (
        "suites",
        (
            "cuda_ipc",
            "engine",
            "kernels",
            "transport",
            "memory",
            "memory_gpu",
            "moe",
            "overhead",
            "overlap",
            "schedules",
            "wire_check",
            "graphs",
        ),
    ),  # fmt: skip
)

#: library layers above both packages: neither may import them
_ABOVE = ("dualpipe_kernels.cli", "dualpipe_kernels.commands", "dualpipe_kernels.compat", "dualpipe_kernels.__main__")


def _order(layers: tuple[tuple[str, tuple[str, ...]], ...], boundary: tuple[str, ...] = ()) -> list[str]:
    out: list[str] = []
    for name, modules in layers:
        out += boundary if name == "boundary wing" else modules
    return out


#: import cycles of the whole package known while another branch removes them (the lead empties it on merge)
_KNOWN_CYCLES: tuple[tuple[str, ...], ...] = ()


def _modules(package: str) -> dict[str, Path]:
    """``{name relative to the package ("" for its __init__): path}`` of every module under ``package``
    (``""``: the whole of ``dualpipe_kernels``)."""
    root = PACKAGE / package if package else PACKAGE
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, qualified: str, is_package: bool) -> list[tuple[tuple[str, ...], int]]:
    """Every import in ``path``, anywhere in the file, as ``(candidates, line)``: the absolute module name it
    names, and for ``from base import name`` first ``base.name`` (when that is a module) then ``base``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[tuple[str, ...], int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [((a.name,), node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = qualified.split(".") if is_package else qualified.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            found += [((f"{base}.{a.name}", base), node.lineno) for a in node.names]
    return found


def _graph(package: str) -> dict[str, dict[str, int]]:
    """``{module: {imported module of the same package: first line}}`` (names relative to the package)."""
    modules = _modules(package)
    prefix = f"dualpipe_kernels.{package}" if package else "dualpipe_kernels"
    qualified = {(f"{prefix}.{m}" if m else prefix): m for m in modules}
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        me = f"{prefix}.{name}" if name else prefix
        for candidates, line in _imports(path, me, path.name == "__init__.py"):
            target = next((c for c in candidates if c in qualified), None)
            if target is not None and qualified[target] != name:
                edges.setdefault(qualified[target], line)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _without(graph: dict[str, dict[str, int]], edges: frozenset[tuple[str, str]]) -> dict[str, dict[str, int]]:
    return {m: {t: n for t, n in e.items() if (m, t) not in edges} for m, e in graph.items()}


def _check_layers(package: str, order: list[str], tolerated: frozenset[tuple[str, str]] = frozenset()) -> None:
    graph = _graph(package)
    pos = {m: i for i, m in enumerate(order)}
    assert len(pos) == len(order), f"{package}: a module is listed twice in the declared order"
    missing = sorted(set(graph) - set(pos))
    assert not missing, f"{package}: module(s) {missing} have no place in the declared layers: add them"
    stale = sorted(set(pos) - set(graph))
    assert not stale, f"{package}: the declared layers list module(s) {stale} that do not exist"
    upward = [
        f"{package}/{m or '__init__'} (line {line}) imports {t or '__init__'}, declared above it"
        for m, edges in sorted(graph.items())
        for t, line in sorted(edges.items())
        if pos[t] >= pos[m] and (m, t) not in tolerated
    ]
    assert not upward, "imports pointing up the declared layers:\n" + "\n".join(upward)
    cycles = _cycles(_without(graph, tolerated))
    assert not cycles, f"{package}: import cycles {cycles}"


def test_the_graph_is_read_as_written():
    """Spot checks of the reader on today's code: module-level, lazy and TYPE_CHECKING imports all count."""
    runtime = _graph("runtime")
    assert {"boundary.exchange", "options", "result", "step"} <= set(runtime["executor"])
    assert "conveniences" in runtime["step"]
    assert "checkpoint" in runtime["conveniences"]  # lazy: inside model_state_dict
    assert "executor" in runtime[""] and "executor" not in runtime["options"]
    assert "boundary.header" in runtime["boundary.layout_memory"] and runtime["boundary.header"].keys() <= set()
    assert "schedules_short" in _graph("benchmarks")["schedules"]  # lazy: inside short_chunk_rows


def test_runtime_imports_point_down_its_layers():
    _check_layers("runtime", _order(RUNTIME_LAYERS, _BOUNDARY_ORDER), _PENDING_BOUNDARY_EDGES)


def test_the_pending_boundary_edges_are_boundary_internal_and_still_there():
    graph = _graph("runtime")
    for src, dst in sorted(_PENDING_BOUNDARY_EDGES):
        assert src.startswith("boundary.") and dst.startswith("boundary."), (src, dst)
        assert dst in graph.get(src, {}), f"{src} no longer imports {dst}: remove it from _PENDING_BOUNDARY_EDGES"


def test_benchmarks_imports_point_down_their_layers():
    _check_layers("benchmarks", _order(BENCHMARKS_LAYERS))


def test_outside_runtime_the_graph_has_no_cycles_even_counting_pending_edges_in_boundary_only():
    """Every cycle of runtime/ as it is today lies inside runtime/boundary/."""
    for cycle in _cycles(_graph("runtime")):
        assert all(m.startswith("boundary.") for m in cycle), f"a cycle outside runtime/boundary/: {cycle}"


def test_the_whole_package_has_no_import_cycle():
    """Every module of dualpipe_kernels/, every subpackage together: no two modules import each other, directly
    or through others (a lazy import counts: it still ties the two modules' jobs together)."""
    graph = _graph("")
    assert {"commands.demo", "planner.plan", "runtime.executor"} <= set(graph)  # the reader saw the subpackages
    assert "schedules.ir" in graph["schedules.dualpipe"]
    cycles = [c for c in _cycles(graph) if tuple(c) not in _KNOWN_CYCLES]
    assert not cycles, f"import cycles in dualpipe_kernels: {cycles}"


def test_the_cycle_finder_finds_a_cycle_through_three_modules():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
    assert _cycles(graph) == [["a", "b", "c"]] and _cycles(_without(graph, frozenset({("c", "a")}))) == []


@pytest.mark.parametrize("package", ["runtime", "benchmarks"])
def test_no_import_of_the_layers_above(package):
    bad = []
    for name, path in _modules(package).items():
        qualified = f"dualpipe_kernels.{package}.{name}" if name else f"dualpipe_kernels.{package}"
        for candidates, line in _imports(path, qualified, path.name == "__init__.py"):
            target = candidates[-1]  # the module itself, or the base of a from-import
            if any(target == a or target.startswith(a + ".") for a in _ABOVE):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def test_bench_scripts_use_no_private_names_of_the_package():
    """bench/*.py use the package's public names only: no ``from dualpipe_kernels... import _x``, no
    ``obj._x`` on anything but the script's own ``self`` / ``cls``."""
    bad = []
    for path in sorted(BENCH_SCRIPTS.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dualpipe_kernels"):
                mod_private = any(p.startswith("_") for p in (node.module or "").split("."))
                names = [a.name for a in node.names if a.name.startswith("_")]
                if mod_private or names:
                    bad.append(f"{path.name}:{node.lineno} imports {node.module} {names}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("dualpipe_kernels") and any(p.startswith("_") for p in a.name.split(".")):
                        bad.append(f"{path.name}:{node.lineno} imports {a.name}")
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    bad.append(f"{path.name}:{node.lineno} reads .{node.attr}")
    assert not bad, "bench scripts reaching into private names:\n" + "\n".join(bad)


def test_the_graph_reader_sees_lazy_and_type_checking_imports(tmp_path):
    """The reader itself: an import inside a function and one under TYPE_CHECKING are edges too."""
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from dualpipe_kernels.runtime.executor import Pipeline\n"
        "def f():\n    from . import loop\n    import dualpipe_kernels.runtime.options\n"
    )
    got = {c for cands, _ in _imports(src, "dualpipe_kernels.runtime.m", False) for c in cands}
    want = {"dualpipe_kernels.runtime.executor", "dualpipe_kernels.runtime.loop", "dualpipe_kernels.runtime.options"}
    assert want <= got
