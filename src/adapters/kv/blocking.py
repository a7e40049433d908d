"""Where a blocking copy or check of KV bytes runs, seen from trio: a small one on the calling
thread, a large one in a worker thread.

Reading a piece in shared memory (its CRC-32) or copying one into a region blocks for as long as
the bytes take. For a megabyte that belongs off the event loop; for the few hundred bytes of a
device piece's document (`adapters.mlx.device_pieces`) or a tiny model's piece it takes
microseconds, less than the hop to a worker thread and back (~0.1 ms on a quiet host, 1-1.5 ms on
a loaded two-core one), and a streamed handoff's last piece makes three such hops on its way
(`bench/step_trace/hops.py`). This module imports trio; it must never import httpx, mlx or mlx_lm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, TypeVar

import trio

__all__ = ["ON_THE_CALLER_BYTES", "run_blocking"]

T = TypeVar("T")

ON_THE_CALLER_BYTES: Final = 64 << 10
"""At most this many bytes are read or copied on the calling thread (a CRC-32 and a copy of 64 KiB
take ~10 us)."""


async def run_blocking(call: Callable[[], T], nbytes: int | None) -> T:
    """`call()`, which blocks for `nbytes` of copying or checking (None: unknown, or more work than
    its bytes say), on this thread when that is small, else in a worker thread."""
    if nbytes is not None and nbytes <= ON_THE_CALLER_BYTES:
        return call()
    return await trio.to_thread.run_sync(call)
