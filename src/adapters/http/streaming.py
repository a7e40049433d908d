"""A streamed HTTP response that ends its exchange cleanly, and the disconnect watch under it.

Starlette's `StreamingResponse` (under an ASGI 2.1 server such as hypercorn) and our first SSE
response both ran the body beside a task waiting for `http.disconnect` and cancelled the body
when it came. But the server sends that message while the app's *last* message is still being
handled, and cancelling there stopped hypercorn half way through ending the exchange: a client
that asked for `Connection: close` waited for a close that never came. `WatchedStream` sends
the last message outside the watch. It is also lean on purpose (it runs once per generated
token per stream): no per-chunk timeout scope or extra task. An adapter: it may import trio and
starlette, and must never import mlx, mlx_lm or httpx (the router serves through it too).
"""

from __future__ import annotations

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
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                async for chunk in self._chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not watch.disconnected:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            with trio.CancelScope(shield=True):
                await self._chunks.aclose()
                await self._on_close()


__all__ = ["Watch", "WatchedStream", "cancel_on_disconnect"]
