"""The KV stream (wire format version 4): a prompt's cache as it is computed, then its first token.

A prefill node that streams a handoff writes one stream per request: a preamble (the KV magic and
version 4), then records. A *segment* record carries one piece of the cache, a token range of a
layer range, as a complete version-1 payload of its own (header, data frames, end frame with its
CRC-32: each piece keeps every guarantee of the wire format and is validated alone, before
anything is built from it), and flags: whether the prefill node has started the step that
computes the prompt's last pieces (so the decode node keeps its steps free for the join). A
*first token* record holds the prompt's first token as the prefill sampled it; an *end* record
the token count the segments must cover; an *error* record the prefill node's typed error, when
the prefill fails mid-stream; a *shared segment* record a segment whose payload the reader maps
from shared memory (nodes on one host), by reference. The decoder (`SegmentCoverage`) checks
that the segments fit together: each layer's token ranges follow one another from 0 without a
gap or an overlap, and at the end every layer covers exactly the declared tokens.

Version 4 only frames; the pieces inside are version 1 (or 2). A reader of versions 1 and 2
refuses a stream at its preamble ("unsupported KV format version 4"), and this reader refuses a
stream whose preamble is not version 4 (version 3, the same records without flags, included).
``docs/wire-format.md`` documents the bytes. This module needs no MLX: it must never import mlx,
mlx_lm or numpy; nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from adapters.kv.frames import MAGIC, fail
from statecore.errors import Code

STREAM_VERSION: Final[int] = 4
_PREAMBLE: Final = struct.Struct("<8sH")  # magic, version (as every KV payload starts)
_RECORD: Final = struct.Struct("<cQ")  # record kind, body length
_RANGE: Final = struct.Struct("<IIIII")  # tokens [start, stop), layers [first, end), flags
_END: Final = struct.Struct("<QI")  # tokens covered, segments sent

SEGMENT: Final = b"S"
SHARED_SEGMENT: Final = b"R"  # a segment whose payload lies in shared memory (adapters.kv.shm_region)
FIRST_TOKEN: Final = b"T"
ERROR: Final = b"X"
END: Final = b"Z"
# A segment's flag: the prefill node has started the step that computes the prompt's last pieces
LAST_STEP_STARTED: Final = 1
_KNOWN_FLAGS: Final = LAST_STEP_STARTED
MAX_DOCUMENT_BYTES: Final = 1 << 20  # a first-token or error record is a small JSON document
PREAMBLE_BYTES: Final = _PREAMBLE.size
RECORD_HEAD_BYTES: Final = _RECORD.size
SEGMENT_HEAD_BYTES: Final = _RECORD.size + _RANGE.size


# --------------------------------------------------------------------------- writing


def preamble() -> bytes:
    return _PREAMBLE.pack(MAGIC, STREAM_VERSION)


@dataclass(frozen=True, slots=True)
class SegmentRange:
    """Which part of a cache a segment holds: tokens [start, stop) of layers [first_layer, end_layer)."""

    start: int
    stop: int
    first_layer: int
    end_layer: int

    @property
    def tokens(self) -> int:
        return self.stop - self.start


def _range(where: SegmentRange, last_step_started: bool) -> bytes:
    return _RANGE.pack(where.start, where.stop, where.first_layer, where.end_layer,
                       LAST_STEP_STARTED if last_step_started else 0)


def segment_head(where: SegmentRange, payload_bytes: int, *, last_step_started: bool = False) -> bytes:
    """A segment record's head; the version-1 payload (`payload_bytes` long) follows it.
    `last_step_started`: the step computing the prompt's last pieces is running."""
    return _RECORD.pack(SEGMENT, _RANGE.size + payload_bytes) + _range(where, last_step_started)


def shared_segment_record(where: SegmentRange, reference: dict[str, object], *,
                          last_step_started: bool = False) -> bytes:
    """A segment whose payload the reader maps from shared memory: its range and flags, then
    the JSON reference (`adapters.kv.shm_region.ShmRef`)."""
    body = json.dumps(reference, separators=(",", ":")).encode()
    return _RECORD.pack(SHARED_SEGMENT, _RANGE.size + len(body)) + _range(where, last_step_started) + body


def document_record(kind: bytes, document: dict[str, object]) -> bytes:
    """A first-token or error record: its JSON document."""
    body = json.dumps(document, separators=(",", ":")).encode()
    return _RECORD.pack(kind, len(body)) + body


def end_record(tokens: int, segments: int) -> bytes:
    return _RECORD.pack(END, _END.size) + _END.pack(tokens, segments)


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True, slots=True)
class Segment:
    where: SegmentRange
    payload: memoryview  # a complete version-1/2 payload; validated by the codec
    last_step_started: bool = False  # the prompt's last pieces are being computed


@dataclass(frozen=True, slots=True)
class SharedSegment:
    """A segment whose payload is in shared memory: `reference` is its JSON `ShmRef`."""

    where: SegmentRange
    reference: object
    last_step_started: bool = False


@dataclass(frozen=True, slots=True)
class Document:
    """A first-token (`kind` FIRST_TOKEN) or error (ERROR) record's parsed JSON object."""

    kind: bytes
    value: dict[str, object]
    raw: bytes  # the JSON text, for a strict model to validate as JSON


@dataclass(frozen=True, slots=True)
class StreamEnd:
    tokens: int
    segments: int


Record = Segment | SharedSegment | Document | StreamEnd

# Reads exactly len(view) bytes of the stream into view (raises when the stream ends first).
ReadInto = Callable[[memoryview], Awaitable[None]]
# A buffer of n bytes to land a segment in (a receive buffer kept for reuse, or a fresh one).
TakeBuffer = Callable[[int], memoryview]


async def read_preamble(read_into: ReadInto) -> None:
    head = memoryview(bytearray(_PREAMBLE.size))
    await read_into(head)
    magic, version = _PREAMBLE.unpack(head)
    if magic != MAGIC:
        fail(Code.KV_MALFORMED, "not a statecore KV stream (bad magic)")
    if version != STREAM_VERSION:
        fail(Code.KV_MALFORMED,
             f"unsupported KV stream version {version} (this node reads stream version {STREAM_VERSION})")


async def read_record(read_into: ReadInto, take: TakeBuffer, max_segment_bytes: int) -> Record:
    """The stream's next record, its framing checked; a segment's payload lands in `take`'s buffer."""
    head = memoryview(bytearray(_RECORD.size))
    await read_into(head)
    kind, length = _RECORD.unpack(head)
    if kind == SEGMENT:
        if length < _RANGE.size:
            fail(Code.KV_MALFORMED, f"a segment record of {length} bytes holds no range")
        if length - _RANGE.size > max_segment_bytes:
            fail(Code.KV_TOO_LARGE, f"a KV segment of {length} bytes exceeds {max_segment_bytes}")
        where = memoryview(bytearray(_RANGE.size))
        await read_into(where)
        start, stop, first, end, flags = _RANGE.unpack(where)
        payload = take(length - _RANGE.size)
        await read_into(payload)
        return Segment(SegmentRange(start, stop, first, end), payload, _last_step_started(flags))
    if kind == SHARED_SEGMENT:
        if not _RANGE.size < length <= _RANGE.size + MAX_DOCUMENT_BYTES:
            fail(Code.KV_MALFORMED, f"a shared segment record of {length} bytes")
        body = memoryview(bytearray(length))
        await read_into(body)
        start, stop, first, end, flags = _RANGE.unpack_from(body)
        try:
            reference = json.loads(bytes(body[_RANGE.size :]))
        except ValueError as exc:
            fail(Code.KV_MALFORMED, f"a shared segment's reference is not JSON: {exc}")
        return SharedSegment(SegmentRange(start, stop, first, end), reference, _last_step_started(flags))
    if kind in (FIRST_TOKEN, ERROR):
        if length > MAX_DOCUMENT_BYTES:
            fail(Code.KV_MALFORMED, f"a {kind!r} record of {length} bytes exceeds the limit")
        body = memoryview(bytearray(length))
        await read_into(body)
        try:
            value = json.loads(bytes(body))
        except ValueError as exc:
            fail(Code.KV_MALFORMED, f"a {kind!r} record is not JSON: {exc}")
        if not isinstance(value, dict):
            fail(Code.KV_MALFORMED, f"a {kind!r} record is not a JSON object")
        return Document(kind, value, bytes(body))
    if kind == END:
        if length != _END.size:
            fail(Code.KV_MALFORMED, f"an end record must hold {_END.size} bytes, not {length}")
        body = memoryview(bytearray(length))
        await read_into(body)
        tokens, segments = _END.unpack(body)
        return StreamEnd(tokens, segments)
    fail(Code.KV_MALFORMED, f"unknown KV stream record kind {kind!r}")


def _last_step_started(flags: int) -> bool:
    if flags & ~_KNOWN_FLAGS:
        fail(Code.KV_MALFORMED, f"a segment with unknown flags {flags:#x}")
    return bool(flags & LAST_STEP_STARTED)


class SegmentCoverage:
    """Checks that a stream's segments fit together: per layer, token ranges in order from 0,
    no gap, no overlap; `finish` checks that every layer covers the declared tokens."""

    def __init__(self, layers: int, prompt_tokens: int) -> None:
        self.layers = layers
        self.prompt_tokens = prompt_tokens
        self.upto = [0] * layers  # each layer's tokens received so far
        self.segments = 0
        self.whole = False  # one segment held the whole cache (a family that streams no ranges)

    def add(self, where: SegmentRange) -> None:
        if not (0 <= where.first_layer < where.end_layer <= self.layers):
            fail(Code.KV_MALFORMED, f"segment layers [{where.first_layer}, {where.end_layer}) are not "
                                    f"inside the model's {self.layers}")
        if not where.start < where.stop <= self.prompt_tokens:
            fail(Code.KV_MALFORMED, f"segment tokens [{where.start}, {where.stop}) are not inside "
                                    f"the prompt's {self.prompt_tokens}")
        behind = [layer for layer in range(where.first_layer, where.end_layer)
                  if self.upto[layer] != where.start]
        if behind:
            fail(Code.KV_MALFORMED, f"segment tokens [{where.start}, {where.stop}) of layer {behind[0]} "
                                    f"do not follow its {self.upto[behind[0]]} tokens received")
        for layer in range(where.first_layer, where.end_layer):
            self.upto[layer] = where.stop
        self.segments += 1

    def finish(self, end: StreamEnd) -> None:
        if end.segments != self.segments:
            fail(Code.KV_TRUNCATED, f"the stream declares {end.segments} segments, {self.segments} arrived")
        if end.tokens != self.prompt_tokens or any(got != end.tokens for got in self.upto):
            fail(Code.KV_TRUNCATED, f"the stream covers {min(self.upto, default=0)} of the prompt's "
                                    f"{self.prompt_tokens} tokens in some layer (declared {end.tokens})")


__all__ = [
    "END",
    "ERROR",
    "FIRST_TOKEN",
    "PREAMBLE_BYTES",
    "SEGMENT",
    "SEGMENT_HEAD_BYTES",
    "SHARED_SEGMENT",
    "STREAM_VERSION",
    "Document",
    "ReadInto",
    "Record",
    "Segment",
    "SegmentCoverage",
    "SegmentRange",
    "SharedSegment",
    "StreamEnd",
    "TakeBuffer",
    "document_record",
    "end_record",
    "preamble",
    "read_preamble",
    "read_record",
    "segment_head",
    "shared_segment_record",
]
