"""The KV plane on a real socket, read by the decode node's own client (`adapters.kv.pull`): a
chunked answer arrives byte for byte across its parts (the payload's own memoryviews and small
records), and each part leaves before the next is made; a sized answer is pulled whole; an
answer whose parts fail midway reaches the client as a cut, never as a short success, and its
parts' own cleanup runs; the request's method, target, headers and body reach the handler as sent; a
connection that says nothing leaves the listener serving."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import h11
import pytest
import trio

from adapters.http.node_api import MAX_INTERNAL_BODY
from adapters.kv import pull as kv_pull
from adapters.kv.plane import PlaneAnswer, PlaneRequest, serve_plane
from effects.engine_port import KvBytes

PAYLOAD = bytes(range(256)) * 8192 + b"tail"  # 2 MiB and an odd tail


async def _serving(handler: Callable[[PlaneRequest], Awaitable[PlaneAnswer]],
                   nursery: trio.Nursery, max_body_bytes: int = MAX_INTERNAL_BODY) -> str:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    await nursery.start(serve_plane, listener, handler, max_body_bytes)
    return f"http://127.0.0.1:{listener.socket.getsockname()[1]}"


async def test_a_chunked_answer_arrives_whole_and_each_part_leaves_at_once() -> None:
    asked: list[PlaneRequest] = []
    second_part = trio.Event()

    async def parts() -> AsyncIterator[Sequence[KvBytes]]:
        yield [b"head:", memoryview(PAYLOAD)[: len(PAYLOAD) // 2]]
        await second_part.wait()  # the client must already hold the first part
        yield [memoryview(PAYLOAD)[len(PAYLOAD) // 2 :], b":end"]

    async def handler(request: PlaneRequest) -> PlaneAnswer:
        asked.append(request)
        return PlaneAnswer(200, parts())

    async with trio.open_nursery() as nursery:
        base = await _serving(handler, nursery)
        async with kv_pull.open_stream(f"{base}/internal/prefill_stream?x=1", [("X-Statecore-Token", "t")],
                                       b'{"a": 1}', connect_timeout_s=5) as (status, body):
            assert status == 200 and isinstance(body, kv_pull.StreamBody)
            first = bytearray(5 + len(PAYLOAD) // 2)
            await body.read_into(memoryview(first))
            assert bytes(first) == b"head:" + PAYLOAD[: len(PAYLOAD) // 2]
            second_part.set()
            rest = bytearray(len(PAYLOAD) - len(PAYLOAD) // 2 + 4)
            await body.read_into(memoryview(rest))
            assert bytes(rest) == PAYLOAD[len(PAYLOAD) // 2 :] + b":end"
        nursery.cancel_scope.cancel()
    (request,) = asked
    assert (request.method, request.target) == ("POST", "/internal/prefill_stream?x=1")
    assert request.body == b'{"a": 1}'
    assert request.headers["x-statecore-token"] == "t"


async def test_a_sized_answer_is_pulled_whole_and_an_error_document_keeps_its_status() -> None:
    async def handler(request: PlaneRequest) -> PlaneAnswer:
        if request.target.endswith("/missing"):
            return PlaneAnswer.document(404, b'{"error": {"code": "kv_not_found"}}')

        async def parts() -> AsyncIterator[Sequence[KvBytes]]:
            yield [memoryview(PAYLOAD)[:1000]]
            yield [memoryview(PAYLOAD)[1000:]]

        return PlaneAnswer(200, parts(), len(PAYLOAD))

    async with trio.open_nursery() as nursery:
        base = await _serving(handler, nursery)
        buffers = kv_pull.ReceiveBuffers(1 << 24)
        # a connection that closes without a request leaves the listener serving
        quiet = await trio.open_tcp_stream("127.0.0.1", int(base.rsplit(":", 1)[1]))
        await quiet.aclose()
        pulled = await kv_pull.pull(f"{base}/internal/kv/r1", [], max_bytes=1 << 24,
                                    connect_timeout_s=5, buffers=buffers)
        assert pulled.status == 200 and bytes(pulled.body) == PAYLOAD
        missing = await kv_pull.pull(f"{base}/internal/kv/missing", [], max_bytes=1 << 24,
                                     connect_timeout_s=5, buffers=buffers)
        assert missing.status == 404 and b"kv_not_found" in bytes(missing.body)
        nursery.cancel_scope.cancel()


async def test_an_answer_failing_midway_is_a_cut_and_its_parts_are_closed() -> None:
    closed = trio.Event()

    async def parts() -> AsyncIterator[Sequence[KvBytes]]:
        try:
            yield [memoryview(PAYLOAD)[:4096]]
            raise RuntimeError("the prefill failed")
        finally:
            closed.set()  # where the node's stream cancels its prefill

    async def handler(request: PlaneRequest) -> PlaneAnswer:
        return PlaneAnswer(200, parts())

    async with trio.open_nursery() as nursery:
        base = await _serving(handler, nursery)
        async with kv_pull.open_stream(f"{base}/s", [], b"{}", connect_timeout_s=5) as (status, body):
            assert status == 200 and isinstance(body, kv_pull.StreamBody)
            got = bytearray(4096)
            await body.read_into(memoryview(got))
            with pytest.raises((kv_pull.KvPullError, kv_pull.KvStreamCut)):
                await body.read_into(memoryview(bytearray(1)))
        with trio.fail_after(5):
            await closed.wait()
        nursery.cancel_scope.cancel()


async def test_a_client_that_leaves_mid_body_gets_the_parts_closed() -> None:
    """The decode node going away mid-stream: the write fails, and the parts are closed (the
    node's stream then cancels its prefill) though they never ended on their own."""
    closed = trio.Event()
    big = bytes(32 << 20)  # more than the socket buffers hold: the write is still going on

    async def parts() -> AsyncIterator[Sequence[KvBytes]]:
        try:
            while True:
                yield [memoryview(big)]
        finally:
            closed.set()

    async def handler(request: PlaneRequest) -> PlaneAnswer:
        return PlaneAnswer(200, parts())

    async with trio.open_nursery() as nursery:
        base = await _serving(handler, nursery)
        async with kv_pull.open_stream(f"{base}/s", [], b"{}", connect_timeout_s=5) as (status, body):
            assert status == 200 and isinstance(body, kv_pull.StreamBody)
            await body.read_into(memoryview(bytearray(4096)))
        with trio.fail_after(30):
            await closed.wait()
        nursery.cancel_scope.cancel()


async def test_a_request_body_over_the_nodes_bound_closes_its_connection_unanswered() -> None:
    asked: list[PlaneRequest] = []

    async def handler(request: PlaneRequest) -> PlaneAnswer:
        asked.append(request)
        return PlaneAnswer.document(200, b"{}")

    async with trio.open_nursery() as nursery:
        base = await _serving(handler, nursery, max_body_bytes=1024)
        with pytest.raises((kv_pull.KvPullError, h11.ProtocolError)):  # open_stream's transport errors
            async with kv_pull.open_stream(f"{base}/internal/prefill_stream", [], b"x" * 4096,
                                           connect_timeout_s=5):
                pass
        async with kv_pull.open_stream(f"{base}/internal/prefill_stream", [], b"x" * 1024,
                                       connect_timeout_s=5) as (status, _):
            assert status == 200  # at the bound: answered
        nursery.cancel_scope.cancel()
    assert [len(request.body) for request in asked] == [1024]
