"""The KV wire format: a prefilled prompt cache as bytes, and back, bit for bit.

A prefill node encodes the per-layer cache objects of one prompt into frames (a small,
strictly validated JSON header, raw tensor-data chunks, an end frame with the total length
and a CRC-32); a decode node validates the whole payload before it builds any cache object.
The codec is generic over mlx-lm's cache classes: a layer travels as its class name plus its
``state`` (arrays, ints, ``None``, strings, nested lists/tuples), and is rebuilt with the
class's own ``from_state``. The one class-aware piece is `_live_view`, which cuts
over-allocated buffers down to what the next decode step reads (see its docstring).
A payload may hold a contiguous range of each plain `KVCache` layer's KV heads (version 2: a
tensor-parallel instance's rank gets only its slice); one that holds every head is written as
version 1, byte for byte as before. ``docs/wire-format.md`` documents the format byte by byte.
This is an adapter: it may import anything, and nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal, NoReturn, TypeAlias, Union

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as cache_module
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from effects.engine_port import KvBytes, LayerTravel
from statecore.errors import Code, StatecoreError, bug, peer_error, unsupported_cache

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

_MAX_HEADER_BYTES: Final = 4 << 20
_MAX_FRAME_BYTES: Final = (1 << 32) - 1
_MAX_DEPTH: Final = 16
_MAX_STR: Final = 256
_MAX_FINGERPRINT: Final = 1024
_INT_BOUND: Final = 1 << 63
_DIM_BOUND: Final = 1 << 31  # mlx shapes are int32
_CLASS_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


# --------------------------------------------------------------------------- dtypes

# wire name -> (mlx dtype, little-endian numpy dtype the bytes are moved as).
# numpy has no bfloat16: its bits travel as uint16 and are viewed back.
_DTYPES: Final[dict[str, tuple[Any, np.dtype[Any]]]] = {
    "bool": (mx.bool_, np.dtype("|b1")),
    "uint8": (mx.uint8, np.dtype("|u1")),
    "uint16": (mx.uint16, np.dtype("<u2")),
    "uint32": (mx.uint32, np.dtype("<u4")),
    "uint64": (mx.uint64, np.dtype("<u8")),
    "int8": (mx.int8, np.dtype("|i1")),
    "int16": (mx.int16, np.dtype("<i2")),
    "int32": (mx.int32, np.dtype("<i4")),
    "int64": (mx.int64, np.dtype("<i8")),
    "float16": (mx.float16, np.dtype("<f2")),
    "bfloat16": (mx.bfloat16, np.dtype("<u2")),
    "float32": (mx.float32, np.dtype("<f4")),
    "float64": (mx.float64, np.dtype("<f8")),
    "complex64": (mx.complex64, np.dtype("<c8")),
}
_DTYPE_NAMES: Final[dict[Any, str]] = {mxd: name for name, (mxd, _) in _DTYPES.items()}
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
    shape: Annotated[list[Annotated[int, Field(ge=0, lt=_DIM_BOUND)]], Field(max_length=16)]
    nbytes: Annotated[int, Field(ge=0, lt=_INT_BOUND)]


class IntNode(_Strict):
    kind: Literal["int"]
    value: Annotated[int, Field(ge=-_INT_BOUND, lt=_INT_BOUND)]


class NoneNode(_Strict):
    kind: Literal["none"]


class StrNode(_Strict):
    kind: Literal["str"]
    value: Annotated[str, Field(max_length=_MAX_STR)]


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

    start: Annotated[int, Field(ge=0, lt=_DIM_BOUND)]
    stop: Annotated[int, Field(ge=1, lt=_DIM_BOUND)]
    total: Annotated[int, Field(ge=1, lt=_DIM_BOUND)]


class LayerHeader(_Strict):
    class_name: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
    state: Node
    heads: HeadRange | None = None  # version 2 only; absent: every head


class Header(_Strict):
    fingerprint: Annotated[str, Field(max_length=_MAX_FINGERPRINT)]
    token_count: Annotated[int, Field(ge=0, lt=_INT_BOUND)]
    layers: Annotated[list[LayerHeader], Field(min_length=1, max_length=65536)]


ListNode.model_rebuild()
TupleNode.model_rebuild()
HeadRange.model_rebuild()
LayerHeader.model_rebuild()
Header.model_rebuild()
_HEADER_ADAPTER: Final = TypeAdapter(Header)


# --------------------------------------------------------------------------- public types


@dataclass(frozen=True, slots=True)
class DecodedKv:
    """A validated payload, rebuilt: one cache object per layer, ready for the decoder."""

    caches: list[Any]
    token_count: int
    class_names: tuple[str, ...]
    heads: tuple[HeadRange | None, ...]  # per layer; None: every head


# --------------------------------------------------------------------------- class resolution


def _resolve_class(name: str) -> type[Any] | None:
    """The mlx-lm cache class called `name`, or None: only classes defined in
    `mlx_lm.models.cache` (public names only) that have a `from_state` classmethod can be
    rebuilt by name."""
    if not _CLASS_NAME_RE.fullmatch(name) or name.startswith("_"):
        return None
    cls = getattr(cache_module, name, None)
    if not isinstance(cls, type) or cls.__module__ != cache_module.__name__:
        return None
    if not isinstance(inspect.getattr_static(cls, "from_state", None), classmethod):
        return None
    return cls


def _qualified(cls: type[Any]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# --------------------------------------------------------------------------- trimming to live


def _cut(x: Any, n: int) -> Any:
    """The first `n` positions of a [..., seq, dim] buffer."""
    return x[..., :n, :]


def _live_kv(c: Any) -> Any:
    keys, values, offset = c.state
    if keys is None or keys.shape[-2] == offset:
        return c
    return type(c).from_state((_cut(keys, offset), _cut(values, offset), offset))


def _live_quantized(c: Any) -> Any:
    keys, values, offset, group_size, bits = c.state
    if keys is None or keys[0].shape[-2] == offset:
        return c
    keys = type(keys)(_cut(x, offset) for x in keys)
    values = type(values)(_cut(x, offset) for x in values)
    return type(c).from_state((keys, values, offset, group_size, bits))


def _live_chunked(c: Any) -> Any:
    keys, values, offset, chunk_size, start = c.state
    live = offset - start
    if keys is None or keys.shape[-2] == live:
        return c
    return type(c).from_state((_cut(keys, live), _cut(values, live), offset, chunk_size, start))


def _live_rotating(c: Any) -> Any:
    keys, values, offset, keep, max_size, idx = c.state
    if keys is None:
        return c
    size = keys.shape[-2]
    if size > max_size and idx == size:
        # A multi-token update left the whole chunk in temporal order (size up to
        # max_size + S - 1). Both next-step paths (in place: trim to max_size, rotate to
        # `keep`; concat: keep the last max_size - 1) read only `keep` sink tokens and
        # the newest max_size - keep ones, so that is exactly what travels; idx = max_size
        # makes the rebuilt cache take the same path to the same buffer.
        drop = size - max_size

        def window(x: Any) -> Any:
            return mx.concatenate([x[..., :keep, :], x[..., keep + drop :, :]], axis=2)

        return type(c).from_state((window(keys), window(values), offset, keep, max_size, max_size))
    if idx == offset < size:
        # Never wrapped; the tail of the step-sized buffer is unwritten.
        return type(c).from_state((_cut(keys, offset), _cut(values, offset), offset, keep, max_size, idx))
    return c  # wrapped in place: exactly max_size slots, all live


def _live_list(c: Any) -> Any:
    members = [_live_view(m) for m in c.caches]
    if all(m is o for m, o in zip(members, c.caches, strict=True)):
        return c
    return type(c)(*members)


_LIVE_VIEWS: Final[dict[str, Callable[[Any], Any]]] = {
    "KVCache": _live_kv,
    "QuantizedKVCache": _live_quantized,
    "ChunkedKVCache": _live_chunked,
    "RotatingKVCache": _live_rotating,
    "CacheList": _live_list,
}


def _live_view(cache: Any) -> Any:
    """An equivalent cache object holding only what the next decode step reads.

    This is the one class-aware function of the codec, and it is unavoidable: mlx-lm
    0.32.2 has no "trim to live" API, and `state` returns the raw buffers (a `KVCache`
    after 33 tokens hands out a 256-slot buffer; a `RotatingKVCache` after a long prefill
    holds the whole prompt). Each entry rewrites the class's own `state` tuple and goes
    back through the class's own `from_state`, so the format itself never sees a class:
    the result travels through the generic state walk like any other cache. Classes not
    listed (and any future mlx-lm class) travel untrimmed: bigger, still exact. Keys are
    class names resolved in `mlx_lm.models.cache`; a model's own class of the same name is
    not matched (it cannot travel at all).
    """
    name = type(cache).__name__
    view = _LIVE_VIEWS.get(name)
    if view is None or _resolve_class(name) is not type(cache):
        return cache
    return view(cache)


# --------------------------------------------------------------------------- state <-> nodes


class _NotPlain(Exception):
    """A state leaf the wire cannot carry (internal; becomes a travel reason)."""


def _describe(value: Any, arrays: list[Any], path: str, depth: int) -> dict[str, Any]:
    """The header node for one state value; appends its arrays, depth-first, to `arrays`."""
    if depth > _MAX_DEPTH:
        raise _NotPlain(f"state nests deeper than {_MAX_DEPTH} at {path}")
    if isinstance(value, mx.array):
        name = _DTYPE_NAMES.get(value.dtype)
        if name is None:
            raise _NotPlain(f"state holds an array of dtype {value.dtype} at {path}")
        arrays.append(value)
        shape = [int(d) for d in value.shape]
        return {
            "kind": "array",
            "dtype": name,
            "shape": shape,
            "nbytes": math.prod(shape) * _DTYPES[name][1].itemsize,
        }
    if value is None:
        return {"kind": "none"}
    if isinstance(value, bool):  # before int: bool is an int subclass
        raise _NotPlain(f"state holds a bool at {path}")
    if isinstance(value, int):
        if not -_INT_BOUND <= value < _INT_BOUND:
            raise _NotPlain(f"state holds an int outside 64 bits at {path}")
        return {"kind": "int", "value": value}
    if isinstance(value, str):
        if len(value) > _MAX_STR:
            raise _NotPlain(f"state holds a string longer than {_MAX_STR} at {path}")
        return {"kind": "str", "value": value}
    if type(value) in (list, tuple):
        items = [_describe(v, arrays, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
        return {"kind": "list" if type(value) is list else "tuple", "items": items}
    raise _NotPlain(f"state holds a {type(value).__qualname__} at {path}")


def _plan(cache: Any) -> tuple[str, dict[str, Any], list[Any]]:
    """(class name, header node of the live state, the live arrays) for one travelable layer.

    Raises `_NotPlain` with a reason when the layer cannot travel. Besides checking the
    state's leaves, it rebuilds the class from that state (arrays are shared, nothing is
    copied) and requires the rebuilt object to report the same state: that catches, with no
    class knowledge, e.g. a `CacheList` holding a member class mlx-lm cannot rebuild by name.
    """
    cls = type(cache)
    name = cls.__name__
    if _resolve_class(name) is not cls:
        raise _NotPlain(
            f"cache class {_qualified(cls)} is not an mlx-lm cache class that can be rebuilt by name"
        )
    try:
        live = _live_view(cache)
        state = live.state
    except Exception as exc:
        raise _NotPlain(f"{name}: reading its state failed: {type(exc).__name__}: {exc}") from exc
    arrays: list[Any] = []
    node = _describe(state, arrays, "state", 0)
    try:
        rebuilt = cls.from_state(state)
        again = _describe(rebuilt.state, [], "state", 0)
    except _NotPlain:
        raise
    except Exception as exc:
        raise _NotPlain(f"{name}: rebuilding from its state failed: {type(exc).__name__}: {exc}") from exc
    if type(rebuilt) is not cls or again != node:
        raise _NotPlain(f"{name}: from_state does not reproduce its state")
    return name, node, arrays


def travel_report(caches: Sequence[Any]) -> tuple[LayerTravel, ...]:
    """Per layer: can this cache object be handed off, and if not, why not.

    Empty input gives an empty tuple, which callers must treat as *not* travelable.
    """
    report = []
    for index, cache in enumerate(caches):
        name = type(cache).__name__
        try:
            _plan(cache)
        except _NotPlain as exc:
            report.append(LayerTravel(index, name, False, str(exc)))
        else:
            report.append(LayerTravel(index, name, True))
    return tuple(report)


def raw_tensor_bytes(caches: Sequence[Any]) -> int:
    """Bytes of the live tensors (after trimming to live): the payload's floor."""
    total = 0
    for cache in caches:
        arrays: list[Any] = []
        _describe(_live_view(cache).state, arrays, "state", 0)
        total += sum(int(a.nbytes) for a in arrays)
    return total


# --------------------------------------------------------------------------- encode


_MIN_RUN_BYTES: Final = 4096


def _byte_runs(array: Any) -> list[memoryview]:
    """The array's bytes in C order, little-endian, as flat byte views of its own memory.

    Live views are usually strided (a [B, H, seq, D] buffer cut on the seq axis), but made
    of contiguous blocks (one per leading index): those blocks are handed out as they are,
    so the only copy of the tensor data is the one into the frames. Fragmented layouts
    (blocks under 4 KiB) are compacted first.
    """
    wire = _DTYPES[_DTYPE_NAMES[array.dtype]][1]
    host = np.asarray(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)
    if host.dtype != wire:  # big-endian hosts only
        host = host.astype(wire)
    if not host.flags.c_contiguous:
        lead = next(k for k in range(1, host.ndim + 1) if host[(0,) * k].flags.c_contiguous)
        if host[(0,) * lead].nbytes >= _MIN_RUN_BYTES:
            return [_flat(host[index]) for index in np.ndindex(*host.shape[:lead])]
        host = np.ascontiguousarray(host)
    return [_flat(host)]


def _flat(host: np.ndarray[Any, Any]) -> memoryview:
    flat: memoryview = host.reshape(-1).view(np.uint8).data
    return flat


@dataclass(frozen=True, slots=True)
class HostTensors:
    """A cache's header and its tensors' bytes in host memory: what `frame_payload` frames."""

    header_bytes: bytes
    runs: list[memoryview]
    version: int = ALL_HEADS_VERSION  # FORMAT_VERSION when the header names head ranges


def encode_cache(
    caches: Sequence[Any],
    *,
    fingerprint: str,
    token_count: int,
    chunk_bytes: int = 1 << 20,
    heads: tuple[int, int] | None = None,
) -> list[bytes]:
    """Encode per-layer caches as frames: header frame, data frames, end frame.

    `b"".join(frames)` is the payload (`host_tensors`, then `frame_payload`). Raises
    `StatecoreError` (UNSUPPORTED_CACHE) when a layer cannot travel, and a BUG-fault error for
    invalid arguments.
    """
    return frame_payload(host_tensors(caches, fingerprint=fingerprint, token_count=token_count,
                                      heads=heads),
                         chunk_bytes=chunk_bytes)


def _head_view(cache: Any, start: int, stop: int) -> tuple[Any, dict[str, int]]:
    """KV heads [start, stop) of a plain `KVCache`'s live tokens, as a `KVCache` over views of its
    buffers (nothing copied), and the range the header names."""
    if _resolve_class(type(cache).__name__) is not type(cache) or type(cache).__name__ != "KVCache":
        raise StatecoreError(unsupported_cache([f"{type(cache).__name__} (a head range needs KVCache)"]))
    if cache.keys is None:
        raise StatecoreError(unsupported_cache(["KVCache (empty: no heads to cut)"]))
    keys, values, offset = _live_view(cache).state
    total = int(keys.shape[1])
    if not 0 <= start < stop <= total:
        raise StatecoreError(bug(f"head range [{start}, {stop}) is not inside the {total} KV heads"))
    view = type(cache).from_state((keys[:, start:stop], values[:, start:stop], offset))
    return view, {"start": start, "stop": stop, "total": total}


def host_tensors(caches: Sequence[Any], *, fingerprint: str, token_count: int,
                 heads: tuple[int, int] | None = None) -> HostTensors:
    """The header and the live tensors' bytes in host memory (on the thread that owns the caches).

    `heads` (start, stop): only those KV heads of every layer travel, each layer's header naming
    the range (version 2; every layer must be a plain `KVCache`); None: every head (version 1).
    The returned views keep their arrays alive, so the caches may be dropped meanwhile.
    """
    if not isinstance(fingerprint, str) or len(fingerprint) > _MAX_FINGERPRINT:
        raise StatecoreError(bug(f"fingerprint must be a str of at most {_MAX_FINGERPRINT}"))
    if isinstance(token_count, bool) or not 0 <= token_count < _INT_BOUND:
        raise StatecoreError(bug(f"token_count must be a non-negative int, got {token_count!r}"))
    if not caches:
        raise StatecoreError(unsupported_cache(["<no cache layers>"]))

    layers: list[dict[str, Any]] = []
    arrays: list[Any] = []
    refused: list[str] = []
    for cache in caches:
        head_range: dict[str, int] | None = None
        if heads is not None:
            cache, head_range = _head_view(cache, *heads)
        try:
            name, node, layer_arrays = _plan(cache)
        except _NotPlain:
            refused.append(type(cache).__name__)
            continue
        layer: dict[str, Any] = {"class_name": name, "state": node}
        if head_range is not None:
            layer["heads"] = head_range
        layers.append(layer)
        arrays.extend(layer_arrays)
    if refused:
        raise StatecoreError(unsupported_cache(refused))

    header = {"fingerprint": fingerprint, "token_count": token_count, "layers": layers}
    header_bytes = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    if len(header_bytes) > _MAX_HEADER_BYTES:
        raise StatecoreError(unsupported_cache([layer["class_name"] for layer in layers]))
    _HEADER_ADAPTER.validate_json(header_bytes)  # the encoder obeys the decoder's schema

    mx.eval(*arrays)
    return HostTensors(header_bytes, [run for array in arrays for run in _byte_runs(array)],
                       ALL_HEADS_VERSION if heads is None else FORMAT_VERSION)


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
    Bytes only, no MLX, so safe off the device thread (zlib releases the GIL over large
    buffers); the checksum is most of an export's time."""
    crc = zlib.crc32(tensors.header_bytes)
    total = 0
    for view in tensors.runs:
        crc = zlib.crc32(view, crc)
        total += len(view)
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
"""Data bytes per frame of an engine export: large, since the frames are never copied."""


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


def _fail(code: Code, message: str) -> NoReturn:
    raise StatecoreError(peer_error(message, code))


@dataclass(frozen=True, slots=True)
class _Framing:
    version: int
    header: memoryview
    data: list[tuple[int, int]]  # (start, stop) offsets of each data frame's payload
    data_bytes: int
    declared_total: int
    declared_crc: int


def _split_frames(payload: memoryview) -> _Framing:
    """Walk the framing: preamble, one header frame, data frames, one end frame, nothing after."""
    size = len(payload)
    if size < _PREAMBLE.size:
        if MAGIC.startswith(bytes(payload[: len(MAGIC)])):
            _fail(Code.KV_TRUNCATED, f"payload ends inside the preamble ({size} bytes)")
        _fail(Code.KV_MALFORMED, "not a statecore KV payload (bad magic)")
    magic, version = _PREAMBLE.unpack_from(payload, 0)
    if magic != MAGIC:
        _fail(Code.KV_MALFORMED, "not a statecore KV payload (bad magic)")
    if version not in READ_VERSIONS:
        spoken = ", ".join(str(v) for v in READ_VERSIONS)
        _fail(
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
            _fail(Code.KV_TRUNCATED, f"payload ends {where} (at byte {size})")
        kind, length = _FRAME.unpack_from(payload, pos)
        pos += _FRAME.size
        if header is None:
            if kind != _HEADER_FRAME:
                _fail(Code.KV_MALFORMED, f"first frame must be the header, got {kind!r}")
            if length > _MAX_HEADER_BYTES:
                _fail(Code.KV_MALFORMED, f"header frame of {length} bytes exceeds the limit")
        elif kind == _END_FRAME:
            if length != _END.size:
                _fail(Code.KV_MALFORMED, f"end frame must hold {_END.size} bytes, not {length}")
        elif kind != _DATA_FRAME:
            _fail(Code.KV_MALFORMED, f"unexpected frame type {kind!r} at byte {pos - _FRAME.size}")
        if length > size - pos:
            _fail(Code.KV_TRUNCATED, f"frame {kind!r} of {length} bytes runs past the payload end")
        if header is None:
            header = payload[pos : pos + length]
        elif kind == _END_FRAME:
            total, crc = _END.unpack_from(payload, pos)
            pos += length
            if pos != size:
                _fail(Code.KV_MALFORMED, f"{size - pos} trailing bytes after the end frame")
            return _Framing(version, header, data, data_bytes, total, crc)
        else:
            data.append((pos, pos + length))
            data_bytes += length
        pos += length


class _Body:
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


def _check_node(node: Node, path: str, depth: int) -> int:
    """Validate a header node's internal consistency; returns its tensor byte count."""
    if depth > _MAX_DEPTH:
        _fail(Code.KV_MALFORMED, f"header state nests deeper than {_MAX_DEPTH} at {path}")
    if isinstance(node, ArrayNode):
        expect = math.prod(node.shape) * _DTYPES[node.dtype][1].itemsize
        if node.nbytes != expect:
            _fail(
                Code.KV_MALFORMED,
                f"{path}: {node.dtype}{node.shape} needs {expect} bytes, header says {node.nbytes}",
            )
        return expect
    if isinstance(node, ListNode | TupleNode):
        return sum(_check_node(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(node.items))
    return 0


def _build(node: Node, body: _Body) -> Any:
    """The state value for a validated node, reading its arrays from the body in order."""
    if isinstance(node, ArrayNode):
        mxd, wire = _DTYPES[node.dtype]
        host = np.frombuffer(body.take(node.nbytes), dtype=wire, count=math.prod(node.shape))
        if not host.flags.aligned:
            host = host.copy()
        array = mx.array(host.reshape(node.shape))
        return array.view(mxd) if node.dtype == "bfloat16" else array
    if isinstance(node, IntNode | StrNode):
        return node.value
    if isinstance(node, NoneNode):
        return None
    items = [_build(item, body) for item in node.items]
    return items if isinstance(node, ListNode) else tuple(items)


@dataclass(frozen=True, slots=True)
class ValidatedKv:
    """A payload that passed every check `validate_payload` makes; `build_caches` rebuilds it."""

    view: memoryview
    data: list[tuple[int, int]]
    header: Any
    classes: list[type[Any]]


def decode_cache(
    payload: KvBytes,
    *,
    fingerprint: str,
    expected_classes: Sequence[str] | None = None,
    max_bytes: int = 1 << 34,
) -> DecodedKv:
    """Validate a payload completely, then rebuild its caches (`validate_payload`, then
    `build_caches`)."""
    return build_caches(
        validate_payload(payload, fingerprint=fingerprint, expected_classes=expected_classes,
                         max_bytes=max_bytes)
    )


def validate_payload(
    payload: KvBytes,
    *,
    fingerprint: str,
    expected_classes: Sequence[str] | None = None,
    max_bytes: int = 1 << 34,
) -> ValidatedKv:
    """Every check on a payload that needs no MLX array: safe off the device thread.

    Validation order: size limit, magic, version, framing (truncation, frame types, trailing
    bytes), end-frame total, checksum, header schema, fingerprint, layer count and classes,
    per-tensor dtype/shape/byte counts against the body. Every failure raises
    `StatecoreError` with KV_TOO_LARGE, KV_MALFORMED, KV_TRUNCATED, KV_CHECKSUM,
    KV_WRONG_MODEL or UNSUPPORTED_CACHE. The checksum (zlib, which releases the GIL) is most of
    the time for a large payload, so a decode node runs this in a worker thread and keeps its
    device thread decoding meanwhile.
    """
    view = memoryview(payload).cast("B")
    if len(view) > max_bytes:
        _fail(Code.KV_TOO_LARGE, f"KV payload of {len(view)} bytes exceeds {max_bytes}")
    framing = _split_frames(view)
    if framing.data_bytes != framing.declared_total:
        short = framing.data_bytes < framing.declared_total
        _fail(
            Code.KV_TRUNCATED if short else Code.KV_MALFORMED,
            f"data frames hold {framing.data_bytes} bytes, the end frame declares {framing.declared_total}",
        )
    crc = zlib.crc32(framing.header)
    for start, stop in framing.data:
        crc = zlib.crc32(view[start:stop], crc)
    if crc != framing.declared_crc:
        _fail(Code.KV_CHECKSUM, f"checksum mismatch: {crc:#010x} != {framing.declared_crc:#010x}")

    try:
        header = _HEADER_ADAPTER.validate_json(bytes(framing.header))
    except (ValidationError, ValueError, RecursionError) as exc:
        _fail(Code.KV_MALFORMED, f"invalid KV header: {exc}")
    if header.fingerprint != fingerprint:
        _fail(
            Code.KV_WRONG_MODEL,
            f"KV payload is for model {header.fingerprint[:64]!r}, this node serves {fingerprint[:64]!r}",
        )
    names = tuple(layer.class_name for layer in header.layers)
    if expected_classes is not None and tuple(expected_classes) != names:
        if len(expected_classes) != len(names):
            detail = f"{len(names)} layers, expected {len(expected_classes)}"
        else:
            detail = f"classes {list(names)}, expected {list(expected_classes)}"
        _fail(Code.KV_WRONG_MODEL, f"KV payload has {detail}")
    classes = [_resolve_class(name) for name in names]
    unknown = [name for name, cls in zip(names, classes, strict=True) if cls is None]
    if unknown:
        raise StatecoreError(unsupported_cache(unknown))
    needed = sum(_check_node(layer.state, f"layer {i}", 0) for i, layer in enumerate(header.layers))
    if needed != framing.data_bytes:
        _fail(
            Code.KV_MALFORMED,
            f"header describes {needed} tensor bytes, the body holds {framing.data_bytes}",
        )

    for i, layer in enumerate(header.layers):
        if layer.heads is not None:
            _check_heads(framing.version, i, layer)

    return ValidatedKv(view, framing.data, header, [cls for cls in classes if cls is not None])


def _check_heads(version: int, index: int, layer: LayerHeader) -> None:
    """A layer's head range: version 2 only, on a plain `KVCache` whose keys and values hold
    exactly that many heads (axis 1)."""
    heads = layer.heads
    assert heads is not None
    where = f"layer {index}: heads [{heads.start}, {heads.stop}) of {heads.total}"
    if version < FORMAT_VERSION:
        _fail(Code.KV_MALFORMED, f"{where} in a version {version} payload (head ranges are version 2)")
    if layer.class_name != "KVCache":
        _fail(Code.KV_MALFORMED, f"{where} on a {layer.class_name} (only KVCache layers are cut by heads)")
    if not heads.start < heads.stop <= heads.total:
        _fail(Code.KV_MALFORMED, f"{where} is not a range of its heads")
    state = layer.state
    arrays = state.items[:2] if isinstance(state, TupleNode) else []
    if len(arrays) < 2 or not all(isinstance(a, ArrayNode) and len(a.shape) == 4 and
                                  a.shape[1] == heads.stop - heads.start for a in arrays):
        _fail(Code.KV_MALFORMED, f"{where}: its keys and values do not hold that many heads")


def build_caches(validated: ValidatedKv) -> DecodedKv:
    """The caches of a validated payload, as MLX arrays (on the thread that will use them).

    A state that its cache class does not accept raises KV_MALFORMED; nothing half-built escapes.
    """
    header = validated.header
    names = tuple(layer.class_name for layer in header.layers)
    body = _Body(validated.view, validated.data)
    built: list[Any] = []
    for i, (layer, cls) in enumerate(zip(header.layers, validated.classes, strict=True)):
        try:
            state = _build(layer.state, body)
            cache = cls.from_state(state)
            again = _describe(cache.state, [], "state", 0)
        except Exception as exc:
            _fail(
                Code.KV_MALFORMED,
                f"layer {i}: {layer.class_name} cannot be rebuilt from the state sent: "
                f"{type(exc).__name__}: {exc}",
            )
        if again != layer.state.model_dump():
            _fail(Code.KV_MALFORMED, f"layer {i}: {layer.class_name} did not accept its state")
        built.append(cache)
    mx.eval([a for c in built for a in _arrays_of(c)])
    return DecodedKv(caches=built, token_count=header.token_count, class_names=names,
                     heads=tuple(layer.heads for layer in header.layers))


def _arrays_of(cache: Any) -> list[Any]:
    arrays: list[Any] = []
    _describe(cache.state, arrays, "state", 0)
    return arrays


__all__ = [
    "ALL_HEADS_VERSION",
    "FORMAT_VERSION",
    "MAGIC",
    "READ_VERSIONS",
    "DecodedKv",
    "HeadRange",
    "HostTensors",
    "ValidatedKv",
    "build_caches",
    "decode_cache",
    "declared_tensor_bytes",
    "encode_cache",
    "encoded_size",
    "END_FRAME_BYTES",
    "end_frame",
    "end_frame_in_background",
    "frame_payload",
    "unsealed_pieces",
    "host_tensors",
    "raw_tensor_bytes",
    "travel_report",
    "validate_payload",
]
