"""The prefix cache's arrays (`adapters.mlx.prefix_cache.PrefixCache`) on tiny real KV: cases the
model-based test (`tests/model/test_prefix_cache_model.py`) found, kept as plain regressions."""

from __future__ import annotations

import gc
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from adapters.mlx.prefix_cache import PrefixCache

CHUNK = 4


def prompt_cache(tokens: int, heads: int, layers: int = 2) -> list[Any]:
    """A prompt's own cache as prefill builds it (mlx-lm's KVCache: its buffer grows by 256 positions)."""
    cache = []
    for layer in range(layers):
        own = KVCache()  # type: ignore[no-untyped-call]
        own.update_and_fetch(mx.full((1, heads, tokens, 2), layer + 1.0, mx.float16),
                             mx.full((1, heads, tokens, 2), -layer - 1.0, mx.float16))
        cache.append(own)
    return cache


def test_a_kept_block_holds_its_own_bytes_not_the_prompt_s_buffer() -> None:
    # One key/value head (the tiny llama's; multi-query models'): a block's slice of the prompt's
    # buffer is already contiguous, and a block kept as that slice kept the whole buffer alive
    # (256 positions for 4 counted).
    limit = mx.set_cache_limit(0)  # MLX's buffer cache would hand out larger buffers for small arrays
    try:
        for heads in (1, 2):
            gc.collect()
            before = mx.get_active_memory()
            prefix = PrefixCache(CHUNK, capacity_bytes=1 << 20)
            tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
            cache = prompt_cache(len(tokens), heads)
            mx.eval(prefix.keep(prefix.keys_of(tokens), 0, cache, 0, CHUNK))
            assert prefix.nbytes == 2 * 2 * heads * CHUNK * 2 * 2
            del cache
            gc.collect()
            assert mx.get_active_memory() - before == prefix.nbytes, heads
            del prefix
    finally:
        mx.set_cache_limit(limit)
