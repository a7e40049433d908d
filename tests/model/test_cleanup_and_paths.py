"""Properties of the tables that a spec snapshot cannot give: cleanup on every way out, and paths.

- Every edge from a phase P into `failed` or `cancelled`, declared or not, begins with P's
  cleanup, and P's cleanup frees everything a request can hold in P (`tests.model.holdings`,
  written from what intents do, not from the tables).
- Every path through each request machine, from its initial phase to a terminal one, with each
  (phase, event) edge taken at most twice, is walked with concrete events: at every step the
  request holds only what its phase may, and at the end nothing, with exactly one reply.
- A few paths by hand: a prefill ends `done` only through `kv_taken` or a normal ending after
  its first token; the router relays decode tokens only after the first token; a decode node
  starts decoding only once the KV it decodes from is installed; the deadline is armed once,
  before any work.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from statecore.events import EventKind
from statecore.ids import RequestId
from statecore.intents import CancelRemote, CancelTimer, Intent, IntentKind, ReleaseKv, StopDecoding
from statecore.step import RequestRecord, step_request
from statecore.table import MACHINES, REQUEST_MACHINES, Machine
from tests.model.holdings import MAY_HOLD, Walk
from tests.model.strategies import SAMPLE_EVENTS

EVENT_OF_KIND = {type(e).kind: e for e in SAMPLE_EVENTS.values()}
# the intents a cleanup names, which carry only the request's id
CLEANUP_INTENTS = {t.kind: t for t in (CancelTimer, CancelRemote, ReleaseKv, StopDecoding)}
WORK = {IntentKind.START_PREFILL, IntentKind.FETCH_KV, IntentKind.SEND_KV, IntentKind.INSTALL_KV,
        IntentKind.START_DECODE}


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_every_edge_into_failed_or_cancelled_begins_with_the_phases_cleanup(name: str) -> None:
    machine: Machine[Any] = MACHINES[name]
    ends = {machine.failure, machine.cancelled} - {None}
    if not ends:  # the loop and peer health: no request phase, nothing to clean up
        assert not machine.cleanup
        assert not any(edge.target in ends for edge in machine.table.values())
        return
    checked = 0
    for (phase, kind), edge in machine.table.items():
        if machine.is_terminal(phase) or edge.target not in ends:
            continue
        cleanup = machine.cleanup.get(phase, ())
        assert edge.intents[: len(cleanup)] == cleanup, (phase, kind, edge)
        checked += 1
    assert checked >= len(EventKind)  # every non-terminal phase fails on most events


@pytest.mark.parametrize("name", sorted(REQUEST_MACHINES))
def test_each_phases_cleanup_frees_everything_it_may_hold(name: str) -> None:
    machine: Machine[Any] = REQUEST_MACHINES[name]
    for phase in machine.all_phases:
        if machine.is_terminal(phase):
            continue
        walk = Walk(phase.value, held=set(MAY_HOLD[name].get(phase.value, frozenset())))
        cleanup = machine.cleanup.get(phase, ())
        walk.take(name, None, [CLEANUP_INTENTS[kind](RequestId("r")) for kind in cleanup])
        assert not walk.held, f"{phase.value}: cleanup {cleanup} leaves {walk.held}"


@dataclass(frozen=True)
class Step:
    phase: str  # before the event
    event: EventKind
    intents: list[Intent]
    moved_to: str
    over_held: frozenset[str]  # what the request holds after it that `moved_to` may not


def paths(machine: Machine[Any], most: int = 2) -> Iterator[tuple[list[Step], Walk, str]]:
    """Every path from the initial phase to a terminal one taking each edge at most `most`
    times, as (its steps, the request's walk, the terminal phase)."""
    used: Counter[tuple[Any, EventKind]] = Counter()

    def extend(record: RequestRecord[Any], steps: list[Step], walk: Walk
               ) -> Iterator[tuple[list[Step], Walk, str]]:
        if machine.is_terminal(record.phase):
            yield steps, walk, record.phase.value
            return
        for kind in EventKind:
            if used[(record.phase, kind)] >= most:
                continue
            event = EVENT_OF_KIND[kind]
            moved, intents = step_request(machine, record, event)
            after = Walk(moved.phase.value, list(walk.intents), set(walk.held))
            after.take(machine.name, event, intents)
            step = Step(record.phase.value, kind, intents, moved.phase.value,
                        frozenset(after.over_held(machine.name, moved.phase.value)))
            used[(record.phase, kind)] += 1
            yield from extend(moved, [*steps, step], after)
            used[(record.phase, kind)] -= 1

    yield from extend(RequestRecord(RequestId("r"), machine.initial), [], Walk(machine.initial.value))


def route(steps: list[Step]) -> list[tuple[str, str]]:
    return [(s.phase, s.event.value) for s in steps]


@pytest.mark.parametrize("name", sorted(REQUEST_MACHINES))
def test_every_path_ends_holding_nothing_with_one_reply(name: str) -> None:
    ends: Counter[str] = Counter()
    for steps, walk, end in paths(REQUEST_MACHINES[name]):
        for i, step in enumerate(steps):  # leaving a phase releases what only it may hold
            assert not step.over_held, f"{route(steps[:i + 1])}: in {step.moved_to} holds {step.over_held}"
        assert not walk.held, f"{route(steps)} ends {end} holding {walk.held}"
        problem = walk.reply_problem(name, end)
        assert problem is None, f"{route(steps)} ends {end}: {problem}"
        ends[end] += 1
    assert set(ends) == {"done", "failed", "cancelled"}, ends


def kinds(steps: list[Step]) -> list[IntentKind]:
    return [i.kind for step in steps for i in step.intents]


def test_a_prefill_ends_done_only_through_kv_taken_or_a_normal_end_after_its_first_token() -> None:
    done = 0
    for steps, _, end in paths(REQUEST_MACHINES["request_prefill"]):
        if end != "done":
            continue
        assert (steps[-1].phase, steps[-1].event) in {("handoff", EventKind.KV_TAKEN),
                                                      ("handoff", EventKind.STOP_MATCHED)}, route(steps)
        assert EventKind.PREFILL_DONE in [s.event for s in steps], route(steps)
        done += 1
    assert done > 0


def test_the_router_relays_decode_tokens_only_after_the_first_token() -> None:
    for steps, _, _ in paths(REQUEST_MACHINES["request_router"]):
        seen_first = False
        for step in steps:
            seen_first |= step.event is EventKind.FIRST_TOKEN and step.phase == "prefilling"
            if any(i.kind is IntentKind.RESPOND_TOKEN for i in step.intents):
                assert seen_first, route(steps)


def test_a_decode_node_decodes_only_from_an_installed_cache() -> None:
    for steps, _, _ in paths(REQUEST_MACHINES["request_decode"]):
        got = kinds(steps)
        if IntentKind.START_DECODE in got:
            start = got.index(IntentKind.START_DECODE)
            assert IntentKind.INSTALL_KV in got[:start], route(steps)
            assert EventKind.KV_INSTALLED in [s.event for s in steps], route(steps)
        if IntentKind.INSTALL_KV in got:
            events = [s.event for s in steps]
            assert EventKind.KV_RECEIVED in events or EventKind.PREFILL_DONE in events, route(steps)


@pytest.mark.parametrize("name", sorted(REQUEST_MACHINES))
def test_the_deadline_is_armed_once_before_any_work(name: str) -> None:
    for steps, _, _ in paths(REQUEST_MACHINES[name]):
        got = kinds(steps)
        assert got.count(IntentKind.ARM_DEADLINE) <= 1, route(steps)
        work = [i for i, k in enumerate(got) if k in WORK]
        if work:
            assert IntentKind.ARM_DEADLINE in got[: work[0]], route(steps)
