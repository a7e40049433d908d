"""The seed bug, pinned: an empty cache list or an unknown class is never "all supported"."""

from __future__ import annotations

from effects.engine_port import LayerTravel, ModelInfo
from effects.fakes import fake_info
from statecore.errors import Code, unsupported_cache


def _info(layers: tuple[LayerTravel, ...]) -> ModelInfo:
    return ModelInfo("m", "fp", 4096, 100, frozenset({0}), 2048, layers)


def test_no_layers_is_not_travelable() -> None:
    info = _info(())
    assert not info.can_travel
    assert info.untravelable_classes == ("<no cache layers reported>",)


def test_one_unknown_class_makes_the_model_untravelable() -> None:
    info = _info((LayerTravel(0, "KVCache", True), LayerTravel(1, "OpaqueCache", False, "unknown")))
    assert not info.can_travel
    assert info.untravelable_classes == ("OpaqueCache",)


def test_every_layer_travelable() -> None:
    assert fake_info().can_travel
    assert not fake_info(can_travel=False).can_travel


def test_the_error_names_the_class_and_is_a_4xx() -> None:
    error = unsupported_cache(["OpaqueCache", "OpaqueCache"])
    assert error.code is Code.UNSUPPORTED_CACHE
    assert "OpaqueCache" in error.message and error.message.count("OpaqueCache") == 1
    assert error.http_status == 422
