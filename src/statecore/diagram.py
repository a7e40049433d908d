"""Render the machines from their tables as Mermaid or DOT, through transitions' diagram
extension, and assemble `docs/state-machines.md`; `graph_data` gives the same edges as plain
data (with a layered placement) for the live view that nodes serve at `/ui`.

Only declared edges are drawn (undeclared pairs follow each machine's rule, stated under its
diagram). This module may import `transitions` (for diagrams only); it must never import
trio, httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from typing import Any, Literal

from transitions.extensions.diagrams import GraphMachine

from statecore.table import MACHINES, Machine, Undeclared

DiagramFormat = Literal["mermaid", "dot"]


class _Model:
    """transitions binds triggers onto a model object; diagrams need nothing else."""


def _labelled_edges(machine: Machine[Any]) -> list[tuple[str, str, str]]:
    """(source, `event / intents` label, target) for every declared edge, in table order:
    what every drawing of a machine shows, whichever renderer draws it."""
    edges: list[tuple[str, str, str]] = []
    for (source, kind), edge in machine.declared.items():
        intents = ", ".join(i.value for i in edge.intents)
        label = f"{kind.value} / {intents}" if intents else kind.value
        edges.append((source.value, label, edge.target.value))
    return edges


def _graph_machine(machine: Machine[Any], engine: Literal["mermaid", "graphviz"]) -> Any:
    transitions = [{"trigger": label, "source": source, "dest": dest}
                   for source, label, dest in _labelled_edges(machine)]
    model = _Model()
    GraphMachine(
        model=model,
        states=[p.value for p in machine.all_phases],
        transitions=transitions,
        initial=machine.initial.value,
        graph_engine=engine,
        auto_transitions=False,
        show_conditions=False,
        title=machine.title,
    )
    return model.get_graph()  # type: ignore[attr-defined]


_ACTIVE_STYLE = re.compile(r"\s+Class (\w+) s_active")


def render(machine: Machine[Any], fmt: DiagramFormat = "mermaid") -> str:
    """One machine as Mermaid (stateDiagram-v2) or DOT source; deterministic."""
    if fmt == "mermaid":
        text = str(_graph_machine(machine, "mermaid").draw(None))
        # transitions marks the model's current (initial) phase as "active"; a doc has none
        text = _ACTIVE_STYLE.sub(r"\n  Class \1 s_default", text)
        # transitions writes the title bare between the front matter's fences; Mermaid 11 reads
        # only `title:` there (and drops a bare line)
        text = text.replace(f"---\n{machine.title}\n---", f"---\ntitle: {machine.title}\n---", 1)
        finals = [f"  {p.value} --> [*]" for p in machine.all_phases if p in machine.terminal]
        return text.rstrip("\n") + ("\n" + "\n".join(finals) if finals else "") + "\n"
    source: str = _graph_machine(machine, "graphviz").source
    return source


def _ranks(machine: Machine[Any]) -> dict[str, int]:
    """A column for each phase: its fewest steps from the initial phase along declared edges,
    with terminal phases together in the last column (phases nothing reaches go there too)."""
    steps = {machine.initial.value: 0}
    frontier = [machine.initial.value]
    edges = _labelled_edges(machine)
    while frontier:
        reached: list[str] = []
        for phase in frontier:
            for source, _, dest in edges:
                if source == phase and dest not in steps:
                    steps[dest] = steps[phase] + 1
                    reached.append(dest)
        frontier = reached
    terminal = {p.value for p in machine.terminal}
    inner = [n for p, n in steps.items() if p not in terminal]
    last = max(inner, default=0) + 1
    return {p.value: last if p.value in terminal or p.value not in steps else steps[p.value]
            for p in machine.all_phases}


def graph_data(machine: Machine[Any]) -> dict[str, Any]:
    """One machine as JSON-ready data for a drawing made elsewhere (the live view's SVG): its
    phases with a column (`rank`) and a row each, and one edge per (source, target) pair
    carrying the labels of every declared transition between them, as the diagrams read."""
    ranks = _ranks(machine)
    rows: dict[int, int] = {}
    phases = []
    for phase in machine.all_phases:
        rank = ranks[phase.value]
        phases.append({"name": phase.value, "rank": rank, "row": rows.get(rank, 0),
                       "terminal": phase in machine.terminal, "initial": phase is machine.initial,
                       "unsuccessful": machine.is_unsuccessful(phase)})
        rows[rank] = rows.get(rank, 0) + 1
    grouped: dict[tuple[str, str], list[str]] = {}
    for source, label, dest in _labelled_edges(machine):
        grouped.setdefault((source, dest), []).append(label)
    return {
        "name": machine.name,
        "title": machine.title,
        "phases": phases,
        "edges": [{"source": s, "target": t, "labels": labels} for (s, t), labels in grouped.items()],
    }


def _undeclared_rule(machine: Machine[Any]) -> str:
    if machine.undeclared is Undeclared.FAIL_REQUEST and machine.failure is not None:
        return (
            f"Any other (phase, event) pair moves a non-terminal request to "
            f"`{machine.failure.value}` with code `illegal_transition`, freeing what the "
            "phase holds; terminal phases absorb every event."
        )
    return (
        "Any other (phase, event) pair leaves the phase unchanged and reports an "
        "`illegal_transition` bug (logged and counted); it never stops the loop."
    )


def _phase_list(phases: Iterable[enum.Enum]) -> str:
    return ", ".join(f"`{p.value}`" for p in phases)


def render_markdown() -> str:
    """docs/state-machines.md, generated from the tables; a test keeps it fresh."""
    parts = [
        "# State machines",
        "",
        "<!-- Generated by `statecore diagram --markdown` from src/statecore/table.py. "
        "Do not edit by hand. -->",
        "",
        "Each diagram is drawn from the same transition table the code runs on. Edge labels "
        "read `event / intents`.",
    ]
    for machine in MACHINES.values():
        parts += [
            "",
            f"## {machine.title} (`{machine.name}`)",
            "",
            f"Phases: {_phase_list(machine.all_phases)}. Terminal: "
            f"{_phase_list(p for p in machine.all_phases if p in machine.terminal) or 'none'}.",
            "",
            _undeclared_rule(machine),
            "",
            "```mermaid",
            render(machine, "mermaid").rstrip("\n"),
            "```",
        ]
    return "\n".join(parts) + "\n"


__all__ = ["DiagramFormat", "graph_data", "render", "render_markdown"]
