"""A restorable snapshot of a request's or a batch's caches, taken before a model call so that a
call which raises part-way (some layers' caches advanced, others not) can be undone and computed
again or split up. MLX only; never imports trio or the HTTP side.

What is saved is each cache's public `state` (mlx-lm's property, which every cache class has and
`from_state` rebuilds from: arrays, ints, `None`), read through that property and put back through
its setter: no private attribute of mlx-lm is read here, and no object's attribute dict. A
`CacheList` is saved member by member, so that every reference to a member sees it restored.
What is shared, not copied: large arrays. A large array written in place by the call (a cache's
keys and values) changes only at positions past the saved offset, which the next call writes
again; a small one (offsets, paddings: MLX's `+=` rewrites the array object itself) is held as a
separate array so its saved value survives. A list inside a state (an `ArraysCache`'s states) is
copied: the call may set its items.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import CacheList

__all__ = ["Checkpoint"]

_SMALL_ARRAY = 4096  # elements: held as their own array (a lazy no-op, evaluated only if restored)


def _held(value: Any) -> Any:
    """A value of a state as it is now, safe from the in-place changes a call makes."""
    if isinstance(value, mx.array):
        return mx.stop_gradient(value) if value.size <= _SMALL_ARRAY else value
    if isinstance(value, list):
        return [_held(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_held(item) for item in value)
    return value


def _caches(roots: Iterable[Any]) -> Iterable[Any]:
    """Every cache to save: the roots, a `CacheList`'s members in its place."""
    for cache in roots:
        if isinstance(cache, CacheList):
            yield from _caches(cache.caches)
        else:
            yield cache


class Checkpoint:
    """`Checkpoint(caches)` saves; `restore()` puts every cache back as it was (in place, so
    every reference to it sees the restored state), as often as it is called."""

    def __init__(self, caches: Iterable[Any]) -> None:
        self._saved = [(cache, _held(cache.state)) for cache in _caches(caches)]

    def restore(self) -> None:
        for cache, state in self._saved:
            # Held again: the restored cache's own `+=` must not change what a second restore gives.
            cache.state = _held(state)
