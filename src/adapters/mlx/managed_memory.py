"""Moving a KV piece's memory between the GPU and the host in bulk, on MLX's CUDA backend.

MLX's CUDA backend allocates every array as CUDA managed memory, which the driver moves page by
page on first touch: the host reading KV that the GPU computed (a prefill node copying a piece
into shared memory, or checksumming it), and the GPU reading an array the host built (a decode
node writing a piece into its slot), each wait on faults that move a few KiB at a time, and the
faults the host takes on pages the GPU holds hold up the kernels running meanwhile. With
`STATECORE_CUDA_PREFETCH` (environment, every engine node):
- `arriving`, the default: `to_device` asks the CUDA runtime to move arriving KV's pages to the
  GPU in bulk (`cudaMemPrefetchAsync`), in the worker thread that built it: on an H100 it halved
  the stall an 8,000-token handoff causes 16 decoding streams (docs/performance.md); KV leaving
  is read by faults;
- `on`: `to_host` moves leaving KV's pages to the host in bulk too, on the prefill node's device
  thread as a step's pieces are handed out (a long prompt's later steps wait for it: its TTFT
  rose);
- `copy`: KV leaving the GPU is copied out by the copy engine instead (`host_copies`:
  `cudaMemcpyAsync` into host memory of its own, pageable: slower than the faults there), and
  arriving KV moves as with `arriving`;
- `off`: nothing here moves anything (the pages move by faults).
Each on a stream of the calling thread's own, so that waiting for it never waits for the model's
kernels. Only where MLX runs on CUDA and the runtime loads; elsewhere nothing moves. A runtime
error turns the moves off for the process (logged once): pages then move by faults, as before,
and nothing else changes (the bytes are the same either way). This module imports ctypes, numpy
and mlx; never trio.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any, Final

__all__ = ["PREFETCH_ENV", "CudaCopies", "cuda_runtime", "enabled", "host_copies", "spans", "to_device",
           "to_host"]

logger = logging.getLogger("adapters.engine_mlx")

PREFETCH_ENV: Final = "STATECORE_CUDA_PREFETCH"
_NON_BLOCKING: Final = 1  # cudaStreamNonBlocking
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2  # cudaMemLocationType (CUDA 12.2 and later)
_CPU_DEVICE_ID: Final = -1  # cudaCpuDeviceId (the CUDA 12 signature)
_COPY_DEFAULT: Final = 4  # cudaMemcpyDefault: the direction from the (unified) addresses
_MODES: Final = ("off", "arriving", "on", "copy")


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CudaCopies:
    """The CUDA runtime's copies (`copy`: device to host, host to device or device to device, the
    direction from the unified addresses) on a stream of the calling thread's own, waited for:
    what this module's moves and `adapters.mlx.device_pieces` share."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
        self.streams = threading.local()

    def stream(self) -> ctypes.c_void_p:
        stream: ctypes.c_void_p | None = getattr(self.streams, "stream", None)
        if stream is None:
            stream = ctypes.c_void_p(0)
            flags = ctypes.c_uint(_NON_BLOCKING)
            self.check(self.library.cudaStreamCreateWithFlags(ctypes.byref(stream), flags),
                       "cudaStreamCreateWithFlags")
            self.streams.stream = stream
        return stream

    def copy(self, pairs: Sequence[tuple[int, int, int]]) -> None:
        """(destination, source, bytes) each, on the copy engine, and wait."""
        stream = self.stream()
        for target, source, size in pairs:
            code = self.library.cudaMemcpyAsync(ctypes.c_void_p(target), ctypes.c_void_p(source),
                                                ctypes.c_size_t(size), ctypes.c_int(_COPY_DEFAULT), stream)
            self.check(code, "cudaMemcpyAsync")
        self.check(self.library.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def check(self, code: int, call: str) -> None:
        if code != 0:
            raise OSError(f"{call} answered CUDA error {code}")


class _Runtime(CudaCopies):
    """The CUDA runtime's prefetch, or None where it cannot be used (see the module's paragraph)."""

    def __init__(self, library: ctypes.CDLL, version: int, device: int, mode: str) -> None:
        super().__init__(library)
        self.mode = mode
        self.version = version
        self.device = device
        self.failed = False

    def prefetch(self, spans: Sequence[tuple[int, int]], *, to_device: bool) -> None:
        stream = self.stream()
        for pointer, size in spans:
            span = (ctypes.c_void_p(pointer), ctypes.c_size_t(size))
            if self.version >= 13000:
                where = (_Location(_LOCATION_DEVICE, self.device) if to_device
                         else _Location(_LOCATION_HOST, 0))
                code = self.library.cudaMemPrefetchAsync(*span, where, ctypes.c_uint(0), stream)
            else:
                target = self.device if to_device else _CPU_DEVICE_ID
                code = self.library.cudaMemPrefetchAsync(*span, ctypes.c_int(target), stream)
            self.check(code, "cudaMemPrefetchAsync")
        self.check(self.library.cudaStreamSynchronize(stream), "cudaStreamSynchronize")


_lock = threading.Lock()
_runtime: _Runtime | None = None
_probed = False


def cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library MLX runs on here, loaded, or None where MLX does not run on CUDA
    (or no runtime library answers)."""
    import mlx.core as mx

    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        return None
    names = ["libcudart.so.13", "libcudart.so.12", ctypes.util.find_library("cudart") or ""]
    for site in sys.path:
        names += sorted(glob.glob(os.path.join(site, "nvidia", "**", "libcudart.so*"), recursive=True))
    for name in filter(None, names):
        try:
            library = ctypes.CDLL(name)
        except OSError:
            continue
        version, device = ctypes.c_int(0), ctypes.c_int(0)
        if library.cudaRuntimeGetVersion(ctypes.byref(version)):
            continue
        if library.cudaGetDevice(ctypes.byref(device)):
            continue
        return library
    return None


def _load() -> _Runtime | None:
    mode = os.environ.get(PREFETCH_ENV, "arriving")
    if mode not in _MODES:
        logger.warning("%s=%s is none of %s: off", PREFETCH_ENV, mode, "|".join(_MODES))
    if mode not in _MODES[1:]:
        return None
    import mlx.core as mx

    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        return None  # not on CUDA: no page moves between a GPU and the host
    library = cuda_runtime()
    if library is None:
        logger.info("no CUDA runtime library loads: KV pieces move between the GPU and the host by faults")
        return None
    version, device = ctypes.c_int(0), ctypes.c_int(0)
    library.cudaRuntimeGetVersion(ctypes.byref(version))
    library.cudaGetDevice(ctypes.byref(device))
    logger.info("KV pieces move between the GPU and the host in bulk (%s: %s; CUDA runtime %d)",
                PREFETCH_ENV, mode, version.value)
    return _Runtime(library, version.value, device.value, mode)


def _get() -> _Runtime | None:
    global _runtime, _probed
    with _lock:
        if not _probed:
            _probed = True
            _runtime = _load()
        return None if _runtime is None or _runtime.failed else _runtime


def enabled() -> bool:
    """Whether `to_host` and `to_device` move anything here."""
    return _get() is not None


def spans(buffers: Sequence[Any]) -> list[tuple[int, int]]:
    """What a move of `buffers` (evaluated arrays, or host byte runs of them) moves: each
    contiguous one's (address, bytes), read through its buffer (no MLX op: a worker thread builds
    and evaluates nothing); others are left to faults."""
    import numpy as np

    found = []
    for buffer in buffers:
        view = memoryview(buffer)
        if view.c_contiguous and view.nbytes:
            found.append((int(np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data), view.nbytes))
    return found


def _move(buffers: Sequence[Any], *, to_device: bool) -> None:
    runtime = _get()
    if runtime is None or not buffers:
        return
    try:
        runtime.prefetch(spans(buffers), to_device=to_device)
    except OSError as exc:
        runtime.failed = True
        logger.warning("moving KV memory in bulk failed (%s): pages move by faults from now on", exc)


def to_host(buffers: Sequence[Any]) -> None:
    """Move evaluated arrays the GPU computed (or host byte runs of them, as
    `frames.HostTensors.runs`) into host memory, and wait: the host reads them next. (With
    `copy`, nothing: `host_copies` reads them.)"""
    runtime = _get()
    if runtime is not None and runtime.mode == "on":
        _move(buffers, to_device=False)


def host_copies(buffers: Sequence[Any]) -> list[Any]:
    """With `copy`: arrays the GPU computed (waited for here; or host byte runs of them) as numpy
    arrays of their own host memory (the same shape, dtype and bytes), copied by the copy engine;
    otherwise, or for a buffer that is not contiguous, the buffers themselves (the host then reads
    them where they are, by faults on a GPU)."""
    runtime = _get()
    if runtime is None or runtime.mode != "copy" or not buffers:
        return list(buffers)
    import mlx.core as mx
    import numpy as np

    mx.eval(*[buffer for buffer in buffers if isinstance(buffer, mx.array)])  # computed: only waits

    copies: list[Any] = list(buffers)
    pairs = []
    for index, buffer in enumerate(buffers):
        view = np.asarray(buffer)  # the buffer's own memory (evaluated: nothing computed here)
        if view.flags.c_contiguous and view.nbytes:
            copies[index] = np.empty_like(view)
            pairs.append((int(copies[index].ctypes.data), int(view.ctypes.data), view.nbytes))
    try:
        runtime.copy(pairs)
    except OSError as exc:
        runtime.failed = True
        logger.warning("copying KV out of the GPU failed (%s): pages move by faults from now on", exc)
        return list(buffers)
    return copies


def to_device(arrays: Sequence[Any]) -> None:
    """Move evaluated arrays the host built into the GPU's memory, and wait: the GPU reads them next."""
    _move(arrays, to_device=True)
