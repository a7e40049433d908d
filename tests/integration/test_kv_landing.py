"""KV received over the network straight into a node's shared memory (`adapters.kv.shm_landing.ShmLanding`,
a node whose engine core is a process): a pull over a real socket and a streamed piece land in a
region and are handed on by reference with no copy; a receive cut mid-body gives its region back
at once; a region whose views all go unclaimed goes back; with no room in shared memory the bytes
land in process memory, as before. (That the process core decodes from such a region as from a
copy is tests/integration/test_engine_core_process.py's.)"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import trio

from adapters.http.peers_httpx import HttpxPeers
from adapters.kv import pull as kv_pull
from adapters.kv import stream as kv_stream
from adapters.kv.shm_inbox import ShmInbox
from adapters.kv.shm_landing import ShmLanding
from adapters.kv.shm_outbox import ROUND_BYTES, ShmOutbox
from adapters.kv.shm_region import ShmRef
from effects.ports import KvSegment, SamplingParams
from statecore.errors import Code, StatecoreError
from statecore.ids import RequestId

PAYLOAD = bytes(range(256)) * 4096  # 1 MiB


@pytest.fixture
def outbox() -> Iterator[ShmOutbox]:
    box = ShmOutbox(checksum=False, max_bytes=4 * ROUND_BYTES)
    try:
        yield box
    finally:
        box.close()


@pytest.fixture
def landing(outbox: ShmOutbox) -> ShmLanding:
    return ShmLanding(outbox, kv_pull.ReceiveBuffers(1 << 24).take)


def read(outbox: ShmOutbox, ref: ShmRef) -> bytes:
    inbox = ShmInbox(outbox.directory)
    try:
        data = bytes(inbox.read(ref))
        inbox.done(ref)
        return data
    finally:
        inbox.close()


async def _serve(stream: trio.SocketStream, body: bytes, declared: int) -> None:
    """An HTTP/1.1 answer declaring `declared` body bytes and sending `body` (fewer: cut)."""
    request = b""
    while b"\r\n\r\n" not in request:
        request += await stream.receive_some(4096)
    await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % declared)
    await stream.send_all(body)
    await stream.aclose()


@dataclass
class Server:
    """A node answering each GET with the next (body, declared length) of `answers`."""

    url: str
    answers: list[tuple[bytes, int]] = field(default_factory=list)


@pytest.fixture
async def server(nursery: trio.Nursery) -> Server:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    served = Server(f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/internal/kv/r1")

    async def handler(stream: trio.SocketStream) -> None:
        await _serve(stream, *served.answers.pop(0))

    nursery.start_soon(trio.serve_listeners, handler, listeners)
    return served


async def test_a_pull_lands_in_shared_memory_and_a_cut_one_gives_its_region_back(
        server: Server, outbox: ShmOutbox, landing: ShmLanding) -> None:
    server.answers.append((PAYLOAD, len(PAYLOAD)))
    pulled = await kv_pull.pull(server.url, [], max_bytes=1 << 24, connect_timeout_s=5, buffers=landing)
    assert isinstance(pulled.body, memoryview)
    ref = landing.claim(pulled.body)
    assert ref is not None and read(outbox, ref) == PAYLOAD  # the receive's own bytes, no copy since
    assert landing.claim(pulled.body) is None  # once only
    assert outbox.free(ref) and outbox.statistics().held_regions == 0
    # cut mid-body: the region goes back before the exception (and its traceback's views) does
    server.answers.append((PAYLOAD[: len(PAYLOAD) // 2], len(PAYLOAD)))
    with pytest.raises(kv_pull.KvPullError):
        await kv_pull.pull(server.url, [], max_bytes=1 << 24, connect_timeout_s=5, buffers=landing)
    assert outbox.statistics().held_regions == 0
    assert landing.statistics().landed == 2 and landing.statistics().claimed == 1


def test_an_unclaimed_region_goes_back_with_its_last_view_and_no_room_lands_in_process_memory(
        outbox: ShmOutbox, landing: ShmLanding) -> None:
    view = landing.take(len(PAYLOAD))
    part = view[: len(PAYLOAD) // 2]
    assert landing.claim(part) is None  # a part of a landed payload is not the payload
    assert landing.claim(memoryview(bytearray(16))) is None  # nor is memory it never handed out
    assert outbox.statistics().held_regions == 1
    del view, part
    gc.collect()
    assert outbox.statistics().held_regions == 0 and landing.statistics().held == 0
    # the outbox's budget held by requests: the bytes land in process memory, copied on as before
    held = [outbox.reserve("other", ROUND_BYTES) for _ in range(4)]
    fallback = landing.take(len(PAYLOAD))
    assert landing.claim(fallback) is None and landing.statistics().fell_back == 1
    for writer in held:
        writer.abort()


class _Body(httpx.AsyncByteStream):
    def __init__(self, data: bytes) -> None:
        self.data = data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.data


def _stream_peers(data: bytes, landing: ShmLanding) -> HttpxPeers:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/internal/info":
            return httpx.Response(200, json={})
        return httpx.Response(200, stream=_Body(data))

    peers = HttpxPeers(transport=httpx.MockTransport(answer), kv_transport="http")
    peers.landing = landing
    return peers


@pytest.mark.parametrize("cut", [False, True])
async def test_a_streamed_piece_lands_in_shared_memory_and_a_cut_one_gives_its_region_back(
        outbox: ShmOutbox, landing: ShmLanding, cut: bool) -> None:
    where = kv_stream.SegmentRange(0, 5, 0, 1)
    data = (kv_stream.preamble() + kv_stream.segment_head(where, len(PAYLOAD)) + PAYLOAD
            + kv_stream.end_record(5, 1))
    peers = _stream_peers(data[: len(data) // 2] if cut else data, landing)
    items = peers.prefill_stream("http://prefill", RequestId("r1"), [1, 2, 3, 4, 5], SamplingParams(4),
                                 layers=1)
    try:
        if cut:
            with pytest.raises(StatecoreError) as raised:
                await items.__anext__()
            assert raised.value.info.code is Code.KV_TRUNCATED
            assert outbox.statistics().held_regions == 0
            return
        segment = await items.__anext__()
        assert isinstance(segment, KvSegment)
        ref = landing.claim(segment.payload.pieces[0])
        assert ref is not None and read(outbox, ref) == PAYLOAD
        outbox.free(ref)
    finally:
        await items.aclose()
        await peers.aclose()
