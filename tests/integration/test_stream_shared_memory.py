"""A decode node reading a KV stream whose pieces lie in shared memory: a piece read in place,
and the typed errors when the memory is gone, freed under the reader, or never offered."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from adapters.http.peers_httpx import HttpxPeers
from adapters.kv import shm as kv_shm
from adapters.kv import stream as kv_stream
from adapters.kv.codec import encode_cache
from effects.ports import KvSegment, PrefillReply
from statecore.errors import Code, StatecoreError


def _payload(tokens: int) -> bytes:
    cache = KVCache()  # type: ignore[no-untyped-call]
    cache.update_and_fetch(mx.ones((1, 2, tokens, 8)), mx.zeros((1, 2, tokens, 8)))  # type: ignore[no-untyped-call]
    return b"".join(encode_cache([cache], fingerprint="fp", token_count=tokens))


@pytest.fixture
def outbox() -> Iterator[kv_shm.ShmOutbox]:
    box = kv_shm.ShmOutbox(checksum=False)
    try:
        yield box
    finally:
        box.close()


def _reader(data: bytes) -> kv_stream.ReadInto:
    position = 0

    async def read_into(view: memoryview) -> None:
        nonlocal position
        view[:] = data[position : position + len(view)]
        position += len(view)

    return read_into


def _stream(outbox: kv_shm.ShmOutbox, tokens: int = 5) -> tuple[bytes, kv_shm.ShmRef]:
    ref = outbox.put("r1", [_payload(tokens)])
    where = kv_stream.SegmentRange(0, tokens, 0, 1)
    data = (kv_stream.preamble() + kv_stream.shared_segment_record(where, ref.model_dump())
            + kv_stream.document_record(kv_stream.FIRST_TOKEN, {"first_token": 3, "is_eos": False,
                                                                "held_bytes": 0})
            + kv_stream.end_record(tokens, 1))
    return data, ref


async def test_a_piece_in_shared_memory_is_read_in_place(outbox: kv_shm.ShmOutbox) -> None:
    data, _ = _stream(outbox)
    peers = HttpxPeers()
    items = [item async for item in peers._stream_items(_reader(data), 5, 1,
                                                         kv_shm.ShmInbox(outbox.directory))]
    await peers.aclose()
    segment, first = items
    assert isinstance(segment, KvSegment) and isinstance(first, PrefillReply)
    assert bytes(segment.payload.pieces[0]) == _payload(5) and first.first_token == 3


@pytest.mark.parametrize("how", ["released", "closed"])
async def test_shared_memory_gone_before_the_read_is_a_typed_error(outbox: kv_shm.ShmOutbox,
                                                                   how: str) -> None:
    data, _ = _stream(outbox)
    if how == "released":
        outbox.release("r1")  # freed: the region may be reused
    else:
        outbox.close()  # unlinked: the prefill node stopped
    peers = HttpxPeers()
    with pytest.raises(StatecoreError) as raised:
        async for _ in peers._stream_items(_reader(data), 5, 1, kv_shm.ShmInbox(outbox.directory)):
            pass
    await peers.aclose()
    assert raised.value.info.code is Code.KV_SHM_GONE


async def test_a_region_reused_while_the_piece_was_read_is_a_typed_error(outbox: kv_shm.ShmOutbox) -> None:
    data, _ = _stream(outbox)
    peers = HttpxPeers()
    items = peers._stream_items(_reader(data), 5, 1, kv_shm.ShmInbox(outbox.directory))
    first = await items.__anext__()
    assert isinstance(first, KvSegment)
    outbox.release("r1")
    outbox.put("r2", [b"\x00" * 64])  # another request takes the region under the reader
    with pytest.raises(StatecoreError) as raised:
        await items.__anext__()  # the reader says it is done with the piece: it changed
    await items.aclose()
    await peers.aclose()
    assert raised.value.info.code is Code.KV_SHM_GONE


async def test_a_shared_piece_nobody_asked_for_is_refused(outbox: kv_shm.ShmOutbox) -> None:
    data, _ = _stream(outbox)
    peers = HttpxPeers()
    with pytest.raises(StatecoreError) as raised:
        async for _ in peers._stream_items(_reader(data), 5, 1, None):
            pass
    await peers.aclose()
    assert raised.value.info.code is Code.KV_MALFORMED
