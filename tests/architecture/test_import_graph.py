"""No import cycles in det_local, counting imports inside functions and under TYPE_CHECKING
too (issue 12, item 6; issue 26: a type-only circle is a circle of the design all the same)."""

from __future__ import annotations

import ast
from pathlib import Path

import det_local

ROOT = Path(det_local.__file__).resolve().parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """Every det_local module `path` imports, at any depth (functions and TYPE_CHECKING blocks
    included: a Protocol in the lower module breaks a circle, a type-only import does not)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(_known(alias.name, modules))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in modules else _known(base, modules))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in out if m and m != name}


def _known(name: str, modules: set[str]) -> str:
    """The det_local module a dotted name is (or is in); "" for anything else."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return ""


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, name, modules) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def test_cycle_finder_finds_a_function_local_cycle(tmp_path: Path) -> None:
    """The checker itself: a cycle made only by an import inside a function is found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from det_local.sched import engine\n")
    mods = {"det_local.sched.engine", "det_local.sched", "x.m"}
    assert _imports(src, "x.m", mods) == {"det_local.sched.engine"}


def test_sched_imports_nothing_above_it() -> None:
    graph = import_graph()
    upward = {
        (m, i)
        for m, deps in graph.items()
        if m.startswith("det_local.sched")
        for i in deps
        if _within(i, ("det_local.api", "det_local.cli", "det_local.client", "det_local.web"))
    }
    assert not upward, upward


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_no_import_cycles_in_the_daemon() -> None:
    """sched/, store/, search/, wire/rpc.py and the rest of the daemon's side: no cycle at all."""
    daemon = [
        c for c in cycles(import_graph()) if not all(m.startswith("det_local.trial") for m in c)
    ]
    assert daemon == []


def test_no_import_cycles_in_det_local() -> None:
    assert cycles(import_graph()) == []
