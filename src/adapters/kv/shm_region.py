"""A region of shared memory for KV bytes between two processes of one host: its file, its
header, its owner's lock, and the values that name one on the wire.

Regions are files in a tmpfs (`/dev/shm` on Linux; the temporary directory elsewhere) mapped with
`mmap`. Each holds a 4 KiB header page (magic, generation, byte count, state) and then page-aligned
data; it gets its name (`statecore-kv-<pid>-<outbox>-<number | probe>`) only once its owner holds a
shared `flock` on it, which the owner keeps for as long as it lives: the kernel drops it when the
process dies however it dies (SIGKILL included), so a reader or `sweep_orphans` can tell an orphan
from a live region, and remove it. A `ShmRef` names one write's bytes in a region (range,
generation, CRC-32), a `ShmAdvert` a producer's probe region (so a peer can find out whether it
shares the memory: `adapters.kv.shm_inbox.same_host`); both are strict pydantic values, validated
when they arrive (`parse_ref`, `parse_advert`). Every failure is a `StatecoreError` (`kv_shm_gone`,
`kv_malformed`, `kv_checksum_mismatch`; `overloaded` when there is no room, so the caller can fall
back to HTTP); no OSError escapes. The producer's side is `adapters.kv.shm_outbox`, the consumer's
`adapters.kv.shm_inbox`. This is an adapter: it must never import trio, httpx, mlx, mlx_lm or
numpy; nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import stat
import struct
import tempfile
import time
from pathlib import Path
from typing import Annotated, Final, NoReturn

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, peer_error

PREFIX: Final = "statecore-kv-"
# statecore-kv-<pid>-<8 hex of this outbox>-<region number | "probe">
NAME_PATTERN: Final = r"^statecore-kv-[0-9]{1,10}-[0-9a-f]{8}-(?:[0-9]{1,12}|probe)$"
NAME: Final = re.compile(NAME_PATTERN)
_TMP_SUFFIX: Final = ".tmp"  # a region being made; renamed once its owner holds its lock
_TMP_GRACE_S: Final = 60.0  # an unlocked .tmp older than this is an orphan

REGION_MAGIC: Final = b"SCKVSHM1"
HEADER: Final = struct.Struct("<8sQQI")  # magic, generation, nbytes, state
DATA_OFFSET: Final = 4096  # the header page; data starts page-aligned
FREE, WRITING, LIVE, CLOSED = 0, 1, 2, 3
PROBE_BYTES: Final = 64  # data bytes of the probe region: its nonce
NONCE_BYTES: Final = 16
MAP_POPULATE: Final = getattr(mmap, "MAP_POPULATE", 0)  # Linux: map every page up front


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
        refuse(Code.KV_MALFORMED, f"invalid shared-memory KV reference: {_first_error(exc)}")


def parse_advert(document: object) -> ShmAdvert | None:
    """A peer's advert, or None when it sent none or an invalid one (then: no shared memory)."""
    try:
        return SHM_ADVERT_ADAPTER.validate_python(document)
    except ValidationError:
        return None


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc']) or 'reference'}: {first['msg']}"


def refuse(code: Code, message: str) -> NoReturn:
    raise StatecoreError(peer_error(message, code))


def region_gone(message: str) -> NoReturn:
    refuse(Code.KV_SHM_GONE, message)


def no_room(message: str) -> NoReturn:
    raise StatecoreError(ErrorInfo(Fault.OVERLOADED, Code.OVERLOADED, message))


# --------------------------------------------------------------------------- files


def make_region(directory: Path, name: str, capacity: int) -> tuple[int, mmap.mmap]:
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
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | MAP_POPULATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        HEADER.pack_into(mapped, 0, REGION_MAGIC, 0, 0, FREE)
        os.rename(tmp, directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        os.close(fd)
        raise
    return fd, mapped


def owner_gone(fd: int) -> bool:
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
        if not NAME.match(name):
            continue
        path = where / entry
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            young_tmp = entry != name and now - info.st_mtime < _TMP_GRACE_S
            if stat.S_ISREG(info.st_mode) and not young_tmp and owner_gone(fd):
                os.unlink(path)
                removed.append(entry)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def unlinked(fd: int) -> bool:
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return True


__all__ = [
    "CLOSED",
    "DATA_OFFSET",
    "FREE",
    "HEADER",
    "LIVE",
    "MAP_POPULATE",
    "NAME",
    "NAME_PATTERN",
    "NONCE_BYTES",
    "PREFIX",
    "PROBE_BYTES",
    "REGION_MAGIC",
    "SHM_ADVERT_ADAPTER",
    "SHM_REF_ADAPTER",
    "WRITING",
    "ShmAdvert",
    "ShmRef",
    "default_directory",
    "make_region",
    "no_room",
    "owner_gone",
    "parse_advert",
    "parse_ref",
    "refuse",
    "region_gone",
    "sweep_orphans",
    "unlinked",
]
