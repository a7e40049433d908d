"""`CoreKv`: the KV payloads a node and its engine core process pass each other, in shared memory.

A payload the core exports is read here in place (`as_pieces`), as a view whose last reference
going away queues a `Free` for the core (sent with the node's next message, or soon: `wake` asks
for a flush), and it names its region (`KvPieces.shared`), so a prefill node's shared-memory
transport hands that very region on to the decode node (the core's copy into it is the payload's
only one). A payload handed to the core (`share`) goes by reference when it already lies in this
node's shared memory: it was received over the network into a region of `landing` (an
`adapters.kv.shm_landing.ShmLanding`: the receive its only copy); any other payload is copied once
into this node's region (inline in the message when every region is held). The caller frees it
(`unshare`) when its call ends. A streamed piece that arrived in another node's region is passed on
by the caller as its reference, without coming here. This module imports numpy and trio (the copy
runs on a worker thread); it must never import mlx, nor anything that does: a node whose core is a
process never loads mlx.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import trio

from adapters.kv.shm_inbox import ShmInbox
from adapters.kv.shm_landing import ShmLanding
from adapters.kv.shm_outbox import ShmOutbox
from adapters.kv.shm_region import ShmRef
from adapters.mlx.core_wire import Free
from effects.engine_port import KvBytes, KvPieces
from statecore.errors import Code, StatecoreError

__all__ = ["CoreKv"]


class CoreKv:
    """This node's side of the shared memory it shares with its engine core process. `wake` is
    called, on any thread, when a `Free` is due and no message may come soon to carry it."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._outbox = ShmOutbox(checksum=False)  # payloads carry their own checksums
        self._inbox = ShmInbox()
        self._landing: ShmLanding | None = None
        self._frees: collections.deque[ShmRef] = collections.deque()
        self.copies = 0  # payloads copied into the node's shared memory (not handed by reference)

    def landing(self, fallback: Callable[[int], memoryview]) -> ShmLanding:
        """Where KV received for the core should land: a region of this node's shared memory,
        which `share` hands to the core by reference; `fallback` (process memory) when no region
        is free."""
        if self._landing is None:
            self._landing = ShmLanding(self._outbox, fallback)
        return self._landing

    async def share(self, holder: str, pieces: Sequence[KvBytes], seal: Any = None) -> ShmRef | bytes:
        """A payload handed to the core: the region it was received into (`landing`), else
        copied once into this node's shared memory (inline when every region is held)."""
        if self._landing is not None and len(pieces) == 1 and seal is None:
            landed = self._landing.claim(pieces[0])
            if landed is not None:
                return landed
        self.copies += 1

        def put() -> ShmRef | bytes:
            parts = [*pieces, seal() if seal is not None else b""]
            try:
                return self._outbox.put(holder, [memoryview(part) for part in parts])
            except StatecoreError as exc:
                if exc.info.code is not Code.OVERLOADED:
                    raise
                return b"".join(parts)

        return await trio.to_thread.run_sync(put)

    def unshare(self, shared: ShmRef | bytes) -> None:
        """The call that took `shared` (from `share`) ended: its region is free again."""
        if isinstance(shared, ShmRef):
            self._outbox.free(shared)

    def as_pieces(self, payload: ShmRef | bytes) -> KvPieces:
        """A payload the core exported, read in place: `Free` goes back once no view of it is left."""
        if isinstance(payload, bytes):
            return KvPieces((payload,))
        view = self._inbox.read(payload)
        array = np.frombuffer(view, dtype=np.uint8)
        weakref.finalize(array, self._free_later, payload)
        return KvPieces((array.data,), shared=payload)  # a view that keeps `array` alive

    def due_frees(self) -> list[Free]:
        """The `Free`s to send with the node's next message to the core."""
        frees: list[Free] = []
        while self._frees:
            frees.append(Free(self._frees.popleft()))
        return frees

    def frees_due(self) -> bool:
        return bool(self._frees)

    def close(self) -> None:
        self._outbox.close()
        self._inbox.close()

    def _free_later(self, ref: ShmRef) -> None:
        """Any thread (the last view may go anywhere): sent with the next message, or soon."""
        self._frees.append(ref)
        self._wake()
