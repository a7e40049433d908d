"""Intents: the effects the core asks for, as data. The core never performs anything.

The transition tables name intents by `IntentKind`; `statecore.step` builds the concrete
intent values from the record and the event. The effects layer performs them through ports
and feeds the outcomes back as events. This module must never import trio, httpx, mlx or
mlx_lm.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, Literal

from statecore.errors import ErrorInfo
from statecore.events import Timer, TokenLogprobs
from statecore.ids import RequestId


class IntentKind(enum.Enum):
    START_PREFILL = "start_prefill"
    START_DECODE = "start_decode"
    FETCH_KV = "fetch_kv"
    INSTALL_KV = "install_kv"
    SEND_KV = "send_kv"
    REFUSE_KV = "refuse_kv"
    RELEASE_KV = "release_kv"
    STOP_DECODING = "stop_decoding"
    CANCEL_REMOTE = "cancel_remote"
    ARM_DEADLINE = "arm_deadline"
    ARM_LEASE = "arm_lease"
    CANCEL_TIMER = "cancel_timer"
    RESPOND_TOKEN = "respond_token"
    COMPLETE = "complete"
    REJECT = "reject"
    # loop
    ADMIT_REQUEST = "admit_request"
    REFUSE_REQUEST = "refuse_request"
    START_ACCEPTING = "start_accepting"
    STOP_ACCEPTING = "stop_accepting"
    ARM_DRAIN = "arm_drain"
    STOP_LOOP = "stop_loop"
    REPORT_BUG = "report_bug"
    # peer health
    MARK_AVAILABLE = "mark_available"
    MARK_UNAVAILABLE = "mark_unavailable"
    ARM_COOLDOWN = "arm_cooldown"
    SEND_PROBE = "send_probe"


@dataclass(frozen=True, slots=True)
class StartPrefill:
    kind: ClassVar[IntentKind] = IntentKind.START_PREFILL
    request_id: RequestId


@dataclass(frozen=True, slots=True)
class StartDecode:
    kind: ClassVar[IntentKind] = IntentKind.START_DECODE
    request_id: RequestId


@dataclass(frozen=True, slots=True)
class FetchKv:
    kind: ClassVar[IntentKind] = IntentKind.FETCH_KV
    request_id: RequestId


@dataclass(frozen=True, slots=True)
class InstallKv:
    kind: ClassVar[IntentKind] = IntentKind.INSTALL_KV
    request_id: RequestId


@dataclass(frozen=True, slots=True)
class SendKv:
    kind: ClassVar[IntentKind] = IntentKind.SEND_KV
    request_id: RequestId


@dataclass(frozen=True, slots=True)
class RefuseKv:
    """Answer a pull of a request's KV with why there is none to send (the request holds none
    yet, or this node holds no such request): the request itself is left as it is."""

    kind: ClassVar[IntentKind] = IntentKind.REFUSE_KV
    request_id: RequestId
    error: ErrorInfo


@dataclass(frozen=True, slots=True)
class ReleaseKv:
    """Free a held cache (prefill side) or tell its owner it is taken (decode side)."""

    kind: ClassVar[IntentKind] = IntentKind.RELEASE_KV
    request_id: RequestId


@dataclass(frozen=True, slots=True)
class StopDecoding:
    """Free the request's decoder slot."""

    kind: ClassVar[IntentKind] = IntentKind.STOP_DECODING
    request_id: RequestId


@dataclass(frozen=True, slots=True)
class CancelRemote:
    """Tell the peers working on this request to stop and free what they hold. `finish_reason`
    is set when the request ended normally here ("stop", "length"): the peers then end it as
    done with that reason, not as cancelled."""

    kind: ClassVar[IntentKind] = IntentKind.CANCEL_REMOTE
    request_id: RequestId
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class ArmTimer:
    """Arm (or re-arm) the request's single timer; the interpreter knows the durations."""

    request_id: RequestId
    timer: Timer

    @property
    def kind(self) -> IntentKind:
        return IntentKind.ARM_LEASE if self.timer is Timer.KV_LEASE else IntentKind.ARM_DEADLINE


@dataclass(frozen=True, slots=True)
class CancelTimer:
    kind: ClassVar[IntentKind] = IntentKind.CANCEL_TIMER
    request_id: RequestId


@dataclass(frozen=True, slots=True)
class RespondTokens:
    """Send a request's tokens to whoever reads its replies: the first token alone, then each
    decode step's tokens together (`statecore.events.TokensGenerated`); `logprobs` one per token
    when asked, else None."""

    kind: ClassVar[IntentKind] = IntentKind.RESPOND_TOKEN
    request_id: RequestId
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True, slots=True)
class Complete:
    """End the request normally, as `finish_reason` says; `ending_tokens` is what the end adds to
    the generation's tokens as usage counts them without sending any (1 for an ending EOS:
    `statecore.policy.counts_ending_token`, asked here once for every reader), else 0."""

    kind: ClassVar[IntentKind] = IntentKind.COMPLETE
    request_id: RequestId
    finish_reason: str
    ending_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Reject:
    """End the request with an error (a 4xx/5xx, or an error event if streaming began)."""

    kind: ClassVar[IntentKind] = IntentKind.REJECT
    request_id: RequestId
    error: ErrorInfo


# The kinds a loop or a peer intent can have, as types: their performers match on these alone,
# exhaustively, and `loop_kind` / `peer_kind` are the one place an IntentKind is sorted.
LoopIntentKind = Literal[
    IntentKind.ADMIT_REQUEST,
    IntentKind.REFUSE_REQUEST,
    IntentKind.START_ACCEPTING,
    IntentKind.STOP_ACCEPTING,
    IntentKind.ARM_DRAIN,
    IntentKind.STOP_LOOP,
    IntentKind.REPORT_BUG,
]
PeerIntentKind = Literal[
    IntentKind.MARK_AVAILABLE,
    IntentKind.MARK_UNAVAILABLE,
    IntentKind.ARM_COOLDOWN,
    IntentKind.SEND_PROBE,
]


def loop_kind(kind: IntentKind) -> LoopIntentKind | None:
    """`kind` if it is a loop intent's, else None."""
    match kind:
        case (
            IntentKind.ADMIT_REQUEST | IntentKind.REFUSE_REQUEST | IntentKind.START_ACCEPTING
            | IntentKind.STOP_ACCEPTING | IntentKind.ARM_DRAIN | IntentKind.STOP_LOOP
            | IntentKind.REPORT_BUG
        ):
            return kind
        case _:
            return None


def peer_kind(kind: IntentKind) -> PeerIntentKind | None:
    """`kind` if it is a peer intent's, else None."""
    match kind:
        case (
            IntentKind.MARK_AVAILABLE | IntentKind.MARK_UNAVAILABLE | IntentKind.ARM_COOLDOWN
            | IntentKind.SEND_PROBE
        ):
            return kind
        case _:
            return None


@dataclass(frozen=True, slots=True)
class LoopIntent:
    """An intent about the loop itself (start/stop accepting, stop, arm drain, report bug)."""

    kind: LoopIntentKind
    detail: str = ""


@dataclass(frozen=True, slots=True)
class PeerIntent:
    """An intent about one peer's routing state (mark, probe, cool down)."""

    kind: PeerIntentKind
    peer: str


Intent = (
    StartPrefill
    | StartDecode
    | FetchKv
    | InstallKv
    | SendKv
    | RefuseKv
    | ReleaseKv
    | StopDecoding
    | CancelRemote
    | ArmTimer
    | CancelTimer
    | RespondTokens
    | Complete
    | Reject
    | LoopIntent
    | PeerIntent
)

__all__ = [
    "ArmTimer",
    "CancelRemote",
    "CancelTimer",
    "Complete",
    "FetchKv",
    "InstallKv",
    "Intent",
    "IntentKind",
    "LoopIntent",
    "LoopIntentKind",
    "PeerIntent",
    "PeerIntentKind",
    "RefuseKv",
    "Reject",
    "ReleaseKv",
    "RespondTokens",
    "SendKv",
    "StartDecode",
    "StartPrefill",
    "StopDecoding",
    "loop_kind",
    "peer_kind",
]
