"""How a generation ends on EOS: the EOS token counts as a generated token (as vLLM and mlx-lm
count it: a reply whose first token is EOS reports completion_tokens 1), and `ignore_eos`
(vLLM's, sent by GuideLLM and AIPerf) generates through EOS to max_tokens, on a single node and
through the cluster's internal wire."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from adapters.frontend.app import build_app
from adapters.frontend.frontend import Frontend
from adapters.http.internal_wire import SamplingBody
from adapters.metrics import Metrics
from effects.fakes import EOS, FakeEngine
from effects.interpret import EnginePerformer, local_backend
from effects.ports import GenerationRequest, Output, SamplingParams
from effects.runner import NodeRunner
from statecore.ids import RequestId
from statecore.intents import Complete, RespondTokens
from statecore.table import DECODE_REQUEST
from tests.integration.fake_backend import FakeBackend, as_scripted, completed, fake_model_info


async def generate(eos_at: int, sampling: SamplingParams) -> list[Output]:
    engine = FakeEngine(eos_at=eos_at)
    performer = EnginePerformer(engine)
    runner = NodeRunner(DECODE_REQUEST, performer)
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        generation = await local_backend(runner, performer).start(
            GenerationRequest(RequestId("r"), (3, 4, 5), sampling))
        outputs = [out async for out in generation]
        nursery.cancel_scope.cancel()
    return outputs


async def test_eos_ends_a_generation_with_stop() -> None:
    outputs = await generate(3, SamplingParams(max_tokens=8))
    assert [type(o) for o in outputs] == [RespondTokens, RespondTokens, Complete]
    assert as_scripted(outputs[-1]) == completed("stop")


async def test_eos_as_the_first_token_ends_it_at_once() -> None:
    assert [as_scripted(o) for o in await generate(1, SamplingParams(max_tokens=8))] == [completed("stop")]


@pytest.mark.parametrize("eos_at", [1, 3])
async def test_ignore_eos_generates_through_eos_to_max_tokens(eos_at: int) -> None:
    outputs = await generate(eos_at, SamplingParams(max_tokens=6, ignore_eos=True))
    tokens = [t for o in outputs if isinstance(o, RespondTokens) for t in o.tokens]
    assert len(tokens) == 6 and tokens[eos_at - 1] == EOS
    assert as_scripted(outputs[-1]) == completed("length")


def test_ignore_eos_crosses_the_internal_wire() -> None:
    sampling = SamplingParams(max_tokens=5, ignore_eos=True)
    assert SamplingBody.model_validate_json(SamplingBody.of(sampling).model_dump_json()).params() == sampling


async def test_a_reply_that_is_only_eos_reports_one_completion_token(bpe_dir: Path) -> None:
    engine = FakeEngine(eos_at=1)
    performer = EnginePerformer(engine)
    runner = NodeRunner(DECODE_REQUEST, performer)
    metrics = Metrics("single")
    metrics.watch(runner, engine=engine, handoffs=performer.handoffs)
    frontend = Frontend.load(bpe_dir, local_backend(runner, performer))
    transport = httpx.ASGITransport(app=build_app(frontend))
    async with trio.open_nursery() as nursery, httpx.AsyncClient(transport=transport,
                                                                base_url="http://node") as client:
        await nursery.start(runner.run)
        reply = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        nursery.cancel_scope.cancel()
    body = reply.json()
    assert body["choices"][0]["text"] == "" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 1
    sent = metrics.registry.get_sample_value("statecore:generation_tokens_total", {"role": "single"})
    assert sent == 1  # the metric equals the usage clients get


async def test_ignore_eos_reaches_the_backend(bpe_dir: Path) -> None:
    backend = FakeBackend(fake_model_info(context_length=256))
    backend.scripts.append([completed("length")])
    frontend = Frontend.load(bpe_dir, backend)
    transport = httpx.ASGITransport(app=build_app(frontend))
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        reply = await client.post("/v1/completions",
                                  json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert backend.generations[-1].request.sampling.ignore_eos


def test_a_peer_error_with_a_param_crosses_the_internal_wire() -> None:
    """OpenAI's `param` is in every error body now; a node's error still reads back whole."""
    from adapters.http.internal_wire import error_from_json, error_json
    from statecore.errors import Code, ErrorInfo, Fault

    error = ErrorInfo(Fault.CLIENT, Code.INVALID_REQUEST, "bad temperature", "temperature")
    assert error_from_json(error_json(error), 400) == error
    plain = ErrorInfo(Fault.PEER, Code.KV_NOT_FOUND, "no such cache")
    assert error_from_json(error_json(plain), 404) == plain
