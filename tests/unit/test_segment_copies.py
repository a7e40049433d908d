"""A stream's pieces in copy: taken in order, and a new item is not kept waiting behind them."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import trio

from adapters.http.segment_copies import COPY_FINISHED, SegmentCopies
from effects.engine_port import KvPieces, KvSegment
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.ids import RequestId


class GatedOutbox:
    """An outbox whose `put` of a piece waits until the test opens that piece's gate."""

    def __init__(self) -> None:
        self.gates: dict[bytes, threading.Event] = {}
        self.full = False

    def gate(self, payload: bytes) -> threading.Event:
        return self.gates.setdefault(payload, threading.Event())

    def put(self, request_id: str, pieces: list[memoryview]) -> Any:
        payload = b"".join(bytes(p) for p in pieces)
        assert self.gate(payload).wait(10)
        if self.full:
            raise StatecoreError(ErrorInfo(Fault.OVERLOADED, Code.OVERLOADED, "no room"))
        return f"ref:{payload.decode()}"


def piece(start: int, payload: bytes) -> KvSegment:
    return KvSegment(start, start + 1, 0, 1, KvPieces((payload,)))


async def test_an_item_comes_through_while_the_oldest_copy_runs_and_pieces_keep_their_order() -> None:
    outbox = GatedOutbox()
    copies = SegmentCopies(outbox, RequestId("r"))  # type: ignore[arg-type]
    send, items = trio.open_memory_channel[str](4)
    copies.start(piece(0, b"a"))
    copies.start(piece(1, b"b"))
    await send.send("first token")
    assert await copies.next_event(items, more_items=True) == "first token"
    outbox.gate(b"b").set()  # the younger copy ends first: it still waits for the older one
    await trio.to_thread.run_sync(lambda: copies._copies[1].future.result(10))
    assert copies.finished() is None
    outbox.gate(b"a").set()
    assert await copies.next_event(items, more_items=True) is COPY_FINISHED
    taken = [copies.finished(), copies.finished()]
    order: list[tuple[int, object]] = [(done[0].start, done[1]) for done in taken if done is not None]
    assert order == [(0, "ref:a"), (1, "ref:b")]
    assert not copies


async def test_with_no_more_items_it_waits_for_the_copy_and_settle_waits_for_all() -> None:
    outbox = GatedOutbox()
    copies = SegmentCopies(outbox, RequestId("r"))  # type: ignore[arg-type]
    _, items = trio.open_memory_channel[str](1)
    copies.start(piece(0, b"a"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, outbox.gate(b"a").set)
        assert await copies.next_event(items, more_items=False) is COPY_FINISHED
    copies.start(piece(1, b"b"))
    outbox.gate(b"b").set()
    await copies.settle()
    assert copies._copies[-1].future.done()


async def test_no_room_hands_the_piece_back_without_a_reference() -> None:
    outbox = GatedOutbox()
    outbox.full = True
    copies = SegmentCopies(outbox, RequestId("r"))  # type: ignore[arg-type]
    _, items = trio.open_memory_channel[str](1)
    outbox.gate(b"a").set()
    copies.start(piece(0, b"a"))
    assert await copies.next_event(items, more_items=False) is COPY_FINISHED
    taken = copies.finished()
    assert taken is not None and taken[1] is None  # no reference: the caller sends it inline


async def test_an_item_taken_in_the_round_the_copy_ends_is_not_lost() -> None:
    outbox = GatedOutbox()
    copies = SegmentCopies(outbox, RequestId("r"))  # type: ignore[arg-type]
    send, items = trio.open_memory_channel[str](1)
    copies.start(piece(0, b"a"))
    await send.send("first token")
    copies._copies[0].done.set()  # both waits end in the first round
    assert await copies.next_event(items, more_items=True) == "first token"
    outbox.gate(b"a").set()
    await copies.settle()


async def test_a_closed_channel_ends_the_wait() -> None:
    outbox = GatedOutbox()
    copies = SegmentCopies(outbox, RequestId("r"))  # type: ignore[arg-type]
    send, items = trio.open_memory_channel[str](1)
    copies.start(piece(0, b"a"))
    await send.aclose()
    with pytest.raises(trio.EndOfChannel):
        await copies.next_event(items, more_items=True)
    outbox.gate(b"a").set()
    await copies.settle()
