"""A decode step's tokens travel as one value (a verify step gives a request several): from the
engine's stream through the runner and the core to the front end, each token once, in its order,
and what the client reads is what it reads when every step gives one token. The fake engine's
`step_tokens` sets the tokens a step gives; its tokens are a function of the history
(`effects.fakes.next_token`), so the tokens a request must get are known here."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from adapters.frontend.app import build_app
from adapters.frontend.frontend import Frontend
from effects.fakes import EOS, FakeEngine, next_token
from effects.interpret import EnginePerformer, local_backend
from effects.ports import GenerationRequest, Output, SamplingParams
from effects.runner import NodeRunner
from statecore.ids import RequestId
from statecore.intents import Complete, RespondTokens
from statecore.table import DECODE_REQUEST

PROMPT = (3, 4, 5)


def expected_tokens(prompt: Sequence[int], max_tokens: int, eos_at: int | None = None) -> list[int]:
    """The tokens the fake engine generates for `prompt`, EOS (at `eos_at`) the last if it comes."""
    history, tokens = list(prompt), []
    for produced in range(1, max_tokens + 1):
        token = EOS if produced == eos_at else next_token(history)
        history.append(token)
        tokens.append(token)
        if token == EOS:
            break
    return tokens


async def outputs_of(engine: FakeEngine, sampling: SamplingParams) -> list[Output]:
    performer = EnginePerformer(engine)
    runner = NodeRunner(DECODE_REQUEST, performer)
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        generation = await local_backend(runner, performer).start(
            GenerationRequest(RequestId("r"), PROMPT, sampling))
        outputs = [out async for out in generation]
        nursery.cancel_scope.cancel()
    return outputs


@pytest.mark.parametrize("step_tokens", [1, 3, 4])
@pytest.mark.parametrize(("max_tokens", "eos_at"), [(11, None), (12, 7), (9, 5), (6, 2)])
async def test_a_steps_tokens_come_once_in_their_order_as_one_reply(
    step_tokens: int, max_tokens: int, eos_at: int | None
) -> None:
    outputs = await outputs_of(FakeEngine(eos_at=eos_at, step_tokens=step_tokens),
                               SamplingParams(max_tokens=max_tokens))
    *replies, end = outputs
    assert isinstance(end, Complete)
    want = expected_tokens(PROMPT, max_tokens, eos_at)
    ends_on_eos = want[-1] == EOS
    # the first token alone, then each step's tokens as one reply, an ending EOS never sent
    steps = [tuple(want[at:at + step_tokens]) for at in range(1, len(want), step_tokens)]
    grouped = [(want[0],), *(kept for step in steps if (kept := tuple(t for t in step if t != EOS)))]
    assert [reply.tokens if isinstance(reply, RespondTokens) else reply for reply in replies] == grouped
    assert (end.finish_reason, end.ending_tokens) == (("stop", 1) if ends_on_eos else ("length", 0))


async def client_reads(bpe_dir: Path, step_tokens: int, body: dict[str, Any]) -> list[Any]:
    """What a client reads of a completion: its body, or its stream's events (ids and times
    left out), whatever a decode step gives."""
    engine = FakeEngine(step_tokens=step_tokens)
    performer = EnginePerformer(engine)
    runner = NodeRunner(DECODE_REQUEST, performer)
    frontend = Frontend.load(bpe_dir, local_backend(runner, performer))
    transport = httpx.ASGITransport(app=build_app(frontend))
    async with trio.open_nursery() as nursery, httpx.AsyncClient(transport=transport,
                                                                base_url="http://node") as client:
        await nursery.start(runner.run)
        reply = await client.post("/v1/completions", json=body)
        nursery.cancel_scope.cancel()
    assert reply.status_code == 200, reply.text
    docs = [reply.json()] if not body.get("stream") else [
        json.loads(line.removeprefix("data: ")) for line in reply.text.splitlines()
        if line.startswith("data: {")]
    return [{key: value for key, value in doc.items() if key not in ("id", "created")} for doc in docs]


def text_of(read: list[Any]) -> str:
    return "".join(choice["text"] for doc in read for choice in doc["choices"])


@pytest.mark.parametrize("stream", [False, True])
async def test_the_client_reads_the_same_whatever_a_step_gives(bpe_dir: Path, stream: bool) -> None:
    """The same body, or the same events one by one (a token's text its own event), when a step
    gives several tokens as when it gives one; also when a stop string ends inside a step."""
    body: dict[str, Any] = {"prompt": "hello", "max_tokens": 14}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    one = await client_reads(bpe_dir, 1, body)
    assert text_of(one) and one[-1]["usage"]["completion_tokens"] == 14
    if stream:
        assert len(one) > 8  # an event per token (a few tokens' text held back to the next)
    for step_tokens in (2, 3, 5):
        assert await client_reads(bpe_dir, step_tokens, body) == one
    text = text_of(one)
    stop = text[len(text) // 2:][:2]
    stopped = await client_reads(bpe_dir, 1, {**body, "stop": stop})
    assert text_of(stopped) == text[: text.index(stop)]
    assert stopped[-2 if stream else -1]["choices"][0]["finish_reason"] == "stop"
    for step_tokens in (3, 5):
        assert await client_reads(bpe_dir, step_tokens, {**body, "stop": stop}) == stopped
