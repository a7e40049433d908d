"""`--adapter-path`: a LoRA adapter applied at load gives mlx-lm's own answers with that adapter,
changes the fingerprint (so KV never moves between nodes with different adapters), and a
directory that is no adapter is refused at load."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load as mlx_lm_load

from effects.engine_port import SamplingParams
from statecore.errors import StatecoreError
from statecore.ids import RequestId
from support.tiny_adapter import build_lora_adapter
from support.tiny_models import cached_checkpoint
from tests.integration.engines import close_engine, load_engine, sent_tokens

CHUNK = 16
PROMPT = [(7 * i + 3) % 500 + 2 for i in range(40)]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lora_adapter(cached_checkpoint("llama"), tmp_path_factory.mktemp("adapter"))


def mlx_lm_tokens(adapter: Path | None, max_tokens: int) -> list[int]:
    applied = None if adapter is None else str(adapter)
    model = mlx_lm_load(str(cached_checkpoint("llama")), adapter_path=applied)[0]
    steps = generate_step(mx.array(PROMPT), model, max_tokens=max_tokens, prefill_step_size=CHUNK)
    return [int(token) for token, _ in steps]


async def test_an_adapter_gives_mlx_lm_s_answers_with_it_and_its_own_fingerprint(adapter_dir: Path) -> None:
    base = await load_engine(cached_checkpoint("llama"), prefill_chunk_size=CHUNK)
    try:
        adapted = await load_engine(cached_checkpoint("llama"), prefill_chunk_size=CHUNK,
                                    adapter_path=adapter_dir)
        try:
            sampling = SamplingParams(max_tokens=24)
            tokens = {}
            for name, engine in (("base", base), ("adapted", adapted)):
                outcome = await engine.prefill(RequestId(name), PROMPT, sampling)
                await engine.decode_held(RequestId(name), PROMPT, outcome.first_token, sampling)
                tokens[name] = [outcome.first_token] + await sent_tokens(engine.stream(RequestId(name)))
            assert tokens["adapted"] == mlx_lm_tokens(adapter_dir, 24)
            assert tokens["base"] == mlx_lm_tokens(None, 24)
            assert tokens["adapted"] != tokens["base"]
            assert adapted.info.fingerprint != base.info.fingerprint
            # a prefill node without the adapter cannot hand its KV to a node with it
            outcome = await base.prefill(RequestId("h"), PROMPT, sampling)
            payload = (await base.export_held(RequestId("h"))).joined()
            await base.release_held(RequestId("h"))
            with pytest.raises(StatecoreError, match="kv_wrong_model"):
                await adapted.install(RequestId("h"), payload, PROMPT, outcome.first_token, sampling)
        finally:
            await close_engine(adapted)
    finally:
        await close_engine(base)


async def test_a_directory_that_is_no_adapter_is_refused_at_load(tmp_path: Path) -> None:
    with pytest.raises(StatecoreError, match="adapter"):
        await load_engine(cached_checkpoint("llama"), prefill_chunk_size=CHUNK, adapter_path=tmp_path)
