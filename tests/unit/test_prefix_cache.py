"""The prefix cache's arrays (`adapters.mlx.prefix_cache.PrefixCache`) on tiny real KV: cases the
model-based test (`tests/model/test_prefix_cache_model.py`) found, kept as plain regressions."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from adapters.mlx.prefix_cache import PrefixCache

CHUNK = 4
TOKENS = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # two blocks before the last token


@pytest.fixture
def live_bytes() -> Iterator[None]:
    """MLX's count of live bytes is the arrays' own: no larger cached buffer handed out for a small one."""
    limit = mx.set_cache_limit(0)
    gc.collect()
    try:
        yield
    finally:
        mx.set_cache_limit(limit)


def computed(cache: list[Any], tokens: int, heads: int) -> None:
    """`tokens` more positions computed into a prompt's own cache (mlx-lm's KVCache, whose buffer
    grows by 256 positions)."""
    for layer, own in enumerate(cache):
        own.update_and_fetch(mx.full((1, heads, tokens, 2), layer + 1.0, mx.float16),
                             mx.full((1, heads, tokens, 2), -layer - 1.0, mx.float16))


@pytest.mark.parametrize("heads", [1, 2])
def test_a_kept_block_holds_its_own_bytes_not_the_prompt_s_buffer(live_bytes: None, heads: int) -> None:
    # One key/value head (the tiny llama's; multi-query models'): a block's slice of the prompt's
    # buffer is already contiguous, and a block kept as that slice kept the whole buffer alive
    # (256 positions for 4 counted).
    before = mx.get_active_memory()
    prefix = PrefixCache(CHUNK, capacity_bytes=1 << 20)
    cache = [KVCache() for _ in range(2)]  # type: ignore[no-untyped-call]
    computed(cache, len(TOKENS), heads)
    mx.eval(prefix.keep(prefix.keys_of(TOKENS), 0, cache, 0, CHUNK))
    assert prefix.nbytes == 2 * 2 * heads * CHUNK * 2 * 2
    del cache
    gc.collect()
    assert mx.get_active_memory() - before == prefix.nbytes


@pytest.mark.parametrize("heads", [1, 2])
def test_a_block_evaluated_after_its_prompt_moved_on_holds_its_own_bytes(live_bytes: None,
                                                                         heads: int) -> None:
    # Two blocks kept as they are built, their arrays left for a later step; the second leaves the
    # device (its copy to the host evaluates it first), then the step evaluates the first. By then
    # only the first block's slice held the prompt's older buffer: a copy of it may take that
    # buffer over (MLX donates a lone input's buffer), where a gather writes a new one (a strided
    # slice's copy always does).
    before = mx.get_active_memory()
    keys = PrefixCache(CHUNK, 0).keys_of(TOKENS)
    prefix = PrefixCache(CHUNK, capacity_bytes=1 << 20, host_bytes=1 << 20)
    cache = [KVCache() for _ in range(2)]  # type: ignore[no-untyped-call]
    pending = []
    for chunk in range(2):
        computed(cache, CHUNK, heads)
        pending.extend(prefix.keep(keys, chunk, cache, chunk * CHUNK, (chunk + 1) * CHUNK))
    prefix.evict(1)  # the second block, the least recently used leaf, to the host
    assert prefix.index.device_keys() == keys[:1] and prefix.index.host_keys() == keys[1:]
    mx.eval(pending)
    del cache, pending
    gc.collect()
    assert mx.get_active_memory() - before == prefix.nbytes == 2 * 2 * heads * CHUNK * 2 * 2
