"""`graph_data`, the machines as the live view draws them, holds exactly the tables' edges
(the same ones the docs' diagrams draw) and places every phase in a distinct cell."""

from __future__ import annotations

import json

import pytest

from statecore.diagram import graph_data
from statecore.table import MACHINES, SERVING_LOOP


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_every_declared_edge_and_no_other_is_in_the_data(name: str) -> None:
    machine = MACHINES[name]
    graph = json.loads(json.dumps(graph_data(machine)))  # JSON-ready as it is
    drawn = {(e["source"], e["target"], label) for e in graph["edges"] for label in e["labels"]}
    declared = {(source.value, edge.target.value, kind.value)
                for (source, kind), edge in machine.declared.items()}
    assert {(s, t, label.split(" / ")[0]) for s, t, label in drawn} == declared
    assert len(drawn) == len(machine.declared)
    pairs = [(e["source"], e["target"]) for e in graph["edges"]]
    assert len(pairs) == len(set(pairs)), "one edge per (source, target) pair"


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_phases_get_distinct_cells_terminal_ones_last(name: str) -> None:
    machine = MACHINES[name]
    phases = graph_data(machine)["phases"]
    assert [p["name"] for p in phases] == [p.value for p in machine.all_phases]
    assert len({(p["rank"], p["row"]) for p in phases}) == len(phases)
    by_name = {p["name"]: p for p in phases}
    assert by_name[machine.initial.value]["rank"] == 0 and by_name[machine.initial.value]["initial"]
    last = max(p["rank"] for p in phases)
    for phase in machine.terminal:
        assert by_name[phase.value]["rank"] == last and by_name[phase.value]["terminal"]


def test_ranks_follow_the_shortest_way_from_the_initial_phase() -> None:
    ranks = {p["name"]: p["rank"] for p in graph_data(SERVING_LOOP)["phases"]}
    # stopped is one step from starting, but terminal phases share the last column
    assert ranks == {"starting": 0, "serving": 1, "draining": 2, "stopped": 3}
