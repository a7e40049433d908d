"""A stream the router starts (`KvStreams.open_for_attach`): what its prefill sends waits until the
decode node attaches, whichever of the two calls comes first; it is attached to once; the router's
call hears the first token alone, or why it will not come; a request that ends unattached leaves
nothing behind."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from effects.kv_pulls import KvStreams
from effects.ports import KvPieces, KvSegment, PrefillReply
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.ids import RequestId

RID = RequestId("r1")
PIECE = KvSegment(0, 4, 0, 2, KvPieces((b"KV",)))
FIRST = PrefillReply(7, False, 64)


async def _read_all(receive: trio.MemoryReceiveChannel[object]) -> list[object]:
    return [item async for item in receive]


async def test_what_the_prefill_sent_before_the_attach_waits_for_it() -> None:
    streams = KvStreams()
    streams.open_for_attach(RID, 4, 2)
    streams.send(RID, PIECE)
    streams.send(RID, FIRST)
    assert await streams.first_reply(RID) == FIRST  # the router's call hears it at once
    streams.send(RID, None)
    receive = await streams.attach(RID, wait_s=1)
    assert await _read_all(receive) == [PIECE, FIRST, None]
    streams.end(RID)
    assert len(streams) == 0 and RID not in streams


async def test_a_decode_node_that_comes_first_waits_for_the_router_s_call() -> None:
    streams = KvStreams()
    attached: list[trio.MemoryReceiveChannel[object]] = []

    async def attach() -> None:
        attached.append(await streams.attach(RID, wait_s=5))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(attach)
        await trio.testing.wait_all_tasks_blocked()
        assert not attached
        streams.open_for_attach(RID, 4, 2)
        streams.send(RID, PIECE)
    streams.send(RID, None)
    assert await _read_all(attached[0]) == [PIECE, None]


async def test_a_stream_is_attached_to_once_and_never_without_its_prefill() -> None:
    streams = KvStreams()
    with pytest.raises(StatecoreError) as never:
        await streams.attach(RID, wait_s=0.01)  # no router call came
    assert never.value.info.code is Code.KV_NOT_FOUND
    streams.open_for_attach(RID, 4, 2)
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
    streams.open_for_attach(RID, 4, 2)
    failed = ErrorInfo(Fault.PEER, Code.ENGINE_FAILED, "the device failed")
    streams.send(RID, failed)
    assert await streams.first_reply(RID) == failed
    receive = await streams.attach(RID, wait_s=1)
    assert await _read_all(receive) == [failed]


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
