"""The load's warm-up request: one request of two chunks and a token through the serving path,
then forgotten.

On MLX's CUDA backend the first use of a kind of work (a kernel compiled at run time, a cuBLASLt
plan) costs up to ~0.5 s on the host; paid at the load, it does not stall the streams decoding
beside the first long prompt: every kind of work a long prompt brings (its chunks, the prefix
cache's copies, its row in the slot pool, the traced step at a long length) has run once before
the first client's request. The request goes through the Engine port as any other (prefilled,
decoded a few tokens, its stream read to its end); then the engine forgets what it left (the
prefix cache's blocks, the step rates its traced steps would skew). It sees the engine only through
the port; it must never import mlx.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from effects.engine_port import Engine, SamplingParams
from statecore.errors import StatecoreError
from statecore.ids import RequestId

__all__ = ["warm_serving_path"]

logger = logging.getLogger("adapters.engine_mlx")


async def warm_serving_path(engine: Engine, chunk_size: int, forget: Callable[[], Awaitable[object]]) -> None:
    """Prefill and decode one request of two chunks (`chunk_size` tokens each) and a token, then
    `forget` what it left. A model or budget too small for such a request is warmed as far as it
    goes."""
    started = time.perf_counter()
    info = engine.info
    length = max(1, min(2 * chunk_size + 1, info.context_length - 8))
    prompt = [1 + i % max(1, min(info.vocab_size - 1, 997)) for i in range(length)]
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    rid = RequestId("statecore-warm-up")
    try:
        outcome = await engine.prefill(rid, prompt, sampling)
        await engine.decode_held(rid, prompt, outcome.first_token, sampling)
        async for _ in engine.stream(rid):
            pass
    except StatecoreError as exc:
        logger.info("the load's warm-up request stopped early: %s", exc)
        await engine.cancel(rid)
        await engine.release_held(rid)
    await forget()
    logger.info("warmed the serving path with a %d-token request in %.1f s", length,
                time.perf_counter() - started)
