"""Inbound events: everything that can happen to a request, a loop or a peer.

Events are frozen, slotted dataclasses tagged with a `kind`; the transition tables are keyed
on `(phase, kind)`. Time enters the core only as `TimerFired`, transport loss only as
`TransportLost`, the client going away only as `ClientCancelled`. This module must never
import trio, httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from statecore.errors import ErrorInfo


class EventKind(enum.Enum):
    # request life
    ADMITTED = "admitted"
    REJECTED = "rejected"
    DISPATCHED = "dispatched"
    PREFILL_DONE = "prefill_done"
    FIRST_TOKEN = "first_token"
    DECODE_STARTED = "decode_started"
    TOKEN = "token"
    FINISHED = "finished"
    STOP_MATCHED = "stop_matched"
    RETRY = "retry"
    PREFILL_LOCALLY = "prefill_locally"
    KV_REQUESTED = "kv_requested"
    KV_TAKEN = "kv_taken"
    KV_RECEIVED = "kv_received"
    KV_INSTALLED = "kv_installed"
    PEER_FAILED = "peer_failed"
    ENGINE_FAILED = "engine_failed"
    CLIENT_CANCELLED = "client_cancelled"
    TIMER_FIRED = "timer_fired"
    TRANSPORT_LOST = "transport_lost"
    # loop life
    REQUEST_OPENED = "request_opened"
    LOOP_READY = "loop_ready"
    DRAIN_REQUESTED = "drain_requested"
    DRAIN_COMPLETE = "drain_complete"
    # peer health
    PROBE_SUCCEEDED = "probe_succeeded"
    PROBE_FAILED = "probe_failed"


class Timer(enum.Enum):
    """Which timer fired. The phase decides what it means; stale timers are cancelled."""

    DEADLINE = "deadline"  # the request's overall deadline
    KV_LEASE = "kv_lease"  # a held cache was never taken
    PEER_COOLDOWN = "peer_cooldown"  # a down peer may be probed again
    DRAIN = "drain"  # the drain deadline


@dataclass(frozen=True, slots=True)
class Admitted:
    """Intake validated the request; for the router, nodes were chosen."""

    kind: ClassVar[EventKind] = EventKind.ADMITTED
    prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Rejected:
    """Intake found the request unservable (bad input, unsupported cache, overload)."""

    kind: ClassVar[EventKind] = EventKind.REJECTED
    error: ErrorInfo


@dataclass(frozen=True, slots=True)
class Dispatched:
    """A peer accepted the request (router) and is working on it."""

    kind: ClassVar[EventKind] = EventKind.DISPATCHED


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """What a request that asked for logprobs gets with each token: the token's log-probability
    and the `top` most likely tokens' (id, log-probability), most likely first. The core only
    carries it from the event to the token it answers."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class GeneratedToken:
    """Not an event: one token as a decoder hands it out to its request's stream, inside an engine
    (its device thread's item). `finish_reason` is set on the last one only, "stop" when the token
    is EOS (`statecore.policy.token_finish`), "length" when it was the last one allowed. The
    engine's stream yields the events `statecore.policy.decoded` makes of a step's worth."""

    token: int
    finish_reason: str | None = None
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True, slots=True)
class PrefillDone:
    """The engine prefilled the prompt and sampled the first token; the cache is held."""

    kind: ClassVar[EventKind] = EventKind.PREFILL_DONE
    first_token: int
    held_bytes: int
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The router received the first token (before the KV moves)."""

    kind: ClassVar[EventKind] = EventKind.FIRST_TOKEN
    token: int
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True, slots=True)
class DecodeStarted:
    """The decode node installed the cache and is decoding."""

    kind: ClassVar[EventKind] = EventKind.DECODE_STARTED


@dataclass(frozen=True, slots=True)
class TokensGenerated:
    """A decode step's tokens for one request (a verify step's several, else one), in order, as
    they are sent: one event per step, not per token. `logprobs` is one per token when the request
    asked for them, else None. The engine's stream yields this very value (`effects.engine_port`),
    made by `statecore.policy.decoded`: an EOS that ends the generation is not among the tokens."""

    kind: ClassVar[EventKind] = EventKind.TOKEN
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    """Generation ended normally: "stop" (EOS or stop string) or "length"."""

    kind: ClassVar[EventKind] = EventKind.FINISHED
    finish_reason: str


@dataclass(frozen=True, slots=True)
class StopMatched:
    """The front end ended the request normally before the engine did (a stop string matched;
    on a node: the router's request ended, e.g. at its first token); the nodes must stop.
    `finish_reason` is how it ended: "stop" or "length"."""

    kind: ClassVar[EventKind] = EventKind.STOP_MATCHED
    finish_reason: str = "stop"


@dataclass(frozen=True, slots=True)
class RetryRequested:
    """A peer failed before the first token reached the client and retry budget remains."""

    kind: ClassVar[EventKind] = EventKind.RETRY
    error: ErrorInfo


@dataclass(frozen=True, slots=True)
class PrefillLocally:
    """The decode node prefills this (short) prompt itself instead of pulling KV."""

    kind: ClassVar[EventKind] = EventKind.PREFILL_LOCALLY


@dataclass(frozen=True, slots=True)
class KvRequested:
    """A decode node asked for the held cache."""

    kind: ClassVar[EventKind] = EventKind.KV_REQUESTED


@dataclass(frozen=True, slots=True)
class KvTaken:
    """The decode node pulled the held cache and confirmed the install."""

    kind: ClassVar[EventKind] = EventKind.KV_TAKEN


@dataclass(frozen=True, slots=True)
class KvReceived:
    """The whole KV payload arrived, end frame included."""

    kind: ClassVar[EventKind] = EventKind.KV_RECEIVED
    nbytes: int


@dataclass(frozen=True, slots=True)
class KvInstalled:
    kind: ClassVar[EventKind] = EventKind.KV_INSTALLED


@dataclass(frozen=True, slots=True)
class PeerFailed:
    """A peer answered with an error or sent something invalid."""

    kind: ClassVar[EventKind] = EventKind.PEER_FAILED
    error: ErrorInfo


@dataclass(frozen=True, slots=True)
class EngineFailed:
    """The local engine failed this request (or its device thread died)."""

    kind: ClassVar[EventKind] = EventKind.ENGINE_FAILED
    error: ErrorInfo


@dataclass(frozen=True, slots=True)
class ClientCancelled:
    kind: ClassVar[EventKind] = EventKind.CLIENT_CANCELLED


@dataclass(frozen=True, slots=True)
class TimerFired:
    kind: ClassVar[EventKind] = EventKind.TIMER_FIRED
    timer: Timer


@dataclass(frozen=True, slots=True)
class TransportLost:
    """A connection this machine depends on is gone (wsproto's receive_data(None))."""

    kind: ClassVar[EventKind] = EventKind.TRANSPORT_LOST
    detail: str = ""
    origin: str | None = None  # the node whose connection it was, where known (`ErrorInfo.origin`)


@dataclass(frozen=True, slots=True)
class RequestOpened:
    """A new request asks to enter the loop; the loop's phase admits or refuses it
    (`statecore.policy.admission` reads that edge)."""

    kind: ClassVar[EventKind] = EventKind.REQUEST_OPENED


@dataclass(frozen=True, slots=True)
class LoopReady:
    kind: ClassVar[EventKind] = EventKind.LOOP_READY


@dataclass(frozen=True, slots=True)
class DrainRequested:
    kind: ClassVar[EventKind] = EventKind.DRAIN_REQUESTED


@dataclass(frozen=True, slots=True)
class DrainComplete:
    kind: ClassVar[EventKind] = EventKind.DRAIN_COMPLETE


@dataclass(frozen=True, slots=True)
class ProbeSucceeded:
    kind: ClassVar[EventKind] = EventKind.PROBE_SUCCEEDED


@dataclass(frozen=True, slots=True)
class ProbeFailed:
    kind: ClassVar[EventKind] = EventKind.PROBE_FAILED
    detail: str = ""


Event = (
    Admitted
    | Rejected
    | Dispatched
    | PrefillDone
    | FirstToken
    | DecodeStarted
    | TokensGenerated
    | Finished
    | StopMatched
    | RetryRequested
    | PrefillLocally
    | KvRequested
    | KvTaken
    | KvReceived
    | KvInstalled
    | PeerFailed
    | EngineFailed
    | ClientCancelled
    | TimerFired
    | TransportLost
    | RequestOpened
    | LoopReady
    | DrainRequested
    | DrainComplete
    | ProbeSucceeded
    | ProbeFailed
)

EVENT_TYPES: tuple[type[Event], ...] = (
    Admitted,
    Rejected,
    Dispatched,
    PrefillDone,
    FirstToken,
    DecodeStarted,
    TokensGenerated,
    Finished,
    StopMatched,
    RetryRequested,
    PrefillLocally,
    KvRequested,
    KvTaken,
    KvReceived,
    KvInstalled,
    PeerFailed,
    EngineFailed,
    ClientCancelled,
    TimerFired,
    TransportLost,
    RequestOpened,
    LoopReady,
    DrainRequested,
    DrainComplete,
    ProbeSucceeded,
    ProbeFailed,
)

__all__ = [
    "EVENT_TYPES",
    "Admitted",
    "ClientCancelled",
    "DecodeStarted",
    "Dispatched",
    "DrainComplete",
    "DrainRequested",
    "EngineFailed",
    "Event",
    "EventKind",
    "Finished",
    "FirstToken",
    "GeneratedToken",
    "KvInstalled",
    "KvReceived",
    "KvRequested",
    "KvTaken",
    "LoopReady",
    "PeerFailed",
    "PrefillDone",
    "PrefillLocally",
    "ProbeFailed",
    "ProbeSucceeded",
    "Rejected",
    "RequestOpened",
    "RetryRequested",
    "StopMatched",
    "Timer",
    "TimerFired",
    "TokensGenerated",
    "TokenLogprobs",
    "TransportLost",
]
