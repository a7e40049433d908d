"""Another process's GPU memory read into an array of this engine's own, lazily, by a kernel on
the steps' stream.

A streamed handoff's device piece (`adapters.mlx.device_pieces`) lies in the sender's buffer,
opened here through CUDA IPC. Copying it out with the CUDA runtime made the device thread wait
twice a piece (the landing arrays' allocation, then the copy), and where the prefill node
computes on the same GPU each wait lasted until the GPU switched to this process: 45-100 ms on an
H100 while 16 streams decoded, every one of them without a token meanwhile. `read` instead
returns an array that a kernel fills from the address (16 bytes a thread), unevaluated: it is
computed with the next step that uses it, in the steps' order, and the device thread waits for
nothing here. Whoever frees the sender's region must know the read is done: the engine evaluates
a request's reads before its install is answered (`Reads.settle`); a read of a cancelled
request may see the region reused, into arrays nobody reads. `usable` checks the kernel once
against a copy it can verify (off where it is not right, or MLX has no CUDA kernels: the caller
then copies through the runtime). This module imports mlx; never trio.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Final

import mlx.core as mx

from adapters.mlx.managed_memory import spans

__all__ = ["UNIT_BYTES", "Reads", "read", "usable"]

logger = logging.getLogger("adapters.engine_mlx")

UNIT_BYTES: Final = 16  # one thread's load and store (a uint4)
_THREADS: Final = 256

_SOURCE = """
    const uint64_t base = source[0];
    const uint64_t units = source[1];
    const uint64_t index = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (index < units) {
        reinterpret_cast<uint4*>(landing)[index] = reinterpret_cast<const uint4*>(base)[index];
    }
"""

_lock = threading.Lock()
_kernel: Any = None
_usable: bool | None = None


def _read_kernel() -> Any:
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="statecore_device_read", input_names=["source"],
                                      output_names=["landing"], source=_SOURCE)
    return _kernel


def read(address: int, nbytes: int) -> Any:
    """`nbytes` (a multiple of `UNIT_BYTES`; `address` aligned to it) from `address` in this
    process's GPU address space, as a flat uint8 array, unevaluated."""
    if nbytes % UNIT_BYTES or address % UNIT_BYTES:
        raise ValueError(f"a device read of {nbytes} bytes at {address:#x}: not in {UNIT_BYTES}-byte units")
    units = nbytes // UNIT_BYTES
    source = mx.array([address, units], dtype=mx.uint64)
    (landing,) = _read_kernel()(inputs=[source], grid=(-(-units // _THREADS) * _THREADS, 1, 1),
                                threadgroup=(_THREADS, 1, 1), output_shapes=[(nbytes,)],
                                output_dtypes=[mx.uint8])
    return landing


def usable() -> bool:
    """Whether `read` copies right here (checked once a process, on a buffer of its own)."""
    global _usable
    with _lock:
        if _usable is None:
            _usable = _check()
        return _usable


def _check() -> bool:
    try:
        # as large as a piece's arrays are (the allocator's large buffers), and not a whole number of blocks
        expected = mx.random.randint(0, 256, ((1 << 20) + 64,), key=mx.random.key(11)).astype(mx.uint8)
        mx.eval(expected)
        ((address, nbytes),) = spans([expected])
        got = read(address, nbytes)
        same = bool(mx.array_equal(got, expected).item())
    except Exception as exc:  # a kernel that does not build or run here: the runtime's copies
        logger.warning("device pieces are copied through the CUDA runtime (the read kernel: %s)", exc)
        return False
    if same:
        logger.info("device pieces are read by a kernel computed with the step that uses them")
    else:
        logger.warning("device pieces are copied through the CUDA runtime (the read kernel copied wrong)")
    return same


class Reads:
    """Each request's reads not yet known to be done (device thread only)."""

    def __init__(self) -> None:
        self._pending: dict[str, list[Any]] = {}

    def add(self, request_id: str, landing: Any) -> None:
        self._pending.setdefault(request_id, []).append(landing)

    def settle(self, request_id: str) -> None:
        """The request's reads done (evaluated; those a step computed already cost nothing), so
        that the sender may free what they read once the request is installed."""
        landed = self._pending.pop(request_id, [])
        if landed:
            mx.eval(*landed)

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._pending)
