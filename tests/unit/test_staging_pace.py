"""The pace of a streamed handoff's writes into its slot while rows decode (`adapters.mlx.staging`):
pieces read in from host memory go a step's share at a time; a piece already in the device's own
memory (a device piece, copied device to device) goes whole with the next step. Real slot
buffers and KV caches of MLX (on the CPU, any device's arrays are in its memory).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from adapters.mlx.slots import SlotPool
from adapters.mlx.staging import StagedSlots, slot_views

LAYERS, HEADS, DIM = 2, 2, 8


def piece(start: int, tokens: int) -> list[KVCache]:
    """One KVCache per layer holding `tokens` positions whose values say where they are."""
    caches = []
    for layer in range(LAYERS):
        keys = mx.broadcast_to(mx.arange(start, start + tokens, dtype=mx.float32)[None, None, :, None],
                               (1, HEADS, tokens, DIM)) + 1000 * layer
        caches.append(KVCache.from_state((mx.array(keys), mx.array(-keys), tokens)))  # type: ignore[no-untyped-call]
    return caches


@pytest.mark.parametrize("in_device_memory", [False, True])
def test_a_piece_in_device_memory_is_written_whole_while_rows_decode(in_device_memory: bool) -> None:
    pool = SlotPool(num_slots=2, num_layers=LAYERS, max_capacity=256)
    staged = StagedSlots()
    prompt = 96
    for start in (0, 32, 64):
        assert staged.stage(pool, "r", 0, start, piece(start, 32), prompt, prompt + 8, room=True,
                            decoding=True, in_device_memory=in_device_memory)
    entry = staged.entries["r"]
    if not in_device_memory:  # paced: the steps write them, a share each
        assert len(entry.pending) == 3 * LAYERS and entry.pending_bytes > 0
        staged.write_some(pool, budget=1)
        assert len(entry.pending) == 3 * LAYERS - 1
        staged.write_some(pool, budget=None)
    assert not entry.pending and entry.pending_bytes == 0
    for layer, cache in enumerate(slot_views(pool, entry.slot, prompt)):
        expected = mx.arange(prompt, dtype=mx.float32) + 1000 * layer
        assert mx.array_equal(cache.keys[0, 0, :, 0], expected).item()
        assert mx.array_equal(cache.values[0, 1, :, 3], -expected).item()
