"""The engine's prefix cache: the KV of whole prefill chunks, kept for prompts that start the same way.

After a prompt's chunk of `chunk_size` tokens is built (`run_units`), its slice of every layer's
keys and values is kept as one block (a contiguous copy, evaluated with the step), under the key
that names every token up to its end (`statecore.prefix.block_keys`). A new prompt whose first
blocks are cached starts from a cache made of them (concatenated, so the blocks themselves are
never written) at its first uncached chunk: the calls after it are the ones it would have made
from token 0, so its tokens are the same to the bit. A block is stored once, however many
prompts share it. Plain `KVCache` models without kv_bits only (what the slot lane takes); the
other families' state at a chunk boundary is not a slice of a cache (rotating windows, SSM
state, chunked attention), so they are not cached. The blocks count against the node's KV budget:
`PrefixIndex` keeps them within `capacity` and admission evicts them before it refuses a
request. Device thread only. This module imports mlx and mlx_lm; never trio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from statecore.prefix import PrefixIndex, block_keys

__all__ = ["PrefixCache"]


class PrefixCache:
    def __init__(self, chunk_size: int, capacity_bytes: int) -> None:
        self.chunk_size = chunk_size
        self.index = PrefixIndex(capacity_bytes)
        self._blocks: dict[bytes, list[tuple[Any, Any]]] = {}  # key -> per layer (keys, values)
        self.queries = 0  # prompts looked up (every prompt with at least one whole block)
        self.hits = 0  # prompts that started from cached blocks
        self.tokens_reused = 0  # prompt tokens not computed thanks to them
        self.evictions = 0  # blocks forgotten, for capacity or because admission needed memory

    @property
    def nbytes(self) -> int:
        return self.index.nbytes

    def keys_of(self, tokens: Sequence[int]) -> list[bytes]:
        """The prompt's block keys: computed once per prompt, for `start` and every `keep`."""
        return block_keys(tokens, self.chunk_size)

    def start(self, keys: Sequence[bytes], counted: bool = True, again: bool = False
              ) -> tuple[int, list[Any] | None]:
        """How many leading blocks of a prompt's `keys` are cached, and a fresh cache holding
        them (None when none is). Not `counted`: a conversation kept, not a prompt served;
        `again`: a prompt looked up at arrival, looked up once more (a hit counts, not a query)."""
        if keys and counted and not again:
            self.queries += 1
        count = self.index.cached(keys)
        if count == 0:
            return 0, None
        layers = len(self._blocks[keys[0]])
        cache = []
        for layer in range(layers):
            own = KVCache()  # type: ignore[no-untyped-call]
            own.keys = mx.concatenate([self._blocks[key][layer][0] for key in keys[:count]], axis=2)
            own.values = mx.concatenate([self._blocks[key][layer][1] for key in keys[:count]], axis=2)
            own.offset = count * self.chunk_size
            cache.append(own)
        if counted:
            self.hits += 1
            self.tokens_reused += count * self.chunk_size
        return count, cache

    def keep(self, keys: Sequence[bytes], chunk: int, cache: Sequence[Any]) -> list[Any]:
        """Keep chunk `chunk` of the prompt whose block keys are `keys` (just built into `cache`)
        unless it is kept already; returns the arrays to evaluate with this step (none when
        nothing new is kept)."""
        if chunk >= len(keys) or keys[chunk] in self.index:
            return []
        parent = keys[chunk - 1] if chunk else None
        if parent is not None and parent not in self.index:
            return []  # its prefix was forgotten meanwhile: a block is kept only after its parent
        start, end = chunk * self.chunk_size, (chunk + 1) * self.chunk_size
        block = [(mx.contiguous(layer.keys[..., start:end, :]),
                  mx.contiguous(layer.values[..., start:end, :])) for layer in cache]
        nbytes = sum(int(k.nbytes) + int(v.nbytes) for k, v in block)
        forgotten = self.index.add(keys[chunk], parent, nbytes)
        self.evictions += sum(1 for key in forgotten if key in self._blocks)
        if keys[chunk] in forgotten:
            return []
        self._blocks[keys[chunk]] = block
        for key in forgotten:
            self._blocks.pop(key, None)
        return [array for pair in block for array in pair]

    def evict(self, nbytes: int) -> None:
        """Free at least `nbytes` (admission needs them), least recently used blocks first."""
        for key in self.index.evict(nbytes):
            if self._blocks.pop(key, None) is not None:
                self.evictions += 1
