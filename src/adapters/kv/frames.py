"""The KV wire format's frames: everything about a payload that needs no MLX.

A payload is a preamble (magic, version), one header frame (a small JSON document validated by
the strict models below: per layer its class name, its state's tree of arrays, ints, strings,
None, lists and tuples, and for version 2 the KV heads it holds), data frames of raw tensor
bytes, and an end frame with the total length and a CRC-32. This module frames a cache's host
bytes (`HostTensors`) into pieces, computes the end frame, walks a received payload's framing
(`split_frames`) and checks a header's internal consistency (`check_node`, `check_heads`), so a
router or any process without MLX can handle KV bytes. `adapters.kv.codec` turns caches into
`HostTensors` and validated payloads back into caches. ``docs/wire-format.md`` documents the
format byte by byte. This module must never import mlx, mlx_lm or numpy; nothing in `statecore`
or `effects` may import it.
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Annotated, Final, Literal, NoReturn, TypeAlias, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from adapters.kv import checksum
from effects.engine_port import KvBytes
from statecore.errors import Code, StatecoreError, bug, peer_error

FORMAT_VERSION: Final[int] = 2  # the newest: layers may name the KV heads they hold
ALL_HEADS_VERSION: Final[int] = 1  # written when every layer holds all its heads
READ_VERSIONS: tuple[int, ...] = (ALL_HEADS_VERSION, FORMAT_VERSION)  # what this node decodes
MAGIC: Final[bytes] = b"\x89SCKV\r\n\x1a"

_PREAMBLE: Final = struct.Struct("<8sH")  # magic, format version
_FRAME: Final = struct.Struct("<cI")  # frame type, payload length
_END: Final = struct.Struct("<QI")  # total tensor bytes, crc32
_HEADER_FRAME: Final = b"H"
_DATA_FRAME: Final = b"D"
_END_FRAME: Final = b"E"

MAX_HEADER_BYTES: Final = 4 << 20
_MAX_FRAME_BYTES: Final = (1 << 32) - 1
MAX_DEPTH: Final = 16
MAX_STR: Final = 256
MAX_FINGERPRINT: Final = 1024
INT_BOUND: Final = 1 << 63
DIM_BOUND: Final = 1 << 31  # mlx shapes are int32
# bytes per element of each wire dtype (the codec maps the names to MLX's and numpy's dtypes)
DTYPE_BYTES: Final[dict[str, int]] = {
    "bool": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "int8": 1, "int16": 2, "int32": 4,
    "int64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex64": 8,
}  # fmt: skip
DtypeName: TypeAlias = Literal[
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64", "complex64",
]  # fmt: skip


# --------------------------------------------------------------------------- header schema


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class ArrayNode(_Strict):
    kind: Literal["array"]
    dtype: DtypeName
    shape: Annotated[list[Annotated[int, Field(ge=0, lt=DIM_BOUND)]], Field(max_length=16)]
    nbytes: Annotated[int, Field(ge=0, lt=INT_BOUND)]


class IntNode(_Strict):
    kind: Literal["int"]
    value: Annotated[int, Field(ge=-INT_BOUND, lt=INT_BOUND)]


class NoneNode(_Strict):
    kind: Literal["none"]


class StrNode(_Strict):
    kind: Literal["str"]
    value: Annotated[str, Field(max_length=MAX_STR)]


class ListNode(_Strict):
    kind: Literal["list"]
    items: Annotated[list[Node], Field(max_length=4096)]


class TupleNode(_Strict):
    kind: Literal["tuple"]
    items: Annotated[list[Node], Field(max_length=4096)]


Node: TypeAlias = Annotated[
    Union[ArrayNode, IntNode, NoneNode, StrNode, ListNode, TupleNode],  # noqa: UP007
    Field(discriminator="kind"),
]


class HeadRange(_Strict):
    """KV heads [start, stop) of a layer's `total`: what a version-2 layer's arrays hold."""

    start: Annotated[int, Field(ge=0, lt=DIM_BOUND)]
    stop: Annotated[int, Field(ge=1, lt=DIM_BOUND)]
    total: Annotated[int, Field(ge=1, lt=DIM_BOUND)]


class LayerHeader(_Strict):
    class_name: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
    state: Node
    heads: HeadRange | None = None  # version 2 only; absent: every head


class Header(_Strict):
    fingerprint: Annotated[str, Field(max_length=MAX_FINGERPRINT)]
    token_count: Annotated[int, Field(ge=0, lt=INT_BOUND)]
    layers: Annotated[list[LayerHeader], Field(min_length=1, max_length=65536)]
HEADER_ADAPTER: Final = TypeAdapter(Header)


@dataclass(frozen=True, slots=True)
class HostTensors:
    """A cache's header and its tensors' bytes in host memory: what `frame_payload` frames."""

    header_bytes: bytes
    runs: list[memoryview]
    version: int = ALL_HEADS_VERSION  # FORMAT_VERSION when the header names head ranges


def _framed_pieces(tensors: HostTensors, chunk_bytes: int) -> list[list[bytes | memoryview]]:
    """The header frame and the data frames, each as the pieces it is made of: the tensors' own
    memory is referenced, never copied. The end frame is `end_frame`'s."""
    if not 1 <= chunk_bytes <= _MAX_FRAME_BYTES:
        raise StatecoreError(bug(f"chunk_bytes must be in [1, 2**32 - 1], got {chunk_bytes}"))
    header_bytes = tensors.header_bytes
    frames: list[list[bytes | memoryview]] = [
        [_PREAMBLE.pack(MAGIC, tensors.version)
         + _FRAME.pack(_HEADER_FRAME, len(header_bytes)) + header_bytes]
    ]
    pending: list[bytes | memoryview] = []
    pending_len = 0
    for view in tensors.runs:
        pos = 0
        while pos < len(view):
            piece = view[pos : pos + chunk_bytes - pending_len]
            pending.append(piece)
            pending_len += len(piece)
            pos += len(piece)
            if pending_len == chunk_bytes:
                frames.append([_FRAME.pack(_DATA_FRAME, pending_len), *pending])
                pending, pending_len = [], 0
    if pending:
        frames.append([_FRAME.pack(_DATA_FRAME, pending_len), *pending])
    return frames


END_FRAME_BYTES: Final = _FRAME.size + _END.size


def end_frame(tensors: HostTensors) -> bytes:
    """The end frame: the data byte count and the CRC-32 of the header and every data byte.
    Bytes only, no MLX, so safe off the device thread; the checksum (`adapters.kv.checksum`,
    on several cores) is most of an export's time."""
    crc = checksum.crc32([tensors.header_bytes, *tensors.runs])
    total = sum(len(view) for view in tensors.runs)
    return _FRAME.pack(_END_FRAME, _END.size) + _END.pack(total, crc)


def end_frame_in_background(tensors: HostTensors) -> Callable[[], bytes]:
    """Start computing `end_frame` on its own thread; the returned call blocks until it is done
    (and raises what it raised). The thread only reads the tensors' host memory."""
    done: Future[bytes] = Future()

    def compute() -> None:
        try:
            done.set_result(end_frame(tensors))
        except BaseException as exc:  # handed to whoever waits for the frame
            done.set_exception(exc)

    threading.Thread(target=compute, name="kv-end-frame", daemon=True).start()
    return done.result


def frame_payload(tensors: HostTensors, *, chunk_bytes: int = 1 << 20) -> list[bytes]:
    """The payload's frames, each as one bytes object (header frame, data frames, end frame)."""
    return [*(b"".join(pieces) for pieces in _framed_pieces(tensors, chunk_bytes)), end_frame(tensors)]


EXPORT_FRAME_BYTES = 16 << 20


def unsealed_pieces(tensors: HostTensors, *,
                    chunk_bytes: int = EXPORT_FRAME_BYTES) -> list[bytes | memoryview]:
    """The payload but its end frame, as an ordered list of buffers: frame headers plus views of
    the tensors' own host memory (kept alive by the views). Sending these one after another
    skips the copies that framing and joining a body would make, and they can go out while
    `end_frame` is still computing the checksum."""
    return [piece for pieces in _framed_pieces(tensors, chunk_bytes) for piece in pieces]


def encoded_size(frames: Sequence[bytes]) -> int:
    """Bytes on the wire for these frames."""
    return sum(len(frame) for frame in frames)


def declared_tensor_bytes(payload: KvBytes) -> int | None:
    """The tensor bytes a payload's end frame declares, read from its last bytes alone (for
    figures, not validation: nothing else is checked); None when it does not end in an end frame."""
    if len(payload) < _PREAMBLE.size + END_FRAME_BYTES:
        return None
    kind, length = _FRAME.unpack_from(payload, len(payload) - END_FRAME_BYTES)
    if kind != _END_FRAME or length != _END.size:
        return None
    total, _crc = _END.unpack_from(payload, len(payload) - _END.size)
    return int(total)


# --------------------------------------------------------------------------- decode


def fail(code: Code, message: str) -> NoReturn:
    raise StatecoreError(peer_error(message, code))


@dataclass(frozen=True, slots=True)
class Framing:
    version: int
    header: memoryview
    data: list[tuple[int, int]]  # (start, stop) offsets of each data frame's payload
    data_bytes: int
    declared_total: int
    declared_crc: int


def split_frames(payload: memoryview) -> Framing:
    """Walk the framing: preamble, one header frame, data frames, one end frame, nothing after."""
    size = len(payload)
    if size < _PREAMBLE.size:
        if MAGIC.startswith(bytes(payload[: len(MAGIC)])):
            fail(Code.KV_TRUNCATED, f"payload ends inside the preamble ({size} bytes)")
        fail(Code.KV_MALFORMED, "not a statecore KV payload (bad magic)")
    magic, version = _PREAMBLE.unpack_from(payload, 0)
    if magic != MAGIC:
        fail(Code.KV_MALFORMED, "not a statecore KV payload (bad magic)")
    if version not in READ_VERSIONS:
        spoken = ", ".join(str(v) for v in READ_VERSIONS)
        fail(
            Code.KV_MALFORMED,
            f"unsupported KV format version {version} (this node reads versions {spoken})",
        )
    pos = _PREAMBLE.size
    header: memoryview | None = None
    data: list[tuple[int, int]] = []
    data_bytes = 0
    while True:
        if size - pos < _FRAME.size:
            where = "before the end frame" if header is not None else "before the header"
            fail(Code.KV_TRUNCATED, f"payload ends {where} (at byte {size})")
        kind, length = _FRAME.unpack_from(payload, pos)
        pos += _FRAME.size
        if header is None:
            if kind != _HEADER_FRAME:
                fail(Code.KV_MALFORMED, f"first frame must be the header, got {kind!r}")
            if length > MAX_HEADER_BYTES:
                fail(Code.KV_MALFORMED, f"header frame of {length} bytes exceeds the limit")
        elif kind == _END_FRAME:
            if length != _END.size:
                fail(Code.KV_MALFORMED, f"end frame must hold {_END.size} bytes, not {length}")
        elif kind != _DATA_FRAME:
            fail(Code.KV_MALFORMED, f"unexpected frame type {kind!r} at byte {pos - _FRAME.size}")
        if length > size - pos:
            fail(Code.KV_TRUNCATED, f"frame {kind!r} of {length} bytes runs past the payload end")
        if header is None:
            header = payload[pos : pos + length]
        elif kind == _END_FRAME:
            total, crc = _END.unpack_from(payload, pos)
            pos += length
            if pos != size:
                fail(Code.KV_MALFORMED, f"{size - pos} trailing bytes after the end frame")
            return Framing(version, header, data, data_bytes, total, crc)
        else:
            data.append((pos, pos + length))
            data_bytes += length
        pos += length


class Body:
    """Reads consecutive tensor byte ranges out of the data frames, copying only when a
    tensor straddles a frame boundary."""

    def __init__(self, payload: memoryview, segments: list[tuple[int, int]]) -> None:
        self._payload = payload
        self._segments = segments
        self._seg = 0
        self._pos = segments[0][0] if segments else 0

    def take(self, n: int) -> memoryview | bytes:
        pieces: list[memoryview] = []
        while n > 0:
            stop = self._segments[self._seg][1]
            step = min(n, stop - self._pos)
            pieces.append(self._payload[self._pos : self._pos + step])
            self._pos += step
            n -= step
            if self._pos == stop and self._seg + 1 < len(self._segments):
                self._seg += 1
                self._pos = self._segments[self._seg][0]
        if len(pieces) == 1:
            return pieces[0]
        return b"".join(pieces)


def check_node(node: Node, path: str, depth: int) -> int:
    """Validate a header node's internal consistency; returns its tensor byte count."""
    if depth > MAX_DEPTH:
        fail(Code.KV_MALFORMED, f"header state nests deeper than {MAX_DEPTH} at {path}")
    if isinstance(node, ArrayNode):
        expect = math.prod(node.shape) * DTYPE_BYTES[node.dtype]
        if node.nbytes != expect:
            fail(
                Code.KV_MALFORMED,
                f"{path}: {node.dtype}{node.shape} needs {expect} bytes, header says {node.nbytes}",
            )
        return expect
    if isinstance(node, ListNode | TupleNode):
        return sum(check_node(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(node.items))
    return 0


def check_heads(version: int, index: int, layer: LayerHeader) -> None:
    """A layer's head range: version 2 only, on a plain `KVCache` whose keys and values hold
    exactly that many heads (axis 1)."""
    heads = layer.heads
    assert heads is not None
    where = f"layer {index}: heads [{heads.start}, {heads.stop}) of {heads.total}"
    if version < FORMAT_VERSION:
        fail(Code.KV_MALFORMED, f"{where} in a version {version} payload (head ranges are version 2)")
    if layer.class_name != "KVCache":
        fail(Code.KV_MALFORMED, f"{where} on a {layer.class_name} (only KVCache layers are cut by heads)")
    if not heads.start < heads.stop <= heads.total:
        fail(Code.KV_MALFORMED, f"{where} is not a range of its heads")
    state = layer.state
    arrays = state.items[:2] if isinstance(state, TupleNode) else []
    if len(arrays) < 2 or not all(isinstance(a, ArrayNode) and len(a.shape) == 4 and
                                  a.shape[1] == heads.stop - heads.start for a in arrays):
        fail(Code.KV_MALFORMED, f"{where}: its keys and values do not hold that many heads")


__all__ = [
    "ALL_HEADS_VERSION",
    "ArrayNode",
    "Body",
    "DIM_BOUND",
    "DTYPE_BYTES",
    "DtypeName",
    "END_FRAME_BYTES",
    "EXPORT_FRAME_BYTES",
    "FORMAT_VERSION",
    "Framing",
    "HEADER_ADAPTER",
    "HeadRange",
    "Header",
    "HostTensors",
    "INT_BOUND",
    "IntNode",
    "LayerHeader",
    "ListNode",
    "MAGIC",
    "MAX_DEPTH",
    "MAX_FINGERPRINT",
    "MAX_HEADER_BYTES",
    "MAX_STR",
    "Node",
    "NoneNode",
    "READ_VERSIONS",
    "StrNode",
    "TupleNode",
    "check_heads",
    "check_node",
    "declared_tensor_bytes",
    "encoded_size",
    "end_frame",
    "end_frame_in_background",
    "fail",
    "frame_payload",
    "split_frames",
    "unsealed_pieces",
]
