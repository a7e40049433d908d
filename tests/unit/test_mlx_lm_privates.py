"""No code under src/ reads a private attribute of mlx-lm's objects, nor snapshots one with
`vars()`: the next mlx-lm release may rename what is private without notice, and the engine
must then fail loudly at a public API, never silently compute something else.

The names checked are the private attributes mlx-lm's own classes set (`self._name = ...` in its
installed source) that no class under src/ sets for itself (those are ambiguous: `self._run._text`
is ours); an access `x._name` in src/ with one of those names fails this test unless `x` is
`self` or `cls`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import mlx_lm

SRC = Path(__file__).resolve().parents[2] / "src"


def private_names(root: Path) -> set[str]:
    names: set[str] = set()
    for path in root.rglob("*.py"):
        names.update(re.findall(r"\bself\.(_[A-Za-z]\w*)\s*=", path.read_text(encoding="utf-8")))
    return names


def mlx_lm_private_names() -> set[str]:
    return private_names(Path(mlx_lm.__file__).parent) - private_names(SRC)


def reads(tree: ast.AST, private: set[str]) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private and not node.attr.startswith("__"):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars":
            found.append((node.lineno, "vars()"))
    return found


def test_the_names_are_found() -> None:
    private = mlx_lm_private_names()
    assert {"_idx", "_generation_batch", "_next_tokens"} <= private


def test_no_private_attribute_of_mlx_lm_is_read_in_src() -> None:
    private = mlx_lm_private_names()
    offenders = [f"{path.relative_to(SRC)}:{line}: {what}"
                 for path in sorted(SRC.rglob("*.py"))
                 for line, what in reads(ast.parse(path.read_text(encoding="utf-8")), private)]
    assert not offenders, offenders


def test_the_check_sees_what_the_old_merge_lane_read() -> None:
    old = "pending = generation._next_tokens.tolist()\nsaved = vars(batch)\nself._idx = 0\n"
    found = reads(ast.parse(old), mlx_lm_private_names())
    assert sorted(what for _, what in found) == ["._next_tokens", "vars()"]
