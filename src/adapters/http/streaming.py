"""A streamed HTTP response that ends its exchange cleanly, and the disconnect watch under it.

Starlette's `StreamingResponse` (under an ASGI 2.1 server such as hypercorn) and our first SSE
response both ran the body beside a task waiting for `http.disconnect` and cancelled the body
when it came. But the server sends that message while the app's *last* message is still being
handled, and cancelling there stopped hypercorn half way through ending the exchange: a client
that asked for `Connection: close` waited for a close that never came. `WatchedStream` sends
the last message outside the watch. It is also lean on purpose (it runs once per generated
token per stream): no per-chunk timeout scope or extra task.

Server-sent events as every API of the front end frames them are here too: one JSON encoding for
every body and event, `data:` events (OpenAI's chat and completions) and named ones (Anthropic's
Messages, OpenAI's Responses), a per-choice template for the chat's text chunks, and the
text/event-stream response (`event_stream`). An adapter: it may import trio and starlette, and
must never import mlx, mlx_lm or httpx (the router serves through it too).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


@dataclass(slots=True)
class Watch:
    disconnected: bool = False


@asynccontextmanager
async def cancel_on_disconnect(receive: Receive) -> AsyncIterator[Watch]:
    """Run the body until it ends or the client disconnects (then the body is cancelled)."""
    watch = Watch()
    async with trio.open_nursery() as nursery:

        async def wait_disconnect() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    watch.disconnected = True
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(wait_disconnect)
        try:
            yield watch
        finally:
            nursery.cancel_scope.cancel()


async def _nothing() -> None:
    return None


class WatchedStream(StreamingResponse):
    """Chunks sent the moment they are made. The client leaving cancels the stream; the chunk
    generator is always closed and `on_close` always runs (shielded), also when the client left
    before the generator ever started."""

    def __init__(
        self,
        chunks: AsyncGenerator[bytes, None],
        *,
        media_type: str,
        headers: Mapping[str, str] | None = None,
        on_close: Callable[[], Awaitable[None]] = _nothing,
    ) -> None:
        super().__init__(chunks, headers=dict(headers or {}), media_type=media_type)
        self._chunks = chunks
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with cancel_on_disconnect(receive) as watch:
                # The first chunk is made before the head goes, so the two leave together: sent
                # first, the head let the event loop run other tasks before the first chunk
                # was even made (the first token's text waited ~1-2 ms behind it).
                first = await anext(self._chunks, None)
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                if first is not None:
                    await send({"type": "http.response.body", "body": first, "more_body": True})
                    async for chunk in self._chunks:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not watch.disconnected:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            with trio.CancelScope(shield=True):
                await self._chunks.aclose()
                await self._on_close()



def dumps(obj: object) -> str:
    """The one JSON encoding of every body and event (Starlette's JSONResponse's settings)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def data_event(obj: object) -> bytes:
    """One server-sent event: `data: <json or [DONE]>` and a blank line (JSON has no raw newline)."""
    return b"data: " + (obj if isinstance(obj, str) else dumps(obj)).encode() + b"\n\n"


def named_event(event: str, data: object) -> bytes:
    """One server-sent event with its name (Messages' and Responses' events); JSON has no raw newline."""
    return f"event: {event}\ndata: {dumps(data)}\n\n".encode()


# What `dumps` writes for a string (json.dumps' own encoder with ensure_ascii=False): quotes,
# backslashes and control characters escaped, everything else as it is.
_json_string: Callable[[str], str] = json.encoder.encode_basestring
TEXT_MARK = "\ue000text\ue001"  # stands in for the text when a template is made


@dataclass(frozen=True, slots=True)
class TextEvent:
    """A template of one choice's text chunk event: its bytes before and after the text. A
    stream's text chunks differ only in the text, so their JSON is made once per choice; `of`
    gives exactly the bytes `data_event` would for the chunk with that text."""

    head: bytes
    tail: bytes

    @classmethod
    def around(cls, event: bytes) -> TextEvent | None:
        """The template of `event`, a chunk whose text is `TEXT_MARK`; None unless the mark is
        in it exactly once (a model name could hold it too)."""
        mark = _json_string(TEXT_MARK).encode()
        head, found, tail = event.partition(mark)
        if not found or mark in tail:
            return None
        return cls(head, tail)

    def of(self, text: str) -> bytes:
        return self.head + _json_string(text).encode() + self.tail


# A stream sends the events it has made in one body write (one ASGI message) before it waits
# for the backend, or once this many are waiting.
EVENTS_PER_WRITE = 64


def event_stream(events: AsyncGenerator[bytes, None], headers: Mapping[str, str],
                  on_close: Callable[[], Awaitable[None]]) -> WatchedStream:
    """A text/event-stream response whose events go out the moment they are made."""
    return WatchedStream(events, media_type="text/event-stream", on_close=on_close,
                         headers={**headers, "Cache-Control": "no-store", "X-Accel-Buffering": "no"})


__all__ = [
    "EVENTS_PER_WRITE",
    "TEXT_MARK",
    "TextEvent",
    "Watch",
    "WatchedStream",
    "cancel_on_disconnect",
    "data_event",
    "dumps",
    "event_stream",
    "named_event",
]
