"""Many requests through one serving loop, driven by hypothesis, checked against specs/.

Invariants: terminal phases absorb; the loop stops if and only if `TransportLost` or a
finished drain was seen; one request's event changes no other request; every request ends
in exactly one terminal phase; each request's phase is what the spec predicts.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from statecore.events import DrainRequested, Event, LoopReady, TransportLost
from statecore.ids import RequestId
from statecore.intents import Reject
from statecore.loop import ForLoop, ForRequest, LoopState, OpenRequest, loop_step, new_loop
from statecore.phases import LoopPhase
from statecore.table import REQUEST_MACHINES, Machine
from tests.model.strategies import events, expected_target, spec


class LoopWithRequests(RuleBasedStateMachine):
    machine_name = "request_router"
    ids = Bundle("ids")

    def __init__(self) -> None:
        super().__init__()
        self.machine: Machine[Any] = REQUEST_MACHINES[self.machine_name]
        self.spec = spec(self.machine_name)
        self.state: LoopState[Any] = new_loop(self.machine)
        self.counter = 0
        self.opened: list[RequestId] = []
        self.expected: dict[RequestId, str] = {}  # the spec's view of every request
        self.saw_transport_lost = False
        self.saw_drain = False
        self.outcomes: dict[RequestId, Any] = {}  # every terminal phase the loop reported

    def step(self, envelope: Any) -> list[Any]:
        """One loop step; collect the requests it settled (each exactly once, ever)."""
        self.state, intents = loop_step(self.state, envelope)
        for rid, record in self.state.settled.items():
            assert rid not in self.outcomes, f"{rid} settled twice"
            assert rid not in self.state.live
            self.outcomes[rid] = record.phase
        return intents

    @initialize()
    def start(self) -> None:
        self.step(ForLoop(LoopReady()))
        assert self.state.loop.phase is LoopPhase.SERVING

    @rule(target=ids)
    def open_request(self) -> RequestId:
        rid = RequestId(f"req-{self.counter}")
        self.counter += 1
        intents = self.step(OpenRequest(rid))
        if self.state.accepting:
            assert intents == []
            self.opened.append(rid)
            self.expected[rid] = self.machine.initial.value
        else:
            assert len(intents) == 1 and isinstance(intents[0], Reject)
        return rid

    @rule(rid=ids, event=events)
    def request_event(self, rid: RequestId, event: Event) -> None:
        before = dict(self.state.live)
        self.step(ForRequest(rid, event))
        if rid in self.expected:
            phase = self.expected[rid]
            self.expected[rid] = expected_target(self.spec, phase, event.kind.value)
        for other, record in before.items():  # one request's event changes no other request
            if other != rid:
                assert self.state.live.get(other) == record

    @rule(rid=consumes(ids))
    def forget(self, rid: RequestId) -> None:
        """Stop sending events to a request (keeps the bundle small)."""

    @precondition(lambda self: not self.state.stopped)
    @rule()
    def drain(self) -> None:
        self.saw_drain = True
        self.step(ForLoop(DrainRequested()))

    @precondition(lambda self: not self.state.stopped)
    @rule(detail=st.text(max_size=5))
    def lose_transport(self, detail: str) -> None:
        self.saw_transport_lost = True
        live = list(self.state.live)
        self.step(ForLoop(TransportLost(detail)))
        for rid in live:
            self.expected[rid] = expected_target(
                self.spec, self.expected[rid], TransportLost.kind.value
            )

    @invariant()
    def requests_match_the_spec(self) -> None:
        for rid in self.opened:
            record = self.state.live.get(rid)
            phase = record.phase.value if record else self.outcomes[rid].value
            assert phase == self.expected[rid], rid

    @invariant()
    def each_request_is_live_or_terminal_exactly_once(self) -> None:
        assert not (self.state.live.keys() & self.outcomes.keys())
        assert set(self.opened) == set(self.state.live) | set(self.outcomes)
        for phase in self.outcomes.values():
            assert self.machine.is_terminal(phase)

    @invariant()
    def loop_stops_iff_transport_lost_or_drain_finished(self) -> None:
        drain_finished = self.saw_drain and not self.state.live
        assert self.state.stopped == (self.saw_transport_lost or drain_finished)

    def teardown(self) -> None:
        if not self.state.stopped:
            self.step(ForLoop(TransportLost("teardown")))
        assert not self.state.live
        assert set(self.outcomes) == set(self.opened)


class RouterLoop(LoopWithRequests):
    machine_name = "request_router"


class PrefillLoop(LoopWithRequests):
    machine_name = "request_prefill"


class DecodeLoop(LoopWithRequests):
    machine_name = "request_decode"


TestRouterLoop = RouterLoop.TestCase
TestPrefillLoop = PrefillLoop.TestCase
TestDecodeLoop = DecodeLoop.TestCase
