"""The batch's KV layout: one preallocated slot per decoding row, for models of plain KVCache layers.

Each layer keeps one key and one value buffer of shape (slots, kv_heads, capacity, head_dim). A
request joins by taking the lowest free slot and having its prompt's KV written there; it leaves by
giving the slot back. Nothing of the other rows moves: a step writes each row's new key and value
at that row's own position (one scatter per buffer) and attends over the first `rows` slots with a
mask that hides what lies past each row's length (rows of free slots compute a throwaway token at
position 0). Buffers grow (by doubling, up to the model's context) only when a request needs more
room than any before it; that copy is the one time rows move. `SlotStepLayer` is what the model
sees as a layer's cache during one decode step: mlx-lm's attention calls `update_and_fetch` and
`make_mask`, and RoPE reads the per-row `offset` array. With a pool `attention`
(`adapters.mlx.attention`) each layer also offers `fused_attention`: the rows' attention read in
place from the pool's buffers up to each row's length, no mask and no gather (the masked views
are still built, lazily, for models whose attention is not routed); with `exact_rows` each row
attends in a call of its own over exactly its own length (`attention.exact_rows_attention`: where
masked attention's bits would follow the longest row, a row's tokens then never depend on which
others share its step). This module imports mlx; never trio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import mlx.core as mx

from adapters.mlx.attention import DecodeAttention, exact_rows_attention
from statecore.scheduling import bucketed

__all__ = ["Buffers", "SlotPool", "SlotStepLayer", "layers_over", "zeroed"]

_FIRST_CAPACITY = 256


def zeroed(shape: Any, dtype: Any) -> Any:
    """A zeroed buffer (unevaluated): every allocation of the pool's (a test makes one fail)."""
    return mx.zeros(shape, dtype)


class SlotPool:
    """Per-layer slot buffers and the free-slot list (device thread only)."""

    def __init__(self, num_slots: int, num_layers: int, max_capacity: int) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.max_capacity = max_capacity
        self.capacity = 0
        self.keys: list[Any] = [None] * num_layers
        self.values: list[Any] = [None] * num_layers
        self.attention: DecodeAttention | None = None  # set: layers offer `fused_attention`
        self.exact_rows = False  # set: each row attends in a call of its own (host-known lengths)
        self.generation = 0  # how often the buffers were emptied: a step built before reads nothing back
        self._free = list(range(num_slots))

    # -- slots ---------------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """The lowest free slot (keeps the used range dense, so steps compute few idle rows)."""
        self._free.sort()
        return self._free.pop(0)

    def give_back(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} is already free")
        self._free.append(slot)

    def rows(self, used: Sequence[int]) -> int:
        """How many leading slots a step must cover to include every used one."""
        return max(used) + 1 if used else 0

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in (*self.keys, *self.values) if b is not None)

    # -- contents ------------------------------------------------------------------------------

    def reserve(self, tokens: int, like: Sequence[Any]) -> None:
        """Make room for `tokens` positions per slot (the first buffers shaped after `like`'s
        KVCache layers, one per layer; later growth keeps their shapes)."""
        if tokens > self.max_capacity:
            raise ValueError(f"{tokens} positions exceed the slot capacity limit {self.max_capacity}")
        if tokens <= self.capacity and self.keys[0] is not None:
            return
        capacity = max(self.capacity, _FIRST_CAPACITY)
        while capacity < tokens:
            capacity *= 2
        capacity = min(capacity, self.max_capacity)
        if self.keys[0] is None:  # the first: shaped after `like`, a cache of every layer
            for index, layer in enumerate(like):
                for buffers, sample in ((self.keys, layer.keys), (self.values, layer.values)):
                    _, heads, _, dim = sample.shape
                    buffers[index] = zeroed((self.num_slots, heads, capacity, dim), sample.dtype)
        else:
            for buffers in (self.keys, self.values):
                for index, old in enumerate(buffers):
                    _, heads, _, dim = old.shape
                    extra = zeroed((self.num_slots, heads, capacity - old.shape[2], dim), old.dtype)
                    buffers[index] = mx.concatenate([old, extra], axis=2)
        self.capacity = capacity

    def empty_buffers(self) -> bool:
        """Every layer's buffers replaced by zeroed ones of the same shape, evaluated: after a step
        that wrote them failed on the device, what they hold (its lazy writes, which may raise
        again, and the values its failed kernels left) is not kept. Every slot's contents go with
        them; `generation` counts it. False where the new ones could not be allocated (the device
        out of memory: another process may hold it): the pool is then as before its first
        request, unallocated, and the next request to join allocates it again."""
        kept = [[None if buffer is None else (buffer.shape, buffer.dtype) for buffer in buffers]
                for buffers in (self.keys, self.values)]
        self._unallocated()  # let go of the old ones before the new ones are allocated
        self.generation += 1
        try:
            for buffers, shapes in zip((self.keys, self.values), kept, strict=True):
                for index, shape in enumerate(shapes):
                    if shape is not None:
                        buffers[index] = zeroed(*shape)
                        mx.eval(buffers[index])
        except RuntimeError:  # how MLX says the device is out of memory
            self._unallocated()
            self.capacity = 0
            mx.clear_cache()  # what MLX keeps of freed buffers goes back to the device
            return False
        return True

    def _unallocated(self) -> None:
        self.keys[:] = [None] * self.num_layers
        self.values[:] = [None] * self.num_layers

    def write_prompt(self, slot: int, layers: Sequence[Any], tokens: int) -> None:
        """Copy a request's KVCache layers (covering `tokens` positions) into its slot."""
        self.reserve(tokens + 1, layers)
        for index, layer in enumerate(layers):
            self.keys[index][slot : slot + 1, :, :tokens, :] = layer.keys[..., :tokens, :]
            self.values[index][slot : slot + 1, :, :tokens, :] = layer.values[..., :tokens, :]

    def step_layers(self, offsets: Sequence[int], slots: Sequence[int] | None = None,
                    bucket: int = 0) -> list[SlotStepLayer]:
        """The caches one decode step hands the model: row i is slot i (or `slots[i]` when a
        subset of slots is given, as when a failed step is retried in parts), writing at
        offsets[i]. The whole leading range reads the buffers in place; a subset gathers its rows,
        and rows all of one slot (a verify step's) read that slot in place.
        With `bucket` the attended length is rounded up to a multiple of it (the mask hides the
        extra positions), so the GPU meets a few shapes rather than a new one every step."""
        rows = len(offsets)
        longest = max(offsets) + 1
        if slots is None:
            slot_array = mx.arange(rows, dtype=mx.int32)
        else:
            if len(slots) != rows:
                raise ValueError("one offset per slot")
            slot_array = mx.array(list(slots), dtype=mx.int32)
        one_slot = slots[0] if slots is not None and rows > 1 and len(set(slots)) == 1 else None
        exact = None
        if self.exact_rows:  # each row's (slot, length), its length counting the token it adds
            exact = [(slot, offset + 1) for slot, offset in zip(slots or range(rows), offsets, strict=True)]
        return layers_over(self, mx.array(list(offsets), dtype=mx.int32), slot_array,
                           self.attended_length(offsets, bucket), longest, gather=slots is not None,
                           one_slot=one_slot, exact=exact)

    def attended_length(self, offsets: Sequence[int], bucket: int) -> int:
        """The length a step over rows at `offsets` attends, rounded up to a multiple of `bucket`."""
        return min(self.capacity, bucketed(max(offsets) + 1, bucket))


class Buffers(Protocol):
    """Where a step's layers read and write each layer's key and value buffer: the pool itself,
    or the stand-ins a traced (compiled) step is given."""

    keys: list[Any]
    values: list[Any]
    attention: DecodeAttention | None
    num_layers: int


def layers_over(buffers: Buffers, positions: Any, slot_array: Any, length: int, longest: int,
                gather: bool = False, one_slot: int | None = None,
                exact: Sequence[tuple[int, int]] | None = None) -> list[SlotStepLayer]:
    """One step's layers over `buffers`: row i is slot `slot_array[i]`, writing at positions[i]
    and attending `length` positions (`longest` of them at most hold keys: the fused attention's
    bound, any value from the longest row's length up to `length`); with `exact` (each row's slot
    and length, on the host) each row attends in a call of its own instead."""
    # Row i may see positions 0..positions[i] (its history and the token it adds now).
    mask = (mx.arange(length)[None, :] <= positions[:, None])[:, None, None, :]
    row_index = slot_array[:, None]
    attention = buffers.attention
    reads = None if attention is None else _Reads(attention, slot_array, positions + 1, longest)
    head_index: dict[int, Any] = {}
    layers = []
    for index in range(buffers.num_layers):
        heads = buffers.keys[index].shape[1]
        if heads not in head_index:
            head_index[heads] = mx.arange(heads)[None, :]
        layers.append(SlotStepLayer(buffers, index, positions, row_index, head_index[heads], mask, length,
                                    gather=gather, reads=reads, one_slot=one_slot, exact=exact))
    return layers


class _Reads:
    """What one step's fused attention needs besides a layer's buffers (shared by its layers)."""

    def __init__(self, attention: DecodeAttention, slots: Any, lengths: Any, longest: int) -> None:
        self.attention = attention
        self.slots = slots
        self.lengths = lengths
        self.longest = longest


class SlotStepLayer:
    """One layer's cache as the model sees it during one decode step over the pool's first rows."""

    def __init__(self, pool: Buffers, index: int, positions: Any, row_index: Any, head_index: Any,
                 mask: Any, length: int, gather: bool = False, reads: _Reads | None = None,
                 one_slot: int | None = None, exact: Sequence[tuple[int, int]] | None = None) -> None:
        self._pool = pool
        self._index = index
        self.offset = positions  # per-row RoPE offsets (mx.fast.rope takes an array)
        self._rows = row_index
        self._heads = head_index
        self._mask = mask
        self._length = length
        self._gather = gather
        self._one_slot = one_slot
        self._reads = reads
        self._exact = exact
        self.fused_attention = (self._attend_rows if exact is not None
                                else None if reads is None else self._attend)

    def _attend(self, queries: Any, scale: float) -> Any:
        # Called after update_and_fetch: the pool's buffers hold this step's keys and values.
        reads = self._reads
        assert reads is not None
        pool, i = self._pool, self._index
        return reads.attention(queries, pool.keys[i], pool.values[i], reads.slots, reads.lengths, scale,
                               reads.longest)

    def _attend_rows(self, queries: Any, scale: float) -> Any:
        # Called after update_and_fetch, as `_attend`.
        assert self._exact is not None
        pool, i = self._pool, self._index
        return exact_rows_attention(queries, pool.keys[i], pool.values[i], self._exact, scale)

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        pool, i = self._pool, self._index
        rows = keys.shape[0]
        where = (self._rows, self._heads, self.offset[:, None])
        # Rebinding the pool's buffer before evaluation lets MLX update it in place.
        k = pool.keys[i]
        k[where] = keys[:, :, 0, :]
        pool.keys[i] = k
        v = pool.values[i]
        v[where] = values[:, :, 0, :]
        pool.values[i] = v
        if self._one_slot is not None:
            # Every row reads the same slot: a broadcast view of it, not a copy per row (a
            # 4-row verify step's copies cost up to a fifth of its time on the CPU).
            one, shape = self._one_slot, (rows, k.shape[1], self._length, k.shape[3])
            return (mx.broadcast_to(k[one : one + 1, :, : self._length, :], shape),
                    mx.broadcast_to(v[one : one + 1, :, : self._length, :], shape))
        if self._gather:
            slots = self._rows[:, 0]
            return k[slots, :, : self._length, :], v[slots, :, : self._length, :]
        return k[:rows, :, : self._length, :], v[:rows, :, : self._length, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if n != 1 or window_size is not None:
            raise ValueError("a slot step decodes one token per row, without a window")
        return self._mask
