"""`adapters.kv.pull.ReceiveBuffers`: a buffer is handed out again only once nothing refers to it.

The property that matters is safety: a view (or a numpy array over it) that someone still holds
is never overwritten by a later pull. Reuse is the point of the pool, so it is checked too, and
the cap on what stays kept.
"""

from __future__ import annotations

import numpy as np
import pytest

from adapters.kv.pull import ReceiveBuffers

MIB = 1 << 20


def _owner(view: memoryview) -> int:
    return id(view.obj)


def test_a_view_of_the_length_asked_for() -> None:
    buffers = ReceiveBuffers(keep_bytes=16 * MIB)
    view = buffers.take(1234)
    assert len(view) == 1234 and not view.readonly


def test_a_held_view_is_never_handed_out_again() -> None:
    buffers = ReceiveBuffers(keep_bytes=16 * MIB)
    first = buffers.take(MIB)
    first[:] = b"a" * MIB
    second = buffers.take(MIB)
    assert _owner(second) != _owner(first)
    second[:] = b"b" * MIB
    assert bytes(first) == b"a" * MIB


def test_a_numpy_array_over_a_view_keeps_its_buffer_busy() -> None:
    buffers = ReceiveBuffers(keep_bytes=16 * MIB)
    view = buffers.take(MIB)
    owner = _owner(view)
    array = np.frombuffer(view[16:], dtype=np.uint8)
    del view
    again = buffers.take(MIB)
    assert _owner(again) != owner
    del array, again
    assert _owner(buffers.take(MIB)) == owner  # idle again: the first fit is reused


def test_a_released_buffer_is_reused_smallest_fit_first() -> None:
    buffers = ReceiveBuffers(keep_bytes=64 * MIB)
    small, large = buffers.take(MIB), buffers.take(8 * MIB)
    small_owner, large_owner = _owner(small), _owner(large)
    del small, large
    assert _owner(buffers.take(MIB // 2)) == small_owner
    assert _owner(buffers.take(3 * MIB)) == large_owner
    assert buffers.kept_bytes == 9 * MIB  # nothing new was allocated


def test_idle_buffers_beyond_the_cap_are_dropped_busy_ones_never() -> None:
    buffers = ReceiveBuffers(keep_bytes=2 * MIB)
    held = [buffers.take(MIB) for _ in range(4)]
    assert buffers.kept_bytes == 4 * MIB  # all busy: over the cap, but none may go
    for i, view in enumerate(held):
        view[:] = bytes([i]) * MIB
    del view
    held.pop()
    held.pop()
    buffers.take(MIB)  # reuses one idle buffer, then trims the other (over the cap)
    assert buffers.kept_bytes == 3 * MIB
    assert [bytes(v[:1]) for v in held] == [b"\x00", b"\x01"]


def test_a_negative_cap_is_refused() -> None:
    with pytest.raises(ValueError):
        ReceiveBuffers(keep_bytes=-1)
