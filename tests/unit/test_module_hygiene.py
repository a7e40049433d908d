"""No module of `src` imports another's private name (a leading underscore: that module's own
business), and the modules' top-level imports form no circle (each idea stands on those below
it; a circle makes two modules one idea in two files)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _module_names(src: Path) -> dict[str, Path]:
    names: dict[str, Path] = {}
    for path in src.rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (a relative one resolved from `module`)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    kept = package[: len(package) - node.level + 1]
    return ".".join(kept + ([node.module] if node.module else []))


def private_imports(src: Path) -> list[str]:
    """Every `from M import _name` in `src`, as 'module: M._name'."""
    found = []
    for module, path in _module_names(src).items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                found += [f"{module}: {_base(module, path, node)}.{alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def import_graph(src: Path) -> dict[str, set[str]]:
    """Each module's top-level imports of other modules of `src` (those Python runs at import;
    an import inside a function or under `if TYPE_CHECKING` is no edge)."""
    modules = _module_names(src)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {module: set() for module in modules}
    for module, path in modules.items():
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, ast.Import):
                targets = [resolve(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _base(module, path, node)
                targets = [resolve(f"{base}.{alias.name}") for alias in node.names]
            else:
                continue
            graph[module].update(t for t in targets if t is not None and t != module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_private_name_is_imported_across_modules() -> None:
    assert private_imports(SRC) == []


def test_no_import_circle() -> None:
    assert circles(import_graph(SRC)) == []


def test_the_checks_see_a_private_import_and_a_circle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import _hidden\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nfrom . import a\n"
                                  "if TYPE_CHECKING:\n    from pkg import c\n_hidden = 1\n")
    (package / "c.py").write_text("def late() -> None:\n    from pkg import a\n")
    assert private_imports(tmp_path) == ["pkg.a: pkg.b._hidden"]
    assert circles(import_graph(tmp_path)) == [["pkg.a", "pkg.b"]]
