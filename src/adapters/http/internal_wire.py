"""The nodes' internal endpoints as a contract: the JSON shapes they exchange, validated with
pydantic, and what every internal route does before and after its own work (require the shared
token when one is configured, read the body up to a limit, validate it, answer a
`StatecoreError` as its JSON error).

The shapes are shared by the server side (`adapters.http.node_api` and the route groups it
composes) and the client side (`adapters.http.peers_httpx`) so the two can never drift. Token
ids, sampling and errors travel as small JSON documents; KV bytes never do (they use
`adapters.kv`). This module may import anything.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from effects.ports import (
    DecodeMessage,
    LayerTravel,
    ModelInfo,
    Output,
    PrefillReply,
    PrefixSource,
    PrefixSummary,
    SamplingParams,
)
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error
from statecore.events import Finished, TokenLogprobs, TokensGenerated
from statecore.intents import Complete, Reject, RespondTokens

TOKEN_HEADER = "x-statecore-token"
REQUEST_ID_HEADER = "x-request-id"
# `?cached_tokens=1` on /internal/prefill and /internal/decode: the router asks for the prompt
# tokens the node's prefill took from its prefix cache (`cached_tokens` in the prefill reply or the
# stream's first line). Only then does a node send them: a router of an older version, whose
# strict reply model refuses unknown fields, never asks; a node of an older version ignores it.
CACHED_TOKENS_PARAM = "cached_tokens"


class _Strict(BaseModel):
    """Every internal message: no unknown fields, no coercion (a "5" is not a 5, a 5.0 is not
    an int). Read JSON with `model_validate_json`, so arrays become the tuples fields declare."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class SamplingBody(_Strict):
    max_tokens: int = Field(ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    ignore_eos: bool = False
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    xtc_probability: float = Field(default=0.0, ge=0.0, le=1.0)
    xtc_threshold: float = Field(default=0.1, ge=0.0, le=0.5)
    xtc_special_tokens: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = Field(default=0.0, ge=0.0)
    repetition_context_size: int = Field(default=20, ge=0)
    presence_penalty: float = 0.0
    presence_context_size: int = Field(default=20, ge=0)
    frequency_penalty: float = 0.0
    frequency_context_size: int = Field(default=20, ge=0)
    logprobs: int | None = Field(default=None, ge=0)
    response_format: str | None = Field(default=None, min_length=1)
    choice_group: str = Field(default="", max_length=200)
    choice: int = Field(default=0, ge=0)
    choices: int = Field(default=1, ge=1)
    # sent only when set (`_encoded`): a node of an older version sees the same body
    adapter: str | None = Field(default=None, min_length=1, max_length=64)
    num_draft_tokens: int | None = Field(default=None, ge=0)  # sent only when set, as `adapter`

    @classmethod
    def of(cls, sampling: SamplingParams) -> SamplingBody:
        return cls(**{name: getattr(sampling, name) for name in cls.model_fields})

    def params(self) -> SamplingParams:
        return SamplingParams(**{name: getattr(self, name) for name in type(self).model_fields})


class PrefixFromBody(_Strict):
    """The router's hint on /internal/prefill: the decode node at `url` holds the prompt's first
    `tokens` tokens in its prefix cache (`effects.ports.PrefixSource`)."""

    url: str = Field(min_length=1, max_length=2000)
    tokens: int = Field(ge=1)

    def source(self) -> PrefixSource:
        return PrefixSource(self.url, self.tokens)

    @classmethod
    def of(cls, source: PrefixSource | None) -> PrefixFromBody | None:
        """The hint as sent; None when there is none."""
        return None if source is None else cls(url=source.node, tokens=source.tokens)


def prefix_source(hint: PrefixFromBody | None) -> PrefixSource | None:
    """A body's hint as the port's value; None when it gave none."""
    return None if hint is None else hint.source()


class PrefillBody(_Strict):
    request_id: str = Field(min_length=1, max_length=200)
    prompt: list[int] = Field(min_length=1)
    sampling: SamplingBody
    # Optional, and sent only when set: a node of an older version, whose strict model refuses
    # unknown fields, sees the same body as before from a router that gives no hint.
    prefix_from: PrefixFromBody | None = None
    # /internal/prefill_stream only, sent only when set: the asking decode node maps this node's
    # shared memory (it checked the advert in /internal/info), so pieces may go by reference
    kv_shm: bool = False
    # with kv_shm, sent only when set: the asking node's engine takes pieces in GPU memory on this
    # host (`adapters.mlx.device_pieces`), so they may go device to device
    kv_device: bool = False
    # Sent only when set. On /internal/prefill: the router starts a streamed handoff's prefill
    # here, and its decode node will attach to the stream; the reply comes with the first token.
    # On /internal/prefill_stream: the decode node attaches to that stream (nothing is prefilled
    # anew; `prompt` must be the started request's).
    kv_attach: bool = False
    # with kv_attach on /internal/prefill: the decode node that will attach, as the router names it
    # (the prefill node remembers whether that node took its pieces in GPU memory)
    kv_attach_by: str | None = Field(default=None, min_length=1, max_length=2000)

    def encoded(self) -> bytes:
        return _encoded(self, ("prefix_from", "kv_shm", "kv_device", "kv_attach", "kv_attach_by"))


class PrefixKvBody(_Strict):
    """POST /internal/prefix_kv: the token ids whose leading whole blocks the caller wants."""

    tokens: list[int] = Field(min_length=1)


class LogprobsBody(_Strict):
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, logprobs: TokenLogprobs | None) -> LogprobsBody | None:
        return None if logprobs is None else cls(logprob=logprobs.logprob, top=logprobs.top)

    def value(self) -> TokenLogprobs:
        return TokenLogprobs(self.logprob, self.top)


class PrefillReplyBody(_Strict):
    first_token: int
    is_eos: bool
    held_bytes: int = 0
    logprobs: LogprobsBody | None = None
    cached_tokens: int | None = Field(default=None, ge=0)  # only when asked (CACHED_TOKENS_PARAM)

    def document(self) -> dict[str, object]:
        """The reply as sent: `cached_tokens` only when it is reported."""
        return self.model_dump(exclude=None if self.cached_tokens is not None else {"cached_tokens"})

    @classmethod
    def of(cls, reply: PrefillReply) -> PrefillReplyBody:
        return cls(first_token=reply.first_token, is_eos=reply.is_eos, held_bytes=reply.held_bytes,
                   logprobs=LogprobsBody.of(reply.logprobs), cached_tokens=reply.cached_tokens)

    def reply(self) -> PrefillReply:
        return PrefillReply(self.first_token, self.is_eos, self.held_bytes,
                            None if self.logprobs is None else self.logprobs.value(), self.cached_tokens)


class DecodeBody(_Strict):
    request_id: str = Field(min_length=1, max_length=200)
    prompt: list[int] = Field(min_length=1)
    sampling: SamplingBody
    first_token: int | None = None
    prefill_url: str | None = None
    # A streamed handoff (sent only when set, so a node of an older version sees the same body):
    # this node asks `prefill_url` to prefill and streams the KV from it as it is computed.
    kv_stream: bool = False
    prefix_from: PrefixFromBody | None = None
    # with kv_stream, sent only when set: the router started the prefill on `prefill_url` itself;
    # this node attaches to its stream (`PrefillBody.kv_attach`) instead of asking for it
    kv_attach: bool = False

    def encoded(self) -> bytes:
        return _encoded(self, ("kv_stream", "prefix_from", "kv_attach"))


def _encoded(body: PrefillBody | DecodeBody, sent_only_when_set: tuple[str, ...]) -> bytes:
    """A prompt-carrying body as sent: without the fields in `sent_only_when_set` that are unset, its
    sampling without `adapter` when none is named and without `num_draft_tokens` when the request
    gave none (what older nodes expect). Pydantic's own encoder writes it: a long prompt's ids take
    a fifth of `json.dumps`'s time (0.17 against 0.87 ms at 8,000 ids), and the router writes two of
    these bodies before a prefill starts."""
    exclude: dict[str, Any] = {name: True for name in sent_only_when_set if not getattr(body, name)}
    unnamed = {name for name in ("adapter", "num_draft_tokens") if getattr(body.sampling, name) is None}
    if unnamed:
        exclude["sampling"] = unnamed
    return body.model_dump_json(exclude=exclude or None).encode()


class ErrorBody(_Strict):
    message: str
    type: str
    code: str
    param: str | None = None
    fault: str = "peer"


class PrefixSummaryBody(_Strict):
    """GET /internal/prefix: the node's prefix-cache summary; `unchanged` (no keys) when the
    caller's `since` is the current version."""

    block_tokens: int = Field(ge=0)
    version: int = Field(ge=0)
    keys: tuple[str, ...] = ()  # hex of each kept block's summary key
    unchanged: bool = False
    block_ends: tuple[int, ...] = ()  # a block also ends after these tokens (statecore.prefix)

    @classmethod
    def of(cls, summary: PrefixSummary | None, since: int | None) -> PrefixSummaryBody:
        if summary is None:
            return cls(block_tokens=0, version=since or 0, unchanged=True)
        return cls(block_tokens=summary.block_tokens, version=summary.version,
                   keys=tuple(key.hex() for key in summary.keys), block_ends=summary.block_ends)

    def summary(self) -> PrefixSummary | None:
        if self.unchanged:
            return None
        return PrefixSummary(self.block_tokens, self.version, tuple(bytes.fromhex(key) for key in self.keys),
                             self.block_ends)


def error_json(error: ErrorInfo) -> dict[str, object]:
    """A node's error document: OpenAI's body with the fault beside the code, and, beside the
    body, the node the error comes from where it is known (`ErrorInfo.origin`: a node passing on
    another's error). Outside the body, so that a reader that knows no origin reads the rest."""
    body = error.to_openai()
    document: dict[str, object] = {"error": {**body["error"], "fault": error.fault.value}}
    if error.origin is not None:
        document["origin"] = error.origin
    return document


def error_from_json(data: object, status: int) -> ErrorInfo:
    """An ErrorInfo from a peer's error body (no `origin`: not known); anything unreadable is the
    peer's fault."""
    try:
        body = ErrorBody.model_validate(data["error"] if isinstance(data, dict) else None)  # strs only
        origin = data.get("origin") if isinstance(data, dict) else None
        return ErrorInfo(Fault(body.fault), Code(body.code), body.message, body.param,
                         origin if isinstance(origin, str) and origin else None)
    except (ValueError, KeyError, TypeError):
        return ErrorInfo(Fault.PEER, Code.PEER_FAILED, f"peer answered HTTP {status}")


def _logprobs_json(logprobs: TokenLogprobs | None) -> dict[str, object]:
    return {} if logprobs is None else {"logprobs": [logprobs.logprob, logprobs.top]}


def _logprobs(carried: list[Any]) -> TokenLogprobs:
    return TokenLogprobs(float(carried[0]), tuple((int(token), float(lp)) for token, lp in carried[1]))


def output_line(item: Output | PrefillReply) -> bytes:
    """One NDJSON line of a decode node's stream: its request's replies as the core made them."""
    match item:
        case PrefillReply(first_token=first, is_eos=is_eos, logprobs=logprobs, cached_tokens=cached):
            doc: dict[str, object] = {"first_token": first, "is_eos": is_eos, **_logprobs_json(logprobs)}
            if cached is not None:
                doc["cached_tokens"] = cached
        case RespondTokens(tokens=(token,), logprobs=logprobs):  # one token: the line older routers read
            doc = {"token": token, **_logprobs_json(None if logprobs is None else logprobs[0])}
        case RespondTokens(tokens=tokens, logprobs=logprobs):  # a step's tokens, one line
            doc = {"tokens": list(tokens)}
            if logprobs is not None:
                doc["logprobs"] = [[lp.logprob, lp.top] for lp in logprobs]
        case Complete(finish_reason=reason):
            doc = {"finish_reason": reason}
        case Reject(error=error):
            doc = error_json(error)
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def parse_output_line(line: bytes) -> DecodeMessage:
    """A line of a decode node's stream as the router's own event (a token, the end), the first
    token's reply, or the node's error."""
    try:
        doc = json.loads(line)
        carried = doc.get("logprobs")
        if "tokens" in doc:
            tokens = tuple(int(token) for token in doc["tokens"])
            several = None if carried is None else tuple(_logprobs(each) for each in carried)
            if not tokens or (several is not None and len(several) != len(tokens)):
                raise ValueError("a step's tokens and their logprobs do not match")
            return TokensGenerated(tokens, several)
        logprobs = None if carried is None else _logprobs(carried)
        if "token" in doc:
            return TokensGenerated((int(doc["token"]),), None if logprobs is None else (logprobs,))
        if "first_token" in doc:
            cached = None if doc.get("cached_tokens") is None else int(doc["cached_tokens"])
            if cached is not None and cached < 0:
                raise ValueError("negative cached_tokens")
            return PrefillReply(int(doc["first_token"]), bool(doc["is_eos"]), 0, logprobs, cached)
        if "finish_reason" in doc:
            return Finished(str(doc["finish_reason"]))
        return error_from_json(doc, 200)
    except (ValueError, TypeError, KeyError):
        return ErrorInfo(Fault.PEER, Code.PEER_FAILED, "a decode node sent an unreadable line")


def info_json(info: ModelInfo) -> dict[str, object]:
    return {
        "name": info.name,
        "fingerprint": info.fingerprint,
        "context_length": info.context_length,
        "vocab_size": info.vocab_size,
        "eos_token_ids": sorted(info.eos_token_ids),
        "prefill_chunk_size": info.prefill_chunk_size,
        "layers": [
            {"index": lay.index, "class_name": lay.class_name, "can_travel": lay.can_travel,
             "reason": lay.reason}
            for lay in info.layers
        ],
        "parameter_bytes_by_rank": list(info.parameter_bytes_by_rank),
        **({"adapters": list(info.adapters)} if info.adapters else {}),
    }


def info_from_json(doc: dict[str, object]) -> ModelInfo:
    layers = doc.get("layers")
    eos = doc.get("eos_token_ids")
    by_rank = doc.get("parameter_bytes_by_rank", [])
    adapters = doc.get("adapters", [])
    if (not isinstance(layers, list) or not isinstance(eos, list) or not isinstance(by_rank, list)
            or not isinstance(adapters, list)):
        raise ValueError("malformed model info")
    return ModelInfo(
        name=str(doc["name"]),
        fingerprint=str(doc["fingerprint"]),
        context_length=int(str(doc["context_length"])),
        vocab_size=int(str(doc["vocab_size"])),
        eos_token_ids=frozenset(int(e) for e in eos),
        prefill_chunk_size=int(str(doc["prefill_chunk_size"])),
        layers=tuple(
            LayerTravel(int(d["index"]), str(d["class_name"]), bool(d["can_travel"]), str(d["reason"]))
            for d in layers
        ),
        parameter_bytes_by_rank=tuple(int(b) for b in by_rank),
        adapters=tuple(str(name) for name in adapters),
    )


# What every internal route does before and after its own work

Handler = Callable[[Request], Awaitable[Response]]
MAX_INTERNAL_BODY = 64 << 20
Body = TypeVar("Body", bound=BaseModel)


def error_response(error: ErrorInfo) -> JSONResponse:
    return JSONResponse(error_json(error), status_code=error.http_status)


def token_refusal(token: str | None, given: str) -> ErrorInfo | None:
    """Why a request that gave `given` as the internal token is refused (None: it is not)."""
    if token is None or hmac.compare_digest(given.encode(), token.encode()):
        return None
    return ErrorInfo(Fault.CLIENT, Code.UNAUTHORIZED, "missing or wrong internal token")


def guarded(token: str | None, handler: Handler) -> Handler:
    """Require the shared token (when one is set) and map StatecoreError to its response."""

    async def wrapped(request: Request) -> Response:
        refused = token_refusal(token, request.headers.get(TOKEN_HEADER, ""))
        if refused is not None:
            return error_response(refused)
        try:
            return await handler(request)
        except StatecoreError as exc:
            return error_response(exc.info)

    return wrapped


async def read_body(request: Request) -> bytes:
    """The request body, refused as soon as it grows past the limit (never buffered whole)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_INTERNAL_BODY:
            raise StatecoreError(client_error("body too large", Code.BODY_TOO_LARGE))
        chunks.append(chunk)
    return b"".join(chunks)


def validated(model: type[Body], raw: bytes) -> Body:
    """`raw` as `model`, or a client error naming the first problems."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise StatecoreError(client_error(f"invalid internal request: {exc.errors()[:3]}")) from exc


__all__ = [
    "CACHED_TOKENS_PARAM",
    "MAX_INTERNAL_BODY",
    "REQUEST_ID_HEADER",
    "TOKEN_HEADER",
    "DecodeBody",
    "Handler",
    "PrefillBody",
    "PrefillReplyBody",
    "PrefixFromBody",
    "PrefixKvBody",
    "PrefixSummaryBody",
    "SamplingBody",
    "error_from_json",
    "error_json",
    "error_response",
    "guarded",
    "info_from_json",
    "info_json",
    "output_line",
    "parse_output_line",
    "read_body",
    "token_refusal",
    "validated",
]
