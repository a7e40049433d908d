"""The parallel CRC-32 gives zlib's value: the wire format's checksum is unchanged by it."""

from __future__ import annotations

import random
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.kv import checksum


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300))
def test_combine_is_the_crc_of_the_concatenation(a: bytes, b: bytes) -> None:
    assert checksum.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_combine_over_lengths_with_many_bits_set() -> None:
    rng = random.Random(7)
    for length in (1, 255, 4096, (1 << 20) + 3, 3 * (1 << 20) - 1):
        a, b = rng.randbytes(17), rng.randbytes(length)
        assert checksum.crc32_combine(zlib.crc32(a), zlib.crc32(b), length) == zlib.crc32(a + b)


def test_large_buffers_give_zlibs_value_from_any_start() -> None:
    rng = random.Random(3)
    # above the parallel threshold, in pieces that do not fall on the piece size
    buffers: list[bytes | memoryview] = [
        rng.randbytes(5), memoryview(rng.randbytes(checksum.PIECE_BYTES + 11)),
        rng.randbytes(checksum.PARALLEL_FROM_BYTES - checksum.PIECE_BYTES), b"", rng.randbytes(9)]
    assert sum(len(b) for b in buffers) >= checksum.PARALLEL_FROM_BYTES
    for start in (0, 0xDEADBEEF):
        expected = start
        for buffer in buffers:
            expected = zlib.crc32(buffer, expected)
        assert checksum.crc32(buffers, start) == expected


def test_small_buffers_take_one_core_and_give_zlibs_value() -> None:
    buffers: list[bytes | memoryview] = [b"statecore", b"", memoryview(b"KV")]
    assert checksum.crc32(buffers) == zlib.crc32(b"statecoreKV")
