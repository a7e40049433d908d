"""The trio side's one record per request (`adapters.mlx.callers`): a record lives while it holds
something (a stream not yet taken, pieces not yet installed) and is gone once it holds nothing, so
the facade keeps nothing for a request that ended."""

from __future__ import annotations

import pytest
import trio

from adapters.mlx.callers import Callers
from statecore.errors import StatecoreError


def piece(start: int) -> tuple[int, int, int, list[object]]:
    return (0, 2, start, [])


def test_a_stream_is_kept_until_taken_and_then_the_record_is_gone() -> None:
    callers = Callers()
    send, receive = callers.open_stream("r", 4)
    with pytest.raises(StatecoreError, match="already decoding"):
        callers.open_stream("r", 4)
    assert callers.take_stream("r") is receive
    assert callers.get("r") is None
    assert callers.take_stream("r") is None
    send.close()
    receive.close()


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
    send, receive = callers.open_stream("r", 4)
    callers.keep_piece("r", piece(0))
    callers.drop("r")
    assert callers.get("r") is None
    with pytest.raises(trio.ClosedResourceError):
        receive.receive_nowait()
    send.close()


def test_a_failed_start_closes_only_its_own_stream() -> None:
    callers = Callers()
    _, first = callers.open_stream("r", 4)
    _, other = callers.open_stream("s", 4)
    callers.close_stream("r", only=other)  # not r's: nothing happens
    assert callers.get("r") is not None
    callers.close_stream("r", only=first)
    assert callers.get("r") is None and callers.get("s") is not None
    callers.close()
    assert callers.get("s") is None
