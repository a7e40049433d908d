"""The engine's settings, checked before anything reaches the device thread: `engine_settings`,
from `MlxEngine.load`'s arguments (`EngineOptions`, documented, defaulted and checked here). A
request's arguments are not checked here: `statecore.policy` decides what an engine takes of one
(`engine_request`, `token_ids`), which `MlxEngine` asks at its door. A refusal is a client error
(`StatecoreError` with its code). This module imports mlx only through what it calls to pick
defaults (the backend, the host's memory); it must never import trio.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

from adapters.mlx.attention import DECODE_ATTENTION_MODES
from adapters.mlx.compiled import COMPILE_MODES
from adapters.mlx.distributed import TensorGroup
from adapters.mlx.fusion import FUSION_MODES
from adapters.mlx.memory import default_kv_memory_bytes
from adapters.mlx.prefill import default_chunk_tokens, default_shape_bucket, on_cuda
from adapters.mlx.prefix_cache import HOST_PULL_MODES, default_host_bytes
from adapters.mlx.settings import Settings
from statecore.errors import StatecoreError, client_error
from statecore.prefix import MESSAGE_BLOCKS
from statecore.scheduling import STEP_TARGET_FLOOR_MULTIPLE, default_step_tokens

__all__ = [
    "PREFILL_MEMORY_CAP_MODES",
    "EngineOptions",
    "engine_settings",
]

_KV_BITS = (2, 3, 4, 5, 6, 8)
_KV_GROUP_SIZES = (32, 64, 128)
PREFILL_MEMORY_CAP_MODES = ("auto", "on", "off")  # --prefill-memory-cap


class EngineOptions(TypedDict, total=False):
    """The engine's settings as `MlxEngine.load` takes them (`**options`) and passes them on to
    `engine_settings`, where each is documented, defaulted and checked (a test holds the two to the
    same names and types)."""

    prefill_chunk_size: int | None
    kv_bits: int | None
    kv_group_size: int
    max_batch: int
    max_num_batched_tokens: int | None
    step_target_ms: float | None
    step_target_floors: float
    prefill_batch: int
    max_padding: float
    max_slot_tokens: int
    kv_memory_bytes: int | None
    device_shared_by: int
    decodes_locally: bool
    shape_bucket: int | None
    decode_attention: str
    compile_decode: str
    fuse_projections: str
    preallocate_slots: bool | None
    prefix_cache_bytes: int | None
    prefix_host_bytes: int | None
    prefix_host_pull: str
    prefill_memory_cap: str
    keep_conversations: bool
    message_blocks: str
    prefill_stacking: str
    speculative: str
    num_draft_tokens: int
    speculative_max_rows: int
    draft_model: Path | None
    tensor: TensorGroup | None


def engine_settings(
    model_dir: Path,
    *,
    prefill_chunk_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    max_batch: int = 32,
    max_num_batched_tokens: int | None = None,
    step_target_ms: float | None = None,
    step_target_floors: float = STEP_TARGET_FLOOR_MULTIPLE,
    prefill_batch: int = 32,
    max_padding: float = 0.25,
    max_slot_tokens: int = 32768,
    kv_memory_bytes: int | None = None,
    device_shared_by: int = 1,
    decodes_locally: bool = True,
    shape_bucket: int | None = None,
    decode_attention: str = "auto",
    compile_decode: str = "auto",
    fuse_projections: str = "auto",
    preallocate_slots: bool | None = None,
    prefix_cache_bytes: int | None = None,
    prefix_host_bytes: int | None = None,
    prefix_host_pull: str = "auto",
    prefill_memory_cap: str = "auto",
    keep_conversations: bool = False,
    message_blocks: str = "all",
    prefill_stacking: str = "off",
    speculative: str = "off",
    num_draft_tokens: int = 3,
    speculative_max_rows: int = 1,
    draft_model: Path | None = None,
    tensor: TensorGroup | None = None,
) -> Settings:
    """The device loop's settings from `MlxEngine.load`'s arguments, each checked (a client error
    names the first that is wrong); the defaults that depend on the host are picked here.

    Each step decodes every live request (at most `max_batch`) and prefills work units of
    waiting prompts (a chunk's layers in slices of at most `max_num_batched_tokens` -
    `max_batch` tokens' worth) until `max_num_batched_tokens` is spent, touching at most
    `prefill_batch` prompts (default budget: `max_batch` + 2,048 tokens or a whole chunk if
    larger, several chunks of a prompt per step; a smaller one, down to `max_batch` + chunk
    size / layers, slices chunks by layers). While streams decode, `step_target_ms` sizes
    each step's prefill from the rates the device loop measures of its own steps, so that a
    step stays near the target (`statecore.scheduling.step_token_budget`: at least the oldest
    prompt's next unit, at most the budget): None (default) = `step_target_floors` (default 16,
    `statecore.scheduling.STEP_TARGET_FLOOR_MULTIPLE`) times a step without prefill, 0 = off. A
    tensor- or pipeline-parallel instance runs without it (its ranks plan alike). A chunk
    (`prefill_chunk_size`, default 256; 2,048 on MLX's CUDA backend:
    `adapters.mlx.prefill.default_chunk_tokens`) is one prefill call and the prefix cache's block.
    Short prompts waiting together are prefilled in one padded call when the padding stays
    within `max_padding` of their tokens (plain KVCache models; `prefill_batch` 1 turns it
    off). `max_slot_tokens` caps one decoding row's preallocated KV (longer requests decode in
    the batch lane). `preallocate_slots` (default: on MLX's CUDA backend only)
    allocates the slot pool at its full capacity at load (it is set aside from the budget
    either way); otherwise it grows as rows need it, a copy of every row each time.

    `kv_memory_bytes` (default: `memory.default_kv_memory_bytes`) bounds every KV cache together:
    half of it at most is set aside for the slot layout; each other request reserves its
    cache's worst case (prompt, or prompt + max_tokens once it decodes outside the slots)
    before anything is allocated, and is refused (OVERLOADED, or KV_MEMORY_EXCEEDED when
    it can never fit) otherwise. `decodes_locally` False (a prefill node) reserves only a
    prompt's cache for its prefill, and sets nothing aside for a slot layout (it has none).

    `prefill_memory_cap` ("auto": on when `kv_memory_bytes` is given; "on"; "off") caps each
    step's prefill work so that the KV held and reserved now (the slot pool as allocated,
    every reservation, kept prefixes) plus the step's estimated activations
    (`statecore.scheduling.activation_bytes`: attention scores, a layer's intermediates,
    logits, a batched call's batch cache) stay within `kv_memory_bytes`: batched short
    prompts go in smaller groups, a long prompt's units wait. The oldest waiting prompt
    always advances, alone when even its next unit is over (counted); decode rows always run.

    `shape_bucket` (default: `default_shape_bucket()`, 128 on MLX's CUDA backend and 0 = off
    elsewhere) pads prefill chunks, and rounds the slot lane's attended length, up to a
    multiple of it, on plain KVCache models: the device meets a few shapes, not one per
    prompt length. Like the chunk size it changes the computation's last bits, so it is part
    of the model fingerprint.

    `decode_attention` (slot lane): "auto" runs the rows' attention in statecore's own CUDA
    kernel (`adapters.mlx.attention`: each row read in place up to its length, no mask) on
    MLX's CUDA backend when its load-time self-check passes, else MLX's masked attention;
    "kernel" requires the kernel (the load fails without it); "masked" never uses it;
    "reference" routes through the kernel's contract in plain MLX ops (any backend: tests).

    `compile_decode` (slot lane): "auto" traces the step's model call once per shape and
    replays it (`adapters.mlx.compiled`) on MLX's CUDA backend, where building the graph from
    Python is a large share of a step; "on" everywhere; "off" never.

    `fuse_projections`: "auto" (on MLX's CUDA backend) computes each layer's query, key and
    value projections, and its MLP's gate and up projections, as one matmul each
    (`adapters.mlx.fusion`): fewer kernels to launch per step; "on" everywhere; "off" never.
    Part of the fingerprint when it fuses.

    `prefix_cache_bytes` (default: a quarter of `kv_memory_bytes`; 0 = off) keeps the KV of
    whole prefill chunks (plain KVCache models) for prompts that start with the same tokens
    (`adapters.mlx.prefix_cache`): they start after the cached chunks, with the same numbers.
    The kept blocks give way to any request that needs their memory. `keep_conversations`
    (nodes that decode, with the prefix cache on) keeps a finished request's prompt and
    generated tokens' whole chunks too, computed again as prefill chunks after it ends, and a
    handed-off prompt's as it is installed (`adapters.mlx.device`): a conversation's next
    turn starts after them. `prefix_host_bytes` (default: on MLX's CUDA backend only, see
    `adapters.mlx.prefix_cache.default_host_bytes`; 0 = off; always off on a tensor- or
    pipeline-parallel instance, whose ranks must hold the same blocks) bounds a host-memory
    tier that blocks leaving the device go to; `prefix_host_pull` (auto, always, never) says
    when a prompt takes them back rather than computing them (auto: by measured rates).
    `message_blocks` ("all", "long"): a prefill block ends right after every end-of-turn token
    but a prompt's last, in a prompt of any length ("all": a system prompt shared by first turns
    shorter than a chunk is reused), or after every one in prompts longer than a chunk only
    ("long", the rule before: a shorter chat prompt is one call and may share a padded call with
    other short prompts, but nothing of it is reused). Part of the fingerprint.
    `prefill_stacking` (auto: on MLX's CUDA backend; on; off): prompts whose next prefill call
    has one shape (a burst of first turns on one cached system prompt: their last message, then
    their last token) compute it as rows of one call where the load check finds every row
    computed as its own call (`adapters.mlx.prefill.run_stacked`): fewer calls, the same bits.
    Off on a tensor- or pipeline-parallel instance and under the prefill memory cap.

    `speculative` ("off", "ngram", "draft"): while at most `speculative_max_rows` requests
    decode, each step drafts up to `num_draft_tokens` tokens per row, by prompt lookup or with
    `draft_model` (a model directory of the same vocabulary; giving one turns "off" into
    "draft"), and checks them in one verify step (`adapters.mlx.speculative`); greedy and
    seeded rows emit exactly the tokens they emit without it. It stays off (logged) where the
    load check finds that a verify step would not compute an ordinary step's numbers.
    """
    if prefill_chunk_size is None:
        prefill_chunk_size = default_chunk_tokens()
    if prefill_chunk_size < 1:
        raise StatecoreError(client_error("prefill_chunk_size must be >= 1"))
    if kv_bits is not None and kv_bits not in _KV_BITS:
        raise StatecoreError(client_error(f"kv_bits must be one of {_KV_BITS} or None"))
    if kv_group_size not in _KV_GROUP_SIZES:
        raise StatecoreError(client_error(f"kv_group_size must be one of {_KV_GROUP_SIZES}"))
    if max_batch < 1:
        raise StatecoreError(client_error("max_batch must be >= 1"))
    if prefill_batch < 1:
        raise StatecoreError(client_error("prefill_batch must be >= 1"))
    budget = (default_step_tokens(max_batch, prefill_chunk_size) if max_num_batched_tokens is None
              else max_num_batched_tokens)
    if budget <= max_batch:
        raise StatecoreError(client_error(
            f"max_num_batched_tokens ({budget}) must be more than max_batch ({max_batch}): every "
            "step decodes every row and must leave room for prefill"
        ))
    if not max_padding >= 0.0:
        raise StatecoreError(client_error("max_padding must be >= 0"))
    if max_slot_tokens < 1:
        raise StatecoreError(client_error("max_slot_tokens must be >= 1"))
    bucket = default_shape_bucket() if shape_bucket is None else shape_bucket
    if bucket < 0:
        raise StatecoreError(client_error("shape_bucket must be >= 0"))
    if decode_attention not in DECODE_ATTENTION_MODES:
        raise StatecoreError(client_error(
            f"decode_attention must be one of {', '.join(DECODE_ATTENTION_MODES)}"))
    if compile_decode not in COMPILE_MODES:
        raise StatecoreError(client_error(f"compile_decode must be one of {', '.join(COMPILE_MODES)}"))
    if fuse_projections not in FUSION_MODES:
        raise StatecoreError(client_error(
            f"fuse_projections must be one of {', '.join(FUSION_MODES)}"))
    if device_shared_by < 1:
        raise StatecoreError(client_error("device_shared_by must be >= 1"))
    memory = (default_kv_memory_bytes(model_dir, device_shared_by) if kv_memory_bytes is None
              else kv_memory_bytes)
    if memory < 1:
        raise StatecoreError(client_error("kv_memory_bytes must be >= 1"))
    prefix_bytes = memory // 4 if prefix_cache_bytes is None else prefix_cache_bytes
    if prefix_bytes < 0:
        raise StatecoreError(client_error("prefix_cache_bytes must be >= 0"))
    host_bytes = default_host_bytes(prefix_bytes) if prefix_host_bytes is None else prefix_host_bytes
    if host_bytes < 0:
        raise StatecoreError(client_error("prefix_host_bytes must be >= 0"))
    if prefix_host_pull not in HOST_PULL_MODES:
        raise StatecoreError(client_error(
            f"prefix_host_pull must be one of {', '.join(HOST_PULL_MODES)}"))
    rule = next((rule for rule in MESSAGE_BLOCKS if rule == message_blocks), None)
    if rule is None:
        raise StatecoreError(client_error(
            f"message_blocks must be one of {', '.join(MESSAGE_BLOCKS)}"))
    if prefill_stacking not in ("auto", "on", "off"):
        raise StatecoreError(client_error("prefill_stacking must be one of auto, on, off"))
    if prefill_memory_cap not in PREFILL_MEMORY_CAP_MODES:
        raise StatecoreError(client_error(
            f"prefill_memory_cap must be one of {', '.join(PREFILL_MEMORY_CAP_MODES)}"))
    capped = kv_memory_bytes is not None if prefill_memory_cap == "auto" else prefill_memory_cap == "on"
    if draft_model is not None and speculative == "off":
        speculative = "draft"
    if speculative not in ("off", "ngram", "draft"):
        raise StatecoreError(client_error("speculative must be off, ngram or draft"))
    if (speculative == "draft") != (draft_model is not None):
        raise StatecoreError(client_error(
            "speculative 'draft' needs a draft model, and a draft model needs speculative 'draft'"))
    if num_draft_tokens < 1 or speculative_max_rows < 1:
        raise StatecoreError(client_error("num_draft_tokens and speculative_max_rows must be >= 1"))
    if step_target_ms is not None and not step_target_ms >= 0:
        raise StatecoreError(client_error("step_target_ms must be >= 0 (0: off)"))
    if not step_target_floors > 0:
        raise StatecoreError(client_error("step_target_floors must be > 0"))
    settings = Settings(prefill_chunk_size, kv_bits, kv_group_size, max_batch, budget, prefill_batch,
                        max_padding, max_slot_tokens, memory, decodes_locally, bucket, decode_attention,
                        prefix_bytes, compile_decode,
                        on_cuda() if preallocate_slots is None else preallocate_slots, capped,
                        fuse_projections,
                        keep_conversations=keep_conversations and decodes_locally,
                        speculative=speculative if decodes_locally and tensor is None else "off",
                        num_draft_tokens=num_draft_tokens, speculative_max_rows=speculative_max_rows,
                        step_target_ms=0.0 if tensor is not None else step_target_ms,
                        step_target_floors=step_target_floors,
                        prefix_host_bytes=host_bytes if tensor is None else 0,
                        prefix_host_pull=prefix_host_pull, message_blocks=rule,
                        prefill_stacking=prefill_stacking if tensor is None and not capped else "off")
    return settings


# A request's arguments at the engine's door (`MlxEngine` checks each call's); a refusal is a client error.
