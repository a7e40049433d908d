"""One KV pull: an HTTP/1.1 GET on a trio socket whose body lands in one buffer sized for it.

A decode node's `GET /internal/kv/{id}` moves megabytes to gigabytes. Through httpx every 64 KiB
read becomes its own bytes object, is copied into and out of h11's receive buffer, climbs three
iterator layers and a scheduler round trip, and the pieces are joined at the end; measured on
loopback that ran at 15-20% of what the socket itself moves (bench/results/handoff_http.md).
Here h11 (sans-IO) writes the request and parses the response head only; the body, whose length
the head declares, is `recv_into` a preallocated buffer, so each byte is copied once out of the
kernel. One connection per pull (`Connection: close`): a pull is one large transfer, and a
fresh loopback or LAN connection costs far less than the bytes it carries.

`HttpxPeers.fetch_kv` uses this for plain `http://` nodes when no test transport is injected,
and maps its errors (OSError, trio's broken-stream and timeout errors, h11's protocol errors,
`KvPullError`) to typed errors in one place. This is an adapter: it may import anything, and
nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11
import trio

READ_BYTES = 1 << 16  # the head and any body of unknown length are read in pieces this big
MAX_ERROR_BODY = 1 << 20  # an error answer is a small JSON document; more is the peer's fault


class KvPullError(Exception):
    """The peer broke HTTP/1.1 or the connection mid-answer: the transport is lost."""


class KvTooLarge(Exception):
    """The answer declares (or grows to) more bytes than the caller allows."""


@dataclass(frozen=True, slots=True)
class PulledKv:
    status: int
    body: bytes
    head_s: float  # GET sent -> response head parsed
    last_byte_s: float  # GET sent -> last body byte received


def _content_length(response: h11.Response) -> int | None:
    for name, value in response.headers:
        if name == b"content-length":
            return int(value)
    return None


async def _receive_head(stream: trio.SocketStream, conn: h11.Connection) -> h11.Response:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(READ_BYTES))
        elif isinstance(event, h11.Response):
            return event
        elif not isinstance(event, h11.InformationalResponse):
            raise KvPullError(f"expected a response head, got {type(event).__name__}")


async def _receive_framed(stream: trio.SocketStream, conn: h11.Connection, limit: int) -> bytes:
    """A body of no declared length (or an error answer), through h11, at most `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(READ_BYTES))
        elif isinstance(event, h11.Data):
            size += len(event.data)
            if size > limit:
                raise KvTooLarge(f"the answer exceeds {limit} bytes")
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return b"".join(chunks)
        else:
            raise KvPullError(f"unexpected {type(event).__name__} in a response body")


async def _receive_sized(stream: trio.SocketStream, conn: h11.Connection, length: int) -> bytearray:
    """Exactly `length` body bytes: what h11 already holds, then straight from the socket."""
    buffer = bytearray(length)
    view = memoryview(buffer)
    early, closed = conn.trailing_data  # body bytes that arrived together with the head
    if len(early) > length:
        raise KvPullError(f"{len(early) - length} bytes beyond the declared Content-Length")
    view[: len(early)] = early
    got = len(early)
    while got < length:
        if closed:
            raise KvPullError(f"the peer closed the connection after {got} of {length} body bytes")
        n = await stream.socket.recv_into(view[got:], length - got)
        if n == 0:
            raise KvPullError(f"the peer closed the connection after {got} of {length} body bytes")
        got += n
    view.release()
    return buffer


async def pull(url: str, headers: Sequence[tuple[str, str]], *, max_bytes: int,
               connect_timeout_s: float) -> PulledKv:
    """GET `url` (plain http) and return its status and whole body. A 200 answer may be up to
    `max_bytes`; any other answer up to MAX_ERROR_BODY (it is read for its error document)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"kv_pull handles plain http:// URLs only, not {url!r}")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    started = time.perf_counter()
    with trio.fail_after(connect_timeout_s):
        stream = await trio.open_tcp_stream(parts.hostname, parts.port or 80)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(method="GET", target=target,
                              headers=[("Host", parts.netloc), ("Connection", "close"), *headers])
        data = conn.send(request)
        end = conn.send(h11.EndOfMessage())
        assert data is not None and end is not None  # h11 returns bytes for every client event
        await stream.send_all(data + end)
        response = await _receive_head(stream, conn)
        head = time.perf_counter()
        length = _content_length(response)
        body: bytes | bytearray
        if response.status_code != 200:
            body = await _receive_framed(stream, conn, MAX_ERROR_BODY)
        elif length is None:
            body = await _receive_framed(stream, conn, max_bytes)
        elif length > max_bytes:
            raise KvTooLarge(f"the answer declares {length} bytes, the limit is {max_bytes}")
        else:
            body = await _receive_sized(stream, conn, length)
        last_byte = time.perf_counter()
    # the one copy after the clock stops: the Engine port takes immutable bytes
    return PulledKv(response.status_code, bytes(body), head - started, last_byte - started)


__all__ = ["KvPullError", "KvTooLarge", "PulledKv", "pull"]
