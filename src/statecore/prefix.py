"""The prefix cache's policy: which computed prompt blocks a new prompt may reuse, and which to forget.

A prompt is prefilled in chunks (`prompt_chunks`: prompt[:-1] cut into blocks, then the last
token alone); each chunk is one model call, and a step computes several. A block ends every
`chunk_size` tokens after the previous end, and right after every token of the node's *block
ends* (the model's end-of-turn tokens) but the prompt's last one: so a chat message's end, where
prompts that share a system prompt or a document stop sharing, is a block's end, in a prompt of
any length (a system prompt shared by first turns shorter than a chunk is a block of its own),
while the message just sent, which no other prompt starts with, is computed with what follows
it (the assistant's header) in one call; a prompt of one message is then one call, and may
share a padded call with other short prompts. The message just sent ends a block in the
conversation kept after the turn (`conversation_block_bounds`: every end-of-turn token) and in
the next turn's prompt, where another message follows it. The cut points are a function of the
tokens (the chunk size and the block ends are in the fingerprint), the same on every node,
whether a block came from the cache or not. (Rule `LONG`, `message_blocks` "long", is the rule
before: early ends only in a prompt longer than one chunk before its last token, after every
end-of-turn token; a shorter prompt is one call and nothing of it is ever reused.) The KV
cache after k blocks depends only on their tokens and calls, and the calls after them are the
same whether or not the first k were computed now: so a block is one chunk, named by a key
chained over every block up to its end (`block_keys`: it names the tokens and where each block
ends), and a prompt whose first k blocks are cached starts at chunk k with the same numbers as
from token 0. A cut anywhere else would change the calls (and so the last bits: a row's numbers
depend on where its call ends, docs/engine.md).
`PrefixIndex` keeps the cached blocks' keys and sizes in two tiers: the device's (what a prompt
starts from) and, where the device's memory is not the host's, a bounded host pool. Each tier
has its own byte capacity and least-recently-used order; a block is in one tier at most; a
device block's parent is on the device and a host block's is on either (what is held is always
whole prefixes). A block leaves the device, least recently used first and only after every
device block that extends it, for its capacity or on demand (`evict`, when admission needs the
memory): to the host pool when there is one, else forgotten; the host pool forgets its least
recently used leaves to stay within its capacity. `promote` brings a prompt's host blocks back
to the device (the engine decides when that beats computing them). Every operation returns the
moves it made (`Moved`), in order, for the engine to do the same with the arrays. A finished request's
conversation (its prompt and every generated token) is what its next turn starts with:
`conversation_block_range` says which of its blocks a node computes again, as prefill chunks,
to keep them (decode computed those tokens one at a time, whose numbers are not a chunk's).
The engine keeps the arrays (`adapters.mlx.prefix_cache`). This module must never import trio,
httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["ALL", "DEVICE", "HOST", "LONG", "MESSAGE_BLOCKS", "MessageBlocks", "Moved", "PrefixIndex", "Tier",
           "block_bounds", "block_keys",
           "conversation_block_bounds", "conversation_block_keys", "conversation_block_range",
           "conversation_blocks", "prompt_chunks"]

Tier = Literal["device", "host"]
DEVICE: Tier = "device"
HOST: Tier = "host"

# Where an end-of-turn token ends a prompt's block (the module's paragraph): message_blocks
MessageBlocks = Literal["all", "long"]
ALL: MessageBlocks = "all"
LONG: MessageBlocks = "long"
MESSAGE_BLOCKS: tuple[MessageBlocks, ...] = (ALL, LONG)


def block_bounds(tokens: Sequence[int], chunk_size: int, ends: Collection[int] = (), *,
                 rule: MessageBlocks = ALL) -> list[int]:
    """Where the prompt's blocks end before its last token, in order: `chunk_size` tokens after
    the previous end, or right after a token of `ends` other than the last one before the
    prompt's last token (rule `LONG`: after every one, in a prompt of more than one chunk before
    its last token only)."""
    if chunk_size < 1:
        raise ValueError("chunk_size must be > 0")
    head = len(tokens) - 1
    if rule == LONG:
        return _bounds(tokens, head, chunk_size, ends if head > chunk_size else ())
    after_ends = _after_ends(tokens, head, ends)
    return _cut(head, chunk_size, after_ends[:-1] if after_ends else after_ends)


def _bounds(tokens: Sequence[int], head: int, chunk_size: int, ends: Collection[int]) -> list[int]:
    """Block ends within tokens[:head] (at most `head`)."""
    return _cut(head, chunk_size, _after_ends(tokens, head, ends))


def _after_ends(tokens: Sequence[int], head: int, ends: Collection[int]) -> list[int]:
    """The positions right after each token of `ends` in tokens[:head], in order. Found by
    `Sequence.index` (a C scan) rather than a Python loop over every token: the router computes
    these for each prompt it routes, on its first token's path (~1.5 ms a pass at 8,000 tokens)."""
    found: list[int] = []
    for end in set(ends):
        at = 0
        while True:
            try:
                at = tokens.index(end, at, head) + 1
            except ValueError:
                break
            found.append(at)
    return sorted(found)


def _cut(head: int, chunk_size: int, after_ends: Sequence[int]) -> list[int]:
    """Block ends up to `head`: at each of `after_ends`, and `chunk_size` tokens after the
    previous end wherever no end-of-turn comes sooner."""
    bounds: list[int] = []
    start = 0
    for position in (*after_ends, head + 1):
        while position - start > chunk_size:
            start += chunk_size
            bounds.append(start)
        if position <= head:
            bounds.append(position)
            start = position
    return bounds


def prompt_chunks(tokens: Sequence[int], chunk_size: int, ends: Collection[int] = (), *,
                  rule: MessageBlocks = ALL) -> tuple[int, ...]:
    """The token counts of a prompt's prefill calls, in order: its blocks, the rest of
    prompt[:-1] when it does not end a block, then the last token alone (its logits give the
    first token). Without `ends`, `statecore.scheduling.prefill_chunks`; `rule`: `block_bounds`."""
    if not tokens:
        raise ValueError("a prompt has at least one token")
    head = len(tokens) - 1
    bounds = block_bounds(tokens, chunk_size, ends, rule=rule)
    if not bounds or bounds[-1] < head:
        bounds.append(head)
    sizes = [end - start for start, end in zip([0, *bounds], bounds, strict=False)]
    return (*(size for size in sizes if size), 1)


def keys_at(tokens: Sequence[int], bounds: Sequence[int]) -> list[bytes]:
    """The keys of the blocks of `tokens` that end at `bounds` (`block_keys`)."""
    keys: list[bytes] = []
    parent = b""
    for start, end in zip([0, *bounds], bounds, strict=False):
        block = array("I", tokens[start:end]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        keys.append(parent)
    return keys


def block_keys(tokens: Sequence[int], chunk_size: int, ends: Collection[int] = (), *,
               rule: MessageBlocks = ALL) -> list[bytes]:
    """The keys of the prompt's blocks (`block_bounds`), in order: key i names the tokens up to
    block i's end and where every block before it ends (a 16-byte BLAKE2b chained over the
    blocks: the same tokens cut elsewhere are other blocks, whose numbers differ)."""
    return keys_at(tokens, block_bounds(tokens, chunk_size, ends, rule=rule))


def conversation_block_bounds(tokens: Sequence[int], chunk_size: int, ends: Collection[int] = ()
                              ) -> list[int]:
    """Where the blocks of a finished conversation (or any prefix a later prompt goes on from)
    end, its very end included when a block ends there: a next turn's prompt starts with all of
    `tokens` and goes on. Cut as a longer prompt whose last message end comes after them is
    (after every end-of-turn token, even within one chunk)."""
    if chunk_size < 1:
        raise ValueError("chunk_size must be > 0")
    return _bounds(tokens, len(tokens), chunk_size, ends)


def conversation_block_keys(tokens: Sequence[int], chunk_size: int, ends: Collection[int] = ()
                            ) -> list[bytes]:
    """The keys of a conversation's blocks (`conversation_block_bounds`)."""
    return keys_at(tokens, conversation_block_bounds(tokens, chunk_size, ends))


def conversation_blocks(prompt_tokens: int, conversation_tokens: int, cached_blocks: int,
                        chunk_size: int) -> range:
    """`conversation_block_range` for blocks of `chunk_size` tokens (no early ends)."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be > 0")
    return conversation_block_range(max(0, prompt_tokens - 1) // chunk_size,
                                    max(0, conversation_tokens) // chunk_size, cached_blocks)


def conversation_block_range(prompt_blocks: int, conversation_blocks: int, cached_blocks: int) -> range:
    """Which blocks of a finished request's conversation (prompt, then generated tokens) to
    compute and keep, given that its first `cached_blocks` are cached: those after them, up to
    its last (`conversation_blocks` in all; `prompt_blocks`: the prompt's own). None when some of
    the prompt's own blocks are not cached (forgotten meanwhile, or the prompt came
    short-batched): keeping would then recompute the prompt, which is prefill's work, not a
    turn's tail."""
    if cached_blocks < prompt_blocks:
        return range(0)
    return range(cached_blocks, conversation_blocks)


@dataclass(frozen=True, slots=True)
class Moved:
    """One block's move in an index operation: to the host pool, back to the device, or
    forgotten (`to` None). The engine moves or drops the block's arrays in the same order."""

    key: bytes
    to: Tier | None


@dataclass(slots=True)
class _Block:
    parent: bytes | None
    nbytes: int
    device_children: int = 0  # blocks extending it on the device: it stays there while any does
    host_children: int = 0  # ... and in the host pool: it is never forgotten while any does


class PrefixIndex:
    """Held blocks by key in two tiers (device, host), each least recently used first; whole
    prefixes only. `host_capacity_bytes` 0: no host pool (a block leaving the device is forgotten)."""

    def __init__(self, capacity_bytes: int, host_capacity_bytes: int = 0) -> None:
        self.capacity_bytes = capacity_bytes
        self.host_capacity_bytes = host_capacity_bytes
        self._device: OrderedDict[bytes, _Block] = OrderedDict()
        self._host: OrderedDict[bytes, _Block] = OrderedDict()
        self.nbytes = 0  # the device tier's
        self.host_nbytes = 0
        self.version = 0  # grows whenever a block is added or forgotten (summaries are cached by it)

    def __len__(self) -> int:
        return len(self._device) + len(self._host)

    def __contains__(self, key: bytes) -> bool:
        """Held in either tier."""
        return key in self._device or key in self._host

    def tier(self, key: bytes) -> Tier | None:
        if key in self._device:
            return DEVICE
        return HOST if key in self._host else None

    def on_device(self, key: bytes) -> bool:
        return key in self._device

    def parent(self, key: bytes) -> bytes | None:
        return self._entry(key).parent

    def cached_keys(self) -> list[bytes]:
        """Every held block's key, the device's then the host pool's (each least recently used first)."""
        return [*self._device, *self._host]

    def device_keys(self) -> list[bytes]:
        return list(self._device)

    def host_keys(self) -> list[bytes]:
        return list(self._host)

    def cached(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`' leading blocks are on the device; those become its most recently used."""
        count = 0
        for key in keys:
            if key not in self._device:
                break
            count += 1
        for key in keys[:count]:
            self._device.move_to_end(key)
        return count

    def on_host(self, keys: Sequence[bytes], start: int) -> int:
        """How many of `keys` from `start` on (the blocks after those on the device) are in the host pool."""
        count = 0
        for key in keys[start:]:
            if key not in self._host:
                break
            count += 1
        return count

    def add(self, key: bytes, parent: bytes | None, nbytes: int, room: int | None = None) -> list[Moved]:
        """Put a block on the device (its parent, when it has one, must be there; a block held
        in the host pool is taken from it: its new arrays replace the old), then make room: the
        moves made, the block's own among them when it cannot stay (larger than the capacity,
        or only its own prefix is left). `room`: the most the device tier may grow by now, as in
        `promote`."""
        limit = self._limit(room)
        if key in self._device:
            self._device.move_to_end(key)
            return []
        if parent is not None and parent not in self._device:
            raise ValueError("a block is cached only after the block before it")
        if key in self._host:
            block = self._retier(key, DEVICE)
            self.nbytes += nbytes - block.nbytes
            block.nbytes = nbytes
        else:
            self._device[key] = _Block(parent, nbytes)
            self.nbytes += nbytes
            self.version += 1
            if parent is not None:
                self._device[parent].device_children += 1
        moves = self.evict(self.nbytes - limit, keep=key)
        if self.nbytes > limit:  # only its own prefix is left, and it does not fit
            moves.extend(self._leave_device(key))
        return moves

    def evict(self, nbytes: int, keep: bytes | None = None) -> list[Moved]:
        """Free `nbytes` of the device tier (or all but `keep` and its ancestors): its least
        recently used blocks that no device block extends go to the host pool (or are forgotten
        without one); the moves made."""
        moves: list[Moved] = []
        freed = 0
        protected = self._ancestors(keep)
        while freed < nbytes:
            victim = next((key for key, block in self._device.items()
                           if block.device_children == 0 and key not in protected), None)
            if victim is None:
                break
            freed += self._device[victim].nbytes
            moves.extend(self._leave_device(victim))
        return moves

    def evict_host(self, nbytes: int) -> list[Moved]:
        """Forget the host pool's least recently used leaves until `nbytes` are freed or it is empty."""
        moves: list[Moved] = []
        freed = 0
        while freed < nbytes and self._host:
            victim = next(k for k, b in self._host.items() if b.host_children == 0)
            freed += self._host[victim].nbytes
            moves.append(self._forget(victim))
        return moves

    def promote(self, keys: Sequence[bytes], start: int, room: int | None = None) -> list[Moved]:
        """Bring `keys`' host blocks from `start` on (those right after the device's) back to the
        device, in order, as far as they fit beside their own prefix; the moves made (each
        promoted block's first, then what left the device for it). `room`: the most the device
        tier may grow by now (what KV admission leaves free): beyond it, and beyond the capacity,
        least recently used device blocks go to the host pool for them."""
        limit = self._limit(room)
        moves: list[Moved] = []
        for key in keys[start:]:
            block = self._host.get(key)
            if block is None or (block.parent is not None and block.parent not in self._device):
                break
            prefix_bytes = sum(self._device[k].nbytes for k in self._ancestors(block.parent))
            if block.nbytes + prefix_bytes > limit:
                break  # not even beside its prefix alone: it stays where it is
            self._retier(key, DEVICE)
            moves.append(Moved(key, DEVICE))
            moves.extend(self.evict(self.nbytes - limit, keep=key))
        return moves

    def _leave_device(self, key: bytes) -> list[Moved]:
        """A device block that no device block extends leaves it: to the host pool, which then
        forgets its least recently used leaves to fit (this one too, last, if it must), or
        forgotten with every host block extending it when there is no pool or it is larger."""
        block = self._device[key]
        if block.nbytes > self.host_capacity_bytes:
            return [*self._forget_extensions(key), self._forget(key)]
        self._retier(key, HOST)
        return [Moved(key, HOST), *self.evict_host(self.host_nbytes - self.host_capacity_bytes)]

    def _limit(self, room: int | None) -> int:
        """The device tier's bound for one operation: its capacity, and no more than `room` above
        what it holds now (None: the capacity alone; a negative room counts as none)."""
        return self.capacity_bytes if room is None else min(self.capacity_bytes, self.nbytes + max(0, room))

    def _retier(self, key: bytes, to: Tier) -> _Block:
        """Move a held block into the other tier, as its most recently used; its bytes and its
        parent's counts of extensions (the parent is on the device either way) go with it."""
        source, target = (self._host, self._device) if to == DEVICE else (self._device, self._host)
        block = target[key] = source.pop(key)
        step = block.nbytes if to == DEVICE else -block.nbytes
        self.nbytes += step
        self.host_nbytes -= step
        if block.parent is not None:
            parent = self._device[block.parent]
            parent.device_children += 1 if to == DEVICE else -1
            parent.host_children -= 1 if to == DEVICE else -1
        return block

    def _forget_extensions(self, key: bytes) -> list[Moved]:
        """Forget every host block that extends `key` (deepest first)."""
        moves: list[Moved] = []
        for child in [k for k, b in self._host.items() if b.parent == key]:
            moves.extend(self._forget_extensions(child))
            moves.append(self._forget(child))
        return moves

    def _forget(self, key: bytes) -> Moved:
        tier = self._device if key in self._device else self._host
        block = tier.pop(key)
        if tier is self._device:
            self.nbytes -= block.nbytes
        else:
            self.host_nbytes -= block.nbytes
        self.version += 1
        if block.parent is not None:
            parent = self._entry(block.parent)
            if tier is self._device:
                parent.device_children -= 1
            else:
                parent.host_children -= 1
        return Moved(key, None)

    def _entry(self, key: bytes) -> _Block:
        return self._device[key] if key in self._device else self._host[key]

    def _ancestors(self, key: bytes | None) -> set[bytes]:
        found: set[bytes] = set()
        while key is not None and key in self:
            found.add(key)
            key = self._entry(key).parent
        return found
