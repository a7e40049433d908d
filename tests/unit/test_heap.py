"""`adapters.heap.freeze_startup_heap`: what a process built before serving leaves the cyclic
collector's passes, and what startup left unreachable is collected first, not kept."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from adapters.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.peer: _Node | None = None


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the suite's process keeps its usual collector


def _tracked(obj: object) -> bool:
    return any(other is obj for other in gc.get_objects())


def test_what_startup_built_leaves_the_collectors_passes(frozen_heap: None) -> None:
    startup = [_Node() for _ in range(50)]
    cycle = _Node()
    cycle.peer = cycle
    unreachable = weakref.ref(cycle)
    del cycle
    assert _tracked(startup[0])

    frozen = freeze_startup_heap()

    assert frozen == gc.get_freeze_count() >= len(startup)
    assert not _tracked(startup[0])  # frozen: no pass walks it
    assert unreachable() is None  # startup's garbage was collected, not frozen
    serving = _Node()
    assert _tracked(serving)  # what serving makes is collected as before
