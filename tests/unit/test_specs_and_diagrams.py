"""The specs, the generated docs and the CLI agree with the tables the code runs on."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from adapters.cli import main
from statecore.diagram import render, render_markdown
from statecore.errors import Code
from statecore.phases import PrefillPhase
from statecore.spec import compare, load_spec, render_toml, spec_from_machine
from statecore.table import MACHINES, PREFILL_REQUEST, Edge

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_spec_file_matches_table(name: str) -> None:
    spec = load_spec(ROOT / "specs" / f"{name}.toml")
    assert compare(spec, spec_from_machine(MACHINES[name])) == []


def test_compare_reports_a_changed_edge() -> None:
    machine = PREFILL_REQUEST
    key = next(iter(machine.declared))
    altered = dict(machine.declared)
    altered[key] = Edge(PrefillPhase.FAILED, (), Code.INTERNAL)
    changed = replace(machine, declared=altered)
    problems = compare(spec_from_machine(machine), spec_from_machine(changed))
    assert len(problems) == 1 and key[0].value in problems[0]


def test_spec_toml_round_trips(tmp_path: Path) -> None:
    spec = spec_from_machine(MACHINES["request_router"])
    path = tmp_path / "s.toml"
    path.write_text(render_toml(spec))
    assert load_spec(path) == spec


def test_state_machines_doc_is_fresh() -> None:
    doc = (ROOT / "docs" / "state-machines.md").read_text()
    assert doc == render_markdown(), "run: statecore diagram --markdown > docs/state-machines.md"


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_every_declared_edge_is_drawn(name: str) -> None:
    machine = MACHINES[name]
    text = render(machine, "mermaid")
    for (source, kind), edge in machine.declared.items():
        assert f"{source.value} --> {edge.target.value}" in text
        assert kind.value in text
    dot = render(machine, "dot")
    assert dot.startswith("digraph")


def test_cli_diagram_prints_every_machine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--format", "mermaid"]) == 0
    out = capsys.readouterr().out
    for machine in MACHINES.values():
        assert machine.title in out
    assert out.count("stateDiagram-v2") == len(MACHINES)


def test_cli_spec_check_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spec", "--dir", str(ROOT / "specs")]) == 0
