"""A restorable snapshot of mlx-lm's generator and cache objects, taken before a model call so
that a call which raises part-way (some layers' caches advanced, others not) can be undone and
computed again or split up. MLX only; never imports trio or the HTTP side.

What is saved: every object of mlx-lm's generator and cache modules reachable from the roots (its
attribute dict) and every list or deque among them (its items). What is shared, not copied: the
model, samplers, and large arrays. A large array written in place by the call (a cache's keys
and values) changes only at positions past the saved offset, which the next call writes again;
a small one (offsets, paddings: MLX's `+=` rewrites the array object itself) is held as a
separate array so its saved value survives.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import mlx.core as mx

_SAVED_MODULES = frozenset({"mlx_lm.generate", "mlx_lm.models.cache"})
_LEAVES = frozenset({int, float, bool, str, type(None), mx.array})
_SMALL_ARRAY = 4096  # elements: held as their own array (a lazy no-op, evaluated only if restored)


def _held(value: Any) -> Any:
    if isinstance(value, mx.array) and value.size <= _SMALL_ARRAY:
        return mx.stop_gradient(value)
    return value


class Checkpoint:
    """`Checkpoint(roots)` saves; `restore()` puts every saved object back as it was (in place,
    so every reference to it sees the restored state)."""

    def __init__(self, *roots: Any) -> None:
        self._objects: list[tuple[Any, dict[str, Any]]] = []
        self._sequences: list[tuple[list[Any] | deque[Any], list[Any]]] = []
        self._seen: set[int] = set()
        for root in roots:
            self._visit(root)

    def _visit(self, value: Any) -> None:
        if type(value) in _LEAVES or id(value) in self._seen:
            return
        if isinstance(value, list | deque):
            self._seen.add(id(value))
            self._sequences.append((value, list(value)))
            if value and type(value[0]) is not int:  # a token list holds nothing to visit
                for item in value:
                    self._visit(item)
        elif isinstance(value, tuple):
            for item in value:
                self._visit(item)
        elif type(value).__module__ in _SAVED_MODULES and hasattr(value, "__dict__"):
            self._seen.add(id(value))
            attributes = vars(value)
            self._objects.append((value, {name: _held(v) for name, v in attributes.items()}))
            for item in list(attributes.values()):
                self._visit(item)

    def restore(self) -> None:
        for sequence, items in self._sequences:
            if isinstance(sequence, deque):
                sequence.clear()
                sequence.extend(items)
            else:
                sequence[:] = items
        for obj, attributes in self._objects:
            vars(obj).clear()
            # Held again: the restored object's own `+=` must not change what a second restore gives.
            vars(obj).update({name: _held(v) for name, v in attributes.items()})


__all__ = ["Checkpoint"]
