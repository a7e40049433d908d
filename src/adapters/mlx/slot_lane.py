"""The slot lane: rows of plain `KVCache` models, each in a preallocated slot of the pool
(`adapters.mlx.slots`), decoding in one model call a step that the device loop launches with the
rest of its step and reads back while the next is built.

Joining copies a prompt's cache into a free slot (or takes the slot a streamed handoff's pieces
were staged in: `adapters.mlx.staging`) and leaving gives the slot back: no other row's KV moves.
A row fed once takes its next input straight from the previous step's tokens on the
device (`last_tokens`). A step's call that raises while it is built changes nothing the next call
reads (each row's new key and value land at its own position), so it is built once more; if that
raises too, the rows are split in halves until each failing row stands alone and fails alone.
A step that fails on the device (when it is evaluated, after its graph and the pool's lazy writes
were built) leaves the pool's buffers unusable: its lazy writes raise again, or hold what its
failed kernels left, NaN included, which even a masked read of a free position passes on. The
buffers then start again empty (`lose`): the failed step's rows have failed already; a row that
joined since and has no token yet is written in again from its prompt's cache, kept until a step
of it is read back; any other row, and a handoff staged in the pool, fails.
This module imports mlx; it must never import trio (but for the types of `Live`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from adapters.mlx.rows import Deliveries, LaneHost, Live, rewind
from adapters.mlx.sampling import PositionSampler, SamplerMark, sample_rows
from adapters.mlx.staging import STAGED_BYTES_PER_STEP, StagedSlots
from statecore.errors import StatecoreError

__all__ = ["SlotLane", "SlotStep"]

logger = logging.getLogger("adapters.engine_mlx")


@dataclass(frozen=True, slots=True)
class SlotStep:
    """A slot step as built: its (rows,) tokens, the row of each slot (None: a free slot's
    throwaway row), the logprob arrays of the rows that asked, and every array it evaluates."""

    tokens: Any
    owners: list[Live | None]
    logprobs: dict[int, tuple[Any, ...]]
    outputs: list[Any]


@dataclass(frozen=True, slots=True)
class _Joined:
    """A row as it joined (its prompt's cache, where the row stood): kept until a step's token of
    it is read back, to write it in again if the pool's buffers are lost before."""

    live: Live
    cache: list[Any]
    prompt_tokens: int
    mark: SamplerMark


class SlotLane:
    """The slot lane's step over `loop.pool` (see the module's paragraph)."""

    def __init__(self, loop: LaneHost) -> None:
        self.loop = loop
        self.last_tokens: Any = None  # the previous step's (rows,) tokens, on the device
        self.staged = StagedSlots()  # handed-off prompts written into their slots as pieces come
        self.joined: dict[str, _Joined] = {}  # rows without a token read back yet, by request id

    def enter(self, live: Live, cache: list[Any], prompt_tokens: int, needed: int) -> None:
        """Take a free slot and copy the prompt's cache into it (or the slot its pieces were
        staged in, as they stand); a copy that raises is made once more (it writes the same
        positions again), as a failed step is computed again."""
        pool = self.loop.pool
        assert pool is not None
        staged = self.staged.adopt(live)
        if staged is not None:
            live.slot = staged.slot
            live.offset = prompt_tokens
            return
        slot = pool.take()
        try:
            try:
                pool.reserve(needed, cache)
                pool.write_prompt(slot, cache, prompt_tokens)
            except StatecoreError:
                raise
            except Exception as exc:
                self.loop.step_retries += 1
                logger.warning("copying a cache into slot %d raised (%s: %s); copying it again",
                               slot, type(exc).__name__, exc)
                pool.reserve(needed, cache)
                pool.write_prompt(slot, cache, prompt_tokens)
        except BaseException:
            pool.give_back(slot)
            raise
        live.slot = slot
        live.offset = prompt_tokens
        self.joined[live.request_id] = _Joined(live, cache, prompt_tokens, live.sampler.mark())

    def leave(self, live: Live) -> None:
        self.read_back(live)
        if live.slot is not None and self.loop.pool is not None:
            self.loop.pool.give_back(live.slot)
            live.slot = None

    def read_back(self, live: Live) -> None:
        """A token of `live` was read back (or it left): its joining cache is let go."""
        joined = self.joined.get(live.request_id)
        if joined is not None and joined.live is live:
            del self.joined[live.request_id]

    def lose(self, rows: list[Live], error: StatecoreError, deliveries: Deliveries) -> list[Live]:
        """The pool's buffers are lost (a step that wrote them failed on the device; its own rows
        have ended): they start again empty. Of `rows` (the slot rows left), one with no token
        since it joined is written in again from its prompt's cache and decodes from its first
        step as it would have; the others, and the handoffs staged in the pool, fail with
        `error`; all of them where the new buffers could not be allocated (the device out of
        memory), which leaves the pool unallocated until a request joins. Returns the rows written
        in again."""
        pool = self.loop.pool
        assert pool is not None
        allocated = pool.empty_buffers()
        if not allocated:
            logger.warning("the slot pool's buffers could not be allocated again (the device is out of "
                           "memory): its %d rows fail; the next request to join allocates them", len(rows))
        self.last_tokens = None
        failing = self.staged.lose(error)
        again: list[Live] = []
        for live in rows:
            joined = self.joined.get(live.request_id)
            if (not allocated or live in failing or joined is None or joined.live is not live
                    or live.slot is None):
                failing.append(live)
                continue
            try:
                pool.write_prompt(live.slot, joined.cache, joined.prompt_tokens)
            except Exception:
                logger.exception("writing %s's prompt into its slot again raised", live.request_id)
                failing.append(live)
                continue
            live.offset, live.fed = joined.prompt_tokens, False
            live.sampler.reset(joined.mark)
            again.append(live)
        for live in dict.fromkeys(failing):
            self.loop.end(live, error, deliveries)
        return again

    def prepare_join(self, slot: int, prompt_tokens: int, live: Iterable[Live]) -> None:
        """Trace now the shape of the step a request joining on `slot` after a prompt of
        `prompt_tokens` will take beside the `live` rows in slots (`CompiledSlotStep.prepare`),
        rather than on the step it joins."""
        compiled, pool = self.loop.compiled, self.loop.pool
        if compiled is None or pool is None:
            return
        placed = [(row.slot, row.offset) for row in live if row.slot is not None]
        try:
            compiled.prepare(pool.rows([slot, *(taken for taken, _ in placed)]),
                             max([prompt_tokens, *(offset for _, offset in placed)]))
        except Exception:  # the step that meets the shape traces it, and answers for what raises
            logger.debug("tracing a coming join's step ahead failed", exc_info=True)

    def build(self, rows: list[Live]) -> SlotStep:
        """Every slot row's token in one model call (built, not evaluated)."""
        loop, pool = self.loop, self.loop.pool
        assert pool is not None
        if self.staged:
            # One step's share of the pieces staged meanwhile; all of them when no row but those
            # waiting for them would decode (nobody else's step to stretch).
            alone = all(live.staging for live in rows)
            self.staged.write_some(pool, None if alone else STAGED_BYTES_PER_STEP)
            rows = [live for live in rows if not live.staging]
        count = pool.rows([live.slot for live in rows if live.slot is not None])
        if loop.compiled is not None:
            count = loop.compiled.rows(count)
        inputs = self.inputs(rows, count)
        marks = [live.sampler.mark() for live in rows]
        try:
            tokens = loop.twice(lambda: self.call(rows, inputs, count), lambda: rewind(rows, marks),
                                f"a decode step of {len(rows)} rows")
        except Exception:
            tokens, rows = self.isolate(rows, inputs, count)
        owners: list[Live | None] = [None] * count
        logprobs: dict[int, tuple[Any, ...]] = {}
        for live in rows:
            assert live.slot is not None
            owners[live.slot] = live
            live.fed = True
            live.offset += 1
            picked = live.sampler.take_logprobs()
            if picked is not None:
                logprobs[live.slot] = picked
        self.last_tokens = tokens
        arrays = [array for picked in logprobs.values() for array in picked]
        return SlotStep(tokens, owners, logprobs, [tokens, *arrays, *pool.keys, *pool.values])

    def inputs(self, rows: list[Live], count: int) -> Any:
        """The (count,) input tokens of a slot step: a row fed before takes the previous step's
        token straight from the device; a new row (or one after a reset) its host token."""
        host_tokens = [0] * count
        from_host = [True] * count
        previous = self.last_tokens
        carried = 0 if previous is None else int(previous.shape[0])
        for live in rows:
            slot = live.slot
            assert slot is not None
            if live.fed and slot < carried:
                from_host[slot] = False
            else:
                host_tokens[slot] = live.last_token
        inputs = mx.array(host_tokens, dtype=mx.uint32)
        if all(from_host):
            return inputs
        if carried >= count:
            on_device = previous[:count]
        else:
            on_device = mx.concatenate([previous, mx.zeros((count - carried,), dtype=previous.dtype)])
        return mx.where(mx.array(from_host), inputs, on_device.astype(mx.uint32))

    def call(self, rows: list[Live], inputs: Any, count: int, only: Any = None) -> Any:
        """Build one model call over the first `count` slots and return its (count,) sampled
        tokens (free slots in that range compute a throwaway row at position 0); or, given
        `only` (an array of `rows`' slots), over just those rows, in that order."""
        loop, pool = self.loop, self.loop.pool
        assert pool is not None
        loop.computing = ("decode", [live.request_id for live in rows])
        if only is None:
            by_slot = [""] * count  # the call's rows are the first `count` slots ("": computed for nothing)
            for live in rows:
                assert live.slot is not None
                by_slot[live.slot] = live.request_id
            loop.computing = ("decode", by_slot)
            offsets = [0] * count
            self.staged.throwaway_offsets(offsets)
            samplers: list[PositionSampler | None] = [None] * count
            for live in rows:
                assert live.slot is not None
                offsets[live.slot] = live.offset
                samplers[live.slot] = None if live.sampler.plain_greedy else live.sampler
            if loop.compiled is not None:
                return sample_rows(loop.compiled(inputs, offsets), samplers)
            layers, step_inputs = pool.step_layers(offsets, bucket=loop.bucket), inputs
        else:
            slots = [live.slot for live in rows if live.slot is not None]
            samplers = [None if live.sampler.plain_greedy else live.sampler for live in rows]
            layers = pool.step_layers([live.offset for live in rows], slots, bucket=loop.bucket)
            step_inputs = inputs[only]
        logits = loop.model(step_inputs[:, None], cache=layers)[:, -1, :]
        return sample_rows(logits, samplers)

    def isolate(self, rows: list[Live], inputs: Any, count: int) -> tuple[Any, list[Live]]:
        """Compute the step in ever smaller groups of rows; a row whose call raises alone, twice,
        fails. Returns the (count,) tokens of the rows that computed, and those rows."""
        loop = self.loop
        tokens = mx.zeros((count,), dtype=mx.uint32)
        survivors: list[Live] = []
        culprits: list[tuple[Live, Exception]] = []
        groups = [rows[: len(rows) // 2], rows[len(rows) // 2 :]] if len(rows) > 1 else [rows]
        tried_alone: set[str] = set()
        while groups:
            group = groups.pop()
            if not group:
                continue
            marks = [live.sampler.mark() for live in group]
            try:
                where = mx.array([live.slot for live in group], dtype=mx.int32)
                tokens[where] = self.call(group, inputs, count, only=where).astype(mx.uint32)
            except Exception as exc:
                rewind(group, marks)
                if len(group) == 1 and group[0].request_id not in tried_alone:
                    # Alone for the first time: a transient error gets its second chance here too.
                    tried_alone.add(group[0].request_id)
                    loop.step_retries += 1
                    groups.append(group)
                elif len(group) == 1:
                    culprits.append((group[0], exc))
                else:
                    groups += [group[: len(group) // 2], group[len(group) // 2 :]]
            else:
                survivors.extend(group)
        deliveries: Deliveries = {}
        for live, raised in culprits:
            loop.fail_alone(live, raised, deliveries)
        loop.hand_out(deliveries)
        return tokens, survivors
