"""`Checkpoint`: what a model call changed in mlx-lm's caches is undone through their public `state`,
even MLX's in-place `+=`, a `CacheList`'s members in place, a batch cache's index."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from adapters.mlx.checkpoint import Checkpoint


def test_restore_undoes_reassigned_and_in_place_changes_every_time() -> None:
    arrays: Any = mlx_cache.ArraysCache(size=2, left_padding=[1, 0])
    arrays[0] = mx.ones((2, 3))
    plain: Any = mlx_cache.KVCache()  # type: ignore[no-untyped-call]
    plain.update_and_fetch(mx.ones((1, 1, 4, 2)), mx.ones((1, 1, 4, 2)))
    nested = mlx_cache.CacheList(plain, arrays)  # type: ignore[no-untyped-call]
    checkpoint = Checkpoint([nested])
    for _ in range(2):  # a second failed try is undone as well as the first
        arrays[0] = mx.zeros((2, 3))  # a state replaced
        arrays.left_padding += 5  # rewrites the array object itself
        plain.update_and_fetch(mx.zeros((1, 1, 1, 2)), mx.zeros((1, 1, 1, 2)))
        checkpoint.restore()
        assert arrays.left_padding.tolist() == [1, 0]
        assert mx.array_equal(arrays[0], mx.ones((2, 3)))
        assert plain.offset == 4
        keys, _, _ = plain.state  # past the offset: written again by the next call
        assert mx.array_equal(keys[..., :4, :], mx.ones((1, 1, 4, 2)))


def test_a_batch_cache_is_restored_through_its_public_state() -> None:
    """A batch of two rows (merged, as the batch lane merges them) steps once; restored, its
    offsets, index and contents are as before, and the next step computes as the first did."""
    rows = []
    for length in (3, 5):
        row: Any = mlx_cache.KVCache()  # type: ignore[no-untyped-call]
        row.update_and_fetch(mx.ones((1, 2, length, 4)), mx.ones((1, 2, length, 4)))
        rows.append(row)
    batch: Any = mlx_cache.BatchKVCache.merge(rows)  # type: ignore[no-untyped-call]
    checkpoint = Checkpoint([batch])
    before = batch.offset.tolist(), batch.size()
    first = batch.update_and_fetch(mx.full((2, 2, 1, 4), 2.0), mx.full((2, 2, 1, 4), 2.0))
    mx.eval(first)
    checkpoint.restore()
    assert (batch.offset.tolist(), batch.size()) == before
    again = batch.update_and_fetch(mx.full((2, 2, 1, 4), 2.0), mx.full((2, 2, 1, 4), 2.0))
    assert all(mx.array_equal(a, b) for a, b in zip(first, again, strict=True))
