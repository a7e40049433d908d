"""Prompt tokens details (`--enable-prompt-tokens-details`): how many of a request's prompt tokens
its prefill took from the prefix cache reaches the client's usage.

A single node on a tiny real checkpoint over HTTP (chat and completions, whole and streamed, the
Responses and Messages APIs): a first prompt reports 0, a follow-up that starts like it its whole
shared chunks; with the flag off every body is byte for byte what it was (the same bodies less the
details). Then the cluster's wire over fake engines, in process: the router asks the prefill node
(`?cached_tokens=1`) and a decode node that prefills locally (a first token that is EOS too), and
only then do they answer with the count; without the flag the wire is today's.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import trio

from adapters.frontend.app import build_app
from adapters.frontend.frontend import Frontend
from adapters.http.internal_wire import PrefillReplyBody, output_line, parse_output_line
from adapters.http.peers_httpx import HttpxPeers
from adapters.mlx import MlxEngine
from effects.fakes import FakeEngine
from effects.interpret import EnginePerformer, RouterPerformer, local_backend, router_backend
from effects.ports import GenerationRequest, PrefillReply, SamplingParams
from effects.runner import NodeRunner, Timeouts
from statecore.events import TokensGenerated
from statecore.ids import RequestId
from statecore.routing import RouteCandidate, RouteChoice, choose_route
from statecore.table import DECODE_REQUEST, ROUTER_REQUEST
from support.tiny_models import cached_checkpoint
from tests.integration.engines import close_engine, load_engine
from tests.integration.fake_backend import as_scripted, completed
from tests.integration.fake_nodes import Hosts, start_fake_nodes

CHUNK = 16  # the prefix cache keeps whole prefill chunks: small ones, so short prompts share some
OPENING = " ".join(f"The lighthouse keeper counted ship number {i} at dawn." for i in range(6))
FOLLOW_UP = OPENING + " Then the fog rolled in."


# -- a single node on a real engine ---------------------------------------------------------------


@dataclass
class Single:
    details: httpx.AsyncClient  # the front end with prompt tokens details on
    plain: httpx.AsyncClient  # the same backend's front end with them off (the default)
    engine: MlxEngine


@pytest.fixture
async def single(nursery: trio.Nursery) -> AsyncIterator[Single]:
    path = cached_checkpoint("llama")
    engine = await load_engine(path, prefill_chunk_size=CHUNK)
    performer = EnginePerformer(engine)
    runner: NodeRunner[Any] = NodeRunner(DECODE_REQUEST, performer, name="single")
    await nursery.start(runner.run)
    backend = local_backend(runner, performer)
    apps = [build_app(Frontend.load(path, backend, prompt_tokens_details=on)) for on in (True, False)]
    try:
        async with (
            httpx.AsyncClient(transport=httpx.ASGITransport(app=apps[0]), base_url="http://on") as on,
            httpx.AsyncClient(transport=httpx.ASGITransport(app=apps[1]), base_url="http://off") as off,
        ):
            yield Single(on, off, engine)
    finally:
        await close_engine(engine)


def _completion(prompt: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _chat(content: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}], "max_tokens": 6,
                            "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _usage(response: httpx.Response, stream: bool) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    if not stream:
        usage: dict[str, Any] = response.json()["usage"]
        return usage
    chunks = [json.loads(line[len("data: "):]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    return usage


def _without_details(body: bytes) -> bytes:
    """A body with prompt tokens details as one without them: the details taken out, and the
    ids and times (which differ between any two requests) made equal."""
    body = re.sub(rb',"prompt_tokens_details":\{"cached_tokens":\d+\}', b"", body)
    body = re.sub(rb'"cache_read_input_tokens":\d+,', b"", body)
    body = re.sub(rb'"input_tokens":\d+', b'"input_tokens":0', body)
    body = re.sub(rb'"(input_tokens_details)":\{"cached_tokens":\d+\}', rb'"\1":{"cached_tokens":0}', body)
    body = re.sub(rb'(cmpl|chatcmpl|msg|resp)[-_][0-9a-f]{32}', b"ID", body)
    return re.sub(rb'"(created|created_at)":\d+', rb'"\1":0', body)


@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_a_follow_up_reports_the_prompt_tokens_its_prefill_took_from_the_cache(
    single: Single, kind: str
) -> None:
    path, make = (("/v1/completions", _completion) if kind == "completions"
                  else ("/v1/chat/completions", _chat))
    # each prompt twice, streamed and not: the first time computed, the second from the cache
    opening = _usage(await single.details.post(path, json=make(OPENING, False)), False)
    assert opening["prompt_tokens"] > 3 * CHUNK and opening["prompt_tokens_details"] == {"cached_tokens": 0}
    again = _usage(await single.details.post(path, json=make(OPENING, True)), True)
    whole = (opening["prompt_tokens"] - 1) // CHUNK * CHUNK  # every whole chunk before the last token
    if kind == "completions":
        assert again["prompt_tokens_details"] == {"cached_tokens": whole}
    else:  # a block also ends after the user message's end-of-turn token: the template's tail is computed
        assert whole - CHUNK < again["prompt_tokens_details"]["cached_tokens"] < opening["prompt_tokens"] - 1
    follow = _usage(await single.details.post(path, json=make(FOLLOW_UP, True)), True)
    assert follow["prompt_tokens"] > opening["prompt_tokens"]
    assert CHUNK <= follow["prompt_tokens_details"]["cached_tokens"] <= opening["prompt_tokens"]
    assert follow["prompt_tokens_details"]["cached_tokens"] % CHUNK == 0
    assert list(follow) == ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"]
    follow_again = _usage(await single.details.post(path, json=make(FOLLOW_UP, False)), False)
    assert follow_again["prompt_tokens_details"]["cached_tokens"] >= follow["prompt_tokens_details"][
        "cached_tokens"]


async def test_with_the_flag_off_every_body_is_todays(single: Single) -> None:
    """The same requests through the front end without the flag (the prompts cached by now):
    byte for byte the bodies with the details, less the details; usage without any."""
    requests = [(path, make(text, stream)) for path, make in (("/v1/completions", _completion),
                                                              ("/v1/chat/completions", _chat))
                for text in (OPENING, OPENING) for stream in (False, True)]
    for path, body in requests:
        on = await single.details.post(path, json=body)
        off = await single.plain.post(path, json=body)
        assert b'"prompt_tokens_details"' in on.content and b"prompt_tokens_details" not in off.content
        assert _without_details(on.content) == _without_details(off.content)
        assert set(_usage(off, body["stream"])) == {"prompt_tokens", "completion_tokens", "total_tokens"}


async def test_responses_and_messages_report_it_in_their_own_shapes(single: Single) -> None:
    model = (await single.plain.get("/v1/models")).json()["data"][0]["id"]
    responses = {"input": OPENING, "max_output_tokens": 6, "temperature": 0}
    messages = {"model": model, "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "user", "content": OPENING}]}
    first = (await single.details.post("/v1/responses", json=responses)).json()["usage"]
    assert first["input_tokens_details"] == {"cached_tokens": 0}
    again = (await single.details.post("/v1/responses", json=responses)).json()["usage"]
    assert again["input_tokens_details"]["cached_tokens"] > 0
    assert again["input_tokens"] == first["input_tokens"]  # OpenAI's input_tokens counts them
    plain = await single.plain.post("/v1/responses", json=responses)
    assert plain.json()["usage"]["input_tokens_details"] == {"cached_tokens": 0}  # as ever

    total = (await single.plain.post("/v1/messages", json=messages)).json()["usage"]
    assert set(total) == {"input_tokens", "output_tokens"}  # without the flag: as ever
    usage = (await single.details.post("/v1/messages", json=messages)).json()["usage"]
    cached = usage["cache_read_input_tokens"]
    assert cached > 0 and usage["input_tokens"] + cached == total["input_tokens"]  # Anthropic's sum
    streamed = await single.details.post("/v1/messages", json={**messages, "stream": True})
    start = next(json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
                 if line.startswith("data: ") and '"message_start"' in line)
    assert start["message"]["usage"] == {**usage, "output_tokens": 0}
    for path, body in (("/v1/responses", responses), ("/v1/messages", messages),
                       ("/v1/messages", {**messages, "stream": True})):
        on, off = await single.details.post(path, json=body), await single.plain.post(path, json=body)
        assert _without_details(on.content) == _without_details(off.content)


# -- the cluster's wire, over fake engines ---------------------------------------------------------


class _WatchedPeers(HttpxPeers):
    """The router's peers, noting what the router counted as being prefilled at each call."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.prefilling: dict[str, int] = {}
        self.seen: list[dict[str, int]] = []

    async def prefill(self, node: str, *args: Any, **kwargs: Any) -> PrefillReply:
        self.seen.append(dict(self.prefilling))
        return await super().prefill(node, *args, **kwargs)

    def decode(self, node: str, call: Any) -> Any:
        self.seen.append(dict(self.prefilling))
        return super().decode(node, call)


@dataclass
class FakeCluster:
    prefill: FakeEngine
    decode: FakeEngine
    hosts: Hosts
    nursery: trio.Nursery
    routers: list[HttpxPeers]
    performers: list[RouterPerformer] = field(default_factory=list)

    async def generate(self, prompt: Sequence[int], *, details: bool, local_prefill_below: int = 0,
                       rid: str = "r") -> tuple[list[Any], int]:
        """One request through a router of its own: its outputs, and the cached tokens its
        generation reports."""
        peers = _WatchedPeers(transport=self.hosts, prompt_tokens_details=details)
        self.routers.append(peers)
        urls = {"prefill": "http://prefill", "decode": "http://decode"}
        def route(avoid: set[str], prompt: Sequence[int], request_id: str) -> RouteChoice:
            return choose_route(len(prompt), [RouteCandidate(urls["decode"], 0)], local_prefill_below, 0)

        performer = RouterPerformer(peers, lambda role, *_: urls[role], route)
        peers.prefilling = performer.prefilling
        self.performers.append(performer)
        runner: NodeRunner[Any] = NodeRunner(ROUTER_REQUEST, performer, timeouts=Timeouts(deadline_s=5.0))
        await self.nursery.start(runner.run)
        backend = router_backend(runner, performer, lambda: self.prefill.info,
                                 local_prefill_below=local_prefill_below)
        generation = await backend.start(GenerationRequest(RequestId(rid), tuple(prompt), SamplingParams(5)))
        outputs = [output async for output in generation]
        return outputs, generation.cached_tokens


@pytest.fixture
async def fake_cluster(nursery: trio.Nursery) -> AsyncIterator[FakeCluster]:
    nodes = await start_fake_nodes(nursery)
    built = FakeCluster(nodes.prefill, nodes.decode, nodes.hosts, nursery, [])
    yield built
    for peers in [nodes.peers, *built.routers]:
        await peers.aclose()


async def test_the_node_that_prefilled_tells_the_router_only_when_it_asks(fake_cluster: FakeCluster) -> None:
    fake_cluster.prefill.cached_tokens, fake_cluster.decode.cached_tokens = 32, 16
    prompt = list(range(1, 41))
    handed_off, cached = await fake_cluster.generate(prompt, details=True, rid="handed-off")
    assert cached == 32 and as_scripted(handed_off[-1]) == completed("length")
    local, cached = await fake_cluster.generate(prompt, details=True, local_prefill_below=100, rid="local")
    assert cached == 16 and as_scripted(local[-1]) == completed("length")
    assert fake_cluster.hosts.queries == [("/internal/prefill", "cached_tokens=1"),
                                          ("/internal/decode", "cached_tokens=1"),
                                          ("/internal/decode", "cached_tokens=1")]
    # without the flag: the same outputs, nothing asked, nothing reported
    fake_cluster.hosts.queries.clear()
    again, cached = await fake_cluster.generate(prompt, details=False, rid="handed-off-2")
    assert ([as_scripted(o) for o in again], cached) == ([as_scripted(o) for o in handed_off], 0)
    again, cached = await fake_cluster.generate(prompt, details=False, local_prefill_below=100, rid="local-2")
    assert ([as_scripted(o) for o in again], cached) == ([as_scripted(o) for o in local], 0)
    assert {query for _, query in fake_cluster.hosts.queries} == {""}


async def test_a_local_prefill_whose_first_token_ends_it_still_reports_its_cached_tokens(
    fake_cluster: FakeCluster
) -> None:
    fake_cluster.decode.cached_tokens = 16
    fake_cluster.decode.eos_at = 1
    prompt = list(range(1, 41))
    for details, cached in ((True, 16), (False, 0)):
        outputs, reported = await fake_cluster.generate(prompt, details=details, local_prefill_below=100,
                                                        rid=f"eos-{details}")
        assert ([as_scripted(o) for o in outputs], reported) == ([completed("stop")], cached)


def test_the_wire_carries_the_count_only_when_it_is_reported() -> None:
    reply = PrefillReplyBody(first_token=5, is_eos=False, held_bytes=7)
    assert reply.document() == {"first_token": 5, "is_eos": False, "held_bytes": 7, "logprobs": None}
    assert PrefillReplyBody(first_token=5, is_eos=False, cached_tokens=48).document()["cached_tokens"] == 48
    assert output_line(PrefillReply(5, False, 0)) == b'{"first_token":5,"is_eos":false}\n'
    line = output_line(PrefillReply(5, False, 0, None, 48))
    assert line == b'{"first_token":5,"is_eos":false,"cached_tokens":48}\n'
    assert parse_output_line(line) == PrefillReply(5, False, 0, None, 48)
    assert parse_output_line(b'{"first_token":5,"is_eos":false}') == PrefillReply(5, False, 0)
    assert parse_output_line(b'{"token":5}') == TokensGenerated((5,))
    assert not isinstance(parse_output_line(b'{"first_token":5,"is_eos":false,"cached_tokens":-1}'),
                          PrefillReply)


async def test_the_router_counts_a_prompt_as_prefilling_on_its_node_until_its_first_token(
    fake_cluster: FakeCluster
) -> None:
    prompt = list(range(1, 41))
    await fake_cluster.generate(prompt, details=False, rid="handed-off")
    await fake_cluster.generate(prompt, details=False, local_prefill_below=100, rid="local")
    handed_off, local = fake_cluster.routers[-2:]
    assert isinstance(handed_off, _WatchedPeers) and isinstance(local, _WatchedPeers)
    # the prefill call saw the prompt counted on the prefill node; the decode call after the
    # first token, nothing; a local prefill is counted on the decode node while it computes
    assert handed_off.seen == [{"http://prefill": 40}, {}]
    assert local.seen == [{"http://decode": 40}]
    assert all(performer.prefilling == {} for performer in fake_cluster.performers)
