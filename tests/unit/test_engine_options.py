"""`MlxEngine.load` takes the engine's settings as `**options: Unpack[EngineOptions]` and hands
them to `engine_settings`, which documents, defaults and checks each: the two name the same
settings with the same types, so neither can gain one the other lacks."""

from __future__ import annotations

import inspect
from typing import get_type_hints

from adapters.mlx import limits
from adapters.mlx.engine import MlxEngine
from adapters.mlx.limits import EngineOptions, engine_settings


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
