"""Each decision issue 35 lists has one home: docs/architecture.md's table "Checked: nothing else
decides it" gives, per decision, a grep over `src` and the only files it may find (the home and its
askers). This test runs every row's grep and fails when one finds a file the row does not name, so a
decision made again elsewhere shows up here, and the table stays what the code is."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SECTION = "### Checked: nothing else decides it"


@dataclass(frozen=True)
class Check:
    decision: str
    patterns: tuple[str, ...]  # the grep's `-e` patterns (POSIX extended, as Python reads them)
    allowed: frozenset[str]  # files under src/ the grep may find


def _code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _cells(row: str) -> list[str]:
    """A table row's cells; a pipe escaped as `\\|` (inside code spans too) is a pipe in a cell."""
    cells = re.split(r"(?<!\\)\|", row.strip().strip("|"))
    return [cell.replace("\\|", "|").strip() for cell in cells]


def checks(doc: str) -> list[Check]:
    """The rows of the doc's checked table."""
    section = doc.split(SECTION, 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    found = []
    for row in rows[1:]:  # the header first
        decision, _home, grep, only = _cells(row)
        words = shlex.split(_code_spans(grep)[0])
        assert words[:2] == ["grep", "-rnE"] and words[-1] == "src", grep
        patterns = tuple(words[i + 1] for i, word in enumerate(words) if word == "-e")
        allowed = frozenset(span for span in _code_spans(only) if span.endswith(".py"))
        found.append(Check(decision, patterns, allowed))
    return found


def finds(check: Check, src: Path) -> dict[str, list[int]]:
    """What the check's grep finds under `src`: file (relative to it) -> line numbers."""
    pattern = re.compile("|".join(f"(?:{p})" for p in check.patterns))
    hits: dict[str, list[int]] = {}
    for path in sorted(src.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                hits.setdefault(str(path.relative_to(src)), []).append(number)
    return hits


def test_every_listed_decision_has_a_check() -> None:
    decisions = [check.decision for check in checks(DOC.read_text())]
    assert len(decisions) == 11, decisions
    assert all(check.patterns and check.allowed for check in checks(DOC.read_text()))


def test_nothing_but_a_decisions_home_and_askers_decide_it() -> None:
    outside = {}
    for check in checks(DOC.read_text()):
        missing = sorted(name for name in check.allowed if not (ROOT / "src" / name).is_file())
        assert not missing, f"{check.decision}: no such file {missing}"
        found = finds(check, ROOT / "src")
        stray = {name: lines for name, lines in found.items() if name not in check.allowed}
        if stray:
            outside[check.decision] = stray
    assert not outside, (f"decided outside its home (or an asker docs/architecture.md's '{SECTION[4:]}' "
                         f"does not name: add it there if it only asks): {outside}")


def test_the_check_sees_a_decision_made_elsewhere(tmp_path: Path) -> None:
    doc = DOC.read_text()
    first = next(check for check in checks(doc) if "first token" in check.decision)
    (tmp_path / "statecore").mkdir()
    (tmp_path / "statecore" / "policy.py").write_text("def is_eos(token, eos):\n    return token in eos\n")
    (tmp_path / "rogue.py").write_text("if first.token in self.eos_ids:\n    pass\n")
    assert finds(first, tmp_path) == {"statecore/policy.py": [2], "rogue.py": [1]}
