"""Opening and closing a real `MlxEngine` in a test, each under a deadline: a tiny model loads
and closes in seconds, so an engine that hangs (a device thread that never answers) fails its
test here, at once and saying so, instead of running into the per-test timeout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from adapters.mlx import MlxEngine

ENGINE_DEADLINE_S = 120.0  # generous: a loaded 2-core machine compiles and loads slowly


async def load_engine(model_dir: Path, **kw: Any) -> MlxEngine:
    with trio.fail_after(ENGINE_DEADLINE_S):
        return await MlxEngine.load(model_dir, **kw)


async def close_engine(engine: MlxEngine) -> None:
    with trio.fail_after(ENGINE_DEADLINE_S):
        await engine.aclose()
