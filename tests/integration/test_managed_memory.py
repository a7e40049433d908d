"""`adapters.mlx.managed_memory`: what it would move, and that it moves or copies nothing on the CPU:
the bulk moves and the copy engine's copies need MLX's CUDA backend
(`bench/handoff/managed_prefetch.py` times them there)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from adapters.kv import codec
from adapters.mlx import managed_memory


def test_spans_are_each_contiguous_arrays_own_bytes() -> None:
    halves = mx.ones((2, 4, 8), dtype=mx.bfloat16)
    whole = mx.arange(12, dtype=mx.float32)
    strided = mx.ones((4, 4))[:, :2]
    mx.eval(halves, whole, strided)
    spans = managed_memory.spans([halves, whole, strided])
    assert spans == [(np.asarray(codec.wire_view(halves)).ctypes.data, 2 * 4 * 8 * 2),
                     (np.asarray(whole).ctypes.data, 12 * 4)]  # a strided view is left to faults


def test_nothing_moves_on_the_cpu() -> None:
    arrays = [mx.ones((3, 5))]
    mx.eval(arrays)
    before = np.array(arrays[0])
    assert not managed_memory.enabled()
    managed_memory.to_host(arrays)
    managed_memory.to_device(arrays)
    managed_memory.to_host([memoryview(np.asarray(arrays[0]).tobytes())])
    assert np.array_equal(np.array(arrays[0]), before)
    # nothing is copied out either: the host reads the arrays where they are
    assert all(copy is array for copy, array in zip(managed_memory.host_copies(arrays), arrays, strict=True))
