"""The KV stream (wire version 4): its records, the last-step flag, the coverage checks, version
refusals both ways, and the chunked body reader under record boundaries that do not line up with
chunks."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import mlx.core as mx
import pytest
import trio
import trio.testing
from mlx_lm.models.cache import KVCache

from adapters.kv import pull as kv_pull
from adapters.kv import stream as kv_stream
from adapters.kv.codec import encode_cache, validate_payload
from adapters.kv.frames import MAGIC
from statecore.errors import Code, StatecoreError


def _payload(tokens: int, layers: int = 2) -> bytes:
    caches = []
    for _ in range(layers):
        cache = KVCache()  # type: ignore[no-untyped-call]
        cache.update_and_fetch(mx.ones((1, 2, tokens, 8)), mx.zeros((1, 2, tokens, 8)))  # type: ignore[no-untyped-call]
        caches.append(cache)
    return b"".join(encode_cache(caches, fingerprint="fp", token_count=tokens))


def _segment(start: int, stop: int, first: int, end: int, *, last_step_started: bool = False) -> bytes:
    payload = _payload(stop - start, end - first)
    return kv_stream.segment_head(kv_stream.SegmentRange(start, stop, first, end), len(payload),
                                  last_step_started=last_step_started) + payload


def _reader(data: bytes) -> kv_stream.ReadInto:
    position = 0

    async def read_into(view: memoryview) -> None:
        nonlocal position
        if position + len(view) > len(data):
            raise kv_pull.KvStreamCut("the test stream ended")
        view[:] = data[position : position + len(view)]
        position += len(view)

    return read_into


async def _records(data: bytes, layers: int, tokens: int, max_bytes: int = 1 << 30) -> list[kv_stream.Record]:
    read_into = _reader(data)
    await kv_stream.read_preamble(read_into)
    coverage = kv_stream.SegmentCoverage(layers, tokens)
    records: list[kv_stream.Record] = []
    while True:
        record = await kv_stream.read_record(read_into, _fresh, max_bytes)
        records.append(record)
        if isinstance(record, kv_stream.Segment):
            coverage.add(record.where)
        if isinstance(record, kv_stream.StreamEnd):
            coverage.finish(record)
            return records


def _fresh(nbytes: int) -> memoryview:
    return memoryview(bytearray(nbytes))


def _stream(*records: bytes) -> bytes:
    return kv_stream.preamble() + b"".join(records)


async def test_pieces_by_token_and_layer_range_then_the_first_token_then_the_end() -> None:
    data = _stream(
        # chunk 0 in two layer slices; the step computing the rest started before the second went
        _segment(0, 6, 0, 1), _segment(0, 6, 1, 2, last_step_started=True),
        kv_stream.document_record(kv_stream.FIRST_TOKEN,
                                  {"first_token": 7, "is_eos": False, "held_bytes": 0}),
        _segment(6, 7, 0, 2),  # the last token, every layer
        kv_stream.end_record(7, 3),
    )
    records = await _records(data, layers=2, tokens=7)
    segments = [r for r in records if isinstance(r, kv_stream.Segment)]
    assert [s.where for s in segments] == [kv_stream.SegmentRange(0, 6, 0, 1),
                                           kv_stream.SegmentRange(0, 6, 1, 2),
                                           kv_stream.SegmentRange(6, 7, 0, 2)]
    assert [s.last_step_started for s in segments] == [False, True, False]
    # each piece is a whole version-1 payload that the codec validates on its own
    validated = validate_payload(segments[2].payload, fingerprint="fp", expected_classes=["KVCache"] * 2)
    assert validated.header.token_count == 1
    first = next(r for r in records if isinstance(r, kv_stream.Document))
    assert first.kind == kv_stream.FIRST_TOKEN and first.value["first_token"] == 7


@pytest.mark.parametrize(("pieces", "end", "code", "words"), [
    ([(0, 3, 0, 2), (4, 7, 0, 2)], (7, 2), Code.KV_MALFORMED, "do not follow"),  # a gap
    ([(0, 4, 0, 2), (3, 7, 0, 2)], (7, 2), Code.KV_MALFORMED, "do not follow"),  # an overlap
    ([(0, 7, 0, 3)], (7, 1), Code.KV_MALFORMED, "not inside the model"),  # a layer too many
    ([(0, 8, 0, 2)], (8, 1), Code.KV_MALFORMED, "not inside the prompt"),  # past the prompt
    ([(0, 7, 0, 1)], (7, 1), Code.KV_TRUNCATED, "covers"),  # a layer never sent
    ([(0, 7, 0, 2)], (7, 2), Code.KV_TRUNCATED, "declares 2 segments"),  # a piece lost
])
async def test_pieces_that_do_not_fit_together_are_refused(
    pieces: Sequence[tuple[int, int, int, int]], end: tuple[int, int], code: Code, words: str
) -> None:
    data = _stream(*(_segment(*piece) for piece in pieces), kv_stream.end_record(*end))
    with pytest.raises(StatecoreError) as raised:
        await _records(data, layers=2, tokens=7)
    assert raised.value.info.code is code and words in raised.value.info.message


async def test_an_old_reader_refuses_a_stream_and_a_stream_reader_refuses_an_old_payload() -> None:
    with pytest.raises(StatecoreError) as old:  # a version 1/2 reader given a stream
        validate_payload(_stream(kv_stream.end_record(0, 0)), fingerprint="fp")
    assert old.value.info.code is Code.KV_MALFORMED
    assert "unsupported KV format version 4" in old.value.info.message
    with pytest.raises(StatecoreError) as new:  # a stream reader given a version 1 payload
        await kv_stream.read_preamble(_reader(_payload(3)))
    assert new.value.info.code is Code.KV_MALFORMED and "stream version 1" in new.value.info.message
    with pytest.raises(StatecoreError) as version_3:  # the records before the flags
        await kv_stream.read_preamble(_reader(struct.pack("<8sH", MAGIC, 3)))
    assert version_3.value.info.code is Code.KV_MALFORMED
    assert "unsupported KV stream version 3" in version_3.value.info.message
    with pytest.raises(StatecoreError) as magic:
        await kv_stream.read_preamble(_reader(b"GET / HTTP/1.1\r\n"))
    assert magic.value.info.code is Code.KV_MALFORMED


async def test_unknown_records_oversized_pieces_and_bad_documents_are_typed_errors() -> None:
    unknown = _stream(struct.pack("<cQ", b"Q", 0))
    with pytest.raises(StatecoreError, match="unknown KV stream record"):
        await _records(unknown, 2, 7)
    flagged = bytearray(_stream(_segment(0, 7, 0, 2)))
    flagged[kv_stream.PREAMBLE_BYTES + kv_stream.RECORD_HEAD_BYTES + 16] = 0x02  # a flag no reader knows
    with pytest.raises(StatecoreError, match="unknown flags 0x2"):
        await _records(bytes(flagged), 2, 7)
    big = _stream(_segment(0, 7, 0, 2))
    with pytest.raises(StatecoreError) as raised:
        await _records(big, 2, 7, max_bytes=64)
    assert raised.value.info.code is Code.KV_TOO_LARGE
    not_json = _stream(struct.pack("<cQ", kv_stream.FIRST_TOKEN, 3) + b"{x}")
    with pytest.raises(StatecoreError, match="not JSON"):
        await _records(not_json, 2, 7)


# --------------------------------------------------------------------------- the chunked body


def _chunked(data: bytes, sizes: Sequence[int], *, finish: bool = True) -> bytes:
    out = bytearray()
    position = 0
    for size in sizes:
        piece = data[position : position + size]
        if not piece:
            break
        out += f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        position += len(piece)
    if position < len(data):
        rest = data[position:]
        out += f"{len(rest):x}\r\n".encode() + rest + b"\r\n"
    if finish:
        out += b"0\r\n\r\n"
    return bytes(out)


async def _read_all(wire: bytes, early: int, layers: int, tokens: int) -> list[kv_stream.Record]:
    send, receive = trio.testing.memory_stream_pair()
    body = kv_pull.StreamBody(receive, wire[:early], chunked=True, length=None)
    records: list[kv_stream.Record] = []

    async def feed() -> None:
        rest = wire[early:]
        for start in range(0, len(rest), 1000):  # the socket hands bytes over in its own pieces
            await send.send_all(rest[start : start + 1000])
        await send.aclose()

    failed: Exception | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(feed)
        try:
            await kv_stream.read_preamble(body.read_into)
            coverage = kv_stream.SegmentCoverage(layers, tokens)
            while True:
                record = await kv_stream.read_record(body.read_into, _fresh, 1 << 30)
                records.append(record)
                if isinstance(record, kv_stream.Segment):
                    coverage.add(record.where)
                if isinstance(record, kv_stream.StreamEnd):
                    coverage.finish(record)
                    break
        except Exception as exc:  # raised here, not as the nursery's group
            failed = exc
    if failed is not None:
        raise failed
    return records


async def test_the_chunked_body_is_read_whatever_its_chunk_sizes() -> None:
    data = _stream(_segment(0, 6, 0, 2), _segment(6, 7, 0, 2), kv_stream.end_record(7, 2))
    for sizes in ([len(data)], [3, 7, 1, 500, 33], [1] * 40, [math.ceil(len(data) / 2)]):
        records = await _read_all(_chunked(data, sizes), early=5, layers=2, tokens=7)
        assert [type(r) for r in records] == [kv_stream.Segment, kv_stream.Segment, kv_stream.StreamEnd]


async def test_a_chunked_body_that_ends_before_the_end_record_is_a_cut_stream() -> None:
    data = _stream(_segment(0, 6, 0, 2))  # no end record, then the last chunk
    with pytest.raises(kv_pull.KvStreamCut):
        await _read_all(_chunked(data, [100, 100]), early=0, layers=2, tokens=7)


async def test_a_connection_lost_mid_chunk_is_not_a_cut_stream() -> None:
    data = _stream(_segment(0, 6, 0, 2), kv_stream.end_record(6, 1))
    wire = _chunked(data, [len(data)], finish=False)[: len(data) // 2]  # the peer died mid-chunk
    with pytest.raises(kv_pull.KvPullError):
        await _read_all(wire, early=0, layers=2, tokens=6)


def test_the_stream_magic_is_the_payload_magic() -> None:
    assert kv_stream.preamble()[:8] == MAGIC and kv_stream.preamble()[8:] == b"\x04\x00"
