"""Policy: the decisions the shell would otherwise make in several places, made once, purely.

Admission (may a new request enter this loop now? may a routed one whose cache cannot travel?),
what a peer's failure means (retry on
another node, blame the node, or fail the request) and a routed request's retries
(`RetryState`), what a request may ask (its context, a grammar's end, token ids inside the
vocabulary, sampling values an engine takes), how a generation ends
(EOS, length, the first token being the last, the finish reason a client reads) and which event
an error becomes. Effects and adapters ask these functions and decide nothing themselves; the
tables in `statecore.table` stay the only place a phase moves. Admission reads the serving
loop's own `request_opened` edge, so the diagram shows it. This module must never import trio,
httpx, mlx or mlx_lm.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import SupportsIndex, cast

from statecore.errors import Code, ErrorInfo, Fault, unsupported_cache
from statecore.events import (
    EngineFailed,
    EventKind,
    Finished,
    GeneratedToken,
    PeerFailed,
    TokensGenerated,
    TransportLost,
)
from statecore.ids import RequestId
from statecore.intents import IntentKind
from statecore.phases import LoopPhase
from statecore.routing import prefills_locally
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


def travel_refusal(prompt_tokens: int, local_below: int, *, can_travel: bool,
                   untravelable_classes: Collection[str]) -> ErrorInfo | None:
    """Why a routed request is refused at intake because its KV may have to leave the node that
    computes it and the model's cache cannot (`unsupported_cache` naming the classes); None when
    it may enter. A prompt its decode node prefills itself (`routing.prefills_locally`) never
    travels; a longer one may, so it is refused before any node works on it, never mid-stream."""
    if can_travel or prefills_locally(prompt_tokens, local_below):
        return None
    return unsupported_cache(list(untravelable_classes))


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


@dataclass(frozen=True, slots=True)
class RetryState:
    """A routed request's attempts, the core's record of its retries: how many have started, and
    the nodes that failed ones used, which the next attempt avoids (unless nothing else is left:
    `statecore.routing.avoiding`)."""

    attempts: int = 0
    tried: frozenset[str] = frozenset()

    def started(self) -> RetryState:
        """One more attempt starts."""
        return replace(self, attempts=self.attempts + 1)

    def node_request_id(self, request_id: RequestId) -> RequestId:
        """Each retry uses its own id on the nodes, so a late copy of a failed attempt can never
        collide with the new one; the client's id stays a prefix (logs, fault markers)."""
        return request_id if self.attempts <= 1 else RequestId(f"{request_id}.retry{self.attempts - 1}")


def attempt_failed(state: RetryState, error: ErrorInfo, *, used: Collection[str | None],
                   first_token_sent: bool, max_attempts: int) -> tuple[RetryState, PeerFailureVerdict]:
    """What one attempt's failure means (`peer_failure`: blame, retry, backoff) and the retry
    state after it: a retried request avoids the nodes this attempt `used` from now on."""
    verdict = peer_failure(error, first_token_sent=first_token_sent, attempts=state.attempts,
                           max_attempts=max_attempts)
    if verdict.retry:
        state = replace(state, tried=state.tried | {node for node in used if node is not None})
    return state, verdict


# -- how a generation ends ----------------------------------------------------------------

STOP = "stop"  # EOS, or a stop string the front end matched
LENGTH = "length"  # max_tokens reached
FINISH_REASONS = frozenset({STOP, LENGTH})
TOOL_CALLS = "tool_calls"  # a reply that ended normally after calling tools (the client's reason only)


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
    return length_finish(remaining)


def length_finish(remaining: int) -> str | None:
    """"length" once no token is allowed after the latest one (`remaining` of max_tokens left),
    else None: the one place max_tokens ends a generation, whichever layer counts the tokens."""
    return LENGTH if remaining <= 0 else None


def first_token_finish(first_is_eos: bool, *, hands_off: bool) -> str | None:
    """A prefill's first token ends the request here when it is EOS ("stop", and it is never
    sent as text), unless the cache leaves for a decode node whatever the token (a prefill
    node: the router decides from the `is_eos` flag it is sent)."""
    return STOP if first_is_eos and not hands_off else None


def after_first_token(max_tokens: int) -> str | None:
    """How a request ends once its first token is sent: "length" when that token was the last
    one allowed (`max_tokens` 1: nothing is decoded), else None."""
    return length_finish(max_tokens - 1)


def finish_before_decoding(first_token: int, eos_token_ids: Collection[int], *, ignore_eos: bool,
                           max_tokens: int) -> str | None:
    """How a prefill's first token ends its request where it would join the decoder: "stop" when
    it ends it as EOS (`first_token_ends`), "length" when it was the last allowed
    (`after_first_token`), None when decoding goes on. The engine asks this once, for its own
    record, where a caller brings it a request that has already ended."""
    if first_token_ends(first_token, eos_token_ids, ignore_eos=ignore_eos):
        return STOP
    return after_first_token(max_tokens)


def decoded_tokens(tokens: Sequence[int], finish_reason: str | None) -> tuple[int, str | None]:
    """(how many of `tokens` are sent, how the generation ends after them) for tokens out of the
    decoder in order (a step's, or several steps' read together), the last of which ended the
    generation as `finish_reason` says (the engine asked `token_finish` of each; a generation
    ends at its last token, so only that one can say how): an EOS ("stop") ends it and is not
    sent; any other token is sent, the last one then ending it when it was the last allowed
    ("length")."""
    return (len(tokens) - 1 if finish_reason == STOP else len(tokens)), finish_reason


def decoded(items: Sequence[GeneratedToken]) -> list[TokensGenerated | Finished]:
    """A decoder's tokens for one request, read together (a step's, or several steps' when the
    reader was behind), as the core's events: one `TokensGenerated` with those sent
    (`decoded_tokens`: an ending EOS is not), then `Finished` when the last ended the generation.
    Nothing after an ending token is taken."""
    ending = next((at for at, item in enumerate(items) if item.finish_reason is not None), None)
    taken = items if ending is None else items[: ending + 1]
    sent, finish = decoded_tokens([item.token for item in taken],
                                  None if ending is None else taken[-1].finish_reason)
    events: list[TokensGenerated | Finished] = []
    if sent:
        logprobs = tuple(lp for item in taken[:sent] if (lp := item.logprobs) is not None)
        events.append(TokensGenerated(tuple(item.token for item in taken[:sent]),
                                      logprobs if len(logprobs) == sent else None))
    if finish is not None:
        events.append(Finished(finish))
    return events


def counts_ending_token(finish_reason: str) -> bool:
    """Whether the token that ended a generation counts as generated although it makes no text:
    EOS does ("stop" from the engine), as vLLM and mlx-lm count it."""
    return finish_reason == STOP


def text_finish(engine_reason: str | None, *, stop_string_matched: bool) -> str:
    """The finish reason of a reply's text: "stop" when a stop string ended it (the engine still
    running, `engine_reason` None, or whatever it said of the tokens after it), else the
    engine's reason."""
    if stop_string_matched:
        return STOP
    assert engine_reason is not None, "a generation still running ended without a stop string"
    return engine_reason


def reply_finish(reason: str, *, called_tools: bool) -> str:
    """The finish reason the client reads: a reply that called tools and then ended normally
    ("stop") ended for its tool calls; "length" stays "length" (a call may be cut short)."""
    return TOOL_CALLS if called_tools and reason == STOP else reason


def first_token_ends(first_token: int, eos_token_ids: Collection[int], *, ignore_eos: bool) -> bool:
    """Whether a prefill's first token ends its request as EOS: it is never sent as text nor
    counted as an output token, and the router ends the request with "stop" when told so
    (`first_token_finish`). The prefill node says it in its reply's `is_eos`."""
    return is_eos(first_token, eos_token_ids, ignore_eos=ignore_eos)


# -- what a request may ask ---------------------------------------------------------------


def context_room(prompt_tokens: int, context_length: int) -> int:
    """How many tokens the model's context leaves for a request's answer after its prompt (the
    front end's default `max_tokens`; below 1: `context_overflow` names the prompt)."""
    return context_length - prompt_tokens


def context_overflow(prompt_tokens: int, max_tokens: int | None, context_length: int) -> str | None:
    """Which part of a request does not fit the model's context: "prompt" when the prompt leaves
    no room for one generated token, "max_tokens" when the prompt and `max_tokens` (None: not
    given) together exceed it; None when it fits."""
    room = context_room(prompt_tokens, context_length)
    if room < 1:
        return "prompt"
    if max_tokens is not None and max_tokens > room:
        return "max_tokens"
    return None


def grammar_end_conflict(*, has_stop_strings: bool, ignore_eos: bool) -> str | None:
    """A constrained reply (a response_format, a forced tool call) ends where its grammar is
    whole, with EOS: stop strings could cut it short and `ignore_eos` would run past it. The
    parameter that conflicts ("stop" first, then "ignore_eos"), None when neither does."""
    if has_stop_strings:
        return "stop"
    if ignore_eos:
        return "ignore_eos"
    return None


def token_ids(tokens: Sequence[object], vocab_size: int, what: str) -> list[int] | str:
    """`tokens` as token ids (Python ints; numpy integers welcome) inside the vocabulary
    [0, vocab_size), or why they are refused (a str, `what` its subject), naming the first token
    at fault: not an integer (a bool is none) or outside. Plain ints in range, the usual case, are
    found so by C-level passes (a type set, min, max): a token at a time cost ~1.3 ms of every
    8,000-token prompt's first token."""
    ids = list(tokens)
    if ids and set(map(type, ids)) == {int}:
        plain = cast(list[int], ids)
        if min(plain) >= 0 and max(plain) < vocab_size:
            return plain
    checked: list[int] = []
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, SupportsIndex):
            return f"{what} {token!r} is not an integer"
        value = token.__index__()
        if not 0 <= value < vocab_size:
            return f"{what} {value} is outside the vocabulary [0, {vocab_size})"
        checked.append(value)
    return checked


def engine_request(prompt: Sequence[object], vocab_size: int, *, max_tokens: int, temperature: float,
                   top_p: float, top_k: int) -> list[int] | str:
    """What an engine takes of a request: its prompt as token ids (`token_ids`), or why it is
    refused (an empty prompt, sampling values out of range). What the request may ask of the model
    (`context_overflow`) the front end asks once; peers only send what a front end accepted."""
    ids = token_ids(prompt, vocab_size, "prompt token")
    if isinstance(ids, str):
        return ids
    if not ids:
        return "the prompt is empty"
    if max_tokens < 1:
        return "max_tokens must be >= 1"
    if temperature < 0.0 or temperature != temperature:
        return "temperature must be >= 0"
    if not 0.0 < top_p <= 1.0:
        return "top_p must be in (0, 1]"
    if top_k < 0:
        return "top_k must be >= 0"
    return ids


# -- which event an error becomes ---------------------------------------------------------


def failure_event(error: ErrorInfo) -> TransportLost | PeerFailed | EngineFailed:
    """The event a failed piece of work posts for its request: a lost transport is an input of
    its own (wsproto's `receive_data(None)`), a peer's or a connection's fault is the peer's,
    anything else (our bug, a refused or failed engine call) is the engine's."""
    if error.code is Code.TRANSPORT_LOST:
        return TransportLost(error.message, error.origin)
    if error.fault in (Fault.PEER, Fault.TRANSPORT):
        return PeerFailed(error)
    return EngineFailed(error)


__all__ = [
    "BLAMED_FAULTS",
    "FINISH_REASONS",
    "LENGTH",
    "RETRYABLE_FAULTS",
    "STOP",
    "TOOL_CALLS",
    "PeerFailureVerdict",
    "RetryState",
    "admission",
    "after_first_token",
    "attempt_failed",
    "blames_peer",
    "context_overflow",
    "context_room",
    "counts_ending_token",
    "decoded",
    "decoded_tokens",
    "failure_event",
    "first_token_ends",
    "finish_before_decoding",
    "first_token_finish",
    "grammar_end_conflict",
    "is_eos",
    "length_finish",
    "peer_failure",
    "reply_finish",
    "text_finish",
    "token_finish",
    "travel_refusal",
]
