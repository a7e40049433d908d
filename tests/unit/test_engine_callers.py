"""The trio side's one record per request (`adapters.mlx.callers`): a record lives while it holds
something (a stream not yet taken, pieces not yet installed) and is gone once it holds nothing, so
the facade keeps nothing for a request that ended."""

from __future__ import annotations

import pytest
import trio

from adapters.mlx.callers import Callers
from effects.engine_port import GeneratedToken
from statecore.errors import StatecoreError, client_error


def piece(start: int) -> tuple[int, int, int, list[object]]:
    return (0, 2, start, [])


async def test_a_stream_is_kept_until_read_and_then_the_record_is_gone() -> None:
    callers, cancelled = Callers(), []
    with (callers.opening_stream("r", 4) as send, pytest.raises(StatecoreError, match="already decoding"),
          callers.opening_stream("r", 4)):
        pass  # a second start of r is refused while r's stream is kept
    send.send_nowait(GeneratedToken(7))
    send.close()
    assert [item async for item in callers.stream("r", lambda: cancelled.append("r"))] == [GeneratedToken(7)]
    assert callers.get("r") is None and cancelled == []
    with pytest.raises(StatecoreError, match="no stream for request 'r'"):
        await callers.stream("r", lambda: cancelled.append("r")).__anext__()


async def test_an_error_the_engine_sent_ends_the_stream_raised() -> None:
    callers, cancelled = Callers(), []
    with callers.opening_stream("r", 4) as send:
        send.send_nowait(GeneratedToken(1))
        send.send_nowait(StatecoreError(client_error("the engine said no")))
    stream = callers.stream("r", lambda: cancelled.append("r"))
    assert await stream.__anext__() == GeneratedToken(1)
    with pytest.raises(StatecoreError, match="the engine said no"):
        await stream.__anext__()
    assert cancelled == []  # it ended: nothing to cancel


async def test_a_reader_that_leaves_early_cancels_the_request() -> None:
    callers, cancelled = Callers(), []
    with callers.opening_stream("r", 4) as send:
        send.send_nowait(GeneratedToken(1))
    stream = callers.stream("r", lambda: cancelled.append("r"))
    assert await stream.__anext__() == GeneratedToken(1)
    await stream.aclose()
    assert cancelled == ["r"] and callers.get("r") is None
    send.close()


def test_pieces_come_back_in_order_with_the_last_one_at_the_end() -> None:
    callers = Callers()
    callers.keep_piece("s", piece(96), last=True)  # the rest of s is in its slot: not counted here
    assert callers.arriving == 0
    callers.keep_piece("r", piece(0))
    callers.keep_piece("r", piece(96), last=True)
    callers.keep_piece("r", piece(32))
    assert callers.arriving == 1
    assert [p[2] for p in callers.take_pieces("r")] == [0, 32, 96]
    assert callers.get("r") is None and callers.arriving == 0
    assert callers.take_pieces("r") == []
    assert [p[2] for p in callers.take_pieces("s")] == [96] and callers.get("s") is None


def test_a_cancel_closes_the_kept_stream_and_forgets_the_pieces() -> None:
    callers = Callers()
    with callers.opening_stream("r", 4) as send:
        pass
    callers.keep_piece("r", piece(0))
    callers.drop("r")
    assert callers.get("r") is None
    with pytest.raises(trio.BrokenResourceError):  # its reading end is closed
        send.send_nowait(GeneratedToken(1))
    send.close()


def test_a_failed_start_closes_only_its_own_stream() -> None:
    callers = Callers()
    with pytest.raises(RuntimeError), callers.opening_stream("r", 4) as send:
        raise RuntimeError("the start failed")
    assert callers.get("r") is None
    with pytest.raises(trio.ClosedResourceError):
        send.send_nowait(GeneratedToken(1))
    with pytest.raises(RuntimeError), callers.opening_stream("r", 4):
        callers.drop("r")  # cancelled while its start waited, then started again:
        with callers.opening_stream("r", 4) as again:
            pass
        raise RuntimeError("the first start failed late")
    assert callers.get("r") is not None  # the second start's stream is kept
    callers.close()
    assert callers.get("r") is None
    again.close()
