"""Shared memory for KV bytes between two nodes of one host: no socket, one copy into place.

A prefill node's `ShmOutbox` copies each piece of KV it hands off (a segment: header, tensor
bytes, checksum, whatever the caller frames) once into a region of shared memory and returns a
`ShmRef`, a small JSON-able reference that travels to the decode node over the ordinary HTTP
stream (or, with `reserve`, lets the copy that makes the bytes - a device-to-host copy - write
them in place, and `ShmWriter.commit` publishes them: then shared memory adds no copy at all).
The decode node's `ShmInbox.read` maps the region and returns a read-only view of the bytes,
validated (the region exists and its owner is alive, the range is inside it, the region
still holds the generation the reference names, the CRC-32 matches); the caller copies from the
view into place, calls `ShmInbox.done` (which says whether the region changed while it was read)
and sends the reference back, and the producer's `ShmOutbox.free` makes the region reusable.
A node whose engine core is a process receives KV from the network straight into its own regions
(`ShmLanding`: the buffers a receive fills), so handing the bytes to its core copies nothing.
Regions are files in a tmpfs (`/dev/shm` on Linux; the temporary directory elsewhere) mapped with
`mmap`, kept in an arena and reused, because a fresh region costs the kernel zeroing every page
on first touch. Each region holds a 4 KiB header page (magic, generation, byte count, state) and
then page-aligned data. The owner holds a shared `flock` on every region it made for as long as it
lives: the kernel drops it when the process dies however it dies (SIGKILL included), so a reader
or `sweep_orphans` can tell an orphan from a live region, and remove it. `ShmOutbox.close` (also
run at interpreter exit, so a node draining on SIGTERM leaves nothing behind) unlinks everything.
Whether a peer can use this at all is measured, not guessed from its URL: the outbox makes a tiny
probe region and advertises it (`ShmAdvert`, for `/internal/info`); `same_host` maps it and
checks its nonce. Every failure is a `StatecoreError` (`kv_shm_gone`, `kv_malformed`,
`kv_checksum_mismatch`; `overloaded` when the producer has no room, so the caller can fall back
to HTTP); no OSError escapes. This is an adapter: it must never import trio, httpx, mlx, mlx_lm or
numpy (callers run `put` and the checksum on a worker thread and do the copy into place
themselves); nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import mmap
import os
import re
import secrets
import stat
import struct
import tempfile
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Final, NoReturn

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, bug, peer_error

PREFIX: Final = "statecore-kv-"
# statecore-kv-<pid>-<8 hex of this outbox>-<region number | "probe">
NAME_PATTERN: Final = r"^statecore-kv-[0-9]{1,10}-[0-9a-f]{8}-(?:[0-9]{1,12}|probe)$"
_NAME: Final = re.compile(NAME_PATTERN)
_TMP_SUFFIX: Final = ".tmp"  # a region being made; renamed once its owner holds its lock
_TMP_GRACE_S: Final = 60.0  # an unlocked .tmp older than this is an orphan

REGION_MAGIC: Final = b"SCKVSHM1"
_HEADER: Final = struct.Struct("<8sQQI")  # magic, generation, nbytes, state
DATA_OFFSET: Final = 4096  # the header page; data starts page-aligned
_FREE, _WRITING, _LIVE, _CLOSED = 0, 1, 2, 3
_PROBE_BYTES: Final = 64  # data bytes of the probe region: its nonce
_NONCE_BYTES: Final = 16

ROUND_BYTES: Final = 1 << 20  # region capacities round up to this
COPY_SLICE: Final = 4 << 20  # `put` copies this much at a time, letting other threads in between


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
DEFAULT_MAX_BYTES: Final = 2 << 30
_MAP_POPULATE: Final = getattr(mmap, "MAP_POPULATE", 0)  # Linux: map every page up front


def default_directory() -> Path:
    """Where regions live: /dev/shm where it is a writable directory (Linux), else the
    temporary directory (macOS has no /dev/shm; a file mapped there is still shared memory)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


# --------------------------------------------------------------------------- wire values


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class ShmRef(_Strict):
    """Where one `put`'s bytes are: a region (file name in the shared directory), the range,
    the region's generation at the time (a region freed or reused since has another) and the
    CRC-32 of the bytes (None: `put` was told not to compute one). The region name doubles as
    the slot id: the consumer sends the reference back and the producer frees the slot."""

    region: Annotated[str, Field(pattern=NAME_PATTERN)]
    offset: Annotated[int, Field(ge=DATA_OFFSET, lt=1 << 63)]
    nbytes: Annotated[int, Field(ge=0, lt=1 << 63)]
    generation: Annotated[int, Field(ge=1, lt=1 << 63)]
    crc32: Annotated[int, Field(ge=0, lt=1 << 32)] | None = None


class ShmAdvert(_Strict):
    """What a producer advertises (e.g. in `/internal/info`) so that a peer can find out
    whether it shares its shared memory: the directory, a probe region's name and the nonce
    written in it."""

    directory: Annotated[str, Field(min_length=1, max_length=4096)]
    probe: Annotated[str, Field(pattern=NAME_PATTERN)]
    nonce: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


SHM_REF_ADAPTER: Final = TypeAdapter(ShmRef)
SHM_ADVERT_ADAPTER: Final = TypeAdapter(ShmAdvert)


def parse_ref(document: object) -> ShmRef:
    """A reference received from a peer (a JSON object already parsed), validated strictly;
    `kv_malformed` otherwise."""
    try:
        return SHM_REF_ADAPTER.validate_python(document)
    except ValidationError as exc:
        _fail(Code.KV_MALFORMED, f"invalid shared-memory KV reference: {_first_error(exc)}")


def parse_advert(document: object) -> ShmAdvert | None:
    """A peer's advert, or None when it sent none or an invalid one (then: no shared memory)."""
    try:
        return SHM_ADVERT_ADAPTER.validate_python(document)
    except ValidationError:
        return None


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc']) or 'reference'}: {first['msg']}"


def _fail(code: Code, message: str) -> NoReturn:
    raise StatecoreError(peer_error(message, code))


def _gone(message: str) -> NoReturn:
    _fail(Code.KV_SHM_GONE, message)


def _no_room(message: str) -> NoReturn:
    raise StatecoreError(ErrorInfo(Fault.OVERLOADED, Code.OVERLOADED, message))


# --------------------------------------------------------------------------- files


def _make_region(directory: Path, name: str, capacity: int) -> tuple[int, mmap.mmap]:
    """Create, lock (shared: "my owner lives"), size and map a region; it gets its name only
    once locked, so a sweep never takes a region being made for an orphan."""
    tmp = directory / (name + _TMP_SUFFIX)
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        size = DATA_OFFSET + capacity
        fallocate = getattr(os, "posix_fallocate", None)
        try:
            if fallocate is None:
                raise OSError(errno.ENOSYS, "no posix_fallocate")
            fallocate(fd, 0, size)  # tmpfs pages reserved now: ENOSPC here, never SIGBUS later
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(fd, size)  # a file system (or OS: macOS) that cannot reserve
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        _HEADER.pack_into(mapped, 0, REGION_MAGIC, 0, 0, _FREE)
        os.rename(tmp, directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        os.close(fd)
        raise
    return fd, mapped


def _owner_gone(fd: int) -> bool:
    """Whether nobody holds the region's owner lock any more (its process died, or it is
    closing it). Taking the lock exclusively without waiting succeeds only then."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def sweep_orphans(directory: str | os.PathLike[str] | None = None) -> list[str]:
    """Unlink the regions (and probes) in `directory` whose owner is dead: a node killed with
    SIGKILL cannot clean up, so every new `ShmOutbox` calls this, and an operator may. Regions of
    live processes are never touched. Returns the names removed."""
    where = Path(directory) if directory is not None else default_directory()
    removed: list[str] = []
    try:
        names = [entry for entry in os.listdir(where) if entry.startswith(PREFIX)]
    except OSError:
        return removed
    now = time.time()
    for entry in names:
        name = entry.removesuffix(_TMP_SUFFIX)
        if not _NAME.match(name):
            continue
        path = where / entry
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            young_tmp = entry != name and now - info.st_mtime < _TMP_GRACE_S
            if stat.S_ISREG(info.st_mode) and not young_tmp and _owner_gone(fd):
                os.unlink(path)
                removed.append(entry)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


# --------------------------------------------------------------------------- producer


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
            _HEADER.pack_into(region.mapped, 0, REGION_MAGIC, region.generation + 1, 0, _CLOSED)
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
        self._nonce = secrets.token_hex(_NONCE_BYTES)
        self._probe: list[_Region] = []
        self._finalizer = weakref.finalize(self, _close_all, self._regions, self._probe, self.directory)
        probe_name = f"{self._stem}-probe"
        try:
            fd, mapped = _make_region(self.directory, probe_name, _PROBE_BYTES)
        except OSError as exc:
            _no_room(f"cannot make shared memory in {self.directory}: {exc}")
        self._probe.append(_Region(probe_name, fd, mapped, _PROBE_BYTES))
        mapped[DATA_OFFSET : DATA_OFFSET + _NONCE_BYTES] = bytes.fromhex(self._nonce)
        _HEADER.pack_into(mapped, 0, REGION_MAGIC, 1, _NONCE_BYTES, _LIVE)

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
            _HEADER.pack_into(region.mapped, 0, REGION_MAGIC, region.generation, nbytes, _WRITING)
            return ShmWriter(self, region, region.generation, nbytes)

    def _finish(self, region: _Region, generation: int, nbytes: int, *, commit: bool) -> None:
        with self._lock:
            region.writing = False
            if region.generation != generation or self._closed:
                return  # released (or closed) meanwhile: the reference reads as gone
            if commit:
                _HEADER.pack_into(region.mapped, 0, REGION_MAGIC, generation, nbytes, _LIVE)
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
            _HEADER.pack_into(region.mapped, 0, REGION_MAGIC, region.generation, 0, _FREE)

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
            _no_room(f"shared memory for KV is full: {mapped_bytes} of {self.max_bytes} bytes held "
                     f"by requests, {capacity} more needed")
        name = f"{self._stem}-{next(self._numbers)}"
        try:
            fd, mapped = _make_region(self.directory, name, capacity)
        except OSError as exc:
            _no_room(f"cannot make {capacity} bytes of shared memory in {self.directory}: {exc}")
        region = _Region(name, fd, mapped, capacity)
        self._regions[name] = region
        self._counts.created += 1
        return region

    def _drop(self, region: _Region) -> None:
        del self._regions[region.name]
        self._counts.dropped += 1
        _close_all({region.name: region}, [], self.directory)


# --------------------------------------------------------------------------- landing


RECEIVED: Final = "received"  # the holder of a landing's regions (no request is known at `take`)


@dataclass(slots=True)
class _Landed:
    writer: ShmWriter
    array: weakref.ref[object]  # the numpy array every view `take` handed out is made from
    ref: ShmRef | None = None  # once claimed


@dataclass(frozen=True, slots=True)
class ShmLandingStatistics:
    landed: int  # receives that landed in shared memory
    fell_back: int  # receives that landed in `fallback` (no room in shared memory)
    claimed: int  # landed payloads handed on by reference (`claim`)
    held: int  # landed regions some view still refers to


class ShmLanding:
    """Where KV bytes received over the network land on a node whose engine core reads them from
    shared memory: `take(nbytes)` (the buffer a receive fills: `kv_pull`'s pull, a KV stream's
    segment) is a writable view of a region of `outbox` reserved for it, so handing the received
    payload to the core (`claim`: the reference to send instead of the bytes) copies nothing; the
    receive is the bytes' only copy. When the outbox has no room (`overloaded`) the bytes land in
    `fallback` (process memory) and the caller copies as before. A region goes back to the outbox
    once the last view of it goes (a receive cut mid-body, a payload never handed on), unclaimed
    or claimed, whichever comes first with the claimer's own `ShmOutbox.free` of the reference.
    Used from one thread (the node's trio thread); the last view may go on any thread."""

    def __init__(self, outbox: ShmOutbox, fallback: Callable[[int], memoryview]) -> None:
        self._outbox = outbox
        self._fallback = fallback
        self._lock = threading.RLock()  # reentrant: as `ShmOutbox._lock`, for `_gone`
        self._landed: dict[int, _Landed] = {}  # by id() of the array the views are made from
        self._counts = [0, 0, 0]  # landed, fell back, claimed

    def take(self, nbytes: int) -> memoryview:
        """A writable view of exactly `nbytes` bytes for a receive to fill."""
        import numpy as np  # here, not at the top: as `copy_into`

        if nbytes <= 0:
            return self._fallback(nbytes)
        try:
            writer = self._outbox.reserve(RECEIVED, nbytes)
        except StatecoreError as exc:
            if exc.info.code is not Code.OVERLOADED:
                raise
            self._counts[1] += 1
            return self._fallback(nbytes)
        array = np.frombuffer(writer.view, dtype=np.uint8)  # views of it keep it (and the region)
        landed = _Landed(writer, weakref.ref(array))
        with self._lock:
            self._landed[id(array)] = landed
            self._counts[0] += 1
        weakref.finalize(array, self._gone, id(array), landed)
        return array.data

    def claim(self, payload: object) -> ShmRef | None:
        """The reference to `payload`'s bytes when it is a whole view `take` handed out (then the
        region is the caller's to `ShmOutbox.free` once the reader is done); None otherwise (it
        landed in `fallback`, it is a part of a view, or it was claimed already)."""
        if not isinstance(payload, memoryview):
            return None
        owner = payload.obj
        with self._lock:
            landed = self._landed.get(id(owner))
            if (landed is None or landed.array() is not owner or landed.ref is not None
                    or payload.nbytes != landed.writer.nbytes):
                return None
            landed.ref = landed.writer.commit()  # no checksum to compute for an outbox without one
            self._counts[2] += 1
            return landed.ref

    def give_back(self, view: memoryview) -> None:
        """The receive into `view` (from `take`) failed: its region goes back to the outbox now,
        not when the last view goes (a traceback may keep one for a while)."""
        owner = view.obj
        with self._lock:
            landed = self._landed.get(id(owner))
            if landed is None or landed.array() is not owner or landed.ref is not None:
                return
        landed.writer.abort()

    def statistics(self) -> ShmLandingStatistics:
        with self._lock:
            landed, fell_back, claimed = self._counts
            return ShmLandingStatistics(landed, fell_back, claimed, len(self._landed))

    def _gone(self, key: int, landed: _Landed) -> None:
        """The last view of a landed region went: the region goes back (a no-op when the claimer
        freed it already)."""
        with self._lock:
            if self._landed.get(key) is landed:
                del self._landed[key]
        if landed.ref is None:
            landed.writer.abort()
        else:
            self._outbox.free(landed.ref)


# --------------------------------------------------------------------------- consumer


@dataclass(slots=True)
class _Mapped:
    fd: int
    mapped: mmap.mmap


def _unmap(entry: _Mapped) -> None:
    with contextlib.suppress(BufferError):  # a view is still held: the map goes with it
        entry.mapped.close()
    with contextlib.suppress(OSError):
        os.close(entry.fd)


class ShmInbox:
    """A consumer's mappings of one producer's regions (in `directory`, the advert's).

    `read` returns a read-only view of a reference's bytes, validated; copy out of it, then call
    `done` (did the bytes stay put while you read?) and send the reference back to the producer
    (`ShmOutbox.free`). Mappings are kept for the next reads of the same region, and dropped once
    its file is gone."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_directory()
        self._lock = threading.Lock()
        self._maps: dict[str, _Mapped] = {}

    def read(self, ref: ShmRef) -> memoryview:
        """The bytes `ref` names, as a read-only view of the shared memory (no copy). Raises
        `kv_shm_gone` (the region was unlinked, freed or reused, or its owner died: an orphan is
        unlinked on the way), `kv_malformed` (the range is not inside the region, or it is not a
        region) or `kv_checksum_mismatch`. Blocks for the checksum: call it from a worker thread."""
        entry = self._entry(ref.region)
        mapped = entry.mapped
        if ref.offset + ref.nbytes > len(mapped):
            _fail(Code.KV_MALFORMED, f"shared-memory reference [{ref.offset}, {ref.offset + ref.nbytes}) "
                                     f"runs past region {ref.region} ({len(mapped)} bytes)")
        self._check_alive(ref.region, entry)
        magic, generation, nbytes, state = _HEADER.unpack_from(mapped, 0)
        if magic != REGION_MAGIC:
            _fail(Code.KV_MALFORMED, f"{ref.region} is not a statecore KV region")
        if state != _LIVE or generation != ref.generation:
            what = {_FREE: "freed", _WRITING: "being rewritten", _CLOSED: "closed"}.get(state, "reused")
            _gone(f"shared-memory region {ref.region} was {what} (generation {generation}, "
                  f"the reference names {ref.generation})")
        if nbytes != ref.nbytes:
            _fail(Code.KV_MALFORMED, f"region {ref.region} holds {nbytes} bytes, the reference says "
                                     f"{ref.nbytes}")
        view = memoryview(mapped)[ref.offset : ref.offset + ref.nbytes]
        if ref.crc32 is not None and zlib.crc32(view) != ref.crc32:
            view.release()
            _fail(Code.KV_CHECKSUM, f"the bytes in shared-memory region {ref.region} do not match "
                                    "their CRC-32")
        return view

    def done(self, ref: ShmRef) -> None:
        """The caller has copied `ref`'s bytes: `kv_shm_gone` when the region changed while it
        did (it was freed or reused under the read: the copy cannot be trusted)."""
        with self._lock:
            entry = self._maps.get(ref.region)
        if entry is None:
            _gone(f"shared-memory region {ref.region} was never read here")
        try:
            _magic, generation, _nbytes, state = _HEADER.unpack_from(entry.mapped, 0)
        except ValueError:
            _gone(f"shared-memory region {ref.region} was unmapped while it was read")
        if state != _LIVE or generation != ref.generation:
            _gone(f"shared-memory region {ref.region} changed while it was read (generation "
                  f"{generation}, the reference names {ref.generation})")

    def close(self) -> None:
        """Drop every mapping (one whose view someone still holds goes when the view goes)."""
        with self._lock:
            entries, self._maps = list(self._maps.values()), {}
        for entry in entries:
            _unmap(entry)

    def mapped_regions(self) -> list[str]:
        with self._lock:
            return sorted(self._maps)

    def _entry(self, name: str) -> _Mapped:
        with self._lock:
            entry = self._maps.get(name)
            if entry is not None:
                if _unlinked(entry.fd):
                    del self._maps[name]
                    _unmap(entry)
                    _gone(f"shared-memory region {name} was unlinked by its owner")
                return entry
            self._prune()
            entry = self._map(name)
            self._maps[name] = entry
            return entry

    def _map(self, name: str) -> _Mapped:
        if not _NAME.match(name):  # the schema checks it too; never a path of a peer's choosing
            _fail(Code.KV_MALFORMED, f"{name!r} is not a shared-memory region name")
        path = self.directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            _gone(f"shared-memory region {name} does not exist in {self.directory}")
        except OSError as exc:
            _gone(f"cannot open shared-memory region {path}: {exc}")
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size < DATA_OFFSET:
                _fail(Code.KV_MALFORMED, f"{path} is not a statecore KV region")
            mapped = mmap.mmap(fd, info.st_size, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                               prot=mmap.PROT_READ)
        except OSError as exc:
            os.close(fd)
            _gone(f"cannot map shared-memory region {path}: {exc}")
        except BaseException:
            os.close(fd)
            raise
        return _Mapped(fd, mapped)

    def _check_alive(self, name: str, entry: _Mapped) -> None:
        if _owner_gone(entry.fd):
            with self._lock:
                if self._maps.get(name) is entry:
                    del self._maps[name]
            with contextlib.suppress(OSError):
                os.unlink(self.directory / name)  # an orphan: nobody else will
            _unmap(entry)
            _gone(f"the process that owned shared-memory region {name} is gone")

    def _prune(self) -> None:
        for name, entry in list(self._maps.items()):
            if _unlinked(entry.fd):
                del self._maps[name]
                _unmap(entry)


def _unlinked(fd: int) -> bool:
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return True


# --------------------------------------------------------------------------- the probe


def same_host(advert: ShmAdvert) -> bool:
    """Whether this process shares memory with the producer that published `advert`: its probe
    region can be opened and mapped here, holds the advertised nonce, and its owner is alive.
    False on any failure (another host, another container's /dev/shm, another user)."""
    if not _NAME.match(advert.probe) or not os.path.isabs(advert.directory):
        return False
    path = Path(advert.directory) / advert.probe
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size < DATA_OFFSET + _NONCE_BYTES or _owner_gone(fd):
            return False
        with mmap.mmap(fd, DATA_OFFSET + _NONCE_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:
            magic, _generation, nbytes, state = _HEADER.unpack_from(m, 0)
            nonce = m[DATA_OFFSET : DATA_OFFSET + _NONCE_BYTES]
        return (magic == REGION_MAGIC and state == _LIVE and nbytes == _NONCE_BYTES
                and secrets.compare_digest(nonce, bytes.fromhex(advert.nonce)))
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)


__all__ = [
    "DATA_OFFSET",
    "DEFAULT_MAX_BYTES",
    "NAME_PATTERN",
    "PREFIX",
    "RECEIVED",
    "ROUND_BYTES",
    "SHM_ADVERT_ADAPTER",
    "SHM_REF_ADAPTER",
    "ShmAdvert",
    "ShmInbox",
    "ShmLanding",
    "ShmLandingStatistics",
    "ShmOutbox",
    "ShmOutboxStatistics",
    "ShmRef",
    "ShmWriter",
    "default_directory",
    "parse_advert",
    "parse_ref",
    "same_host",
    "sweep_orphans",
]
