"""Internal HTTP endpoints of prefill and decode nodes, and every node's info and stats.

Prefill node: `POST /internal/prefill` (prefill, answer the first token, hold the KV under a
lease), `GET /internal/kv/{id}` (the held KV in the wire format), `DELETE /internal/kv/{id}`
(taken: release it); `/internal/prefill`'s body may name the decode node holding the prompt's
start (`prefix_from`), which the node may pull first. Decode node: `POST /internal/decode` (pull
the KV from a prefill node, or prefill locally, then stream NDJSON lines of token ids). Decode and
single nodes: `POST /internal/prefix_kv` (the prefix cache's leading whole blocks of the posted
token ids, in the KV wire format; 404 `prefix_not_cached` when none is held). Both:
`POST /internal/cancel/{id}`, with `?finished=stop|length` when the router's request ended
normally (the node's part then ends as done with that reason), without it a cancellation.
Every node: `GET /internal/info` (the model's fingerprint and per-layer cache travel report),
`GET /internal/stats` (live counts for leak checks), `GET /internal/handoffs` (the recent KV
handoffs' bytes and timings). When a shared token is configured, internal endpoints require it
in the `X-Statecore-Token` header. Every request goes through the node's `NodeRunner`, so its life
is the core's state machine: admission is the runner's (`statecore.policy.admission`), a KV
pull is an event whose answer is the table's (`SendKv`, or `RefuseKv` with KV_NOT_FOUND), and
whether a first token ends its request is read from its context (`NodeRequest.ends_at_first_token`,
which the performer set when the token was computed or received). This module may import
anything.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Final

import trio
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from adapters.blas import blas_in_use
from adapters.http.internal_wire import (
    CACHED_TOKENS_PARAM,
    TOKEN_HEADER,
    DecodeBody,
    LogprobsBody,
    PrefillBody,
    PrefillReplyBody,
    PrefixKvBody,
    PrefixSummaryBody,
    error_json,
    info_json,
    output_line,
    prefix_source,
)
from adapters.http.segment_copies import CopyFinished, SegmentCopies
from adapters.http.streaming import WatchedStream
from adapters.kv import shm as kv_shm
from adapters.kv import stream as kv_stream
from adapters.kv.frames import declared_tensor_bytes
from adapters.kv.plane import PlaneAnswer, PlaneRequest
from effects.faults import Phase
from effects.interpret import EnginePerformer, NodeRequest
from effects.kv_pulls import StreamItem
from effects.ports import (
    Engine,
    KvBytes,
    KvPieces,
    KvSegment,
    PrefillReply,
)
from effects.runner import NodeRunner, RunnerGeneration, open_generation
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error
from statecore.events import (
    Admitted,
    ClientCancelled,
    KvRequested,
    KvTaken,
    PrefillLocally,
    StopMatched,
)
from statecore.ids import RequestId
from statecore.intents import Complete, Reject, RespondToken
from statecore.policy import FINISH_REASONS, STOP

log = logging.getLogger("statecore.node_api")

Handler = Callable[[Request], Awaitable[Response]]
KV_SEND_TIMEOUT_S = 60.0
MAX_INTERNAL_BODY = 64 << 20


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


def _validated(model: type[PrefillBody] | type[DecodeBody] | type[PrefixKvBody], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise StatecoreError(client_error(f"invalid internal request: {exc.errors()[:3]}")) from exc


KV_PATH = "/internal/kv/"
KV_SEND_SLICE = 4 << 20
"""Bytes per ASGI body message of a KV payload (see `_messages`)."""


def kv_body(parts: AsyncIterator[Sequence[KvBytes]], length: int) -> Response:
    """A KV payload's parts (`payload_parts`) sent through the ASGI server with their
    Content-Length (`_messages`)."""
    return WatchedStream(_messages(parts), media_type="application/octet-stream",
                         headers={"content-length": str(length)})


async def payload_parts(payload: KvPieces, on_end: Callable[[KvBytes], None] = lambda end: None,
                        head: bytes = b"") -> AsyncGenerator[Sequence[KvBytes], None]:
    """`head` and a payload's pieces as they are (the first bytes leave at once), then its end
    frame once the checksum is computed; `on_end` gets the payload's last bytes."""
    yield [head, *payload.pieces] if head else payload.pieces
    if payload.seal is not None:
        end = await trio.to_thread.run_sync(payload.seal)
        on_end(end)
        yield [end]
    elif payload.pieces:
        on_end(payload.pieces[-1])


async def _messages(parts: AsyncIterator[Sequence[KvBytes]]) -> AsyncGenerator[bytes, None]:
    """Buffers as ASGI body messages of KV_SEND_SLICE bytes, each gathered as it goes: the
    tensors are copied once (into the message, which the server then sends as it is) and a cache
    of many small blocks does not cost one server round per block. Each item of `parts` is sent
    before the next is awaited (a streamed record must not wait for the next one)."""
    async with contextlib.aclosing(parts) as items:  # type: ignore[type-var]
        async for buffers in items:
            batch: list[memoryview] = []
            size = 0
            for buffer in buffers:
                view = memoryview(buffer).cast("B")
                while len(view):
                    take = view[: KV_SEND_SLICE - size]
                    view = view[len(take):]
                    batch.append(take)
                    size += len(take)
                    if size == KV_SEND_SLICE:
                        yield b"".join(batch)
                        batch, size = [], 0
            if batch:
                yield b"".join(batch)


DEVICE_THREAD: Final = "the MLX device thread"  # what runs a node's engine by default
CORE_PROCESS: Final = "the engine core process"  # ... with --engine-core process


class NodeApi:
    """The internal routes of one engine-backed node."""

    def __init__(
        self,
        role: str,
        engine: Engine,
        runner: NodeRunner[Any],
        performer: EnginePerformer,
        *,
        token: str | None = None,
        max_live: int = 256,
        kv_buffer_bytes: Callable[[], int] = lambda: 0,
        warnings: list[str] | None = None,
        kv_stream: bool = True,
        shm: kv_shm.ShmOutbox | None = None,
        kv_served: Callable[[int], None] = lambda nbytes: None,
        runs_engine: str = DEVICE_THREAD,
    ) -> None:
        self.role = role
        self.runs_engine = runs_engine  # what runs the engine (DEVICE_THREAD or CORE_PROCESS): what dies
        # a prefill node's shared memory for streamed pieces to decode nodes on this host
        self.shm = shm
        # the metrics' count of KV served: a streamed piece's payload bytes, or a pulled payload's,
        # once sent (through the HTTP port or the KV plane alike)
        self.kv_served = kv_served
        # Requests with pieces in shared memory. A region is released when the decode node says it
        # is done with the request (its DELETE once installed, or its cancel): a region freed
        # earlier could be reused while it still maps the piece. A request that ended here
        # without that word keeps its regions for KV_SEND_TIMEOUT_S at most.
        self._shared: set[RequestId] = set()
        # The pieces an engine core process put in shared memory and this node handed on as they
        # lie: kept (so the core keeps their regions) until the request's regions are released.
        self._handed_on: dict[RequestId, list[KvPieces]] = {}
        if shm is not None:
            performer.on_forget.append(self._release_later)
        self.kv_port: int | None = None  # the KV plane's port, once it listens (a prefill node's)
        self.blas: str | None = None  # what the engine computes with, when its node knows (else MLX is asked)
        self.kv_plane_bodies = 0  # KV bodies the plane answered (streams and pulls)
        # whether this node takes part in streamed handoffs (not a tensor- or pipeline-parallel one)
        self.kv_stream = kv_stream
        self.warnings = warnings or []  # start-up warnings, repeated in /health
        self.lost_reason: str | None = None  # why the engine (this node's transport) is lost
        self.kv_buffer_bytes = kv_buffer_bytes  # a decode node's kept receive buffers
        self.engine = engine
        self.runner = runner
        self.performer = performer
        self.token = token
        self.max_live = max_live
        self.faults = performer.faults

    def routes(self) -> list[BaseRoute]:
        g = self.token
        common: list[BaseRoute] = [
            Route("/internal/info", guarded(g, self.info), methods=["GET"]),
            Route("/internal/stats", guarded(g, self.stats), methods=["GET"]),
            Route("/internal/handoffs", guarded(g, self.handoffs), methods=["GET"]),
            Route("/internal/cancel/{request_id}", guarded(g, self.cancel), methods=["POST"]),
            Route("/internal/prefix", guarded(g, self.prefix), methods=["GET"]),
        ]
        if self.role == "prefill":
            return [
                *common,
                Route("/internal/prefill", guarded(g, self.prefill), methods=["POST"]),
                Route("/internal/prefill_stream", guarded(g, self.prefill_stream), methods=["POST"]),
                Route("/internal/kv/{request_id}", guarded(g, self.send_kv), methods=["GET"]),
                Route("/internal/kv/{request_id}", guarded(g, self.kv_taken), methods=["DELETE"]),
            ]
        return [*common, Route("/internal/decode", guarded(g, self.decode), methods=["POST"]),
                Route("/internal/prefix_kv", guarded(g, self.prefix_kv), methods=["POST"])]

    def lose(self, reason: str) -> None:
        """The engine (this node's transport) is lost: health says why from now on."""
        self.lost_reason = reason

    def engine_lost(self) -> str | None:
        """Why this node's engine is lost (its loop ends and the node exits soon), or None."""
        if self.lost_reason is not None:
            return self.lost_reason
        if not self.engine.statistics().device_thread_alive:
            return f"{self.runs_engine} is not running"
        return None

    async def health(self, request: Request) -> Response:
        details: dict[str, object] = {"warnings": self.warnings} if self.warnings else {}
        if (lost := self.engine_lost()) is not None:
            details["reason"] = lost
        elif not self.runner.ready():
            phase = self.runner.statistics().phase.value
            details["reason"] = f"the serving loop is not accepting requests ({phase})"
        else:
            return JSONResponse({"status": "ok", **details})
        return JSONResponse({"status": "unavailable", **details}, status_code=503)

    async def info(self, request: Request) -> Response:
        shared: dict[str, object] = {} if self.shm is None else {"kv_shm": self.shm.advert().model_dump()}
        if self.kv_port is not None:
            shared["kv_port"] = self.kv_port
        return JSONResponse({**info_json(self.engine.info), "blas": self.blas or blas_in_use(),
                             "kv_stream": self.kv_stream and self.role in ("prefill", "decode"), **shared})

    def statistics(self) -> dict[str, object]:
        engine = self.engine.statistics()
        runner = self.runner.statistics()
        return {
            "role": self.role,
            "loop_phase": runner.phase.value,
            "live_requests": runner.live_requests,
            "live_tasks": runner.live_tasks,
            "contexts": runner.entries,
            "outcomes": runner.outcomes,
            "bugs": runner.bugs,
            "decoding": engine.decoding,
            "held_caches": engine.held_caches,
            "held_bytes": engine.held_bytes,
            "kv_arriving": engine.arriving,  # streamed handoffs' pieces kept, not yet installed
            # shared memory held for streamed pieces not yet taken (a prefill node's)
            "kv_shm_held_bytes": 0 if self.shm is None else self.shm.statistics().held_bytes,
            "kv_plane_bodies": self.kv_plane_bodies,  # KV bodies sent on the KV plane's socket
            # KV pulls and streamed handoffs waiting for a request's KV (a prefill node's)
            "kv_waiting": len(self.performer.kv_pulls) + len(self.performer.kv_streams),
            "device_thread_alive": engine.device_thread_alive,
            "engine_step_retries": engine.step_retries,
            "engine_rows_isolated": engine.rows_isolated,
            "kv_reserved_bytes": engine.kv_reserved_bytes,
            "kv_budget_bytes": engine.kv_budget_bytes,
            "device_memory_bytes": engine.device_memory_bytes,
            "device_peak_bytes": engine.device_peak_bytes,
            "prefix_cache_bytes": engine.prefix_cache_bytes,
            "prefix_cache_hits": engine.prefix_cache_hits,
            "prefix_tokens_reused": engine.prefix_tokens_reused,
            "prefix_cache_queries": engine.prefix_cache_queries,
            "prefix_cache_evictions": engine.prefix_cache_evictions,
            "prefix_host": {"bytes": engine.prefix_host_bytes,
                            "capacity_bytes": engine.prefix_host_capacity_bytes,
                            "blocks_out": engine.prefix_host_out, "blocks_back": engine.prefix_host_back,
                            "blocks_forgotten": engine.prefix_host_forgotten},
            "prefill_capped_steps": engine.prefill_capped_steps,
            "activation_overruns": engine.activation_overruns,
            "activation_estimate_peak_bytes": engine.activation_estimate_peak_bytes,
            "conversations_kept": engine.conversations_kept,
            "speculative": {"steps": engine.speculative_steps, "drafted": engine.speculative_drafted,
                            "accepted": engine.speculative_accepted, "emitted": engine.speculative_emitted,
                            "off_reason": engine.speculative_off_reason or None},
            "kv_receive_buffer_bytes": self.kv_buffer_bytes(),  # kept for reuse, not a leak
            "device_time": {kind: {"calls": calls, "seconds": round(seconds, 6)}
                            for kind, calls, seconds in engine.device_time},
        }

    async def prefix(self, request: Request) -> Response:
        """The prefix cache's summary for the router (`?since=VERSION`: only whether it changed)."""
        raw = request.query_params.get("since")
        if raw is not None and not raw.isdigit():
            return error_response(client_error("since must be a version number (a non-negative integer)"))
        since = None if raw is None else int(raw)
        summary = await self.engine.prefix_summary(since)
        return JSONResponse(PrefixSummaryBody.of(summary, since).model_dump())

    async def stats(self, request: Request) -> Response:
        return JSONResponse(self.statistics())

    async def handoffs(self, request: Request) -> Response:
        return JSONResponse(self.performer.handoffs.snapshot())

    async def _admit(self, rid: RequestId, context: NodeRequest, capacity: int) -> RunnerGeneration:
        return await open_generation(self.runner, rid, capacity, context, max_live=self.max_live,
                                     faults=self.faults, refusal=self._lost_engine())

    def _lost_engine(self) -> ErrorInfo | None:
        """Between its device's death and its loop's end (it then exits) the node is a failed peer
        to whoever asks, not a bug of the request: the router tries another node."""
        if (lost := self.engine_lost()) is None:
            return None
        return ErrorInfo(Fault.PEER, Code.ENGINE_FAILED,
                         f"this node's engine is lost ({lost}): it is going down")

    async def prefill(self, request: Request) -> Response:
        body: PrefillBody = _validated(PrefillBody, await read_body(request))
        rid = RequestId(body.request_id)
        context = NodeRequest(tuple(body.prompt), body.sampling.params(), hands_off=True,
                              prefix_from=prefix_source(body.prefix_from))
        generation = await self._admit(rid, context, 4)
        await self.runner.post(rid, Admitted(len(body.prompt)))
        try:
            reply = await generation.replies.receive()
        except trio.EndOfChannel:
            # cancelled before its first token (a cancellation sends no rejection)
            reply = Reject(rid, ErrorInfo(Fault.CANCELLED, Code.CANCELLED, "the prefill was cancelled"))
        match reply:
            case RespondToken(token=token, logprobs=logprobs):
                held = self.engine.statistics().held_bytes
                cached = context.cached_tokens if _asks_cached_tokens(request) else None
                return JSONResponse(PrefillReplyBody(first_token=token, is_eos=context.ends_at_first_token,
                                                     held_bytes=held,
                                                     logprobs=LogprobsBody.of(logprobs),
                                                     cached_tokens=cached).document())
            case Reject(error=error):
                return error_response(error)
            case Complete():
                return error_response(ErrorInfo(Fault.BUG, Code.INTERNAL, "prefill completed early"))

    async def prefill_stream(self, request: Request) -> Response:
        """A streamed handoff through the ASGI server (`_open_prefill_stream`); the KV plane
        (`plane`) serves the same stream on the socket directly."""
        records = await self._open_prefill_stream(await read_body(request))
        return WatchedStream(_messages(records), media_type="application/octet-stream")

    async def plane(self, request: PlaneRequest) -> PlaneAnswer:
        """The KV routes as the KV plane (`adapters.kv.plane`) serves them: a prefill node's
        streamed handoff and held KV, their bodies written to the socket as they are."""
        refused = token_refusal(self.token, request.headers.get(TOKEN_HEADER.lower(), ""))
        try:
            if refused is not None:
                raise StatecoreError(refused)
            path = request.target.split("?", 1)[0]
            if self.role == "prefill" and request.method == "POST" and path == "/internal/prefill_stream":
                records = await self._open_prefill_stream(request.body)
                self.kv_plane_bodies += 1
                return PlaneAnswer(200, records)
            if self.role == "prefill" and request.method == "GET" and path.startswith(KV_PATH):
                parts, length = await self._kv_parts(RequestId(path.removeprefix(KV_PATH)))
                self.kv_plane_bodies += 1
                return PlaneAnswer(200, parts, length)
            unknown = client_error(f"the KV plane serves no {request.method} {path}")
            return PlaneAnswer.document(404, json.dumps(error_json(unknown)).encode())
        except StatecoreError as exc:
            return PlaneAnswer.document(exc.info.http_status, json.dumps(error_json(exc.info)).encode())

    async def _open_prefill_stream(self, raw: bytes) -> AsyncGenerator[Sequence[KvBytes], None]:
        """A streamed handoff, asked by the decode node the router chose: prefill the prompt and
        stream its KV as it is computed (`adapters.kv.stream`), the first token among it. The
        request then waits in `handoff`, holding the cache, for the decode node's DELETE once it
        installed the pieces (or its cancel, or the lease), as a pulled cache does."""
        body: PrefillBody = _validated(PrefillBody, raw)
        rid = RequestId(body.request_id)
        context = NodeRequest(tuple(body.prompt), body.sampling.params(), hands_off=True,
                              prefix_from=prefix_source(body.prefix_from))
        # the stream waits by request id for what the prefill sends it (`KvStreams`), from
        # before the request is admitted until its last item
        items = self.performer.kv_streams.open(rid, len(body.prompt), len(self.engine.info.layers))
        try:
            generation = await self._admit(rid, context, 4)
            await self.runner.post(rid, Admitted(len(body.prompt)))
        except BaseException:
            self.performer.kv_streams.end(rid)  # never admitted: nothing else would close it
            raise
        shared = self.shm if body.kv_shm else None
        self.performer.handoffs.record(rid).transport = "http" if shared is None else "shm"
        return self._stream_records(generation, items, len(body.prompt), shared)

    async def _stream_records(self, generation: RunnerGeneration,
                              items: trio.MemoryReceiveChannel[StreamItem], prompt_tokens: int,
                              shared: kv_shm.ShmOutbox | None) -> AsyncGenerator[Sequence[KvBytes], None]:
        """The stream's records: each piece as it is computed (through shared memory: copied in
        the background, `SegmentCopies`, its record written once the copy is done, in order),
        the first token as soon as it is sampled, then the end once every piece went."""
        rid = generation.request_id
        ended = False
        received = sent = 0
        copies = None if shared is None else SegmentCopies(shared, rid)
        more_items = True
        try:
            yield [kv_stream.preamble()]
            async with items:
                while True:
                    while copies is not None and (copied := copies.finished()) is not None:
                        async for parts in self._piece_record(rid, *copied):
                            yield parts
                        sent += 1
                    if not more_items and not copies:
                        ended = True
                        yield [kv_stream.end_record(prompt_tokens, sent)]
                        break
                    try:
                        event = (await items.receive() if copies is None
                                 else await copies.next_event(items, more_items=more_items))
                    except trio.EndOfChannel:
                        break
                    match event:
                        case CopyFinished():
                            continue
                        case KvSegment():
                            damaged = None if received else await self._damaged(rid, event.payload)
                            received += 1
                            if damaged is not None:  # tests only: a cut or flipped first piece
                                yield [self._piece_head(event), damaged]
                                if len(damaged) < event.payload.nbytes:
                                    return  # cut: the stream ends here, without its end record
                                sent += 1
                            elif copies is not None:
                                self._shared.add(rid)
                                if event.payload.shared is not None:
                                    self._handed_on.setdefault(rid, []).append(event.payload)
                                copies.start(event)
                            else:
                                async for parts in self._piece_record(rid, event, None):
                                    yield parts
                                sent += 1
                        case PrefillReply():
                            yield [kv_stream.document_record(kv_stream.FIRST_TOKEN,
                                                             PrefillReplyBody.of(event).document())]
                        case ErrorInfo():
                            ended = True
                            yield [kv_stream.document_record(kv_stream.ERROR, error_json(event))]
                            return
                        case None:
                            more_items = False
        finally:
            if copies is not None:
                await copies.settle()  # their regions exist before anyone releases them
            if not ended:  # the decode node went away mid-stream: free the prefill now
                with trio.CancelScope(shield=True):
                    await generation.cancel()
            if self.runner.context(rid) is None:
                self._release_later(rid)  # it ended before its last piece was put

    @staticmethod
    def _piece_range(segment: KvSegment) -> kv_stream.SegmentRange:
        return kv_stream.SegmentRange(segment.start, segment.stop, segment.first_layer, segment.end_layer)

    def _piece_head(self, segment: KvSegment) -> bytes:
        return kv_stream.segment_head(self._piece_range(segment), segment.payload.nbytes,
                                      last_step_started=segment.last_step_started)

    async def _piece_record(self, rid: RequestId, segment: KvSegment,
                            ref: kv_shm.ShmRef | None) -> AsyncGenerator[Sequence[KvBytes], None]:
        """A piece's record: by reference to its copy in shared memory, or inline."""
        if ref is not None:
            yield [kv_stream.shared_segment_record(self._piece_range(segment), ref.model_dump(),
                                                 last_step_started=segment.last_step_started)]
        else:
            if self.shm is not None and rid in self._shared:
                log.warning("request %s: no room in shared memory; a piece goes over HTTP", rid)
            async for parts in payload_parts(segment.payload, head=self._piece_head(segment)):
                yield parts
        self.kv_served(segment.payload.nbytes)

    def _release_shared(self, rid: RequestId) -> None:
        """The decode node is done with the request: its shared memory may be reused."""
        if self.shm is not None and rid in self._shared:
            self._shared.discard(rid)
            self.shm.release(rid)
            self._handed_on.pop(rid, None)  # the core frees their regions once the last view goes

    def _release_later(self, rid: RequestId) -> None:
        """A request ended here: its shared memory goes once the decode node says so, or after
        KV_SEND_TIMEOUT_S (a decode node that never will: it died)."""
        if rid not in self._shared:
            return

        async def release_when_overdue() -> None:
            await trio.sleep(KV_SEND_TIMEOUT_S)
            self._release_shared(rid)

        trio.lowlevel.spawn_system_task(release_when_overdue)

    async def prefix_kv(self, request: Request) -> Response:
        """The prefix cache's leading whole blocks of the posted tokens, in the KV wire format (a
        prefill node about to prefill a prompt that starts with them pulls them), or
        PREFIX_NOT_CACHED (404) when it holds none. Never a live request's cache. Counted as KV
        served once sent, as a pulled payload is."""
        body: PrefixKvBody = _validated(PrefixKvBody, await read_body(request))
        payload = await self.engine.export_prefix(body.tokens)
        return kv_body(self._served(payload_parts(payload), payload.nbytes), payload.nbytes)

    async def send_kv(self, request: Request) -> Response:
        return kv_body(*await self._kv_parts(RequestId(request.path_params["request_id"])))

    async def _kv_parts(self, rid: RequestId) -> tuple[AsyncGenerator[Sequence[KvBytes], None], int]:
        """The held KV the decode node pulls, as body parts and their length (the HTTP port's
        answer and the KV plane's alike)."""
        payload = await self._kv_to_send(rid)
        if isinstance(payload, bytes):  # a damaged payload (tests only): no end frame to read
            return self._served(payload_parts(KvPieces((payload,))), len(payload)), len(payload)
        parts = payload_parts(payload, lambda end: self._note_raw_bytes(rid, end))
        return self._served(parts, payload.nbytes), payload.nbytes

    async def _served(self, parts: AsyncGenerator[Sequence[KvBytes], None],
                      nbytes: int) -> AsyncGenerator[Sequence[KvBytes], None]:
        """`parts` as they are, the whole payload counted as KV served (`kv_served`) once its
        last part was sent, whichever port carried it (as a streamed piece is)."""
        async with contextlib.aclosing(parts):
            async for buffers in parts:
                yield buffers
        self.kv_served(nbytes)

    async def _kv_to_send(self, rid: RequestId) -> KvPieces | bytes:
        """The held KV the decode node pulls (bytes: a damaged payload, tests only). The pull is
        the core's `KvRequested` event; the core answers it (the KV once the request holds it,
        else why not) and the performer delivers the answer to the pull waiting here."""
        with self.performer.kv_pulls.pull(rid) as pull:
            await self.runner.post(rid, KvRequested())
            with trio.move_on_after(KV_SEND_TIMEOUT_S):
                payload = await pull.wait()
                if isinstance(payload, ErrorInfo):
                    raise StatecoreError(payload)
                damaged = await self._damaged(rid, payload)
                return payload if damaged is None else damaged
        raise StatecoreError(ErrorInfo(Fault.PEER, Code.TIMEOUT, "the KV was not ready in time"))

    def _note_raw_bytes(self, rid: RequestId, tail: KvBytes) -> None:
        """Record the tensor bytes that the payload's end (`tail`: its last bytes) declares."""
        self.performer.handoffs.record(rid).raw_bytes = declared_tensor_bytes(tail)

    async def _damaged(self, rid: RequestId, pieces: KvPieces) -> bytes | None:
        """Injected transfer faults (tests only): cut after the header's first bytes, cut
        mid-body, or flip one byte. None when no fault applies."""
        phases = (Phase.SEND_HEADER, Phase.MID_BODY, Phase.CHECKSUM)
        fault = next((phase for phase in phases if self.faults.applies(phase, rid)), None)
        if fault is None:
            return None
        payload = await trio.to_thread.run_sync(pieces.joined)  # waits for the end frame
        if fault is Phase.SEND_HEADER:
            return payload[:16]
        middle = len(payload) // 2
        if fault is Phase.MID_BODY:
            return payload[:middle]
        return payload[:middle] + bytes([payload[middle] ^ 0xFF]) + payload[middle + 1 :]

    async def kv_taken(self, request: Request) -> Response:
        rid = RequestId(request.path_params["request_id"])
        await self.runner.post(rid, KvTaken())
        self._release_shared(rid)
        return JSONResponse({"released": rid})

    async def cancel(self, request: Request) -> Response:
        rid = RequestId(request.path_params["request_id"])
        finished = request.query_params.get("finished")
        if finished is None and request.query_params.get("stopped") == "1":
            finished = STOP  # a router of an older version
        if finished is not None and finished not in FINISH_REASONS:
            raise StatecoreError(client_error(f"finished must be one of {sorted(FINISH_REASONS)}"))
        await self.runner.post(rid, StopMatched(finished) if finished else ClientCancelled())
        self._release_shared(rid)
        return JSONResponse({"cancelled": rid})

    async def decode(self, request: Request) -> Response:
        body: DecodeBody = _validated(DecodeBody, await read_body(request))
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
            prefix_from=prefix_source(body.prefix_from),
        )
        generation = await self._admit(rid, context, body.sampling.max_tokens + 4)
        await self.runner.post(rid, PrefillLocally() if local else Admitted(len(body.prompt)))
        return WatchedStream(self._lines(generation, context, first_is_prefill=local or streamed,
                                         cached_tokens=_asks_cached_tokens(request)),
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
                if sent == 3 and self.faults.applies(Phase.STREAM_OUT, generation.request_id):
                    return  # the stream to the router breaks off (tests only)
                cached = context.cached_tokens if cached_tokens else None
                if first and isinstance(output, RespondToken):
                    first = False
                    yield output_line(PrefillReply(output.token, context.ends_at_first_token, 0,
                                                   output.logprobs, cached))
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


def _asks_cached_tokens(request: Request) -> bool:
    """Whether the router asked for the prefill's cached prompt tokens (`?cached_tokens=1`)."""
    return request.query_params.get(CACHED_TOKENS_PARAM) == "1"


__all__ = ["CORE_PROCESS", "DEVICE_THREAD", "MAX_INTERNAL_BODY", "NodeApi", "error_response", "guarded",
           "kv_body", "payload_parts"]
