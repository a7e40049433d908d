"""`adapters.mlx.callers.PieceOrder`: a streamed handoff's pieces are checked side by side and kept
in the stream's order; a piece after one that failed is never kept, one before it still is, and
giving the request's pieces up fails every piece still waiting for its turn."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from adapters.mlx.callers import Callers, PieceOrder
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError


async def keep_all(order: PieceOrder, arrival: list[int], fail: set[int]) -> tuple[list[int], dict[int, str]]:
    """Pieces whose checks end in `arrival` order; each then waits for its turn and is kept
    (or fails, for `fail`). The order they were kept in, and how each that was not ended."""
    kept: list[int] = []
    ended: dict[int, str] = {}

    async def piece(index: int, delay: int) -> None:
        for _ in range(delay):  # its check ends after `delay` scheduling rounds
            await trio.lowlevel.checkpoint()
        ok = False
        try:
            await order.turn(index)
            if index in fail:  # its check found it corrupt
                raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_CHECKSUM, "a corrupt piece"))
            kept.append(index)
            ok = True
        except StatecoreError as exc:
            ended[index] = "failed" if exc.info.code is Code.KV_CHECKSUM else exc.info.message
        finally:
            order.done(index, kept=ok)

    async with trio.open_nursery() as nursery:
        for delay, index in enumerate(arrival):
            nursery.start_soon(piece, index, delay * 3)
    return kept, ended


@pytest.mark.parametrize("arrival", [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4, 1, 3]])
async def test_pieces_are_kept_in_the_stream_s_order_whatever_order_their_checks_end(
        arrival: list[int]) -> None:
    kept, ended = await keep_all(PieceOrder(), arrival, fail=set())
    assert kept == [0, 1, 2, 3, 4] and not ended


@pytest.mark.parametrize("arrival", [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [3, 4, 0, 2, 1]])
async def test_no_piece_after_a_failed_one_is_kept_and_every_one_before_it_is(arrival: list[int]) -> None:
    kept, ended = await keep_all(PieceOrder(), arrival, fail={2})
    assert kept == [0, 1]
    earlier = "an earlier KV piece of this handoff failed"
    assert ended == {2: "failed", 3: earlier, 4: earlier}


async def test_giving_the_pieces_up_fails_the_ones_waiting_and_forgets_the_order() -> None:
    callers = Callers()
    order = callers.piece_order("r")
    assert callers.piece_order("r") is order and callers.get("r") is not None
    outcome: list[str] = []

    async def waiting() -> None:
        try:
            await order.turn(3)  # pieces 0-2 never come
        except StatecoreError as exc:
            outcome.append(exc.info.code.value)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiting)
        await trio.testing.wait_all_tasks_blocked()
        callers.forget_pieces("r")  # the request was cancelled
    assert outcome == [Code.KV_MALFORMED.value]
    assert callers.get("r") is None  # nothing left of it


def test_callers_that_name_no_index_are_kept_in_the_order_of_their_calls() -> None:
    order = PieceOrder()
    assert [order.claim() for _ in range(3)] == [0, 1, 2]


async def test_an_install_asked_before_the_last_pieces_are_kept_waits_for_them() -> None:
    """`kept_all`: the install a decode node asks as its stream ends starts once every piece it
    named is kept, not before, whatever order their checks end in."""
    order = PieceOrder()
    waited: list[int] = []

    async def install() -> None:
        await order.kept_all(3)
        waited.append(order.kept)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(install)
        await trio.testing.wait_all_tasks_blocked()
        for index in (0, 1):
            order.done(index, kept=True)
            await trio.testing.wait_all_tasks_blocked()
            assert not waited
        order.done(2, kept=True)
    assert waited == [3]


async def test_an_install_waiting_for_a_piece_that_fails_raises_that_piece_s_error() -> None:
    """The install raises the failed piece's own error (its code and words, so the request fails
    as the piece's check failed it, whichever of the two the node hears first); a failure after
    the pieces it waits for does not concern it; pieces given up fail it too."""
    corrupt = StatecoreError(ErrorInfo(Fault.PEER, Code.KV_CHECKSUM, "a corrupt piece"))
    order = PieceOrder()
    order.done(0, kept=True)
    order.done(2, kept=False, failure=StatecoreError(ErrorInfo(Fault.PEER, Code.KV_MALFORMED, "later")))
    order.done(1, kept=False, failure=corrupt)  # the earliest failure is the one an install raises
    with pytest.raises(StatecoreError) as raised:
        await order.kept_all(3)
    assert raised.value is corrupt

    past = PieceOrder()
    past.done(0, kept=True)
    past.done(1, kept=False, failure=corrupt)  # not one of the pieces the install waits for
    await past.kept_all(1)

    callers = Callers()
    given_up = callers.piece_order("r")
    async with trio.open_nursery() as nursery:
        async def install() -> None:
            with pytest.raises(StatecoreError) as raised:
                await given_up.kept_all(2)
            assert raised.value.info.code is Code.KV_MALFORMED
        nursery.start_soon(install)
        await trio.testing.wait_all_tasks_blocked()
        callers.forget_pieces("r")  # the request ended: its handoff's pieces are given up
