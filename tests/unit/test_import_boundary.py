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
