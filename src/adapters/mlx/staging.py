"""A streamed handoff's KV written into its slot as the pieces arrive, before the request joins.

On a decode node the pieces of a streamed handoff come while the prefill node still computes the
prompt. For a model of plain KVCache layers each piece goes straight into a slot of the pool,
taken for the request when its first piece comes: when the first token arrives the request joins
the batch on the slot as it stands, with no copy of its whole cache on the step it joins (the
install is spread over the steps in between). While rows decode, one step writes at most
`STAGED_BYTES_PER_STEP` of staged KV read in from host memory (the copies go with that step), so
that no running stream's step grows by more than one such copy, and a request that joins with
writes still queued decodes once they are done (its own second token waits rather than every
stream); a piece already in the device's memory (a device piece) goes whole with the next step,
its copy device to device; with nothing decoding a piece is written at once, and evaluated (off
the step the request joins on). A staged
slot is no row: a step that covers it computes its throwaway token at the prompt's end, the
position the request's own first step writes again, never over the KV already written. Where a
request cannot stage (no pool, another cache class, no free slot, too long for a slot) its pieces
are kept and joined at install, as before. This module imports mlx and mlx-lm; never trio.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache

from adapters.mlx.slots import SlotPool
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError

if TYPE_CHECKING:
    from adapters.mlx.rows import Live

__all__ = ["STAGED_BYTES_PER_STEP", "Staged", "StagedSlots", "slot_views"]

# One step's share of staged copies while rows decode: small beside a step's own traffic on a GPU
# (a few milliseconds of host-to-device copy at the ~4 GB/s MLX reaches), a millisecond or two of
# memcpy on a CPU.
STAGED_BYTES_PER_STEP = 16 * 1024 * 1024


@dataclass(slots=True)
class Staged:
    """One request's slot while its pieces arrive: per layer, the tokens written or queued (in
    order), and the writes still queued (layer, first token, keys, values)."""

    slot: int
    prompt_tokens: int
    needed: int
    covered: list[int]
    pending: deque[tuple[int, int, Any, Any]] = field(default_factory=deque)
    pending_bytes: int = 0
    row: Live | None = None  # the request decoding on this slot, out of the steps until they are written
    lost: StatecoreError | None = None  # the pool's buffers were emptied: what it wrote is gone


def slot_views(pool: SlotPool, slot: int, tokens: int) -> list[Any]:
    """A slot's first `tokens` positions as one KVCache per layer, views of the pool's buffers as
    they are now (lazy: read only if used; a view kept past the next step would make that step
    copy the whole buffer, which it could otherwise update in place)."""
    caches: list[Any] = []
    for keys, values in zip(pool.keys, pool.values, strict=True):
        caches.append(KVCache.from_state(  # type: ignore[no-untyped-call]
            (keys[slot : slot + 1, :, :tokens, :], values[slot : slot + 1, :, :tokens, :], tokens)))
    return caches


def _malformed(message: str) -> StatecoreError:
    return StatecoreError(ErrorInfo(Fault.PEER, Code.KV_MALFORMED, message))


class StagedSlots:
    """The staged slots of one pool (device thread only)."""

    def __init__(self) -> None:
        self.entries: dict[str, Staged] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.entries

    def stage(self, pool: SlotPool | None, request_id: str, first_layer: int, start: int,
              caches: Sequence[Any], prompt_tokens: int, needed: int, *, room: bool, decoding: bool,
              in_device_memory: bool = False) -> bool:
        """Queue a piece (layers from `first_layer`, tokens from `start`) into the request's slot,
        taking one at its first piece when `room` allows; False when the request does not stage
        (its pieces are then joined at install). Written at once when nothing is `decoding`, or
        when its arrays are `in_device_memory` (a copy between device buffers, with the next step)."""
        entry = self.entries.get(request_id)
        if entry is None:
            if not self._can_start(pool, first_layer, caches, needed, room=room):
                return False
            assert pool is not None
            slot = pool.take()
            try:
                pool.reserve(needed, caches)
            except BaseException:
                pool.give_back(slot)
                raise
            entry = Staged(slot, prompt_tokens, needed, [0] * pool.num_layers)
            self.entries[request_id] = entry
        if entry.lost is not None:
            raise entry.lost
        if prompt_tokens != entry.prompt_tokens:
            raise _malformed(f"a KV piece for a prompt of {prompt_tokens} tokens; "
                             f"it has {entry.prompt_tokens}")
        for layer, cache in enumerate(caches, start=first_layer):
            if not 0 <= layer < len(entry.covered):
                raise _malformed(f"a KV piece names layer {layer}; the model has {len(entry.covered)}")
            if type(cache) is not KVCache:
                raise _malformed(f"layer {layer} of a KV piece is a {type(cache).__name__}, not a KVCache")
            keys: Any = cache.keys
            values: Any = cache.values
            tokens = int(keys.shape[2])
            if start != entry.covered[layer] or start + tokens > prompt_tokens:
                raise _malformed(f"layer {layer}'s KV piece covers [{start}, {start + tokens}); "
                                 f"{entry.covered[layer]} of {prompt_tokens} tokens came before it")
            entry.covered[layer] = start + tokens
            entry.pending.append((layer, start, keys, values))
            entry.pending_bytes += int(keys.nbytes) + int(values.nbytes)
        if not decoding:
            # Nothing decodes: the piece is copied into its slot now, on the steps' stream (in
            # place), while the pieces after it still come, rather than by the step it joins on
            # (on MLX's CUDA backend that step read every piece in from host memory: 30-43 ms
            # against a 5-7 ms step for 2,000 tokens of the 1B shape).
            _, layers = self.write(pool, entry, None)
            assert pool is not None
            with mx.stream(generation_stream):
                mx.eval([buffer for layer in layers for buffer in (pool.keys[layer], pool.values[layer])])
        elif in_device_memory:
            # The pace of STAGED_BYTES_PER_STEP is for arrays read in from host memory; a piece
            # already in the device's memory is a device-to-device copy (an 8,000-token prompt of
            # the 1B shape, 262 MB, is a fraction of a millisecond on an H100), so it goes with the
            # next step whole, and the request joins without waiting for paced writes.
            self.write(pool, entry, None)
        return True

    def _can_start(self, pool: SlotPool | None, first_layer: int, caches: Sequence[Any], needed: int, *,
                   room: bool) -> bool:
        if pool is None or not room or not pool.free_slots or needed > pool.max_capacity:
            return False
        if any(type(cache) is not KVCache for cache in caches):
            return False
        # The pool's buffers are shaped after a first cache of every layer.
        return pool.keys[0] is not None or (first_layer == 0 and len(caches) == pool.num_layers)

    def write(self, pool: SlotPool | None, entry: Staged, budget: int | None) -> tuple[int, set[int]]:
        """Write `entry`'s queued pieces into its slot (lazily: they are evaluated with the next
        step, on its stream; evaluated at once from a job, on another stream, each write copied
        the whole pool buffer: a 450 ms install on the CPU), at most `budget` bytes of them but
        always one (None: all); the bytes and the layers written."""
        assert pool is not None
        written = 0
        touched: set[int] = set()
        while entry.pending and (budget is None or written == 0 or written < budget):
            layer, start, keys, values = entry.pending[0]
            size = int(keys.nbytes) + int(values.nbytes)
            if budget is not None and written and written + size > budget:
                break
            entry.pending.popleft()
            stop = start + int(keys.shape[2])
            pool.keys[layer][entry.slot : entry.slot + 1, :, start:stop, :] = keys
            pool.values[layer][entry.slot : entry.slot + 1, :, start:stop, :] = values
            entry.pending_bytes -= size
            written += size
            touched.add(layer)
        return written, touched

    def write_some(self, pool: SlotPool | None, budget: int | None = STAGED_BYTES_PER_STEP) -> None:
        """One step's share of the queued writes, oldest request first (None: all of them); a
        joined request whose writes are done is no longer staged: it decodes from this step on."""
        for request_id, entry in list(self.entries.items()):
            if budget is not None and budget <= 0:
                break
            written, _ = self.write(pool, entry, budget)
            if budget is not None:
                budget -= written
            if entry.row is not None and not entry.pending:
                entry.row.staging = False
                del self.entries[request_id]

    def ready(self, pool: SlotPool | None, request_id: str, *, decoding: bool) -> Staged:
        """The request's slot, every layer covering its prompt (raises, the peer's fault, when
        pieces are missing); its queued writes all made now unless rows are `decoding` (then a
        step's share at a time: it joins, and decodes once they are done)."""
        entry = self.entries[request_id]
        if entry.lost is not None:
            raise entry.lost
        if not decoding:
            self.write(pool, entry, None)
        short = [layer for layer, tokens in enumerate(entry.covered) if tokens != entry.prompt_tokens]
        if short:
            raise StatecoreError(ErrorInfo(
                Fault.PEER, Code.KV_TRUNCATED,
                f"the KV pieces cover {entry.covered[short[0]]} of the prompt's {entry.prompt_tokens} "
                f"tokens in layer {short[0]}"))
        return entry

    def lose(self, error: StatecoreError) -> list[Live]:
        """The pool's buffers were emptied: every staged request's pieces are gone. One not joined
        yet keeps its slot until it is unstaged, and its next piece or its install raises
        `error`; those that joined (their writes still queued) are returned, no longer staged:
        they fail, and their slots go back as they leave."""
        joined = [entry.row for entry in self.entries.values() if entry.row is not None]
        for request_id, entry in list(self.entries.items()):
            entry.pending.clear()
            entry.pending_bytes = 0
            if entry.row is not None:
                entry.row.staging = False
                del self.entries[request_id]
            else:
                entry.lost = error
        return joined

    def views(self, pool: SlotPool | None, request_id: str) -> list[Any]:
        """The staged prompt's cache as KVCache views of its slot (lazy: read only if used)."""
        assert pool is not None
        entry = self.entries[request_id]
        return slot_views(pool, entry.slot, entry.prompt_tokens)

    def adopt(self, live: Live) -> Staged | None:
        """The staged slot a joining request takes as its row: no longer staged, or, while its
        writes are still queued, staged (and the row `staging`) until they are done (`write_some`)."""
        entry = self.entries.get(live.request_id)
        if entry is None:
            return None
        if entry.pending:
            entry.row = live
            live.staging = True
        else:
            del self.entries[live.request_id]
        return entry

    def unstage(self, pool: SlotPool | None, request_id: str) -> bool:
        """Forget a staged request's pieces and give its slot back (a joined one's slot goes back
        as its row leaves the lane); whether it had one."""
        entry = self.entries.pop(request_id, None)
        if entry is None:
            return False
        if pool is not None and entry.row is None:
            pool.give_back(entry.slot)
        return True

    def release(self, pool: SlotPool | None, request_id: str) -> bool:
        """A request whose pieces came but which will not join (its first token ended it, or it
        went elsewhere): its slot back; one that joined keeps its slot and writes. Whether it had
        a staged slot to give back."""
        entry = self.entries.get(request_id)
        if entry is None or entry.row is not None:
            return False
        return self.unstage(pool, request_id)

    def throwaway_offsets(self, offsets: list[int]) -> None:
        """A step's offsets for staged slots in its range: their prompt's end, not position 0."""
        for entry in self.entries.values():
            if entry.slot < len(offsets):
                offsets[entry.slot] = entry.prompt_tokens
