"""`Checkpoint`: what a model call changed in mlx-lm's caches is undone, even MLX's in-place `+=`."""

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


def test_objects_outside_mlx_lm_are_shared_not_saved() -> None:
    class Sampler:
        position = 3

    sampler = Sampler()
    checkpoint = Checkpoint([sampler, [1, 2, 3]])
    sampler.position = 9
    checkpoint.restore()
    assert sampler.position == 9  # the engine rewinds its samplers itself
