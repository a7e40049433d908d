"""The engine's prefix cache: the KV of whole prefill chunks, kept for prompts that start the same way.

After a prompt's block is built (`run_units`: a chunk, one call, of at most `chunk_size` tokens,
ending early after a token of `ends`, `statecore.prefix.block_bounds`), its slice of every layer's
keys and values is kept as one block (a copy in a buffer of its own, evaluated with the step), under the key
that names every token up to its end and where each block ends (`statecore.prefix.block_keys`).
A new prompt whose first blocks are cached starts from a cache made of them (concatenated, so
the blocks themselves are never written) at its first uncached chunk: the calls after it are
the ones it would have made from token 0, so its tokens are the same to the bit. A block is
stored once, however many prompts share it. Plain `KVCache` models without kv_bits only (what
the slot lane takes); the other families' state at a chunk boundary is not a slice of a cache
(rotating windows, SSM state, chunked attention), so they are not cached. The device blocks
count against the node's KV budget: `PrefixIndex` keeps them within `capacity` and admission
evicts them before it refuses a request.

The host tier (`host_bytes` > 0; by default only where the device's memory is not the host's,
MLX's CUDA backend: `default_host_bytes`): a block evicted from the device is copied into a
bounded pool of host memory (numpy arrays, bf16 as its bits) instead of being forgotten. A
prompt whose next blocks are there takes them back to the device when that is quicker than
computing them (`host_pull`: auto decides by `statecore.routing.prefix_pull_pays`, the rule of
`--prefix-pull`, on measured rates: the host-to-device copies' bytes per second, measured here,
and the seconds a prefill token adds to a step, the device loop's `StepRates`; always; never).
A block that came back holds the very bytes the device computed, so the prompt's tokens are
still a cache-less run's. Device thread only.
This module imports mlx, mlx_lm and numpy; never trio.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from adapters.mlx.prefill import on_cuda
from statecore.prefix import (
    ALL,
    DEVICE,
    HOST,
    MessageBlocks,
    Moved,
    PrefixIndex,
    block_keys,
    conversation_block_keys,
)
from statecore.routing import PullRates, prefix_pull_pays

__all__ = ["HOST_PULL_MODES", "PrefixCache", "default_host_bytes", "to_device", "to_host"]

HOST_PULL_MODES = ("auto", "always", "never")  # --prefix-host-pull, as --prefix-pull's
_HOST_SHARE_OF_MEMORY = 8  # by default the host pool takes at most this fraction of the host's memory
_HOST_TIMES_DEVICE = 4  # ... and at most this many times the device tier's capacity

_HostArray = tuple[np.ndarray[Any, Any], mx.Dtype]


def default_host_bytes(device_bytes: int) -> int:
    """The host pool's capacity when none is given: on MLX's CUDA backend (the device's memory is
    not the host's) four times the device tier's, and at most an eighth of the host's memory;
    0 (off) on unified memory (Apple silicon, the CPU backend), where the host is the device."""
    if not on_cuda() or device_bytes <= 0:
        return 0
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(_HOST_TIMES_DEVICE * device_bytes, physical // _HOST_SHARE_OF_MEMORY)


def _own_copy(array: Any, start: int, end: int) -> Any:
    """A layer's keys or values at positions [start, end) (axis 2) in a buffer of their own (lazy:
    evaluated with the step). A slice is a view of the prompt's whole buffer, and only a copy of a
    strided one (several rows or heads: MLX's general copy) always writes a new buffer: a slice
    that is already contiguous (one key/value head) `mx.contiguous` returns as it is, and any
    plain copy of it takes over the input's buffer when nothing else holds that by then (MLX
    donates it: the prompt's cache had moved on to a larger buffer before the step evaluated
    the block). Either kept 256 positions and more alive for the block's counted bytes; a gather
    writes a new buffer (and costs 2.5-4x a general copy on the CPU, so only where it must)."""
    if array.shape[0] * array.shape[1] > 1 and end - start < array.shape[2]:
        return mx.contiguous(array[..., start:end, :])
    return mx.take(array, mx.arange(start, end), axis=2)


def to_host(array: Any) -> _HostArray:
    """A device array's bytes in host memory (bf16, which numpy lacks, as its 16-bit words)."""
    dtype = array.dtype
    bits = array.view(mx.uint16) if dtype == mx.bfloat16 else array
    return np.array(bits, copy=True), dtype


def to_device(held: _HostArray) -> Any:
    """A host copy (`to_host`'s) back on the device, with its bytes and dtype as they were."""
    data, dtype = held
    array = mx.array(data)
    return array.view(dtype) if dtype == mx.bfloat16 else array


class PrefixCache:
    def __init__(self, chunk_size: int, capacity_bytes: int, host_bytes: int = 0,
                 host_pull: str = "auto", rates: PullRates | None = None,
                 room: Callable[[], int] | None = None,
                 prefill_token_s: Callable[[], float | None] | None = None,
                 ends: frozenset[int] = frozenset(), rule: MessageBlocks = ALL) -> None:
        """`ends`: the tokens after which a block ends early (the device loop's block ends), by
        `rule` (`statecore.prefix.block_bounds`).
        `room`: the device bytes KV admission leaves free beside the kept blocks now (the
        device loop's budget less what requests reserved, the slot pool and the blocks): blocks
        kept or coming back from the host never take more; older blocks leave the device for
        them (None: only the capacity bounds them). `prefill_token_s`: the seconds a prefill
        token adds to a step, as the device loop measures it (None until measured: no host
        block comes back under "auto" before then)."""
        if host_pull not in HOST_PULL_MODES:
            raise ValueError(f"host_pull must be one of {', '.join(HOST_PULL_MODES)}, not {host_pull!r}")
        self.chunk_size = chunk_size
        self.ends = ends
        self.rule = rule
        self.host_pull = host_pull
        self.room = room
        self.prefill_token_s = prefill_token_s
        self.index = PrefixIndex(capacity_bytes, host_bytes)
        self._blocks: dict[bytes, list[tuple[Any, Any]]] = {}  # device: key -> per layer (keys, values)
        self._host: dict[bytes, list[tuple[_HostArray, _HostArray]]] = {}  # the host pool's copies
        self.queries = 0  # prompts looked up (every prompt with at least one whole block)
        self.hits = 0  # prompts that started from cached blocks
        self.tokens_reused = 0  # prompt tokens not computed thanks to them
        self.evictions = 0  # blocks that left the device, for capacity or because admission needed memory
        self.host_out = 0  # ... of them, copied into the host pool
        self.host_back = 0  # host blocks a prompt took back to the device
        self.host_forgotten = 0  # host blocks forgotten to stay within the pool's capacity
        self.host_declined = 0  # prompts that found host blocks and computed them (quicker, measured)
        # what the host pulls weigh (statecore.routing.prefix_pull_pays): the copies have no
        # latency to speak of; the rates are this node's and outlive an emptied cache
        self.rates = PullRates(pull_latency_s=0.0) if rates is None else rates

    @property
    def nbytes(self) -> int:
        return self.index.nbytes

    @property
    def host_nbytes(self) -> int:
        return self.index.host_nbytes

    def emptied(self) -> PrefixCache:
        """A new, empty cache of the same sizes (the measured rates kept: they are the node's)."""
        return PrefixCache(self.chunk_size, self.index.capacity_bytes, self.index.host_capacity_bytes,
                           self.host_pull, self.rates, self.room, self.prefill_token_s, self.ends,
                           self.rule)

    def keys_of(self, tokens: Sequence[int]) -> list[bytes]:
        """The prompt's block keys: computed once per prompt, for `start` and every `keep`."""
        return block_keys(tokens, self.chunk_size, self.ends, rule=self.rule)

    def conversation_keys_of(self, tokens: Sequence[int]) -> list[bytes]:
        """The keys of every block of `tokens` as a prefix of a longer prompt (its end included
        when a block ends there): a conversation kept, a prefix exported or imported."""
        return conversation_block_keys(tokens, self.chunk_size, self.ends)

    def start(self, keys: Sequence[bytes], counted: bool = True, again: bool = False, already: int = 0,
              hit_before: bool = False) -> tuple[int, list[Any] | None]:
        """How many leading blocks of a prompt's `keys` are cached, and a fresh cache holding
        them (None when none is; its `offset`: the tokens they cover); host blocks after the
        device's come back first when that pays. Not `counted`: a conversation kept, not a prompt
        served; `again`: a prompt looked up at arrival, looked up once more (a hit counts, not a
        query); `already`: the leading tokens the prompt holds (a prompt part-way through,
        skipping blocks kept meanwhile: only the rest count as reused), `hit_before`: some of them
        came from the cache (its hit is counted)."""
        if keys and counted and not again:
            self.queries += 1
        count = self.index.cached(keys)
        on_host = self.index.on_host(keys, count)
        if on_host:
            if self._host_pays(self._tokens(keys[:count]), self._tokens(keys[count : count + on_host])):
                self._apply(self.index.promote(keys, count, self._room()))
                count = self.index.cached(keys)
            elif counted:
                self.host_declined += 1
        if count == 0:
            return 0, None
        layers = len(self._blocks[keys[0]])
        cache = []
        for layer in range(layers):
            own = KVCache()  # type: ignore[no-untyped-call]
            own.keys = mx.concatenate([self._blocks[key][layer][0] for key in keys[:count]], axis=2)
            own.values = mx.concatenate([self._blocks[key][layer][1] for key in keys[:count]], axis=2)
            own.offset = int(own.keys.shape[2])
            cache.append(own)
        if counted:
            self.hits += 0 if hit_before else 1
            self.tokens_reused += cache[0].offset - already
        return count, cache

    def keep(self, keys: Sequence[bytes], chunk: int, cache: Sequence[Any], start: int, end: int
             ) -> list[Any]:
        """Keep chunk `chunk` of the prompt whose block keys are `keys` (just built into `cache`,
        its tokens [start, end)) on the device unless it is there already (a host copy gives way
        to it: a block is in one tier); returns the arrays to evaluate with this step (none when
        nothing new is kept)."""
        if chunk >= len(keys) or self.index.on_device(keys[chunk]):
            return []
        parent = keys[chunk - 1] if chunk else None
        if parent is not None and not self.index.on_device(parent):
            return []  # its prefix left the device meanwhile: a block is kept only after its parent
        block = [(_own_copy(layer.keys, start, end), _own_copy(layer.values, start, end)) for layer in cache]
        nbytes = sum(int(k.nbytes) + int(v.nbytes) for k, v in block)
        self.rates = self.rates.held(nbytes, end - start)
        self._host.pop(keys[chunk], None)
        self._blocks[keys[chunk]] = block
        self._apply(self.index.add(keys[chunk], parent, nbytes, self._room()))
        if keys[chunk] not in self._blocks:
            return []
        return [array for pair in block for array in pair]

    def evict(self, nbytes: int) -> None:
        """Free at least `nbytes` of device memory (admission needs them), least recently used
        blocks first: into the host pool when there is one."""
        self._apply(self.index.evict(nbytes))

    def evict_host(self, nbytes: int) -> None:
        """Forget at least `nbytes` of the host pool (or all of it), least recently used first."""
        self._apply(self.index.evict_host(nbytes))

    def _apply(self, moves: Sequence[Moved]) -> None:
        """Do with the arrays what the index did with the keys, in the same order."""
        copied = 0
        started = time.perf_counter()
        for moved in moves:
            key = moved.key
            if moved.to == HOST:
                self._host[key] = [(to_host(k), to_host(v)) for k, v in self._blocks.pop(key)]
                self.evictions += 1
                self.host_out += 1
            elif moved.to == DEVICE:
                arrays = [(to_device(k), to_device(v)) for k, v in self._host.pop(key)]
                mx.eval(arrays)
                self._blocks[key] = arrays
                copied += sum(int(k.nbytes) + int(v.nbytes) for k, v in arrays)
                self.host_back += 1
            elif self._blocks.pop(key, None) is not None:
                self.evictions += 1
            elif self._host.pop(key, None) is not None:
                self.host_forgotten += 1
        if copied:  # the copies back, timed with whatever left the device for them
            self.rates = self.rates.pulled(copied, 0.0, time.perf_counter() - started)

    def _tokens(self, keys: Sequence[bytes]) -> int:
        """The tokens held blocks cover (each block's length, read off its first layer's keys)."""
        held = 0
        for key in keys:
            device = self._blocks.get(key)
            held += int(device[0][0].shape[2] if device is not None else self._host[key][0][0][0].shape[2])
        return held

    def _room(self) -> int | None:
        return None if self.room is None else self.room()

    def _host_pays(self, device_tokens: int, host_tokens: int) -> bool:
        if self.host_pull != "auto":
            return self.host_pull == "always"
        seconds = None if self.prefill_token_s is None else self.prefill_token_s()
        rates = replace(self.rates, prefill_tokens_per_s=1 / seconds if seconds else None)
        return prefix_pull_pays(device_tokens + host_tokens, device_tokens, rates)
