"""Per-request LoRA adapters (`--adapters NAME=PATH`): a request naming adapter X gets the tokens
of an engine started with `--adapter-path X` (and of mlx-lm with it), a request naming none the
base model's, also while both decode side by side in one batch; the adapter set is part of the
fingerprint; a name the node does not serve is a 400 listing those it does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import pytest
import trio

from adapters.frontend.app import build_app
from adapters.frontend.frontend import Frontend
from adapters.mlx.engine import MlxEngine
from effects.engine_port import SamplingParams
from statecore.ids import RequestId
from support.tiny_adapter import build_lora_adapter
from support.tiny_models import cached_checkpoint
from tests.integration.engines import load_into, opened_engines, sent_tokens
from tests.integration.fake_backend import FakeBackend, completed, fake_model_info, replied

CHUNK = 16
PROMPT = [(7 * i + 3) % 500 + 2 for i in range(40)]


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    model = cached_checkpoint("llama")
    return (build_lora_adapter(model, tmp_path_factory.mktemp("x"), seed=1),
            build_lora_adapter(model, tmp_path_factory.mktemp("y"), seed=2, rank=2))


Request = tuple[str, list[int], SamplingParams]


async def tokens_of(engine: MlxEngine, requests: list[Request]) -> dict[str, list[int]]:
    """Each request prefilled, then all decoded at once (side by side in the decoder)."""
    firsts = {}
    for name, prompt, sampling in requests:
        firsts[name] = (await engine.prefill(RequestId(name), prompt, sampling)).first_token
    tokens: dict[str, list[int]] = {}

    async def decode(name: str, prompt: list[int], sampling: SamplingParams) -> None:
        tokens[name] = [firsts[name]] + await sent_tokens(engine.stream(RequestId(name)))

    for name, prompt, sampling in requests:
        await engine.decode_held(RequestId(name), prompt, firsts[name], sampling)
    async with trio.open_nursery() as nursery:
        for request in requests:
            nursery.start_soon(decode, *request)
    return tokens


async def test_a_named_adapter_gives_the_tokens_of_a_node_started_with_it(
        adapter_dirs: tuple[Path, Path]) -> None:
    x, y = adapter_dirs
    model = cached_checkpoint("llama")
    alone = {"prefill_chunk_size": CHUNK, "prefix_cache_bytes": 0}
    plain = SamplingParams(max_tokens=20)
    seeded = SamplingParams(max_tokens=20, temperature=0.8, seed=7)
    async with opened_engines() as opened:
        served = await load_into(opened, model, prefill_chunk_size=CHUNK, adapters=[("x", x), ("y", y)])
        base = await load_into(opened, model, **alone)
        only_x = await load_into(opened, model, **alone, adapter_path=x)
        only_y = await load_into(opened, model, **alone, adapter_path=y)
        assert served.info.adapters == ("x", "y")
        assert len({e.info.fingerprint for e in (served, base, only_x, only_y)}) == 4
        expected = {}
        for engine, adapter in ((base, None), (only_x, "x"), (only_y, "y")):
            for kind, sampling in (("greedy", plain), ("seeded", seeded)):
                got = await tokens_of(engine, [("alone", PROMPT, sampling)])
                expected[(adapter, kind)] = got["alone"]
        assert expected[("x", "greedy")] != expected[(None, "greedy")] != expected[("y", "greedy")]
        # one at a time on the node serving both, then all six side by side in one batch
        kinds = (("greedy", plain), ("seeded", seeded))
        requests = [(f"{adapter}-{kind}", PROMPT, dataclasses.replace(sampling, adapter=adapter))
                    for adapter in (None, "x", "y") for kind, sampling in kinds]
        for name, prompt, sampling in requests:
            one = await tokens_of(served, [(name + "-alone", prompt, sampling)])
            assert one[name + "-alone"] == expected[(sampling.adapter, name.split("-")[1])], name
        together = await tokens_of(served, requests)
        for name, _, sampling in requests:
            assert together[name] == expected[(sampling.adapter, name.split("-")[1])], name


async def test_a_name_the_node_does_not_serve_is_a_400_listing_those_it_does(bpe_dir: Path) -> None:
    for served, listed in ((("x", "y"), "serves 'x', 'y'"), ((), "serves none")):
        backend = FakeBackend(dataclasses.replace(fake_model_info(), adapters=served))
        frontend = Frontend.load(bpe_dir, backend)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(frontend)),
                                     base_url="http://node") as client:
            response = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                                   "adapters": "z"})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "adapters" and listed in error["message"], error
            if served:  # a name it serves reaches the backend with the request
                backend.scripts.append([replied(5), completed("length")])
                response = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                                       "adapters": "y"})
                assert response.status_code == 200, response.text
                assert backend.last.request.sampling.adapter == "y"
