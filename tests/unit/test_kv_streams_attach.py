"""A stream the router starts (`KvStreams.open_for_attach`): what its prefill sends waits until the
decode node attaches, whichever of the two calls comes first, and the attach waits until the
request is admitted (`ready_for_attach`), whose cancel it is handed; it is attached to once; the
router's call hears the first token alone, or why it will not come; a request that ends unattached
leaves nothing behind."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from effects.kv_pulls import AttachedStream, KvStreams, StreamItem
from effects.ports import KvPieces, KvSegment, PrefillReply
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.ids import RequestId

RID = RequestId("r1")
PIECE = KvSegment(0, 4, 0, 2, KvPieces((b"KV",)))
FIRST = PrefillReply(7, False, 64)


async def _read_all(receive: trio.MemoryReceiveChannel[StreamItem]) -> list[StreamItem]:
    return [item async for item in receive]


async def _cancel() -> None:
    raise AssertionError("no test here cancels its request")


def _started(streams: KvStreams) -> None:
    """The router's call: the stream opened, then its request admitted."""
    streams.open_for_attach(RID, 4, 2)
    streams.ready_for_attach(RID, _cancel)


async def test_what_the_prefill_sent_before_the_attach_waits_for_it() -> None:
    streams = KvStreams()
    _started(streams)
    streams.send(RID, PIECE)
    streams.send(RID, FIRST)
    assert await streams.first_reply(RID) == FIRST  # the router's call hears it at once
    streams.send(RID, None)
    attached = await streams.attach(RID, wait_s=1)
    assert attached.cancel is _cancel
    assert await _read_all(attached.items) == [PIECE, FIRST, None]
    streams.end(RID)
    assert len(streams) == 0 and RID not in streams


async def test_a_decode_node_that_comes_first_waits_for_the_router_s_call() -> None:
    streams = KvStreams()
    attached: list[AttachedStream] = []

    async def attach() -> None:
        attached.append(await streams.attach(RID, wait_s=5))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(attach)
        await trio.testing.wait_all_tasks_blocked()
        assert not attached
        _started(streams)
        streams.send(RID, PIECE)
    streams.send(RID, None)
    assert await _read_all(attached[0].items) == [PIECE, None]


async def test_an_attach_waits_for_its_request_to_be_admitted() -> None:
    """The router's call opens the stream before it admits the request (so that nothing the
    prefill sends is lost): a decode node attaching in between waits for the admission, which
    hands it the request's cancel."""
    streams = KvStreams()
    streams.open_for_attach(RID, 4, 2)
    attached: list[AttachedStream] = []

    async def attach() -> None:
        attached.append(await streams.attach(RID, wait_s=5))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(attach)
            await trio.testing.wait_all_tasks_blocked()
            assert not attached  # opened, not yet admitted
            streams.send(RID, PIECE)
            streams.ready_for_attach(RID, _cancel)
    streams.send(RID, None)
    assert attached[0].cancel is _cancel
    assert await _read_all(attached[0].items) == [PIECE, None]


async def test_an_attach_never_admitted_in_time_is_refused() -> None:
    streams = KvStreams()
    streams.open_for_attach(RID, 4, 2)
    with pytest.raises(StatecoreError) as late:
        await streams.attach(RID, wait_s=0.01)
    assert late.value.info.code is Code.KV_NOT_FOUND
    streams.ready_for_attach(RID, _cancel)  # it still may be, once


async def test_a_stream_is_attached_to_once_and_never_without_its_prefill() -> None:
    streams = KvStreams()
    with pytest.raises(StatecoreError) as never:
        await streams.attach(RID, wait_s=0.01)  # no router call came
    assert never.value.info.code is Code.KV_NOT_FOUND
    _started(streams)
    await streams.attach(RID, wait_s=1)
    with pytest.raises(StatecoreError) as twice:
        await streams.attach(RID, wait_s=0.01)
    assert twice.value.info.code is Code.KV_NOT_FOUND
    with pytest.raises(StatecoreError):
        streams.open_for_attach(RID, 4, 2)  # a duplicate request id


async def test_a_request_that_ends_unattached_tells_the_router_and_leaves_nothing() -> None:
    streams = KvStreams()
    streams.open_for_attach(RID, 4, 2)
    streams.send(RID, PIECE)
    streams.end(RID)  # cancelled before its first token
    told = await streams.first_reply(RID)
    assert isinstance(told, ErrorInfo) and told.code is Code.KV_NOT_FOUND
    assert len(streams) == 0 and RID not in streams
    with pytest.raises(StatecoreError):
        await streams.attach(RID, wait_s=0.01)


async def test_a_failed_prefill_s_error_reaches_both_calls() -> None:
    streams = KvStreams()
    _started(streams)
    failed = ErrorInfo(Fault.PEER, Code.ENGINE_FAILED, "the device failed")
    streams.send(RID, failed)
    assert await streams.first_reply(RID) == failed
    attached = await streams.attach(RID, wait_s=1)
    assert await _read_all(attached.items) == [failed]


async def test_a_decode_node_that_attaches_after_the_request_failed_hears_why() -> None:
    streams = KvStreams()
    streams.open_for_attach(RID, 4, 2)
    streams.send(RID, PIECE)
    streams.send(RID, FIRST)
    failed = ErrorInfo(Fault.BUG, Code.INJECTED_FAULT, "injected fault in kv_encode")
    streams.send(RID, failed)
    streams.end(RID)  # the request failed and ended before its decode node attached
    assert len(streams) == 0 and RID not in streams  # its pieces are gone
    with pytest.raises(StatecoreError) as late:
        await streams.attach(RID, wait_s=5)
    assert late.value.info == failed  # at once, not after the wait


async def test_a_decode_node_waiting_when_the_request_ends_hears_it_at_once() -> None:
    streams = KvStreams()
    heard: list[ErrorInfo] = []

    async def attach() -> None:
        with pytest.raises(StatecoreError) as gone:
            await streams.attach(RID, wait_s=30)
        heard.append(gone.value.info)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(attach)
            await trio.testing.wait_all_tasks_blocked()
            streams.open_for_attach(RID, 4, 2)
            streams.end(RID)  # cancelled before anyone attached
    assert [info.code for info in heard] == [Code.KV_NOT_FOUND]
