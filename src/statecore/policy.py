"""Policy: the decisions the shell would otherwise make in several places, made once, purely.

Admission (may a new request enter this loop now?), what a peer's failure means (retry on
another node, blame the node, or fail the request), how a generation ends (EOS, length, the
first token being the last) and which event an error becomes. Effects and adapters ask these
functions and decide nothing themselves; the tables in `statecore.table` stay the only place
a phase moves. Admission reads the serving loop's own `request_opened` edge, so the diagram
shows it. This module must never import trio, httpx, mlx or mlx_lm.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from statecore.errors import Code, ErrorInfo, Fault
from statecore.events import EngineFailed, EventKind, PeerFailed, TransportLost
from statecore.intents import IntentKind
from statecore.phases import LoopPhase
from statecore.table import SERVING_LOOP

# -- admission ----------------------------------------------------------------------------


def admission(loop_phase: LoopPhase, live: int, max_live: int | None = None) -> ErrorInfo | None:
    """Why a new request may not enter a loop in `loop_phase` with `live` requests in it (None:
    it may). The loop table's `request_opened` edge says whether the phase admits at all;
    `max_live` (None: no limit) bounds the requests in flight."""
    edge = SERVING_LOOP.edge(loop_phase, EventKind.REQUEST_OPENED)
    if IntentKind.ADMIT_REQUEST not in edge.intents:
        if loop_phase is LoopPhase.DRAINING:
            message = "the node is not accepting requests (draining); retry elsewhere"
        else:
            message = f"the node is not accepting requests ({loop_phase.value}); retry later"
        return ErrorInfo(Fault.OVERLOADED, Code.DRAINING, message)
    if max_live is not None and live >= max_live:
        return ErrorInfo(Fault.OVERLOADED, Code.OVERLOADED,
                         f"too many requests in flight (limit {max_live}); retry shortly")
    return None


# -- a peer's failure ---------------------------------------------------------------------

# Faults worth another attempt on other nodes: the node failed or was busy, not the request.
RETRYABLE_FAULTS = frozenset({Fault.PEER, Fault.TRANSPORT, Fault.OVERLOADED})
# Faults that count against the node's health: it could not be reached or its stream broke.
# (A peer that answered with an error is alive; its own probe decides whether it is down.)
BLAMED_FAULTS = frozenset({Fault.TRANSPORT})


@dataclass(frozen=True, slots=True)
class PeerFailureVerdict:
    """What a router does with one attempt's failure."""

    blame: bool  # tell the node's health machine
    retry: bool  # start another attempt (else the request fails with the error)
    backoff_s: float = 0.0  # wait this long before the next attempt


def blames_peer(error: ErrorInfo) -> bool:
    """Whether this error counts against the node that produced it."""
    return error.fault in BLAMED_FAULTS


def peer_failure(
    error: ErrorInfo, *, first_token_sent: bool, attempts: int, max_attempts: int
) -> PeerFailureVerdict:
    """Retry only before the client has a token (the output would otherwise diverge) and while
    attempts remain, with a bounded exponential backoff."""
    retry = error.fault in RETRYABLE_FAULTS and not first_token_sent and attempts < max_attempts
    backoff = 0.05 * 2 ** (attempts - 1) if retry else 0.0
    return PeerFailureVerdict(blames_peer(error), retry, backoff)


# -- how a generation ends ----------------------------------------------------------------

STOP = "stop"  # EOS, or a stop string the front end matched
LENGTH = "length"  # max_tokens reached
FINISH_REASONS = frozenset({STOP, LENGTH})


def is_eos(token: int, eos_token_ids: Collection[int], *, ignore_eos: bool) -> bool:
    """Whether a token ends the generation as EOS (never under vLLM's `ignore_eos`)."""
    return not ignore_eos and token in eos_token_ids


def token_finish(
    token: int, eos_token_ids: Collection[int], *, ignore_eos: bool, remaining: int
) -> str | None:
    """How a newly generated token ends the generation, `remaining` tokens allowed after it:
    "stop" at EOS, "length" when it was the last allowed one, None when generation goes on."""
    if is_eos(token, eos_token_ids, ignore_eos=ignore_eos):
        return STOP
    if remaining <= 0:
        return LENGTH
    return None


def first_token_finish(first_is_eos: bool, *, hands_off: bool) -> str | None:
    """A prefill's first token ends the request here when it is EOS ("stop", and it is never
    sent as text), unless the cache leaves for a decode node whatever the token (a prefill
    node: the router decides from the `is_eos` flag it is sent)."""
    return STOP if first_is_eos and not hands_off else None


def first_token_is_last(max_tokens: int) -> bool:
    """With `max_tokens` 1 the first token was the last: the request ends with "length" once it
    is sent, and nothing is decoded."""
    return max_tokens <= 1


def decoded_token(is_eos_token: bool, finish_reason: str | None, *,
                  ignore_eos: bool) -> tuple[bool, str | None]:
    """(send the token, how the generation ends after it) for a token out of the decoder: an
    EOS token ends with "stop" and is not sent; any other is sent, then ends the generation
    when the engine marked it the last."""
    if is_eos_token and not ignore_eos:
        return False, STOP
    return True, finish_reason


# -- which event an error becomes ---------------------------------------------------------


def failure_event(error: ErrorInfo) -> TransportLost | PeerFailed | EngineFailed:
    """The event a failed piece of work posts for its request: a lost transport is an input of
    its own (wsproto's `receive_data(None)`), a peer's or a connection's fault is the peer's,
    anything else (our bug, a refused or failed engine call) is the engine's."""
    if error.code is Code.TRANSPORT_LOST:
        return TransportLost(error.message)
    if error.fault in (Fault.PEER, Fault.TRANSPORT):
        return PeerFailed(error)
    return EngineFailed(error)


__all__ = [
    "BLAMED_FAULTS",
    "FINISH_REASONS",
    "LENGTH",
    "RETRYABLE_FAULTS",
    "STOP",
    "PeerFailureVerdict",
    "admission",
    "blames_peer",
    "decoded_token",
    "failure_event",
    "first_token_finish",
    "first_token_is_last",
    "is_eos",
    "peer_failure",
    "token_finish",
]
