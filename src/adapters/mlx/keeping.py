"""Prefix keeping on the device thread: what goes into the prefix cache (`adapters.mlx.prefix_cache`)
and where a prompt starts from it.

A prompt's whole chunks are kept as they are built (`keep_chunk`); a new prompt whose leading
chunks are cached starts after them (`touch_prefix` before its admission, then
`start_from_prefix`), and looks again whenever it is about to start a block (`look_again`:
prompts that came together with one system prompt or document skip what another has built
since; the scheduler holds back one whose next block another is computing,
`statecore.engine_schedule.block_waits`).
Conversations (`Settings.keep_conversations`, decode and single nodes with a prefix cache): a
request that ends normally leaves a *keep task* behind, a prefill task without a first token
over its prompt and generated tokens' whole chunks, started from the cached ones
(`statecore.prefix.conversation_blocks`): it computes the chunks after the prompt's kept blocks
as any prompt would and keeps them, so the next turn finds the whole conversation cached with
the numbers a cache-less prefill of it gives. It gives way to requests: scheduled after every
waiting prompt, under a step-time target given only the room the target leaves beside streams
(`statecore.scheduling.step_token_budget`'s optional work: on the CPU mostly idle capacity), and,
though it reserves its KV like one, dropped when admission needs the memory. A handed-off
prompt's whole chunks are kept as they are installed (the prefill node computed the same calls:
same fingerprint, chunk size and bucket; after its first step is read back, `keep_joined`), and
another node's kept blocks as they are imported. This module imports mlx; it
must never import trio, and sees the device loop only as a `KeepingHost`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import mlx.core as mx

from adapters.mlx.memory import KvCost
from adapters.mlx.prefill import PrefillTask
from adapters.mlx.prefix_cache import PrefixCache
from adapters.mlx.requests import EngineRequest, RequestTable
from adapters.mlx.rows import Live
from adapters.mlx.sampling import PositionSampler
from adapters.mlx.settings import Settings
from adapters.mlx.slots import SlotPool
from adapters.mlx.staging import slot_views
from effects.engine_port import SamplingParams
from statecore.engine_schedule import EnginePhase, Finish
from statecore.prefix import (
    MessageBlocks,
    block_bounds,
    conversation_block_bounds,
    conversation_block_range,
    prompt_chunks,
)
from statecore.scheduling import KvAdmission, kv_admission, prefill_units

__all__ = ["KeepingHost", "PrefixKeeping"]

logger = logging.getLogger("adapters.engine_mlx")

_KEEP_AFTER = 1 << 40  # keep tasks queue after every prompt (the scheduler takes the oldest first)


class KeepingHost(Protocol):
    """What prefix keeping needs of the device loop."""

    settings: Settings
    model: Any
    pool: SlotPool | None
    prefix: PrefixCache | None
    requests: RequestTable
    waiting: Mapping[str, PrefillTask]
    cost: KvCost
    pool_reserved: int
    arrivals: int
    layers: int
    inner_points: int  # points inside a layer a unit may stop at (`prefill_units`)
    block_ends: frozenset[int]  # after these tokens a prefill block ends early (statecore.prefix)
    message_blocks: MessageBlocks  # ... by this rule

    @property
    def unit_tokens(self) -> int: ...

    def plain(self, cache: list[Any]) -> bool: ...


class PrefixKeeping:
    """A device loop's keeping of prefixes (see the module's paragraph)."""

    def __init__(self, loop: KeepingHost) -> None:
        self.loop = loop
        self.conversations_kept = 0  # finished requests whose conversation's chunks were kept
        self.conversation_tokens_kept = 0  # tokens of whole chunks those keep tasks computed
        # Rows whose first token was counted while a handed-off prompt's chunks wait to be kept
        # (`keep_due`, once the step is done)
        self.due: list[Live] = []

    def keep_chunk(self, task: PrefillTask, chunk: int) -> list[Any]:
        """A whole chunk just built: into the prefix cache."""
        prefix = self.loop.prefix
        assert prefix is not None and task.cache is not None
        start = task.chunk_start(chunk)
        return prefix.keep(task.block_keys, chunk, task.cache, start, start + task.chunks[chunk])

    def forget_prefixes(self) -> None:
        """Empty the prefix cache, counters included (after the load's warm-up request)."""
        self.drop_keep_tasks()
        self.conversations_kept = self.conversation_tokens_kept = 0
        if self.loop.prefix is not None:
            self.loop.prefix = self.loop.prefix.emptied()

    def keep_conversation(self, live: Live) -> None:
        """A request ended normally: queue the keep task of its conversation's whole chunks (when
        its prompt's blocks are cached and the memory is free now; else nothing is kept)."""
        loop = self.loop
        prefix, conversation = loop.prefix, live.conversation
        if prefix is None or conversation is None:
            return
        chunk, ends = loop.settings.prefill_chunk_size, loop.block_ends
        bounds = conversation_block_bounds(conversation, chunk, ends)
        keys = prefix.conversation_keys_of(conversation)
        cached = prefix.index.cached(keys)
        # The prompt's own blocks, as far as they are the conversation's (they part where the
        # prompt's last message end, no block's end in the prompt, is one in the conversation)
        own_blocks = 0
        for own, kept_as in zip(block_bounds(conversation[: live.prompt_tokens], chunk, ends,
                                             rule=loop.message_blocks), bounds, strict=False):
            if own != kept_as:
                break
            own_blocks += 1
        blocks = conversation_block_range(own_blocks, len(bounds), cached)
        keep_id = f"{live.request_id}#keep"
        if not blocks or keep_id in loop.waiting:
            return
        tokens = conversation[: bounds[blocks.stop - 1]]
        need = loop.cost.of(len(tokens))
        fits = kv_admission(need, loop.requests.reserved_bytes + prefix.nbytes, loop.pool_reserved,
                            loop.settings.kv_memory_bytes)
        if fits is not KvAdmission.FITS:
            return
        chunks = tuple(end - start for start, end in zip([0, *bounds], bounds[: blocks.stop], strict=False))
        loop.arrivals += 1
        sampler = PositionSampler(SamplingParams(max_tokens=1), 0, len(tokens), tokens)
        units = prefill_units(chunks, loop.layers, loop.unit_tokens, loop.inner_points)
        task = PrefillTask(keep_id, tokens, sampler, _KEEP_AFTER + loop.arrivals, chunks, units,
                           keeps_only=True)
        task.block_keys = keys[: blocks.stop]
        count, cache = prefix.start(task.block_keys, counted=False)
        if cache is not None:
            task.cache = cache
            task.done_tokens = task.cached_tokens = cache[0].offset
            task.done_units = next(i for i, unit in enumerate(task.units) if unit.chunk == count)
        loop.requests.add(EngineRequest(keep_id, EnginePhase.KEEPING, reserved=need, task=task))

    def kept(self, task: PrefillTask) -> None:
        """A keep task done: its conversation's chunks are in the prefix cache. Counted now, not
        when it was queued: a queued one gives way to admission or waits for the capacity the
        streams leave, and may never compute."""
        self.conversations_kept += 1
        self.conversation_tokens_kept += len(task.tokens) - task.cached_tokens

    def drop_keep_tasks(self) -> bool:
        """Forget every keep task not yet done (admission needs their memory); whether any was."""
        dropped = [rid for rid, task in self.loop.waiting.items() if task.keeps_only]
        for rid in dropped:
            self.loop.requests.remove(rid, Finish.GAVE_WAY)
        return bool(dropped)

    def keep_installed(self, tokens: Sequence[int], cache: list[Any]) -> None:
        """A handed-off prompt's whole chunks into the prefix cache, as they arrived. Only prompts
        of more than two calls (a block, then more before the last token): a prefill node may
        compute one of a call and the last token in a padded batch, whose numbers are not the
        chunk call's."""
        prefix, loop = self.loop.prefix, self.loop
        chunk = loop.settings.prefill_chunk_size
        if prefix is None or not loop.settings.keep_conversations:
            return
        if len(prompt_chunks(tokens, chunk, loop.block_ends, rule=loop.message_blocks)) <= 2:
            return
        if not self.loop.plain(cache):
            return
        keys = prefix.keys_of(tokens)
        bounds = block_bounds(tokens, chunk, loop.block_ends, rule=loop.message_blocks)
        kept: list[Any] = []
        for index, (start, end) in enumerate(zip([0, *bounds], bounds, strict=False)):
            kept.extend(prefix.keep(keys, index, cache, start, end))
        if kept:
            mx.eval(kept)  # copies now: the installed cache itself goes on into a slot

    def keep_due(self) -> None:
        """After a step: the handed-off prompts whose first token it counted are kept (outside the
        step, whose time the step-time target measures: a decode step that carried a copy would
        raise its floor)."""
        due, self.due = self.due, []
        for live in due:
            self.keep_joined(live)

    def keep_joined(self, live: Live) -> None:
        """A handed-off prompt's whole chunks into the prefix cache (`keep_installed`), after its
        first step rather than on the step it joins, where the copy (5-17 ms for 2,000 tokens of
        the 23 M llama on the CPU) came before its second token. A slot row's are read from its
        slot, whose prompt positions no step writes. Keeping is a saving, never a request's fate:
        a copy that raises is logged and nothing is kept."""
        loop = self.loop
        pending, live.keep_prompt = live.keep_prompt, None
        if pending is None or loop.model is None:
            return
        tokens, cache = pending
        try:
            if cache is None:
                assert loop.pool is not None and live.slot is not None
                cache = slot_views(loop.pool, live.slot, len(tokens))
            self.keep_installed(tokens, cache)
        except Exception:
            logger.exception("keeping the handed-off prompt of %s raised; not kept", live.request_id)

    def keep_imported(self, tokens: Sequence[int], cache: list[Any]) -> int:
        """Another node's prefix-cache blocks covering `tokens` (whole chunks, computed as chunks
        there: the same fingerprint) into this prefix cache; the leading tokens now cached. Unlike
        `keep_installed` it needs neither a long prompt nor `keep_conversations`: these are kept
        blocks, never a padded batch's numbers."""
        prefix = self.loop.prefix
        if prefix is None or not self.loop.plain(cache):
            return 0
        keys = prefix.conversation_keys_of(tokens)
        bounds = conversation_block_bounds(tokens, prefix.chunk_size, prefix.ends)
        kept: list[Any] = []
        for index, (start, end) in enumerate(zip([0, *bounds], bounds, strict=False)):
            kept.extend(prefix.keep(keys, index, cache, start, end))
        if kept:
            mx.eval(kept)  # copies now, so the imported cache can go
        count = prefix.index.cached(keys)
        return bounds[count - 1] if count else 0

    def touch_prefix(self, tokens: Sequence[int]) -> list[bytes]:
        """The prompt's block keys, its cached leading blocks made the most recently used: called
        before its admission, whose eviction then takes other prompts' blocks before its own."""
        prefix = self.loop.prefix
        if prefix is None:
            return []
        keys = prefix.keys_of(tokens)
        prefix.index.cached(keys)
        return keys

    def start_from_prefix(self, task: PrefillTask, keys: list[bytes], again: bool = False) -> None:
        """A new prompt whose first whole chunks are cached starts after them (`keys`: its block
        keys, from `touch_prefix`). `again`: a prompt that found none at arrival and has not
        started, looked up once more as its first unit is built: a prompt that came with others
        starting the same way (a shared system prompt) finds the blocks the first of them has
        computed since, in an earlier step or earlier in this one."""
        prefix = self.loop.prefix
        if prefix is None:
            return
        task.block_keys = keys
        count, cache = prefix.start(task.block_keys, again=again)
        if cache is None:
            return
        task.cache = cache
        task.done_tokens = task.cached_tokens = cache[0].offset
        task.done_units = next(i for i, unit in enumerate(task.units) if unit.chunk == count)

    def look_again(self, task: PrefillTask) -> bool:
        """A prompt about to start a block looks again: prompts that came together with one
        system prompt or document start after the blocks the first of them has built since, and
        one that is part-way through its prompt skips the blocks another has kept meanwhile (its
        own chunks are the same calls, so a cache of kept blocks holds its own numbers). Whether
        it is further along now."""
        if not task.block_keys or task.retried or task.keeps_only or task.finished:
            return False
        unit = task.units[task.done_units]
        if not unit.starts_chunk or unit.chunk >= len(task.block_keys):
            return False  # inside a block (its layers' slices), or past the kept ones
        if not task.done_units:
            self.start_from_prefix(task, task.block_keys, again=True)
            return task.done_units > 0
        prefix = self.loop.prefix
        if prefix is None or prefix.index.cached(task.block_keys) <= unit.chunk:
            return False
        count, cache = prefix.start(task.block_keys, again=True, already=task.done_tokens,
                                    hit_before=task.cached_tokens > 0)
        assert cache is not None and count > unit.chunk
        task.cache = cache
        task.done_tokens = cache[0].offset
        task.cached_tokens += task.done_tokens - task.chunk_start(unit.chunk)
        task.done_units = next(i for i, later in enumerate(task.units) if later.chunk == count)
        return True
