"""`MlxEngine.load` takes the engine's settings as `**options: Unpack[EngineOptions]` and hands
them to `engine_settings`, which documents, defaults and checks each: the two name the same
settings with the same types, so neither can gain one the other lacks."""

from __future__ import annotations

import inspect
from typing import get_type_hints

import pytest

from adapters.mlx import limits
from adapters.mlx import prefill as prefill_module
from adapters.mlx.engine import MlxEngine
from adapters.mlx.limits import EngineOptions, engine_settings
from statecore.scheduling import DEFAULT_CHUNK_TOKENS
from support.tiny_models import cached_checkpoint


def test_the_options_are_engine_settings_keywords_with_their_types() -> None:
    signature = inspect.signature(engine_settings)
    keywords = {name for name, parameter in signature.parameters.items()
                if parameter.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(EngineOptions.__annotations__) == keywords
    hints = get_type_hints(engine_settings, vars(limits))
    options = get_type_hints(EngineOptions, vars(limits))
    assert {name: options[name] for name in keywords} == {name: hints[name] for name in keywords}


def test_load_takes_no_setting_of_its_own_beside_the_options() -> None:
    own = {name for name, parameter in inspect.signature(MlxEngine.load).parameters.items()
           if parameter.kind is inspect.Parameter.KEYWORD_ONLY}
    assert own == {"trust_remote_code", "adapter_path", "adapters", "warm_request", "model_call_hook"}
    assert not own & set(EngineOptions.__annotations__)


def test_the_chunk_is_2048_tokens_on_mlx_s_cuda_backend_and_256_elsewhere(
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = cached_checkpoint("llama")
    assert engine_settings(path).prefill_chunk_size == DEFAULT_CHUNK_TOKENS == 256
    assert engine_settings(path, prefill_chunk_size=64).prefill_chunk_size == 64
    monkeypatch.setattr(prefill_module, "on_cuda", lambda: True)
    assert engine_settings(path).prefill_chunk_size == 2048
    assert engine_settings(path, prefill_chunk_size=64).prefill_chunk_size == 64
