"""A decode node reading a KV stream whose pieces lie in shared memory: a piece read in place,
and the typed errors when the memory is gone, freed under the reader, or never offered. Each
goes through `HttpxPeers.prefill_stream` over a mock transport: the prefill node's
`/internal/info` offers its shared memory (or not), and its `/internal/prefill_stream` answers
with the stream's bytes."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator

import httpx
import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from adapters.http.peers_httpx import HttpxPeers
from adapters.kv import stream as kv_stream
from adapters.kv.codec import encode_cache
from adapters.kv.shm_outbox import ShmOutbox
from adapters.kv.shm_region import ShmRef
from effects.ports import KvSegment, PrefillReply, SamplingParams
from statecore.errors import Code, StatecoreError
from statecore.ids import RequestId


def _payload(tokens: int) -> bytes:
    cache = KVCache()  # type: ignore[no-untyped-call]
    cache.update_and_fetch(mx.ones((1, 2, tokens, 8)), mx.zeros((1, 2, tokens, 8)))  # type: ignore[no-untyped-call]
    return b"".join(encode_cache([cache], fingerprint="fp", token_count=tokens))


@pytest.fixture
def outbox() -> Iterator[ShmOutbox]:
    box = ShmOutbox(checksum=False)
    try:
        yield box
    finally:
        box.close()


def _stream(outbox: ShmOutbox, tokens: int = 5) -> tuple[bytes, ShmRef]:
    ref = outbox.put("r1", [_payload(tokens)])
    where = kv_stream.SegmentRange(0, tokens, 0, 1)
    data = (kv_stream.preamble() + kv_stream.shared_segment_record(where, ref.model_dump())
            + kv_stream.document_record(kv_stream.FIRST_TOKEN, {"first_token": 3, "is_eos": False,
                                                                "held_bytes": 0})
            + kv_stream.end_record(tokens, 1))
    return data, ref


class _Body(httpx.AsyncByteStream):
    """A response body streamed as a prefill node streams it (not read ahead, as `content=` is)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.data


def _peers(data: bytes, offer: ShmOutbox | None,
           when_asked: Callable[[], object] = lambda: None) -> HttpxPeers:
    """Peers whose prefill node offers `offer`'s shared memory (None: none) and answers a
    streamed prefill with `data`, after `when_asked` ran (its memory changed after the offer)."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/internal/info":
            return httpx.Response(200, json={} if offer is None else {"kv_shm": offer.advert().model_dump()})
        assert request.url.path == "/internal/prefill_stream"
        when_asked()
        return httpx.Response(200, stream=_Body(data))

    return HttpxPeers(transport=httpx.MockTransport(answer))


def _items(peers: HttpxPeers) -> AsyncGenerator[KvSegment | PrefillReply, None]:
    return peers.prefill_stream("http://prefill", RequestId("r1"), [1, 2, 3, 4, 5], SamplingParams(4),
                                layers=1)


async def test_a_piece_in_shared_memory_is_read_in_place(outbox: ShmOutbox) -> None:
    data, _ = _stream(outbox)
    peers = _peers(data, outbox)
    items = [item async for item in _items(peers)]
    await peers.aclose()
    segment, first = items
    assert isinstance(segment, KvSegment) and isinstance(first, PrefillReply)
    assert bytes(segment.payload.pieces[0]) == _payload(5) and first.first_token == 3


@pytest.mark.parametrize("how", ["released", "closed"])
async def test_shared_memory_gone_before_the_read_is_a_typed_error(outbox: ShmOutbox,
                                                                   how: str) -> None:
    data, _ = _stream(outbox)
    # freed (the region may be reused), or unlinked (the prefill node stopped)
    gone = (lambda: outbox.release("r1")) if how == "released" else outbox.close
    peers = _peers(data, outbox, when_asked=gone)
    with pytest.raises(StatecoreError) as raised:
        async for _ in _items(peers):
            pass
    await peers.aclose()
    assert raised.value.info.code is Code.KV_SHM_GONE


async def test_a_region_reused_while_the_piece_was_read_is_a_typed_error(outbox: ShmOutbox) -> None:
    data, _ = _stream(outbox)
    peers = _peers(data, outbox)
    items = _items(peers)
    first = await items.__anext__()
    assert isinstance(first, KvSegment)
    outbox.release("r1")
    outbox.put("r2", [b"\x00" * 64])  # another request takes the region under the reader
    with pytest.raises(StatecoreError) as raised:
        await items.__anext__()  # the reader says it is done with the piece: it changed
    await items.aclose()
    await peers.aclose()
    assert raised.value.info.code is Code.KV_SHM_GONE


async def test_a_shared_piece_nobody_asked_for_is_refused(outbox: ShmOutbox) -> None:
    data, _ = _stream(outbox)
    peers = _peers(data, offer=None)  # the prefill node offers no shared memory, yet sends a piece in it
    with pytest.raises(StatecoreError) as raised:
        async for _ in _items(peers):
            pass
    await peers.aclose()
    assert raised.value.info.code is Code.KV_MALFORMED
