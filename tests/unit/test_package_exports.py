"""Each package's `__all__` names its public modules, and every name there is one."""

from __future__ import annotations

import importlib
import importlib.util

import pytest


@pytest.mark.parametrize(
    "package",
    ["statecore", "effects", "adapters", "adapters.frontend", "adapters.http", "adapters.kv",
     "adapters.serve", "support"],
)
def test_every_listed_module_exists(package: str) -> None:
    names = importlib.import_module(package).__all__
    assert names, f"{package}.__all__ is empty"
    assert names == sorted(names)
    missing = [n for n in names if importlib.util.find_spec(f"{package}.{n}") is None]
    assert missing == []
