"""A prefill node's streamed pieces in shared memory (`adapters.http.kv_send.SharedPieces`): a
region a copy put after the decode node released the request is freed once the copies settle (it
was held forever before: CI saw 1 MiB held on a prefill node after an untyped fault)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from adapters.http.kv_send import SharedPieces
from adapters.kv.shm_outbox import ShmOutbox
from effects.engine_port import KvPieces
from statecore.ids import RequestId

MIB = 1 << 20


def test_a_region_put_after_the_release_goes_once_the_copies_settle(tmp_path: Path) -> None:
    box = ShmOutbox(max_bytes=4 * MIB, directory=str(tmp_path))
    try:
        shared = SharedPieces(box, cast(Any, SimpleNamespace(on_forget=[])))
        late, live = RequestId("late"), RequestId("live")
        for rid in (late, live):
            shared.hold(rid, KvPieces((b"piece",)))
        shared.release(late)  # the decode node's cancel, while a copy of late's was under way
        box.put(late, [memoryview(b"x" * 1000)])  # that copy's region, put afterwards
        box.put(live, [memoryview(b"y" * 1000)])
        held = box.statistics().held_bytes
        shared.settled(late)
        shared.settled(live)  # still held here: the decode node has not said it is done
        assert 0 < box.statistics().held_bytes < held
        shared.release(live)
        assert box.statistics().held_bytes == 0
    finally:
        box.close()
