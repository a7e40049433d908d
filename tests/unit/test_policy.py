"""The core's policy: admission, a peer's failure, how a generation ends, error to event."""

from __future__ import annotations

from dataclasses import replace

import pytest

from statecore import policy
from statecore.errors import Code, ErrorInfo, Fault
from statecore.events import DrainRequested, EngineFailed, EventKind, LoopReady, PeerFailed, TransportLost
from statecore.ids import RequestId
from statecore.intents import IntentKind, Reject
from statecore.loop import ForLoop, OpenRequest, loop_step, new_loop
from statecore.phases import LoopPhase
from statecore.policy import (
    admission,
    after_first_token,
    blames_peer,
    decoded_tokens,
    failure_event,
    finish_before_decoding,
    first_token_finish,
    is_eos,
    length_finish,
    peer_failure,
    token_finish,
)
from statecore.routing import avoiding
from statecore.table import DECODE_REQUEST, SERVING_LOOP, Edge


def test_only_a_serving_loop_admits() -> None:
    assert admission(LoopPhase.SERVING, 0) is None
    for phase in (LoopPhase.STARTING, LoopPhase.DRAINING, LoopPhase.STOPPED):
        refused = admission(phase, 0)
        assert refused is not None and refused.code is Code.DRAINING and refused.http_status == 503
        assert "not accepting requests" in refused.message and phase.value in refused.message


def test_the_in_flight_limit_answers_overloaded() -> None:
    assert admission(LoopPhase.SERVING, 2, max_live=3) is None
    refused = admission(LoopPhase.SERVING, 3, max_live=3)
    assert refused is not None and refused.code is Code.OVERLOADED and refused.http_status == 429
    assert "limit 3" in refused.message
    # a loop that does not admit says so, whatever the count
    draining = admission(LoopPhase.DRAINING, 3, max_live=3)
    assert draining is not None and draining.code is Code.DRAINING


def _error(fault: Fault, code: Code = Code.PEER_FAILED) -> ErrorInfo:
    return ErrorInfo(fault, code, "x")


@pytest.mark.parametrize(
    ("fault", "retry", "blame"),
    [
        (Fault.PEER, True, False),
        (Fault.TRANSPORT, True, True),
        (Fault.OVERLOADED, True, False),
        (Fault.CLIENT, False, False),
        (Fault.UNSUPPORTED, False, False),
        (Fault.BUG, False, False),
        (Fault.CANCELLED, False, False),
    ],
)
def test_a_peer_failure_is_retried_and_blamed_by_fault(fault: Fault, retry: bool, blame: bool) -> None:
    verdict = peer_failure(_error(fault), first_token_sent=False, attempts=1, max_attempts=3)
    assert (verdict.retry, verdict.blame) == (retry, blame)
    assert blames_peer(_error(fault)) is blame


def test_no_retry_after_the_first_token_or_the_last_attempt() -> None:
    error = _error(Fault.TRANSPORT)
    assert not peer_failure(error, first_token_sent=True, attempts=1, max_attempts=3).retry
    assert not peer_failure(error, first_token_sent=False, attempts=3, max_attempts=3).retry
    backoffs = [peer_failure(error, first_token_sent=False, attempts=n, max_attempts=9).backoff_s
                for n in (1, 2, 3)]
    assert backoffs == [0.05, 0.1, 0.2]


def test_how_a_generation_ends() -> None:
    eos = {7}
    assert is_eos(7, eos, ignore_eos=False) and not is_eos(7, eos, ignore_eos=True)
    assert token_finish(7, eos, ignore_eos=False, remaining=5) == "stop"
    assert token_finish(7, eos, ignore_eos=True, remaining=5) is None
    assert token_finish(3, eos, ignore_eos=False, remaining=0) == "length"
    assert token_finish(3, eos, ignore_eos=False, remaining=1) is None
    assert first_token_finish(True, hands_off=False) == "stop"
    assert first_token_finish(True, hands_off=True) is None  # the router decides from is_eos
    assert first_token_finish(False, hands_off=False) is None
    assert after_first_token(1) == "length" and after_first_token(2) is None
    assert length_finish(0) == "length" and length_finish(1) is None
    assert finish_before_decoding(7, eos, ignore_eos=False, max_tokens=1) == "stop"  # EOS first
    assert finish_before_decoding(7, eos, ignore_eos=True, max_tokens=1) == "length"
    assert finish_before_decoding(3, eos, ignore_eos=False, max_tokens=2) is None
    # a step's tokens: an ending EOS is not sent, a "length" ending token is; only the last ends it
    assert decoded_tokens([5, 6, 2], "stop") == (2, "stop")
    assert decoded_tokens([2], "stop") == (0, "stop")
    assert decoded_tokens([5, 6, 7], "length") == (3, "length")
    assert decoded_tokens([5, 6], None) == (2, None)


def test_which_event_an_error_becomes() -> None:
    lost = failure_event(ErrorInfo(Fault.TRANSPORT, Code.TRANSPORT_LOST, "gone"))
    assert lost == TransportLost("gone")
    # where the lost connection was a peer's, the request's error still says which (its origin)
    assert failure_event(ErrorInfo(Fault.TRANSPORT, Code.TRANSPORT_LOST, "gone", origin="http://p")) == \
        TransportLost("gone", "http://p")
    assert isinstance(failure_event(_error(Fault.PEER)), PeerFailed)
    assert isinstance(failure_event(_error(Fault.TRANSPORT, Code.TIMEOUT)), PeerFailed)
    for fault in (Fault.BUG, Fault.OVERLOADED, Fault.CLIENT, Fault.UNSUPPORTED):
        assert isinstance(failure_event(_error(fault, Code.INTERNAL)), EngineFailed)


def test_the_loop_refuses_at_the_door_what_admission_refuses() -> None:
    starting = new_loop(DECODE_REQUEST)
    state, intents = loop_step(starting, OpenRequest(RequestId("early")))
    assert [type(i) for i in intents] == [Reject] and not state.live
    assert isinstance(intents[0], Reject) and intents[0].error.code is Code.DRAINING
    state, _ = loop_step(starting, ForLoop(LoopReady()))
    state, intents = loop_step(state, OpenRequest(RequestId("in")))
    assert intents == [] and RequestId("in") in state.live
    state, _ = loop_step(state, ForLoop(DrainRequested()))
    state, intents = loop_step(state, OpenRequest(RequestId("late")))
    assert isinstance(intents[0], Reject) and "draining" in intents[0].error.message


def test_admission_is_read_off_the_loop_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table's request_opened edge decides: a serving loop whose edge refused would refuse."""
    declared = dict(SERVING_LOOP.declared)
    declared[(LoopPhase.SERVING, EventKind.REQUEST_OPENED)] = Edge(
        LoopPhase.SERVING, (IntentKind.REFUSE_REQUEST,))
    monkeypatch.setattr(policy, "SERVING_LOOP", replace(SERVING_LOOP, declared=declared))
    refused = policy.admission(LoopPhase.SERVING, 0)
    assert refused is not None and refused.code is Code.DRAINING


# -- what a request may ask, the finish reason a client reads, a routed request's retries --------


@pytest.mark.parametrize(("prompt", "max_tokens", "context", "overflow"), [
    (10, None, 16, None),
    (15, None, 16, None),  # one token of room is enough
    (16, None, 16, "prompt"),  # no room for one generated token
    (17, 1, 16, "prompt"),  # the prompt is named first
    (10, 6, 16, None),  # exactly the context
    (10, 7, 16, "max_tokens"),
])
def test_the_context_names_what_does_not_fit(prompt: int, max_tokens: int | None, context: int,
                                             overflow: str | None) -> None:
    assert policy.context_overflow(prompt, max_tokens, context) == overflow


@pytest.mark.parametrize(("stops", "ignore_eos", "conflict"), [
    (False, False, None), (True, False, "stop"), (False, True, "ignore_eos"), (True, True, "stop")])
def test_a_grammar_refuses_what_would_cut_it_or_run_past_it(stops: bool, ignore_eos: bool,
                                                            conflict: str | None) -> None:
    assert policy.grammar_end_conflict(has_stop_strings=stops, ignore_eos=ignore_eos) == conflict


def test_the_finish_reason_a_client_reads() -> None:
    assert policy.counts_ending_token("stop") and not policy.counts_ending_token("length")
    assert policy.text_finish(None, stop_string_matched=True) == "stop"
    assert policy.text_finish("length", stop_string_matched=True) == "stop"
    assert policy.text_finish("length", stop_string_matched=False) == "length"
    assert policy.reply_finish("stop", called_tools=True) == policy.TOOL_CALLS == "tool_calls"
    assert policy.reply_finish("length", called_tools=True) == "length"  # a call may be cut short
    assert policy.reply_finish("stop", called_tools=False) == "stop"


def test_the_first_token_ends_a_request_only_as_eos() -> None:
    assert policy.first_token_ends(2, {2}, ignore_eos=False)
    assert not policy.first_token_ends(2, {2}, ignore_eos=True)
    assert not policy.first_token_ends(3, {2}, ignore_eos=False)


def test_a_retried_request_avoids_the_nodes_its_failed_attempts_used() -> None:
    lost = ErrorInfo(Fault.TRANSPORT, Code.TRANSPORT_LOST, "gone")
    state = policy.RetryState().started()
    assert state.node_request_id(RequestId("r")) == "r"
    state, verdict = policy.attempt_failed(state, lost, used=("p0", "d0"), first_token_sent=False,
                                           max_attempts=3)
    assert verdict == policy.PeerFailureVerdict(blame=True, retry=True, backoff_s=0.05)
    assert state.tried == {"p0", "d0"}
    state = state.started()
    assert state.node_request_id(RequestId("r")) == "r.retry1"
    state, verdict = policy.attempt_failed(state, lost, used=(None, "d1"), first_token_sent=False,
                                           max_attempts=3)
    assert verdict.retry and verdict.backoff_s == 0.1 and state.tried == {"p0", "d0", "d1"}
    # a token already sent: no retry, and the nodes are not marked
    after, verdict = policy.attempt_failed(state.started(), lost, used=("p2",), first_token_sent=True,
                                           max_attempts=3)
    assert not verdict.retry and after.tried == state.tried


@pytest.mark.parametrize(("prompt", "can_travel", "refused"), [
    (99, False, False),  # the decode node prefills it itself: nothing travels
    (100, False, True),  # it may travel, and cannot
    (100, True, False),
])
def test_a_routed_request_whose_cache_cannot_travel_is_refused_only_if_it_may_travel(
    prompt: int, can_travel: bool, refused: bool
) -> None:
    error = policy.travel_refusal(prompt, 100, can_travel=can_travel, untravelable_classes=("OpaqueCache",))
    assert (error is not None) == refused
    if error is not None:
        assert error.code is Code.UNSUPPORTED_CACHE and "OpaqueCache" in error.message
    # local_below 0: every prompt goes through a prefill node
    assert policy.travel_refusal(5, 0, can_travel=False, untravelable_classes=()) is not None


def test_avoiding_keeps_every_node_when_nothing_else_is_left() -> None:
    assert avoiding(["a", "b", "c"], {"b"}) == ["a", "c"]
    assert avoiding(["a", "b"], {"a", "b"}) == ["a", "b"]
    assert avoiding([], {"a"}) == []


def test_avoiding_falls_back_on_the_callers_own_pick_when_it_has_one() -> None:
    # a choice of n > 1 follows its siblings' decode nodes only where this attempt does not avoid
    # them; else nothing, and the caller takes the route's pick
    assert avoiding(["a", "b"], {"a"}, otherwise=()) == ["b"]
    assert avoiding(["a", "b"], {"a", "b"}, otherwise=()) == []
    assert avoiding(["a", "b"], {"a", "b"}, otherwise=["c"]) == ["c"]
