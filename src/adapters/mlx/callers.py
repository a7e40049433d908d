"""The trio side's one record per request (`Caller`), beside the device thread's (`adapters.mlx.requests`).

The device thread's record lives while the engine works on a request; what the request's caller in
trio needs comes before it or outlives it: a streamed prefill's handout while the prefill runs (asked
whether its pieces go in GPU memory), a streamed handoff's pieces, validated and built as they
arrived, until its install; the stream its tokens arrive on, from the call that starts its decoding
(`opening_stream`) until the port's `stream` reads it (`stream`: a request may finish before its
caller reads a token), and, where its items come to trio in an engine core process's frames
(`ProcessEngine`), the stream's sending end until its last item (`feed`, `end_feed`). Both Engine
ports that keep streams in trio (`MlxEngine`, `ProcessEngine`) keep them here. Each request has at
most one `Caller` here,
made by the first call that needs one and gone once nothing in it is left (its stream taken, its
pieces installed, a cancel or a release), so the facade keeps no other map by request. Only trio
reads or changes it; the device thread never sees it (an engine core in its own process would
leave this in the front end's). It imports trio; it must never import mlx.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from adapters.mlx.jobs import StreamItem
from effects.engine_port import Decoded, GeneratedToken
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error
from statecore.events import Finished
from statecore.policy import decoded

__all__ = ["Caller", "Callers", "Handout", "Piece", "PieceOrder"]

# A streamed handoff's piece, built: (its first layer, its end layer, its first token, its caches).
Piece = tuple[int, int, int, list[Any]]


class Handout(Protocol):
    """A streamed prefill's sink on the device thread (`adapters.mlx.kv_out.PieceHandout`), as trio
    asks it."""

    def on_device(self) -> bool: ...


@dataclass(eq=False)
class PieceOrder:
    """A streamed handoff's pieces are checked side by side but kept in the stream's order (a
    slot takes each layer's tokens in order): piece i is kept once pieces 0 to i-1 were, and no
    piece after one that failed (or after the request's pieces were given up: all of them)."""

    claimed: int = 0  # indices handed to callers that name none (they call one after another)
    kept: int = 0
    failed_at: int | None = None
    failure: StatecoreError | None = None  # the first failed piece's error (an install raises it)
    changed: trio.Event = field(default_factory=trio.Event)

    def claim(self) -> int:
        self.claimed += 1
        return self.claimed - 1

    async def turn(self, index: int) -> None:
        """Wait until every piece before `index` is kept; raise if one of them failed."""
        await trio.lowlevel.checkpoint()  # a request cancelled meanwhile keeps nothing
        while not self._fails(index) and self.kept < index:
            await self.changed.wait()
        if self._fails(index):
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_MALFORMED,
                                           "an earlier KV piece of this handoff failed"))

    async def kept_all(self, count: int) -> None:
        """Wait until the first `count` pieces are kept (an install asked while the last ones are
        still being checked); raise the failed piece's error if one of them failed, or a generic
        one if the pieces were given up."""
        await trio.lowlevel.checkpoint()
        while not self._fails(count) and self.kept < count:
            await self.changed.wait()
        if self._fails(count):
            raise self.failure or StatecoreError(ErrorInfo(
                Fault.PEER, Code.KV_MALFORMED, "the handoff's KV pieces were given up before its install"))

    def done(self, index: int, *, kept: bool, failure: StatecoreError | None = None) -> None:
        """Piece `index` kept, or failed (`failure`: its error; -1: every piece given up)."""
        if kept:
            self.kept += 1
        elif self.failed_at is None or index < self.failed_at:
            self.failed_at, self.failure = index, failure
        self.changed.set()
        self.changed = trio.Event()

    def _fails(self, index: int) -> bool:
        return self.failed_at is not None and self.failed_at < index


@dataclass(eq=False)
class Caller:
    """What trio keeps for one request between its calls (see the module's paragraph)."""

    stream: trio.MemoryReceiveChannel[StreamItem] | None = None  # until `stream()` takes it
    feed: trio.MemorySendChannel[StreamItem] | None = None  # kept where trio feeds it: until the last item
    pieces: list[Piece] = field(default_factory=list)  # a streamed handoff's, kept for the install
    last_piece: Piece | None = None  # the last one, which the install job writes into its slot
    order: PieceOrder | None = None  # a streamed handoff's, from its first piece to its install
    handout: Handout | None = None  # a streamed prefill's sink, while its prefill runs

    @property
    def empty(self) -> bool:
        return (self.stream is None and self.feed is None and not self.pieces and self.last_piece is None
                and self.order is None and self.handout is None)


class Callers:
    """Every request's `Caller`, by request id."""

    def __init__(self) -> None:
        self._records: dict[str, Caller] = {}

    def get(self, request_id: str) -> Caller | None:
        return self._records.get(request_id)

    @property
    def arriving(self) -> int:
        """Requests with pieces kept for their install, not in a slot (one whose last piece waits
        for its install job has the rest in its slot: the slots count it)."""
        return sum(1 for caller in self._records.values() if caller.pieces)

    @property
    def feeding(self) -> bool:
        """Whether a stream kept with its sending end waits for items."""
        return any(caller.feed is not None for caller in self._records.values())

    def piece_order(self, request_id: str) -> PieceOrder:
        """The order the request's streamed pieces are kept in (made at its first piece)."""
        caller = self._records.setdefault(request_id, Caller())
        if caller.order is None:
            caller.order = PieceOrder()
        return caller.order

    def keep_piece(self, request_id: str, piece: Piece, *, last: bool = False) -> None:
        caller = self._records.setdefault(request_id, Caller())
        if last:
            caller.last_piece = piece
        else:
            caller.pieces.append(piece)

    def take_pieces(self, request_id: str) -> list[Piece]:
        """The request's pieces in order, for its install; none are kept after."""
        caller = self._records.get(request_id)
        if caller is None:
            return []
        pieces = caller.pieces + ([] if caller.last_piece is None else [caller.last_piece])
        caller.pieces, caller.last_piece, caller.order = [], None, None
        self._tidy(request_id, caller)
        return pieces

    def forget_pieces(self, request_id: str) -> None:
        """The request's pieces forgotten; any piece still waiting for its turn fails."""
        caller = self._records.get(request_id)
        if caller is not None:
            if caller.order is not None:
                caller.order.done(-1, kept=False)
            caller.pieces, caller.last_piece, caller.order = [], None, None
            self._tidy(request_id, caller)

    @contextmanager
    def handing_out(self, request_id: str, handout: Handout | None) -> Iterator[None]:
        """The request's streamed prefill keeps `handout` while it runs (None: nothing to keep)."""
        caller = None if handout is None else self._records.setdefault(request_id, Caller())
        if caller is not None:
            caller.handout = handout
        try:
            yield
        finally:
            if caller is not None:
                caller.handout = None
                self._tidy(request_id, caller)

    def pieces_on_device(self, request_id: str) -> bool:
        """Whether the request's streamed prefill, running now, sends its pieces in GPU memory."""
        caller = self._records.get(request_id)
        return caller is not None and caller.handout is not None and caller.handout.on_device()

    @contextmanager
    def opening_stream(self, request_id: str, capacity: int, *, fed_here: bool = False
                       ) -> Iterator[trio.MemorySendChannel[StreamItem]]:
        """The request's token stream, opened for the call that starts its decoding (refused while
        one is kept) and kept for `stream`; `fed_here`: its sending end is kept too, for `feed`.
        Closed and forgotten again when that call fails."""
        caller = self._records.setdefault(request_id, Caller())
        if caller.stream is not None:
            raise StatecoreError(client_error(f"request {request_id!r} is already decoding"))
        send, receive = trio.open_memory_channel[StreamItem](capacity)
        caller.stream = receive
        if fed_here:
            caller.feed = send
        try:
            yield send
        except BaseException:
            if caller.feed is send:
                caller.feed = None
            self.close_stream(request_id, only=receive)
            receive.close()
            send.close()
            self._tidy(request_id, caller)
            raise

    def feed(self, request_id: str, item: StreamItem) -> None:
        """One item for the request's kept stream (nothing when it has ended or its reader left)."""
        caller = self._records.get(request_id)
        if caller is not None and caller.feed is not None:
            _send_quietly(caller.feed, item)

    def end_feed(self, request_id: str, error: StatecoreError | None = None) -> None:
        """The request's stream has had its last item (`error`: it ended with it): closed."""
        caller = self._records.get(request_id)
        if caller is None or caller.feed is None:
            return
        if error is not None:
            _send_quietly(caller.feed, error)
        caller.feed.close()
        caller.feed = None
        self._tidy(request_id, caller)

    def fail_feeds(self, error: StatecoreError) -> None:
        """The items' source is gone: every kept stream ends with `error`."""
        for request_id in [rid for rid, caller in self._records.items() if caller.feed is not None]:
            self.end_feed(request_id, error)

    async def stream(self, request_id: str, cancel_nowait: Callable[[], None]
                     ) -> AsyncGenerator[Decoded, None]:
        """The request's tokens after the first, from its kept stream (taken here: read once), as
        the core's events: a step's tokens, handed out together, read as one (`decoded`); an
        error the engine sent ends it, raised; a reader that leaves before the end cancels the
        request (`cancel_nowait`)."""
        caller = self._records.get(request_id)
        receive = None if caller is None else caller.stream
        if caller is None or receive is None:
            raise StatecoreError(ErrorInfo(
                Fault.BUG, Code.INTERNAL,
                f"no stream for request {request_id!r} (never started, already taken, or cancelled)"))
        caller.stream = None
        self._tidy(request_id, caller)
        finished = False
        try:
            async with receive:
                async for first in receive:
                    items = _ready_after(first, receive)
                    events = decoded([item for item in items if isinstance(item, GeneratedToken)])
                    for event in events:
                        yield event
                    if isinstance(error := items[-1], StatecoreError):
                        finished = True
                        raise StatecoreError(error.info) from error
                    if events and isinstance(events[-1], Finished):
                        break  # its end: nothing after it is the request's
            finished = True
        finally:
            if not finished:
                cancel_nowait()

    def close_stream(self, request_id: str,
                     only: trio.MemoryReceiveChannel[StreamItem] | None = None) -> None:
        """Close the request's kept stream (`only`: when it is that one) and forget it."""
        caller = self._records.get(request_id)
        if caller is None or caller.stream is None or (only is not None and caller.stream is not only):
            return
        caller.stream.close()
        caller.stream = None
        self._tidy(request_id, caller)

    def drop(self, request_id: str) -> None:
        """The request is cancelled: its kept stream (both ends) closed, its pieces forgotten."""
        self.close_stream(request_id)
        self.end_feed(request_id)
        self.forget_pieces(request_id)

    def close(self) -> None:
        """The engine stops: every kept stream closed, every record forgotten."""
        for caller in self._records.values():
            if caller.stream is not None:
                caller.stream.close()
            if caller.feed is not None:
                caller.feed.close()
            if caller.order is not None:
                caller.order.done(-1, kept=False)
        self._records.clear()

    def _tidy(self, request_id: str, caller: Caller) -> None:
        if caller.empty and self._records.get(request_id) is caller:
            del self._records[request_id]


def _ready_after(first: StreamItem, receive: trio.MemoryReceiveChannel[StreamItem]) -> list[StreamItem]:
    """`first` and the items already waiting behind it, up to one that ends the stream (an error,
    or a token that ends its request), never waiting: a decode step's items come in one hand-out,
    so the reader takes them as one value instead of waking once each."""
    items = [first]
    while not _ends_stream(items[-1]):
        try:
            items.append(receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            break
    return items


def _ends_stream(item: StreamItem) -> bool:
    return isinstance(item, StatecoreError) or item.finish_reason is not None


def _send_quietly(send: trio.MemorySendChannel[StreamItem], item: StreamItem) -> None:
    # WouldBlock cannot happen (the bound is max_tokens); the others mean the reader is gone, and
    # its stream's exit already asked for a cancel.
    with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
        send.send_nowait(item)
