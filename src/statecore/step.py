"""Pure step functions: (record, event) -> (record, intents), read off the tables.

`step_request`, `step_loop` and `step_peer` look the edge up in the machine's total table,
move the record with `dataclasses.replace`, and build each intent the edge names from the
record and the event. They never raise for any (phase, event) pair: an undeclared pair is a
table edge too (a request fails with ILLEGAL_TRANSITION; a loop or a peer reports a bug and
stays). This module must never import trio, httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Generic, TypeVar, assert_never

from statecore.errors import Code, ErrorInfo, Fault, bug
from statecore.events import (
    Admitted,
    ClientCancelled,
    DecodeStarted,
    Dispatched,
    DrainComplete,
    DrainRequested,
    EngineFailed,
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
    RequestOpened,
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
    loop_kind,
    peer_kind,
)
from statecore.phases import LoopPhase, PeerPhase
from statecore.policy import STOP, counts_ending_token
from statecore.table import PEER_HEALTH, SERVING_LOOP, Edge, Machine

P = TypeVar("P", bound=enum.Enum)


@dataclass(frozen=True, slots=True)
class RequestRecord(Generic[P]):
    """One request's life on one node."""

    request_id: RequestId
    phase: P
    error: ErrorInfo | None = None
    finish_reason: str | None = None
    tokens_out: int = 0


@dataclass(frozen=True, slots=True)
class LoopRecord:
    phase: LoopPhase = LoopPhase.STARTING
    bugs: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PeerRecord:
    peer: PeerId
    phase: PeerPhase = PeerPhase.UNKNOWN
    bugs: tuple[str, ...] = ()


def new_request(machine: Machine[P], request_id: RequestId) -> RequestRecord[P]:
    return RequestRecord(request_id=request_id, phase=machine.initial)


def event_error(event: Event) -> ErrorInfo | None:
    """The error an event carries, if it is a failure event."""
    match event:
        case Rejected(error=error) | PeerFailed(error=error) | EngineFailed(error=error):
            return error
        case RetryRequested(error=error):
            return error
        case (
            Admitted() | Dispatched() | PrefillDone() | FirstToken() | DecodeStarted()
            | TokensGenerated() | Finished() | StopMatched() | PrefillLocally() | KvRequested()
            | KvTaken() | KvReceived() | KvInstalled() | ClientCancelled() | TimerFired()
            | TransportLost() | RequestOpened() | LoopReady() | DrainRequested() | DrainComplete()
            | ProbeSucceeded() | ProbeFailed()
        ):
            return None
        case _:
            assert_never(event)


def _normal_end(event: Event) -> str | None:
    """How an event ends a request normally ("stop", "length"), or None if it does not."""
    match event:
        case Finished(finish_reason=reason) | StopMatched(finish_reason=reason):
            return reason
        case _:
            return None


HANDED_OFF = "handed_off"
CANCELLED = "cancelled"


def outcome_reason(machine: Machine[P], record: RequestRecord[P]) -> str:
    """Why a terminal request ended, in the same words on every node: for `done` how it ended
    ("stop", "length", or "handed_off": a prefill node's part ended when the decode node took
    the cache); for `cancelled` "cancelled"; for `failed` the error code."""
    if record.phase is machine.cancelled and machine.cancelled is not machine.failure:
        return CANCELLED
    if record.phase is machine.failure:
        return (record.error.code if record.error else Code.INTERNAL).value
    return record.finish_reason or HANDED_OFF


def _tokens_of(event: Event) -> tuple[tuple[int, ...], tuple[TokenLogprobs, ...] | None] | None:
    """The tokens an event carries, with their logprobs (None: not asked), in the form a reply
    sends them: a step's tokens as they came, a first token alone."""
    match event:
        case TokensGenerated(tokens=tokens, logprobs=logprobs):
            return tokens, logprobs
        case FirstToken(token=token, logprobs=logprobs) | PrefillDone(first_token=token, logprobs=logprobs):
            return (token,), None if logprobs is None else (logprobs,)
        case _:
            return None


_MESSAGES: dict[Code, str] = {
    Code.TIMEOUT: "the request's deadline passed while it was {phase}",
    Code.LEASE_EXPIRED: "the held KV cache was never taken before its lease expired",
    Code.TRANSPORT_LOST: "a connection this request depended on was lost while it was {phase}",
    Code.CANCELLED: "the request was cancelled while it was {phase}",
    Code.ILLEGAL_TRANSITION: "event '{event}' is not expected while a request is {phase}",
}
_FAULTS: dict[Code, Fault] = {
    Code.TIMEOUT: Fault.PEER,
    Code.LEASE_EXPIRED: Fault.PEER,
    Code.TRANSPORT_LOST: Fault.TRANSPORT,
    Code.CANCELLED: Fault.CANCELLED,
    Code.ILLEGAL_TRANSITION: Fault.BUG,
}


def _edge_error(edge: Edge[P], phase: P, event: Event) -> ErrorInfo:
    """The error for a failure edge: the event's own, else one made from the edge's code.

    An undeclared pair is always an illegal transition, whatever the event carries."""
    carried = event_error(event)
    if carried is not None and edge.declared:
        return carried
    code = edge.code or Code.INTERNAL
    template = _MESSAGES.get(code, "request failed while {phase}")
    message = template.format(phase=str(phase.value), event=event.kind.value)
    origin = None
    if isinstance(event, TransportLost):
        origin = event.origin
        if event.detail:
            message = f"{message}: {event.detail}"  # which transport, and why (e.g. a hung engine)
    return ErrorInfo(_FAULTS.get(code, Fault.BUG), code, message, origin=origin)


def _no_kv(rid: RequestId, why: str) -> ErrorInfo:
    return ErrorInfo(Fault.PEER, Code.KV_NOT_FOUND, f"no KV held for {rid} ({why})")


def _build_request_intent(
    kind: IntentKind, rid: RequestId, edge: Edge[P], phase: P, event: Event
) -> Intent:
    match kind:
        case IntentKind.START_PREFILL:
            return StartPrefill(rid)
        case IntentKind.START_DECODE:
            return StartDecode(rid)
        case IntentKind.FETCH_KV:
            return FetchKv(rid)
        case IntentKind.INSTALL_KV:
            return InstallKv(rid)
        case IntentKind.SEND_KV:
            return SendKv(rid)
        case IntentKind.REFUSE_KV:
            return RefuseKv(rid, _no_kv(rid, f"it is in {phase.value}"))
        case IntentKind.RELEASE_KV:
            return ReleaseKv(rid)
        case IntentKind.STOP_DECODING:
            return StopDecoding(rid)
        case IntentKind.CANCEL_REMOTE:
            return CancelRemote(rid, _normal_end(event))
        case IntentKind.ARM_DEADLINE:
            return ArmTimer(rid, Timer.DEADLINE)
        case IntentKind.ARM_LEASE:
            return ArmTimer(rid, Timer.KV_LEASE)
        case IntentKind.CANCEL_TIMER:
            return CancelTimer(rid)
        case IntentKind.RESPOND_TOKEN:
            carried = _tokens_of(event)
            if carried is None:  # a table edge names RESPOND_TOKEN on a token-less event
                missing = f"no token in '{event.kind.value}' at {phase.value}"
                return Reject(rid, bug(missing, Code.ILLEGAL_TRANSITION))
            return RespondTokens(rid, *carried)
        case IntentKind.COMPLETE:
            reason = _normal_end(event) or STOP
            return Complete(rid, reason, int(counts_ending_token(reason)))
        case IntentKind.REJECT:
            return Reject(rid, _edge_error(edge, phase, event))
        case (
            IntentKind.ADMIT_REQUEST | IntentKind.REFUSE_REQUEST
            | IntentKind.START_ACCEPTING | IntentKind.STOP_ACCEPTING | IntentKind.ARM_DRAIN
            | IntentKind.STOP_LOOP | IntentKind.REPORT_BUG | IntentKind.MARK_AVAILABLE
            | IntentKind.MARK_UNAVAILABLE | IntentKind.ARM_COOLDOWN | IntentKind.SEND_PROBE
        ):
            misplaced = f"loop/peer intent {kind.value} on a request edge"
            return Reject(rid, bug(misplaced, Code.ILLEGAL_TRANSITION))
        case _:
            assert_never(kind)


def step_absent(machine: Machine[P], request_id: RequestId, event: Event) -> list[Intent]:
    """An event for a request this node does not hold: what the machine's `absent` rule asks
    (a KV pull is refused), else nothing (a late event is absorbed)."""
    intents: list[Intent] = []
    for kind in machine.absent.get(event.kind, ()):
        if kind is IntentKind.REFUSE_KV:
            intents.append(RefuseKv(request_id, _no_kv(request_id, "no such request here")))
        else:  # an `absent` rule that names another intent: a table bug, reported not raised
            intents.append(LoopIntent(IntentKind.REPORT_BUG, f"{kind.value} for an absent request"))
    return intents


def step_request(
    machine: Machine[P], record: RequestRecord[P], event: Event
) -> tuple[RequestRecord[P], list[Intent]]:
    """Move one request by one event. Total: every (phase, event) pair has an outcome."""
    edge = machine.edge(record.phase, event.kind)
    if machine.is_terminal(record.phase):
        return record, []  # terminal phases absorb
    intents = [
        _build_request_intent(kind, record.request_id, edge, record.phase, event)
        for kind in edge.intents
    ]
    error = record.error
    if machine.is_unsuccessful(edge.target):
        error = _edge_error(edge, record.phase, event)
    finish = event.finish_reason if isinstance(event, Finished) else record.finish_reason
    if isinstance(event, StopMatched) and machine.is_terminal(edge.target):
        finish = event.finish_reason
    tokens = record.tokens_out + sum(len(i.tokens) for i in intents if isinstance(i, RespondTokens))
    moved = replace(
        record, phase=edge.target, error=error, finish_reason=finish, tokens_out=tokens
    )
    return moved, intents


def _loop_intents(edge: Edge[LoopPhase], phase: LoopPhase, event: Event) -> list[Intent]:
    detail = "" if edge.declared else f"event '{event.kind.value}' in loop phase {phase.value}"
    intents: list[Intent] = []
    for kind in edge.intents:
        narrowed = loop_kind(kind)
        if narrowed is None:  # a loop edge names a request's or a peer's intent: a table bug
            intents.append(LoopIntent(IntentKind.REPORT_BUG, f"{kind.value} on a loop edge"))
        else:
            intents.append(LoopIntent(narrowed, detail))
    return intents


def step_loop(record: LoopRecord, event: Event) -> tuple[LoopRecord, list[Intent]]:
    edge = SERVING_LOOP.edge(record.phase, event.kind)
    intents = _loop_intents(edge, record.phase, event)
    bugs = record.bugs
    if not edge.declared and not SERVING_LOOP.is_terminal(record.phase):
        bugs = (*bugs, f"illegal transition: {event.kind.value} in {record.phase.value}")
    return replace(record, phase=edge.target, bugs=bugs), intents


def step_peer(record: PeerRecord, event: Event) -> tuple[PeerRecord, list[Intent]]:
    edge = PEER_HEALTH.edge(record.phase, event.kind)
    intents: list[Intent] = [PeerIntent(k, record.peer) for kind in edge.intents
                             if (k := peer_kind(kind)) is not None]
    bugs = record.bugs
    if not edge.declared:
        bugs = (*bugs, f"illegal transition: {event.kind.value} in {record.phase.value}")
    return replace(record, phase=edge.target, bugs=bugs), intents


__all__ = [
    "LoopRecord",
    "PeerRecord",
    "RequestRecord",
    "event_error",
    "new_request",
    "outcome_reason",
    "step_absent",
    "step_loop",
    "step_peer",
    "step_request",
]
