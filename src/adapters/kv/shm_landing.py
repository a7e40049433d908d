"""`ShmLanding`: KV received over the network lands straight in a node's own shared memory.

A node whose engine core is a process (`adapters.mlx.core_client.ProcessEngine`) reads KV from
shared memory, so the buffers its peers receive KV bodies into (a pull's, a streamed piece's) are
regions of the node's `ShmOutbox`: handing the received payload to the core then copies nothing,
the receive is the bytes' only copy. This is an adapter: it must never import trio, httpx, mlx or
mlx_lm, and numpy only inside `take` (as `adapters.kv.shm_outbox.copy_into`); nothing in
`statecore` or `effects` may import it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from adapters.kv.shm_outbox import ShmOutbox, ShmWriter
from adapters.kv.shm_region import ShmRef
from statecore.errors import Code, StatecoreError

RECEIVED: Final = "received"  # the holder of a landing's regions (no request is known at `take`)


@dataclass(slots=True)
class _Landed:
    writer: ShmWriter
    array: weakref.ref[object]  # the numpy array every view `take` handed out is made from
    ref: ShmRef | None = None  # once claimed


@dataclass(frozen=True, slots=True)
class ShmLandingStatistics:
    landed: int  # receives that landed in shared memory
    fell_back: int  # receives that landed in `fallback` (no room in shared memory)
    claimed: int  # landed payloads handed on by reference (`claim`)
    held: int  # landed regions some view still refers to


class ShmLanding:
    """Where KV bytes received over the network land on a node whose engine core reads them from
    shared memory: `take(nbytes)` (the buffer a receive fills: `kv_pull`'s pull, a KV stream's
    segment) is a writable view of a region of `outbox` reserved for it, so handing the received
    payload to the core (`claim`: the reference to send instead of the bytes) copies nothing; the
    receive is the bytes' only copy. When the outbox has no room (`overloaded`) the bytes land in
    `fallback` (process memory) and the caller copies as before. A region goes back to the outbox
    once the last view of it goes (a receive cut mid-body, a payload never handed on), unclaimed
    or claimed, whichever comes first with the claimer's own `ShmOutbox.free` of the reference.
    Used from one thread (the node's trio thread); the last view may go on any thread."""

    def __init__(self, outbox: ShmOutbox, fallback: Callable[[int], memoryview]) -> None:
        self._outbox = outbox
        self._fallback = fallback
        self._lock = threading.RLock()  # reentrant: as `ShmOutbox._lock`, for `gone`
        self._landed: dict[int, _Landed] = {}  # by id() of the array the views are made from
        self._counts = [0, 0, 0]  # landed, fell back, claimed

    def take(self, nbytes: int) -> memoryview:
        """A writable view of exactly `nbytes` bytes for a receive to fill."""
        import numpy as np  # here, not at the top: as `copy_into`

        if nbytes <= 0:
            return self._fallback(nbytes)
        try:
            writer = self._outbox.reserve(RECEIVED, nbytes)
        except StatecoreError as exc:
            if exc.info.code is not Code.OVERLOADED:
                raise
            self._counts[1] += 1
            return self._fallback(nbytes)
        array = np.frombuffer(writer.view, dtype=np.uint8)  # views of it keep it (and the region)
        landed = _Landed(writer, weakref.ref(array))
        with self._lock:
            self._landed[id(array)] = landed
            self._counts[0] += 1
        weakref.finalize(array, self._gone, id(array), landed)
        return array.data

    def claim(self, payload: object) -> ShmRef | None:
        """The reference to `payload`'s bytes when it is a whole view `take` handed out (then the
        region is the caller's to `ShmOutbox.free` once the reader is done); None otherwise (it
        landed in `fallback`, it is a part of a view, or it was claimed already)."""
        if not isinstance(payload, memoryview):
            return None
        owner = payload.obj
        with self._lock:
            landed = self._landed.get(id(owner))
            if (landed is None or landed.array() is not owner or landed.ref is not None
                    or payload.nbytes != landed.writer.nbytes):
                return None
            landed.ref = landed.writer.commit()  # no checksum to compute for an outbox without one
            self._counts[2] += 1
            return landed.ref

    def give_back(self, view: memoryview) -> None:
        """The receive into `view` (from `take`) failed: its region goes back to the outbox now,
        not when the last view goes (a traceback may keep one for a while)."""
        owner = view.obj
        with self._lock:
            landed = self._landed.get(id(owner))
            if landed is None or landed.array() is not owner or landed.ref is not None:
                return
        landed.writer.abort()

    def statistics(self) -> ShmLandingStatistics:
        with self._lock:
            landed, fell_back, claimed = self._counts
            return ShmLandingStatistics(landed, fell_back, claimed, len(self._landed))

    def _gone(self, key: int, landed: _Landed) -> None:
        """The last view of a landed region went: the region goes back (a no-op when the claimer
        freed it already)."""
        with self._lock:
            if self._landed.get(key) is landed:
                del self._landed[key]
        if landed.ref is None:
            landed.writer.abort()
        else:
            self._outbox.free(landed.ref)


__all__ = ["RECEIVED", "ShmLanding", "ShmLandingStatistics"]
