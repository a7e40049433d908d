"""The MLX engine: model loading, the device loop and its scheduler's plans, the slot KV layout,
prefill, sampling. `MlxEngine` implements `effects.engine_port.Engine`; see docs/engine.md."""

from adapters.mlx.engine import MlxEngine
from adapters.mlx.loading import FORMAT_VERSION
from adapters.mlx.sampling import position_key_seed, request_seed

__all__ = ["FORMAT_VERSION", "MlxEngine", "position_key_seed", "request_seed"]
