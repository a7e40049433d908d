"""A single node's first token leaves before its request joins the decoder.

On one host the join and the first decode (or verify) step's build run on the engine's thread
and take the interpreter the event loop needs to write the first token; so a front end's request
joins (`InstallKv`) only once its reader took the first token and came back for more
(`NodeRunner.join_after_first_read`). These tests check the order of events, not times: the
join waits for the reader, the first body write precedes the join through the HTTP front end,
the node API's requests (a cluster's path) join at once, and a request still decodes to its end.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
import trio.testing

from adapters.frontend.app import build_app
from adapters.frontend.frontend import Frontend
from effects.engine_port import SamplingParams
from effects.fakes import FakeEngine
from effects.interpret import EnginePerformer, NodeRequest, local_backend
from effects.ports import GenerationRequest
from effects.runner import NodeRunner, open_generation
from statecore.events import PrefillLocally
from statecore.ids import RequestId
from statecore.intents import Complete, RespondTokens
from statecore.table import DECODE_REQUEST


class JoinLog(FakeEngine):
    """A fake engine that writes each join into a log the test shares with the client."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    async def decode_held(self, request_id: RequestId, prompt: Sequence[int], first_token: int,
                          sampling: SamplingParams) -> None:
        self.log.append("join")
        await super().decode_held(request_id, prompt, first_token, sampling)


@asynccontextmanager
async def single_node(log: list[str]) -> AsyncIterator[tuple[JoinLog, EnginePerformer, NodeRunner[Any]]]:
    """A single node's runner over a `JoinLog` engine, running until the block ends."""
    engine = JoinLog(log)
    performer = EnginePerformer(engine)
    runner = NodeRunner(DECODE_REQUEST, performer)
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        yield engine, performer, runner
        nursery.cancel_scope.cancel()


async def test_the_join_waits_for_the_reader_to_take_the_first_token() -> None:
    log: list[str] = []
    async with single_node(log) as (engine, performer, runner):
        generation = await local_backend(runner, performer).start(
            GenerationRequest(RequestId("r"), (3, 4, 5), SamplingParams(max_tokens=6)))
        replies = aiter(generation)
        first = await anext(replies)
        assert isinstance(first, RespondTokens) and len(first.tokens) == 1
        await trio.testing.wait_all_tasks_blocked()  # everything else that could run has run
        assert log == [] and RequestId("r") in engine.held  # the reader holds the first token: no join
        rest = [reply async for reply in replies]  # the reader comes back: the join goes
    assert log == ["join"]
    assert [len(r.tokens) for r in rest if isinstance(r, RespondTokens)] == [1] * 5
    assert isinstance(rest[-1], Complete) and rest[-1].finish_reason == "length"


async def test_a_node_api_request_joins_without_waiting_for_its_reader() -> None:
    """The node API's requests (a decode node serving a router's short prompt) join as before."""
    log: list[str] = []
    async with single_node(log) as (_, performer, runner):
        rid = RequestId("r")
        sampling = SamplingParams(max_tokens=6)
        generation = await open_generation(runner, rid, 10, NodeRequest((3, 4, 5), sampling),
                                           max_live=None, faults=performer.faults)
        await runner.post(rid, PrefillLocally())
        first = await anext(aiter(generation))
        assert isinstance(first, RespondTokens)
        await trio.testing.wait_all_tasks_blocked()
    assert log == ["join"]


async def test_the_first_token_is_written_before_the_join(bpe_dir: Path) -> None:
    """Through the HTTP front end, streamed: the first token's event is written (a body message
    the client receives) before the engine is asked to join the request."""
    log: list[str] = []
    received = False

    async def receive() -> dict[str, Any]:
        nonlocal received
        if not received:
            received = True
            body = {"prompt": "hello", "max_tokens": 6, "stream": True, "ignore_eos": True}
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            texts = [json.loads(line[6:])["choices"][0]["text"]
                     for line in message["body"].decode().split("\n") if line.startswith("data: {")]
            log.extend(f"text {text!r}" for text in texts if text)
        await trio.sleep(0)  # a socket write is a checkpoint: anything runnable runs here

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"node")],
        "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 8000),
    }
    async with single_node(log) as (_, performer, runner):
        app = build_app(Frontend.load(bpe_dir, local_backend(runner, performer)))
        with trio.fail_after(10):
            await app(scope, receive, send)
    assert "join" in log and log.index("join") > 0, log  # a text event went out before the join
    assert log[0].startswith("text ")
    assert len([entry for entry in log if entry != "join"]) >= 2  # and the stream went on after it
