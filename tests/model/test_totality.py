"""Every (state, event) pair of every machine has a defined outcome, and it is the spec's.

h2's test_state_machines idea: enumerate phases x event types, and let hypothesis vary the
events' payloads. No pair may raise, leave the machine's phases, or disagree with specs/.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from statecore.errors import Code
from statecore.events import EVENT_TYPES, Event, EventKind
from statecore.ids import PeerId, RequestId
from statecore.intents import IntentKind, Reject
from statecore.phases import LoopPhase, PeerPhase
from statecore.step import LoopRecord, PeerRecord, RequestRecord, step_loop, step_peer, step_request
from statecore.table import MACHINES, PEER_HEALTH, REQUEST_MACHINES, SERVING_LOOP, Machine
from tests.model.strategies import SAMPLE_EVENTS, events, expected_target, spec


def test_every_event_kind_has_one_event_type() -> None:
    assert sorted(t.kind.value for t in EVENT_TYPES) == sorted(k.value for k in EventKind)


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_table_is_total(name: str) -> None:
    machine: Machine[Any] = MACHINES[name]
    for phase in machine.all_phases:
        for kind in EventKind:
            edge = machine.edge(phase, kind)
            assert edge.target in set(machine.all_phases)


@pytest.mark.parametrize("name", sorted(REQUEST_MACHINES))
@given(data=st.data(), event=events)
def test_request_step_is_total_and_matches_spec(name: str, data: st.DataObject, event: Event) -> None:
    machine: Machine[Any] = REQUEST_MACHINES[name]
    phase = data.draw(st.sampled_from(list(machine.all_phases)))
    record = RequestRecord(RequestId("r"), phase)
    moved, intents = step_request(machine, record, event)
    assert moved.phase.value == expected_target(spec(name), phase.value, event.kind.value)
    assert moved.request_id == record.request_id
    if machine.is_terminal(phase):
        assert moved == record and intents == []
    if machine.is_unsuccessful(moved.phase) and not machine.is_terminal(phase):
        assert moved.error is not None
        if moved.phase is machine.failure:
            assert sum(isinstance(i, Reject) for i in intents) == 1
    if not machine.is_terminal(moved.phase):
        assert moved.error is None


@given(phase=st.sampled_from(list(LoopPhase)), event=events)
def test_loop_step_is_total_and_matches_spec(phase: LoopPhase, event: Event) -> None:
    moved, intents = step_loop(LoopRecord(phase), event)
    assert moved.phase.value == expected_target(spec(SERVING_LOOP.name), phase.value, event.kind.value)
    stops = moved.phase is LoopPhase.STOPPED and phase is not LoopPhase.STOPPED
    if stops:  # only transport loss or a finished drain (or a drain with nothing started)
        assert event.kind in {
            EventKind.TRANSPORT_LOST, EventKind.DRAIN_COMPLETE, EventKind.TIMER_FIRED,
            EventKind.DRAIN_REQUESTED,
        }
        assert any(i.kind is IntentKind.STOP_LOOP for i in intents)
    if event.kind in {EventKind.PEER_FAILED, EventKind.ENGINE_FAILED, EventKind.REJECTED}:
        assert moved.phase is phase  # a request's failure never moves the loop


@given(phase=st.sampled_from(list(PeerPhase)), event=events)
def test_peer_step_is_total_and_matches_spec(phase: PeerPhase, event: Event) -> None:
    moved, _ = step_peer(PeerRecord(PeerId("p"), phase), event)
    assert moved.phase.value == expected_target(spec(PEER_HEALTH.name), phase.value, event.kind.value)


@pytest.mark.parametrize("name", sorted(REQUEST_MACHINES))
def test_undeclared_pairs_fail_with_illegal_transition(name: str) -> None:
    machine: Machine[Any] = REQUEST_MACHINES[name]
    samples = {t.kind: t for t in EVENT_TYPES}
    checked = 0
    for phase in machine.all_phases:
        if machine.is_terminal(phase):
            continue
        for kind in EventKind:
            if (phase, kind) in machine.declared:
                continue
            event = SAMPLE_EVENTS[samples[kind]]
            moved, _ = step_request(machine, RequestRecord(RequestId("r"), phase), event)
            assert moved.phase is machine.failure
            assert moved.error is not None and moved.error.code is Code.ILLEGAL_TRANSITION
            checked += 1
    assert checked > 0
