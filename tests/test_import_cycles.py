"""No import circle between the package's modules.

Every ``import`` statement of every module of ``nw_adapter/`` counts, also the lazy imports inside
functions (a circle through a lazy import is still a design circle: two modules that need each
other). An edge goes from a module to the module it names: ``from a.b import c`` names the module
``a.b.c`` when that is a module, else ``a.b``; relative imports are resolved. Edges to a package's
``__init__`` come only from naming the package itself (importing ``a.b.c`` also runs
``a/b/__init__.py``, which Python resolves without a circle as long as the modules themselves form
none).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nw_adapter"


def _module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under ``root`` (a package folder)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imported(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package modules that module ``name`` (file ``path``) imports anywhere in its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in modules:
                    found.add(target)
                elif source in modules:
                    found.add(source)
    found.discard(name)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports (:func:`_imported`), for every module under ``root``."""
    modules = _module_names(root)
    return {name: _imported(path, name, modules) for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_package_has_no_import_circle():
    graph = import_graph(PACKAGE)
    assert len(graph) > 50 and graph["nw_adapter.correlate.loading"]  # the parser sees the package
    assert import_cycles(graph) == []


def test_a_circle_through_a_lazy_relative_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .c import g\n")
    (pkg / "sub" / "c.py").write_text("def g():\n    from .. import a\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]


def test_the_families_loading_circle_would_be_found(tmp_path):
    """The circle this test was written for (issue 18): loading and families importing each other."""
    pkg = tmp_path / "app"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "loading.py").write_text("def resolve():\n    from app import families\n")
    (pkg / "families.py").write_text("def flow():\n    from app.loading import ModelLoadError\n")
    assert import_cycles(import_graph(pkg)) == [["app.families", "app.loading"]]
