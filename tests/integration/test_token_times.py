"""`TokenTimes`, an instrument of a real runner over a fake engine: each request's decoded tokens
applied by the loop and each output its reader took, in order and per request, through
`GET /internal/token_times` (the internal token wanted, `since` honoured), and a bounded ring."""

from __future__ import annotations

import httpx
import trio
from starlette.applications import Starlette

from adapters.http.internal_wire import TOKEN_HEADER
from adapters.token_times import APPLIED, READ, TokenTimes
from effects.engine_port import SamplingParams
from effects.fakes import FakeEngine
from effects.interpret import EnginePerformer, local_backend
from effects.ports import GenerationRequest
from effects.runner import NodeRunner, Timeouts
from statecore.events import TokensGenerated
from statecore.ids import RequestId
from statecore.intents import Complete, RespondTokens
from statecore.table import DECODE_REQUEST

TOKEN = "s3cret"


async def test_each_token_is_noted_where_it_was_applied_and_where_it_was_read(nursery: trio.Nursery) -> None:
    times = TokenTimes()
    performer = EnginePerformer(FakeEngine())
    runner = NodeRunner(DECODE_REQUEST, performer, timeouts=Timeouts(deadline_s=5.0), name="decode")
    runner.instruments.add(times)
    await nursery.start(runner.run)
    backend = local_backend(runner, performer)
    outputs = {}
    for rid, max_tokens in (("a", 5), ("b", 3)):
        request = GenerationRequest(RequestId(rid), (3, 4, 5), SamplingParams(max_tokens))
        generation = await backend.start(request)
        outputs[rid] = [out async for out in generation]
        assert isinstance(outputs[rid][-1], Complete)

    app = Starlette(routes=[times.route(TOKEN)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node",
                                 headers={TOKEN_HEADER: TOKEN}) as client:
        refused = await client.get("/internal/token_times", headers={TOKEN_HEADER: "wrong"})
        assert refused.status_code in (401, 403)
        body = (await client.get("/internal/token_times")).json()
        assert (await client.get("/internal/token_times?since=x")).status_code == 400
        last_of_a = body[READ]["a"][-1]
        later = (await client.get(f"/internal/token_times?since={last_of_a}")).json()
    assert body["clock"] == "unix_s"
    for rid, max_tokens in (("a", 5), ("b", 3)):
        read, applied = body[READ][rid], body[APPLIED][rid]
        told = sum(len(o.tokens) for o in outputs[rid] if isinstance(o, RespondTokens))
        assert len(read) == told == max_tokens
        assert len(applied) == max_tokens - 1  # the first token is the prefill's, not a decode step's
        assert read == sorted(read) and applied == sorted(applied)
        # every decoded token was applied before its reader took it
        assert all(a <= r for a, r in zip(applied, read[1:], strict=True))
    assert body[READ]["a"][-1] <= body[READ]["b"][0]
    assert "b" in later[READ] and later[READ]["a"] == [last_of_a]


def test_the_ring_is_bounded_and_a_step_of_several_tokens_repeats_its_moment() -> None:
    ticks = iter(range(100))
    times = TokenTimes(capacity=3, clock=lambda: float(next(ticks)))
    for _ in range(4):
        times.applied(RequestId("r"), TokensGenerated((1,)), None)
    times.applied(RequestId("r"), TokensGenerated((1, 2)), None)
    assert times.since(0.0)[APPLIED]["r"] == [2.0, 3.0, 4.0, 4.0]
    assert times.since(4.0)[APPLIED]["r"] == [4.0, 4.0]
