"""Many requests through one serving loop, driven by hypothesis, checked against specs/ and
against what each request holds.

Each request's next event is drawn mostly from what its spec allows in the phase the spec
says it is in (a progress edge most often), so requests walk the whole machine: each test
asserts that its run reached every phase. Every intent the loop returns is filed under its
request, and a small model of what a request holds (its timer, a KV cache on this node, work
or a cache on another node, a decoder row), written from what the intents do on a node and not
from the tables, follows it. Invariants:
- each request's phase is what the spec predicts; terminal phases absorb; one request's event
  changes no other request; every request settles exactly once;
- after every step a request holds only what its phase may hold (leaving a phase releases what
  it held), and a settled request holds nothing: every timer cancelled (or fired), every cache
  and row released, every remote part cancelled or ended by the peer itself;
- a settled request got exactly one reply: `failed` one Reject, `done` one Complete (on a
  prefill node, whose answer is its first token, one RespondTokens and no Complete), `cancelled`
  none; the reply is the last intent it got; a request refused at intake gets one Reject;
- the loop stops if and only if `TransportLost` or a finished drain was seen, and says so with
  exactly one stop_loop intent.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from statecore.events import (
    ClientCancelled,
    DrainRequested,
    Event,
    EventKind,
    LoopReady,
    TransportLost,
)
from statecore.ids import RequestId
from statecore.intents import Intent, IntentKind, LoopIntent, PeerIntent, RefuseKv, Reject
from statecore.loop import Envelope, ForLoop, ForRequest, LoopState, OpenRequest, loop_step, new_loop
from statecore.phases import LoopPhase
from statecore.table import REQUEST_MACHINES, Machine
from tests.model.holdings import Walk
from tests.model.strategies import EVENTS_BY_KIND, events, expected_target, spec


class LoopWithRequests(RuleBasedStateMachine):
    machine_name: ClassVar[str] = "request_router"
    reached: ClassVar[set[str]] = set()  # every phase any request of any run was in
    ids = Bundle("ids")

    def __init__(self) -> None:
        super().__init__()
        self.machine: Machine[Any] = REQUEST_MACHINES[self.machine_name]
        self.spec = spec(self.machine_name)
        self.state: LoopState[Any] = new_loop(self.machine)
        self.counter = 0
        self.walks: dict[RequestId, Walk] = {}  # every admitted request
        self.refused: dict[RequestId, list[Intent]] = {}
        self.saw_transport_lost = False
        self.saw_drain = False
        self.outcomes: dict[RequestId, Any] = {}  # every terminal phase the loop reported
        self.stop_loops = 0
        self.failing = False

    def step(self, envelope: Envelope, event: Event | None = None) -> list[Intent]:
        """One loop step: file its intents under their requests, follow what each holds,
        collect the requests it settled (each exactly once, ever)."""
        self.failing = True  # until this step's checks pass
        self.state, intents = loop_step(self.state, envelope)
        by_request: dict[RequestId, list[Intent]] = {}
        for intent in intents:
            match intent:
                case LoopIntent(kind=kind):
                    self.stop_loops += kind is IntentKind.STOP_LOOP
                case PeerIntent():
                    raise AssertionError(f"a peer intent from a request loop: {intent}")
                case RefuseKv():  # an answer to a peer, the request left as it is (checked by the rules)
                    pass
                case _:
                    by_request.setdefault(intent.request_id, []).append(intent)
        for rid, mine in by_request.items():
            if rid in self.refused or (rid not in self.walks and isinstance(envelope, OpenRequest)):
                self.refused.setdefault(rid, []).extend(mine)
                continue
            assert rid in self.walks, f"intents for a request never admitted: {mine}"
            assert rid not in self.outcomes, f"{rid} got {mine} after it settled"
        moved = {envelope.request_id} if isinstance(envelope, ForRequest) else set(self.walks)
        for rid in moved & self.walks.keys() - self.outcomes.keys():
            self.walks[rid].take(self.machine_name, event, by_request.get(rid, []))
        for rid, record in self.state.settled.items():
            assert rid not in self.outcomes, f"{rid} settled twice"
            assert rid not in self.state.live
            self.outcomes[rid] = record.phase
            self.check_settled(rid, record.phase.value)
        self.failing = False
        return intents

    def check_settled(self, rid: RequestId, phase: str) -> None:
        walk = self.walks[rid]
        assert not walk.held, f"{rid} settled {phase} still holding {sorted(walk.held)}: {walk.intents}"
        problem = walk.reply_problem(self.machine_name, phase)
        assert problem is None, f"{rid} settled {phase}: {problem}: {walk.intents}"

    def deliver(self, rid: RequestId, event: Event) -> None:
        before = dict(self.state.live)
        walk = self.walks.get(rid)
        if walk is not None and rid in before:
            walk.phase = expected_target(self.spec, walk.phase, event.kind.value)
            self.reached.add(walk.phase)
        self.step(ForRequest(rid, event), event)
        for other, record in before.items():  # one request's event changes no other request
            if other != rid:
                assert self.state.live.get(other) == record

    @initialize()
    def start(self) -> None:
        self.step(ForLoop(LoopReady()))
        assert self.state.loop.phase is LoopPhase.SERVING

    @rule(target=ids)
    def open_request(self) -> RequestId:
        rid = RequestId(f"req-{self.counter}")
        self.counter += 1
        accepting = self.state.accepting
        if accepting:
            self.walks[rid] = Walk(self.machine.initial.value)
            self.reached.add(self.machine.initial.value)
        intents = self.step(OpenRequest(rid))
        if accepting:
            assert intents == []
        else:
            assert len(intents) == 1 and isinstance(intents[0], Reject)
            assert self.refused[rid] == intents
        return rid

    def next_kind(self, phase: str) -> st.SearchStrategy[EventKind]:
        """Mostly an edge the spec declares from `phase` forward (to a later phase in the
        spec's order that is not terminal; to `done` where none is), else any edge it
        declares, now and then any event at all."""
        order = self.spec.phases
        declared = [t for t in self.spec.transition if t.source == phase]
        allowed = [EventKind(t.event) for t in declared]
        later = [t for t in declared if order.index(t.target) > order.index(phase)
                 and t.target not in ("failed", "cancelled")]
        forward = [EventKind(t.event) for t in later if t.target not in self.spec.terminal] or [
            EventKind(t.event) for t in later]
        return st.integers(0, 99).flatmap(
            lambda roll: st.sampled_from(forward) if roll < 60 and forward
            else st.sampled_from(allowed) if roll < 92 and allowed
            else st.sampled_from(EventKind)
        )

    @precondition(lambda self: bool(self.state.live))
    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        """A few events for one live request, each drawn from what its phase allows."""
        rid = data.draw(st.sampled_from(sorted(self.state.live)), label="request")
        for _ in range(data.draw(st.integers(1, 6), label="events")):
            if rid not in self.state.live:
                break
            kind = data.draw(self.next_kind(self.walks[rid].phase), label="kind")
            self.deliver(rid, data.draw(EVENTS_BY_KIND[kind], label="event"))

    @rule(rid=ids, event=events)
    def stray_event(self, rid: RequestId, event: Event) -> None:
        """Any event for a request that is not live (settled, refused): absorbed, unless the spec's
        `absent` rule answers it (a KV pull refused), and nothing else moves."""
        if rid in self.state.live:
            return
        before = self.state.live
        intents = self.step(ForRequest(rid, event), event)
        assert [i.kind.value for i in intents] == list(self.spec.absent.get(event.kind.value, ()))
        assert all(isinstance(i, RefuseKv) and i.request_id == rid for i in intents)
        assert self.state.live == before

    @rule(rid=consumes(ids))
    def forget(self, rid: RequestId) -> None:
        """Stop sending stray events to a request (keeps the bundle small)."""

    # Stopping the loop ends a run's walk, so it waits until requests have had time to move.
    @precondition(lambda self: not self.state.stopped and self.counter >= 4)
    @rule()
    def drain(self) -> None:
        self.saw_drain = True
        self.step(ForLoop(DrainRequested()))

    @precondition(lambda self: not self.state.stopped and self.counter >= 4)
    @rule(detail=st.text(max_size=5))
    def lose_transport(self, detail: str) -> None:
        self.lose(detail)

    def lose(self, detail: str) -> None:
        self.saw_transport_lost = True
        for rid in self.state.live:
            walk = self.walks[rid]
            walk.phase = expected_target(self.spec, walk.phase, TransportLost.kind.value)
        self.step(ForLoop(TransportLost(detail)), TransportLost(detail))

    @invariant()
    def requests_match_the_spec(self) -> None:
        for rid, walk in self.walks.items():
            record = self.state.live.get(rid)
            assert record or rid in self.outcomes, f"{rid} vanished: neither live nor settled"
            phase = record.phase.value if record else self.outcomes[rid].value
            assert phase == walk.phase, rid

    @invariant()
    def each_request_holds_only_what_its_phase_may(self) -> None:
        for rid, record in self.state.live.items():
            extra = self.walks[rid].over_held(self.machine_name, record.phase.value)
            assert not extra, f"{rid} in {record.phase.value} holds {sorted(extra)}"

    @invariant()
    def each_request_is_live_or_terminal_exactly_once(self) -> None:
        assert not (self.state.live.keys() & self.outcomes.keys())
        assert set(self.walks) == set(self.state.live) | set(self.outcomes)
        for phase in self.outcomes.values():
            assert self.machine.is_terminal(phase)
        for intents in self.refused.values():
            assert len(intents) == 1 and isinstance(intents[0], Reject)

    @invariant()
    def loop_stops_iff_transport_lost_or_drain_finished(self) -> None:
        drain_finished = self.saw_drain and not self.state.live
        assert self.state.stopped == (self.saw_transport_lost or drain_finished)
        assert self.stop_loops == int(self.state.stopped), f"{self.stop_loops} stop_loop intents"

    def teardown(self) -> None:
        if self.failing:  # a step's check failed: that is the error to report, not what follows
            return
        if self.state.loop.phase is LoopPhase.DRAINING:  # let the drain finish: cancel the rest
            for rid in sorted(self.state.live):
                self.deliver(rid, ClientCancelled())
        if not self.state.stopped:
            self.lose("teardown")
        self.requests_match_the_spec()
        self.loop_stops_iff_transport_lost_or_drain_finished()
        assert not self.state.live
        assert set(self.outcomes) == set(self.walks)


def machine_class(name: str) -> type[LoopWithRequests]:
    return type(f"LoopOf_{name}", (LoopWithRequests,), {"machine_name": name, "reached": set()})


@pytest.mark.parametrize("name", sorted(REQUEST_MACHINES))
def test_requests_walk_every_phase_and_settle_clean(name: str) -> None:
    walker = machine_class(name)
    run_state_machine_as_test(walker, settings=settings(stateful_step_count=60))
    phases = set(spec(name).phases)
    assert walker.reached == phases, f"never reached: {sorted(phases - walker.reached)}"
