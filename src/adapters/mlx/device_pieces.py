"""A streamed handoff's pieces that never leave the GPU: CUDA IPC between engine nodes on one host.

Between two nodes on one host whose engines both run on MLX's CUDA backend, a streamed prefill's
piece need not cross the host at all (on an H100 the host's page faults, checksums and copies of a
2,000-token prompt's 62 MiB took tens of milliseconds on each side; a copy between device buffers
takes a fraction of one). The prefill side (`DeviceArena`, on its device thread as the step's
pieces are handed out) copies each piece's arrays, device to device, into a region of one buffer
of its own that CUDA lets other processes open (`cudaIpcGetMemHandle`), held under the request
until its cache is released or cancelled; what travels instead of the KV bytes is a *device piece
document*: `MAGIC`, then a JSON object naming the buffer (its IPC handle), the region, the arrays'
shapes and dtype, the model's fingerprint and the token count. The decode side parses and checks
the document (`parse`, in a worker thread: framing, version, fingerprint, shapes against the
range), then on its device thread (`take`) reads the region into arrays of its own by a kernel
computed with its next step (`adapters.mlx.device_read`; nothing waited for there), settled before
the request's install is answered, and builds the piece's caches. A device piece carries no
checksum: it never crosses a wire, only one GPU's memory (or NVLink between two). Whoever cannot
read GPU memory refuses the document, typed (`KV_MALFORMED`); a sender whose buffer is full, or
whose CUDA call fails, sends that piece the host's way instead. `STATECORE_KV_DEVICE` (`auto`, the
default, or `off`) and `STATECORE_KV_DEVICE_BYTES` (the buffer, 1 GiB by default) are the operator's
knobs.
This module imports ctypes, numpy and mlx; never trio or httpx.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import struct
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from adapters.mlx import managed_memory
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError

__all__ = ["DEVICE_ENV", "MAGIC", "DeviceArena", "DevicePiece", "Regions", "arena", "dtype_name", "enabled",
           "encode", "is_device_piece", "landed_arrays", "parse", "region_bytes", "release_held_pieces",
           "take"]

logger = logging.getLogger("adapters.engine_mlx")

DEVICE_ENV: Final = "STATECORE_KV_DEVICE"
DEVICE_BYTES_ENV: Final = "STATECORE_KV_DEVICE_BYTES"
# the version is the magic's last byte: another one is refused (KV wire bytes start "\x89SCKV")
MAGIC: Final = b"SCKVDEV1"
_LENGTH = struct.Struct("<I")
_MAX_DOCUMENT: Final = 1 << 20
_ALIGN: Final = 512
_IPC_HANDLE_BYTES: Final = 64
_LAZY_PEER_ACCESS: Final = 1  # cudaIpcMemLazyEnablePeerAccess: the region may be on another GPU
_DTYPES: Final = ("bfloat16", "float16", "float32")  # what a piece's KV may be


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _IPC_HANDLE_BYTES)]


@dataclass(frozen=True, slots=True)
class DevicePiece:
    """A device piece document, parsed and checked: where its bytes lie and what they are."""

    arena: str  # the sending buffer's id (a receiver opens each buffer once)
    handle: bytes  # its CUDA IPC handle
    offset: int  # the region's start in the buffer
    fingerprint: str
    token_count: int
    dtype: str
    shapes: tuple[tuple[int, ...], ...]  # keys then values of each layer

    def nbytes(self) -> list[int]:
        item = 4 if self.dtype == "float32" else 2
        sizes = []
        for shape in self.shapes:
            size = item
            for dim in shape:
                size *= dim
            sizes.append(size)
        return sizes


def _malformed(message: str) -> StatecoreError:
    return StatecoreError(ErrorInfo(Fault.PEER, Code.KV_MALFORMED, message))


def _aligned(size: int) -> int:
    return (size + _ALIGN - 1) // _ALIGN * _ALIGN


def dtype_name(dtype: Any) -> str | None:
    """An MLX dtype as a document names it, or None for one a device piece cannot carry."""
    name = str(dtype).rsplit(".", 1)[-1]
    return name if name in _DTYPES else None


def is_device_piece(payload: Any) -> bool:
    """Whether a payload is a device piece document (any version) rather than KV wire bytes."""
    return bytes(memoryview(payload)[: len(MAGIC) - 1]) == MAGIC[:-1]


def encode(piece: DevicePiece) -> bytes:
    document = json.dumps({
        "arena": piece.arena, "handle": piece.handle.hex(), "offset": piece.offset,
        "fingerprint": piece.fingerprint, "token_count": piece.token_count, "dtype": piece.dtype,
        "shapes": [list(shape) for shape in piece.shapes],
    }, separators=(",", ":")).encode()
    return MAGIC + _LENGTH.pack(len(document)) + document


def parse(payload: Any, *, fingerprint: str, token_count: int, layers: int) -> DevicePiece:
    """A device piece document for `layers` layers of `token_count` positions of this model,
    checked; `KV_MALFORMED` (or `KV_WRONG_MODEL`) otherwise. Reads no GPU memory."""
    view = memoryview(payload).cast("B")
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise _malformed(f"unsupported device piece version {bytes(view[: len(MAGIC)])!r} "
                         f"(this node reads {MAGIC!r})")
    if len(view) < len(MAGIC) + _LENGTH.size:
        raise _malformed("a device piece document cut short")
    (length,) = _LENGTH.unpack_from(view, len(MAGIC))
    body = view[len(MAGIC) + _LENGTH.size :]
    if length > _MAX_DOCUMENT or length != len(body):
        raise _malformed(f"a device piece document of {len(body)} bytes says {length}")
    try:
        document = json.loads(bytes(body))
        piece = DevicePiece(
            arena=str(document["arena"]), handle=bytes.fromhex(document["handle"]),
            offset=int(document["offset"]), fingerprint=str(document["fingerprint"]),
            token_count=int(document["token_count"]), dtype=str(document["dtype"]),
            shapes=tuple(tuple(int(dim) for dim in shape) for shape in document["shapes"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise _malformed(f"a malformed device piece document: {exc!r}") from exc
    if piece.fingerprint != fingerprint:
        raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_WRONG_MODEL,
                                       "a device piece of another model or configuration (its fingerprint)"))
    if len(piece.handle) != _IPC_HANDLE_BYTES or piece.offset < 0 or piece.dtype not in _DTYPES:
        raise _malformed("a device piece document names no valid region or dtype")
    if piece.token_count != token_count or len(piece.shapes) != 2 * layers:
        raise _malformed(f"a device piece holds {len(piece.shapes) // 2} layers of {piece.token_count} "
                         f"tokens, not {layers} of {token_count}")
    if any(len(shape) != 4 or shape[0] != 1 or shape[2] != token_count or min(shape) < 1
           for shape in piece.shapes):
        raise _malformed("a device piece's arrays are not (1, heads, tokens, dims) of its tokens")
    return piece


class _Runtime(managed_memory.CudaCopies):
    """The CUDA runtime calls both sides make (one process-wide instance; see `_runtime`): the
    copies `managed_memory` makes, and the buffers other processes opened here."""

    def __init__(self, library: ctypes.CDLL) -> None:
        super().__init__(library)
        self.opened: dict[str, int] = {}  # arena id -> its buffer's address here
        self.lock = threading.Lock()

    def open(self, arena_id: str, handle: bytes) -> int:
        with self.lock:
            if arena_id not in self.opened:
                pointer = ctypes.c_void_p(0)
                ipc = _IpcHandle.from_buffer_copy(handle)
                opened = self.library.cudaIpcOpenMemHandle(ctypes.byref(pointer), ipc,
                                                           ctypes.c_uint(_LAZY_PEER_ACCESS))
                self.check(opened, "cudaIpcOpenMemHandle")
                self.opened[arena_id] = int(pointer.value or 0)
                logger.info("reading streamed KV pieces from another process's GPU memory (buffer %s)",
                            arena_id[:8])
            return self.opened[arena_id]


_lock = threading.Lock()
_probed = False
_cuda: _Runtime | None = None


def _runtime() -> _Runtime | None:
    global _probed, _cuda
    with _lock:
        if not _probed:
            _probed = True
            if os.environ.get(DEVICE_ENV, "auto") != "off":
                library = managed_memory.cuda_runtime()
                _cuda = None if library is None else _Runtime(library)
        return _cuda


def enabled() -> bool:
    """Whether this process's engine can send and take device pieces (MLX on CUDA, the runtime
    loaded, not turned off)."""
    return _runtime() is not None


class Regions:
    """The bookkeeping of one buffer's regions: reserved first fit, held per holder, merged with
    their neighbours when freed."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, bytes), by offset
        self._held: dict[str, list[tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def reserve(self, holder: str, nbytes: int) -> int | None:
        """A region of `nbytes` held under `holder`: its offset, or None when none is free."""
        with self._lock:
            for index, (offset, size) in enumerate(self._free):
                if size >= nbytes:
                    rest = (offset + nbytes, size - nbytes)
                    self._free[index : index + 1] = [rest] if rest[1] else []
                    self._held.setdefault(holder, []).append((offset, nbytes))
                    return offset
        return None

    def give_back(self, holder: str, offset: int) -> None:
        """One region of `holder`'s free again."""
        with self._lock:
            regions = self._held.get(holder, [])
            for region in [region for region in regions if region[0] == offset]:
                regions.remove(region)
                self._free_region(region)

    def release(self, holder: str) -> None:
        """Every region held under `holder` free again."""
        with self._lock:
            for region in self._held.pop(holder, []):
                self._free_region(region)

    def _free_region(self, region: tuple[int, int]) -> None:
        merged: list[tuple[int, int]] = []
        for offset, size in sorted([*self._free, region]):
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((offset, size))
        self._free = merged

    def held_bytes(self) -> int:
        with self._lock:
            return sum(size for regions in self._held.values() for _, size in regions)

    def free_runs(self) -> list[tuple[int, int]]:
        """The free (offset, bytes) runs, by offset."""
        with self._lock:
            return list(self._free)


class DeviceArena:
    """The sending side: one IPC-shareable device buffer, cut into regions held per request."""

    def __init__(self, runtime: _Runtime, size: int) -> None:
        self._runtime = runtime
        self.regions = Regions(size)
        self.id = uuid.uuid4().hex
        self._base = 0
        self._handle = b""
        self._failed = False  # the buffer could not be made: every piece goes through the host

    def _allocate(self) -> None:
        library = self._runtime.library
        pointer = ctypes.c_void_p(0)
        size = self.regions.size
        self._runtime.check(library.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(size)), "cudaMalloc")
        handle = _IpcHandle()
        self._runtime.check(library.cudaIpcGetMemHandle(ctypes.byref(handle), pointer), "cudaIpcGetMemHandle")
        # every byte of it (the field's value would end at its first zero byte)
        self._base, self._handle = int(pointer.value or 0), ctypes.string_at(ctypes.addressof(handle),
                                                                              _IPC_HANDLE_BYTES)
        logger.info("streamed KV pieces go device to device: a %d MiB buffer other processes open",
                    size >> 20)

    def put(self, holder: str, arrays: Sequence[Any], *, dtype: str, fingerprint: str,
            token_count: int) -> bytes | None:
        """On the device thread: `arrays` (evaluated, contiguous: keys then values per layer)
        copied into a region held under `holder`; their document, or None when they cannot go
        so (no room, a CUDA error: the caller sends them the host's way)."""
        sizes = [int(array.nbytes) for array in arrays]
        if self._failed:
            return None
        if not self._base:
            try:
                self._allocate()
            except OSError as exc:
                self._failed = True
                logger.warning("no GPU buffer for streamed KV pieces (%s): they go through the host", exc)
                return None
        try:
            offset = self.regions.reserve(holder, region_bytes(sizes))
            if offset is None:
                return None
            sources = managed_memory.spans(arrays)
            if [size for _, size in sources] != sizes:  # an array that is not contiguous
                self.regions.give_back(holder, offset)
                return None
            pairs, at = [], self._base + offset
            for source, size in sources:
                pairs.append((at, source, size))
                at += _aligned(size)
            self._runtime.copy(pairs)
        except OSError as exc:
            logger.warning("a KV piece could not go device to device (%s): it goes through the host", exc)
            return None
        return encode(DevicePiece(self.id, self._handle, offset, fingerprint, token_count, dtype,
                                  tuple(tuple(int(dim) for dim in array.shape) for array in arrays)))


_arena: DeviceArena | None = None


def arena() -> DeviceArena | None:
    """This process's sending buffer (allocated at its first piece), or None where device pieces
    cannot be sent."""
    global _arena
    runtime = _runtime()
    if runtime is None:
        return None
    with _lock:
        if _arena is None:
            _arena = DeviceArena(runtime, int(os.environ.get(DEVICE_BYTES_ENV, str(1 << 30))))
        return _arena


def release_held_pieces(holder: str) -> None:
    """The regions this process's pieces of `holder` hold are free again (nothing when it sent none)."""
    if _arena is not None:
        _arena.regions.release(holder)


def take(piece: DevicePiece) -> tuple[list[Any], Any | None]:
    """On the receiving device thread: the piece's arrays (keys then values per layer), views of
    one array a kernel reads from the sender's region (`adapters.mlx.device_read`: unevaluated,
    computed with the next step; returned second, for the engine to settle before the install
    is answered), or where that kernel is not usable allocated here and copied by the runtime,
    waited for (second None)."""
    from adapters.mlx import device_read

    runtime = _runtime()
    if runtime is None:
        raise _malformed("a KV piece in another process's GPU memory, and this node reads none")
    sizes = piece.nbytes()
    try:
        at = runtime.open(piece.arena, piece.handle) + piece.offset
        if device_read.usable():
            landing = device_read.read(at, region_bytes(sizes))
            return landed_arrays(landing, piece), landing
        return _copied(runtime, piece, at, sizes), None
    except OSError as exc:  # the sender's buffer gone (its process ended), or unreachable from here
        raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_SHM_GONE,
                                       f"a KV piece in GPU memory could not be read: {exc}")) from exc


def region_bytes(sizes: Sequence[int]) -> int:
    """What a piece of arrays of `sizes` bytes takes of the buffer (each array aligned)."""
    return sum(_aligned(size) for size in sizes)


def landed_arrays(landing: Any, piece: DevicePiece) -> list[Any]:
    """The piece's arrays as views of `landing`, its region's bytes (flat uint8) as `put` laid
    them out: each array's bytes in turn, each aligned."""
    import mlx.core as mx

    dtype = getattr(mx, piece.dtype)
    arrays, offset = [], 0
    for shape, size in zip(piece.shapes, piece.nbytes(), strict=True):
        item = size // math.prod(shape)
        raw = landing[offset : offset + size].reshape(*shape[:-1], shape[-1] * item)
        arrays.append(raw.view(dtype))
        offset += _aligned(size)
    return arrays


def _copied(runtime: _Runtime, piece: DevicePiece, at: int, sizes: list[int]) -> list[Any]:
    """The piece's arrays allocated here and copied from `at` by the runtime, waited for."""
    import mlx.core as mx

    # bfloat16 lands as uint16 (its buffer is read through numpy, which has no bfloat16), then
    # is viewed back: the same bytes
    landing = mx.uint16 if piece.dtype == "bfloat16" else getattr(mx, piece.dtype)
    arrays = [mx.zeros(shape, dtype=landing) for shape in piece.shapes]
    mx.eval(*arrays)
    targets = managed_memory.spans(arrays)
    if len(targets) != len(arrays):
        raise StatecoreError(ErrorInfo(Fault.BUG, Code.INTERNAL,
                                       "a device piece's arrays are not contiguous"))
    pairs = []
    for (target, size), expected in zip(targets, sizes, strict=True):
        if size != expected:
            raise _malformed("a device piece's arrays are not the size its shapes say")
        pairs.append((target, at, size))
        at += _aligned(size)
    runtime.copy(pairs)
    return [array.view(mx.bfloat16) for array in arrays] if piece.dtype == "bfloat16" else arrays
