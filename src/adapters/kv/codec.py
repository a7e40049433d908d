"""The KV wire format's codec: a prefilled prompt cache as bytes, and back, bit for bit.

A prefill node turns the per-layer cache objects of one prompt into `HostTensors` (the header
and the tensors' bytes in host memory, which `adapters.kv.frames` frames); a decode node
validates the whole payload before it builds any cache object. The codec is generic over
mlx-lm's cache classes: a layer travels as its class name plus its ``state`` (arrays, ints,
``None``, strings, nested lists/tuples), and is rebuilt with the class's own ``from_state``. The
one class-aware piece is `_live_view`, which cuts over-allocated buffers down to what the next
decode step reads (see its docstring). A payload may hold a contiguous range of each plain
`KVCache` layer's KV heads (version 2: a tensor-parallel instance's rank gets only its slice);
one that holds every head is written as version 1. This module imports mlx and mlx_lm; nothing
in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as cache_module
from pydantic import ValidationError

from adapters.kv import checksum
from adapters.kv.frames import (
    ALL_HEADS_VERSION,
    FORMAT_VERSION,
    HEADER_ADAPTER,
    INT_BOUND,
    MAX_DEPTH,
    MAX_FINGERPRINT,
    MAX_HEADER_BYTES,
    MAX_STR,
    ArrayNode,
    Body,
    Header,
    HeadRange,
    HostTensors,
    IntNode,
    LayerHeader,
    ListNode,
    Node,
    NoneNode,
    StrNode,
    TupleNode,
    check_heads,
    check_node,
    fail,
    frame_payload,
    split_frames,
)
from effects.engine_port import KvBytes, LayerTravel
from statecore.errors import Code, StatecoreError, bug, unsupported_cache

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


ListNode.model_rebuild()
TupleNode.model_rebuild()
HeadRange.model_rebuild()
LayerHeader.model_rebuild()
Header.model_rebuild()


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
    if depth > MAX_DEPTH:
        raise _NotPlain(f"state nests deeper than {MAX_DEPTH} at {path}")
    if isinstance(value, mx.array):
        name = _DTYPE_NAMES.get(value.dtype)
        if name is None:
            raise _NotPlain(f"state holds an array of dtype {value.dtype} at {path}")
        arrays.append(value)
        return _array_node(name, value.shape)
    if value is None:
        return {"kind": "none"}
    if isinstance(value, bool):  # before int: bool is an int subclass
        raise _NotPlain(f"state holds a bool at {path}")
    if isinstance(value, int):
        if not -INT_BOUND <= value < INT_BOUND:
            raise _NotPlain(f"state holds an int outside 64 bits at {path}")
        return {"kind": "int", "value": value}
    if isinstance(value, str):
        if len(value) > MAX_STR:
            raise _NotPlain(f"state holds a string longer than {MAX_STR} at {path}")
        return {"kind": "str", "value": value}
    if type(value) in (list, tuple):
        items = [_describe(v, arrays, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
        return {"kind": "list" if type(value) is list else "tuple", "items": items}
    raise _NotPlain(f"state holds a {type(value).__qualname__} at {path}")


def _array_node(dtype_name: str, shape: Sequence[int]) -> dict[str, Any]:
    """The header node of an array of this dtype (by its wire name) and shape."""
    dims = [int(d) for d in shape]
    return {"kind": "array", "dtype": dtype_name, "shape": dims,
            "nbytes": math.prod(dims) * _DTYPES[dtype_name][1].itemsize}


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
    return _host_runs(np.asarray(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array), wire)


def _host_runs(host: np.ndarray[Any, Any], wire: np.dtype[Any]) -> list[memoryview]:
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
    _check_encode_args(fingerprint, token_count, len(caches))
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

    mx.eval(*arrays)
    return HostTensors(_header_bytes(fingerprint, token_count, layers),
                       [run for array in arrays for run in _byte_runs(array)],
                       ALL_HEADS_VERSION if heads is None else FORMAT_VERSION)


def wire_view(array: Any) -> Any:
    """`array` with the bytes the wire carries (a bfloat16 array viewed as uint16: numpy has no
    bfloat16), to be evaluated with it on the device, so that reading it on the host evaluates
    nothing new (on a GPU a new array to evaluate waits for whatever the device runs now)."""
    return array.view(mx.uint16) if array.dtype == mx.bfloat16 else array


def kv_piece_tensors(arrays: Sequence[Any], *, dtype: Any, fingerprint: str,
                     token_count: int) -> HostTensors:
    """Plain `KVCache` layers of exactly `token_count` positions (keys then values of each, of
    `dtype`, as `wire_view` made them, evaluated with their step, or host copies of those) as
    `host_tensors` makes them of the same layers: the same header and bytes, read on the device
    thread as a streamed prefill hands its pieces out. It neither rebuilds each layer to check
    that it travels (a plain KVCache does) nor evaluates anything."""
    if len(arrays) % 2:
        raise StatecoreError(bug(f"a KV piece takes keys and values per layer, got {len(arrays)} arrays"))
    _check_encode_args(fingerprint, token_count, len(arrays) // 2)
    name = _DTYPE_NAMES[dtype]
    wire = _DTYPES[name][1]
    # computed with their step: nothing left to compute, this only waits for it
    mx.eval(*[array for array in arrays if isinstance(array, mx.array)])
    layers: list[dict[str, Any]] = []
    runs: list[memoryview] = []
    for index in range(0, len(arrays), 2):
        items: list[dict[str, Any]] = []
        for array in arrays[index : index + 2]:
            items.append(_array_node(name, array.shape))
            host = np.asarray(array)
            if host.dtype.itemsize != wire.itemsize:
                raise StatecoreError(bug(f"a KV piece's arrays are wire views of {name}, not {host.dtype}"))
            runs.extend(_host_runs(host.view(wire), wire))
        items.append({"kind": "int", "value": token_count})
        layers.append({"class_name": "KVCache", "state": {"kind": "tuple", "items": items}})
    return HostTensors(_header_bytes(fingerprint, token_count, layers), runs, ALL_HEADS_VERSION)


def _check_encode_args(fingerprint: str, token_count: int, layer_count: int) -> None:
    if not isinstance(fingerprint, str) or len(fingerprint) > MAX_FINGERPRINT:
        raise StatecoreError(bug(f"fingerprint must be a str of at most {MAX_FINGERPRINT}"))
    if isinstance(token_count, bool) or not 0 <= token_count < INT_BOUND:
        raise StatecoreError(bug(f"token_count must be a non-negative int, got {token_count!r}"))
    if not layer_count:
        raise StatecoreError(unsupported_cache(["<no cache layers>"]))


def _header_bytes(fingerprint: str, token_count: int, layers: list[dict[str, Any]]) -> bytes:
    header = {"fingerprint": fingerprint, "token_count": token_count, "layers": layers}
    header_bytes = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise StatecoreError(unsupported_cache([layer["class_name"] for layer in layers]))
    HEADER_ADAPTER.validate_json(header_bytes)  # the encoder obeys the decoder's schema
    return header_bytes
"""Data bytes per frame of an engine export: large, since the frames are never copied."""


def _build(node: Node, body: Body) -> Any:
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
    KV_WRONG_MODEL or UNSUPPORTED_CACHE. The checksum (`adapters.kv.checksum`, on several cores)
    is most of the time for a large payload, so a decode node runs this in a worker thread and keeps its
    device thread decoding meanwhile.
    """
    view = memoryview(payload).cast("B")
    if len(view) > max_bytes:
        fail(Code.KV_TOO_LARGE, f"KV payload of {len(view)} bytes exceeds {max_bytes}")
    framing = split_frames(view)
    if framing.data_bytes != framing.declared_total:
        short = framing.data_bytes < framing.declared_total
        fail(
            Code.KV_TRUNCATED if short else Code.KV_MALFORMED,
            f"data frames hold {framing.data_bytes} bytes, the end frame declares {framing.declared_total}",
        )
    crc = checksum.crc32([framing.header, *(view[start:stop] for start, stop in framing.data)])
    if crc != framing.declared_crc:
        fail(Code.KV_CHECKSUM, f"checksum mismatch: {crc:#010x} != {framing.declared_crc:#010x}")

    try:
        header = HEADER_ADAPTER.validate_json(bytes(framing.header))
    except (ValidationError, ValueError, RecursionError) as exc:
        fail(Code.KV_MALFORMED, f"invalid KV header: {exc}")
    if header.fingerprint != fingerprint:
        fail(
            Code.KV_WRONG_MODEL,
            f"KV payload is for model {header.fingerprint[:64]!r}, this node serves {fingerprint[:64]!r}",
        )
    names = tuple(layer.class_name for layer in header.layers)
    if expected_classes is not None and tuple(expected_classes) != names:
        if len(expected_classes) != len(names):
            detail = f"{len(names)} layers, expected {len(expected_classes)}"
        else:
            detail = f"classes {list(names)}, expected {list(expected_classes)}"
        fail(Code.KV_WRONG_MODEL, f"KV payload has {detail}")
    classes = [_resolve_class(name) for name in names]
    unknown = [name for name, cls in zip(names, classes, strict=True) if cls is None]
    if unknown:
        raise StatecoreError(unsupported_cache(unknown))
    needed = sum(check_node(layer.state, f"layer {i}", 0) for i, layer in enumerate(header.layers))
    if needed != framing.data_bytes:
        fail(
            Code.KV_MALFORMED,
            f"header describes {needed} tensor bytes, the body holds {framing.data_bytes}",
        )

    for i, layer in enumerate(header.layers):
        if layer.heads is not None:
            check_heads(framing.version, i, layer)

    return ValidatedKv(view, framing.data, header, [cls for cls in classes if cls is not None])


def build_caches(validated: ValidatedKv) -> DecodedKv:
    """The caches of a validated payload, as MLX arrays (on the thread that will use them).

    A state that its cache class does not accept, or that describes a cache which could not travel
    again, raises KV_MALFORMED; nothing half-built escapes.
    """
    header = validated.header
    names = tuple(layer.class_name for layer in header.layers)
    body = Body(validated.view, validated.data)
    built: list[Any] = []
    for i, (layer, cls) in enumerate(zip(header.layers, validated.classes, strict=True)):
        try:
            state = _build(layer.state, body)
            cache = cls.from_state(state)
            again = _describe(cache.state, [], "state", 0)
        except Exception as exc:
            fail(
                Code.KV_MALFORMED,
                f"layer {i}: {layer.class_name} cannot be rebuilt from the state sent: "
                f"{type(exc).__name__}: {exc}",
            )
        if again != layer.state.model_dump():
            fail(Code.KV_MALFORMED, f"layer {i}: {layer.class_name} did not accept its state")
        built.append(cache)
    # what is decoded must be a cache that travels: the state a class accepts may still describe
    # none (a KVCache whose offset lies past its arrays: no node could read or send it on)
    for refused in (travel for travel in travel_report(built) if not travel.can_travel):
        fail(Code.KV_MALFORMED, f"layer {refused.index}: {refused.reason}")
    mx.eval([a for c in built for a in _arrays_of(c)])
    return DecodedKv(caches=built, token_count=header.token_count, class_names=names,
                     heads=tuple(layer.heads for layer in header.layers))


def _arrays_of(cache: Any) -> list[Any]:
    arrays: list[Any] = []
    _describe(cache.state, arrays, "state", 0)
    return arrays


__all__ = [
    "DecodedKv",
    "ValidatedKv",
    "build_caches",
    "decode_cache",
    "encode_cache",
    "host_tensors",
    "kv_piece_tensors",
    "raw_tensor_bytes",
    "travel_report",
    "validate_payload",
    "wire_view",
]
