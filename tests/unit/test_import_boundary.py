"""Imports flow adapters -> effects -> statecore, never back; the core performs no I/O."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
FORBIDDEN = {
    "statecore": {"trio", "httpx", "mlx", "mlx_lm", "effects", "adapters", "hypercorn", "starlette"},
    "effects": {"httpx", "mlx", "mlx_lm", "adapters", "hypercorn", "starlette"},
}


def _imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_import_statements(package: str) -> None:
    offenders = {
        str(path.relative_to(SRC)): sorted(_imported_roots(path) & FORBIDDEN[package])
        for path in (SRC / package).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_importing_the_package_loads_no_forbidden_module(package: str) -> None:
    modules = sorted(p.stem for p in (SRC / package).glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module('{package}.' + m)\n"
        f"bad = {sorted(FORBIDDEN[package])!r}\n"
        "print(sorted({n.split('.')[0] for n in sys.modules} & set(bad)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"


def test_the_kv_frames_and_pull_load_no_mlx() -> None:
    # a router handles KV bytes (framing, the end frame, declared sizes) without MLX
    code = (
        "import sys, adapters.kv.frames, adapters.kv.pull, adapters.http.node_api\n"
        "print(sorted({n.split('.')[0] for n in sys.modules} & {'mlx', 'mlx_lm', 'numpy'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_nothing_shipped_imports_the_test_support() -> None:
    # support/ (the tiny checkpoints) and tests/ are not packaged: a shipped module that imports
    # them would fail at run time on an installed copy
    offenders = {
        str(path.relative_to(SRC)): sorted(_imported_roots(path) & {"support", "tests"})
        for path in SRC.rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_walker_sees_a_forbidden_import(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("import trio\nfrom mlx_lm.models import cache\nfrom . import x\n")
    assert _imported_roots(sample) == {"trio", "mlx_lm"}


def _engine_imports() -> dict[str, set[str]]:
    """Each module of adapters.mlx and the modules of adapters.mlx it imports (those under
    TYPE_CHECKING too: a circle there is still two modules that must change together)."""
    package = SRC / "adapters" / "mlx"
    graph: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("adapters.mlx."):
                imported.add(node.module.split(".")[2])
            elif isinstance(node, ast.ImportFrom) and node.module == "adapters.mlx":
                imported.update(alias.name for alias in node.names)
        graph[path.stem] = imported & {p.stem for p in package.glob("*.py")}
    return graph


def test_no_engine_module_imports_itself_through_others() -> None:
    """The engine's modules form no import circle (the lanes and speculation see the device loop
    through a Protocol, never by importing it)."""
    graph = _engine_imports()
    circles: list[list[str]] = []

    def walk(module: str, path: list[str]) -> None:
        for imported in sorted(graph.get(module, ())):
            if imported == path[0]:
                circles.append([*path, imported])
            elif imported not in path and len(path) < len(graph):
                walk(imported, [*path, imported])

    for module in sorted(graph):
        if module != "__init__":
            walk(module, [module])
    assert circles == []


def _modules() -> dict[str, Path]:
    """Every module under src by its dotted name (a package by its own)."""
    found: dict[str, Path] = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module under src that `name` (a module, or a name in one) lives in, else None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _module_imports(path: Path, modules: dict[str, Path]) -> tuple[set[str], list[str]]:
    """The src modules `path` imports when it loads (not under TYPE_CHECKING, not in a function),
    and every private name it takes from another src module (`from m import _x`, or `m._x` on a
    module it imported), wherever in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    loaded: set[str] = set()
    private: list[str] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                whole = f"{node.module}.{alias.name}"
                if whole in modules:
                    aliases[alias.asname or alias.name] = whole
                elif alias.name.startswith("_") and _owner(node.module, modules):
                    private.append(f"from {node.module} import {alias.name}")
        elif (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
              and isinstance(node.value, ast.Name) and node.value.id in aliases):
            private.append(f"{aliases[node.value.id]}.{node.attr}")
    for node in tree.body:  # what runs at import time
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        loaded.update(owner for name in names if (owner := _owner(name, modules)))
    return loaded, private


def test_no_private_name_is_imported_across_modules() -> None:
    """A name that starts with `_` is its module's own: another module that needs it needs a
    public name."""
    modules = _modules()
    offenders = {name: private for name, path in sorted(modules.items())
                 if (private := _module_imports(path, modules)[1])}
    assert offenders == {}


def test_no_test_imports_a_private_name_from_src() -> None:
    """Tests and their support use what src makes public, as any client would: a private name a
    test needs is one src should make public, or the test should go through the public surface."""
    modules = _modules()
    root = SRC.parent
    files = [path for folder in ("tests", "support") for path in sorted((root / folder).rglob("*.py"))]
    assert len(files) > 100  # it sees the tests
    offenders = {str(path.relative_to(root)): private for path in files
                 if (private := _module_imports(path, modules)[1])}
    assert offenders == {}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles in `graph` (module -> the modules it imports), each as a path."""
    state: dict[str, int] = {}  # 1: on the path now, 2: done
    circles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                circles.append([*path[path.index(imported):], imported])
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return circles


def test_no_module_imports_itself_through_others() -> None:
    """No import circle anywhere under src (imports at load time: a function's own import or one
    under TYPE_CHECKING is not a circle at load, and is what breaks one when it must be)."""
    modules = _modules()
    graph = {name: _module_imports(path, modules)[0] - {name} for name, path in modules.items()}
    assert sum(map(len, graph.values())) > len(modules)  # it sees the imports
    assert _circles(graph) == []


def test_the_checks_see_a_private_import_and_a_circle(tmp_path: Path) -> None:
    modules = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    modules["a"].write_text("from b import _hidden, shown\nimport b\nb._other()\n")
    modules["b"].write_text("import a\n")
    loaded, private = _module_imports(modules["a"], modules)
    assert loaded == {"b"} and private == ["from b import _hidden", "b._other"]
    assert _module_imports(modules["b"], modules)[0] == {"a"}
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == [["b", "c", "b"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
