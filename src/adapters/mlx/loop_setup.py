"""Setting the device loop up for a loaded model (`configure`): the slot pool and its attention
where the model's cache is plain KVCache and it decodes here, the shape bucket, the prefix cache,
speculation, the test hook in every model call, and the checks of the step budget and the KV
budget against the model's shape (a budget that cannot hold one layer of a chunk is refused; one
whose whole chunk's activations will overrun it is warned of). The load
(`adapters.mlx.load_on_device`) calls it once, on the device thread. This module imports mlx; it must
never import trio.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import mlx.core as mx

from adapters.mlx.attention import AttentionChoice, choose_attention
from adapters.mlx.compiled import CompiledSlotStep
from adapters.mlx.device import DeviceLoop
from adapters.mlx.lora_rows import AdapterRows, AdapterSet
from adapters.mlx.memory import KvCost, model_shape
from adapters.mlx.prefill import enabled_on_cuda, mark_inner_points, stack_row_counts
from adapters.mlx.prefix_cache import PrefixCache
from adapters.mlx.slots import SlotPool
from adapters.mlx.speculative import Speculator
from statecore.engine_schedule import Stacking
from statecore.errors import StatecoreError, client_error
from statecore.scheduling import activation_bytes, bucketed

__all__ = ["configure", "slot_attention"]

logger = logging.getLogger("adapters.engine_mlx")

_MIN_SLOT_TOKENS = 64  # below this a slot pool is not worth having: rows decode in the batch lane
_STACK_TOKENS = 128  # the longest prefill call (padded) that may be a row of a stacked call
_STACK_MOST_ROWS = 64  # ... and the most rows a stacked call has (the load check is quadratic in it)


class _CheckedModel:
    """The model with the test hook in its call (only when a test armed one, e.g. `--inject-fault
    decode_call_once`): the hook sees the call's stage ("prefill" or "decode") and the requests
    it computes, and may raise from inside the call."""

    def __init__(self, model: Any, loop: DeviceLoop) -> None:
        self._model = model
        self._loop = loop

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hook = self._loop.model_call_hook
        if hook is not None:
            hook(*self._loop.computing)
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def configure(loop: DeviceLoop, model: Any, eos: frozenset[int], vocab_size: int, context_length: int,
              probe_cache: list[Any], cost: KvCost, adapters: AdapterSet | None = None) -> None:
    """Set `loop` up for a loaded model: its lanes (a slot pool where the model's cache is plain
    KVCache and it decodes here), its prefix cache, speculation, and the checks of its budgets
    against the model's shape. With `adapters` (`--adapters`) every model call tells the adapters'
    projections which rows take which adapter (`AdapterRows`); the traced slot step, which would
    not, is off."""
    s = loop.settings
    loop.model = model if loop.model_call_hook is None else _CheckedModel(model, loop)
    if adapters is not None:
        if s.prefix_cache_bytes or s.keep_conversations:
            raise StatecoreError(client_error("--adapters is served without the prefix cache"))
        loop.model = AdapterRows(loop.model, adapters, lambda: loop.computing,
                                 lambda request_id: _adapter_of(loop, request_id))
    loop.eos = eos
    loop.vocab_size = vocab_size
    loop.context_length = context_length
    loop.cost = cost
    loop.layers = len(probe_cache)
    # Under a step-time target a unit may stop inside a layer (a layer of a chunk can outlast a
    # decode step on a CPU): the model's layers hand out those points as a chunk's call is built.
    loop.inner_points = mark_inner_points(model, loop.layers) if loop.timed_units else 0
    loop.shape = model_shape(model, vocab_size, probe_cache)
    one_layer = -(-s.prefill_chunk_size // loop.layers)
    if one_layer > loop.step_room:
        raise StatecoreError(client_error(
            f"max_num_batched_tokens ({s.max_num_batched_tokens}) must be at least max_batch + "
            f"prefill_chunk_size / layers ({s.max_batch} + {one_layer}): a step evaluates at "
            "least one layer of a chunk"))
    if loop.pipelined:
        # A rank's layers wait on the previous rank's inside one model call: a step evaluates
        # a whole chunk or nothing of it. Estimated activations would differ from rank to
        # rank (their layers do), so no prefill is capped by them.
        if s.prefill_chunk_size > loop.step_room:
            raise StatecoreError(client_error(
                f"a pipeline-parallel instance computes a whole prefill chunk per step: "
                f"max_num_batched_tokens ({s.max_num_batched_tokens}) must be at least max_batch "
                f"+ prefill_chunk_size ({s.max_batch} + {s.prefill_chunk_size})"))
        s = loop.settings = dataclasses.replace(s, prefill_memory_cap=False)
    plain = loop.plain(probe_cache)
    # A chat message ends with an end-of-turn token: a prefill block ends there too, so that
    # prompts sharing a system prompt or a document share every block of it (statecore.prefix).
    # Only where blocks can be kept (plain KVCache): other caches' bits follow every cut.
    loop.block_ends = eos if plain else frozenset()
    # In a prompt shorter than a chunk too (a first turn on a shared system prompt), unless
    # message_blocks is "long": such a prompt is then one call, batchable, never reused.
    loop.message_blocks = s.message_blocks
    loop.short_batching = plain and s.prefill_batch > 1
    # Padding a chunk needs caches that can be trimmed back exactly: plain KVCache layers.
    loop.bucket = s.shape_bucket if plain else 0
    if plain and s.prefill_batch > 1 and enabled_on_cuda(s.prefill_stacking):
        # Which row counts compute a row as its own call does (prefill.stack_row_counts): only
        # those stack, so a stacked prompt's calls are still a cache-less run's to the bit.
        tokens = max(loop.bucket, _STACK_TOKENS)
        most = min(s.prefill_batch, _STACK_MOST_ROWS)
        counts, one_token, classes, one_token_classes = stack_row_counts(model, most, tokens, vocab_size)
        loop.stacking = Stacking(counts, tokens, one_token) if counts or one_token else None
        logger.info("stacked prefill calls: row counts computing a row as alone, of 2..%d: %s for calls "
                    "of 2..%d tokens, %s for one-token calls (each count's class of counts computing "
                    "alike: %s; one token: %s)", most, list(counts) or "none", tokens,
                    list(one_token) or "none", list(classes), list(one_token_classes))
    if plain and s.decodes_locally:
        # The pool may grow to half the KV budget at most; that half is set aside for it. A
        # prefill node never decodes a client's request: it keeps the whole budget for prompts.
        fitting = (s.kv_memory_bytes // 2) // max(1, s.max_batch * cost.slot_per_token)
        capacity = min(context_length, s.max_slot_tokens) + 1
        if fitting < min(capacity, _MIN_SLOT_TOKENS):
            logger.warning("a KV budget of %d bytes leaves no room for the slot layout; "
                           "decoding in the batch lane", s.kv_memory_bytes)
        else:
            capacity = min(capacity, fitting)
            loop.pool = SlotPool(s.max_batch, len(probe_cache), capacity)
            loop.pool_reserved = s.max_batch * capacity * cost.slot_per_token
            choice = slot_attention(s.decode_attention, model, probe_cache)
            loop.pool.attention, loop.pool.exact_rows, loop.attention = choice
            if s.preallocate_slots:
                # Set aside from the budget anyway; allocated now, it never grows (a copy of
                # every row, and on the GPU new shapes) while streams decode.
                loop.pool.reserve(capacity, probe_cache)
                mx.eval(loop.pool.keys, loop.pool.values)
            # (a traced CPU step builds C++ per kernel; a traced step would not tell rows' adapters,
            # nor attend each row over its own length: its lengths are not known when it is traced)
            if enabled_on_cuda(s.compile_decode) and adapters is None and not choice.exact_rows:
                loop.compiled = CompiledSlotStep(model, loop.pool, loop.bucket, loop.call_hook)
    loop.slot_lane = loop.pool is not None
    loop.streams_ranges = plain  # a streamed handoff's cache can go in token and layer ranges
    if plain and s.prefix_cache_bytes > 0:
        loop.prefix = PrefixCache(s.prefill_chunk_size, s.prefix_cache_bytes, s.prefix_host_bytes,
                                  s.prefix_host_pull, room=loop.admission.prefix_room,
                                  prefill_token_s=lambda: loop.rates.prefill_token_s, ends=loop.block_ends,
                                  rule=loop.message_blocks)
    if s.speculative != "off":
        loop.speculator = Speculator(s.speculative, s.num_draft_tokens, s.speculative_max_rows,
                                     loop.draft_model)
        loop.speculator.measure(loop)
    if s.prefill_memory_cap:
        # Even on an idle node a whole chunk has beside it only the budget less the slot pool
        # as allocated now and its own prompt's KV: over that, every such chunk overruns.
        whole = bucketed(s.prefill_chunk_size, loop.bucket)
        chunk = activation_bytes(loop.shape, 1, whole, whole)
        room = s.kv_memory_bytes - (0 if loop.pool is None else loop.pool.nbytes) - cost.of(whole)
        if chunk > room:
            logger.warning(
                "one whole prefill chunk's activations are estimated at %d bytes, more than the "
                "%d bytes the KV budget (%d) leaves beside it even on an idle node: every "
                "prompt of %d tokens or more will overrun the budget (engine_activation_overruns); "
                "a smaller --prefill-chunk-size bounds it (a chunk's attention scores grow with "
                "its size times the positions it attends)",
                chunk, max(0, room), s.kv_memory_bytes, s.prefill_chunk_size)


def _adapter_of(loop: DeviceLoop, request_id: str) -> str | None:
    record = loop.requests.get(request_id)
    sampling = None if record is None else record.sampling
    return None if sampling is None else sampling.adapter


def slot_attention(mode: str, model: Any, probe_cache: list[Any]) -> AttentionChoice:
    """The slot lane's decode attention for this model (`adapters.mlx.attention.choose_attention`)."""
    _, kv_heads, _, dim = probe_cache[0].keys.shape
    query_heads = getattr(getattr(model, "args", None), "num_attention_heads", None) or kv_heads
    try:
        return choose_attention(mode, query_heads, kv_heads, dim,
                                probe_cache[0].keys.dtype)
    except ValueError as exc:
        raise StatecoreError(client_error(str(exc))) from exc
