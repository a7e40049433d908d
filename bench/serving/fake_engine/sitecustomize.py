"""Every statecore engine node started with this directory on PYTHONPATH (and
STATECORE_BENCH_FAKE_ENGINE=1) runs `effects.fakes.FakeEngine` instead of loading a model:
tokens appear at once, so a load generator measures the serving path alone (HTTP, runners,
state machines, and in a cluster the router -> prefill -> decode hop). Python imports
`sitecustomize` at start-up in every process, so a local cluster's children get it too.

    STATECORE_BENCH_FAKE_ENGINE=1 PYTHONPATH=bench/serving/fake_engine \\
        .venv/bin/python bench/serving/side_by_side.py \\
        --servers single,cluster --model src/adapters/demo_model --mix 128x16 --mix 2000x16 --concurrency 1

The front end still tokenizes with the model directory's tokenizer (the demo model's has 4,096
ids; the fake engine emits ids below 1,000). Bench code: nothing under src/ may import it.
"""

from __future__ import annotations

import os

if os.environ.get("STATECORE_BENCH_FAKE_ENGINE") == "1":
    from typing import Any

    from adapters import mlx as engine_mlx
    from effects.fakes import FakeEngine

    class _BenchFakeEngine(FakeEngine):
        """What the node asks of `MlxEngine` beyond the port: whole-payload handoffs (no streamed
        pieces), no device thread to crash or abandon."""

        streams_handoffs = False

        def crash_device_thread(self) -> None:
            raise RuntimeError("the bench's fake engine has no device thread")

        def abandon(self, reason: str) -> None:
            pass

        async def aclose(self, join_timeout_s: float | None = None) -> None:
            await super().aclose()

    async def _load(cls: type[Any], *args: Any, **kwargs: Any) -> FakeEngine:
        return _BenchFakeEngine()

    engine_mlx.MlxEngine.load = classmethod(_load)  # type: ignore[method-assign, assignment]
