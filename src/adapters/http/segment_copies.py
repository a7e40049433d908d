"""A streamed handoff's pieces on their way into shared memory, so that the first token need not
wait behind them.

Copying a piece into shared memory (the device-to-host copy on a GPU, and its checksum) takes
tens of milliseconds for a 2,000-token prompt of a 1B model, and the prompt's first token is
sampled while the last pieces are still being copied (unless its engine core, in a process of
its own, wrote them into shared memory already). A prefill node's stream therefore starts
each piece's copy in a worker thread as the piece is computed, writes the pieces' records in
order as their copies finish, and writes the first token's record as soon as it has it, ahead of
pieces still in copy (the stream's format allows pieces after the first token: a reader checks
only that each layer's token ranges follow one another). `next_event` waits for whichever comes
first, a new item or the oldest copy's end, inside a nursery that closes before the caller
yields (no yield inside a nursery). This module must never import mlx, numpy or httpx.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
from dataclasses import dataclass, field
from typing import Final, TypeVar

import trio

from adapters.kv.shm_outbox import ShmOutbox
from adapters.kv.shm_region import ShmRef
from effects.engine_port import KvSegment
from statecore.errors import Fault, StatecoreError
from statecore.ids import RequestId

_COPY_THREADS: Final = 4  # pieces copied at once, across every stream of the node
_pool = concurrent.futures.ThreadPoolExecutor(max_workers=_COPY_THREADS, thread_name_prefix="kv-shm-put")

Item = TypeVar("Item")


@dataclass(slots=True)
class _Copy:
    segment: KvSegment
    future: concurrent.futures.Future[ShmRef | None]
    done: trio.Event = field(default_factory=trio.Event)


class CopyFinished:
    """`next_event`'s answer when the oldest copy ended before a new item came."""


COPY_FINISHED: Final = CopyFinished()


class SegmentCopies:
    """One stream's pieces in copy, oldest first (see the module's paragraph)."""

    def __init__(self, outbox: ShmOutbox, request_id: RequestId) -> None:
        self._outbox = outbox
        self._request_id = request_id
        self._copies: collections.deque[_Copy] = collections.deque()
        self._trio_token = trio.lowlevel.current_trio_token()

    def __bool__(self) -> bool:
        return bool(self._copies)

    def start(self, segment: KvSegment) -> None:
        """Begin copying `segment` (its end frame included) into shared memory; a piece already
        there (an engine core process wrote it: `KvPieces.shared`) is handed on as it lies, with
        no copy (its caller keeps the piece alive until the decode node is done with it)."""
        future: concurrent.futures.Future[ShmRef | None]
        if isinstance(segment.payload.shared, ShmRef):
            future = concurrent.futures.Future()
            future.set_result(segment.payload.shared)
        else:
            future = _pool.submit(_put, self._outbox, self._request_id, segment)
        copy = _Copy(segment, future)
        future.add_done_callback(lambda _: self._wake(copy.done))
        self._copies.append(copy)

    def _wake(self, done: trio.Event) -> None:
        with contextlib.suppress(trio.RunFinishedError):  # shutting down: nobody waits any more
            self._trio_token.run_sync_soon(done.set)

    def finished(self) -> tuple[KvSegment, ShmRef | None] | None:
        """The oldest piece and its reference (None: no room, it goes inline) when its copy is
        done; None while it is still copying. Raises what the copy raised."""
        if not self._copies or not self._copies[0].future.done():
            return None
        copy = self._copies.popleft()
        return copy.segment, copy.future.result()

    async def next_event(self, items: trio.MemoryReceiveChannel[Item], *,
                         more_items: bool) -> Item | CopyFinished:
        """The next item of `items`, or COPY_FINISHED when the oldest copy ends first (with
        `more_items` False, only the latter). Raises trio.EndOfChannel as `items.receive` does."""
        oldest = self._copies[0] if self._copies else None
        if oldest is None or oldest.future.done():
            if oldest is not None or not more_items:
                return COPY_FINISHED
            return await items.receive()
        if not more_items:
            await oldest.done.wait()
            return COPY_FINISHED
        got: list[Item] = []
        ended = False
        async with trio.open_nursery() as nursery:

            async def receive() -> None:
                nonlocal ended
                try:
                    got.append(await items.receive())  # cancel-safe: an item is taken or left
                except trio.EndOfChannel:
                    ended = True
                nursery.cancel_scope.cancel()

            async def copied() -> None:
                await oldest.done.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(receive)
            nursery.start_soon(copied)
        # Both may end in one round: the item taken then must not be lost (the copy's end is
        # only a wake-up; `finished` finds it either way).
        if ended:
            raise trio.EndOfChannel
        return got[0] if got else COPY_FINISHED

    async def settle(self) -> None:
        """Wait for every copy still running (their regions must exist before they are released)."""
        with trio.CancelScope(shield=True):
            for copy in self._copies:
                if not copy.future.done():
                    await copy.done.wait()


def _put(outbox: ShmOutbox, request_id: RequestId, segment: KvSegment) -> ShmRef | None:
    """A piece copied into shared memory, its end frame included (waiting for its checksum), or
    None when the outbox has no room now: the piece then goes inline."""
    pieces = [memoryview(piece) for piece in segment.payload.pieces]
    if segment.payload.seal is not None:
        pieces.append(memoryview(segment.payload.seal()))
    try:
        return outbox.put(request_id, pieces)
    except StatecoreError as exc:
        if exc.info.fault is not Fault.OVERLOADED:
            raise
        return None


__all__ = ["COPY_FINISHED", "CopyFinished", "SegmentCopies"]
