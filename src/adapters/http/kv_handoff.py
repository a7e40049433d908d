"""A prefill node's side of the KV handoff: the held KV a decode node pulls (`GET
/internal/kv/{id}`, and `DELETE` once it is taken), the streamed handoff (`POST
/internal/prefill_stream`: prefill, then each piece of the KV as it is computed, the first token
among them; or, where the router started the prefill itself with `POST /internal/prefill` and
`kv_attach`, the stream of that prefill, which the decode node attaches to), and the same two on
the KV plane's socket (`KvHandoff.plane`). On one host a streamed
piece goes through shared memory (`SharedPieces` holds its regions until the decode node is done
with them). A pull is the core's `KvRequested` event: the table answers it (`SendKv`, or `RefuseKv`
with KV_NOT_FOUND) and the performer delivers the answer to the pull waiting here. Every KV payload
a node sends over HTTP (these, and `prefix_blocks`' blocks) leaves as `kv_body` makes it: its
pieces as they lie, its end frame once the checksum is computed, in ASGI messages of a fixed size,
counted as KV served once the last part went. This module may import anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

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
from adapters.http.node_status import NodeStatus
from adapters.http.segment_copies import CopyFinished, SegmentCopies
from adapters.http.streaming import WatchedStream
from adapters.kv import stream as kv_stream
from adapters.kv.frames import declared_tensor_bytes
from adapters.kv.plane import PlaneAnswer, PlaneRequest
from adapters.kv.shm_outbox import ShmOutbox
from adapters.kv.shm_region import ShmRef
from effects.faults import FaultPort, Phase
from effects.interpret import EnginePerformer, NodeRequest
from effects.kv_pulls import StreamItem, ended_before_sent
from effects.ports import Engine, KvBytes, KvPieces, KvSegment, PrefillReply
from effects.runner import NodeRunner
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error
from statecore.events import Admitted, ClientCancelled, KvRequested, KvTaken
from statecore.ids import RequestId

log = logging.getLogger("statecore.node_api")

KV_SEND_TIMEOUT_S = 60.0
KV_PATH = "/internal/kv/"
# How long a decode node's attach waits for the router's call that starts the prefill: the router
# sends both at once, and the decode node's may come first.
ATTACH_WAIT_S = 10.0

KV_SEND_SLICE = 4 << 20
"""Bytes per ASGI body message of a KV payload (see `body_messages`)."""


def kv_body(parts: AsyncIterator[Sequence[KvBytes]], length: int) -> Response:
    """A KV payload's parts (`payload_parts`) sent through the ASGI server with their
    Content-Length (`body_messages`)."""
    return WatchedStream(body_messages(parts), media_type="application/octet-stream",
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


async def body_messages(parts: AsyncIterator[Sequence[KvBytes]]) -> AsyncGenerator[bytes, None]:
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


async def counted(parts: AsyncGenerator[Sequence[KvBytes], None], nbytes: int,
                  kv_served: Callable[[int], None]) -> AsyncGenerator[Sequence[KvBytes], None]:
    """`parts` as they are, the whole payload counted as KV served (`kv_served`) once its last
    part was sent, whichever port carried it (as a streamed piece is)."""
    async with contextlib.aclosing(parts):
        async for buffers in parts:
            yield buffers
    kv_served(nbytes)



class SharedPieces:
    """Requests with pieces in shared memory. A region is released when the decode node says it
    is done with the request (its DELETE once installed, or its cancel): a region freed earlier
    could be reused while it still maps the piece. A request that ended here without that word
    keeps its regions for KV_SEND_TIMEOUT_S at most."""

    def __init__(self, shm: ShmOutbox | None, performer: EnginePerformer) -> None:
        self.shm = shm
        self._requests: set[RequestId] = set()
        # The pieces an engine core process put in shared memory and this node handed on as they
        # lie: kept (so the core keeps their regions) until the request's regions are released.
        self._handed_on: dict[RequestId, list[KvPieces]] = {}
        if shm is not None:
            performer.on_forget.append(self.release_later)

    def __contains__(self, rid: RequestId) -> bool:
        return rid in self._requests

    def hold(self, rid: RequestId, payload: KvPieces) -> None:
        """A piece of `rid` goes through shared memory (`payload.shared`: one the core put there)."""
        self._requests.add(rid)
        if payload.shared is not None:
            self._handed_on.setdefault(rid, []).append(payload)

    def release(self, rid: RequestId) -> None:
        """The decode node is done with the request: its shared memory may be reused."""
        if self.shm is not None and rid in self._requests:
            self._requests.discard(rid)
            self.shm.release(rid)
            self._handed_on.pop(rid, None)  # the core frees their regions once the last view goes

    def settled(self, rid: RequestId) -> None:
        """Every copy of `rid`'s pieces is done: where the decode node released the request while
        one was under way, the region that copy put afterwards goes now (nothing else would free
        it: the request is no longer held here)."""
        if self.shm is not None and rid not in self._requests:
            self.shm.release(rid)

    def release_later(self, rid: RequestId) -> None:
        """A request ended here: its shared memory goes once the decode node says so, or after
        KV_SEND_TIMEOUT_S (a decode node that never will: it died)."""
        if rid not in self._requests:
            return

        async def release_when_overdue() -> None:
            await trio.sleep(KV_SEND_TIMEOUT_S)
            self.release(rid)

        trio.lowlevel.spawn_system_task(release_when_overdue)


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
        self.plane_bodies = 0  # KV bodies the plane answered (streams and pulls)
        # by decode node (as routers name it): whether its last attach took pieces in GPU memory,
        # so that a stream the router starts for it makes them so from its first piece
        self._attached_on_device: dict[str, bool] = {}

    async def prefill_stream(self, request: Request) -> Response:
        """A streamed handoff through the ASGI server (`open_prefill_stream`); the KV plane
        (`plane`) serves the same stream on the socket directly."""
        records = await self.open_prefill_stream(await read_body(request))
        return WatchedStream(body_messages(records), media_type="application/octet-stream")

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
        streams.open_for_attach(rid, len(body.prompt), len(self.engine.info.layers))
        try:
            await self.status.admit(rid, context, 4)
            await self.runner.post(rid, Admitted(len(body.prompt)))
        except BaseException:
            streams.end(rid)  # never admitted: nothing else would close it
            raise
        first = await streams.first_reply(rid)
        if isinstance(first, ErrorInfo):
            return error_response(first)
        reply = PrefillReplyBody.of(first if cached_tokens else replace(first, cached_tokens=None))
        return JSONResponse(reply.document())

    async def open_prefill_stream(self, raw: bytes) -> AsyncGenerator[Sequence[KvBytes], None]:
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
        # the stream waits by request id for what the prefill sends it (`KvStreams`), from
        # before the request is admitted until its last item
        items = self.performer.kv_streams.open(rid, len(body.prompt), len(self.engine.info.layers))
        try:
            generation = await self.status.admit(rid, context, 4)
            await self.runner.post(rid, Admitted(len(body.prompt)))
        except BaseException:
            self.performer.kv_streams.end(rid)  # never admitted: nothing else would close it
            raise
        shm = self.shared.shm if body.kv_shm else None
        self.performer.handoffs.record(rid).transport = ("http" if shm is None else
                                                         "gpu" if context.device_pieces else "shm")
        return self._stream_records(rid, generation.cancel, items, len(body.prompt), shm)

    async def _attach(self, rid: RequestId, body: PrefillBody) -> AsyncGenerator[Sequence[KvBytes], None]:
        """The decode node attaches to the stream of the prefill the router started
        (`start_stream`): what the prefill sent so far waits in it. Where the decode node takes
        pieces in GPU memory and they were not made so from the start, those from now on are
        (`Engine.send_pieces_on_device`; those already handed out went the host's way). Pieces made
        so for a decode node that cannot read them fail the request (KV_MALFORMED, retried where
        no token was sent): that decode node is remembered, and its next request goes the host's way."""
        items = await self.performer.kv_streams.attach(rid, ATTACH_WAIT_S)
        context = self.runner.context(rid)
        if not isinstance(context, NodeRequest):  # it ended a moment ago: say why, as its stream would
            raise StatecoreError(_why_it_ended(rid, items))
        if len(context.prompt) != len(body.prompt):
            items.close()
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_NOT_FOUND,
                                           f"request {rid} is not the prefill this decode node attaches to"))
        takes_device = body.kv_shm and body.kv_device and self.engine.info.device_pieces
        if context.attach_by is not None:
            self._attached_on_device[context.attach_by] = takes_device
        if context.device_pieces and not takes_device:
            items.close()
            unreadable = ErrorInfo(Fault.PEER, Code.KV_MALFORMED,
                                   f"request {rid}'s pieces are in GPU memory, which the decode node that "
                                   "attached cannot read; its next request's will not be")
            self.performer.kv_streams.send(rid, unreadable)  # the router's call hears it too
            await self.runner.post(rid, ClientCancelled())
            raise StatecoreError(unreadable)
        if takes_device and not context.device_pieces:
            context.device_pieces = await self.engine.send_pieces_on_device(rid)
        shm = self.shared.shm if body.kv_shm else None
        record = self.performer.handoffs.record(rid)
        record.transport = "http" if shm is None else "gpu" if context.device_pieces else "shm"
        record.attached = True

        async def cancel() -> None:
            await self.runner.post(rid, ClientCancelled())

        return self._stream_records(rid, cancel, items, len(body.prompt), shm)

    async def _stream_records(self, rid: RequestId, cancel: Callable[[], Awaitable[None]],
                              items: trio.MemoryReceiveChannel[StreamItem], prompt_tokens: int,
                              shared: ShmOutbox | None) -> AsyncGenerator[Sequence[KvBytes], None]:
        """The stream's records: each piece as it is computed (through shared memory: copied in
        the background, `SegmentCopies`, its record written once the copy is done, in order),
        the first token as soon as it is sampled, then the end once every piece went. A stream
        its decode node leaves early cancels the request (`cancel`)."""
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
                                self.shared.hold(rid, event.payload)
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
                self.shared.settled(rid)
            if not ended:  # the decode node went away mid-stream: free the prefill now
                with trio.CancelScope(shield=True):
                    await cancel()
            if self.runner.context(rid) is None:
                self.shared.release_later(rid)  # it ended before its last piece was put

    @staticmethod
    def _piece_range(segment: KvSegment) -> kv_stream.SegmentRange:
        return kv_stream.SegmentRange(segment.start, segment.stop, segment.first_layer, segment.end_layer)

    def _piece_head(self, segment: KvSegment) -> bytes:
        return kv_stream.segment_head(self._piece_range(segment), segment.payload.nbytes,
                                      last_step_started=segment.last_step_started)

    async def _piece_record(self, rid: RequestId, segment: KvSegment,
                            ref: ShmRef | None) -> AsyncGenerator[Sequence[KvBytes], None]:
        """A piece's record: by reference to its copy in shared memory, or inline."""
        if ref is not None:
            yield [kv_stream.shared_segment_record(self._piece_range(segment), ref.model_dump(),
                                                 last_step_started=segment.last_step_started)]
        else:
            if self.shared.shm is not None and rid in self.shared:
                log.warning("request %s: no room in shared memory; a piece goes over HTTP", rid)
            async for parts in payload_parts(segment.payload, head=self._piece_head(segment)):
                yield parts
        self.kv_served(segment.payload.nbytes)

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
        self.shared.release(rid)
        return JSONResponse({"released": rid})


__all__ = ["ATTACH_WAIT_S", "KV_PATH", "KV_SEND_SLICE", "KV_SEND_TIMEOUT_S", "KvHandoff", "SharedPieces",
           "body_messages", "counted", "kv_body", "payload_parts"]
