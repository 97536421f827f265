"""The boundary wing (runtime/boundary/) imports without cycles, lazy imports included, and never reaches up
into the rest of the runtime (it is what the runtime's layers build on)."""

from __future__ import annotations

import ast
from pathlib import Path

import dualpipe_kernels.runtime.boundary as boundary

PACKAGE = "dualpipe_kernels.runtime.boundary"


def _imports() -> dict[str, set[str]]:
    """module -> every module of the package or of the runtime it imports, anywhere in its source."""
    out: dict[str, set[str]] = {}
    for path in Path(boundary.__file__).parent.glob("*.py"):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dualpipe_kernels.runtime"):
                if node.module == PACKAGE:
                    deps |= {f"{PACKAGE}.{a.name}" for a in node.names}
                else:
                    deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("dualpipe_kernels.runtime")}
        out[f"{PACKAGE}.{path.stem}"] = deps
    return out


def test_the_boundary_wing_imports_no_module_above_it() -> None:
    upward = {m: sorted(d for d in deps if not d.startswith(PACKAGE)) for m, deps in _imports().items()}
    assert {m: d for m, d in upward.items() if d} == {}


def test_the_boundary_wing_has_no_import_cycle() -> None:
    graph = _imports()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []
    assert f"{PACKAGE}.layout_memory" in graph  # layout memory in its own module
