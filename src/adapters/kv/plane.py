"""The KV data plane: a plain-socket listener beside an engine node's HTTP app that serves KV bodies.

A KV body is tens to thousands of megabytes; through the ASGI server each body message is joined
in Python, framed and queued by hypercorn, which reaches about half of a raw socket's rate on
one host. This listener speaks just enough HTTP/1.1 for the node's KV routes (one request per
connection, answered and closed): it reads the request with h11 and writes the answer's buffers
to the socket as they are (the payload's own memory, chunk framing around it, no join), so a
body moves at the socket's rate. What each route answers is the node's own business
(`adapters.http.node_api`): the listener is given a `PlaneHandler` that maps a request to a
`PlaneAnswer`. The node advertises the listener's port in `/internal/info` (`kv_port`); peers use
it for `POST /internal/prefill_stream` and `GET /internal/kv/{id}` and fall back to the node's
HTTP port when it cannot be reached. This module imports trio and h11; never MLX, httpx,
starlette or the core's tables.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import h11
import trio

from effects.engine_port import KvBytes

log = logging.getLogger(__name__)

__all__ = ["PlaneAnswer", "PlaneHandler", "PlaneRequest", "serve_plane"]

MAX_HEAD_BYTES = 64 << 10
RECEIVE_BYTES = 64 << 10
REQUEST_TIMEOUT_S = 30.0  # a request (head and body) must arrive within this; the answer has no limit
THREAD_SEND_BYTES = 1 << 20  # a buffer this large is written by a worker thread (`_BlockingSender`)
SEND_STALL_S = 120.0  # a peer that takes no byte of a large buffer for this long is gone


@dataclass(frozen=True, slots=True)
class PlaneRequest:
    method: str
    target: str  # the path, with its query if any
    headers: Mapping[str, str]  # lower-case names
    body: bytes


@dataclass(slots=True)
class PlaneAnswer:
    """What the node answers. `parts`: the body, in order, as buffers written as they are;
    sized (`length` set: exactly that many bytes) or chunked (`length` None). `parts` is closed
    (`aclose`) once the answer is written or the connection failed, so its own cleanup runs."""

    status: int
    parts: AsyncIterator[Sequence[KvBytes]]
    length: int | None = None
    content_type: str = "application/octet-stream"

    @classmethod
    def document(cls, status: int, body: bytes) -> PlaneAnswer:
        """A small JSON answer (an error document)."""
        return cls(status, _once([body]), len(body), "application/json")


PlaneHandler = Callable[[PlaneRequest], Awaitable[PlaneAnswer]]


async def _once(parts: Sequence[KvBytes]) -> AsyncIterator[Sequence[KvBytes]]:
    yield parts


async def serve_plane(listener: trio.SocketListener, handler: PlaneHandler, max_body_bytes: int, *,
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve `listener` until cancelled, each connection in its own task; a request body over
    `max_body_bytes` (the node's bound for its internal routes) closes its connection."""
    async with trio.open_nursery() as nursery:
        task_status.started()
        async def connection(stream: trio.SocketStream) -> None:
            await _connection(stream, handler, max_body_bytes)

        await trio.serve_listeners(connection, [listener], handler_nursery=nursery)


async def _connection(stream: trio.abc.Stream, handler: PlaneHandler, max_body_bytes: int) -> None:
    # No SO_SNDBUF of its own: a fixed send buffer turns off the kernel's autotuning, which
    # measured faster (bench/handoff/transport_eval.py, "http plane")
    async with stream:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        try:
            with trio.fail_after(REQUEST_TIMEOUT_S):
                request = await _receive_request(stream, conn, max_body_bytes)
        except (h11.RemoteProtocolError, trio.TooSlowError, trio.BrokenResourceError, OSError) as exc:
            log.debug("KV plane: a request could not be read (%s)", exc)
            return
        if request is None:
            return
        try:
            answer = await handler(request)
        except Exception:  # one request's bug closes its connection, never the listener
            log.exception("KV plane: %s %s could not be answered", request.method, request.target)
            return
        try:
            await _send_answer(stream, conn, answer)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.debug("KV plane: the peer went away mid-answer (%s)", exc)
        except Exception:  # the client sees the body cut: the answer's framing never ends
            log.exception("KV plane: the answer to %s %s failed midway", request.method, request.target)


async def _receive_request(stream: trio.abc.Stream, conn: h11.Connection,
                           max_body_bytes: int) -> PlaneRequest | None:
    head: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(RECEIVE_BYTES)
            conn.receive_data(bytes(data))
            if not data and head is None:
                return None  # connected and closed: a probe
            continue
        if isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > max_body_bytes:
                raise h11.RemoteProtocolError("request body too large")
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            headers = {name.decode("latin-1").lower(): value.decode("latin-1")
                       for name, value in head.headers}
            return PlaneRequest(head.method.decode("ascii"), head.target.decode("latin-1"), headers,
                                bytes(body))
        elif isinstance(event, h11.ConnectionClosed):
            return None


async def _send_answer(stream: trio.abc.Stream, conn: h11.Connection, answer: PlaneAnswer) -> None:
    fields = [("Content-Type", answer.content_type), ("Connection", "close")]
    if answer.length is not None:
        fields.append(("Content-Length", str(answer.length)))
    else:
        fields.append(("Transfer-Encoding", "chunked"))
    head = conn.send(h11.Response(status_code=answer.status, headers=fields))
    assert head is not None
    async with contextlib.aclosing(answer.parts) as parts:  # type: ignore[type-var]
        await stream.send_all(head)
        with _BlockingSender(stream) as sender:
            async for buffers in parts:
                for buffer in buffers:
                    if len(buffer) == 0:
                        continue
                    # the framing around the caller's own memory: nothing copied here
                    framed = conn.send_with_data_passthrough(h11.Data(data=_bytes_like(buffer)))
                    for piece in framed or ():
                        await sender.send_all(piece)
    end = conn.send(h11.EndOfMessage())
    if end:
        await stream.send_all(end)


class _BlockingSender:
    """Large buffers written by a worker thread's `sendall` on a duplicate of the connection's
    socket (with a timeout: the loop runs in C, the GIL released), small ones through trio. Trio's
    own `send_all` goes round its event loop for each socket-buffer's worth, which measured a
    quarter slower than the thread on hundreds of megabytes. Nothing else uses the connection
    while an answer is written."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._socket: socket.socket | None = None
        if isinstance(stream, trio.SocketStream):
            duplicate = socket.socket(fileno=os.dup(stream.socket.fileno()))
            duplicate.settimeout(SEND_STALL_S)
            self._socket = duplicate

    def __enter__(self) -> _BlockingSender:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._socket is not None:
            self._socket.close()

    async def send_all(self, data: Any) -> None:
        if self._socket is None or len(data) < THREAD_SEND_BYTES:
            await self._stream.send_all(data)
            return
        try:
            await trio.to_thread.run_sync(self._socket.sendall, data, abandon_on_cancel=True)
        except TimeoutError as exc:
            raise trio.BrokenResourceError(f"the peer read nothing for {SEND_STALL_S:.0f} s") from exc


def _bytes_like(buffer: KvBytes) -> Any:
    return buffer if isinstance(buffer, bytes) else memoryview(buffer).cast("B")
