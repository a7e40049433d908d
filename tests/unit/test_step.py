"""Pure step functions, table-driven: each case asserts the exact next phase and intents."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import pytest

from statecore.errors import Code, ErrorInfo, Fault, client_error, peer_error
from statecore.events import (
    Admitted,
    ClientCancelled,
    DrainComplete,
    DrainRequested,
    Event,
    Finished,
    FirstToken,
    KvInstalled,
    KvReceived,
    KvRequested,
    KvTaken,
    LoopReady,
    PeerFailed,
    PrefillDone,
    PrefillLocally,
    ProbeFailed,
    ProbeSucceeded,
    Rejected,
    RetryRequested,
    StopMatched,
    Timer,
    TimerFired,
    TokenLogprobs,
    TokensGenerated,
    TransportLost,
)
from statecore.ids import PeerId, RequestId
from statecore.intents import (
    ArmTimer,
    CancelRemote,
    CancelTimer,
    Complete,
    FetchKv,
    InstallKv,
    Intent,
    IntentKind,
    LoopIntent,
    PeerIntent,
    RefuseKv,
    Reject,
    ReleaseKv,
    RespondTokens,
    SendKv,
    StartDecode,
    StartPrefill,
    StopDecoding,
)
from statecore.phases import DecodePhase, LoopPhase, PeerPhase, PrefillPhase, RouterPhase
from statecore.step import (
    LoopRecord,
    PeerRecord,
    RequestRecord,
    outcome_reason,
    step_loop,
    step_peer,
    step_request,
)
from statecore.table import DECODE_REQUEST, PREFILL_REQUEST, ROUTER_REQUEST, Machine

RID = RequestId("r1")
BAD = client_error("prompt is empty")
PEER = peer_error("decode node said no")


@dataclass(frozen=True)
class Case:
    machine: Machine[Any]
    phase: enum.Enum
    event: Event
    target: enum.Enum
    intents: list[Intent]


CASES = [
    # router: the happy path
    Case(ROUTER_REQUEST, RouterPhase.INTAKE, Admitted(5), RouterPhase.ROUTED,
         [ArmTimer(RID, Timer.DEADLINE), StartPrefill(RID)]),
    Case(ROUTER_REQUEST, RouterPhase.PREFILLING, FirstToken(42), RouterPhase.HANDING_OFF,
         [RespondTokens(RID, (42,)), StartDecode(RID)]),
    Case(ROUTER_REQUEST, RouterPhase.DECODING, TokensGenerated((7,)), RouterPhase.DECODING,
         [RespondTokens(RID, (7,))]),
    Case(ROUTER_REQUEST, RouterPhase.DECODING, Finished("length"), RouterPhase.DONE,
         [CancelTimer(RID), Complete(RID, "length")]),
    Case(ROUTER_REQUEST, RouterPhase.DECODING, StopMatched(), RouterPhase.DONE,
         [CancelTimer(RID), CancelRemote(RID, "stop"), Complete(RID, "stop", 1)]),
    # the first token ends it: the nodes hear it was a normal end, not a cancellation
    Case(ROUTER_REQUEST, RouterPhase.PREFILLING, Finished("stop"), RouterPhase.DONE,
         [CancelTimer(RID), CancelRemote(RID, "stop"), Complete(RID, "stop", 1)]),
    Case(ROUTER_REQUEST, RouterPhase.PREFILLING, RetryRequested(PEER), RouterPhase.ROUTED,
         [StartPrefill(RID)]),
    # router: failure and cancellation free what the phase holds
    Case(ROUTER_REQUEST, RouterPhase.INTAKE, Rejected(BAD), RouterPhase.FAILED, [Reject(RID, BAD)]),
    Case(ROUTER_REQUEST, RouterPhase.HANDING_OFF, PeerFailed(PEER), RouterPhase.FAILED,
         [CancelTimer(RID), CancelRemote(RID), Reject(RID, PEER)]),
    Case(ROUTER_REQUEST, RouterPhase.DECODING, ClientCancelled(), RouterPhase.CANCELLED,
         [CancelTimer(RID), CancelRemote(RID)]),
    # prefill node
    Case(PREFILL_REQUEST, PrefillPhase.INTAKE, Admitted(3), PrefillPhase.PREFILL,
         [ArmTimer(RID, Timer.DEADLINE), StartPrefill(RID)]),
    Case(PREFILL_REQUEST, PrefillPhase.PREFILL, PrefillDone(9, 1024), PrefillPhase.HANDOFF,
         [ArmTimer(RID, Timer.KV_LEASE), RespondTokens(RID, (9,))]),
    Case(PREFILL_REQUEST, PrefillPhase.HANDOFF, KvRequested(), PrefillPhase.HANDOFF, [SendKv(RID)]),
    # a pull before the KV is held is answered, and the request goes on
    Case(PREFILL_REQUEST, PrefillPhase.PREFILL, KvRequested(), PrefillPhase.PREFILL,
         [RefuseKv(RID, ErrorInfo(Fault.PEER, Code.KV_NOT_FOUND, "no KV held for r1 (it is in prefill)"))]),
    Case(PREFILL_REQUEST, PrefillPhase.HANDOFF, KvTaken(), PrefillPhase.DONE,
         [CancelTimer(RID), ReleaseKv(RID)]),
    Case(PREFILL_REQUEST, PrefillPhase.HANDOFF, StopMatched("length"), PrefillPhase.DONE,
         [CancelTimer(RID), ReleaseKv(RID)]),
    Case(PREFILL_REQUEST, PrefillPhase.HANDOFF, ClientCancelled(), PrefillPhase.CANCELLED,
         [CancelTimer(RID), ReleaseKv(RID)]),
    Case(PREFILL_REQUEST, PrefillPhase.HANDOFF, TimerFired(Timer.KV_LEASE), PrefillPhase.FAILED,
         [CancelTimer(RID), ReleaseKv(RID), Reject(RID, ErrorInfo(
             Fault.PEER, Code.LEASE_EXPIRED,
             "the held KV cache was never taken before its lease expired"))]),
    # decode node
    Case(DECODE_REQUEST, DecodePhase.INTAKE, Admitted(3), DecodePhase.RECEIVING_KV,
         [ArmTimer(RID, Timer.DEADLINE), FetchKv(RID)]),
    Case(DECODE_REQUEST, DecodePhase.INTAKE, PrefillLocally(), DecodePhase.PREFILLING_LOCALLY,
         [ArmTimer(RID, Timer.DEADLINE), StartPrefill(RID)]),
    Case(DECODE_REQUEST, DecodePhase.RECEIVING_KV, KvReceived(100), DecodePhase.INSTALLING,
         [InstallKv(RID)]),
    Case(DECODE_REQUEST, DecodePhase.INSTALLING, KvInstalled(), DecodePhase.DECODING,
         [ReleaseKv(RID), StartDecode(RID)]),
    Case(DECODE_REQUEST, DecodePhase.DECODING, TransportLost("peer EOF"), DecodePhase.FAILED,
         [CancelTimer(RID), StopDecoding(RID), Reject(RID, ErrorInfo(
             Fault.TRANSPORT, Code.TRANSPORT_LOST,
             "a connection this request depended on was lost while it was decoding: peer EOF"))]),
    # a peer's lost connection: the request's error says which node it comes from
    Case(DECODE_REQUEST, DecodePhase.RECEIVING_KV, TransportLost("stream cut", "http://p"),
         DecodePhase.FAILED,
         [CancelTimer(RID), CancelRemote(RID), Reject(RID, ErrorInfo(
             Fault.TRANSPORT, Code.TRANSPORT_LOST,
             "a connection this request depended on was lost while it was receiving_kv: stream cut",
             origin="http://p"))]),
    Case(DECODE_REQUEST, DecodePhase.RECEIVING_KV, PeerFailed(PEER), DecodePhase.FAILED,
         [CancelTimer(RID), CancelRemote(RID), Reject(RID, PEER)]),
    Case(DECODE_REQUEST, DecodePhase.DECODING, ClientCancelled(), DecodePhase.CANCELLED,
         [CancelTimer(RID), StopDecoding(RID)]),
    Case(DECODE_REQUEST, DecodePhase.RECEIVING_KV, StopMatched(), DecodePhase.DONE,
         [CancelTimer(RID), ReleaseKv(RID), Complete(RID, "stop", 1)]),
]


def _case_id(case: Case) -> str:
    return f"{case.machine.name}:{case.phase.value}:{case.event.kind.value}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_step_request(case: Case) -> None:
    record = RequestRecord(RID, case.phase)
    moved, intents = step_request(case.machine, record, case.event)
    assert moved.phase is case.target
    assert intents == case.intents


# The token path: a decode step's tokens are one event and one reply, in their order, logprobs
# beside them; a first token goes alone; the count of tokens out grows by a step's tokens; an
# ending EOS (never among the tokens) is counted once, by the completion.
STEP_LOGPROBS = (TokenLogprobs(-0.5, ((7, -0.5), (3, -1.5))), TokenLogprobs(-1.0), TokenLogprobs(-2.0))
TOKEN_PATH = [
    (DECODE_REQUEST, DecodePhase.DECODING, TokensGenerated((7, 8, 9), STEP_LOGPROBS), DecodePhase.DECODING,
     [RespondTokens(RID, (7, 8, 9), STEP_LOGPROBS)], 3),
    (DECODE_REQUEST, DecodePhase.DECODING, TokensGenerated((9, 7)), DecodePhase.DECODING,
     [RespondTokens(RID, (9, 7))], 2),
    (ROUTER_REQUEST, RouterPhase.HANDING_OFF, TokensGenerated((4, 5, 6, 4)), RouterPhase.DECODING,
     [RespondTokens(RID, (4, 5, 6, 4))], 4),
    (DECODE_REQUEST, DecodePhase.PREFILLING_LOCALLY, PrefillDone(9, 10, STEP_LOGPROBS[0]),
     DecodePhase.INSTALLING, [RespondTokens(RID, (9,), STEP_LOGPROBS[:1]), InstallKv(RID)], 1),
    (ROUTER_REQUEST, RouterPhase.PREFILLING, FirstToken(42), RouterPhase.HANDING_OFF,
     [RespondTokens(RID, (42,)), StartDecode(RID)], 1),
    (DECODE_REQUEST, DecodePhase.DECODING, Finished("stop"), DecodePhase.DONE,
     [CancelTimer(RID), Complete(RID, "stop", 1)], 0),
    (DECODE_REQUEST, DecodePhase.DECODING, Finished("length"), DecodePhase.DONE,
     [CancelTimer(RID), Complete(RID, "length", 0)], 0),
]


@pytest.mark.parametrize(("machine", "phase", "event", "target", "intents", "tokens"), TOKEN_PATH)
def test_the_token_path(machine: Any, phase: Any, event: Event, target: Any, intents: list[Any],
                        tokens: int) -> None:
    record = RequestRecord(RID, phase, tokens_out=5)
    moved, made = step_request(machine, record, event)
    assert (moved.phase, made, moved.tokens_out) == (target, intents, 5 + tokens)


def test_failure_records_the_error_and_terminal_absorbs() -> None:
    record = RequestRecord(RID, RouterPhase.DECODING)
    failed, _ = step_request(ROUTER_REQUEST, record, PeerFailed(PEER))
    assert failed.error == PEER
    again, intents = step_request(ROUTER_REQUEST, failed, TokensGenerated((3,)))
    assert again == failed and intents == []


def test_undeclared_pair_fails_the_request_with_a_reason() -> None:
    record = RequestRecord(RID, PrefillPhase.PREFILL)
    moved, intents = step_request(PREFILL_REQUEST, record, KvInstalled())
    assert moved.phase is PrefillPhase.FAILED
    assert moved.error is not None and moved.error.code is Code.ILLEGAL_TRANSITION
    assert [i.kind for i in intents] == [
        IntentKind.CANCEL_TIMER, IntentKind.RELEASE_KV, IntentKind.REJECT]


def test_cancelled_records_a_cancellation_error() -> None:
    record = RequestRecord(RID, RouterPhase.PREFILLING)
    moved, _ = step_request(ROUTER_REQUEST, record, ClientCancelled())
    assert moved.phase is RouterPhase.CANCELLED
    assert moved.error is not None and moved.error.code is Code.CANCELLED


@pytest.mark.parametrize(
    ("phase", "event", "target", "kinds"),
    [
        (LoopPhase.STARTING, LoopReady(), LoopPhase.SERVING, [IntentKind.START_ACCEPTING]),
        (LoopPhase.SERVING, PeerFailed(PEER), LoopPhase.SERVING, []),
        (LoopPhase.SERVING, DrainRequested(), LoopPhase.DRAINING,
         [IntentKind.STOP_ACCEPTING, IntentKind.ARM_DRAIN]),
        (LoopPhase.DRAINING, DrainComplete(), LoopPhase.STOPPED, [IntentKind.STOP_LOOP]),
        (LoopPhase.SERVING, TransportLost(), LoopPhase.STOPPED,
         [IntentKind.STOP_ACCEPTING, IntentKind.STOP_LOOP]),
        (LoopPhase.SERVING, KvTaken(), LoopPhase.SERVING, [IntentKind.REPORT_BUG]),
    ],
)
def test_step_loop(
    phase: LoopPhase, event: Event, target: LoopPhase, kinds: list[IntentKind]
) -> None:
    moved, intents = step_loop(LoopRecord(phase), event)
    assert moved.phase is target
    assert [i.kind for i in intents] == kinds
    assert all(isinstance(i, LoopIntent) for i in intents)


def test_loop_illegal_transition_is_reported_not_raised() -> None:
    moved, intents = step_loop(LoopRecord(LoopPhase.SERVING), Finished("stop"))
    assert moved.phase is LoopPhase.SERVING
    assert moved.bugs and "finished" in moved.bugs[0]
    assert isinstance(intents[0], LoopIntent) and "finished" in intents[0].detail


def test_peer_circuit_breaker_walk() -> None:
    peer = PeerId("http://decode-1")
    record = PeerRecord(peer)
    walk: list[tuple[Event, PeerPhase, list[IntentKind]]] = [
        (ProbeSucceeded(), PeerPhase.UP, [IntentKind.MARK_AVAILABLE]),
        (ProbeFailed(), PeerPhase.SUSPECT, []),
        (ProbeFailed(), PeerPhase.DOWN, [IntentKind.MARK_UNAVAILABLE, IntentKind.ARM_COOLDOWN]),
        (ProbeSucceeded(), PeerPhase.DOWN, []),  # half-open only after the cooldown
        (TimerFired(Timer.PEER_COOLDOWN), PeerPhase.PROBING, [IntentKind.SEND_PROBE]),
        (ProbeFailed(), PeerPhase.DOWN, [IntentKind.ARM_COOLDOWN]),
        (TimerFired(Timer.PEER_COOLDOWN), PeerPhase.PROBING, [IntentKind.SEND_PROBE]),
        (ProbeSucceeded(), PeerPhase.UP, [IntentKind.MARK_AVAILABLE]),
    ]
    for event, target, kinds in walk:
        record, intents = step_peer(record, event)
        assert record.phase is target
        assert [i.kind for i in intents] == kinds
        assert all(isinstance(i, PeerIntent) and i.peer == peer for i in intents)


def test_the_loop_state_does_not_grow_with_requests_served() -> None:
    """A finished request is reported in `settled` for one step only, then the state forgets it:
    what one event costs never depends on how many requests the node has served, and a finished
    request id may be used again."""
    from statecore.loop import ForLoop, ForRequest, OpenRequest, loop_step, new_loop
    from statecore.table import DECODE_REQUEST

    state, _ = loop_step(new_loop(DECODE_REQUEST), ForLoop(LoopReady()))
    for n in range(50):
        rid = RequestId(f"r{n % 3}")  # ids come back once their request has ended
        state, intents = loop_step(state, OpenRequest(rid))
        assert intents == []
        state, _ = loop_step(state, ForRequest(rid, ClientCancelled()))
        assert list(state.settled) == [rid] and DECODE_REQUEST.is_terminal(state.settled[rid].phase)
        assert not state.live
    state, _ = loop_step(state, ForRequest(RequestId("gone"), ClientCancelled()))  # absorbed
    assert not state.settled and not state.live


def test_a_kv_pull_for_a_request_not_held_is_refused_and_anything_else_absorbed() -> None:
    """The prefill machine's `absent` rule: a pull for a request the node never had (or that
    ended) gets its answer from the core; any other late event gets nothing."""
    from statecore.loop import ForLoop, ForRequest, loop_step, new_loop

    state, _ = loop_step(new_loop(PREFILL_REQUEST), ForLoop(LoopReady()))
    gone = RequestId("gone")
    after, intents = loop_step(state, ForRequest(gone, KvRequested()))
    assert intents == [RefuseKv(gone, ErrorInfo(Fault.PEER, Code.KV_NOT_FOUND,
                                                "no KV held for gone (no such request here)"))]
    assert after == state
    assert loop_step(state, ForRequest(gone, KvTaken()))[1] == []
    assert loop_step(loop_step(new_loop(DECODE_REQUEST), ForLoop(LoopReady()))[0],
                     ForRequest(gone, KvRequested()))[1] == []  # only a prefill node holds KV to pull


OUTCOMES: list[tuple[Machine[Any], enum.Enum, Event, str, str]] = [
    (ROUTER_REQUEST, RouterPhase.DECODING, Finished("length"), "done", "length"),
    (ROUTER_REQUEST, RouterPhase.DECODING, StopMatched(), "done", "stop"),
    (ROUTER_REQUEST, RouterPhase.DECODING, ClientCancelled(), "cancelled", "cancelled"),
    (ROUTER_REQUEST, RouterPhase.HANDING_OFF, PeerFailed(PEER), "failed", "peer_failed"),
    (PREFILL_REQUEST, PrefillPhase.HANDOFF, KvTaken(), "done", "handed_off"),
    (PREFILL_REQUEST, PrefillPhase.HANDOFF, StopMatched("stop"), "done", "stop"),
    (PREFILL_REQUEST, PrefillPhase.HANDOFF, StopMatched("length"), "done", "length"),
    (PREFILL_REQUEST, PrefillPhase.HANDOFF, ClientCancelled(), "cancelled", "cancelled"),
    (PREFILL_REQUEST, PrefillPhase.HANDOFF, TimerFired(Timer.KV_LEASE), "failed", "kv_lease_expired"),
    (DECODE_REQUEST, DecodePhase.DECODING, Finished("stop"), "done", "stop"),
    (DECODE_REQUEST, DecodePhase.DECODING, StopMatched(), "done", "stop"),
    (DECODE_REQUEST, DecodePhase.DECODING, ClientCancelled(), "cancelled", "cancelled"),
    (DECODE_REQUEST, DecodePhase.RECEIVING_KV, StopMatched(), "done", "stop"),
    (DECODE_REQUEST, DecodePhase.DECODING, TransportLost(), "failed", "transport_lost"),
]


@pytest.mark.parametrize(("machine", "phase", "event", "state", "reason"), OUTCOMES,
                         ids=[f"{m.name}:{p.value}:{e.kind.value}" for m, p, e, _, _ in OUTCOMES])
def test_terminal_reasons_are_the_same_words_on_every_node(
    machine: Machine[Any], phase: enum.Enum, event: Event, state: str, reason: str
) -> None:
    """done/stop, done/length, cancelled, failed/<code>: a normal end or a cancellation is
    never `failed`, on any node."""
    moved, _ = step_request(machine, RequestRecord(RID, phase), event)
    assert (moved.phase.value, outcome_reason(machine, moved)) == (state, reason)
