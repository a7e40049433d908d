"""Tests use what src makes public, as any client would, down to attributes: no test reads or
calls a private attribute (a leading underscore) of a class imported from src, or of an object
such a class made. A private attribute a test needs is one the class should make public, or
the test should go through the public surface. (Imports are `test_import_boundary.py`'s: no
private name imported across modules or into a test, no import circle.)

What it sees: in each function (and at a module's top level, apart), the names imported from
src and those bound from a call of one (`Cls(...)`, `Cls.load(...)`, `module.Cls(...)`, awaited
or not, or `with Cls(...) as x`); then every `name._attribute` on them."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC_PACKAGES = ("statecore", "effects", "adapters")

# A race no public call can force: both of `next_event`'s waits ending in one round needs the
# copy's wake-up event set while its future is still running.
ALLOWED = {("tests/unit/test_segment_copies.py", "copies._copies")}


def _from_src(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in SRC_PACKAGES


def _made_by(value: ast.expr | None, sources: set[str]) -> bool:
    """Whether `value` is a call (awaited or not) of a class among `sources` (a capitalized name),
    or of an attribute of one (`Cls.load(...)`, `module.Cls(...)`): a function's result may be
    anyone's object (`build_parser()` makes argparse's)."""
    if isinstance(value, ast.Await):
        value = value.value
    if not isinstance(value, ast.Call):
        return False
    func, chain = value.func, []
    while isinstance(func, ast.Attribute):
        chain.append(func.attr)
        func = func.value
    return (isinstance(func, ast.Name) and func.id in sources
            and any(name[:1].isupper() for name in [func.id, *chain]))


def _bound(target: ast.expr | None) -> set[str]:
    return {target.id} if isinstance(target, ast.Name) else set()


def _scope_private_uses(nodes: Iterable[ast.AST], imported: set[str]) -> list[tuple[int, str]]:
    nodes = list(nodes)
    sources = set(imported)
    made = set(imported)
    for node in nodes:
        if isinstance(node, ast.Assign) and _made_by(node.value, sources):
            made.update(*(_bound(target) for target in node.targets))
        elif isinstance(node, ast.AnnAssign) and _made_by(node.value, sources):
            made.update(_bound(node.target))
        elif isinstance(node, ast.withitem) and _made_by(node.context_expr, sources):
            made.update(_bound(node.optional_vars))
    return [(node.lineno, f"{node.value.id}.{node.attr}") for node in nodes
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in made
            and node.attr.startswith("_") and not node.attr.startswith("__")]


def private_attribute_uses(path: Path) -> list[str]:
    """Every `x._name` in `path` on a name imported from src or an object one made, as
    'line: x._name'."""
    tree = ast.parse(path.read_text(), filename=str(path))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _from_src(node.module):
            imported.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(alias.asname or alias.name.split(".")[0] for alias in node.names
                            if _from_src(alias.name))
    functions = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
    top_level = [node for statement in tree.body
                 if not isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                 for node in ast.walk(statement)]
    uses = set(_scope_private_uses(top_level, imported))
    for function in functions:
        uses.update(_scope_private_uses(ast.walk(function), imported))
    return [f"{line}: {use}" for line, use in sorted(uses)]


def test_no_test_uses_a_private_attribute_of_a_src_class() -> None:
    files = [path for folder in ("tests", "support") for path in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 100  # it sees the tests
    offenders = {}
    for path in files:
        name = str(path.relative_to(ROOT))
        uses = [use for use in private_attribute_uses(path) if (name, use.split(": ", 1)[1]) not in ALLOWED]
        if uses:
            offenders[name] = uses
    assert offenders == {}


def test_the_check_sees_a_private_attribute_of_a_src_object(tmp_path: Path) -> None:
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "from adapters.http.peers_httpx import HttpxPeers\n"
        "from adapters.kv import shm_inbox as kv_shm\n"
        "from adapters.cli import build_parser\n"
        "from other import Thing\n"
        "async def test_a() -> None:\n"
        "    peers = HttpxPeers()\n"
        "    engine = await HttpxPeers.load()\n"
        "    inbox = kv_shm.ShmInbox('d')\n"
        "    thing = Thing()\n"
        "    peers._stream_items(); engine._device; inbox._regions; HttpxPeers._default\n"
        "    thing._mine; peers.public; peers.__class__\n"
        "def test_b() -> None:\n"
        "    with HttpxPeers() as held:\n"
        "        held._client\n"
        "    peers = Thing()\n"
        "    peers._own\n"
        "    parser = build_parser()\n"
        "    parser._actions\n"
    )
    assert private_attribute_uses(sample) == [
        "10: HttpxPeers._default", "10: engine._device", "10: inbox._regions", "10: peers._stream_items",
        "14: held._client",
    ]
