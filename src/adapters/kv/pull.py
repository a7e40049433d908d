"""One KV pull: an HTTP/1.1 GET (or a POST naming what it wants) on a trio socket whose body lands in
one buffer sized for it.

A decode node's `GET /internal/kv/{id}` moves megabytes to gigabytes. Through httpx every 64 KiB
read becomes its own bytes object, is copied into and out of h11's receive buffer, climbs three
iterator layers and a scheduler round trip, and the pieces are joined at the end; measured on
loopback that ran at 15-20% of what the socket itself moves (bench/results/handoff_http.md).
Here h11 (sans-IO) writes the request and parses the response head only; the body, whose length
the head declares, is `recv_into` a preallocated buffer, so each byte is copied once out of the
kernel, into a buffer kept from an earlier pull (`ReceiveBuffers`) so its pages are already
mapped (or, on a node whose engine core is a process, into the shared memory the core reads:
`Landing`). One connection per pull (`Connection: close`): a pull is one large transfer, and a
fresh loopback or LAN connection costs far less than the bytes it carries. An `https://` pull
runs the same GET over trio's `SSLStream`, the peer's certificate verified against the caller's
context (`adapters.tls.client_context`); its body comes out of the TLS layer a record at a time
and is copied into the same kind of buffer.

`HttpxPeers.fetch_kv` (a GET) and `HttpxPeers.fetch_prefix` (a POST of the prefix's token ids)
use this for `http://` and `https://` nodes when no test transport is injected, and map its
errors (OSError, trio's broken-stream and timeout errors, h11's protocol errors, `KvPullError`)
to typed errors in one place. This is an adapter: it may import anything, and
nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import contextlib
import ssl
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import SplitResult, urlsplit

import h11
import trio

from adapters.tls import client_context

READ_BYTES = 1 << 16  # the head and any body of unknown length are read in pieces this big
MAX_ERROR_BODY = 1 << 20  # an error answer is a small JSON document; more is the peer's fault


# While a buffer sits in the pool and nothing else refers to it, `sys.getrefcount(pool[i])`
# sees two references: the pool's list and the call's own argument.
_ONLY_THE_POOL = 2
_ROUND_BYTES = 1 << 20  # capacities round up to this, so nearby prompt lengths share buffers


class Landing(Protocol):
    """Where a received KV body lands: `take(length)` is a writable view of exactly `length` bytes
    that the receive fills (`ReceiveBuffers`: process memory; `adapters.kv.shm_landing.ShmLanding`: the
    shared memory a node's engine core process reads, so handing the bytes on copies nothing)."""

    def take(self, length: int) -> memoryview: ...

    def give_back(self, view: memoryview) -> None:
        """The receive into `view` (from `take`) failed: its memory may be reused now, though a
        traceback may still refer to the view."""


class ReceiveBuffers:
    """Reusable buffers for the bodies of KV pulls.

    A fresh buffer of tens of megabytes takes a page fault (and the kernel zeroing the page)
    for every 4 KiB the first time it is written; measured on loopback, landing a pull in fresh
    memory ran at about a third of the speed of landing it in memory written before. So a
    buffer, once used, is kept and handed out again. A caller gets a memoryview of a buffer's
    first `length` bytes and never gives it back: a buffer is reused only once nothing refers to
    it any more (no memoryview, no numpy array over it - CPython's reference count says so), so
    a view kept by mistake can never be overwritten under its holder. Buffers are kept up to
    `keep_bytes` in all; beyond that, idle ones are dropped, smallest first. Used from one
    thread (the node's trio thread); other threads only drop their references.
    """

    def __init__(self, keep_bytes: int) -> None:
        if keep_bytes < 0:
            raise ValueError(f"keep_bytes must be >= 0, not {keep_bytes}")
        self.keep_bytes = keep_bytes
        self._buffers: list[bytearray] = []

    def take(self, length: int) -> memoryview:
        index = self._best_idle(length)
        if index is None:
            capacity = -(-max(length, 1) // _ROUND_BYTES) * _ROUND_BYTES
            self._buffers.append(bytearray(capacity))
            index = len(self._buffers) - 1
        view = memoryview(self._buffers[index])[:length]
        self._trim()
        return view

    def give_back(self, view: memoryview) -> None:
        """Nothing to do: a buffer is reused once no view of it is left."""

    @property
    def kept_bytes(self) -> int:
        return sum(len(buffer) for buffer in self._buffers)

    def _idle(self, index: int) -> bool:
        return sys.getrefcount(self._buffers[index]) <= _ONLY_THE_POOL

    def _best_idle(self, length: int) -> int | None:
        """The smallest idle buffer that holds `length` bytes."""
        best: int | None = None
        for i in range(len(self._buffers)):
            size = len(self._buffers[i])
            if size >= length and self._idle(i) and (best is None or size < len(self._buffers[best])):
                best = i
        return best

    def _trim(self) -> None:
        """Drop idle buffers, smallest first, while more than `keep_bytes` are kept."""
        excess = self.kept_bytes - self.keep_bytes
        dropped: set[int] = set()
        for i in sorted(range(len(self._buffers)), key=lambda i: len(self._buffers[i])):
            if excess <= 0:
                break
            if self._idle(i):
                excess -= len(self._buffers[i])
                dropped.add(i)
        self._buffers = [buffer for i, buffer in enumerate(self._buffers) if i not in dropped]


class KvPullError(Exception):
    """The peer broke HTTP/1.1 or the connection mid-answer: the transport is lost."""


class KvStreamCut(Exception):
    """A stream's body ended cleanly before its own end: the peer sent an incomplete stream."""


class KvTooLarge(Exception):
    """The answer declares (or grows to) more bytes than the caller allows."""


@dataclass(frozen=True, slots=True)
class PulledKv:
    status: int
    body: bytes | memoryview  # a view into `ReceiveBuffers`: read it, then let it go
    head_s: float  # GET sent -> response head parsed
    last_byte_s: float  # GET sent -> last body byte received


def _content_length(response: h11.Response) -> int | None:
    for name, value in response.headers:
        if name == b"content-length":
            return int(value)
    return None


async def _receive_head(stream: trio.abc.ReceiveStream, conn: h11.Connection) -> h11.Response:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(bytes(await stream.receive_some(READ_BYTES)))
        elif isinstance(event, h11.Response):
            return event
        elif not isinstance(event, h11.InformationalResponse):
            raise KvPullError(f"expected a response head, got {type(event).__name__}")


async def _receive_framed(stream: trio.abc.ReceiveStream, conn: h11.Connection, limit: int) -> bytes:
    """A body of no declared length (or an error answer), through h11, at most `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(bytes(await stream.receive_some(READ_BYTES)))
        elif isinstance(event, h11.Data):
            size += len(event.data)
            if size > limit:
                raise KvTooLarge(f"the answer exceeds {limit} bytes")
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return b"".join(chunks)
        else:
            raise KvPullError(f"unexpected {type(event).__name__} in a response body")


async def _receive_sized(stream: trio.abc.ReceiveStream, conn: h11.Connection,
                         view: memoryview) -> memoryview:
    """Exactly `len(view)` body bytes into `view`: what h11 already holds, then straight from
    the socket (over TLS: from the TLS layer, one record at a time)."""
    length = len(view)
    early, closed = conn.trailing_data  # body bytes that arrived together with the head
    if len(early) > length:
        raise KvPullError(f"{len(early) - length} bytes beyond the declared Content-Length")
    view[: len(early)] = early
    got = len(early)
    while got < length:
        if closed:
            raise KvPullError(f"the peer closed the connection after {got} of {length} body bytes")
        if isinstance(stream, trio.SocketStream):
            n = await stream.socket.recv_into(view[got:], length - got)
        else:
            chunk = await stream.receive_some(min(length - got, READ_BYTES))
            n = len(chunk)
            view[got : got + n] = chunk
        if n == 0:
            raise KvPullError(f"the peer closed the connection after {got} of {length} body bytes")
        got += n
    return view


@contextlib.asynccontextmanager
async def _connected(url: str, connect_timeout_s: float, ssl_context: ssl.SSLContext | None
                     ) -> AsyncIterator[tuple[trio.abc.Stream, SplitResult, str]]:
    """A connection to `url`'s host (http, or https verified against `ssl_context`: the system
    store when None), its handshake done; with the URL's parts and the request target."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.hostname is None:
        raise ValueError(f"adapters.kv.pull handles http:// and https:// URLs only, not {url!r}")
    secure = parts.scheme == "https"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    with trio.fail_after(connect_timeout_s):
        tcp = await trio.open_tcp_stream(parts.hostname, parts.port or (443 if secure else 80))
    stream: trio.abc.Stream = tcp
    if secure:
        context = ssl_context if ssl_context is not None else client_context(None)
        stream = trio.SSLStream(tcp, context, server_hostname=parts.hostname, https_compatible=True)
    async with stream:
        if isinstance(stream, trio.SSLStream):
            with trio.fail_after(connect_timeout_s):
                await stream.do_handshake()  # an unverified certificate ends the call here
        yield stream, parts, target


async def pull(url: str, headers: Sequence[tuple[str, str]], *, max_bytes: int,
               connect_timeout_s: float, buffers: Landing,
               ssl_context: ssl.SSLContext | None = None, json_body: bytes | None = None) -> PulledKv:
    """GET `url` (http, or https verified against `ssl_context`: the system store when None)
    and return its status and whole body. A 200 answer may be up to `max_bytes`, and lands in one
    of `buffers`; any other answer up to MAX_ERROR_BODY (it is read for its error document).
    `json_body`: POST it instead (a request for a prefix's blocks names their tokens). A body
    whose receive fails gives its buffer back (`Landing.give_back`)."""
    started = time.perf_counter()
    async with _connected(url, connect_timeout_s, ssl_context) as (stream, parts, target):
        conn = h11.Connection(h11.CLIENT)
        fields = [("Host", parts.netloc), ("Connection", "close"), *headers]
        if json_body is not None:
            fields += [("Content-Type", "application/json"), ("Content-Length", str(len(json_body)))]
        request = h11.Request(method="GET" if json_body is None else "POST", target=target, headers=fields)
        data = conn.send(request)
        body_data = b"" if json_body is None else conn.send(h11.Data(data=json_body))
        end = conn.send(h11.EndOfMessage())
        # h11 returns bytes for every client event
        assert data is not None and body_data is not None and end is not None
        await stream.send_all(data + body_data + end)
        response = await _receive_head(stream, conn)
        head = time.perf_counter()
        length = _content_length(response)
        body: bytes | memoryview
        if response.status_code != 200:
            body = await _receive_framed(stream, conn, MAX_ERROR_BODY)
        elif length is None:
            body = await _receive_framed(stream, conn, max_bytes)
        elif length > max_bytes:
            raise KvTooLarge(f"the answer declares {length} bytes, the limit is {max_bytes}")
        else:
            view = buffers.take(length)
            try:
                body = await _receive_sized(stream, conn, view)
            except BaseException:
                buffers.give_back(view)
                raise
        last_byte = time.perf_counter()
    return PulledKv(response.status_code, body, head - started, last_byte - started)


class StreamBody:
    """A streamed answer's body, read exactly as asked: `read_into(view)` fills `view` from the
    body, straight from the socket where it can (`recv_into`). The body may be chunked (an answer
    of no declared length over HTTP/1.1, as the prefill node's KV stream is), sized, or end with
    the connection; the chunk framing is parsed here, so the payload bytes are copied once, out
    of the kernel into the caller's buffer."""

    def __init__(self, stream: trio.abc.Stream, early: bytes, *, chunked: bool, length: int | None) -> None:
        self._stream = stream
        self._buffered = bytearray(early)  # bytes received but not handed out yet
        self._chunked = chunked
        self._left = length  # sized: body bytes left; chunked: left in the current chunk (None: none open)
        self._chunks = 0
        if chunked:
            self._left = None

    async def _receive_into(self, view: memoryview) -> int:
        """Some bytes into `view` (at least one): buffered ones first, else from the stream."""
        if self._buffered:
            n = min(len(view), len(self._buffered))
            view[:n] = self._buffered[:n]
            del self._buffered[:n]
            return n
        if isinstance(self._stream, trio.SocketStream):
            n = await self._stream.socket.recv_into(view, len(view))
        else:
            chunk = await self._stream.receive_some(min(len(view), READ_BYTES))
            n = len(chunk)
            view[:n] = chunk
        if n == 0:
            raise KvPullError("the peer closed the connection mid-stream")
        return n

    async def _line(self) -> bytes:
        """One CRLF-ended line of the chunk framing (a few bytes), read byte by byte past the buffer."""
        line = bytearray()
        one = memoryview(bytearray(1))
        while not line.endswith(b"\r\n"):
            if len(line) > 1024:
                raise KvPullError("a chunk header line runs past 1024 bytes")
            await self._receive_into(one)
            line += one
        return bytes(line[:-2])

    async def _open_chunk(self) -> None:
        if self._chunks and await self._line() != b"":  # the CRLF after the previous chunk's data
            raise KvPullError("a chunk's data is not followed by CRLF")
        size_field = (await self._line()).split(b";", 1)[0].strip()
        try:
            size = int(size_field, 16)
        except ValueError:
            raise KvPullError(f"bad chunk size {size_field[:32]!r}") from None
        if size == 0:
            raise KvStreamCut("the stream ended before its end record")
        self._chunks += 1
        self._left = size

    async def read_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            if self._chunked and not self._left:
                await self._open_chunk()
            want = len(view) - got
            if self._left is not None:
                if self._left == 0:
                    raise KvStreamCut("the body ended before the stream's end record")
                want = min(want, self._left)
            n = await self._receive_into(view[got : got + want])
            got += n
            if self._left is not None:
                self._left -= n


@contextlib.asynccontextmanager
async def open_stream(url: str, headers: Sequence[tuple[str, str]], json_body: bytes, *,
                      connect_timeout_s: float, ssl_context: ssl.SSLContext | None = None
                      ) -> AsyncIterator[tuple[int, StreamBody | bytes]]:
    """POST `json_body` to `url` and yield (status, body): a 200 answer's `StreamBody` to read as
    it arrives, any other answer's whole (small) error document."""
    async with _connected(url, connect_timeout_s, ssl_context) as (stream, parts, target):
        conn = h11.Connection(h11.CLIENT)
        fields = [("Host", parts.netloc), ("Connection", "close"), *headers,
                  ("Content-Type", "application/json"), ("Content-Length", str(len(json_body)))]
        data = conn.send(h11.Request(method="POST", target=target, headers=fields))
        body_data = conn.send(h11.Data(data=json_body))
        end = conn.send(h11.EndOfMessage())
        assert data is not None and body_data is not None and end is not None
        await stream.send_all(data + body_data + end)
        response = await _receive_head(stream, conn)
        if response.status_code != 200:
            yield response.status_code, await _receive_framed(stream, conn, MAX_ERROR_BODY)
            return
        chunked = any(name == b"transfer-encoding" and b"chunked" in value.lower()
                      for name, value in response.headers)
        early, _closed = conn.trailing_data
        yield 200, StreamBody(stream, bytes(early), chunked=chunked, length=_content_length(response))


__all__ = ["KvPullError", "KvStreamCut", "KvTooLarge", "Landing", "PulledKv", "ReceiveBuffers", "StreamBody",
           "open_stream", "pull"]
