"""The internal requests a router sends an engine-backed node: `POST /internal/prefill` (a
prefill node: prefill, answer the first token, hold the KV under a lease for the decode node's
pull), `POST /internal/decode` (a decode node: pull the KV from a prefill node, take it streamed,
or prefill locally, then stream NDJSON lines of token ids), and `POST /internal/cancel/{id}`, with
`?finished=stop|length` when the router's request ended normally (the node's part then ends as
done with that reason), without it a cancellation. Each request's life is the core's state
machine in the node's `NodeRunner`; whether a first token ends its request is read from its
context (`NodeRequest.ends_at_first_token`, set by the performer when the token was computed or
received). This module may import anything.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from adapters.http.internal_wire import (
    CACHED_TOKENS_PARAM,
    DecodeBody,
    LogprobsBody,
    PrefillBody,
    PrefillReplyBody,
    error_response,
    output_line,
    prefix_source,
    read_body,
    validated,
)
from adapters.http.node_status import NodeStatus
from adapters.http.streaming import WatchedStream
from effects.faults import FaultPort, Phase
from effects.interpret import NodeRequest
from effects.ports import PrefillReply
from effects.runner import NodeRunner, RunnerGeneration
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error
from statecore.events import Admitted, ClientCancelled, PrefillLocally, StopMatched
from statecore.ids import RequestId
from statecore.intents import Complete, Reject, RespondTokens
from statecore.policy import FINISH_REASONS, STOP


class StartStream(Protocol):
    """`KvHandoff.start_stream`: a streamed handoff's prefill, started by the router."""

    async def __call__(self, body: PrefillBody, *, cached_tokens: bool) -> Response: ...


class NodeRequests:
    """The prefill, decode and cancel routes of one node."""

    def __init__(self, status: NodeStatus, runner: NodeRunner[Any], faults: FaultPort, *,
                 kv_stream: bool, ended: Callable[[RequestId], None] = lambda rid: None,
                 start_stream: StartStream | None = None) -> None:
        self.status = status  # the node's admission of requests
        self.runner = runner
        self.faults = faults
        # whether this node takes streamed handoffs (not a tensor- or pipeline-parallel one)
        self.kv_stream = kv_stream
        self.ended = ended  # the router is done with a request here (a prefill node frees its shared memory)
        # a prefill node's streamed handoff the router starts (`kv_attach`: `KvHandoff.start_stream`)
        self.start_stream = start_stream

    async def prefill(self, request: Request) -> Response:
        body = validated(PrefillBody, await read_body(request))
        if body.kv_attach:
            if self.start_stream is None or not self.kv_stream:
                raise StatecoreError(client_error("this node takes no streamed handoff (tensor or pipeline "
                                                  "parallel): the router pulls the KV instead"))
            return await self.start_stream(body, cached_tokens=asks_cached_tokens(request))
        rid = RequestId(body.request_id)
        context = NodeRequest(tuple(body.prompt), body.sampling.params(), hands_off=True,
                              prefix_from=prefix_source(body.prefix_from))
        generation = await self.status.admit_prefill(rid, context)
        try:
            reply = await generation.replies.receive()
        except trio.EndOfChannel:
            # cancelled before its first token (a cancellation sends no rejection)
            reply = Reject(rid, ErrorInfo(Fault.CANCELLED, Code.CANCELLED, "the prefill was cancelled"))
        match reply:
            case RespondTokens(tokens=(token,), logprobs=logprobs):  # the first token, alone
                first_logprobs = None if logprobs is None else logprobs[0]
                cached = context.cached_tokens if asks_cached_tokens(request) else None
                return JSONResponse(PrefillReplyBody(first_token=token, is_eos=context.ends_at_first_token,
                                                     held_bytes=context.held_bytes,
                                                     logprobs=LogprobsBody.of(first_logprobs),
                                                     cached_tokens=cached).document())
            case Reject(error=error):
                return error_response(error)
            case Complete() | RespondTokens():
                return error_response(ErrorInfo(Fault.BUG, Code.INTERNAL, "prefill completed early"))

    async def cancel(self, request: Request) -> Response:
        rid = RequestId(request.path_params["request_id"])
        finished = request.query_params.get("finished")
        if finished is None and request.query_params.get("stopped") == "1":
            finished = STOP  # a router of an older version
        if finished is not None and finished not in FINISH_REASONS:
            raise StatecoreError(client_error(f"finished must be one of {sorted(FINISH_REASONS)}"))
        await self.runner.post(rid, StopMatched(finished) if finished else ClientCancelled())
        self.ended(rid)
        return JSONResponse({"cancelled": rid})

    async def decode(self, request: Request) -> Response:
        body = validated(DecodeBody, await read_body(request))
        rid = RequestId(body.request_id)
        streamed = body.kv_stream and body.prefill_url is not None
        if streamed and not self.kv_stream:
            raise StatecoreError(client_error("this node takes no streamed handoff (tensor or pipeline "
                                              "parallel): the router pulls the KV instead"))
        local = not streamed and (body.prefill_url is None or body.first_token is None)
        context = NodeRequest(
            tuple(body.prompt),
            body.sampling.params(),
            first_token=None if local or streamed else body.first_token,
            prefill_url=None if local else body.prefill_url,
            streamed=streamed,
            kv_attach=streamed and body.kv_attach,
            prefix_from=None if streamed and body.kv_attach else prefix_source(body.prefix_from),
        )
        generation = await self.status.admit(rid, context, body.sampling.max_tokens + 4)
        await self.runner.post(rid, PrefillLocally() if local else Admitted(len(body.prompt)))
        return WatchedStream(self._lines(generation, context, first_is_prefill=local or streamed,
                                         cached_tokens=asks_cached_tokens(request)),
                             media_type="application/x-ndjson")

    async def _lines(self, generation: RunnerGeneration, context: NodeRequest, *, first_is_prefill: bool,
                     cached_tokens: bool = False) -> AsyncGenerator[bytes, None]:
        """The decode stream's NDJSON lines. A local prefill's first token goes first as a prefill
        reply (with the prompt tokens it took from the prefix cache when the router asked: then a
        first token that is EOS, which ends the request at once, is sent as one too)."""
        first = first_is_prefill
        finished = False
        sent = 0
        try:
            async for output in generation:
                sent += 1
                if sent == 3 and self.faults.armed \
                        and self.faults.applies(Phase.STREAM_OUT, generation.request_id):
                    return  # the stream to the router breaks off (tests only)
                cached = context.cached_tokens if cached_tokens else None
                if first and isinstance(output, RespondTokens):
                    first = False
                    first_logprobs = None if output.logprobs is None else output.logprobs[0]
                    yield output_line(PrefillReply(output.tokens[0], context.ends_at_first_token, 0,
                                                   first_logprobs, cached))
                    continue
                if (first and cached is not None and isinstance(output, Complete)
                        and output.finish_reason == STOP and context.first_token is not None
                        and context.ends_at_first_token):
                    finished = True
                    yield output_line(PrefillReply(context.first_token, True, 0, None, cached))
                    continue
                finished = isinstance(output, Complete | Reject)
                yield output_line(output)
        finally:
            if not finished:  # the router went away mid-stream: free the slot now
                with trio.CancelScope(shield=True):
                    await generation.cancel()


def asks_cached_tokens(request: Request) -> bool:
    """Whether the router asked for the prefill's cached prompt tokens (`?cached_tokens=1`)."""
    return request.query_params.get(CACHED_TOKENS_PARAM) == "1"


__all__ = ["NodeRequests", "asks_cached_tokens"]
