"""The MLX engine: model loading, the device loop and its scheduler's plans, the slot KV layout,
prefill, sampling. `MlxEngine` implements `effects.engine_port.Engine`; see docs/engine.md.

The names below load on first use, not with the package: a node whose engine core runs in its
own process (`adapters.mlx.core_client`, which imports no mlx) never loads mlx at all."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from adapters.mlx.engine import MlxEngine
    from adapters.mlx.loading import FORMAT_VERSION
    from adapters.mlx.sampling import position_key_seed, request_seed

__all__ = ["FORMAT_VERSION", "MlxEngine", "position_key_seed", "request_seed"]

_HOMES: Final = {"FORMAT_VERSION": "adapters.mlx.loading", "MlxEngine": "adapters.mlx.engine",
                 "position_key_seed": "adapters.mlx.sampling", "request_seed": "adapters.mlx.sampling"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'adapters.mlx' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
