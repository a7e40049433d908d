"""How a prefill node's KV leaves it, whichever route asked for it (`kv_handoff`'s, `prefix_blocks`')
and whichever port carries it (the ASGI server, the KV plane's socket). Every KV payload a node
sends over HTTP leaves as `kv_body` makes it: its pieces as they lie, its end frame once the
checksum is computed, in ASGI messages of a fixed size, counted as KV served once the last part
went. A streamed handoff leaves as records (`StreamRecords`, in `adapters.kv.stream`'s format):
each piece as it is computed, inline or through shared memory (`SharedPieces` holds its regions
until the decode node is done with them), the first token as soon as it is sampled, then the end;
a decode node that leaves early cancels the request, also one that leaves before the first record
was asked for (`StreamBody`). Transfer faults (tests only) are injected here (`damaged`). This
module may import anything.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

import trio
from starlette.responses import Response

from adapters.http.internal_wire import PrefillReplyBody, error_json
from adapters.http.segment_copies import CopyFinished, SegmentCopies
from adapters.http.streaming import WatchedStream
from adapters.kv import stream as kv_stream
from adapters.kv.shm_outbox import ShmOutbox
from adapters.kv.shm_region import ShmRef
from effects.faults import FaultPort, Phase
from effects.interpret import EnginePerformer
from effects.kv_pulls import Cancel, StreamItem
from effects.ports import KvBytes, KvPieces, KvSegment, PrefillReply
from effects.runner import NodeRunner
from statecore.errors import ErrorInfo
from statecore.ids import RequestId

log = logging.getLogger("statecore.node_api")

KV_SEND_TIMEOUT_S = 60.0

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


async def damaged(faults: FaultPort, rid: RequestId, pieces: KvPieces) -> bytes | None:
    """A payload as an injected transfer fault leaves it (tests only): cut after the header's
    first bytes, cut mid-body, or one byte flipped. None when no fault applies."""
    if not faults.armed:
        return None
    phases = (Phase.SEND_HEADER, Phase.MID_BODY, Phase.CHECKSUM)
    fault = next((phase for phase in phases if faults.applies(phase, rid)), None)
    if fault is None:
        return None
    payload = await trio.to_thread.run_sync(pieces.joined)  # waits for the end frame
    if fault is Phase.SEND_HEADER:
        return payload[:16]
    middle = len(payload) // 2
    if fault is Phase.MID_BODY:
        return payload[:middle]
    return payload[:middle] + bytes([payload[middle] ^ 0xFF]) + payload[middle + 1 :]


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


class StreamBody:
    """A stream's records as a port sends them: closing it ends the stream however early. Closed
    before its first record was asked for (the answer's start could not be sent), it cancels its
    request itself: its records' generator never ran, and an unstarted generator's close runs
    none of its cleanup (the cancel of a request its decode node left)."""

    def __init__(self, records: AsyncGenerator[Sequence[KvBytes], None], cancel: Cancel) -> None:
        self._records = records
        self._cancel = cancel
        self._started = False

    def __aiter__(self) -> StreamBody:
        return self

    async def __anext__(self) -> Sequence[KvBytes]:
        self._started = True
        return await anext(self._records)

    async def aclose(self) -> None:
        if not self._started:
            self._started = True
            with trio.CancelScope(shield=True):
                await self._cancel()
        await self._records.aclose()


class StreamRecords:
    """A prefill node's streamed handoffs as the records it sends (`records`)."""

    def __init__(self, shared: SharedPieces, runner: NodeRunner[Any], faults: FaultPort,
                 kv_served: Callable[[int], None]) -> None:
        self.shared = shared
        self.runner = runner
        self.faults = faults
        self.kv_served = kv_served  # the metrics' count of KV served: each piece's bytes, once sent

    def records(self, rid: RequestId, cancel: Cancel, items: trio.MemoryReceiveChannel[StreamItem],
                prompt_tokens: int, shared: ShmOutbox | None) -> StreamBody:
        """The stream's records (`_records`), its request cancelled however early its decode node
        leaves it."""
        return StreamBody(self._records(rid, cancel, items, prompt_tokens, shared), cancel)

    async def _records(self, rid: RequestId, cancel: Cancel, items: trio.MemoryReceiveChannel[StreamItem],
                       prompt_tokens: int, shared: ShmOutbox | None
                       ) -> AsyncGenerator[Sequence[KvBytes], None]:
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
                        async for parts in self._piece(rid, *copied):
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
                            faulty = None if received else await damaged(self.faults, rid, event.payload)
                            received += 1
                            if faulty is not None:  # tests only: a cut or flipped first piece
                                yield [_piece_head(event), faulty]
                                if len(faulty) < event.payload.nbytes:
                                    return  # cut: the stream ends here, without its end record
                                sent += 1
                            elif copies is not None:
                                self.shared.hold(rid, event.payload)
                                copies.start(event)
                            else:
                                async for parts in self._piece(rid, event, None):
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

    async def _piece(self, rid: RequestId, segment: KvSegment,
                     ref: ShmRef | None) -> AsyncGenerator[Sequence[KvBytes], None]:
        """A piece's record: by reference to its copy in shared memory, or inline."""
        if ref is not None:
            yield [kv_stream.shared_segment_record(_piece_range(segment), ref.model_dump(),
                                                 last_step_started=segment.last_step_started)]
        else:
            if self.shared.shm is not None and rid in self.shared:
                log.warning("request %s: no room in shared memory; a piece goes over HTTP", rid)
            async for parts in payload_parts(segment.payload, head=_piece_head(segment)):
                yield parts
        self.kv_served(segment.payload.nbytes)


def _piece_range(segment: KvSegment) -> kv_stream.SegmentRange:
    return kv_stream.SegmentRange(segment.start, segment.stop, segment.first_layer, segment.end_layer)


def _piece_head(segment: KvSegment) -> bytes:
    return kv_stream.segment_head(_piece_range(segment), segment.payload.nbytes,
                                  last_step_started=segment.last_step_started)


__all__ = ["KV_SEND_SLICE", "KV_SEND_TIMEOUT_S", "SharedPieces", "StreamBody", "StreamRecords",
           "body_messages", "counted", "damaged", "kv_body", "payload_parts"]
