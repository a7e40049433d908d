"""The device loop's settings (`Settings`): what `adapters.mlx.limits.engine_settings` checked and
the loaded model may still narrow (`adapters.mlx.loop_setup`). Plain values only: it must never
import mlx, trio or the device loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from statecore.prefix import MessageBlocks
from statecore.scheduling import STEP_TARGET_FLOOR_MULTIPLE

__all__ = ["Settings"]


@dataclass(frozen=True, slots=True)
class Settings:
    prefill_chunk_size: int
    kv_bits: int | None
    kv_group_size: int
    max_batch: int
    max_num_batched_tokens: int
    prefill_batch: int
    max_padding: float
    max_slot_tokens: int
    kv_memory_bytes: int  # what KV caches may take in all: the slot pool and every request's own
    decodes_locally: bool  # False on a prefill node: a prefilled cache never grows here
    shape_bucket: int  # prefill chunks and the slot lane's attended length round up to it (0: off)
    decode_attention: str  # the slot lane's attention: auto | kernel | masked | reference
    prefix_cache_bytes: int  # the prefix cache's capacity (plain KVCache models; 0: off)
    compile_decode: str = "off"  # the slot lane's model call traced per shape: auto | on | off
    preallocate_slots: bool = False  # the slot pool at its full capacity from the load on
    # Each step's prefill work capped so that the KV held and reserved plus the step's estimated
    # activations stay within kv_memory_bytes (on when --kv-memory-bytes is given).
    prefill_memory_cap: bool = False
    fuse_projections: str = "off"  # sibling projections as one matmul (adapters.mlx.fusion): auto | on | off
    keep_conversations: bool = False  # a finished request's whole chunks go into the prefix cache
    # Speculative decoding (adapters.mlx.speculative) while at most speculative_max_rows decode
    speculative: str = "off"  # off | ngram | draft
    num_draft_tokens: int = 3
    speculative_max_rows: int = 1
    # While streams decode, each step's prefill is sized to keep the step near this many ms
    # (`statecore.scheduling.step_token_budget`): None = step_target_floors times the measured
    # decode step, 0 = off (max_num_batched_tokens every step). Off on a lockstep instance: its
    # ranks must plan alike, and each would measure its own times.
    step_target_ms: float | None = None
    step_target_floors: float = STEP_TARGET_FLOOR_MULTIPLE  # None's target, in such steps
    # The prefix cache's host tier (adapters.mlx.prefix_cache): its capacity (0: off), and when a
    # host block comes back to the device rather than being computed
    prefix_host_bytes: int = 0
    prefix_host_pull: str = "auto"
    # Where a prefill block ends after an end-of-turn token (statecore.prefix.block_bounds):
    # "all": after every one but a prompt's last, in every prompt; "long": after every one, only
    # in prompts longer than a chunk (shorter ones are one call, and may share a padded call, but
    # are never reused)
    message_blocks: MessageBlocks = "all"
    # Prompts' short prefill calls of one shape as rows of one stacked call, where the load check
    # finds a row computed alike (adapters.mlx.prefill.run_stacked): auto (MLX's CUDA backend) | on | off
    prefill_stacking: str = "off"
