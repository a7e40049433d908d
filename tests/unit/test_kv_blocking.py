"""Where a blocking copy or check of KV bytes runs (`adapters.kv.blocking`): a small one on the
calling trio thread (a streamed handoff's device piece documents make no worker-thread hops), a
large or unsized one in a worker thread, and a shared-memory piece read either way is the same."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from adapters.kv.blocking import ON_THE_CALLER_BYTES, run_blocking
from adapters.kv.shm_inbox import ShmInbox
from adapters.kv.shm_outbox import ShmOutbox


def where() -> str:
    return threading.current_thread().name


@pytest.mark.parametrize(("nbytes", "on_the_caller"), [
    (0, True), (500, True), (ON_THE_CALLER_BYTES, True), (ON_THE_CALLER_BYTES + 1, False), (None, False),
])
async def test_small_work_runs_on_the_caller_and_large_or_unsized_in_a_worker(nbytes: int | None,
                                                                            on_the_caller: bool) -> None:
    caller = where()
    ran_on = await run_blocking(where, nbytes)
    assert (ran_on == caller) is on_the_caller


@pytest.mark.parametrize("size", [300, ON_THE_CALLER_BYTES * 4])
async def test_a_shared_memory_piece_reads_the_same_on_either_thread(tmp_path: Path, size: int) -> None:
    outbox, inbox = ShmOutbox(directory=tmp_path), ShmInbox(directory=tmp_path)
    try:
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        ref = outbox.put("r", [data])
        view = await run_blocking(lambda: inbox.read(ref), ref.nbytes)
        assert bytes(view) == data
        view.release()
        inbox.done(ref)
    finally:
        inbox.close()
        outbox.close()
