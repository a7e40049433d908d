"""The trio side's one record per request (`adapters.mlx.callers`): a record lives while it holds
something (a stream not yet taken, pieces not yet installed) and is gone once it holds nothing, so
the facade keeps nothing for a request that ended."""

from __future__ import annotations

import pytest
import trio

from adapters.mlx.callers import Callers
from effects.engine_port import GeneratedToken
from statecore.errors import StatecoreError, client_error
from statecore.events import Finished, TokenLogprobs, TokensGenerated


def piece(start: int) -> tuple[int, int, int, list[object]]:
    return (0, 2, start, [])


async def test_a_stream_is_kept_until_read_and_then_the_record_is_gone() -> None:
    callers, cancelled = Callers(), []
    with (callers.opening_stream("r", 4) as send, pytest.raises(StatecoreError, match="already decoding"),
          callers.opening_stream("r", 4)):
        pass  # a second start of r is refused while r's stream is kept
    send.send_nowait(GeneratedToken(7))
    send.close()
    read = [item async for item in callers.stream("r", lambda: cancelled.append("r"))]
    assert read == [TokensGenerated((7,))]
    assert callers.get("r") is None and cancelled == []
    with pytest.raises(StatecoreError, match="no stream for request 'r'"):
        await callers.stream("r", lambda: cancelled.append("r")).__anext__()


async def test_an_error_the_engine_sent_ends_the_stream_raised() -> None:
    callers, cancelled = Callers(), []
    with callers.opening_stream("r", 4) as send:
        send.send_nowait(GeneratedToken(1))
        send.send_nowait(StatecoreError(client_error("the engine said no")))
    stream = callers.stream("r", lambda: cancelled.append("r"))
    assert await stream.__anext__() == TokensGenerated((1,))
    with pytest.raises(StatecoreError, match="the engine said no"):
        await stream.__anext__()
    assert cancelled == []  # it ended: nothing to cancel


async def test_a_reader_that_leaves_early_cancels_the_request() -> None:
    callers, cancelled = Callers(), []
    with callers.opening_stream("r", 4) as send:
        send.send_nowait(GeneratedToken(1))
    stream = callers.stream("r", lambda: cancelled.append("r"))
    assert await stream.__anext__() == TokensGenerated((1,))
    await stream.aclose()
    assert cancelled == ["r"] and callers.get("r") is None
    send.close()


LP = [TokenLogprobs(-float(n)) for n in range(6)]


@pytest.mark.parametrize(("step", "read"), [
    # a verify step's tokens, handed out together: one value, in their order, logprobs beside them
    ([GeneratedToken(3, None, LP[0]), GeneratedToken(9, None, LP[1]), GeneratedToken(4, None, LP[2])],
     [TokensGenerated((3, 9, 4), (LP[0], LP[1], LP[2]))]),
    # an ending EOS is not sent: the step's other tokens are, then the end
    ([GeneratedToken(5), GeneratedToken(6), GeneratedToken(2, "stop")],
     [TokensGenerated((5, 6)), Finished("stop")]),
    ([GeneratedToken(2, "stop")], [Finished("stop")]),
    # the last allowed token is sent, then the end
    ([GeneratedToken(5), GeneratedToken(5, "length")], [TokensGenerated((5, 5)), Finished("length")]),
    # logprobs missing for one: none are claimed
    ([GeneratedToken(1, None, LP[0]), GeneratedToken(8)], [TokensGenerated((1, 8))]),
])
async def test_a_steps_tokens_are_read_as_one_value_in_their_order(
    step: list[GeneratedToken], read: list[object]
) -> None:
    callers = Callers()
    with callers.opening_stream("r", 8) as send:
        for item in step:
            send.send_nowait(item)
    if step[-1].finish_reason is None:
        send.close()
    assert [item async for item in callers.stream("r", lambda: None)] == read


async def test_steps_handed_out_apart_are_read_apart_and_nothing_after_the_end() -> None:
    callers = Callers()
    with callers.opening_stream("r", 8) as send:
        send.send_nowait(GeneratedToken(1))
        send.send_nowait(GeneratedToken(2))
    stream = callers.stream("r", lambda: None)
    assert await stream.__anext__() == TokensGenerated((1, 2))
    send.send_nowait(GeneratedToken(3))
    send.send_nowait(GeneratedToken(4, "length"))
    send.send_nowait(GeneratedToken(5))  # (an engine never sends past an end: not taken)
    assert [item async for item in stream] == [TokensGenerated((3, 4)), Finished("length")]
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


async def test_a_fed_stream_takes_items_until_its_end_and_the_record_goes_after_both_ends() -> None:
    callers, cancelled = Callers(), []
    with callers.opening_stream("r", 4, fed_here=True):
        pass
    callers.feed("r", GeneratedToken(1))
    assert callers.feeding
    stream = callers.stream("r", lambda: cancelled.append("r"))
    assert await stream.__anext__() == TokensGenerated((1,))
    assert callers.get("r") is not None  # read, but still fed
    callers.feed("r", GeneratedToken(2))
    callers.end_feed("r")
    assert [item async for item in stream] == [TokensGenerated((2,))]
    assert callers.get("r") is None and not callers.feeding and cancelled == []
    callers.feed("r", GeneratedToken(3))  # after its end: nothing, nothing kept
    assert callers.get("r") is None


async def test_a_fed_stream_ends_with_the_error_its_source_died_of() -> None:
    callers = Callers()
    for rid in ("r", "s"):
        with callers.opening_stream(rid, 4, fed_here=True):
            pass
    callers.end_feed("s", StatecoreError(client_error("s failed alone")))
    callers.fail_feeds(StatecoreError(client_error("the core is gone")))
    assert not callers.feeding
    for rid, message in (("r", "the core is gone"), ("s", "s failed alone")):
        with pytest.raises(StatecoreError, match=message):
            await callers.stream(rid, lambda: None).__anext__()
    assert callers.get("r") is None and callers.get("s") is None


def test_a_failed_start_or_a_cancel_forgets_a_fed_stream() -> None:
    callers = Callers()
    with pytest.raises(RuntimeError), callers.opening_stream("r", 4, fed_here=True) as send:
        raise RuntimeError("the start failed")
    assert callers.get("r") is None and not callers.feeding
    with pytest.raises(trio.ClosedResourceError):
        send.send_nowait(GeneratedToken(1))
    with callers.opening_stream("r", 4, fed_here=True) as send:
        pass
    callers.drop("r")
    assert callers.get("r") is None and not callers.feeding
    with pytest.raises(trio.ClosedResourceError):
        send.send_nowait(GeneratedToken(1))


class _Handout:
    def __init__(self, on_device: bool) -> None:
        self._on_device = on_device

    def on_device(self) -> bool:
        return self._on_device


def test_a_streamed_prefill_s_handout_is_asked_only_while_its_prefill_runs() -> None:
    callers = Callers()
    with callers.handing_out("r", None):  # no handout (a prefill that hands off nothing): nothing kept
        assert callers.get("r") is None and not callers.pieces_on_device("r")
    with callers.handing_out("r", _Handout(True)), callers.handing_out("s", _Handout(False)):
        assert callers.pieces_on_device("r") and not callers.pieces_on_device("s")
    assert not callers.pieces_on_device("r") and callers.get("r") is None and callers.get("s") is None
    with callers.opening_stream("r", 4) as send, callers.handing_out("r", _Handout(True)):
        pass
    assert callers.get("r") is not None and not callers.pieces_on_device("r")  # its stream is still kept
    callers.close()
    send.close()
