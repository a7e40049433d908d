"""The wire format's CRC-32, computed over several cores: the same value `zlib.crc32` gives.

A handoff checksums every KV byte twice (the sender's end frame, the receiver's check), and one
core's CRC-32 runs at ~2 GB/s: on a fast device that was most of a 2,000-token handoff (64 MiB
of a 1B model's KV: ~30 ms a side against a ~40 ms prefill). So a large buffer is cut into pieces
whose CRCs worker threads compute at once (zlib releases the GIL over large buffers), and the
pieces' CRCs are joined in order by the CRC's algebra: the CRC of `a + b` is the CRC of `a`
carried past `len(b)` zero bytes, xor the CRC of `b`. Carrying past n zero bytes is a linear map
over GF(2) on the 32 bits, built once per length (lengths repeat: the pieces are a fixed size
and tensors keep their shapes). The value, and so the wire format, is unchanged. This module
uses only the standard library; it must never import mlx, numpy, trio or httpx.
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final

PIECE_BYTES: Final = 4 << 20  # one worker's share at a time
PARALLEL_FROM_BYTES: Final = 8 << 20  # below this one core is quicker than handing work out
_REFLECTED_POLY: Final = 0xEDB88320  # CRC-32 (IEEE), least significant bit first, as zlib's
_WORKERS: Final = max(1, min(8, (os.cpu_count() or 1)))

Operator = tuple[int, ...]  # 32 columns: the image of each bit of a CRC


def _apply(operator: Operator, crc: int) -> int:
    out = 0
    bit = 0
    while crc:
        if crc & 1:
            out ^= operator[bit]
        crc >>= 1
        bit += 1
    return out


def _compose(outer: Operator, inner: Operator) -> Operator:
    """`outer` after `inner`."""
    return tuple(_apply(outer, column) for column in inner)


@functools.cache
def _zero_bytes_power(power: int) -> Operator:
    """The map that carries a CRC past 2**power zero bytes."""
    if power == 0:
        # one zero bit: shift right, folding the polynomial in where a one falls off
        bit: Operator = (_REFLECTED_POLY, *(1 << (i - 1) for i in range(1, 32)))
        byte = bit
        for _ in range(3):  # 1 -> 2 -> 4 -> 8 bits
            byte = _compose(byte, byte)
        return byte
    half = _zero_bytes_power(power - 1)
    return _compose(half, half)


@functools.lru_cache(maxsize=256)
def _zero_bytes(length: int) -> Operator:
    """The map that carries a CRC past `length` zero bytes."""
    operator: Operator | None = None
    power = 0
    while length:
        if length & 1:
            step = _zero_bytes_power(power)
            operator = step if operator is None else _compose(step, operator)
        length >>= 1
        power += 1
    return operator if operator is not None else tuple(1 << i for i in range(32))


def crc32_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """The CRC-32 of `a + b` from the CRC-32s of `a` and `b` and the length of `b`."""
    if length_b == 0:
        return crc_a
    return _apply(_zero_bytes(length_b), crc_a) ^ crc_b


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="kv-crc")


def crc32(buffers: Sequence[bytes | memoryview], start: int = 0) -> int:
    """`zlib.crc32` over `buffers` one after another, continuing from `start`; large ones on
    several cores. Blocks until done: call it from a worker thread, never the event loop."""
    views = [memoryview(buffer).cast("B") for buffer in buffers]
    if _WORKERS == 1 or sum(len(view) for view in views) < PARALLEL_FROM_BYTES:
        crc = start
        for view in views:
            crc = zlib.crc32(view, crc)
        return crc
    pieces = [view[offset:offset + PIECE_BYTES] for view in views
              for offset in range(0, len(view), PIECE_BYTES)]
    crc = start
    for piece, piece_crc in zip(pieces, _pool().map(zlib.crc32, pieces), strict=True):
        crc = crc32_combine(crc, piece_crc, len(piece))
    return crc


__all__ = ["PARALLEL_FROM_BYTES", "PIECE_BYTES", "crc32", "crc32_combine"]
