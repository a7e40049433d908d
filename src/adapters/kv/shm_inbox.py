"""`ShmInbox`: a consumer's view of a producer's regions of shared memory, read in place, checked.

The decode node's inbox maps a region a `ShmRef` names and returns a read-only view of its bytes,
validated (the region exists and its owner is alive, the range is inside it, the region still
holds the generation the reference names, the CRC-32 matches); the caller copies from the view
into place, calls `done` (which says whether the region changed while it was read) and sends the
reference back to the producer (`adapters.kv.shm_outbox.ShmOutbox.free`). Whether a peer's
regions can be read here at all is measured, not guessed from its URL: `same_host` maps the
probe region the peer advertises and checks its nonce. The region format is
`adapters.kv.shm_region`'s. This is an adapter: it must never import trio, httpx, mlx, mlx_lm or
numpy (callers read on a worker thread and do the copy into place themselves); nothing in
`statecore` or `effects` may import it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import stat
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

from adapters.kv.shm_region import (
    CLOSED,
    DATA_OFFSET,
    FREE,
    HEADER,
    LIVE,
    MAP_POPULATE,
    NAME,
    NONCE_BYTES,
    REGION_MAGIC,
    WRITING,
    ShmAdvert,
    ShmRef,
    default_directory,
    owner_gone,
    refuse,
    region_gone,
    unlinked,
)
from statecore.errors import Code


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
            refuse(Code.KV_MALFORMED, f"shared-memory reference [{ref.offset}, {ref.offset + ref.nbytes}) "
                                     f"runs past region {ref.region} ({len(mapped)} bytes)")
        self._check_alive(ref.region, entry)
        magic, generation, nbytes, state = HEADER.unpack_from(mapped, 0)
        if magic != REGION_MAGIC:
            refuse(Code.KV_MALFORMED, f"{ref.region} is not a statecore KV region")
        if state != LIVE or generation != ref.generation:
            what = {FREE: "freed", WRITING: "being rewritten", CLOSED: "closed"}.get(state, "reused")
            region_gone(f"shared-memory region {ref.region} was {what} (generation {generation}, "
                  f"the reference names {ref.generation})")
        if nbytes != ref.nbytes:
            refuse(Code.KV_MALFORMED, f"region {ref.region} holds {nbytes} bytes, the reference says "
                                     f"{ref.nbytes}")
        view = memoryview(mapped)[ref.offset : ref.offset + ref.nbytes]
        if ref.crc32 is not None and zlib.crc32(view) != ref.crc32:
            view.release()
            refuse(Code.KV_CHECKSUM, f"the bytes in shared-memory region {ref.region} do not match "
                                    "their CRC-32")
        return view

    def done(self, ref: ShmRef) -> None:
        """The caller has copied `ref`'s bytes: `kv_shm_gone` when the region changed while it
        did (it was freed or reused under the read: the copy cannot be trusted)."""
        with self._lock:
            entry = self._maps.get(ref.region)
        if entry is None:
            region_gone(f"shared-memory region {ref.region} was never read here")
        try:
            _magic, generation, _nbytes, state = HEADER.unpack_from(entry.mapped, 0)
        except ValueError:
            region_gone(f"shared-memory region {ref.region} was unmapped while it was read")
        if state != LIVE or generation != ref.generation:
            region_gone(f"shared-memory region {ref.region} changed while it was read (generation "
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
                if unlinked(entry.fd):
                    del self._maps[name]
                    _unmap(entry)
                    region_gone(f"shared-memory region {name} was unlinked by its owner")
                return entry
            self._prune()
            entry = self._map(name)
            self._maps[name] = entry
            return entry

    def _map(self, name: str) -> _Mapped:
        if not NAME.match(name):  # the schema checks it too; never a path of a peer's choosing
            refuse(Code.KV_MALFORMED, f"{name!r} is not a shared-memory region name")
        path = self.directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            region_gone(f"shared-memory region {name} does not exist in {self.directory}")
        except OSError as exc:
            region_gone(f"cannot open shared-memory region {path}: {exc}")
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size < DATA_OFFSET:
                refuse(Code.KV_MALFORMED, f"{path} is not a statecore KV region")
            mapped = mmap.mmap(fd, info.st_size, flags=mmap.MAP_SHARED | MAP_POPULATE,
                               prot=mmap.PROT_READ)
        except OSError as exc:
            os.close(fd)
            region_gone(f"cannot map shared-memory region {path}: {exc}")
        except BaseException:
            os.close(fd)
            raise
        return _Mapped(fd, mapped)

    def _check_alive(self, name: str, entry: _Mapped) -> None:
        if owner_gone(entry.fd):
            with self._lock:
                if self._maps.get(name) is entry:
                    del self._maps[name]
            with contextlib.suppress(OSError):
                os.unlink(self.directory / name)  # an orphan: nobody else will
            _unmap(entry)
            region_gone(f"the process that owned shared-memory region {name} is gone")

    def _prune(self) -> None:
        for name, entry in list(self._maps.items()):
            if unlinked(entry.fd):
                del self._maps[name]
                _unmap(entry)


def same_host(advert: ShmAdvert) -> bool:
    """Whether this process shares memory with the producer that published `advert`: its probe
    region can be opened and mapped here, holds the advertised nonce, and its owner is alive.
    False on any failure (another host, another container's /dev/shm, another user)."""
    if not NAME.match(advert.probe) or not os.path.isabs(advert.directory):
        return False
    path = Path(advert.directory) / advert.probe
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size < DATA_OFFSET + NONCE_BYTES or owner_gone(fd):
            return False
        with mmap.mmap(fd, DATA_OFFSET + NONCE_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:
            magic, _generation, nbytes, state = HEADER.unpack_from(m, 0)
            nonce = m[DATA_OFFSET : DATA_OFFSET + NONCE_BYTES]
        return (magic == REGION_MAGIC and state == LIVE and nbytes == NONCE_BYTES
                and secrets.compare_digest(nonce, bytes.fromhex(advert.nonce)))
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)


__all__ = ["ShmInbox", "same_host"]
