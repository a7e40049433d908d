"""Machine specs as data: load `specs/*.toml`, render a machine as TOML, compare the two.

A spec lists a machine's phases, initial and terminal phases, the rule for undeclared
pairs, what an event for a request the node does not hold asks for (`absent`), and every
declared transition with its intents and failure code. The tables in
`statecore.table` must agree with the specs exactly; the model-based tests use the specs as
their oracle, so the specs are written and reviewed by hand and no command writes them from the
tables (`render_toml` drafts one for a person to read). pydantic validates the files strictly.
This module must never import trio, httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import enum
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from statecore.table import Machine


class TransitionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    source: str = Field(alias="from")
    event: str
    target: str = Field(alias="to")
    intents: tuple[str, ...] = ()
    code: str | None = None


class MachineSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    machine: str
    title: str
    phases: tuple[str, ...]
    initial: str
    terminal: tuple[str, ...]
    undeclared: str
    # event -> the intents an event for a request the node does not hold asks for
    absent: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    transition: tuple[TransitionSpec, ...]

    def key(self, t: TransitionSpec) -> tuple[str, str]:
        return (t.source, t.event)

    def edges(self) -> dict[tuple[str, str], TransitionSpec]:
        return {(t.source, t.event): t for t in self.transition}


def spec_from_machine(machine: Machine[Any]) -> MachineSpec:
    """The spec a machine's table implies (declared edges only, in table order)."""
    transitions: list[TransitionSpec] = []
    phases: list[enum.Enum] = list(machine.all_phases)
    for phase in phases:
        for (source, kind), edge in machine.declared.items():
            if source is not phase:
                continue
            transitions.append(
                TransitionSpec.model_validate(
                    {
                        "from": source.value,
                        "event": kind.value,
                        "to": edge.target.value,
                        "intents": tuple(i.value for i in edge.intents),
                        "code": edge.code.value if edge.code else None,
                    }
                )
            )
    return MachineSpec(
        machine=machine.name,
        title=machine.title,
        phases=tuple(p.value for p in phases),
        initial=machine.initial.value,
        terminal=tuple(p.value for p in phases if p in machine.terminal),
        undeclared=machine.undeclared.value,
        absent={kind.value: tuple(i.value for i in intents) for kind, intents in machine.absent.items()},
        transition=tuple(transitions),
    )


def load_spec(path: Path) -> MachineSpec:
    with path.open("rb") as handle:
        data = tomllib.load(handle)
    return MachineSpec.model_validate(data)


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(_quote(v) for v in values) + "]"


def render_toml(spec: MachineSpec) -> str:
    lines = [
        f"# {spec.title}: the transitions statecore's table must match exactly.",
        "# Undeclared (phase, event) pairs follow the `undeclared` rule; terminal phases absorb.",
        f"machine = {_quote(spec.machine)}",
        f"title = {_quote(spec.title)}",
        f"phases = {_list(spec.phases)}",
        f"initial = {_quote(spec.initial)}",
        f"terminal = {_list(spec.terminal)}",
        f"undeclared = {_quote(spec.undeclared)}",
    ]
    if spec.absent:
        rules = ", ".join(f"{event} = {_list(intents)}" for event, intents in spec.absent.items())
        lines.append(f"absent = {{ {rules} }}")
    for t in spec.transition:
        lines += [
            "",
            "[[transition]]",
            f"from = {_quote(t.source)}",
            f"event = {_quote(t.event)}",
            f"to = {_quote(t.target)}",
            f"intents = {_list(t.intents)}",
        ]
        if t.code is not None:
            lines.append(f"code = {_quote(t.code)}")
    return "\n".join(lines) + "\n"


def compare(expected: MachineSpec, actual: MachineSpec) -> list[str]:
    """Every difference between a spec and a table, as readable lines (empty when equal)."""
    problems: list[str] = []
    for attr in ("machine", "phases", "initial", "terminal", "undeclared", "absent"):
        if getattr(expected, attr) != getattr(actual, attr):
            problems.append(
                f"{attr}: spec says {getattr(expected, attr)!r}, "
                f"table says {getattr(actual, attr)!r}"
            )
    want, have = expected.edges(), actual.edges()
    for key in sorted(want.keys() - have.keys()):
        problems.append(f"in spec, not in table: {key[0]} --{key[1]}-->")
    for key in sorted(have.keys() - want.keys()):
        problems.append(f"in table, not in spec: {key[0]} --{key[1]}--> {have[key].target}")
    for key in sorted(want.keys() & have.keys()):
        if want[key] != have[key]:
            problems.append(f"{key[0]} --{key[1]}-->: spec {want[key]!r} != table {have[key]!r}")
    return problems


__all__ = [
    "MachineSpec",
    "TransitionSpec",
    "compare",
    "load_spec",
    "render_toml",
    "spec_from_machine",
]
