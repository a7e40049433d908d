"""The prefix cache's host tier on a tiny real checkpoint (CPU: the tier is off by default there,
turned on explicitly): blocks evicted from the device go to the bounded host pool, and a prompt
that finds them there takes them back and gives, to the bit, a cache-less engine's first token,
held KV and tokens, greedy and seeded. With `never`, the same prompt computes them instead (same
numbers). The host pool's bytes stay within its capacity and are reported; off by default on
the CPU backend (unified memory: the host is the device).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from adapters.mlx import MlxEngine
from adapters.mlx.prefix_cache import to_device, to_host
from effects.engine_port import SamplingParams
from statecore.ids import RequestId
from support.tiny_models import cached_checkpoint
from tests.integration.engines import load_into, opened_engines, served_whole

CHUNK = 16
GREEDY = SamplingParams(max_tokens=10)
SEEDED = SamplingParams(max_tokens=10, temperature=1.0, top_k=40, seed=11)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(5 * i + 1 + 13 * salt) % 500 + 2 for i in range(n)]


@pytest.fixture
async def engines() -> AsyncIterator[list[MlxEngine]]:
    async with opened_engines() as opened:
        yield opened


async def load(opened: list[MlxEngine], path: Path, **kw: Any) -> MlxEngine:
    return await load_into(opened, path, prefill_chunk_size=CHUNK, **kw)


served = served_whole


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_blocks_evicted_to_the_host_come_back_and_give_a_cache_less_engine_s_numbers(
    engines: list[MlxEngine], sampling: SamplingParams
) -> None:
    path = cached_checkpoint("llama")
    fresh = await load(engines, path, prefix_cache_bytes=0)
    block = 2 * CHUNK * fresh._device.cost.per_token  # generous: one block's keys and values
    tiered = await load(engines, path, prefix_cache_bytes=8 * block, prefix_host_bytes=8 * block,
                        prefix_host_pull="always")
    document = prompt_of(4 * CHUNK + 5)  # four whole blocks before its last token
    await served(tiered, "first", document, sampling)
    stats = tiered.statistics()
    assert stats.prefix_cache_bytes > 0 and stats.prefix_host_bytes == 0
    assert stats.prefix_host_capacity_bytes == 8 * block

    kept = stats.prefix_cache_bytes
    assert await tiered.evict_prefixes(kept) == kept  # admission's way out: every block to the host
    stats = tiered.statistics()
    assert stats.prefix_cache_bytes == 0 and stats.prefix_host_bytes == kept
    assert stats.prefix_host_out == 4

    question = [*document[: 4 * CHUNK], *prompt_of(9, salt=3)]  # the document resent, a new question
    back = await served(tiered, "again", question, sampling)
    alone = await served(fresh, "again", question, sampling)
    assert back[1] == 4 * CHUNK and alone[1] == 0
    assert back[0] == alone[0] and back[3] == alone[3]
    assert back[2] == alone[2]  # the held KV: the same bytes to the bit
    stats = tiered.statistics()
    assert stats.prefix_host_back == 4 and stats.prefix_host_bytes == 0  # in one tier at a time
    assert stats.prefix_cache_bytes == kept


async def test_never_computes_host_blocks_again_and_the_pool_stays_within_its_capacity(
    engines: list[MlxEngine]
) -> None:
    path = cached_checkpoint("llama")
    fresh = await load(engines, path, prefix_cache_bytes=0)
    per_block = 2 * CHUNK * fresh._device.cost.per_token
    capacity = 3 * per_block  # fewer blocks than two documents have
    tiered = await load(engines, path, prefix_cache_bytes=8 * per_block, prefix_host_bytes=capacity,
                        prefix_host_pull="never")
    assert fresh.statistics().prefix_host_capacity_bytes == 0  # off by default on the CPU backend
    first, second = prompt_of(4 * CHUNK + 3, salt=1), prompt_of(4 * CHUNK + 3, salt=2)
    for rid, prompt in (("a", first), ("b", second)):
        await served(tiered, rid, prompt, GREEDY)
        await tiered.evict_prefixes(tiered.statistics().prefix_cache_bytes)
        stats = tiered.statistics()
        assert 0 < stats.prefix_host_bytes <= capacity
    assert tiered.statistics().prefix_host_forgotten > 0  # the second document pushed the first out
    computed = await served(tiered, "c", second, GREEDY)
    alone = await served(fresh, "c", second, GREEDY)
    assert computed[1] == 0 and computed[2:] == alone[2:]
    stats = tiered.statistics()
    assert stats.prefix_host_back == 0
    # what was computed again is on the device, and its host copies gave way to it
    prefix = tiered._device.prefix
    assert prefix is not None and stats.prefix_cache_bytes > 0 and stats.prefix_host_bytes <= capacity
    assert not set(prefix.index.device_keys()) & set(prefix.index.host_keys())


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_a_block_s_bytes_survive_the_trip_to_the_host_and_back(dtype: mx.Dtype) -> None:
    array = (mx.arange(2 * 3 * 16 * 8, dtype=mx.float32).reshape(2, 3, 16, 8) / 7).astype(dtype)
    back = to_device(to_host(array))
    assert back.dtype == dtype and back.shape == array.shape
    assert back.view(mx.uint8).tolist() == array.view(mx.uint8).tolist()


async def test_blocks_come_back_only_into_the_memory_kv_admission_leaves(engines: list[MlxEngine]) -> None:
    """A prefill node (no slot pool) holding one prompt's cache for its handoff: a second prompt
    finds its document's four blocks in the host pool but the budget, less both reservations,
    leaves room for two and a half: two come back, the other two are computed (the same bits)."""
    path = cached_checkpoint("llama")
    fresh = await load(engines, path, prefix_cache_bytes=0)
    probe = await load(engines, path, prefix_cache_bytes=1 << 30, decodes_locally=False)
    document = prompt_of(4 * CHUNK + 5)
    await probe.prefill(RequestId("measure"), document, GREEDY)
    await probe.release_held(RequestId("measure"))
    block = probe.statistics().prefix_cache_bytes // 4
    other, question = prompt_of(4 * CHUNK + 5, salt=9), [*document[: 4 * CHUNK], *prompt_of(9, salt=3)]
    cost = probe._device.cost
    budget = cost.of(len(other)) + cost.of(len(question)) + 2 * block + block // 2
    tiered = await load(engines, path, prefix_cache_bytes=8 * block, prefix_host_bytes=16 * block,
                        prefix_host_pull="always", decodes_locally=False, kv_memory_bytes=budget,
                        prefill_memory_cap="off")
    assert tiered._device.pool_reserved == 0
    await tiered.prefill(RequestId("document"), document, GREEDY)
    await tiered.release_held(RequestId("document"))
    await tiered.prefill(RequestId("other"), other, GREEDY)  # held: its reservation stays
    await tiered.evict_prefixes(budget)  # every kept block into the host pool
    assert tiered.statistics().prefix_host_bytes == 8 * block

    outcome = await tiered.prefill(RequestId("question"), question, GREEDY)
    assert outcome.cached_tokens == 2 * CHUNK
    assert tiered.statistics().prefix_host_back == 2
    held = (await tiered.export_held(RequestId("question"))).joined()
    alone = await fresh.prefill(RequestId("question"), question, GREEDY)
    assert outcome.first_token == alone.first_token
    assert held == (await fresh.export_held(RequestId("question"))).joined()
    stats = tiered.statistics()
    assert stats.prefix_cache_bytes + stats.kv_reserved_bytes <= budget  # kept blocks stayed in the room too
    for engine, rid in ((tiered, "other"), (tiered, "question"), (fresh, "question")):
        await engine.release_held(RequestId(rid))
