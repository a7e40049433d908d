"""The slot lane's attention contract (`adapters.mlx.attention.reference_attention`, the oracle the
CUDA kernel is checked against at load): each row attends over its own slot up to its own length,
as MLX's attention over that row alone would."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from adapters.mlx.attention import (
    choose_attention,
    exact_rows_attention,
    masked_matches_alone,
    reference_attention,
)


def test_each_row_attends_its_own_slot_up_to_its_length() -> None:
    slots_n, kv_heads, query_heads, capacity, dim = 4, 2, 6, 40, 16
    key = mx.random.key(3)
    q_key, k_key, v_key = mx.random.split(key, 3)
    keys = mx.random.normal((slots_n, kv_heads, capacity, dim), key=k_key)
    values = mx.random.normal((slots_n, kv_heads, capacity, dim), key=v_key)
    slots = [2, 0, 3]
    lengths = [1, 17, 33]
    queries = mx.random.normal((len(slots), query_heads, 1, dim), key=q_key)
    got = reference_attention(queries, keys, values, mx.array(slots, dtype=mx.int32),
                              mx.array(lengths, dtype=mx.int32), 0.25, max(lengths))
    assert got.shape == (3, query_heads, 1, dim)
    for row, (slot, length) in enumerate(zip(slots, lengths, strict=True)):
        alone = mx.fast.scaled_dot_product_attention(
            queries[row : row + 1], keys[slot : slot + 1, :, :length], values[slot : slot + 1, :, :length],
            scale=0.25)
        np.testing.assert_allclose(np.array(got[row]), np.array(alone[0]), rtol=1e-5, atol=1e-5)


def test_exact_rows_give_each_row_its_bits_alone() -> None:
    """Each row in a call of its own over exactly its length: equal, bit for bit, to its attention
    alone, whatever the other rows' lengths (masked attention over the longest may not be)."""
    kv_heads, query_heads, capacity, dim = 2, 8, 300, 64
    q_key, k_key, v_key = mx.random.split(mx.random.key(5), 3)
    keys = mx.random.normal((4, kv_heads, capacity, dim), key=k_key)
    values = mx.random.normal((4, kv_heads, capacity, dim), key=v_key)
    queries = mx.random.normal((3, query_heads, 1, dim), key=q_key)
    rows = [(2, 7), (0, 41), (3, 290)]
    got = exact_rows_attention(queries, keys, values, rows, 0.125)
    assert got.shape == (3, query_heads, 1, dim)
    for row, (slot, length) in enumerate(rows):
        alone = mx.fast.scaled_dot_product_attention(
            queries[row : row + 1], keys[slot : slot + 1, :, :length], values[slot : slot + 1, :, :length],
            scale=0.125)
        assert mx.array_equal(got[row : row + 1], alone).item()
        # the same row with different neighbours: the same bits
        other = exact_rows_attention(queries[row : row + 1], keys, values, [(slot, length)], 0.125)
        assert mx.array_equal(other, alone).item()


def test_off_cuda_auto_keeps_masked_attention_only_where_its_bits_are_a_rows_alone() -> None:
    alike = masked_matches_alone(8, 2, 64, mx.float32)
    auto = choose_attention("auto", 8, 2, 64, mx.float32)
    assert auto.attention is None and auto.exact_rows is not alike
    assert auto.phrase.startswith("masked (MLX)" if alike else "exact rows")
    assert choose_attention("masked", 8, 2, 64, mx.float32) == (None, False, "masked (MLX)")
    assert choose_attention("rows", 8, 2, 64, mx.float32).exact_rows
    # half precision does not reach the BLAS: masked attention keeps a row's bits there
    assert masked_matches_alone(4, 4, 64, mx.bfloat16)
