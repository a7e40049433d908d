"""Every body shape, valid, wrong in one known way, or anything at all, through the front end
in-process, on a single node's real engine (the tiny llama) and runner: a whole answer when the
body is valid, an OpenAI-shaped 4xx naming the field at fault otherwise, never a 5xx, and nothing
left held. The same strategies send a sample of about 50 through a live cluster
(tests/e2e/test_failure_isolation.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.frontend.app import build_app
from adapters.frontend.frontend import Frontend
from adapters.mlx import MlxEngine
from effects.interpret import EnginePerformer, local_backend
from effects.runner import NodeRunner
from statecore.table import DECODE_REQUEST
from support.tiny_models import cached_checkpoint
from tests.integration.engines import close_engine, load_engine
from tests.request_bodies import VIOLATIONS, assert_openai_error, assert_well_formed, bodies, valid_calls


def examples(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Node:
    def __init__(self, client: httpx.AsyncClient, engine: MlxEngine, runner: NodeRunner[Any]) -> None:
        self.client, self.engine, self.runner = client, engine, runner

    async def answer(self, path: str, body: Any) -> httpx.Response:
        # json.dumps, as a client would: it writes Infinity for an infinite float (hostile too)
        return await self.client.post(path, content=json.dumps(body).encode(),
                                      headers={"content-type": "application/json"})

    async def assert_idle(self) -> None:
        """Nothing held once the answers are in (cleanup runs just after a request settles):
        no live request or context, no decoder row, no held KV."""

        def held() -> dict[str, int]:
            runner, engine = self.runner.statistics(), self.engine.statistics()
            counts = {"live_requests": runner.live_requests, "decoding": engine.decoding,
                      "held_caches": engine.held_caches, "held_bytes": engine.held_bytes}
            return {k: v for k, v in counts.items() if v}

        with trio.move_on_after(10):
            while held():
                await trio.sleep(0.01)
        assert not held(), held()


@pytest.fixture
async def node(nursery: trio.Nursery) -> AsyncIterator[Node]:
    path = cached_checkpoint("llama")
    engine = await load_engine(path)
    performer = EnginePerformer(engine)
    runner: NodeRunner[Any] = NodeRunner(DECODE_REQUEST, performer, name="single")
    await nursery.start(runner.run)
    transport = httpx.ASGITransport(app=build_app(Frontend.load(path, local_backend(runner, performer))))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://single", timeout=60) as client:
            yield Node(client, engine, runner)
    finally:
        await close_engine(engine)


# Hypothesis drives each test from a worker thread (`trio.to_thread`): every example reaches the
# node, which lives in the test's trio run, through `trio.from_thread.run`.


async def test_valid_bodies_get_a_well_formed_answer(node: Node) -> None:
    @examples(150)
    @given(call=valid_calls)
    def check(call: tuple[str, dict[str, Any]]) -> None:
        path, body = call
        assert_well_formed(trio.from_thread.run(node.answer, path, body), body)
        trio.from_thread.run(node.assert_idle)

    await trio.to_thread.run_sync(check)


async def test_each_violation_gets_its_own_error(node: Node) -> None:
    @examples(300)
    @given(call=valid_calls, violation=st.sampled_from(VIOLATIONS))
    def check(call: tuple[str, dict[str, Any]], violation: tuple[str, Any, int, str, str]) -> None:
        path, body = call
        field, value, status, code, param = violation
        bad = {**body, field: value}
        response = trio.from_thread.run(node.answer, path, bad)
        assert response.status_code == status, (response.text, bad)
        error = assert_openai_error(response, bad)
        assert (error["code"], error["param"]) == (code, param), (error, bad)

    await trio.to_thread.run_sync(check)


async def test_hostile_bodies_never_get_a_5xx(node: Node) -> None:
    """Anything at all: a whole answer when it happens to be valid, else an OpenAI-shaped 4xx."""

    @examples(1000)
    @given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    def check(body: Any, path: str) -> None:
        response = trio.from_thread.run(node.answer, path, body)
        if response.status_code == 200:
            assert_well_formed(response, body)
        else:
            assert_openai_error(response, body)
        trio.from_thread.run(node.assert_idle)

    await trio.to_thread.run_sync(check)
