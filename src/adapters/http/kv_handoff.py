"""A prefill node's side of the KV handoff: the held KV a decode node pulls (`GET
/internal/kv/{id}`, and `DELETE` once it is taken), the streamed handoff (`POST
/internal/prefill_stream`: prefill, then each piece of the KV as it is computed, the first token
among them; or, where the router started the prefill itself with `POST /internal/prefill` and
`kv_attach`, the stream of that prefill, which the decode node attaches to), and the same two on
the KV plane's socket (`KvHandoff.plane`). How the bytes leave (a payload's body, a stream's
records, its pieces in shared memory) is `kv_send`'s. A pull is the core's `KvRequested` event: the
table answers it (`SendKv`, or `RefuseKv` with KV_NOT_FOUND) and the performer delivers the answer
to the pull waiting here. This module may import anything.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from adapters.http.internal_wire import (
    TOKEN_HEADER,
    PrefillBody,
    PrefillReplyBody,
    error_json,
    error_response,
    prefix_source,
    read_body,
    token_refusal,
    validated,
)
from adapters.http.kv_send import (
    KV_SEND_TIMEOUT_S,
    SharedPieces,
    StreamBody,
    StreamRecords,
    body_messages,
    counted,
    damaged,
    kv_body,
    payload_parts,
)
from adapters.http.node_status import NodeStatus
from adapters.http.streaming import WatchedStream
from adapters.kv.frames import declared_tensor_bytes
from adapters.kv.plane import PlaneAnswer, PlaneRequest
from adapters.kv.shm_outbox import ShmOutbox
from effects.faults import FaultPort
from effects.interpret import EnginePerformer, NodeRequest
from effects.kv_pulls import StreamItem, ended_before_sent
from effects.ports import Engine, KvBytes, KvPieces
from effects.runner import NodeRunner, RunnerGeneration
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error
from statecore.events import KvRequested, KvTaken
from statecore.ids import RequestId

KV_PATH = "/internal/kv/"
# How long a decode node's attach waits for the router's call that starts the prefill: the router
# sends both at once, and the decode node's may come first.
ATTACH_WAIT_S = 10.0

# what a stream's opening gives (`KvHandoff._open_admitted`)
Opened = TypeVar("Opened")


def _why_it_ended(rid: RequestId, items: trio.MemoryReceiveChannel[StreamItem]) -> ErrorInfo:
    """The error a stream's request ended with (its last item), else that it ended before its
    KV was sent; the stream is closed."""
    why = ended_before_sent(rid)
    with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel), items:
        while True:
            if isinstance(item := items.receive_nowait(), ErrorInfo):
                why = item
    return why


class KvHandoff:
    """A prefill node's KV routes: the pull, the streamed handoff, and both on the KV plane."""

    def __init__(self, status: NodeStatus, engine: Engine, runner: NodeRunner[Any],
                 performer: EnginePerformer, shared: SharedPieces, *, token: str | None,
                 kv_served: Callable[[int], None]) -> None:
        self.status = status  # the node's role and its admission of requests
        self.engine = engine
        self.runner = runner
        self.performer = performer
        self.shared = shared
        self.token = token
        # the metrics' count of KV served: a streamed piece's payload bytes, or a pulled payload's,
        # once sent (through the HTTP port or the KV plane alike)
        self.kv_served = kv_served
        self.faults: FaultPort = performer.faults
        self.stream_records = StreamRecords(shared, runner, self.faults, kv_served)
        self.plane_bodies = 0  # KV bodies the plane answered (streams and pulls)
        # by decode node (as routers name it): whether its last attach took pieces in GPU memory,
        # so that a stream the router starts for it makes them so from its first piece
        self._attached_on_device: dict[str, bool] = {}

    async def prefill_stream(self, request: Request) -> Response:
        """A streamed handoff through the ASGI server (`open_prefill_stream`); the KV plane
        (`plane`) serves the same stream on the socket directly."""
        records = await self.open_prefill_stream(await read_body(request))
        # closed here too, however early the response ended: `body_messages` closes it only once
        # it was started itself
        return WatchedStream(body_messages(records), media_type="application/octet-stream",
                             on_close=records.aclose)

    async def plane(self, request: PlaneRequest) -> PlaneAnswer:
        """The KV routes as the KV plane (`adapters.kv.plane`) serves them: a prefill node's
        streamed handoff and held KV, their bodies written to the socket as they are."""
        refused = token_refusal(self.token, request.headers.get(TOKEN_HEADER.lower(), ""))
        try:
            if refused is not None:
                raise StatecoreError(refused)
            path = request.target.split("?", 1)[0]
            prefill = self.status.role == "prefill"
            if prefill and request.method == "POST" and path == "/internal/prefill_stream":
                records = await self.open_prefill_stream(request.body)
                self.plane_bodies += 1
                return PlaneAnswer(200, records)
            if prefill and request.method == "GET" and path.startswith(KV_PATH):
                parts, length = await self.kv_parts(RequestId(path.removeprefix(KV_PATH)))
                self.plane_bodies += 1
                return PlaneAnswer(200, parts, length)
            unknown = client_error(f"the KV plane serves no {request.method} {path}")
            return PlaneAnswer.document(404, json.dumps(error_json(unknown)).encode())
        except StatecoreError as exc:
            return PlaneAnswer.document(exc.info.http_status, json.dumps(error_json(exc.info)).encode())

    async def start_stream(self, body: PrefillBody, *, cached_tokens: bool) -> Response:
        """A streamed handoff the router starts (`POST /internal/prefill` with `kv_attach`): the
        prompt is prefilled at once, its pieces wait for the decode node to attach
        (`open_prefill_stream`), and the answer is the first token as soon as it is sampled (with
        the prompt tokens taken from the prefix cache when `cached_tokens`). Its pieces stay in GPU
        memory from the start where the decode node that will attach took them so last time
        (`_attached_on_device`)."""
        rid = RequestId(body.request_id)
        attach_by = body.kv_attach_by
        on_device = attach_by is not None and self._attached_on_device.get(attach_by, False)
        context = NodeRequest(tuple(body.prompt), body.sampling.params(), hands_off=True,
                              prefix_from=prefix_source(body.prefix_from), attach_by=attach_by,
                              device_pieces=on_device)
        streams = self.performer.kv_streams
        _, generation = await self._open_admitted(rid, context, streams.open_for_attach)
        streams.ready_for_attach(rid, generation.cancel)
        first = await streams.first_reply(rid)
        if isinstance(first, ErrorInfo):
            return error_response(first)
        reply = PrefillReplyBody.of(first if cached_tokens else replace(first, cached_tokens=None))
        return JSONResponse(reply.document())

    async def open_prefill_stream(self, raw: bytes) -> StreamBody:
        """A streamed handoff, asked by the decode node the router chose: prefill the prompt and
        stream its KV as it is computed (`adapters.kv.stream`), the first token among it (or, with
        `kv_attach`, the stream of the prefill the router started: `_attach`). The request then
        waits in `handoff`, holding the cache, for the decode node's DELETE once it installed the
        pieces (or its cancel, or the lease), as a pulled cache does."""
        body = validated(PrefillBody, raw)
        rid = RequestId(body.request_id)
        if body.kv_attach:
            return await self._attach(rid, body)
        context = NodeRequest(tuple(body.prompt), body.sampling.params(), hands_off=True,
                              prefix_from=prefix_source(body.prefix_from),
                              device_pieces=body.kv_shm and body.kv_device)
        items, generation = await self._open_admitted(rid, context, self.performer.kv_streams.open)
        shm = self._pieces_through(rid, body, context)
        return self.stream_records.records(rid, generation.cancel, items, len(body.prompt), shm)

    async def _open_admitted(self, rid: RequestId, context: NodeRequest,
                             open_stream: Callable[[RequestId, int, int], Opened]
                             ) -> tuple[Opened, RunnerGeneration]:
        """The request's stream opened (`open_stream`: `KvStreams.open` or `open_for_attach`,
        before the request is admitted, so that nothing its prefill sends is lost), then the
        request admitted: what the opening gave, and the request's generation (its `cancel` ends
        it as its decode node leaving does). A request never admitted has its stream ended."""
        opened = open_stream(rid, len(context.prompt), len(self.engine.info.layers))
        try:
            generation = await self.status.admit_prefill(rid, context)
        except BaseException:
            self.performer.kv_streams.end(rid)  # never admitted: nothing else would close it
            raise
        return opened, generation

    def _pieces_through(self, rid: RequestId, body: PrefillBody, context: NodeRequest) -> ShmOutbox | None:
        """The shared memory a stream's pieces go through (None: inline, over HTTP), the way they
        go noted in the request's handoff record."""
        shm = self.shared.shm if body.kv_shm else None
        self.performer.handoffs.record(rid).transport = ("http" if shm is None else
                                                         "gpu" if context.device_pieces else "shm")
        return shm

    async def _attach(self, rid: RequestId, body: PrefillBody) -> StreamBody:
        """The decode node attaches to the stream of the prefill the router started
        (`start_stream`): what the prefill sent so far waits in it. Where the decode node takes
        pieces in GPU memory and they were not made so from the start, those from now on are
        (`Engine.send_pieces_on_device`; those already handed out went the host's way). Pieces made
        so for a decode node that cannot read them fail the request (KV_MALFORMED, retried where
        no token was sent): that decode node is remembered, and its next request goes the host's way.
        A request whose stream its decode node leaves, here or later, is cancelled by its
        generation (`start_stream`'s): nobody else can attach to it."""
        attached = await self.performer.kv_streams.attach(rid, ATTACH_WAIT_S)
        items = attached.items
        context = self.runner.context(rid)
        if not isinstance(context, NodeRequest):  # it ended a moment ago: say why, as its stream would
            raise StatecoreError(_why_it_ended(rid, items))
        try:
            if len(context.prompt) != len(body.prompt):
                raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_NOT_FOUND,
                                               f"request {rid} is not the prefill this decode node "
                                               "attaches to"))
            takes_device = body.kv_shm and body.kv_device and self.engine.info.device_pieces
            if context.attach_by is not None:
                self._attached_on_device[context.attach_by] = takes_device
            if context.device_pieces and not takes_device:
                unreadable = ErrorInfo(Fault.PEER, Code.KV_MALFORMED,
                                       f"request {rid}'s pieces are in GPU memory, which the decode node "
                                       "that attached cannot read; its next request's will not be")
                self.performer.kv_streams.send(rid, unreadable)  # the router's call hears it too
                raise StatecoreError(unreadable)
            if takes_device and not context.device_pieces:
                context.device_pieces = await self.engine.send_pieces_on_device(rid)
        except BaseException:
            items.close()
            with trio.CancelScope(shield=True):
                await attached.cancel()
            raise
        shm = self._pieces_through(rid, body, context)
        self.performer.handoffs.record(rid).attached = True
        return self.stream_records.records(rid, attached.cancel, items, len(body.prompt), shm)

    async def send_kv(self, request: Request) -> Response:
        return kv_body(*await self.kv_parts(RequestId(request.path_params["request_id"])))

    async def kv_parts(self, rid: RequestId) -> tuple[AsyncGenerator[Sequence[KvBytes], None], int]:
        """The held KV the decode node pulls, as body parts and their length (the HTTP port's
        answer and the KV plane's alike)."""
        payload = await self._kv_to_send(rid)
        if isinstance(payload, bytes):  # a damaged payload (tests only): no end frame to read
            return counted(payload_parts(KvPieces((payload,))), len(payload), self.kv_served), len(payload)
        parts = payload_parts(payload, lambda end: self._note_raw_bytes(rid, end))
        return counted(parts, payload.nbytes, self.kv_served), payload.nbytes

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
                faulty = await damaged(self.faults, rid, payload)
                return payload if faulty is None else faulty
        raise StatecoreError(ErrorInfo(Fault.PEER, Code.TIMEOUT, "the KV was not ready in time"))

    def _note_raw_bytes(self, rid: RequestId, tail: KvBytes) -> None:
        """Record the tensor bytes that the payload's end (`tail`: its last bytes) declares."""
        self.performer.handoffs.record(rid).raw_bytes = declared_tensor_bytes(tail)

    async def kv_taken(self, request: Request) -> Response:
        rid = RequestId(request.path_params["request_id"])
        await self.runner.post(rid, KvTaken())
        self.shared.release(rid)
        return JSONResponse({"released": rid})


__all__ = ["ATTACH_WAIT_S", "KV_PATH", "KvHandoff"]
