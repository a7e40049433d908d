"""Ports: the Protocols the effects layer drives, and the plain data they exchange.

`Engine` (a model runtime, re-exported from `engine_port`), `Peers` (calls to other nodes),
and `Backend` (what an OpenAI-style front end needs from whatever generates tokens: a local
engine on a single node, or prefill and decode peers behind a router). Adapters implement
them; `effects.fakes` has in-memory versions for tests. A generation's outputs are the core's
own reply intents (`RespondTokens`, `Complete`, `Reject`), read as the core made them: a decode
step's tokens are one value from the engine's stream (the core's `TokensGenerated`) to the text.
This module may import `statecore` and trio; it must never import httpx, mlx or mlx_lm.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from effects.engine_port import (
    Engine,
    EngineStatistics,
    GeneratedToken,
    KvBytes,
    KvPieces,
    KvSegment,
    LayerTravel,
    ModelInfo,
    PrefillOutcome,
    PrefixSummary,
    SamplingParams,
    SegmentSink,
)
from statecore.errors import ErrorInfo
from statecore.events import Finished, TokenLogprobs, TokensGenerated
from statecore.ids import RequestId
from statecore.intents import Complete, Reject, RespondTokens


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation, already tokenized: what a front end hands a backend."""

    request_id: RequestId
    prompt: tuple[int, ...]
    sampling: SamplingParams


Output = RespondTokens | Complete | Reject
"""What a generation gives: its tokens, a step's together (the EOS token never: `Complete("stop")`
is sent instead; it makes no text, but usage counts it, as vLLM and mlx-lm do), its end (`Complete`: "stop" or
"length") or its failure (`Reject`)."""


class Generation(Protocol):
    """One running generation. Iterate for outputs; the last is an end or an error."""

    def __aiter__(self) -> AsyncIterator[Output]: ...

    def receive_nowait(self) -> Output | None:
        """The next output if it is already waiting, taken without waiting (the iterator goes on
        after it); None when none is, or the last one was given. Call it only between outputs
        of the iterator, never while it is waiting for one."""
        ...

    async def stop(self) -> None:
        """The front end matched a stop string: end normally and free everything."""
        ...

    async def cancel(self) -> None:
        """The client went away: cancel and free everything. Idempotent."""
        ...

    @property
    def cached_tokens(self) -> int:
        """How many of the prompt's tokens its prefill took from a prefix cache instead of computing
        them (0 when none did); known once the first output is out."""
        ...


class Backend(Protocol):
    """What generates tokens behind an OpenAI-style front end."""

    @property
    def model_info(self) -> ModelInfo: ...

    def ready(self) -> bool:
        """True only while the serving loop is alive and accepting requests."""
        ...

    async def start(self, request: GenerationRequest) -> Generation:
        """Admit a request. Errors at intake raise StatecoreError (the front end maps it)."""
        ...


@dataclass(frozen=True, slots=True)
class PrefillReply:
    first_token: int
    is_eos: bool
    held_bytes: int
    logprobs: TokenLogprobs | None = None
    # the prompt tokens the prefill took from the node's prefix cache; None: not reported (only a
    # router that asks for them is told: `Peers(prompt_tokens_details=True)`)
    cached_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class PrefixSource:
    """Where a prefill node may pull the start of its prompt from: the decode node it hands off
    to holds the prompt's first `tokens` tokens (whole blocks) in its prefix cache, by the
    router's summary of it."""

    node: str
    tokens: int


@dataclass(frozen=True, slots=True)
class PulledPrefix:
    """A decode node's cached prefix blocks in the KV wire format, and how long the pull took."""

    payload: KvBytes  # a view of a receive buffer: read it within the call that got it
    first_byte_s: float  # the request sent -> the answer's head
    transfer_s: float  # the request sent -> its last byte


DecodeMessage = PrefillReply | TokensGenerated | Finished | ErrorInfo
"""A line of a decode node's stream, read."""


@dataclass(frozen=True, slots=True)
class DecodeCall:
    """What the router asks of a decode node."""

    request_id: RequestId
    prompt: tuple[int, ...]
    sampling: SamplingParams
    first_token: int | None  # None: prefill locally (short prompt), or a streamed handoff
    prefill_url: str | None  # where to pull the KV from; None when prefilling locally
    # A streamed handoff: the decode node asks `prefill_url` to prefill and stream the KV as it is
    # computed (and the first token), and passes the first token on as a local prefill does.
    kv_stream: bool = False
    prefix_from: PrefixSource | None = None  # the streamed prefill's hint (see Peers.prefill)
    # with kv_stream: the router started the prefill itself (`Peers.prefill(attach_by=...)`); the
    # decode node attaches to its stream instead of asking for the prefill
    kv_attach: bool = False


class Peers(Protocol):
    """Calls to other nodes. Transport failures raise StatecoreError with TRANSPORT_LOST. Every
    error a call raises or yields comes from the node called (`ErrorInfo.origin`), unless that
    node passed on another's (whose origin it names)."""

    async def prefill(
        self, node: str, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams,
        prefix_from: PrefixSource | None = None, *, attach_by: str | None = None,
        on_sent: Callable[[], object] | None = None,
    ) -> PrefillReply:
        """`prefix_from`: the decode node the KV goes to holds the prompt's start (a hint: the
        prefill node may pull it from there instead of computing it). `attach_by`: the KV streams
        to that decode node, which attaches to the stream (`prefill_stream(attach=True)`) while
        the prompt is computed; the reply comes as soon as the first token is sampled.
        `on_sent`: told once the call's request has been written (where the transport says so)."""
        ...

    def decode(self, node: str, call: DecodeCall) -> AsyncIterator[DecodeMessage]:
        """The decode node's stream, each line as what it means here: the first token (when the
        decode node prefilled), then each token and the end as the router's own events, or the
        node's error."""
        ...

    async def fetch_kv(self, node: str, request_id: RequestId) -> KvBytes: ...

    def prefill_stream(
        self, node: str, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams,
        prefix_from: PrefixSource | None = None, *, layers: int, attach: bool = False,
    ) -> AsyncGenerator[KvSegment | PrefillReply, None]:
        """Ask a prefill node to prefill and stream the KV while it computes: its pieces in
        order (each a whole wire payload, not yet validated), and the first token among them;
        `layers`: the model's, which the pieces must cover. `attach`: the router started that
        prefill (`prefill(attach_by=...)`); this stream reads it.
        The iterator ends when the stream's end record came and every layer's pieces covered the
        prompt; the prefill node's typed error, a broken stream or a malformed one raise. Close
        it where it is read (`contextlib.aclosing`): it holds the connection."""
        ...

    async def fetch_prefix(self, node: str, tokens: Sequence[int]) -> PulledPrefix:
        """The leading whole blocks of `tokens` that the node's prefix cache holds (the payload's
        token count says how many tokens); PREFIX_NOT_CACHED when it holds none."""
        ...

    async def release_kv(self, node: str, request_id: RequestId) -> None: ...

    async def cancel(self, node: str, request_id: RequestId, *, finish_reason: str | None = None) -> None:
        """Stop the node's part of the request and free what it holds: as a normal end
        ("stop", "length") when `finish_reason` is given, else as a cancellation."""
        ...

    async def health(self, node: str) -> bool: ...

    async def prefix_summary(self, node: str, since: int | None) -> PrefixSummary | None:
        """The node's prefix-cache summary; None when unchanged since version `since`."""
        ...


__all__ = [
    "Backend",
    "DecodeCall",
    "DecodeMessage",
    "Engine",
    "EngineStatistics",
    "GeneratedToken",
    "Generation",
    "GenerationRequest",
    "KvBytes",
    "KvPieces",
    "KvSegment",
    "LayerTravel",
    "ModelInfo",
    "Output",
    "Peers",
    "PrefillOutcome",
    "PrefillReply",
    "PrefixSource",
    "PrefixSummary",
    "PulledPrefix",
    "SamplingParams",
    "SegmentSink",
]
