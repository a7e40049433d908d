"""What a request's KV cache weighs, and how much memory the node gives KV caches.

`KvCost` is measured once at load by prefilling two probe prompts and fitting a line through
their caches' live bytes (`fixed` + `per_token` x tokens), so it holds for every cache family
without a table of classes: plain and quantized KV grow per token, SSM state is fixed, a
rotating cache is over-counted past its window (the safe side); `KvCost.of` adds mlx-lm's
allocation step. `slot_per_token` is one slot's
bytes per position in the slot layout (plain KVCache models). `default_kv_memory_bytes` is the
budget when `--kv-memory-bytes` is not given. This module imports mlx; never trio.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

__all__ = [
    "ALLOCATION_STEP",
    "DEFAULT_KV_MEMORY_FRACTION",
    "KvCost",
    "default_kv_memory_bytes",
    "measure_kv_cost",
    "state_bytes",
]

# mlx-lm's KVCache grows its buffers 256 positions at a time: a cache may hold that many more.
ALLOCATION_STEP = 256
DEFAULT_KV_MEMORY_FRACTION = 0.4
_PROBE_LENGTHS = (8, 24)


@dataclass(frozen=True, slots=True)
class KvCost:
    fixed: int  # bytes a request's cache takes whatever its length
    per_token: int  # bytes per position
    slot_per_token: int  # one slot's bytes per position in the slot layout (0: no slot lane)

    def of(self, tokens: int) -> int:
        """The most a cache of `tokens` positions (its own, outside the slot layout) may take."""
        return self.fixed + self.per_token * (tokens + ALLOCATION_STEP)


def state_bytes(cache: Sequence[Any]) -> int:
    """Bytes of a cache's state arrays as allocated (for caches the KV wire cannot trim)."""
    leaves: list[tuple[str, Any]] = tree_flatten([c.state for c in cache])  # type: ignore[assignment]
    return sum(int(array.nbytes) for _, array in leaves if hasattr(array, "nbytes"))


def measure_kv_cost(probe: Callable[[int], Sequence[Any]], live_bytes: Callable[[Sequence[Any]], int],
                    slot_layers: Sequence[Any] | None) -> KvCost:
    """Fit bytes = fixed + per_token x tokens through two probe caches (`probe(n)` prefills n
    tokens and returns the evaluated cache; `live_bytes` weighs one, trimmed to what it holds);
    `slot_layers`, a plain-KVCache model's cache, gives the slot layout's cost too."""
    short, long = _PROBE_LENGTHS
    small, large = live_bytes(probe(short)), live_bytes(probe(long))
    per_token = max(0, -(-(large - small) // (long - short)))  # rounded up
    fixed = max(0, small - per_token * short)
    slot = sum(2 * c.keys.shape[1] * c.keys.shape[3] * c.keys.dtype.size for c in slot_layers or ())
    return KvCost(fixed, per_token, slot)


def default_kv_memory_bytes() -> int:
    """A share of the device's memory (the GPU's, else the machine's RAM) for KV caches."""
    info: dict[str, Any] = dict(mx.device_info())
    total = info.get("memory_size")
    if not isinstance(total, int) or total <= 0:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total * DEFAULT_KV_MEMORY_FRACTION)
