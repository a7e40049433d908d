"""The prefix cache's policy: which computed prompt blocks a new prompt may reuse, and which to forget.

A prompt is prefilled in fixed chunks (`statecore.scheduling.prefill_chunks`: prompt[:-1] in chunks
of the node's chunk size, then the last token). The KV cache after k whole chunks depends only on
those k * chunk tokens, and the chunks after them are the same calls whether or not the first k
were computed now: so a block is one whole chunk, named by a key chained over every token before
its end (`block_keys`), and a prompt whose first k blocks are cached starts at chunk k with the
same numbers as from token 0. A cut anywhere else would change the calls (and so the last bits:
a row's numbers depend on where its call ends, docs/engine.md); chunks are small (256 tokens by
default) and a step computes several.
`PrefixIndex` keeps the cached blocks' keys and sizes: least recently used first out, a block
only after every block that extends it (what is cached is always whole prefixes), within a byte
capacity, and on demand (`evict`) when admission needs the memory. A finished request's
conversation (its prompt and every generated token) is what its next turn starts with:
`conversation_blocks` says which of its whole chunks a node computes again, as prefill chunks,
to keep them (decode computed those tokens one at a time, whose numbers are not a chunk's).
The engine keeps the arrays (`adapters.mlx.prefix_cache`). This module must never import trio,
httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PrefixIndex", "block_keys", "conversation_block_keys", "conversation_blocks"]


def block_keys(tokens: Sequence[int], chunk_size: int) -> list[bytes]:
    """The keys of the prompt's whole prefill chunks before its last token, in order: key i names
    tokens[: (i + 1) * chunk_size] (a 16-byte BLAKE2b chained over the blocks)."""
    keys: list[bytes] = []
    parent = b""
    for end in range(chunk_size, len(tokens), chunk_size):  # a block ends before the last token
        block = array("I", tokens[end - chunk_size : end]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        keys.append(parent)
    return keys


def conversation_block_keys(tokens: Sequence[int], chunk_size: int) -> list[bytes]:
    """The keys of every whole chunk of a finished conversation, the last one included when it
    ends exactly at the end: a next turn's prompt starts with all of `tokens` and goes on."""
    return block_keys([*tokens, 0], chunk_size)  # one more token: block_keys stops before the last


def conversation_blocks(prompt_tokens: int, conversation_tokens: int, cached_blocks: int,
                        chunk_size: int) -> range:
    """Which whole chunks of a finished request's conversation (prompt, then generated tokens)
    to compute and keep, given that its first `cached_blocks` are cached: those after them, up to
    the conversation's last whole chunk. None when some of the prompt's own blocks are not cached
    (forgotten meanwhile, or the prompt came short-batched): keeping would then recompute the
    prompt, which is prefill's work, not a turn's tail."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be > 0")
    prompt_blocks = max(0, prompt_tokens - 1) // chunk_size
    whole = max(0, conversation_tokens) // chunk_size
    if cached_blocks < prompt_blocks:
        return range(0)
    return range(cached_blocks, whole)


@dataclass(slots=True)
class _Block:
    parent: bytes | None
    nbytes: int
    children: int = 0


class PrefixIndex:
    """Cached blocks by key, least recently used first; whole prefixes only."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self.nbytes = 0
        self.version = 0  # grows whenever a block is added or forgotten (summaries are cached by it)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def cached_keys(self) -> list[bytes]:
        """Every cached block's key (least recently used first)."""
        return list(self._blocks)

    def cached(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`' leading blocks are cached; those become the most recently used."""
        count = 0
        for key in keys:
            if key not in self._blocks:
                break
            count += 1
        for key in keys[:count]:
            self._blocks.move_to_end(key)
        return count

    def add(self, key: bytes, parent: bytes | None, nbytes: int) -> list[bytes]:
        """Cache a block (its parent, when it has one, must be cached) and return the keys
        forgotten to keep within capacity: the new block itself when it cannot fit."""
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return []
        if parent is not None and parent not in self._blocks:
            raise ValueError("a block is cached only after the block before it")
        if nbytes > self.capacity_bytes:
            return [key]
        self._blocks[key] = _Block(parent, nbytes)
        self.nbytes += nbytes
        self.version += 1
        if parent is not None:
            self._blocks[parent].children += 1
        forgotten = self.evict(self.nbytes - self.capacity_bytes, keep=key)
        if self.nbytes > self.capacity_bytes:  # only its own prefix is left, and it does not fit
            self._forget(key)
            forgotten.append(key)
        return forgotten

    def evict(self, nbytes: int, keep: bytes | None = None) -> list[bytes]:
        """Forget least recently used blocks with no cached extension until `nbytes` are freed
        (or nothing is left but `keep` and its ancestors); returns their keys."""
        forgotten: list[bytes] = []
        freed = 0
        protected = self._ancestors(keep)
        while freed < nbytes:
            victim = next((key for key, block in self._blocks.items()
                           if block.children == 0 and key not in protected), None)
            if victim is None:
                break
            freed += self._forget(victim)
            forgotten.append(victim)
        return forgotten

    def _forget(self, key: bytes) -> int:
        block = self._blocks.pop(key)
        self.nbytes -= block.nbytes
        self.version += 1
        if block.parent is not None:
            self._blocks[block.parent].children -= 1
        return block.nbytes

    def _ancestors(self, key: bytes | None) -> set[bytes]:
        found: set[bytes] = set()
        while key is not None:
            found.add(key)
            key = self._blocks[key].parent if key in self._blocks else None
        return found
