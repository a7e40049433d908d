"""A streamed handoff the router starts itself (`RouterPerformer(attaches=...)`): it posts the
prefill node (`/internal/prefill` with `kv_attach`), then the decode node, which attaches to that
prefill's stream. Over fake engines in process (`fake_nodes`): the answers are the
pulled handoff's and the decode-node-asked stream's, whichever call brings the first token first
(it is told once); a prefill that fails fails the attempt on the prefill node (whichever call
tells the router first) and leaves nothing on either node, and blame goes where an error comes
from, whatever its words name; the router's call to the prefill node failing once the first token
came through the decode node ends nothing (peer health hears of it); the decode node's call is made
once the prefill node's is written. A decode node that leaves its stream, however early, cancels
the prefill."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from adapters.http.internal_wire import PrefillBody, SamplingBody, error_json
from adapters.http.kv_handoff import KvHandoff
from adapters.http.node_api import NodeApi
from adapters.http.peers_httpx import HttpxPeers
from adapters.kv import stream as kv_stream
from adapters.kv.plane import PlaneRequest
from adapters.kv.shm_outbox import ShmOutbox
from effects.fakes import FakeEngine, Faults, fake_info
from effects.faults import DEFAULT_MARKER, NO_FAULTS, FaultPort, Phase, Rule
from effects.faults import Faults as ArmedFaults
from effects.interpret import EnginePerformer, RouterPerformer, router_backend
from effects.ports import GenerationRequest, KvSegment, PrefillOutcome, SamplingParams, SegmentSink
from effects.runner import Instrument, NodeRunner, Timeouts
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.events import KvTaken
from statecore.ids import RequestId
from statecore.intents import Reject
from statecore.routing import RouteCandidate, RouteChoice, choose_route
from statecore.table import PREFILL_REQUEST, ROUTER_REQUEST
from tests.integration.fake_backend import as_scripted, completed
from tests.integration.fake_nodes import FakeNodes, Hosts, start_fake_nodes

PROMPT = list(range(1, 41))
URLS = {"prefill": "http://prefill", "decode": "http://decode"}
WAYS = ("attached", "via-decode", "pulled")


class _LateReplies(Hosts):
    """The router's `/internal/prefill` of an attached stream answers only after the decode node's
    stream has ended: the first token reaches the router through the decode node first."""

    def __init__(self) -> None:
        super().__init__()
        self.decode_done = trio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path == "/internal/decode":
            self.decode_done.set()
        elif request.url.path == "/internal/prefill" and b'"kv_attach"' in request.content:
            await self.decode_done.wait()
        return response


class _PrefillWrittenSlowly(Hosts):
    """The router's `/internal/prefill` of an attached stream is written only once every other
    task waits: the calls in the order they arrived, and when that one was written."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []

    async def sent(self, request: httpx.Request) -> None:
        self.order.append(request.url.path)
        if request.url.path == "/internal/prefill" and b'"kv_attach"' in request.content:
            await trio.testing.wait_all_tasks_blocked()
            self.order.append("written")


class _PrefillEngineLost(Hosts):
    """The prefill node answers the router's call as a node whose engine core process died does
    (its transport lost, in words that name no node); the decode node's calls go through."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/internal/prefill":
            lost = ErrorInfo(Fault.TRANSPORT, Code.TRANSPORT_LOST, "the engine core process is gone")
            return httpx.Response(lost.http_status, json=error_json(lost))
        return await super().handle_async_request(request)


class _PullLost(Hosts):
    """The decode node's pull of a handed-off KV loses its connection to the prefill node."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path.startswith("/internal/kv/"):
            raise httpx.ReadError("the connection dropped", request=request)
        return await super().handle_async_request(request)


class _UnansweredPrefill(Hosts):
    """The router's `/internal/prefill` of an attached stream reaches the prefill node, but its
    answer never reaches the router (until the router gives the call up): whatever the prefill
    node says, the router hears it through the decode node first."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path == "/internal/prefill" and b'"kv_attach"' in request.content:
            await trio.sleep_forever()
        return response


class _EngineCoreLost(FakeEngine):
    """A prefill node whose engine core process died: its prefill fails as a lost transport, in
    words that name no node, and the stream tells its decode node so."""

    async def prefill(self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams,
                      segments: SegmentSink | None = None, device_pieces: bool = False) -> PrefillOutcome:
        lost = ErrorInfo(Fault.TRANSPORT, Code.TRANSPORT_LOST, "the engine core process is gone")
        raise StatecoreError(lost)


class _DecodeEngineCoreLost(FakeEngine):
    """A decode node whose engine core process died as it installed a streamed handoff's KV: its
    own failure, in words that name the prefill node the KV came from."""

    async def install_segments(self, request_id: RequestId, prompt: Sequence[int], first_token: int,
                               sampling: SamplingParams, pieces: int | None = None) -> None:
        raise StatecoreError(ErrorInfo(Fault.TRANSPORT, Code.TRANSPORT_LOST,
                                       f"the engine core process died installing {URLS['prefill']}'s KV"))


class _LastPieceHeldUntilInstall(FakeEngine):
    """A decode node whose last piece's check ends only once the install was asked: a node that
    asked it only after every piece was kept would wait forever."""

    def __init__(self) -> None:
        super().__init__()
        self.install_asked = trio.Event()
        self.waited: list[int] = []  # the pieces whose check waited for the install

    async def receive_segment(self, request_id: RequestId, segment: KvSegment, prompt_tokens: int, *,
                              max_tokens: int, index: int | None = None) -> None:
        if segment.stop == prompt_tokens:
            self.waited.append(segment.stop)
            await self.install_asked.wait()
        await super().receive_segment(request_id, segment, prompt_tokens, max_tokens=max_tokens, index=index)

    async def install_segments(self, request_id: RequestId, prompt: Sequence[int], first_token: int,
                               sampling: SamplingParams, pieces: int | None = None) -> None:
        self.install_asked.set()
        await super().install_segments(request_id, prompt, first_token, sampling, pieces=pieces)


class _PrefillCallDropsLate(Hosts):
    """The router's `/internal/prefill` of an attached stream loses its connection once the first
    token came through the decode node's stream, which holds its next lines until the router
    has heard of the drop."""

    def __init__(self) -> None:
        super().__init__()
        self.first_told = trio.Event()  # the router asked for the line after the first token's
        self.dropped = trio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path == "/internal/decode":
            lines = (await response.aread()).splitlines(keepends=True)
            return httpx.Response(response.status_code, stream=_HeldAfterFirstToken(lines, self))
        if request.url.path == "/internal/prefill" and b'"kv_attach"' in request.content:
            await self.first_told.wait()
            self.dropped.set()
            raise httpx.ReadError("the connection dropped", request=request)
        return response


class _HeldAfterFirstToken(httpx.AsyncByteStream):
    def __init__(self, lines: list[bytes], hosts: _PrefillCallDropsLate) -> None:
        self.lines = lines
        self.hosts = hosts

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for line in self.lines:
            yield line
            if b'"first_token"' in line:  # the router relayed it: it asks for more
                self.hosts.first_told.set()
                await self.hosts.dropped.wait()
                await trio.testing.wait_all_tasks_blocked()  # the router's call heard the drop


class _Routers:
    def __init__(self, nodes: FakeNodes, nursery: trio.Nursery) -> None:
        self.nodes = nodes
        self.nursery = nursery
        self.peers: list[HttpxPeers] = []
        self.failures: list[tuple[str, ErrorInfo]] = []

    async def generate(self, way: str, rid: str, prompt: Sequence[int] = PROMPT) -> list[Any]:
        """One request through a router of its own that hands off `way`: its outputs."""
        peers = HttpxPeers(transport=self.nodes.hosts)
        self.peers.append(peers)

        def route(avoid: set[str], prompt: Sequence[int], request_id: str) -> RouteChoice:
            return choose_route(len(prompt), [RouteCandidate(URLS["decode"], 0)], 0, 0)

        performer = RouterPerformer(peers, lambda role, *_: URLS[role], route, max_attempts=1,
                                    on_peer_failure=lambda node, error: self.failures.append((node, error)),
                                    streams=lambda prefill, decode: way != "pulled",
                                    attaches=lambda prefill, decode: way == "attached")
        runner: NodeRunner[Any] = NodeRunner(ROUTER_REQUEST, performer, timeouts=Timeouts(deadline_s=5.0))
        await self.nursery.start(runner.run)
        backend = router_backend(runner, performer, lambda: self.nodes.prefill.info, local_prefill_below=0)
        generation = await backend.start(GenerationRequest(RequestId(rid), tuple(prompt), SamplingParams(5)))
        return [output async for output in generation]

    def left(self) -> list[str]:
        """What either node still holds or waits for."""
        found = []
        for role in ("prefill", "decode"):
            performer, runner = self.nodes.performers[role], self.nodes.runners[role]
            if len(performer.kv_streams) or len(performer.kv_pulls) or runner.statistics().live_requests:
                found.append(f"{role}: streams {len(performer.kv_streams)}, pulls {len(performer.kv_pulls)}, "
                             f"live {runner.statistics().live_requests}")
        found += [f"{role} holds {sorted(engine.held)}" for role, engine in
                  (("prefill", self.nodes.prefill), ("decode", self.nodes.decode)) if engine.held]
        return found


@contextlib.asynccontextmanager
async def _routers(nursery: trio.Nursery, hosts: Hosts | None = None,
                   **nodes: Any) -> AsyncIterator[_Routers]:
    """Both fake nodes (behind `hosts`; `nodes`: as `start_fake_nodes` takes) and the routers a
    test makes; every client closed after."""
    built = _Routers(await start_fake_nodes(nursery, hosts, **nodes), nursery)
    try:
        yield built
    finally:
        for peers in [built.nodes.peers, *built.peers]:
            await peers.aclose()


async def _settled(routers: _Routers) -> None:
    """Nothing is left on either node: their parts end a moment after the router's (the decode
    node's DELETE, the cancels)."""
    with trio.move_on_after(5):
        while routers.left():
            await trio.sleep(0.01)
    assert not routers.left(), routers.left()


async def test_the_router_started_stream_answers_as_the_other_ways(nursery: trio.Nursery) -> None:
    async with _routers(nursery) as routers:
        answers = {way: [as_scripted(output) for output in await routers.generate(way, f"r-{way}")]
                   for way in WAYS}
        assert answers["attached"] == answers["via-decode"] == answers["pulled"]
        records = {record["request_id"]: record
                   for record in routers.nodes.performers["decode"].handoffs.snapshot()["records"]}
        assert (records["r-attached"]["streamed"], records["r-attached"]["attached"]) == (True, True)
        assert (records["r-via-decode"]["streamed"], records["r-via-decode"]["attached"]) == (True, False)
        # the attached stream's prefill was asked by the router, with the decode node's call beside it
        assert routers.nodes.hosts.queries.count(("/internal/prefill", "")) == 2  # attached, pulled
        await _settled(routers)


async def test_the_prefill_nodes_call_is_written_before_the_decode_nodes_is_made(
        nursery: trio.Nursery) -> None:
    """The first token waits on the prefill, not on the decode node's call: that call (its body
    encoded, then sent) starts only once the prefill node's request is written."""
    hosts = _PrefillWrittenSlowly()
    async with _routers(nursery, hosts) as routers:
        pulled = [as_scripted(output) for output in await routers.generate("pulled", "r-pulled")]
        hosts.order.clear()
        attached = [as_scripted(output) for output in await routers.generate("attached", "r-attached")]
        assert attached == pulled
        calls = [step for step in hosts.order if step in ("/internal/prefill", "written", "/internal/decode")]
        assert calls == ["/internal/prefill", "written", "/internal/decode"]
        await _settled(routers)


async def test_the_first_token_is_told_once_when_the_decode_node_brings_it_first(
        nursery: trio.Nursery) -> None:
    async with _routers(nursery, _LateReplies()) as routers:
        pulled = [as_scripted(output) for output in await routers.generate("pulled", "r-pulled")]
        attached = [as_scripted(output) for output in await routers.generate("attached", "r-attached")]
        assert attached == pulled
        await _settled(routers)


async def test_a_prefill_that_fails_fails_the_attempt_alone(nursery: trio.Nursery) -> None:
    async with _routers(nursery) as routers:
        routers.nodes.prefill.faults = Faults(fail={"prefill"})
        outputs = await routers.generate("attached", "r-failed", [*PROMPT, Faults().marker])
        assert isinstance(outputs[-1], Reject), outputs
        assert outputs[-1].error.code is Code.INJECTED_FAULT
        await _settled(routers)


@pytest.mark.parametrize("told_first_by", ["prefill", "decode"])
async def test_a_prefill_node_that_fails_is_the_one_blamed(nursery: trio.Nursery, told_first_by: str) -> None:
    """Whichever call tells the router first: the prefill node refusing the router's call (the
    decode node's attach then finds no prefill: the router's cancel ends its wait at once), or its
    prefill failing, which the decode node's call relays from the stream before the router's
    own call answers. The prefill node is the one blamed (and avoided by a retry), never the decode
    node that told it."""
    hosts = _PrefillEngineLost() if told_first_by == "prefill" else _UnansweredPrefill()
    engine = None if told_first_by == "prefill" else _EngineCoreLost()
    async with _routers(nursery, hosts, prefill_engine=engine) as routers:
        outputs = await routers.generate("attached", "r-lost")
        assert isinstance(outputs[-1], Reject), outputs
        assert outputs[-1].error.code is Code.TRANSPORT_LOST
        assert [node for node, _ in routers.failures] == [URLS["prefill"]]
        await _settled(routers)


async def test_a_pulled_kv_lost_on_its_way_blames_the_prefill_node(nursery: trio.Nursery) -> None:
    """The decode node's pull loses the prefill node after the first token: the request fails
    (typed), and the prefill node is blamed, not the decode node whose call told the router."""
    async with _routers(nursery, _PullLost()) as routers:
        outputs = await routers.generate("pulled", "r-pull-lost")
        assert isinstance(outputs[-1], Reject), outputs
        assert outputs[-1].error.code is Code.TRANSPORT_LOST
        assert [node for node, _ in routers.failures] == [URLS["prefill"]]
        await _settled(routers)


@pytest.mark.parametrize("way", ["attached", "via-decode"])
async def test_a_decode_node_that_fails_itself_is_the_one_blamed_whatever_its_words_name(
        nursery: trio.Nursery, way: str) -> None:
    """Blame follows where the error comes from (`ErrorInfo.origin`), not the node its message
    names: the decode node's own failure names the prefill node, and the decode node is blamed."""
    async with _routers(nursery, decode_engine=_DecodeEngineCoreLost()) as routers:
        outputs = await routers.generate(way, f"r-{way}")
        assert isinstance(outputs[-1], Reject), outputs
        assert outputs[-1].error.code is Code.TRANSPORT_LOST
        assert [node for node, _ in routers.failures] == [URLS["decode"]]
        await _settled(routers)


async def test_a_decode_node_asks_the_install_as_its_stream_ends_not_after_the_last_piece_s_check(
        nursery: trio.Nursery) -> None:
    """The decode node asks its engine to install as soon as the stream has ended (every piece
    handed to the engine), beside the last piece's check, which the install waits for: one round
    trip fewer between the prefill's end and the join. The answers are the pulled handoff's."""
    engine = _LastPieceHeldUntilInstall()
    async with _routers(nursery, decode_engine=engine) as routers:
        pulled = [as_scripted(output) for output in await routers.generate("pulled", "r-pulled")]
        for way in ("attached", "via-decode"):
            with trio.fail_after(10):
                streamed = [as_scripted(output) for output in await routers.generate(way, f"r-{way}")]
            assert streamed == pulled
        assert engine.waited == [len(PROMPT), len(PROMPT)]  # each stream's last piece waited
        await _settled(routers)


async def test_a_prefill_call_that_fails_after_the_first_token_leaves_the_stream_going(
        nursery: trio.Nursery) -> None:
    """Once the first token came through the decode node, the prefill node's part is done: the
    router's own call to it losing its connection then ends nothing (the decode node's DELETE
    frees the prefill node's cache), but peer health hears that the prefill node failed a call."""
    async with _routers(nursery, _PrefillCallDropsLate()) as routers:
        pulled = [as_scripted(output) for output in await routers.generate("pulled", "r-pulled")]
        attached = [as_scripted(output) for output in await routers.generate("attached", "r-dropped")]
        assert attached == pulled
        assert [(node, error.code) for node, error in routers.failures] == [
            (URLS["prefill"], Code.TRANSPORT_LOST)]
        await _settled(routers)


async def test_how_a_decode_node_takes_pieces_is_remembered_for_its_next_stream(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    """Where the decode node that attached took pieces in GPU memory, the prefill node makes the
    next stream's pieces so from its start; a decode node that then cannot read them fails that
    request (typed) and its next one goes the host's way again."""
    outbox = ShmOutbox(checksum=False, max_bytes=16 << 20, directory=str(tmp_path))
    cuda_like = replace(fake_info(), device_pieces=True)  # a prefill node that offers device pieces
    try:
        async with _routers(nursery, prefill_info=cuda_like, shm=outbox) as routers:
            decode_peers = routers.nodes.peers
            decode_peers.takes_device_pieces = True
            pulled = [as_scripted(output) for output in await routers.generate("pulled", "r-pulled")]
            first = [as_scripted(output) for output in await routers.generate("attached", "r-1")]
            second = [as_scripted(output) for output in await routers.generate("attached", "r-2")]
            decode_peers.takes_device_pieces = False  # as a decode node that cannot read them
            refused = await routers.generate("attached", "r-3")
            fourth = [as_scripted(output) for output in await routers.generate("attached", "r-4")]
            assert first == second == fourth == pulled
            assert isinstance(refused[-1], Reject) and refused[-1].error.code is Code.KV_MALFORMED, refused
            sent = {record["request_id"]: record["transport"]
                    for record in routers.nodes.performers["prefill"].handoffs.snapshot()["records"]}
            # r-1 learns it at its attach; r-2 is made so from its start; r-4 after the refusal
            assert (sent["r-1"], sent["r-2"], sent["r-4"]) == ("shm", "gpu", "shm"), sent
            await _settled(routers)
    finally:
        outbox.close()


async def test_a_first_token_that_ends_the_request_ends_both_calls(nursery: trio.Nursery) -> None:
    async with _routers(nursery) as routers:
        routers.nodes.prefill.eos_at = 1
        outputs = [as_scripted(output) for output in await routers.generate("attached", "r-eos")]
        assert outputs == [completed("stop")]
        await _settled(routers)


# -- one prefill node's routes called directly: how a stream's decode node leaving, or attaching
# early, reaches the request

class _Cancels(Instrument):
    """The generations a runner's instruments heard given up."""

    def __init__(self) -> None:
        self.cancelled: list[RequestId] = []

    def generation_cancelled(self, request_id: RequestId) -> None:
        self.cancelled.append(request_id)


@dataclass
class _PrefillNode:
    handoff: KvHandoff  # its KV routes
    runner: NodeRunner[Any]
    cancels: _Cancels  # what its runner's instruments heard
    answered: list[Response] = field(default_factory=list)  # the router's calls' answers

    async def router_call(self, rid: RequestId, prompt: Sequence[int]) -> None:
        """The router's `/internal/prefill` with `kv_attach`, its answer kept."""
        self.answered.append(await self.handoff.start_stream(_prefill_body(rid, prompt), cached_tokens=False))

    async def answer_statuses(self) -> list[int]:
        """The router's call's answer once it came (its status)."""
        with trio.move_on_after(5):
            while not self.answered:
                await trio.sleep(0.01)
        return [response.status_code for response in self.answered]


@contextlib.asynccontextmanager
async def _prefill_node(nursery: trio.Nursery, engine: FakeEngine,
                        faults: FaultPort = NO_FAULTS) -> AsyncIterator[_PrefillNode]:
    """A prefill node over `engine`; nothing is left on it after the block."""
    performer = EnginePerformer(engine, None, faults=faults)
    runner: NodeRunner[Any] = NodeRunner(PREFILL_REQUEST, performer, timeouts=Timeouts(deadline_s=60.0))
    cancels = _Cancels()
    runner.instruments.add(cancels)
    await nursery.start(runner.run)
    yield _PrefillNode(NodeApi("prefill", engine, runner, performer).kv_handoff, runner, cancels)
    with trio.move_on_after(5):
        while len(performer.kv_streams) or runner.statistics().live_requests:
            await trio.sleep(0.01)
    assert (len(performer.kv_streams), runner.statistics().live_requests) == (0, 0)


def _prefill_body(rid: str, prompt: Sequence[int], *, kv_attach: bool = False) -> PrefillBody:
    return PrefillBody(request_id=rid, prompt=list(prompt), sampling=SamplingBody(max_tokens=5),
                       kv_attach=kv_attach)


async def _never_disconnects() -> Message:
    await trio.sleep_forever()
    raise AssertionError("unreachable")


async def _send_fails(message: Message) -> None:
    raise trio.BrokenResourceError("the decode node left")


async def _leave(node: _PrefillNode, body: bytes, when: str) -> None:
    """The decode node asks for the stream (`body`), then leaves it `when`."""
    if when == "mid-prefill":
        records = await node.handoff.open_prefill_stream(body)
        assert await anext(records) == [kv_stream.preamble()]
        assert node.cancels.cancelled == []
        await records.aclose()
    elif when == "before-the-plane-head":
        answer = await node.handoff.plane(PlaneRequest("POST", "/internal/prefill_stream", {}, body))
        assert answer.status == 200
        async with contextlib.aclosing(answer.parts):  # type: ignore[type-var]
            pass  # as the plane closes it when the answer's head could not be written
    else:  # before the HTTP response's start could be sent
        scope = {"type": "http", "method": "POST", "path": "/internal/prefill_stream", "headers": []}

        async def receive() -> Message:
            return {"type": "http.request", "body": body, "more_body": False}

        response = await node.handoff.prefill_stream(Request(scope, receive))
        with pytest.raises(BaseExceptionGroup) as left:
            await response(scope, _never_disconnects, _send_fails)
        assert left.group_contains(trio.BrokenResourceError)


@pytest.mark.parametrize("when", ["mid-prefill", "before-the-http-start", "before-the-plane-head"])
@pytest.mark.parametrize("attached", [True, False], ids=["attached", "asked-by-the-decode-node"])
async def test_a_decode_node_that_leaves_a_stream_cancels_its_request_as_its_client(
        nursery: trio.Nursery, attached: bool, when: str) -> None:
    """Whether the router started the stream or the decode node asked for it, a decode node that
    leaves it, mid-prefill or before its first record was asked for, cancels the request through
    its generation (rather than its cache being held until the router's cancel or the lease): the
    runner's instruments hear the cancel, as they hear a front end's client leaving."""
    engine = FakeEngine(Faults(stall={"prefill"}))  # the stream stays open until left
    prompt = [*PROMPT, Faults().marker]
    rid = RequestId("r-left")
    async with _prefill_node(nursery, engine) as node:
        if attached:
            nursery.start_soon(node.router_call, rid, prompt)
        await _leave(node, _prefill_body(rid, prompt, kv_attach=attached).model_dump_json().encode(), when)
        assert node.cancels.cancelled == [rid]
        if attached:  # the router's call hears that the request ended before its KV was sent
            assert await node.answer_statuses() == [404]


async def test_a_decode_node_that_attaches_to_another_prompt_frees_the_prefill(nursery: trio.Nursery) -> None:
    """It hears KV_NOT_FOUND, and the request whose stream it took is cancelled (nobody else can
    attach to it), rather than holding its cache until the lease."""
    prompt = [*PROMPT, Faults().marker]
    rid = RequestId("r-other")
    async with _prefill_node(nursery, FakeEngine(Faults(stall={"prefill"}))) as node:
        nursery.start_soon(node.router_call, rid, prompt)
        other = _prefill_body(rid, prompt[1:], kv_attach=True).model_dump_json().encode()
        with pytest.raises(StatecoreError) as refused:
            await node.handoff.open_prefill_stream(other)
        assert refused.value.info.code is Code.KV_NOT_FOUND
        assert node.cancels.cancelled == [rid]
        assert await node.answer_statuses() == [404]


async def test_a_decode_node_that_attaches_during_the_admission_waits_for_it(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    """The router's call opens the stream, then admits the request (here slowly): a decode node
    that attaches in between waits for the admission and reads the whole stream, rather than
    hearing that the request ended."""
    rid = RequestId(f"r-{DEFAULT_MARKER}-slow-{Phase.INTAKE.value}")
    slow_intake = ArmedFaults((Rule(Phase.INTAKE, slow_s=1.0),))
    async with _prefill_node(nursery, FakeEngine(), slow_intake) as node:
        nursery.start_soon(node.router_call, rid, PROMPT)
        await trio.testing.wait_all_tasks_blocked()  # the router's call waits in its admission
        attach = _prefill_body(rid, PROMPT, kv_attach=True).model_dump_json().encode()
        records = [parts async for parts in await node.handoff.open_prefill_stream(attach)]
        assert records[-1] == [kv_stream.end_record(len(PROMPT), 2)]  # both pieces of the fake prefill
        await node.runner.post(rid, KvTaken())  # the decode node's DELETE once installed
        assert await node.answer_statuses() == [200]
        assert node.cancels.cancelled == []
