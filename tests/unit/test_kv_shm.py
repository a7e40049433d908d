"""`adapters.kv.shm_outbox`, `shm_inbox` and `shm_region`: KV bytes through shared memory, validated
and nothing left behind.

One process plays both ends here (the cross-process cases, a producer killed or stopped by
SIGTERM, are in tests/integration/test_kv_shm_cross_process.py). Each test gets its own
directory in /dev/shm (the temporary directory where there is none), so it can assert exactly
which files exist, and that none do once the outbox is closed.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from adapters.kv.shm_inbox import ShmInbox, same_host
from adapters.kv.shm_outbox import ShmOutbox
from adapters.kv.shm_region import (
    DATA_OFFSET,
    ShmAdvert,
    ShmRef,
    default_directory,
    parse_advert,
    parse_ref,
    sweep_orphans,
)
from statecore.errors import Code, Fault, StatecoreError

MIB = 1 << 20


@pytest.fixture
def where() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="statecore-test-", dir=default_directory()))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def outbox(where: Path) -> Iterator[ShmOutbox]:
    box = ShmOutbox(max_bytes=16 * MIB, directory=where)
    yield box
    box.close()


@pytest.fixture
def inbox(where: Path) -> Iterator[ShmInbox]:
    box = ShmInbox(where)
    yield box
    box.close()


def _code(excinfo: pytest.ExceptionInfo[StatecoreError]) -> Code:
    return excinfo.value.info.code


def _payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# --------------------------------------------------------------------------- the round trip


def test_pieces_come_back_as_one_read_only_view_of_their_concatenation(
        outbox: ShmOutbox, inbox: ShmInbox) -> None:
    array = np.arange(1000, dtype=np.float32)
    pieces: list[bytes | memoryview] = [b"head", memoryview(bytearray(b"middle")), array.data]
    ref = outbox.put("r1", pieces)
    wire = parse_ref(json.loads(json.dumps(ref.model_dump())))  # it travels as JSON
    assert wire == ref and ref.offset == DATA_OFFSET and ref.nbytes == 10 + array.nbytes
    view = inbox.read(wire)
    assert view.readonly
    assert bytes(view) == b"headmiddle" + array.tobytes()
    landed = np.frombuffer(view[10:], dtype=np.float32).copy()  # the one copy into place
    inbox.done(wire)
    assert outbox.free(wire) is True
    np.testing.assert_array_equal(landed, array)


def test_an_empty_put_reads_back_empty(outbox: ShmOutbox, inbox: ShmInbox) -> None:
    ref = outbox.put("r1", [])
    assert ref.nbytes == 0 and bytes(inbox.read(ref)) == b""


def test_without_a_checksum_the_reference_carries_none(where: Path, inbox: ShmInbox) -> None:
    box = ShmOutbox(max_bytes=4 * MIB, directory=where, checksum=False)
    try:
        ref = box.put("r1", [b"abc"])
        assert ref.crc32 is None and bytes(inbox.read(ref)) == b"abc"
    finally:
        box.close()


def test_a_freed_region_is_reused_and_a_later_put_is_read_correctly(
        outbox: ShmOutbox, inbox: ShmInbox) -> None:
    first = outbox.put("r1", [_payload(MIB, 1)])
    inbox.read(first)
    outbox.free(first)
    second = outbox.put("r2", [_payload(MIB - 7, 2)])
    assert second.region == first.region and second.generation > first.generation
    assert bytes(inbox.read(second)) == _payload(MIB - 7, 2)
    stats = outbox.statistics()
    assert (stats.created, stats.reused, stats.puts) == (1, 1, 2)


def test_a_small_put_does_not_take_a_much_larger_idle_region(outbox: ShmOutbox) -> None:
    big = outbox.put("r1", [bytes(8 * MIB)])
    outbox.free(big)
    small = outbox.put("r2", [b"x"])
    assert small.region != big.region


def test_bytes_written_in_place_through_reserve_are_read_back(outbox: ShmOutbox, inbox: ShmInbox) -> None:
    array = np.arange(4096, dtype=np.float32)
    writer = outbox.reserve("r1", array.nbytes)
    place = np.frombuffer(writer.view, dtype=np.float32)
    np.copyto(place, array)  # the copy that makes the bytes lands in shared memory
    del place
    ref = writer.commit()
    assert ref.nbytes == array.nbytes and ref.crc32 is not None
    np.testing.assert_array_equal(np.frombuffer(inbox.read(ref), dtype=np.float32), array)


def test_a_reserved_region_is_invisible_until_committed_and_abort_gives_it_back(
        outbox: ShmOutbox, inbox: ShmInbox) -> None:
    writer = outbox.reserve("r1", 16)
    writer.view[:] = b"x" * 16
    unpublished = ShmRef(region=outbox.region_names()[0], offset=DATA_OFFSET, nbytes=16, generation=1)
    with pytest.raises(StatecoreError) as excinfo:
        inbox.read(unpublished)
    assert _code(excinfo) is Code.KV_SHM_GONE
    writer.abort()
    writer.abort()
    assert outbox.statistics().held_regions == 0
    with pytest.raises(StatecoreError) as twice:
        writer.commit()
    assert twice.value.info.fault is Fault.BUG


def test_a_request_released_during_its_write_publishes_nothing(outbox: ShmOutbox, inbox: ShmInbox) -> None:
    writer = outbox.reserve("r1", 3)
    writer.view[:] = b"abc"
    outbox.release("r1")
    ref = writer.commit()
    with pytest.raises(StatecoreError) as excinfo:
        inbox.read(ref)
    assert _code(excinfo) is Code.KV_SHM_GONE
    assert outbox.put("r2", [b"def"]).region == ref.region  # the region is free again


# --------------------------------------------------------------------------- failures, typed


def test_a_region_unlinked_before_the_read_is_gone(where: Path, outbox: ShmOutbox, inbox: ShmInbox) -> None:
    ref = outbox.put("r1", [b"abc"])
    os.unlink(where / ref.region)
    with pytest.raises(StatecoreError) as excinfo:
        inbox.read(ref)
    assert _code(excinfo) is Code.KV_SHM_GONE
    assert excinfo.value.info.fault is Fault.PEER and excinfo.value.info.http_status == 502


def test_a_region_unlinked_after_an_earlier_read_is_gone_too(
        where: Path, outbox: ShmOutbox, inbox: ShmInbox) -> None:
    ref = outbox.put("r1", [b"abc"])
    inbox.read(ref).release()  # the inbox keeps the region mapped
    os.unlink(where / ref.region)
    with pytest.raises(StatecoreError) as excinfo:
        inbox.read(ref)
    assert _code(excinfo) is Code.KV_SHM_GONE
    assert inbox.mapped_regions() == []


def test_corrupt_bytes_fail_the_checksum(where: Path, outbox: ShmOutbox, inbox: ShmInbox) -> None:
    ref = outbox.put("r1", [_payload(100_000)])
    fd = os.open(where / ref.region, os.O_RDWR)
    try:
        old = os.pread(fd, 1, DATA_OFFSET + 5000)
        os.pwrite(fd, bytes([old[0] ^ 0x01]), DATA_OFFSET + 5000)
    finally:
        os.close(fd)
    with pytest.raises(StatecoreError) as excinfo:
        inbox.read(ref)
    assert _code(excinfo) is Code.KV_CHECKSUM


def test_a_reference_to_another_generation_is_gone(outbox: ShmOutbox, inbox: ShmInbox) -> None:
    ref = outbox.put("r1", [b"abc"])
    for generation in (ref.generation + 1, ref.generation - 1 or 7):
        with pytest.raises(StatecoreError) as excinfo:
            inbox.read(ref.model_copy(update={"generation": generation}))
        assert _code(excinfo) is Code.KV_SHM_GONE


def test_a_freed_then_reused_region_fails_the_old_reference(outbox: ShmOutbox, inbox: ShmInbox) -> None:
    old = outbox.put("r1", [b"old bytes"])
    outbox.free(old)
    with pytest.raises(StatecoreError) as freed:
        inbox.read(old)
    new = outbox.put("r2", [b"new bytes"])
    assert new.region == old.region
    with pytest.raises(StatecoreError) as reused:
        inbox.read(old)
    assert _code(freed) is Code.KV_SHM_GONE and _code(reused) is Code.KV_SHM_GONE
    assert outbox.free(old) is False  # a stale free changes nothing
    assert bytes(inbox.read(new)) == b"new bytes"


def test_done_says_when_the_region_changed_under_the_read(outbox: ShmOutbox, inbox: ShmInbox) -> None:
    ref = outbox.put("r1", [b"abc"])
    inbox.read(ref)
    outbox.release("r1")  # e.g. the request was cancelled meanwhile
    with pytest.raises(StatecoreError) as excinfo:
        inbox.done(ref)
    assert _code(excinfo) is Code.KV_SHM_GONE


def test_done_before_any_read_is_gone(outbox: ShmOutbox, inbox: ShmInbox) -> None:
    ref = outbox.put("r1", [b"abc"])
    with pytest.raises(StatecoreError) as excinfo:
        inbox.done(ref)
    assert _code(excinfo) is Code.KV_SHM_GONE


def test_a_range_outside_the_region_or_of_another_length_is_malformed(
        outbox: ShmOutbox, inbox: ShmInbox) -> None:
    ref = outbox.put("r1", [b"abc"])
    for update in ({"nbytes": 1 << 40}, {"offset": 1 << 40}, {"nbytes": 2}):
        with pytest.raises(StatecoreError) as excinfo:
            inbox.read(ref.model_copy(update=update))
        assert _code(excinfo) is Code.KV_MALFORMED, update


@pytest.mark.parametrize("document", [
    None, {}, {"region": "../../etc/passwd", "offset": 4096, "nbytes": 1, "generation": 1},
    {"region": "statecore-kv-1-0123abcd-0", "offset": 0, "nbytes": 1, "generation": 1},
    {"region": "statecore-kv-1-0123abcd-0", "offset": 4096, "nbytes": "1", "generation": 1},
    {"region": "statecore-kv-1-0123abcd-0", "offset": 4096, "nbytes": 1, "generation": 1, "x": 1},
])
def test_an_invalid_reference_is_malformed(document: object) -> None:
    with pytest.raises(StatecoreError) as excinfo:
        parse_ref(document)
    assert _code(excinfo) is Code.KV_MALFORMED


def test_a_reference_the_schema_never_saw_cannot_reach_outside_the_directory(inbox: ShmInbox) -> None:
    ref = ShmRef.model_construct(region="../passwd", offset=DATA_OFFSET, nbytes=1, generation=1)
    with pytest.raises(StatecoreError) as excinfo:
        inbox.read(ref)
    assert _code(excinfo) is Code.KV_MALFORMED


def test_a_region_of_a_closed_outbox_is_gone(where: Path, inbox: ShmInbox) -> None:
    box = ShmOutbox(max_bytes=4 * MIB, directory=where)
    ref = box.put("r1", [b"abc"])
    inbox.read(ref).release()
    box.close()
    with pytest.raises(StatecoreError) as excinfo:
        inbox.read(ref)
    assert _code(excinfo) is Code.KV_SHM_GONE


# --------------------------------------------------------------------------- the producer's room


def test_release_frees_every_region_a_request_holds(outbox: ShmOutbox, inbox: ShmInbox) -> None:
    refs = [outbox.put("r1", [b"a"]), outbox.put("r1", [b"b"]), outbox.put("r2", [b"c"])]
    assert outbox.release("r1") == 2 and outbox.release("r1") == 0
    stats = outbox.statistics()
    assert (stats.regions, stats.held_regions) == (3, 1)
    assert bytes(inbox.read(refs[2])) == b"c"
    for ref in refs[:2]:
        with pytest.raises(StatecoreError):
            inbox.read(ref)


def test_idle_regions_are_dropped_least_recently_used_first_to_stay_in_budget(
        where: Path, outbox: ShmOutbox) -> None:
    refs = [outbox.put(f"r{i}", [bytes(4 * MIB)]) for i in range(3)]
    for ref in refs:
        outbox.free(ref)
    outbox.put("big", [bytes(9 * MIB)])  # 12 + 9 MiB > 16: two idle regions go, oldest first
    stats = outbox.statistics()
    assert stats.dropped == 2 and stats.mapped_bytes == 13 * MIB
    assert not (where / refs[0].region).exists() and not (where / refs[1].region).exists()
    assert (where / refs[2].region).exists()


def test_a_budget_held_by_requests_is_overloaded_not_a_crash(outbox: ShmOutbox) -> None:
    outbox.put("r1", [bytes(12 * MIB)])
    with pytest.raises(StatecoreError) as excinfo:
        outbox.put("r2", [bytes(8 * MIB)])
    assert excinfo.value.info.fault is Fault.OVERLOADED and _code(excinfo) is Code.OVERLOADED


def test_a_full_tmpfs_is_overloaded_and_leaves_no_file(
        where: Path, outbox: ShmOutbox, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space, raising=False)
    before = sorted(os.listdir(where))
    with pytest.raises(StatecoreError) as excinfo:
        outbox.put("r1", [b"abc"])
    assert _code(excinfo) is Code.OVERLOADED
    assert sorted(os.listdir(where)) == before


def test_a_file_system_that_cannot_reserve_still_gets_regions(
        outbox: ShmOutbox, inbox: ShmInbox, monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported, raising=False)
    ref = outbox.put("r1", [b"abc"])
    assert bytes(inbox.read(ref)) == b"abc"


def test_a_non_contiguous_piece_is_our_bug(outbox: ShmOutbox) -> None:
    strided = np.arange(10, dtype=np.uint8).data[::2]
    with pytest.raises(StatecoreError) as excinfo:
        outbox.put("r1", [strided])
    assert excinfo.value.info.fault is Fault.BUG


# --------------------------------------------------------------------------- cleanup


def test_close_unlinks_everything_and_put_after_close_is_a_bug(where: Path, inbox: ShmInbox) -> None:
    box = ShmOutbox(max_bytes=8 * MIB, directory=where)
    ref = box.put("r1", [bytes(3 * MIB)])
    view = inbox.read(ref)  # a consumer still holding a view does not keep the file
    assert sorted(os.listdir(where)) == box.region_names()
    box.close()
    box.close()
    assert os.listdir(where) == []
    with pytest.raises(StatecoreError) as excinfo:
        box.put("r2", [b"x"])
    assert excinfo.value.info.fault is Fault.BUG
    view.release()


def test_an_outbox_dropped_without_close_unlinks_its_files(where: Path) -> None:
    box = ShmOutbox(max_bytes=4 * MIB, directory=where)
    box.put("r1", [b"abc"])
    del box  # the finalizer (also registered for interpreter exit) runs
    assert os.listdir(where) == []


def test_a_sweep_leaves_live_regions_alone(where: Path, outbox: ShmOutbox) -> None:
    outbox.put("r1", [b"abc"])
    names = sorted(os.listdir(where))
    assert sweep_orphans(where) == []
    assert sorted(os.listdir(where)) == names


def test_a_sweep_ignores_files_that_are_not_regions(where: Path) -> None:
    (where / "statecore-kv-other").write_bytes(b"x")
    (where / "unrelated").write_bytes(b"x")
    assert sweep_orphans(where) == []
    assert sorted(os.listdir(where)) == ["statecore-kv-other", "unrelated"]


# --------------------------------------------------------------------------- the same-host probe


def test_the_probe_finds_its_own_host(outbox: ShmOutbox) -> None:
    advert = parse_advert(json.loads(json.dumps(outbox.advert().model_dump())))
    assert advert is not None and same_host(advert)


def test_the_probe_fails_for_another_nonce_directory_or_a_closed_outbox(where: Path) -> None:
    box = ShmOutbox(max_bytes=4 * MIB, directory=where)
    advert = box.advert()
    assert not same_host(advert.model_copy(update={"nonce": "0" * 32}))
    assert not same_host(advert.model_copy(update={"directory": str(where / "elsewhere")}))
    assert not same_host(advert.model_copy(update={"directory": "relative/path"}))
    box.close()
    assert not same_host(advert)


@pytest.mark.parametrize("document", [None, {}, {"directory": "/dev/shm", "probe": "x", "nonce": "0" * 32}])
def test_no_or_an_invalid_advert_means_no_shared_memory(document: object) -> None:
    assert parse_advert(document) is None


def test_an_advert_is_a_strict_value() -> None:
    advert = ShmAdvert(directory="/dev/shm", probe="statecore-kv-1-0123abcd-probe", nonce="ab" * 16)
    assert parse_advert(advert.model_dump()) == advert
