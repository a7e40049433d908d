"""`ShmOutbox`: a producer's regions of shared memory, each holding one piece of KV for a consumer.

A prefill node's outbox copies each piece of KV it hands off (a segment: header, tensor bytes,
checksum, whatever the caller frames) once into a region (`put`) and returns a `ShmRef`, a small
JSON-able reference that travels to the decode node over the ordinary HTTP stream; or, with
`reserve`, lets the copy that makes the bytes (a device-to-host copy) write them in place, and
`ShmWriter.commit` publishes them: then shared memory adds no copy at all. The consumer sends the
reference back and `free` makes the region reusable (`release`: every region a request holds).
Regions are kept in an arena and reused, because a fresh region costs the kernel zeroing every
page on first touch; the least recently used idle ones are dropped to stay within `max_bytes`.
The outbox also makes a tiny probe region and advertises it (`advert`, for `/internal/info`), so
that a peer can measure whether it shares this memory rather than guess it from a URL. `close`
(also run at interpreter exit, so a node draining on SIGTERM leaves nothing behind) unlinks
everything; a new outbox sweeps the orphans of dead ones first. The region format is
`adapters.kv.shm_region`'s. This is an adapter: it must never import trio, httpx, mlx or mlx_lm
(callers run `put` and the checksum on a worker thread), and numpy only inside `copy_into` (a
router handles KV frames without it); nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import secrets
import threading
import weakref
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from adapters.kv.shm_region import (
    CLOSED,
    DATA_OFFSET,
    FREE,
    HEADER,
    LIVE,
    NONCE_BYTES,
    PREFIX,
    PROBE_BYTES,
    REGION_MAGIC,
    WRITING,
    ShmAdvert,
    ShmRef,
    default_directory,
    make_region,
    no_room,
    sweep_orphans,
)
from statecore.errors import StatecoreError, bug

ROUND_BYTES: Final = 1 << 20  # region capacities round up to this
COPY_SLICE: Final = 4 << 20  # `put` copies this much at a time, letting other threads in between
DEFAULT_MAX_BYTES: Final = 2 << 30


def copy_into(target: memoryview, sources: Sequence[memoryview]) -> None:
    """`sources` one after another into `target` (bytes, the same total), copied by numpy, which
    releases the GIL for the copy: a memoryview's slice assignment holds it for each memcpy, and
    a prefill step's graph building on the device thread waited behind the copies (on an H100 a
    2,048-token step's build took 15-18 ms beside them, 6.5 ms alone). COPY_SLICE at a time, so
    the copy of a large piece does not hold one thread's turn either."""
    import numpy as np  # here, not at the top: a router handles KV frames without numpy

    into = np.frombuffer(target, dtype=np.uint8)
    pos = 0
    for source in sources:
        data = np.frombuffer(source, dtype=np.uint8)
        for start in range(0, len(data), COPY_SLICE):
            part = data[start : start + COPY_SLICE]
            np.copyto(into[pos : pos + len(part)], part)
            pos += len(part)
    del into  # no export of `target` outlives the copy


@dataclass(slots=True)
class _Region:
    name: str
    fd: int
    mapped: mmap.mmap
    capacity: int  # data bytes
    generation: int = 0
    holder: str | None = None  # the request whose bytes it holds; None: idle
    writing: bool = False  # a `put` is copying into it (never taken, never dropped meanwhile)
    used_at: int = 0  # for dropping the least recently used idle region first


@dataclass(frozen=True, slots=True)
class ShmOutboxStatistics:
    regions: int
    mapped_bytes: int  # data capacity of every region (what the tmpfs holds)
    held_regions: int
    held_bytes: int  # capacity of the regions requests hold
    puts: int
    reused: int  # puts that took an idle region
    created: int
    dropped: int  # idle regions unlinked to make room


@dataclass(slots=True)
class _Counts:
    puts: int = 0
    reused: int = 0
    created: int = 0
    dropped: int = 0
    clock: itertools.count[int] = field(default_factory=itertools.count)


def _close_all(regions: dict[str, _Region], probe: list[_Region], directory: Path) -> None:
    """Mark every region closed, unlink it and let its lock go (the finalizer: no `self`)."""
    for region in [*regions.values(), *probe]:
        with contextlib.suppress(OSError, ValueError):
            HEADER.pack_into(region.mapped, 0, REGION_MAGIC, region.generation + 1, 0, CLOSED)
        with contextlib.suppress(OSError):
            os.unlink(directory / region.name)
        with contextlib.suppress(BufferError, OSError, ValueError):
            region.mapped.close()
        with contextlib.suppress(OSError):
            os.close(region.fd)
    regions.clear()
    probe.clear()


class ShmWriter:
    """A region reserved by `ShmOutbox.reserve`: fill `view` (exactly the bytes asked for, writable
    shared memory), then `commit` for the reference to send, or `abort` to give the region back.
    Blocking (the checksum): call `commit` from a worker thread."""

    def __init__(self, outbox: ShmOutbox, region: _Region, generation: int, nbytes: int) -> None:
        self._outbox = outbox
        self._region = region
        self._generation = generation
        self._done = False
        self.nbytes = nbytes
        self.view = memoryview(region.mapped)[DATA_OFFSET : DATA_OFFSET + nbytes]

    def commit(self) -> ShmRef:
        """Publish the bytes: the reference for the consumer. Once only."""
        if self._done:
            raise StatecoreError(bug("ShmWriter committed or aborted twice"))
        crc = zlib.crc32(self.view) if self._outbox.checksum else None  # releases the GIL
        self._close(commit=True)
        return ShmRef(region=self._region.name, offset=DATA_OFFSET, nbytes=self.nbytes,
                      generation=self._generation, crc32=crc)

    def abort(self) -> None:
        """Give the region back unpublished (idempotent; nothing after a commit)."""
        if not self._done:
            self._close(commit=False)

    def _close(self, *, commit: bool) -> None:
        self._done = True
        with contextlib.suppress(BufferError):  # the caller still holds an array over it: fine
            self.view.release()
        self._outbox._finish(self._region, self._generation, self.nbytes, commit=commit)


class ShmOutbox:
    """A producer's regions of shared memory (one outbox per node process).

    `put` copies a request's pieces into an idle region that fits (capacity at most twice the
    need plus ROUND_BYTES) or a new one, dropping least recently used idle regions to stay within
    `max_bytes`; `free` (the consumer sent the reference back) and `release` (the request ended)
    make regions idle again. Safe to call from several threads: `put`'s copy runs outside the
    lock and without the GIL (`copy_into`)."""

    def __init__(self, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 directory: str | os.PathLike[str] | None = None, checksum: bool = True) -> None:
        if max_bytes < ROUND_BYTES:
            raise StatecoreError(bug(f"max_bytes must be at least {ROUND_BYTES}, not {max_bytes}"))
        self.max_bytes = max_bytes
        self.checksum = checksum
        self.directory = Path(directory) if directory is not None else default_directory()
        sweep_orphans(self.directory)
        self._stem = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        # reentrant: a landed view's finalizer (`ShmLanding`) gives its region back on whichever
        # thread drops the view's last reference, garbage collection included, which may run in
        # the middle of a locked section of this very thread
        self._lock = threading.RLock()
        self._regions: dict[str, _Region] = {}
        self._numbers = itertools.count()
        self._counts = _Counts()
        self._closed = False
        self._nonce = secrets.token_hex(NONCE_BYTES)
        self._probe: list[_Region] = []
        self._finalizer = weakref.finalize(self, _close_all, self._regions, self._probe, self.directory)
        probe_name = f"{self._stem}-probe"
        try:
            fd, mapped = make_region(self.directory, probe_name, PROBE_BYTES)
        except OSError as exc:
            no_room(f"cannot make shared memory in {self.directory}: {exc}")
        self._probe.append(_Region(probe_name, fd, mapped, PROBE_BYTES))
        mapped[DATA_OFFSET : DATA_OFFSET + NONCE_BYTES] = bytes.fromhex(self._nonce)
        HEADER.pack_into(mapped, 0, REGION_MAGIC, 1, NONCE_BYTES, LIVE)

    def advert(self) -> ShmAdvert:
        """What to publish for peers (`same_host` checks it)."""
        return ShmAdvert(directory=str(self.directory), probe=f"{self._stem}-probe", nonce=self._nonce)

    def put(self, request_id: str, pieces: Sequence[bytes | memoryview]) -> ShmRef:
        """Copy `pieces` (in order, contiguous) into one region held for `request_id`: `reserve`,
        the copy, `commit`. Blocks for the copy and the checksum: call it from a worker thread.
        `overloaded` when the budget is held by requests or the tmpfs is full (send over HTTP
        instead)."""
        try:
            views = [memoryview(piece).cast("B") for piece in pieces]
        except TypeError as exc:
            raise StatecoreError(bug(f"put takes C-contiguous buffers: {exc}")) from exc
        writer = self.reserve(request_id, sum(len(view) for view in views))
        try:
            copy_into(writer.view, views)
        except BaseException:
            writer.abort()
            raise
        return writer.commit()

    def reserve(self, request_id: str, nbytes: int) -> ShmWriter:
        """A region held for `request_id` with room for `nbytes`, to be written in place (the
        copy that makes the bytes, e.g. a device-to-host copy, lands in shared memory and `put`'s
        copy is saved), then committed. Readers see it only once committed."""
        if nbytes < 0:
            raise StatecoreError(bug(f"reserve takes nbytes >= 0, not {nbytes}"))
        with self._lock:
            region = self._take(nbytes, request_id)
            region.generation += 1
            region.writing = True
            HEADER.pack_into(region.mapped, 0, REGION_MAGIC, region.generation, nbytes, WRITING)
            return ShmWriter(self, region, region.generation, nbytes)

    def _finish(self, region: _Region, generation: int, nbytes: int, *, commit: bool) -> None:
        with self._lock:
            region.writing = False
            if region.generation != generation or self._closed:
                return  # released (or closed) meanwhile: the reference reads as gone
            if commit:
                HEADER.pack_into(region.mapped, 0, REGION_MAGIC, generation, nbytes, LIVE)
            else:
                self._idle(region)

    def free(self, ref: ShmRef) -> bool:
        """The consumer is done with `ref`: its region becomes idle. False (and nothing changes)
        when the region no longer holds that generation: freed already, or not ours."""
        with self._lock:
            region = self._regions.get(ref.region)
            if region is None or region.generation != ref.generation or region.holder is None:
                return False
            self._idle(region)
            return True

    def release(self, request_id: str) -> int:
        """Free every region `request_id` still holds (it ended, or failed). Returns how many."""
        with self._lock:
            held = [r for r in self._regions.values() if r.holder == request_id]
            for region in held:
                self._idle(region)
            return len(held)

    def close(self) -> None:
        """Unlink every region. Idempotent; also runs at interpreter exit."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def statistics(self) -> ShmOutboxStatistics:
        with self._lock:
            regions = list(self._regions.values())
            held = [r for r in regions if r.holder is not None]
            c = self._counts
            return ShmOutboxStatistics(
                regions=len(regions), mapped_bytes=sum(r.capacity for r in regions),
                held_regions=len(held), held_bytes=sum(r.capacity for r in held),
                puts=c.puts, reused=c.reused, created=c.created, dropped=c.dropped)

    def region_names(self) -> list[str]:
        """The names of this outbox's files in `directory` (the probe included)."""
        with self._lock:
            return sorted([*self._regions, *(p.name for p in self._probe)])

    # ----------------------------------------------------------------- under the lock

    def _idle(self, region: _Region) -> None:
        region.holder = None
        region.generation += 1  # a late read of the old reference now fails, typed
        with contextlib.suppress(ValueError):
            HEADER.pack_into(region.mapped, 0, REGION_MAGIC, region.generation, 0, FREE)

    def _take(self, nbytes: int, request_id: str) -> _Region:
        if self._closed:
            raise StatecoreError(bug("put on a closed ShmOutbox"))
        self._counts.puts += 1
        used_at = next(self._counts.clock)
        fits = [r for r in self._regions.values() if r.holder is None and not r.writing
                and nbytes <= r.capacity <= 2 * nbytes + ROUND_BYTES]
        if fits:
            region = min(fits, key=lambda r: r.capacity)
            self._counts.reused += 1
        else:
            region = self._create(max(ROUND_BYTES, -(-nbytes // ROUND_BYTES) * ROUND_BYTES))
        region.holder = request_id
        region.used_at = used_at
        return region

    def _create(self, capacity: int) -> _Region:
        mapped_bytes = sum(r.capacity for r in self._regions.values())
        idle = sorted((r for r in self._regions.values() if r.holder is None and not r.writing),
                      key=lambda r: r.used_at)
        while mapped_bytes + capacity > self.max_bytes and idle:
            victim = idle.pop(0)
            mapped_bytes -= victim.capacity
            self._drop(victim)
        if mapped_bytes + capacity > self.max_bytes:
            no_room(f"shared memory for KV is full: {mapped_bytes} of {self.max_bytes} bytes held "
                     f"by requests, {capacity} more needed")
        name = f"{self._stem}-{next(self._numbers)}"
        try:
            fd, mapped = make_region(self.directory, name, capacity)
        except OSError as exc:
            no_room(f"cannot make {capacity} bytes of shared memory in {self.directory}: {exc}")
        region = _Region(name, fd, mapped, capacity)
        self._regions[name] = region
        self._counts.created += 1
        return region

    def _drop(self, region: _Region) -> None:
        del self._regions[region.name]
        self._counts.dropped += 1
        _close_all({region.name: region}, [], self.directory)


__all__ = [
    "COPY_SLICE",
    "DEFAULT_MAX_BYTES",
    "ROUND_BYTES",
    "ShmOutbox",
    "ShmOutboxStatistics",
    "ShmWriter",
    "copy_into",
]
