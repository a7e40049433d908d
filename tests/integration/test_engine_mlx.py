"""`MlxEngine` against mlx-lm itself, on tiny real checkpoints.

Parity: prefill on one engine, hand the cache off through the KV wire format to a second
engine, decode there; the tokens must equal mlx-lm's own `generate_step` for the same prompt
and chunk size. Then batching, seeded sampling, the quantized solo lane, cancellation, bad
payloads and bad requests, a dead device thread. Every engine must end a test holding nothing.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
import pytest
import trio
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.utils import load as mlx_lm_load
from mlx_lm.utils import load_tokenizer

from adapters.grammar import response_format_text
from adapters.kv import codec
from adapters.mlx import MlxEngine, commands, slots
from adapters.mlx import choices as choices_module
from adapters.mlx import executor as executor_module
from adapters.mlx import profile as profile_module
from adapters.mlx.prefill import PrefillTask
from adapters.mlx.requests import EngineRequest, Held
from adapters.mlx.sampling import PositionSampler
from effects.engine_port import (
    Decoded,
    Engine,
    EngineStatistics,
    KvSegment,
    PrefixSummary,
    SamplingParams,
)
from statecore.engine_schedule import EnginePhase, Finish, StepPlan
from statecore.engine_schedule import schedule as scheduled
from statecore.errors import Code, Fault, StatecoreError
from statecore.events import TokensGenerated
from statecore.ids import RequestId
from statecore.prefix import block_keys
from statecore.routing import summary_key
from statecore.scheduling import StepRates, prefill_units
from support.tiny_models import (
    build_custom_cache_checkpoint,
    build_tiny_checkpoint,
    cached_checkpoint,
    is_degenerate,
)
from tests.integration.device_faults import FailingAttention
from tests.integration.engines import Streamed, close_engine, load_engine, streamed, streamed_prefill

CHUNK = 16  # small, so that prompts of 33 and 257 tokens take several prefill chunks
GREEDY = SamplingParams(max_tokens=32)
IDLE = EngineStatistics(decoding=0, held_caches=0, held_bytes=0, device_thread_alive=True)


def holdings(engine: MlxEngine) -> EngineStatistics:
    """What the engine holds now (its counters, stall clock, budget, the allocator's figures and the
    prefix cache, which keeps blocks on purpose, set aside): to compare with IDLE, whose
    reservations are zero too."""
    return replace(engine.statistics(), step_retries=0, rows_isolated=0, stalled_s=0.0, kv_budget_bytes=0,
                   device_memory_bytes=0, device_peak_bytes=0, prefix_cache_bytes=0, prefix_cache_hits=0,
                   prefix_tokens_reused=0, prefix_cache_queries=0, prefix_cache_evictions=0,
                   prefill_capped_steps=0, activation_overruns=0, activation_estimate_peak_bytes=0,
                   conversations_kept=0, conversation_tokens_kept=0, device_time=())


class Opener(Protocol):
    def __call__(
        self,
        model_dir: Path,
        *,
        prefill_chunk_size: int = ...,
        kv_bits: int | None = ...,
        kv_group_size: int = ...,
        trust_remote_code: bool = ...,
        max_batch: int = ...,
        prefill_batch: int = ...,
        max_num_batched_tokens: int | None = ...,
        step_target_ms: float | None = ...,
        kv_memory_bytes: int | None = ...,
        decodes_locally: bool = ...,
        shape_bucket: int | None = ...,
        decode_attention: str = ...,
        compile_decode: str = ...,
        fuse_projections: str = ...,
        preallocate_slots: bool | None = ...,
        prefix_cache_bytes: int | None = ...,
        prefill_memory_cap: str = ...,
        keep_conversations: bool = ...,
        message_blocks: str = ...,
        warm_request: bool | None = ...,
        model_call_hook: Callable[[str, Sequence[str]], None] | None = ...,
    ) -> Awaitable[MlxEngine]: ...


@pytest.fixture
async def open_engine() -> AsyncIterator[Opener]:
    """Open engines for a test; at teardown each must hold nothing, then it is closed."""
    opened: list[MlxEngine] = []

    async def opener(model_dir: Path, **kw: Any) -> MlxEngine:
        kw.setdefault("prefill_chunk_size", CHUNK)
        # Plans that do not depend on how fast this machine is now (tests assert their shapes):
        # the step-time target's own tests turn it on.
        kw.setdefault("step_target_ms", 0.0)
        engine = await load_engine(model_dir, **kw)
        opened.append(engine)
        return engine

    yield opener
    try:
        for engine in opened:
            if engine.statistics().device_thread_alive:
                await flush(engine)
                assert holdings(engine) == IDLE
    finally:
        for engine in opened:
            await close_engine(engine)


async def flush(engine: MlxEngine) -> None:
    """Wait until every job posted before now has run (the device queue is FIFO)."""
    await engine.release_held(RequestId("-flush-"))


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + 11 * salt) % 500 + 2 for i in range(n)]


_REFERENCE_MODELS: dict[tuple[Path, bool], Any] = {}


def reference(
    model_dir: Path,
    prompt: Sequence[int],
    max_tokens: int = 32,
    *,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    trust_remote_code: bool = False,
) -> list[int]:
    """mlx-lm's own greedy tokens (generate_step, same chunk size, quantized from the start)."""
    key = (model_dir, trust_remote_code)
    if key not in _REFERENCE_MODELS:
        loaded = mlx_lm_load(str(model_dir), trust_remote_code=trust_remote_code)
        _REFERENCE_MODELS[key] = loaded[0]
    steps = generate_step(
        mx.array(list(prompt)),
        _REFERENCE_MODELS[key],
        max_tokens=max_tokens,
        prefill_step_size=CHUNK,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=0,
    )
    return [int(token) for token, _ in steps]


async def collect(engine: MlxEngine, rid: RequestId) -> Streamed:
    return await streamed(engine.stream(rid))


async def handoff(
    prefill: MlxEngine,
    decode: MlxEngine,
    rid: RequestId,
    prompt: Sequence[int],
    sampling: SamplingParams = GREEDY,
) -> list[int]:
    """Prefill on one engine, move the cache over the wire, decode on the other."""
    outcome = await prefill.prefill(rid, prompt, sampling)
    assert outcome.prompt_tokens == len(prompt)
    assert prefill.statistics().held_bytes >= outcome.held_bytes > 0
    payload = (await prefill.export_held(rid)).joined()
    assert await prefill.release_held(rid) == outcome.held_bytes
    await decode.install(rid, payload, prompt, outcome.first_token, sampling)
    return [outcome.first_token, *(await collect(decode, rid)).tokens]


async def single(
    engine: MlxEngine, rid: RequestId, prompt: Sequence[int], sampling: SamplingParams = GREEDY
) -> list[int]:
    """One node: prefill, then decode the held cache locally."""
    outcome = await engine.prefill(rid, prompt, sampling)
    await engine.decode_held(rid, prompt, outcome.first_token, sampling)
    return [outcome.first_token, *(await collect(engine, rid)).tokens]


async def same_seeded_tokens(one: MlxEngine, other: MlxEngine) -> bool:
    """Whether two engines give one seeded request (temperature 1, top-k 40) the same tokens."""
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_k=40, seed=11)
    prompt = prompt_of(40, salt=2)
    mine = await single(one, RequestId("s"), prompt, seeded)
    return mine == await single(other, RequestId("s"), prompt, seeded)


async def all_at_once(
    call: Callable[[RequestId, list[int]], Awaitable[list[int]]], prompts: dict[RequestId, list[int]]
) -> dict[RequestId, list[int]]:
    """`call` for every prompt at the same time; each request's tokens."""
    got: dict[RequestId, list[int]] = {}

    async def run(rid: RequestId) -> None:
        got[rid] = await call(rid, prompts[rid])

    async with trio.open_nursery() as nursery:
        for rid in prompts:
            nursery.start_soon(run, rid)
    return got


def quantizable_llama(out_dir: Path) -> Path:
    """A tiny llama with head_dim 64, so its KV cache quantizes with group size 64."""
    build_tiny_checkpoint(out_dir, "llama")
    config = json.loads((out_dir / "config.json").read_text())
    config.update(
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        intermediate_size=256,
    )
    mx.random.seed(0)
    args = llama.ModelArgs.from_dict(config)  # type: ignore[no-untyped-call]
    params: list[tuple[str, Any]] = tree_flatten(llama.Model(args).parameters())  # type: ignore[assignment]
    # mlx's default init gives near-uniform logits; scaled up, greedy output varies.
    weights = {
        name: (value * (4 if "embed" in name else 2) if value.ndim == 2 else value) for name, value in params
    }
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


@pytest.fixture(scope="module")
def quantizable_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantizable_llama(tmp_path_factory.mktemp("qllama"))


# ---------------------------------------------------------------------------------------------
# Greedy parity: prefill node + wire + decode node == mlx-lm


PARITY_CASES = [
    ("llama", 1),
    ("llama", 33),
    ("llama", 257),
    ("qwen3", 33),
    ("gemma3_text", 1),
    ("gemma3_text", 257),  # past the sliding window
    ("qwen3_next", 33),
    ("falcon_h1", 33),
    ("mamba2", 33),
    ("llama4", 40),  # past its attention chunk (32); no merge: decodes in the solo lane
]


@pytest.fixture(scope="module")
def fresh_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints built fresh for this run instead of taken from the shared cache.

    llama4: a cache entry built by an earlier tiny_models (same generator version) carries
    attn_temperature_tuning=4, which transformers refuses when mlx-lm loads the tokenizer.
    """
    return {"llama4": build_tiny_checkpoint(tmp_path_factory.mktemp("llama4"), "llama4")}


@pytest.mark.parametrize(("family", "length"), PARITY_CASES)
async def test_greedy_handoff_matches_mlx_lm(
    open_engine: Opener, fresh_dirs: dict[str, Path], family: str, length: int
) -> None:
    path = fresh_dirs.get(family) or cached_checkpoint(family)
    prefill_node = await open_engine(path)
    decode_node = await open_engine(path)
    assert prefill_node.info == decode_node.info
    assert prefill_node.info.can_travel
    prompt = prompt_of(length)
    expected = reference(path, prompt)

    got = await handoff(prefill_node, decode_node, RequestId("r"), prompt)

    assert got == expected
    assert len(got) == GREEDY.max_tokens
    assert not is_degenerate(got)
    # One node gives the same tokens as the handoff.
    assert await single(decode_node, RequestId("s"), prompt) == expected


async def test_model_info(open_engine: Opener) -> None:
    path = cached_checkpoint("gemma3_text")
    engine = await open_engine(path)
    info = engine.info
    assert info.name == path.name
    assert info.vocab_size == 512
    assert info.context_length == 4096
    assert 1 in info.eos_token_ids
    assert info.prefill_chunk_size == CHUNK
    assert [layer.class_name for layer in info.layers] == ["RotatingKVCache", "KVCache"]
    other = await open_engine(path, prefill_chunk_size=CHUNK * 2)
    assert other.info.fingerprint != info.fingerprint  # chunk size changes gemma3's bits


# ---------------------------------------------------------------------------------------------
# Batching


@pytest.mark.parametrize(
    ("family", "dtype"),
    [
        ("qwen3", "float32"),
        ("gemma3_text", "float32"),
        ("qwen3_next", "float32"),
        ("falcon_h1", "float32"),
        ("mamba2", "float32"),
        ("llama", "bfloat16"),
        ("gemma3_text", "bfloat16"),
        ("qwen3_next", "float16"),
        ("llama4", "float32"),  # solo lane next to nothing: still exact
    ],
)
async def test_every_family_decodes_exactly_next_to_others(
    open_engine: Opener, fresh_dirs: dict[str, Path], family: str, dtype: str
) -> None:
    path = cached_checkpoint(family, dtype=dtype) if family != "llama4" else fresh_dirs[family]
    prefill_node = await open_engine(path)
    decode_node = await open_engine(path)
    prompts = {RequestId(f"f{i}"): prompt_of(n, salt=i) for i, n in enumerate((3, 21, 40))}
    got = await all_at_once(partial(handoff, prefill_node, decode_node), prompts)
    assert got == {rid: reference(path, prompt) for rid, prompt in prompts.items()}


async def test_handoff_joins_running_batch_unchanged(open_engine: Opener) -> None:
    path = cached_checkpoint("llama")
    prefill_node = await open_engine(path)
    decode_node = await open_engine(path)
    long = SamplingParams(max_tokens=48)
    others = {RequestId(f"o{i}"): prompt_of(n, salt=i) for i, n in enumerate((5, 40, 90))}
    newcomer = prompt_of(33, salt=7)
    results: dict[RequestId, list[int]] = {}
    started = {rid: trio.Event() for rid in others}

    async def run_other(rid: RequestId, prompt: list[int]) -> None:
        outcome = await decode_node.prefill(rid, prompt, long)
        await decode_node.decode_held(rid, prompt, outcome.first_token, long)
        tokens = [outcome.first_token]
        async for item in decode_node.stream(rid):
            if isinstance(item, TokensGenerated):
                tokens += item.tokens
            if len(tokens) >= 4:
                started[rid].set()
        results[rid] = tokens

    async with trio.open_nursery() as nursery:
        for rid, prompt in others.items():
            nursery.start_soon(run_other, rid, prompt)
        for event in started.values():
            await event.wait()
        assert decode_node.statistics().decoding == 3
        results[RequestId("new")] = await handoff(prefill_node, decode_node, RequestId("new"), newcomer)

    assert results[RequestId("new")] == reference(path, newcomer)
    for rid, prompt in others.items():
        assert results[rid] == reference(path, prompt, long.max_tokens)


async def test_short_prompts_waiting_together_are_batched_and_exact(open_engine: Opener) -> None:
    """Short prompts of different lengths queued together share one padded call; each row is its
    own request, and on the CPU its tokens equal mlx-lm's own. A prompt too long for one chunk
    runs its chunks alone in the same steps; a duplicate request id fails alone."""
    path = cached_checkpoint("llama")
    # A budget that takes every prompt below in one step, whatever order they arrive in.
    engine = await open_engine(path, max_num_batched_tokens=256)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_k=40, seed=7)
    greedy = {RequestId(f"g{i}"): prompt_of(13 + i, salt=i) for i in range(4)}  # 13..16 tokens: one chunk
    long = prompt_of(40, salt=9)
    results: dict[RequestId, list[int]] = {}
    errors: list[StatecoreError] = []

    async def run(rid: RequestId, prompt: list[int], sampling: SamplingParams = GREEDY) -> None:
        results[rid] = await single(engine, rid, prompt, sampling)

    async def duplicate() -> None:
        try:
            await engine.prefill(RequestId("g0"), prompt_of(14, salt=5), GREEDY)
        except StatecoreError as exc:
            errors.append(exc)

    # Hold the device thread until every prefill below is queued.
    gate = await hold_device(engine)
    async with trio.open_nursery() as nursery:
        for rid, prompt in greedy.items():
            nursery.start_soon(run, rid, prompt)
        nursery.start_soon(run, RequestId("seeded"), prompt_of(15, salt=4), seeded)
        nursery.start_soon(run, RequestId("long"), long)
        await release_when_queued(engine, gate, 6)
        nursery.start_soon(duplicate)

    calls, _ = engine.device_profile()["prefill_batched"]
    assert calls == 5  # four greedy rows and the seeded one; "long" needs three chunks
    for rid, prompt in greedy.items():
        assert results[rid] == reference(path, prompt)
    assert results[RequestId("long")] == reference(path, long)
    unbatched = await open_engine(path, prefill_batch=1)
    alone = await single(unbatched, RequestId("seeded"), prompt_of(15, salt=4), seeded)
    assert results[RequestId("seeded")] == alone
    assert unbatched.device_profile()["prefill_batched"] == (0, 0.0)
    assert [e.info.code for e in errors] == [Code.INVALID_REQUEST]


def record_batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every batched prefill call from now on (the real call still runs)."""
    from adapters.mlx import prefill_build
    from adapters.mlx.prefill import run_short_batch

    sizes: list[int] = []

    def recording(model: Any, tasks: Any, bucket: int = 0) -> None:
        sizes.append(len(tasks))
        run_short_batch(model, tasks, bucket)

    monkeypatch.setattr(prefill_build, "run_short_batch", recording)
    return sizes


async def capped_run(engine: MlxEngine, prompts: Mapping[RequestId, list[int]]) -> dict[RequestId, list[int]]:
    """Every prompt queued while the device thread is held, then all at once (greedy)."""
    gate = await hold_device(engine)
    results: dict[RequestId, list[int]] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: _gather(results, all_at_once(partial(single, engine), dict(prompts))))
        await release_when_queued(engine, gate, len(prompts))
    return results


async def test_a_memory_budget_splits_batched_prefills_and_keeps_the_tokens(
    open_engine: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a small --kv-memory-bytes the planned batched prefill of six short prompts (one padded
    call without the cap) is cut to what fits beside the KV reserved: groups of two, in three
    steps; every row's greedy tokens stay mlx-lm's and the uncapped engine's."""
    from statecore.scheduling import batched_prefill_bytes

    path = cached_checkpoint("llama")
    prompts = {RequestId(f"p{i}"): prompt_of(12 + i, salt=i) for i in range(6)}  # 12..17: one chunk each
    common: dict[str, Any] = {"max_num_batched_tokens": 256, "prefix_cache_bytes": 0}
    sizes = record_batches(monkeypatch)
    uncapped = await open_engine(path, **common)
    assert not uncapped._device.settings.prefill_memory_cap  # no --kv-memory-bytes: no cap
    expected = await capped_run(uncapped, prompts)
    assert sizes == [6]
    assert uncapped.statistics().prefill_capped_steps == 0
    # The budget: every request's reservation (no slot lane fits a budget this small: each reserves
    # prompt + max_tokens), plus room for a batched call of two rows but not of three.
    device = uncapped._device
    shape = device.shape
    assert shape is not None
    reserved = sum(device.cost.of(len(p) + GREEDY.max_tokens) for p in prompts.values())

    def pair(rows: int, head: int) -> int:
        return batched_prefill_bytes(shape, rows, head, device.cost.per_token, 256)

    budget = reserved + (pair(2, 16) + pair(3, 11)) // 2
    sizes.clear()
    capped = await open_engine(path, kv_memory_bytes=budget, **common)
    assert not capped._device.slot_lane
    got = await capped_run(capped, prompts)
    assert got == expected == {rid: reference(path, prompt) for rid, prompt in prompts.items()}
    assert sizes == [2, 2, 2]
    stats = capped.statistics()
    assert stats.prefill_capped_steps == 2 and stats.activation_overruns == 0
    assert pair(2, 11) <= stats.activation_estimate_peak_bytes <= budget - reserved
    # The same budget with the cap turned off: one call of six again.
    sizes.clear()
    off = await open_engine(path, kv_memory_bytes=budget, prefill_memory_cap="off", **common)
    assert await capped_run(off, prompts) == expected
    assert sizes == [6] and off.statistics().prefill_capped_steps == 0


async def test_a_unit_over_the_budget_runs_alone(open_engine: Opener,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget with no room beside the reservations: the oldest prompt's next unit runs alone each
    step (counted as an overrun), nothing is batched, nothing starves, the tokens are the same."""
    path = cached_checkpoint("llama")
    prompts = {RequestId(f"p{i}"): prompt_of(14 + i, salt=i) for i in range(3)}
    prompts[RequestId("long")] = prompt_of(40, salt=9)  # three chunks
    sizes = record_batches(monkeypatch)
    probe = await open_engine(path)
    reserved = sum(probe._device.cost.of(len(p) + GREEDY.max_tokens) for p in prompts.values())
    engine = await open_engine(path, kv_memory_bytes=reserved, max_num_batched_tokens=256,
                               prefix_cache_bytes=0)
    got = await capped_run(engine, prompts)
    assert got == {rid: reference(path, prompt) for rid, prompt in prompts.items()}
    assert sizes == []
    stats = engine.statistics()
    assert stats.activation_overruns >= len(prompts) and stats.prefill_capped_steps >= len(prompts) - 1


async def test_kept_prefixes_give_way_to_the_oldest_prompt_s_prefill(open_engine: Opener) -> None:
    """The blocks one prompt left in the prefix cache take the room a later prompt's chunks need
    beside its reservation: they are evicted, not run over (no overrun), and the tokens stay
    mlx-lm's."""
    from statecore.scheduling import chunk_activation_bytes, prefill_chunks

    path = cached_checkpoint("llama")
    first, later = prompt_of(40, salt=4), prompt_of(40, salt=9)  # blocks end at 16 and 32
    probe = await open_engine(path)
    assert await single(probe, RequestId("a"), first) == reference(path, first)
    kept = probe.statistics().prefix_cache_bytes
    device = probe._device
    assert device.shape is not None and kept > 0
    chunks = prefill_chunks(len(later), CHUNK)
    largest = max(chunk_activation_bytes(device.shape, chunks, device.bucket))
    # The later prompt's reservation and its largest chunk fit; with the first's blocks beside
    # them, not (the first's own chunks fit beside its own blocks, which grow as it goes).
    budget = device.cost.of(len(later) + GREEDY.max_tokens) + largest + kept - 1
    engine = await open_engine(path, kv_memory_bytes=budget, prefix_cache_bytes=budget)
    assert not engine._device.slot_lane and engine._device.settings.prefill_memory_cap
    assert await single(engine, RequestId("a"), first) == reference(path, first)
    before = engine.statistics()
    assert before.prefix_cache_bytes == kept and before.activation_overruns == 0
    assert await single(engine, RequestId("b"), later) == reference(path, later)
    after = engine.statistics()
    assert after.prefix_cache_evictions > before.prefix_cache_evictions
    assert after.activation_overruns == 0


async def test_a_whole_chunk_over_the_budget_is_logged_at_load(open_engine: Opener,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Where one whole prefill chunk's estimate is over what the budget leaves beside its own KV
    on an idle node, every prompt that long overruns it: the engine says so at load, naming the
    chunk size as the lever (not without the cap)."""
    from statecore.scheduling import activation_bytes

    path = cached_checkpoint("llama")
    probe = await open_engine(path)
    assert probe._device.shape is not None
    least = activation_bytes(probe._device.shape, 1, CHUNK, CHUNK) + probe._device.cost.of(CHUNK)
    for cap, warned in (("off", False), ("on", True)):
        caplog.clear()
        await open_engine(path, kv_memory_bytes=least - 1, prefill_memory_cap=cap)
        said = [r.getMessage() for r in caplog.records if "whole prefill chunk" in r.getMessage()]
        assert bool(said) is warned and all("--prefill-chunk-size" in line for line in said)
    caplog.clear()
    await open_engine(path, kv_memory_bytes=least)
    assert not [r for r in caplog.records if "whole prefill chunk" in r.getMessage()]


def test_the_activation_estimate_bounds_a_prefill_s_measured_peak() -> None:
    """`statecore.scheduling`'s estimate against the allocator on the CPU (where attention scores
    are materialized): one prompt's prefill and batched short prompts each peak (above what
    they leave allocated) below their estimate, and not far below."""
    import gc

    from mlx_lm.models.cache import make_prompt_cache

    from adapters.mlx.memory import model_shape
    from adapters.mlx.prefill import PrefillTask, run_short_batch, run_units
    from adapters.mlx.sampling import PositionSampler
    from statecore.scheduling import (
        batched_prefill_bytes,
        chunk_activation_bytes,
        prefill_chunks,
        prefill_units,
    )

    model = mlx_lm_load(str(cached_checkpoint("llama")))[0]
    layers = len(make_prompt_cache(model))
    shape = model_shape(model, 512, make_prompt_cache(model))
    kv_per_token = 2 * layers * shape.kv_heads * shape.head_dim * shape.dtype_bytes

    def task(n: int, salt: int) -> PrefillTask:
        chunks = prefill_chunks(n, 2048)
        return PrefillTask(f"r{salt}", prompt_of(n, salt), PositionSampler(GREEDY, 0, n), salt, chunks,
                           prefill_units(chunks, layers, 4096))

    def transient(tasks: list[PrefillTask], batched: bool) -> int:
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        if batched:
            run_short_batch(model, tasks)
        else:
            for one in tasks:
                run_units(model, one, len(one.units), lambda cache: None)
        mx.eval([t.first for t in tasks], [[c.state for c in t.cache or ()] for t in tasks])
        return mx.get_peak_memory() - mx.get_active_memory()  # above what the prefill leaves held

    for n in (64, 256, 600):
        alone = task(n, 0)
        measured = transient([alone], batched=False)
        estimate = sum(chunk_activation_bytes(shape, alone.chunks))
        # (a few hundred KiB at 64 tokens move with what the allocator already holds from the
        # tests before: the ratio is asked of the larger prompts only)
        assert measured <= estimate <= 1.6 * measured + (256 << 10), (n, measured, estimate)
    for rows in (2, 4):
        tasks = [task(200 + i, i) for i in range(rows)]
        measured = transient(tasks, batched=True)
        estimate = batched_prefill_bytes(shape, rows, 200 + rows - 2, kv_per_token, 256)
        assert measured <= estimate <= 1.6 * measured, (rows, measured, estimate)


def test_a_padded_chunk_leaves_the_cache_an_unpadded_one_would() -> None:
    """Padding a chunk to its shape bucket and trimming the padding off again gives the cache,
    first token and positions of the unpadded chunks (attention is causal)."""
    from mlx_lm.models.cache import make_prompt_cache

    from adapters.mlx.prefill import PrefillTask, run_units
    from adapters.mlx.sampling import PositionSampler
    from statecore.scheduling import prefill_chunks, prefill_units

    model = mlx_lm_load(str(cached_checkpoint("llama")))[0]
    prompt = prompt_of(45, salt=3)
    chunks = prefill_chunks(45, CHUNK)
    tasks = []
    for bucket in (0, 24):
        task = PrefillTask("r", prompt, PositionSampler(GREEDY, 0, len(prompt)), 0, chunks,
                           prefill_units(chunks, len(make_prompt_cache(model)), CHUNK))
        while not task.finished:
            run_units(model, task, 1, lambda cache: None, bucket)
        assert task.cache is not None
        mx.eval(task.first, [c.state for c in task.cache])
        tasks.append(task)
    plain, padded = tasks
    assert plain.cache is not None and padded.cache is not None
    assert int(padded.first.item()) == int(plain.first.item())
    assert len(make_prompt_cache(model)) == len(padded.cache)
    for ours, theirs in zip(padded.cache, plain.cache, strict=True):
        assert ours.offset == theirs.offset == len(prompt)
        # What lies past the offset (zeros, or the padding's keys) is never read: compare the rest.
        for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            np.testing.assert_allclose(np.array(a[..., : len(prompt), :]), np.array(b[..., : len(prompt), :]),
                                       rtol=1e-5, atol=1e-5)


async def test_shape_buckets_keep_every_lane_exact(open_engine: Opener) -> None:
    """With a shape bucket (the GPU's default) prefill chunks and batched short prompts are padded
    and the slot lane attends over a rounded-up length: greedy tokens still equal mlx-lm's,
    seeded ones the unbucketed engine's, and the fingerprint tells the two settings apart."""
    path = cached_checkpoint("llama")
    bucketed = await open_engine(path, shape_bucket=24, max_num_batched_tokens=256)
    plain = await open_engine(path, shape_bucket=0)
    assert bucketed.info.fingerprint != plain.info.fingerprint
    prompts = {RequestId(f"p{n}"): prompt_of(n, salt=n) for n in (5, 13, 14, 33, 70)}
    gate = await hold_device(bucketed)
    results: dict[RequestId, list[int]] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: _gather(results, all_at_once(partial(single, bucketed), prompts)))
        await release_when_queued(bucketed, gate, len(prompts))
    assert bucketed.device_profile()["prefill_batched"][0] >= 2  # the short ones shared a call
    assert results == {rid: reference(path, prompt) for rid, prompt in prompts.items()}
    # What a GPU node does at load (one prefill per chunk shape of prompts up to two chunks)
    # leaves nothing behind.
    from adapters.mlx.prefill import warm_chunk_shapes

    warmed = commands.Inspect(lambda: warm_chunk_shapes(bucketed._device.model, 24, CHUNK))
    assert await bucketed._post(warmed) == 2
    assert await same_seeded_tokens(bucketed, plain)


async def test_routed_decode_attention_reads_each_row_in_place_and_keeps_tokens_exact(
    open_engine: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `decode_attention` routed (the GPU kernel's contract, here in MLX ops) every slot step's
    attention goes through it instead of the masked views: rows of different lengths decoding
    together still give mlx-lm's greedy tokens and the masked engine's seeded ones. The kernel
    itself is refused off CUDA, and an unknown mode at load."""
    from adapters.mlx import attention

    calls = []
    plain_reference = attention.reference_attention

    def counted(*args: Any) -> Any:
        calls.append(args[-1])
        return plain_reference(*args)

    monkeypatch.setattr(attention, "reference_attention", counted)
    path = cached_checkpoint("llama")
    routed = await open_engine(path, decode_attention="reference")
    masked = await open_engine(path, decode_attention="masked")
    prompts = {RequestId(f"p{n}"): prompt_of(n, salt=n) for n in (5, 33, 70)}
    results = await all_at_once(partial(single, routed), prompts)
    assert results == {rid: reference(path, prompt) for rid, prompt in prompts.items()}
    assert calls and max(calls) >= 70  # each call attends up to the longest row, not the capacity
    assert await same_seeded_tokens(routed, masked)
    with pytest.raises(StatecoreError, match="CUDA"):
        await open_engine(path, decode_attention="kernel")
    with pytest.raises(StatecoreError, match="decode_attention must be one of"):
        await open_engine(path, decode_attention="fast")


async def test_exact_rows_decode_each_row_as_alone(open_engine: Opener) -> None:
    """`decode_attention="rows"` (the CPU's choice where masked attention's bits follow the longest
    row): each row attends in a call of its own over its own length; rows of different lengths
    decoding together give mlx-lm's greedy tokens and the masked engine's seeded ones, and a
    traced step is not used with it (its lengths are not known when it is traced)."""
    path = cached_checkpoint("llama")
    rows = await open_engine(path, decode_attention="rows", compile_decode="on")
    masked = await open_engine(path, decode_attention="masked")
    assert rows._device.pool is not None and rows._device.pool.exact_rows
    assert rows._device.compiled is None and rows._device.attention.startswith("exact rows")
    prompts = {RequestId(f"p{n}"): prompt_of(n, salt=n) for n in (5, 33, 70)}
    results = await all_at_once(partial(single, rows), prompts)
    assert results == {rid: reference(path, prompt) for rid, prompt in prompts.items()}
    assert await same_seeded_tokens(rows, masked)


@pytest.mark.parametrize("attention", ["reference", "masked"])
async def test_a_traced_decode_step_is_replayed_with_the_same_tokens(
    open_engine: Opener, attention: str
) -> None:
    """`compile_decode` on: the slot lane's model call is traced once per shape (rows rounded up
    to a multiple of 8, the attended length to 128) and replayed; rows of different lengths
    decoding together still give mlx-lm's greedy tokens and the untraced engine's seeded ones,
    and a test's model-call hook still runs on every call (the model's own code does not)."""
    path = cached_checkpoint("llama")
    hooked: list[str] = []
    traced = await open_engine(path, decode_attention=attention, compile_decode="on",
                               model_call_hook=lambda stage, ids: hooked.append(stage))
    plain = await open_engine(path, decode_attention=attention, compile_decode="off")
    compiled = traced._device.compiled
    assert compiled is not None and plain._device.compiled is None
    prompts = {RequestId(f"p{n}"): prompt_of(n, salt=n) for n in (5, 33, 70)}
    results = await all_at_once(partial(single, traced), prompts)
    assert results == {rid: reference(path, prompt) for rid, prompt in prompts.items()}
    steps = dict((kind, calls) for kind, calls, _ in traced.statistics().device_time)["decode_build"]
    assert 1 <= compiled.traces <= 3 < steps  # one shape per (rows, length bucket): the rest replays
    assert hooked.count("decode") == steps
    assert await same_seeded_tokens(traced, plain)
    with pytest.raises(StatecoreError, match="compile_decode must be one of"):
        await open_engine(path, compile_decode="yes")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
async def test_fused_projections_keep_the_tokens_and_change_the_fingerprint(
    open_engine: Opener, family: str
) -> None:
    """`fuse_projections` on (the CUDA default): each layer's q/k/v and gate/up projections are one
    matmul whose slices the model's own code receives; the greedy tokens stay mlx-lm's (these
    small matmuls round the same here), seeded ones the unfused engine's, and the fingerprint
    says the node fuses (its KV may differ from an unfused node's in the last bits)."""
    path = cached_checkpoint(family)
    fused = await open_engine(path, fuse_projections="on")
    plain = await open_engine(path, fuse_projections="off")
    attention = fused._device.model.layers[0].self_attn
    assert type(attention.q_proj).__name__ == "_Slice" and "q_proj" not in attention
    assert type(plain._device.model.layers[0].self_attn.q_proj).__name__ == "Linear"
    prompts = {RequestId(f"f{n}"): prompt_of(n, salt=n) for n in (5, 33, 70)}
    results = await all_at_once(partial(single, fused), prompts)
    assert results == {rid: reference(path, prompt) for rid, prompt in prompts.items()}
    assert await same_seeded_tokens(fused, plain)
    assert fused.info.fingerprint != plain.info.fingerprint
    with pytest.raises(StatecoreError, match="fuse_projections must be one of"):
        await open_engine(path, fuse_projections="yes")


async def test_a_prefill_node_sets_nothing_aside_for_slots(open_engine: Opener) -> None:
    """A prefill node never decodes a client's request: no slot pool (not even allocated at
    load), the whole KV budget left for prompts; a held cache still decodes (in mlx-lm's batch
    generator) with mlx-lm's tokens, as the load's warm-up request needs."""
    path = cached_checkpoint("llama")
    budget = 2 * 32 * 1024 * 512
    prefill = await open_engine(path, decodes_locally=False, preallocate_slots=True, kv_memory_bytes=budget)
    decode = await open_engine(path, preallocate_slots=True, kv_memory_bytes=budget)
    assert prefill._device.pool is None and prefill._device.pool_reserved == 0
    assert decode._device.pool is not None and decode._device.pool_reserved > 0
    prompt = prompt_of(30, salt=4)
    assert await single(prefill, RequestId("p"), prompt) == reference(path, prompt)


async def test_a_preallocated_slot_pool_never_grows(open_engine: Opener) -> None:
    """`preallocate_slots` (the GPU's default): the pool has its whole capacity from the load on,
    so a long row joining copies no other row; tokens stay mlx-lm's."""
    path = cached_checkpoint("llama")
    engine = await open_engine(path, preallocate_slots=True, kv_memory_bytes=2 * 32 * 1024 * 512)
    pool = engine._device.pool
    assert pool is not None and pool.capacity == pool.max_capacity == 1024
    prompts = {RequestId(f"p{n}"): prompt_of(n, salt=n) for n in (5, 300, 700)}
    assert await all_at_once(partial(single, engine), prompts) == {
        rid: reference(path, prompt) for rid, prompt in prompts.items()}
    assert pool.capacity == 1024
    lazy = await open_engine(path, preallocate_slots=False)
    assert lazy._device.pool is not None and lazy._device.pool.capacity == 0


def test_a_traced_step_writes_the_pool_in_place() -> None:
    """The pool's buffers go through the traced call and come back: MLX updates them in place, so
    a step allocates far less than one buffer (a copy would be the whole pool, every step)."""
    from mlx_lm.models.cache import make_prompt_cache

    from adapters.mlx.compiled import CompiledSlotStep
    from adapters.mlx.slots import SlotPool

    model = mlx_lm_load(str(cached_checkpoint("llama")))[0]
    probe = make_prompt_cache(model)
    model(mx.array([[1, 2, 3]]), cache=probe)
    pool = SlotPool(8, len(probe), 2048)
    pool.reserve(2000, probe)
    mx.eval(pool.keys, pool.values)
    step = CompiledSlotStep(model, pool, bucket=0)
    tokens = mx.array([3, 4, 5, 6, 7, 8, 9, 10], dtype=mx.uint32)
    logits = step(tokens, [1, 2, 3, 4, 5, 6, 7, 8])  # traced here
    mx.eval(logits, pool.keys, pool.values)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    for position in range(9, 14):
        logits = step(tokens, [position] * 8)
        mx.eval(logits, pool.keys, pool.values)
    assert step.traces == 1
    assert mx.get_peak_memory() - before < pool.keys[0].nbytes // 4


async def test_device_time_counts_the_steps_and_rows_a_request_took(open_engine: Opener) -> None:
    """The device thread's time by kind: a lone slot-lane request of 32 tokens decodes one row per
    step after its first token: 31 rows, and not one more: on the CPU a step is read back as soon
    as its launch has computed it, so the 32nd token ends the request before another row is built
    (a pipelined loop, elsewhere, would have launched one)."""
    engine = await open_engine(cached_checkpoint("llama"))
    before = {kind: (calls, seconds) for kind, calls, seconds in engine.statistics().device_time}
    assert len(await single(engine, RequestId("t"), prompt_of(40, salt=2))) == 32

    def counted() -> dict[str, tuple[int, float]]:
        return {kind: (calls, seconds) for kind, calls, seconds in engine.statistics().device_time}

    with trio.fail_after(10):  # the last step is counted after its token went out (the CPU's read-back)
        while counted()["step"][0] - before["step"][0] < 32:
            await trio.sleep(0.01)
    after = counted()
    grew = {kind: after[kind][0] - before[kind][0] for kind in after}
    assert grew["decode_rows"] == 31 and grew["decode_build"] == 31, grew
    assert grew["step"] >= 32 and grew["prefill_chunks"] >= 1 and grew["readback"] >= 31, grew
    assert after["step"][1] >= after["decode_build"][1] > before["decode_build"][1]
    assert after["decode_rows"][1] == 0.0


async def test_the_load_warm_up_request_leaves_nothing_behind(open_engine: Opener) -> None:
    """Forced on (it runs by default on MLX's CUDA backend only): after the load's request of two
    chunks and a token, nothing is held or reserved, the prefix cache is empty with its counters
    at 0, and a request is still exactly mlx-lm's."""
    engine = await open_engine(cached_checkpoint("llama"), warm_request=True, prefix_cache_bytes=1 << 26)
    assert engine.device_profile()["prefill_chunks"][0] >= 3  # its chunks did run
    stats = holdings(engine)
    assert stats == IDLE, stats
    full = engine.statistics()
    assert (full.prefix_cache_bytes, full.prefix_cache_queries, full.prefix_cache_hits) == (0, 0, 0)
    assert engine._device.rates == StepRates()  # its traced steps are no measure of serving ones
    prompt = prompt_of(40, salt=4)
    assert await single(engine, RequestId("after"), prompt) == reference(cached_checkpoint("llama"), prompt)


async def test_a_slow_step_is_kept_with_where_its_time_went(
    open_engine: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the threshold at 0 every step counts as slow: the prefill's step lists its prefill
    unit and its prefill time, each decode step its row, and no part exceeds the step."""
    monkeypatch.setattr(profile_module, "SLOW_STEP_S", 0.0)
    engine = await open_engine(cached_checkpoint("llama"))
    tokens = await single(engine, RequestId("t"), prompt_of(40, salt=3), replace(GREEDY, max_tokens=8))
    assert len(tokens) == 8
    with trio.fail_after(10):  # a step's record is kept after its tokens went out (the CPU's read-back)
        while sum(step.decode_rows for step in engine.slow_steps()) < 7:
            await trio.sleep(0.01)
    steps = engine.slow_steps()
    assert any(step.prefill_units == 1 and dict(step.parts).get("prefill_chunks", 0.0) > 0 for step in steps)
    for step in steps:
        assert all(0 < seconds <= step.seconds for _, seconds in step.parts), step
        assert [seconds for _, seconds in step.parts] == sorted((s for _, s in step.parts), reverse=True)


async def test_the_prefix_summary_lists_kept_blocks_and_says_when_nothing_changed(
    open_engine: Opener
) -> None:
    """What the router routes by: the first bytes of each kept block's key, and its version."""
    path = cached_checkpoint("llama")
    engine = await open_engine(path)
    empty = await engine.prefix_summary()
    assert empty is not None and (empty.block_tokens, empty.keys) == (CHUNK, ())
    first = prompt_of(70, salt=4)  # blocks end at 16, 32, 48 and 64
    await single(engine, RequestId("a"), first)
    summary = await engine.prefix_summary(empty.version)
    assert summary is not None and summary.version > empty.version
    assert set(summary.keys) == {summary_key(key) for key in block_keys(first, CHUNK)}
    assert await engine.prefix_summary(summary.version) is None
    off = await open_engine(path, prefix_cache_bytes=0)
    assert await off.prefix_summary() == PrefixSummary(0, 0) and await off.prefix_summary(0) is None


async def test_a_prompt_that_starts_like_an_earlier_one_reuses_its_chunks_and_its_tokens_are_exact(
    open_engine: Opener
) -> None:
    """Whole prefill chunks are kept: a prompt that starts with the same tokens computes only
    from its first new chunk, and gives the same tokens as an engine without the cache (greedy:
    mlx-lm's; seeded: the cache-less engine's). Kept blocks are stored once, stay within their
    capacity, and give way to a request that needs the memory."""
    path = cached_checkpoint("llama")
    cached = await open_engine(path)
    plain = await open_engine(path, prefix_cache_bytes=0)
    first = prompt_of(70, salt=4)  # chunks of 16: blocks end at 16, 32, 48 and 64
    assert await single(cached, RequestId("a"), first) == reference(path, first)
    kept = cached.statistics().prefix_cache_bytes
    assert kept > 0 and cached.statistics().prefix_cache_hits == 0
    follow_up = first[:50] + prompt_of(30, salt=9)  # shares three whole blocks (48 tokens)
    assert await single(cached, RequestId("b"), follow_up) == reference(path, follow_up)
    stats = cached.statistics()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.prefix_tokens_reused) == (2, 1, 48)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_k=40, seed=3)
    again = [*first[:66], 5, 6, 7]
    assert await single(cached, RequestId("s"), again, seeded) == await single(
        plain, RequestId("s"), again, seeded)
    assert cached.statistics().prefix_tokens_reused == 48 + 64
    assert plain.statistics().prefix_cache_bytes == 0
    # at most its capacity (one block here): still exact, the older blocks forgotten
    one_block = kept // 4
    small = await open_engine(path, prefix_cache_bytes=one_block)
    for rid, prompt in (("c", first), ("d", follow_up)):
        assert await single(small, RequestId(rid), prompt) == reference(path, prompt)
        assert small.statistics().prefix_cache_bytes <= one_block
    # kept blocks give way: SMALL_BUDGET holds one of these requests (~650 KB reserved) or the
    # blocks of one (~500 KB), not both, and nothing else is live: the second is not refused
    # (admission's eviction: the prefill memory cap, off here, would evict them earlier, for a
    # chunk's activations; test_kept_prefixes_give_way_to_the_oldest_prompt_s_prefill)
    tight = await open_engine(path, kv_memory_bytes=SMALL_BUDGET, prefix_cache_bytes=SMALL_BUDGET,
                              prefill_memory_cap="off")
    long_a, long_b = prompt_of(1000, salt=1), prompt_of(1000, salt=2)
    eight = SamplingParams(max_tokens=8)
    assert await single(tight, RequestId("la"), long_a, eight) == reference(path, long_a, 8)
    assert tight.statistics().prefix_cache_bytes > SMALL_BUDGET - 650_000
    evicted = tight.statistics().prefix_cache_evictions
    assert await single(tight, RequestId("lb"), long_b, eight) == reference(path, long_b, 8)
    assert tight.statistics().prefix_cache_evictions > evicted  # long_a's blocks gave way


async def test_a_shared_system_message_is_reused_to_its_end_and_the_tokens_are_exact(
    open_engine: Opener
) -> None:
    """A block also ends after an end-of-turn token (a chat message's end) but a prompt's last:
    prompts that start with one system message, then a user message and the assistant's
    header, share its blocks to its very end, here 41 tokens (16, 32, 41: not a multiple of the
    chunk), and their tokens are the cache-less engine's to the bit, greedy and seeded; the
    summary names the same blocks, and a conversation kept goes on from them."""
    path = cached_checkpoint("llama")
    cached = await open_engine(path, keep_conversations=True)
    plain = await open_engine(path, prefix_cache_bytes=0)
    end = min(cached.info.eos_token_ids)
    system = [*prompt_of(40, salt=11), end]
    header = prompt_of(3, salt=15)

    def chat(own: list[int]) -> list[int]:
        return [*system, *own, end, *header]

    first = chat(prompt_of(30, salt=12))
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_k=40, seed=4)
    for rid, sampling in (("g", GREEDY), ("s", seeded)):
        reused, tokens = await prefilled_from_cache(cached, rid, first, sampling)
        assert tokens == (await prefilled_from_cache(plain, rid, first, sampling))[1], rid
    # the second time: every block of it, ending at 16, 32, 41, 57 and 73 (not at 72: the user
    # message's end, its last)
    assert reused == 73
    await kept(cached)
    for rid, sampling, salt in (("g2", GREEDY, 13), ("s2", seeded, 14)):
        second = chat(prompt_of(25, salt=salt))
        reused, tokens = await prefilled_from_cache(cached, rid, second, sampling)
        assert reused == 41 and tokens == (await prefilled_from_cache(plain, rid, second, sampling))[1], rid
    summary = await cached.prefix_summary()
    assert summary is not None and summary.block_ends == tuple(sorted(cached.info.eos_token_ids))
    assert {summary_key(key) for key in block_keys(second, CHUNK, {end})[:3]} <= set(summary.keys)
    await kept(cached)


async def test_at_the_gpu_s_chunk_and_bucket_a_system_prompt_shorter_than_a_chunk_is_reused(
    open_engine: Opener
) -> None:
    """At MLX's CUDA defaults (2,048-token chunks, shapes padded to 128) a first turn is far
    shorter than a chunk, yet its system message is a block of its own: a second conversation
    on it starts at the message's end, on one engine and on a decode node that kept the first
    one's handed-off KV, with the cache-less engine's tokens, greedy and seeded. With
    message_blocks "long" (the rule before) the first turn is one call and nothing is reused."""
    path = cached_checkpoint("llama")
    gpu = partial(open_engine, path, prefill_chunk_size=2048, shape_bucket=128)
    cached = await gpu()
    plain = await gpu(prefix_cache_bytes=0)
    prefill = await gpu(decodes_locally=False)
    decode = await gpu(keep_conversations=True)
    whole = await gpu(message_blocks="long")
    end = min(cached.info.eos_token_ids)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_k=40, seed=4)
    for rid, sampling, salt in (("g", GREEDY, 12), ("s", seeded, 13)):
        system = [*prompt_of(40, salt=salt), end]  # a new one each round: nothing of it kept yet
        first, second = ([*system, *prompt_of(20 + own, salt=salt + own), end, *prompt_of(4, salt=99)]
                         for own in (1, 2))  # a user message, then the assistant's header
        assert (await prefilled_from_cache(cached, f"{rid}1", first, sampling))[0] == 0
        reused, tokens = await prefilled_from_cache(cached, f"{rid}2", second, sampling)
        expected = (await prefilled_from_cache(plain, rid, second, sampling))[1]
        assert reused == len(system) and tokens == expected, rid
        await handoff(prefill, decode, RequestId(f"{rid}1"), first, sampling)
        reused, tokens = await prefilled_from_cache(decode, f"{rid}2", second, sampling)
        assert reused == len(system) and tokens == expected, rid
        await kept(decode)
        await single(whole, RequestId(f"{rid}1"), first, sampling)
        assert (await prefilled_from_cache(whole, f"{rid}2", second, sampling))[0] == 0
    assert whole.info.fingerprint != cached.info.fingerprint  # its calls differ: no KV between them


async def kept(engine: MlxEngine) -> EngineStatistics:
    """The engine's statistics once every finished conversation's keep task has run (polled: a
    keep task is the device loop's own work, no job anyone waits on)."""
    with trio.fail_after(30):
        while any(task.keeps_only for task in list(engine._device.waiting.values())):
            await trio.sleep(0.01)
    await flush(engine)
    return engine.statistics()


async def prefilled_from_cache(engine: MlxEngine, rid: str, prompt: Sequence[int],
                               sampling: SamplingParams = GREEDY) -> tuple[int, list[int]]:
    """One node's request, and how many of its prompt tokens came from the prefix cache."""
    outcome = await engine.prefill(RequestId(rid), prompt, sampling)
    await engine.decode_held(RequestId(rid), prompt, outcome.first_token, sampling)
    generated = (await collect(engine, RequestId(rid))).tokens
    return outcome.cached_tokens, [outcome.first_token, *generated]


async def test_a_finished_conversation_is_kept_whole_and_its_next_turn_is_exact(open_engine: Opener) -> None:
    """keep_conversations: after a turn, its prompt and generated tokens' whole chunks are computed
    again as prefill chunks and kept, so the next turn (the conversation so far, then a new
    message) takes them all from the cache, and its tokens are still mlx-lm's (greedy) and the
    cache-less engine's (seeded). Without it only the prompt's own blocks are found."""
    path = cached_checkpoint("llama")
    keeping = await open_engine(path, keep_conversations=True)
    prompts_only = await open_engine(path)
    plain = await open_engine(path, prefix_cache_bytes=0)
    first = prompt_of(40, salt=6)  # chunks of 16: the prompt's blocks end at 16 and 32
    answer = await single(keeping, RequestId("t1"), first)  # 32 tokens: the conversation has 72
    assert answer == reference(path, first)
    stats = await kept(keeping)
    assert (stats.conversations_kept, stats.conversation_tokens_kept) == (1, 32)  # blocks at 48, 64
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (1, 0)  # keeping is not a query
    second = [*first, *answer, *prompt_of(10, salt=7)]
    cached, tokens = await prefilled_from_cache(keeping, "t2", second)
    assert cached == 64 and tokens == reference(path, second)
    await single(prompts_only, RequestId("t1"), first)
    assert (await prefilled_from_cache(prompts_only, "t2", second))[0] == 32
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_k=40, seed=5)
    answer = await single(keeping, RequestId("s1"), first, seeded)
    assert answer == await single(plain, RequestId("s1"), first, seeded)
    await kept(keeping)
    third = [*first, *answer, *prompt_of(20, salt=8)]  # 80 tokens: blocks through 48 are the conversation's
    cached, tokens = await prefilled_from_cache(keeping, "s2", third, seeded)
    assert cached == 48 and tokens == (await prefilled_from_cache(plain, "s2", third, seeded))[1]
    await kept(keeping)


async def test_a_keep_task_counts_once_it_has_computed(open_engine: Opener) -> None:
    """`conversations_kept` counts keep tasks done, not queued: one whose calls raise gives up
    (a keep task is nobody's request) and counts nothing; the request it followed is untouched."""
    path = cached_checkpoint("llama")

    def failing_keeps(stage: str, ids: Sequence[str]) -> None:
        if any(rid.endswith("#keep") for rid in ids):
            raise RuntimeError("a keep task's call fails")

    engine = await open_engine(path, keep_conversations=True, model_call_hook=failing_keeps)
    first = prompt_of(40, salt=6)
    assert await single(engine, RequestId("t1"), first) == reference(path, first)
    stats = await kept(engine)
    assert (stats.conversations_kept, stats.conversation_tokens_kept) == (0, 0)


async def test_a_handed_off_prompt_is_kept_as_installed_and_its_next_turn_is_exact(
    open_engine: Opener
) -> None:
    """On a decode node a handed-off prompt's whole chunks are kept as they arrive (the prefill
    node computed the same calls), then its conversation's: the next turn, prefilled on the
    decode node, finds all of them and gives mlx-lm's tokens."""
    path = cached_checkpoint("llama")
    prefill = await open_engine(path, decodes_locally=False)
    decode = await open_engine(path, keep_conversations=True)
    first = prompt_of(70, salt=3)  # blocks end at 16..64
    answer = await handoff(prefill, decode, RequestId("h1"), first)
    assert answer == reference(path, first)
    stats = await kept(decode)
    assert stats.conversations_kept == 1 and stats.conversation_tokens_kept == 32  # 64..96
    second = [*first, *answer, *prompt_of(5, salt=4)]
    cached, tokens = await prefilled_from_cache(decode, "h2", second)
    assert cached == 96 and tokens == reference(path, second)
    await kept(decode)


def waiting_keep_task(device: Any) -> PrefillTask:
    """A conversation's keep task of two chunks, waiting on the device loop (device thread only)."""
    chunks = (CHUNK, CHUNK)
    sampler = PositionSampler(SamplingParams(max_tokens=1), 0, 2 * CHUNK, [])
    task = PrefillTask("k#keep", prompt_of(2 * CHUNK), sampler, 0, chunks,
                       prefill_units(chunks, device.layers, device.unit_tokens), keeps_only=True)
    device.requests.add(EngineRequest(task.request_id, EnginePhase.KEEPING, task=task))
    return task


async def test_a_waiting_keep_task_gives_way_to_a_request_that_needs_its_memory(open_engine: Opener) -> None:
    """Keeping a conversation is worth less than serving a request: admission that would refuse
    one for memory drops the keep tasks not yet done (and their reservations) first."""
    engine = await open_engine(cached_checkpoint("llama"), kv_memory_bytes=SMALL_BUDGET,
                               keep_conversations=True)

    def admit_beside_a_keep_task() -> bool:
        device = engine._device
        task = waiting_keep_task(device)
        device.requests[task.request_id].reserved = SMALL_BUDGET - 100_000
        device.admission.admit("r", 200_000, 100)  # fits only once the keep task is gone
        device.requests.unreserve("r")
        return task.request_id not in device.waiting and task.request_id not in device.requests.reserved

    assert await engine._post(commands.Inspect(admit_beside_a_keep_task))


async def test_a_request_refused_for_memory_takes_no_kept_block_nor_keep_task(open_engine: Opener) -> None:
    """Kept blocks and keep tasks give way to a request only when that makes it fit: one refused
    anyway (OVERLOADED beside a held prompt, KV_MEMORY_EXCEEDED on any node) leaves every block
    and keep task where it was, and the next prompt that starts the same way still finds them."""
    path = cached_checkpoint("llama")
    probe = await open_engine(path)
    first, other = prompt_of(70, salt=4), prompt_of(70, salt=9)  # four blocks each
    reservation = probe._device.cost.of(len(first) + GREEDY.max_tokens)  # no slots: the whole request
    blocks = 4 * CHUNK * probe._device.cost.per_token
    budget = reservation + blocks + 1_000  # one request and its blocks; never two requests
    engine = await open_engine(path, kv_memory_bytes=budget, prefix_cache_bytes=budget,
                               prefill_memory_cap="off")
    assert not engine._device.slot_lane
    await engine.prefill(RequestId("a"), first, GREEDY)
    assert engine.statistics().prefix_cache_bytes == blocks
    for rid, prompt, sampling, code in ((RequestId("b"), other, GREEDY, Code.OVERLOADED),
                                        (RequestId("c"), other, SamplingParams(max_tokens=2_000),
                                         Code.KV_MEMORY_EXCEEDED)):
        with pytest.raises(StatecoreError) as refused:
            await engine.prefill(rid, prompt, sampling)
        assert refused.value.info.code is code
        stats = engine.statistics()
        assert (stats.prefix_cache_bytes, stats.prefix_cache_evictions) == (blocks, 0)
    await engine.release_held(RequestId("a"))
    follow_up = first[:50] + prompt_of(20, salt=5)
    cached, tokens = await prefilled_from_cache(engine, "d", follow_up)
    assert cached == 48 and tokens == reference(path, follow_up)

    def refused_beside_a_keep_task() -> bool:
        device = engine._device
        task = waiting_keep_task(device)
        device.requests[task.request_id].reserved = 10_000
        device.requests.add(EngineRequest("live", EnginePhase.HELD, reserved=budget - 20_000,
                                          held=Held([], 1, 0)))
        try:
            device.admission.admit("r", 30_000, 10)  # fits once "live" leaves, not for the keep task's room
        except StatecoreError as exc:
            overloaded = exc.info.code is Code.OVERLOADED
        else:
            overloaded = False
        still_waiting = task.request_id in device.waiting and task.request_id in device.requests.reserved
        for rid in ("r", "live", task.request_id):
            device.requests.remove(rid, Finish.CANCELLED)
        return overloaded and still_waiting

    assert await engine._post(commands.Inspect(refused_beside_a_keep_task))


async def test_a_prompt_s_own_cached_blocks_give_way_last_to_its_admission(open_engine: Opener) -> None:
    """Admission evicts least recently used blocks before the prompt looks its own up: the
    prompt's cached start counts as just used, so its admission takes other prompts' blocks and it
    still starts from its own (here the oldest ones in the cache)."""
    path = cached_checkpoint("llama")
    probe = await open_engine(path)
    first, second = prompt_of(70, salt=4), prompt_of(70, salt=9)  # four blocks each
    reservation = probe._device.cost.of(len(first) + GREEDY.max_tokens)  # no slots: the whole request
    block = CHUNK * probe._device.cost.per_token
    # a request beside eight blocks (kept blocks never take what admission gave requests: both
    # prompts' blocks fit beside the second's reservation); a longer one's admission needs two more
    budget = reservation + 8 * block + 1_000
    engine = await open_engine(path, kv_memory_bytes=budget, prefix_cache_bytes=8 * block,
                               prefill_memory_cap="off")
    assert not engine._device.slot_lane
    for rid, prompt in ((RequestId("a"), first), (RequestId("b"), second)):
        await engine.prefill(rid, prompt, GREEDY)
        await engine.release_held(rid)
    assert engine.statistics().prefix_cache_bytes == 8 * block  # first's blocks the least recent
    follow_up = first[:50] + prompt_of(52, salt=5)  # starts with first's three leading blocks
    cached, tokens = await prefilled_from_cache(engine, "c", follow_up)
    assert engine.statistics().prefix_cache_evictions >= 2  # first's fourth block, then second's
    assert cached == 48 and tokens == reference(path, follow_up)


async def test_each_prefill_reports_the_prompt_tokens_it_took_from_the_prefix_cache(
    open_engine: Opener
) -> None:
    """`PrefillOutcome.cached_tokens`: what a client's usage reports (prompt_tokens_details). A
    first prompt computes everything; one that starts like it takes its whole shared chunks; a
    prefill that raised and started again computed them all after all; no cache, nothing."""
    path = cached_checkpoint("llama")
    flaky = RequestId("again")
    raised: list[str] = []

    def hook(stage: str, request_ids: Sequence[str]) -> None:
        if stage == "prefill" and flaky in request_ids and not raised:
            raised.append(flaky)
            raise RuntimeError("injected: a prefill call raised")

    cached = await open_engine(path, model_call_hook=hook)
    plain = await open_engine(path, prefix_cache_bytes=0)

    async def cached_tokens(engine: MlxEngine, rid: str, prompt: Sequence[int]) -> int:
        outcome = await engine.prefill(RequestId(rid), prompt, GREEDY)
        await engine.release_held(RequestId(rid))
        return outcome.cached_tokens

    first = prompt_of(70, salt=4)  # chunks of 16: blocks end at 16, 32, 48 and 64
    follow_up = first[:50] + prompt_of(30, salt=9)  # shares three whole blocks
    assert await cached_tokens(cached, "a", first) == 0
    assert await cached_tokens(cached, "b", follow_up) == 48
    assert await cached_tokens(cached, "c", first) == 64  # the last 6 are computed, as always
    assert await cached_tokens(cached, "d", first[:40]) == 32
    assert await cached_tokens(cached, flaky, [*first[:66], 5, 6, 7]) == 0 and raised == [flaky]
    assert cached.statistics().prefix_tokens_reused == 48 + 64 + 32 + 64  # the flaky one's lookup
    assert [await cached_tokens(plain, rid, first) for rid in ("a", "c")] == [0, 0]


async def test_prompts_that_arrive_together_compute_their_shared_system_prompt_once(
    open_engine: Opener
) -> None:
    """Conversations that start with one system prompt and arrive in the same step find nothing
    kept at arrival; each looks again as its first unit is built and starts after the blocks the
    first of them computed (earlier in that step, several blocks a step): the system prompt's
    blocks are computed once and the tokens are still the cache-less engine's, greedy and seeded."""
    path = cached_checkpoint("llama")
    gate, parked = threading.Event(), threading.Event()

    def hook(stage: str, request_ids: Sequence[str]) -> None:
        if stage == "prefill" and "gate" in request_ids and not gate.is_set():
            parked.set()
            gate.wait(30)  # the device thread waits while the conversations' jobs queue up

    cached = await open_engine(path, model_call_hook=hook)
    plain = await open_engine(path, prefix_cache_bytes=0)
    system = prompt_of(75, salt=5)  # four whole blocks of 16, then 11 tokens of a fifth
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_k=40, seed=2)
    prompts = {f"c{i}": [*system, *prompt_of(6 + i, salt=20 + i)] for i in range(4)}
    samplings = {rid: GREEDY if i % 2 else seeded for i, rid in enumerate(prompts)}
    got: dict[str, tuple[int, list[int]]] = {}

    async def conversation(rid: str) -> None:
        got[rid] = await prefilled_from_cache(cached, rid, prompts[rid], samplings[rid])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(single, cached, RequestId("gate"), prompt_of(20, salt=9)))
        await trio.to_thread.run_sync(parked.wait, 30)
        for rid in prompts:
            nursery.start_soon(conversation, rid)
        with trio.fail_after(30):
            while cached._thread.queue.qsize() < len(prompts):  # every one queued behind the gate
                await trio.sleep(0.01)
        gate.set()
    assert sorted(cached for cached, _ in got.values()) == [0, 64, 64, 64]
    stats = cached.statistics()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.prefix_tokens_reused) == (5, 3, 3 * 64)
    for rid, (_, tokens) in got.items():
        assert tokens == (await prefilled_from_cache(plain, rid, prompts[rid], samplings[rid]))[1], rid


async def test_a_prompt_part_way_through_a_shared_document_skips_the_blocks_another_keeps_meanwhile(
    open_engine: Opener
) -> None:
    """A document longer than a step's budget: the first prompt computes it two blocks a step; a
    second one arriving after its second step starts after the four blocks kept by then, and,
    about to start its fifth, finds the blocks the first kept meanwhile and starts after those
    too: every block of the document is computed once, and the tokens are still the cache-less
    engine's, greedy and seeded."""
    path = cached_checkpoint("llama")
    gate, parked = threading.Event(), threading.Event()
    calls: list[str] = []

    def hook(stage: str, request_ids: Sequence[str]) -> None:
        if stage == "prefill" and list(request_ids) == ["a"]:
            calls.append("a")
            if len(calls) == 3 and not gate.is_set():  # the first call of its second step
                parked.set()
                gate.wait(30)

    steps = 4 + 2 * CHUNK  # beside a batch of 4, two whole blocks a step
    cached = await open_engine(path, model_call_hook=hook, max_batch=4, max_num_batched_tokens=steps)
    plain = await open_engine(path, prefix_cache_bytes=0, max_batch=4, max_num_batched_tokens=steps)
    document = prompt_of(6 * CHUNK, salt=7)  # six whole blocks
    prompts = {"a": [*document, *prompt_of(20, salt=1)], "b": [*document, *prompt_of(21, salt=2)]}
    samplings = {"a": GREEDY, "b": SamplingParams(max_tokens=8, temperature=1.0, top_k=40, seed=3)}
    got: dict[str, tuple[int, list[int]]] = {}

    async def request(rid: str) -> None:
        got[rid] = await prefilled_from_cache(cached, rid, prompts[rid], samplings[rid])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request, "a")
        await trio.to_thread.run_sync(parked.wait, 30)
        nursery.start_soon(request, "b")
        await release_when_queued(cached, gate, 1)
    assert got["a"][0] == 0 and got["b"][0] == 6 * CHUNK  # four at arrival, two found later
    stats = cached.statistics()
    assert (stats.prefix_cache_hits, stats.prefix_tokens_reused) == (1, 6 * CHUNK)
    for rid in prompts:
        assert got[rid][1] == (await prefilled_from_cache(plain, rid, prompts[rid], samplings[rid]))[1], rid


async def test_a_chunk_evaluated_a_layer_per_step_keeps_every_token_exact(open_engine: Opener) -> None:
    """A budget smaller than a chunk slices each chunk's evaluation by layers over several steps
    (streams decode in between); the graph is the one call's, so tokens equal mlx-lm's, seeded ones
    the unsliced engine's, and a budget below one layer's worth is refused at load."""
    path = cached_checkpoint("llama")  # 2 layers: a 16-token chunk is two units of 8
    sliced = await open_engine(path, max_batch=4, max_num_batched_tokens=4 + 8)
    whole = await open_engine(path, max_batch=4)
    prompts = {RequestId(f"p{n}"): prompt_of(n, salt=n) for n in (9, 33, 70)}
    steps_before = sliced.device_profile()["step"][0]
    results = await all_at_once(partial(single, sliced), prompts)
    assert results == {rid: reference(path, prompt) for rid, prompt in prompts.items()}
    # 70 tokens: four chunks of 16 and one of 5, two units each, and the last token: 11 units of
    # at most 8 tokens, one step each at least.
    assert sliced.device_profile()["step"][0] - steps_before >= 11
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_k=40, seed=5)
    prompt = prompt_of(50, salt=6)
    assert await single(sliced, RequestId("s"), prompt, seeded) == await single(
        whole, RequestId("s"), prompt, seeded)
    with pytest.raises(StatecoreError, match="at least one layer"):
        await open_engine(path, max_batch=4, max_num_batched_tokens=4 + 7)


async def test_a_step_target_slices_a_prompt_beside_a_stream_and_keeps_tokens_exact(
    open_engine: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a stream decodes, a step target smaller than any step leaves each step the decode
    rows and the oldest prompt's next unit (a whole chunk here), far below the configured budget;
    with no stream decoding, a step takes the whole budget. Off (0), every step takes the
    configured budget. Tokens equal mlx-lm's either way."""
    path = cached_checkpoint("llama")
    plans: list[tuple[int, int, int]] = []  # (budget tokens, decode rows, prefill tokens) per step

    def recorded(decode_rows: int, candidates: Any, budget: Any, **options: Any) -> StepPlan:
        plan = scheduled(decode_rows, candidates, budget, **options)
        if candidates:
            plans.append((plan.budget_tokens, decode_rows, plan.prefill_tokens))
        return plan

    monkeypatch.setattr(executor_module, "schedule", recorded)
    stream_sampling = SamplingParams(max_tokens=400, ignore_eos=True)
    stream_prompt, long = prompt_of(20, salt=4), prompt_of(200, salt=5)  # 13 chunks of 16, then the rest
    for target, sliced in ((0.001, True), (0.0, False)):
        engine = await open_engine(path, max_batch=4, step_target_ms=target)
        configured = engine._device.settings.max_num_batched_tokens
        plans.clear()
        async with trio.open_nursery() as nursery:
            streamed: list[list[int]] = []

            async def stream(engine: MlxEngine = engine, streamed: list[list[int]] = streamed) -> None:
                streamed.append(await single(engine, RequestId("stream"), stream_prompt, stream_sampling))

            nursery.start_soon(stream)
            with trio.fail_after(60):
                while engine.statistics().decoding < 1:
                    await trio.sleep(0.01)
            plans.clear()
            assert await single(engine, RequestId("long"), long) == reference(path, long)
        assert streamed == [reference(path, stream_prompt, stream_sampling.max_tokens)]
        beside = [plan for plan in plans if plan[1] > 0]
        assert beside, plans
        if sliced:
            assert all(budget <= rows + CHUNK and prefill <= CHUNK for budget, rows, prefill in beside), plans
            assert len(beside) >= len(long) // CHUNK
        else:
            assert all(budget == configured for budget, _, _ in plans), plans
            assert len(beside) == 1  # the whole prompt in one step


async def test_the_step_after_a_handed_off_request_joins_decodes_only(
    open_engine: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a prompt prefills a layer per step, a handed-off request joins: the step that follows
    computes no prefill (its second token waits for none), the prompt goes on after it, and both
    requests' tokens are exact."""
    path = cached_checkpoint("llama")
    plans: list[tuple[int, int, int]] = []  # (budget tokens, decode rows, prefill works) per step

    def recorded(decode_rows: int, candidates: Any, budget: Any, **options: Any) -> StepPlan:
        plan = scheduled(decode_rows, candidates, budget, **options)
        if candidates:
            plans.append((plan.budget_tokens, decode_rows, len(plan.prefills)))
        return plan

    monkeypatch.setattr(executor_module, "schedule", recorded)
    # A chunk a step and no prefix cache: a streamed prompt leaves in several pieces (a step's
    # chunks, cached ones included, go as one).
    source = await open_engine(path, max_batch=4, max_num_batched_tokens=4 + 16, prefix_cache_bytes=0)
    decode = await open_engine(path, max_batch=4, max_num_batched_tokens=4 + 8)
    newcomer, long = prompt_of(33, salt=7), prompt_of(1500, salt=8)  # ~190 steps: the install lands mid-way
    outcome = await source.prefill(RequestId("new"), newcomer, GREEDY)
    payload = (await source.export_held(RequestId("new"))).joined()
    await source.release_held(RequestId("new"))
    results: dict[str, list[int]] = {}

    async def prefill_long(prompt: list[int]) -> None:
        results["long"] = await single(decode, RequestId(f"long{len(results)}"), prompt)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(prefill_long, long)
        with trio.fail_after(60):
            while not plans:  # the long prompt is being prefilled, a layer a step
                await trio.sleep(0.01)
        await decode.install(RequestId("new"), payload, newcomer, outcome.first_token, GREEDY)
        results["new"] = [outcome.first_token, *(await collect(decode, RequestId("new"))).tokens]
    decode_only = [plan for plan in plans if plan[0] == plan[1]]
    assert len(decode_only) == 1 and decode_only[0][2] == 0, plans
    assert plans.index(decode_only[0]) < len(plans) - 1  # the prompt went on after it
    assert results == {"long": reference(path, long), "new": reference(path, newcomer)}

    # Streamed: from its last piece on, steps hold the prefill back until the request joins.
    outcome, pieces = await streamed_prefill(source, RequestId("piecewise"), newcomer, GREEDY)
    assert len(pieces) > 1
    for piece in pieces[:-1]:
        await decode.receive_segment(RequestId("piecewise"), piece, len(newcomer),
                                     max_tokens=GREEDY.max_tokens)
    plans.clear()
    another = prompt_of(1500, salt=9)  # not the first one, whose chunks the prefix cache now holds
    async with trio.open_nursery() as nursery:
        nursery.start_soon(prefill_long, another)
        with trio.fail_after(60):
            while not plans:
                await trio.sleep(0.01)
            await decode.receive_segment(RequestId("piecewise"), pieces[-1], len(newcomer),
                                         max_tokens=GREEDY.max_tokens)
            held_back = len(plans)
            while len(plans) < held_back + 2:  # two steps after the last piece, before the join
                await trio.sleep(0.001)
        assert all(budget == rows and works == 0 for budget, rows, works in plans[held_back:held_back + 2])
        await decode.install_segments(RequestId("piecewise"), newcomer, outcome.first_token, GREEDY)
        tokens = [outcome.first_token, *(await collect(decode, RequestId("piecewise"))).tokens]
    await source.release_held(RequestId("piecewise"))
    assert tokens == reference(path, newcomer)
    assert results["long"] == reference(path, another)  # it went on after the join
    assert not decode._device.handoffs_coming


async def test_a_failing_prefill_batch_is_retried_one_by_one(
    open_engine: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One bad batch never fails its rows: each prompt is computed again on its own."""
    from adapters.mlx import prefill_build

    path = cached_checkpoint("llama")
    engine = await open_engine(path)

    def broken(model: Any, tasks: Any, bucket: int = 0) -> None:
        raise RuntimeError("injected: the batched call failed")

    monkeypatch.setattr(prefill_build, "run_short_batch", broken)
    prompts = {RequestId(f"b{i}"): prompt_of(12 + i, salt=i) for i in range(3)}
    gate = await hold_device(engine)
    results: dict[RequestId, list[int]] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: _gather(results, all_at_once(partial(single, engine), prompts)))
        await release_when_queued(engine, gate, len(prompts))
    assert engine.device_profile()["prefill_batched"][0] == 0
    assert results == {rid: reference(path, prompt) for rid, prompt in prompts.items()}


# ---------------------------------------------------------------------------------------------
# Model calls that raise: a transient error fails no request, a poisoned row only itself


SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=11)
# Logits shaping: a bias that removes token 9, every penalty with its own context size.
SHAPED = SamplingParams(max_tokens=32, logit_bias=((5, 3.0), (9, -100.0)), repetition_penalty=1.5,
                        repetition_context_size=12, presence_penalty=0.7, presence_context_size=30,
                        frequency_penalty=0.4, frequency_context_size=8)
SHAPED_SEEDED = replace(SHAPED, max_tokens=24, temperature=0.9, min_p=0.05, seed=7, presence_penalty=4.0)


async def run_together(engine: MlxEngine, prompts: dict[RequestId, list[int]],
                       sampling: SamplingParams | Mapping[RequestId, SamplingParams]
                       ) -> dict[RequestId, list[int] | StatecoreError]:
    """Every prompt prefilled in one step, then every held cache set decoding in one step (the
    device is held until each phase's calls are all queued, so the rows join the batch together,
    whatever the event loop's timing), then decoded side by side (with `sampling`, or each with
    its own); each request's tokens, or the error it ended with."""
    got: dict[RequestId, list[int] | StatecoreError] = {}
    first: dict[RequestId, int] = {}

    def own(rid: RequestId) -> SamplingParams:
        return sampling if isinstance(sampling, SamplingParams) else sampling[rid]

    async def prefill(rid: RequestId) -> None:
        try:
            first[rid] = (await engine.prefill(rid, prompts[rid], own(rid))).first_token
        except StatecoreError as exc:
            got[rid] = exc

    async def decode(rid: RequestId) -> None:
        try:
            await engine.decode_held(rid, prompts[rid], first[rid], own(rid))
        except StatecoreError as exc:
            got[rid] = exc
            del first[rid]

    async def stream(rid: RequestId) -> None:
        try:
            got[rid] = [first[rid], *(await collect(engine, rid)).tokens]
        except StatecoreError as exc:
            got[rid] = exc

    for phase, rids in ((prefill, list(prompts)), (decode, None), (stream, None)):
        todo = list(first) if rids is None else rids
        gate = await hold_device(engine) if phase is not stream else None
        async with trio.open_nursery() as nursery:
            for rid in todo:
                nursery.start_soon(phase, rid)
            if gate is not None:
                await release_when_queued(engine, gate, len(todo))
    return got


def six_prompts(tag: str) -> dict[RequestId, list[int]]:
    return {RequestId(f"{tag}{i}"): prompt_of(9 + 4 * i, salt=i) for i in range(6)}


async def with_and_without(open_engine: Opener, path: Path, prompts: dict[RequestId, list[int]],
                           sampling: SamplingParams | Mapping[RequestId, SamplingParams],
                           hook: Callable[[str, Sequence[str]], None],
                           ) -> tuple[dict[RequestId, list[int] | StatecoreError],
                                      dict[RequestId, list[int] | StatecoreError], MlxEngine]:
    """The same prompts run together on a clean engine, then on one whose model calls go through
    `hook`: (clean results, hooked results, the hooked engine)."""
    expected = await run_together(await open_engine(path), prompts, sampling)
    engine = await open_engine(path, model_call_hook=hook)
    return expected, await run_together(engine, prompts, sampling), engine


def poisoning(poisoned: str, batch_sizes: list[int]) -> Callable[[str, Sequence[str]], None]:
    """A model-call hook whose every decode call that computes `poisoned` raises; each such
    call's number of rows goes into `batch_sizes`."""

    def poison(stage: str, request_ids: Sequence[str]) -> None:
        if stage == "decode" and poisoned in request_ids:
            batch_sizes.append(len(request_ids))
            raise RuntimeError("injected: this row always breaks its decode step")

    return poison


# Structured output (response_format): a bounded schema, so that a random tiny model finishes too.
BOUNDED_SCHEMA = {"type": "object",
                  "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
                  "required": ["ok", "color"], "additionalProperties": False}
JSON_SCHEMA = response_format_text("json_schema", BOUNDED_SCHEMA)
JSON_OBJECT = response_format_text("json_object")
# Rows under a grammar (greedy, seeded) between free ones, for the six prompts of `six_prompts("t")`.
CONSTRAINED_AMONG_FREE = {RequestId(f"t{i}"): sampling for i, sampling in enumerate(
    [replace(GREEDY, response_format=JSON_SCHEMA), GREEDY, SEEDED,
     replace(SEEDED, response_format=JSON_SCHEMA), replace(GREEDY, response_format=JSON_SCHEMA), SEEDED])}


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED, SHAPED_SEEDED, CONSTRAINED_AMONG_FREE],
                         ids=["greedy", "seeded", "shaped", "constrained"])
async def test_a_decode_step_that_raises_once_fails_no_request(
    open_engine: Opener, sampling: SamplingParams | Mapping[RequestId, SamplingParams]
) -> None:
    path = cached_checkpoint("llama")
    failed: list[list[str]] = []

    def once(stage: str, request_ids: Sequence[str]) -> None:
        if stage == "decode" and len(request_ids) > 1 and not failed:
            failed.append(list(request_ids))
            raise RuntimeError("injected: a transient error in a batched decode step")

    prompts = six_prompts("t")
    expected, got, engine = await with_and_without(open_engine, path, prompts, sampling, once)
    assert len(failed) == 1 and len(failed[0]) > 1  # it raised in a batch of several rows
    assert got == expected
    if sampling is GREEDY:
        assert got == {rid: reference(path, prompt) for rid, prompt in prompts.items()}
    stats = engine.statistics()
    assert (stats.step_retries, stats.rows_isolated) == (1, 0)


# The slot lane (llama) bisects the batch; mlx-lm's batch generator (gemma3's rotating caches,
# mamba2's arrays) steps each row alone once, and the rows that do not raise join it again.
POISON_CASES = [("llama", GREEDY), ("llama", SEEDED), ("gemma3_text", GREEDY), ("mamba2", GREEDY)]


@pytest.mark.parametrize(("family", "sampling"), POISON_CASES,
                         ids=["llama-greedy", "llama-seeded", "gemma3_text", "mamba2"])
async def test_a_poisoned_row_fails_alone_and_its_batch_decodes_on(open_engine: Opener, family: str,
                                                                   sampling: SamplingParams) -> None:
    path = cached_checkpoint(family)
    poisoned = RequestId("p3")
    batch_sizes: list[int] = []
    prompts = six_prompts("p")
    expected, got, engine = await with_and_without(open_engine, path, prompts, sampling,
                                                   poisoning(poisoned, batch_sizes))
    error = got.pop(poisoned)
    assert isinstance(error, StatecoreError) and error.info.code is Code.ENGINE_FAILED, error
    assert "RuntimeError" in error.info.message
    assert got == {rid: tokens for rid, tokens in expected.items() if rid != poisoned}
    assert max(batch_sizes) > 1 and batch_sizes[-1] == 1  # found in a batch, failed alone
    stats = engine.statistics()
    assert stats.rows_isolated == 1 and stats.step_retries >= 1 and stats.device_thread_alive
    assert await single(engine, RequestId("after"), prompt_of(20)) == reference(path, prompt_of(20))


async def test_a_transient_error_first_seen_while_isolating_a_poisoned_row_fails_nothing_else(
    open_engine: Opener,
) -> None:
    """The poisoned row raises first, so the transient one raises for the first time only once
    the rows are split: alone, it gets its second chance like any step."""
    path = cached_checkpoint("llama")
    poisoned, transient = RequestId("q0"), RequestId("q1")  # two rows: split, each is alone
    fired: list[str] = []

    def hook(stage: str, request_ids: Sequence[str]) -> None:
        if stage != "decode":
            return
        if poisoned in request_ids:
            raise RuntimeError("injected: poisoned")
        if transient in request_ids and not fired:
            fired.append(transient)
            raise RuntimeError("injected: transient")

    prompts = {rid: prompt for rid, prompt in six_prompts("q").items() if rid in (poisoned, transient)}
    expected, got, engine = await with_and_without(open_engine, path, prompts, GREEDY, hook)
    assert isinstance(got.pop(poisoned), StatecoreError)
    assert fired and got == {rid: tokens for rid, tokens in expected.items() if rid != poisoned}
    assert engine.statistics().rows_isolated == 1


class ThirdDecodeStepFails:
    """A model call hook: once `armed`, the third decode step's call is `failing` (for
    `FailingAttention`)."""

    def __init__(self) -> None:
        self.armed, self.decode_calls, self.failing = False, 0, False

    def hook(self, stage: str, request_ids: Sequence[str]) -> None:
        if self.armed and stage == "decode":
            self.decode_calls += 1
        self.failing = self.armed and stage == "decode" and self.decode_calls == 3


async def test_a_slot_step_that_fails_on_the_device_fails_its_rows_and_the_node_decodes_on_exactly(
    open_engine: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The third decode step of three rows fails when the device computes it (not while it is
    built), leaving NaN where it wrote their keys and values: those rows fail, typed; a prompt
    held meanwhile, and requests that come after, greedy and seeded, get the tokens of a node
    that never failed (a0 takes f0's slot, shorter than f0 was, and attends past its own length
    beside a1's longer row: masked, a NaN left there would still reach its values)."""
    path = cached_checkpoint("llama")
    failed_rows = {RequestId(f"f{i}"): prompt_of(50 + i, salt=i) for i in range(3)}
    after = {RequestId("a0"): prompt_of(20, salt=5), RequestId("a1"): prompt_of(70, salt=6)}
    sampling = {RequestId("a0"): GREEDY, RequestId("a1"): SEEDED}
    held_prompt = prompt_of(27, salt=7)
    clean = await open_engine(path)
    expected = await run_together(clean, after, sampling)
    expected_held = await single(clean, RequestId("h"), held_prompt, SEEDED)

    third = ThirdDecodeStepFails()
    engine = await open_engine(path, model_call_hook=third.hook)
    fault = FailingAttention(monkeypatch, lambda: third.failing, leaves_nan=True)
    held = await engine.prefill(RequestId("h"), held_prompt, SEEDED)
    third.armed = True
    got = await run_together(engine, failed_rows, GREEDY)
    assert fault.fired and third.decode_calls >= 3
    for rid in failed_rows:
        error = got[rid]
        assert isinstance(error, StatecoreError) and error.info.code is Code.ENGINE_FAILED, error
        assert "LU factorization" in error.info.message
    assert await run_together(engine, after, sampling) == expected
    await engine.decode_held(RequestId("h"), held_prompt, held.first_token, SEEDED)
    assert [held.first_token, *(await collect(engine, RequestId("h"))).tokens] == expected_held
    assert engine.statistics().device_thread_alive


async def test_a_slot_pool_that_cannot_be_allocated_again_fails_its_rows_and_the_node_decodes_on(
    open_engine: Opener, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As above, and the pool's buffers cannot be allocated again after the failed step (the
    device out of memory, as when another process holds it): the rows fail, typed, the device
    thread lives (it died of this on an H100 beside mlx_lm.server), and the requests after it get
    a clean node's tokens (the next to join allocates the pool)."""
    path = cached_checkpoint("llama")
    failed_rows = {RequestId(f"f{i}"): prompt_of(40 + i, salt=i) for i in range(3)}
    after = {RequestId("a0"): prompt_of(20, salt=5), RequestId("a1"): prompt_of(70, salt=6)}
    sampling = {RequestId("a0"): GREEDY, RequestId("a1"): SEEDED}
    clean = await open_engine(path)
    expected = await run_together(clean, after, sampling)

    third = ThirdDecodeStepFails()
    engine = await open_engine(path, model_call_hook=third.hook)
    fault = FailingAttention(monkeypatch, lambda: third.failing, leaves_nan=True)
    refused = [0]

    def out_of_memory(shape: Any, dtype: Any) -> Any:  # from the failed step on, while armed
        if fault.fired and third.armed:
            refused[0] += 1
            raise RuntimeError("[cuda::malloc] out of memory (a test's)")
        return mx.zeros(shape, dtype)

    monkeypatch.setattr(slots, "zeroed", out_of_memory)
    third.armed = True
    with caplog.at_level(logging.WARNING, logger="adapters.engine_mlx"):
        got = await run_together(engine, failed_rows, GREEDY)
    assert fault.fired and refused[0] >= 1
    for rid in failed_rows:
        error = got[rid]
        assert isinstance(error, StatecoreError) and error.info.code is Code.ENGINE_FAILED, error
    assert any("could not be allocated again" in message for message in caplog.messages)
    third.armed = False
    assert await run_together(engine, after, sampling) == expected
    assert engine.statistics().device_thread_alive


def wire_pieces(pieces: Sequence[KvSegment]) -> list[tuple[int, int, int, int, bytes]]:
    """Streamed pieces as (start, stop, first layer, end layer, payload), in order."""
    return sorted((p.start, p.stop, p.first_layer, p.end_layer, bytes(p.payload.joined())) for p in pieces)


async def test_a_row_that_joined_while_a_failing_step_ran_is_written_in_again_and_decodes_exactly(
    open_engine: Opener, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """r's decode step fails on the device beside a unit of a streamed prompt s (so, on the CPU,
    that step is read back only after the next is built), and j joins in between: the pool's
    buffers are lost with j's prompt in them, so j is written in again from its prompt's cache and
    decodes as on a node that never failed; r fails; s starts again, and its pieces (those of the
    failed step streamed once it is computed again) are a clean node's."""
    path = cached_checkpoint("llama")
    first, joining, streamed = prompt_of(30, salt=1), prompt_of(25, salt=2), prompt_of(400, salt=3)
    clean = await open_engine(path, max_batch=4, max_num_batched_tokens=4 + CHUNK)
    expected = await single(clean, RequestId("j"), joining, SEEDED)
    expected_s, clean_pieces = await streamed_prefill(clean, RequestId("s"), streamed, GREEDY)
    await clean.release_held(RequestId("s"))
    gate, fired = threading.Event(), [False]
    failing = [False]
    engines: list[MlxEngine] = []

    def hook(stage: str, request_ids: Sequence[str]) -> None:
        task = engines[0]._device.waiting.get("s") if engines else None
        failing[0] = (stage == "decode" and "r" in request_ids and not fired[0]
                      and task is not None and task.done_units > 0)
        if failing[0]:
            fired[0] = True
            gate.wait(30)  # j's join is queued meanwhile: it comes before the next step

    # One chunk of prefill a step: s takes many steps, beside r's.
    engine = await open_engine(path, model_call_hook=hook, max_batch=4, max_num_batched_tokens=4 + CHUNK)
    engines.append(engine)
    FailingAttention(monkeypatch, lambda: failing[0], leaves_nan=True)
    held = await engine.prefill(RequestId("j"), joining, SEEDED)
    got: dict[str, list[int] | StatecoreError] = {}

    async def run(rid: str, call: Callable[[], Awaitable[list[int]]]) -> None:
        try:
            got[rid] = await call()
        except StatecoreError as exc:
            got[rid] = exc

    async def decode_j() -> list[int]:
        await engine.decode_held(RequestId("j"), joining, held.first_token, SEEDED)
        return [held.first_token, *(await collect(engine, RequestId("j"))).tokens]

    pieces: list[KvSegment] = []

    async def prefill_s() -> list[int]:
        outcome, streamed_pieces = await streamed_prefill(engine, RequestId("s"), streamed, GREEDY)
        pieces.extend(streamed_pieces)
        await engine.release_held(RequestId("s"))
        return [outcome.first_token]

    with caplog.at_level(logging.WARNING, logger="adapters.engine_mlx"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "r", partial(single, engine, RequestId("r"), first,
                                                 replace(GREEDY, max_tokens=200)))
            with trio.fail_after(60):
                while "r" not in engine._device.live:
                    await trio.sleep(0.005)
                nursery.start_soon(run, "s", prefill_s)
                while not fired[0]:
                    await trio.sleep(0.005)
            nursery.start_soon(run, "j", decode_j)
            await release_when_queued(engine, gate, 1)
    error = got["r"]
    assert isinstance(error, StatecoreError) and error.info.code is Code.ENGINE_FAILED, error
    assert got["j"] == expected and got["s"] == [expected_s.first_token]
    assert wire_pieces(pieces) == wire_pieces(clean_pieces)
    assert "the slot pool's buffers start again empty; 1 of 1 rows written in again" in caplog.messages


async def test_a_prefill_step_that_fails_on_the_device_starts_its_prompt_again(
    open_engine: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """p's first prefill call fails when the device computes it, leaving NaN in what it computed
    (the blocks it kept among it): p starts again and gets a clean node's tokens, as does a later
    prompt that starts like p (from the prefix cache); q's every prefill call fails: q fails."""
    path = cached_checkpoint("llama")
    prompt, longer, other = prompt_of(40, salt=3), [*prompt_of(40, salt=3), 9, 8, 7], prompt_of(35, salt=4)
    clean = await open_engine(path)
    expected = await single(clean, RequestId("c"), prompt, SEEDED)
    expected_longer = await single(clean, RequestId("cl"), longer)
    calls: dict[str, int] = {}
    failing = [False]

    def hook(stage: str, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            calls[rid] = calls.get(rid, 0) + 1
        first_of_p = calls.get("p") == 1 and "p" in request_ids
        failing[0] = stage == "prefill" and (first_of_p or "q" in request_ids)

    engine = await open_engine(path, model_call_hook=hook)
    fault = FailingAttention(monkeypatch, lambda: failing[0], leaves_nan=True)
    assert await single(engine, RequestId("p"), prompt, SEEDED) == expected
    assert fault.fired and engine.statistics().step_retries == 1
    assert await single(engine, RequestId("l"), longer) == expected_longer
    with pytest.raises(StatecoreError, match="LU factorization") as failed:
        await single(engine, RequestId("q"), other)
    assert failed.value.info.code is Code.ENGINE_FAILED


async def test_a_prefill_that_raises_once_starts_again_and_one_that_keeps_raising_fails_alone(
    open_engine: Opener,
) -> None:
    path = cached_checkpoint("llama")
    flaky, broken = RequestId("f1"), RequestId("f4")
    raised: list[str] = []

    def hook(stage: str, request_ids: Sequence[str]) -> None:
        if stage != "prefill":
            return
        if broken in request_ids or (flaky in request_ids and flaky not in raised):
            raised.extend(request_ids)
            raise RuntimeError("injected: a prefill call raised")

    # Long prompts (several chunks each) so that each is prefilled on its own, chunk by chunk.
    prompts = {RequestId(f"f{i}"): prompt_of(40 + 5 * i, salt=i) for i in range(6)}
    engine = await open_engine(path, model_call_hook=hook)
    got = await run_together(engine, prompts, GREEDY)
    error = got.pop(broken)
    assert isinstance(error, StatecoreError) and error.info.code is Code.INTERNAL, error
    assert got == {rid: reference(path, p) for rid, p in prompts.items() if rid != broken}
    assert raised.count(flaky) == 1 and raised.count(broken) == 2  # the broken one: tried twice
    assert engine.statistics().step_retries == 2


class _RaisingLayer:
    """Stands in for one of the model's layers: raises when `fires(inputs)` says so, after the
    layers before it have advanced their caches (a call that fails part-way through)."""

    def __init__(self, inner: Any, fires: Callable[[Any], bool]) -> None:
        self.inner, self.fires = inner, fires

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if self.fires(x):
            raise RuntimeError("injected: a layer raised part-way through the model call")
        return self.inner(x, *args, **kwargs)


def raise_part_way(engine: MlxEngine, fires: Callable[[Any], bool]) -> None:
    """Make the engine's model raise inside its last layer whenever `fires(layer input)`."""
    model = engine._device.model
    layers = getattr(model, "_model", model).layers
    layers[-1] = _RaisingLayer(layers[-1], fires)


# gemma3's sliding layers (rotating caches, wrapped past 16 tokens) and mamba2's arrays decode in
# mlx-lm's batch generator: a failed step there is undone and retried, then split row by row.
MERGE_FAMILIES = ["gemma3_text", "mamba2"]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED, SHAPED_SEEDED], ids=["greedy", "seeded", "shaped"])
@pytest.mark.parametrize("family", MERGE_FAMILIES)
async def test_a_batch_generator_step_that_raises_part_way_fails_no_request(
    open_engine: Opener, family: str, sampling: SamplingParams
) -> None:
    path = cached_checkpoint(family)
    prompts = six_prompts("m")
    expected = await run_together(await open_engine(path), prompts, sampling)
    engine = await open_engine(path)
    batched_decodes: list[int] = []

    def third_batched_decode(x: Any) -> bool:
        if x.shape[0] > 1 and x.shape[1] == 1:
            batched_decodes.append(x.shape[0])
            return len(batched_decodes) == 3
        return False

    raise_part_way(engine, third_batched_decode)
    got = await run_together(engine, prompts, sampling)
    assert got == expected
    stats = engine.statistics()
    assert (stats.step_retries, stats.rows_isolated) == (1, 0)


async def test_a_batch_generator_step_that_fails_on_the_device_once_fails_no_request(
    open_engine: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch lane evaluates its step in the call: a step that fails on the device (leaving NaN
    where it wrote) is undone from its checkpoint and computed again, as one that raises while it
    is built; no request fails and every token is a clean node's."""
    from mlx_lm.models import gemma3_text

    path = cached_checkpoint("gemma3_text")
    prompts = six_prompts("g")
    expected = await run_together(await open_engine(path), prompts, SEEDED)
    batched_decodes, failing = [0], [False]

    def hook(stage: str, request_ids: Sequence[str]) -> None:
        if stage == "decode" and len(request_ids) > 1:
            batched_decodes[0] += 1
        failing[0] = stage == "decode" and len(request_ids) > 1 and batched_decodes[0] == 3

    engine = await open_engine(path, model_call_hook=hook)
    fault = FailingAttention(monkeypatch, lambda: failing[0], leaves_nan=True, module=gemma3_text)
    assert await run_together(engine, prompts, SEEDED) == expected
    assert fault.fired
    stats = engine.statistics()
    assert (stats.step_retries, stats.rows_isolated) == (1, 0)


async def test_an_install_whose_copy_raises_once_still_decodes_exactly(
    open_engine: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    from adapters.mlx.slots import SlotPool

    path = cached_checkpoint("llama")
    prefill_node, decode_node = await open_engine(path), await open_engine(path)
    copies: list[int] = []
    write = SlotPool.write_prompt

    def flaky(pool: SlotPool, slot: int, layers: Any, tokens: int) -> None:
        copies.append(slot)
        if len(copies) == 1:
            raise RuntimeError("injected: the copy into the slot failed")
        write(pool, slot, layers, tokens)

    monkeypatch.setattr(SlotPool, "write_prompt", flaky)
    prompt = prompt_of(33)
    assert await handoff(prefill_node, decode_node, RequestId("i1"), prompt) == reference(path, prompt)
    assert len(copies) == 2 and decode_node.statistics().step_retries == 1


# ---------------------------------------------------------------------------------------------
# KV memory admission: every cache reserved at its worst case before anything is allocated

# The tiny llama's KV cache: 512 bytes per position (2 layers, float32). With 32 slots, a budget
# under 2 x 32 x 64 x 512 bytes leaves no room for the slot layout.
SMALL_BUDGET = 1_000_000  # no slots; 1,000,000 // (512 x (tokens + 256)) requests of their own


async def test_a_request_that_could_never_fit_is_refused_at_once(open_engine: Opener) -> None:
    engine = await open_engine(cached_checkpoint("llama"), kv_memory_bytes=SMALL_BUDGET)
    assert engine.statistics().kv_budget_bytes == SMALL_BUDGET  # nothing set aside: no slots
    for prompt, max_tokens in ((2000, 8), (20, 2000)):  # the prompt alone, or with its output
        with pytest.raises(StatecoreError) as caught:
            await engine.prefill(RequestId(f"big{prompt}"), prompt_of(prompt), SamplingParams(max_tokens))
        assert caught.value.info.code is Code.KV_MEMORY_EXCEEDED and caught.value.info.http_status == 400
        assert "--kv-memory-bytes" in caught.value.info.message
    assert holdings(engine) == IDLE


async def test_requests_beyond_the_kv_budget_wait_their_turn(open_engine: Opener) -> None:
    """Six requests of 9..29 + 32 tokens each reserve 512 x (their tokens + 256) bytes, about
    157,000, from their prefill on (they will decode outside the slots): three fit a budget of
    600,000; the others are refused as OVERLOADED (429) and fit once those leave."""
    path = cached_checkpoint("llama")
    engine = await open_engine(path, kv_memory_bytes=600_000)
    prompts = six_prompts("m")
    got = await run_together(engine, prompts, GREEDY)
    refused = {rid: e for rid, e in got.items() if isinstance(e, StatecoreError)}
    assert len(refused) == 3, got
    assert {e.info.code for e in refused.values()} == {Code.OVERLOADED}
    assert {e.info.http_status for e in refused.values()} == {429}
    for rid, tokens in got.items():
        if rid not in refused:
            assert tokens == reference(path, prompts[rid])
    await flush(engine)
    assert holdings(engine) == IDLE  # every reservation went back
    for rid in refused:  # one at a time they all fit
        assert await single(engine, rid, prompts[rid]) == reference(path, prompts[rid])


async def test_the_slot_layout_shrinks_to_half_the_budget_and_longer_rows_decode_beside_it(
    open_engine: Opener,
) -> None:
    path = cached_checkpoint("llama")
    budget = 2 * 32 * 128 * 512  # half of it: 32 slots of 128 positions
    engine = await open_engine(path, kv_memory_bytes=budget)
    assert engine.statistics().kv_budget_bytes == budget // 2
    short, long = prompt_of(30), prompt_of(120, salt=3)  # 30 + 32 fits a slot; 120 + 32 does not
    got = await all_at_once(partial(single, engine), {RequestId("short"): short, RequestId("long"): long})
    assert got == {RequestId("short"): reference(path, short), RequestId("long"): reference(path, long)}


async def hold_device(engine: MlxEngine) -> threading.Event:
    """Block the device thread (inside a job, its queue drained) until the returned event is set."""
    running, gate = threading.Event(), threading.Event()

    def hold() -> None:
        running.set()
        gate.wait()

    engine._thread.post_nowait(commands.Inspect(hold))
    while not running.is_set():
        await trio.sleep(0.005)
    return gate


async def release_when_queued(engine: MlxEngine, gate: threading.Event, jobs: int) -> None:
    """Set `gate` once `jobs` jobs wait behind it (polled)."""
    while engine._thread.queue.qsize() < jobs:
        await trio.sleep(0.005)
    gate.set()


async def _gather(into: dict[RequestId, list[int]], results: Awaitable[dict[RequestId, list[int]]]) -> None:
    into.update(await results)


# ---------------------------------------------------------------------------------------------
# Seeded sampling


async def test_seeded_sampling_is_placement_independent(open_engine: Opener) -> None:
    path = cached_checkpoint("llama")
    prefill_node = await open_engine(path)
    decode_node = await open_engine(path)
    prompt = prompt_of(33)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=40, seed=1234)

    alone = await single(prefill_node, RequestId("a"), prompt, seeded)
    handed = await handoff(prefill_node, decode_node, RequestId("b"), prompt, seeded)
    assert alone == handed
    assert not is_degenerate(alone)
    assert alone != reference(path, prompt, 24)  # it really sampled

    # Inside a batch of other requests (greedy and sampled neighbours).
    neighbours = {
        RequestId("n0"): SamplingParams(max_tokens=40),
        RequestId("n1"): SamplingParams(max_tokens=40, temperature=0.7, seed=5),
    }
    batched: list[int] = []
    async with trio.open_nursery() as nursery:
        for i, (rid, sampling) in enumerate(neighbours.items()):
            outcome = await decode_node.prefill(rid, prompt_of(20, salt=i), sampling)
            await decode_node.decode_held(rid, prompt_of(20, salt=i), outcome.first_token, sampling)
            nursery.start_soon(collect, decode_node, rid)
        batched = await handoff(prefill_node, decode_node, RequestId("c"), prompt, seeded)
    assert batched == alone

    other_seed = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=40, seed=99)
    assert await single(decode_node, RequestId("d"), prompt, other_seed) != alone


async def test_unseeded_sampling_derives_its_seed_from_the_request_id(
    open_engine: Opener,
) -> None:
    path = cached_checkpoint("qwen3")
    prefill_node = await open_engine(path)
    decode_node = await open_engine(path)
    prompt = prompt_of(20)
    unseeded = SamplingParams(max_tokens=16, temperature=0.8)
    first = await single(prefill_node, RequestId("same"), prompt, unseeded)
    again = await handoff(prefill_node, decode_node, RequestId("same"), prompt, unseeded)
    assert first == again
    assert await single(decode_node, RequestId("other"), prompt, unseeded) != first


# ---------------------------------------------------------------------------------------------
# Logits shaping: logit_bias and penalties (greedy rows too), min_p

def shaped_reference(model_dir: Path, prompt: Sequence[int], sampling: SamplingParams) -> list[int]:
    """mlx-lm's generate_step with mlx-lm's own logits processors, each looking at the last
    tokens of prompt + generated (generate_step hands them only what follows the prompt's last
    token, so the rest of the prompt is put in front)."""
    from mlx_lm.sample_utils import make_logits_processors

    reference(model_dir, [1])  # loads the model
    model = _REFERENCE_MODELS[(model_dir, False)]
    head = mx.array(list(prompt[:-1]))
    processors = make_logits_processors(
        logit_bias=dict(sampling.logit_bias), repetition_penalty=sampling.repetition_penalty,
        repetition_context_size=sampling.repetition_context_size, presence_penalty=sampling.presence_penalty,
        presence_context_size=sampling.presence_context_size, frequency_penalty=sampling.frequency_penalty,
        frequency_context_size=sampling.frequency_context_size)

    def with_prompt(processor: Any) -> Any:
        return lambda tokens, logits: processor(mx.concatenate([head, tokens]), logits)

    steps = generate_step(mx.array(list(prompt)), model, max_tokens=sampling.max_tokens,
                          prefill_step_size=CHUNK,
                          logits_processors=[with_prompt(p) for p in processors])
    return [int(token) for token, _ in steps]


# One model per lane: llama (slots), gemma3 (mlx-lm's batch generator), llama4 (solo).
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "llama4"])
async def test_shaped_greedy_rows_decode_as_mlx_lms_processors_say(
    open_engine: Opener, fresh_dirs: dict[str, Path], family: str
) -> None:
    path = fresh_dirs.get(family) or cached_checkpoint(family)
    prompts = six_prompts("s")
    engine = await open_engine(path)
    got = await run_together(engine, prompts, SHAPED)
    assert got == {rid: shaped_reference(path, prompt, SHAPED) for rid, prompt in prompts.items()}
    plain = {rid: reference(path, prompt) for rid, prompt in prompts.items()}
    assert sum(got[rid] != plain[rid] for rid in prompts) >= 3  # the shaping changed the output
    assert all(9 not in tokens for tokens in got.values() if isinstance(tokens, list))  # biased out


XTC_SEEDED = replace(SHAPED_SEEDED, xtc_probability=0.5, xtc_threshold=0.01, xtc_special_tokens=(1,))


@pytest.mark.parametrize("sampling", [SHAPED, SHAPED_SEEDED, XTC_SEEDED], ids=["greedy", "seeded", "xtc"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "llama4"])
async def test_shaped_sampling_through_a_handoff_equals_one_node(
    open_engine: Opener, fresh_dirs: dict[str, Path], family: str, sampling: SamplingParams
) -> None:
    """The penalties look back on prompt and generated tokens: the decode node starts from the
    prompt and the first token, and draws what the single node draws."""
    path = fresh_dirs.get(family) or cached_checkpoint(family)
    prefill_node, decode_node = await open_engine(path), await open_engine(path)
    prompt = prompt_of(40, salt=3)
    alone = await single(prefill_node, RequestId("a"), prompt, sampling)
    assert await handoff(prefill_node, decode_node, RequestId("a"), prompt, sampling) == alone
    unshaped = replace(sampling, logit_bias=(), repetition_penalty=0.0, presence_penalty=0.0,
                       frequency_penalty=0.0)
    assert alone != await single(prefill_node, RequestId("a"), prompt, unshaped)


# ---------------------------------------------------------------------------------------------
# Logprobs: each token's log-probability and the most likely alternatives


async def run_request(engine: MlxEngine, rid: RequestId, prompt: Sequence[int], sampling: SamplingParams,
                      decode: MlxEngine | None = None) -> tuple[Any, Streamed]:
    """(the prefill's outcome, every token after the first); with `decode`, decoded there after a
    handoff, else where it was prefilled."""
    outcome = await engine.prefill(rid, prompt, sampling)
    if decode is None:
        await engine.decode_held(rid, prompt, outcome.first_token, sampling)
    else:
        payload = (await engine.export_held(rid)).joined()
        await engine.release_held(rid)
        await decode.install(rid, payload, prompt, outcome.first_token, sampling)
    return outcome, await collect(decode or engine, rid)


async def logprobs_of(engine: MlxEngine, rid: RequestId, prompt: Sequence[int], sampling: SamplingParams,
                      decode: MlxEngine | None = None) -> list[tuple[int, Any]]:
    """(token, its TokenLogprobs) for every token, the first from the prefill."""
    outcome, rest = await run_request(engine, rid, prompt, sampling, decode)
    return [(outcome.first_token, outcome.first_logprobs), *zip(rest.tokens, rest.logprobs, strict=True)]


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "llama4"])
async def test_logprobs_are_mlx_lms_and_equal_after_a_handoff(
    open_engine: Opener, fresh_dirs: dict[str, Path], family: str
) -> None:
    path = fresh_dirs.get(family) or cached_checkpoint(family)
    prefill_node, decode_node = await open_engine(path), await open_engine(path)
    prompt = prompt_of(30, salt=2)
    sampling = SamplingParams(max_tokens=12, logprobs=4)
    alone = await logprobs_of(prefill_node, RequestId("a"), prompt, sampling)
    handed = await logprobs_of(prefill_node, RequestId("b"), prompt, sampling, decode=decode_node)
    assert handed == alone  # the same floats, to the bit
    reference(path, [1])  # loads the model
    steps = generate_step(mx.array(prompt), _REFERENCE_MODELS[(path, False)], max_tokens=12,
                          prefill_step_size=CHUNK)
    for (token, logprobs), (expected, row) in zip(alone, steps, strict=True):
        assert token == int(expected) and logprobs is not None
        assert logprobs.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert logprobs.top[0][0] == token  # greedy: the most likely one
        values = [v for _, v in logprobs.top]
        assert len(values) == 4 and values == sorted(values, reverse=True)
        assert values == pytest.approx(sorted(np.array(row).tolist(), reverse=True)[:4], abs=1e-4)
    plain = await logprobs_of(prefill_node, RequestId("c"), prompt, replace(sampling, logprobs=None))
    assert [t for t, _ in plain] == [t for t, _ in alone] and all(lp is None for _, lp in plain)


async def test_seeded_logprobs_in_a_batch_come_with_every_token(open_engine: Opener) -> None:
    engine = await open_engine(cached_checkpoint("llama"))
    sampling = SamplingParams(max_tokens=10, temperature=0.8, seed=3, logprobs=0)
    got: dict[RequestId, list[tuple[int, Any]]] = {}

    async def one(rid: RequestId, prompt: list[int]) -> None:
        got[rid] = await logprobs_of(engine, rid, prompt, sampling)

    async with trio.open_nursery() as nursery:  # side by side: one batch
        for i in range(4):
            nursery.start_soon(one, RequestId(f"l{i}"), prompt_of(10 + i, salt=i))
    assert len(got) == 4
    for pairs in got.values():
        assert len(pairs) == 10
        for _, logprobs in pairs:
            assert logprobs is not None and logprobs.top == () and logprobs.logprob <= 0.0


# ---------------------------------------------------------------------------------------------
# n > 1: the choices of one request enter a batched lane together: the slot lane (llama), mlx-lm's
# batch generator (gemma3's rotating caches)


def choice_of(group: str, choice: int) -> SamplingParams:
    """Choice `choice` of a seeded n = 2 request with logprobs (seed + i, as the front end makes it)."""
    return SamplingParams(max_tokens=12, temperature=0.8, seed=3 + choice, logprobs=2,
                          choice_group=group, choice=choice, choices=2)


async def steps_taken_or_gathering(engine: MlxEngine, steps: int) -> None:
    """Until the device ran `steps` more steps, or holds choices waiting for each other (it takes
    no step for them until all come), or has nothing left to decode."""
    start = engine.device_profile()["step"][0]
    while (engine.device_profile()["step"][0] < start + steps and not engine._device.gathering
           and engine.statistics().decoding):
        await trio.sleep(0.005)


async def choices_decoded(engine: MlxEngine, group: str, prompt: Sequence[int], order: Sequence[int],
                          steps_apart: int, decode: MlxEngine | None = None) -> list[list[tuple[int, Any]]]:
    """Each choice's (token, logprobs), the first from its prefill: both choices prefilled on
    `engine` (one after the other, or with `steps_apart` 0 queued in one step), then put into the
    decoder (there, or on `decode` after a handoff) in `order`, `steps_apart` device steps apart
    (as their prefills may finish on a loaded node)."""
    target = decode or engine
    rids = {c: RequestId(group if c == 0 else f"{group}.{c}") for c in order}
    firsts: dict[int, Any] = {}

    async def prefill(choice: int) -> None:
        firsts[choice] = await engine.prefill(rids[choice], prompt, choice_of(group, choice))

    if steps_apart:
        for c in order:
            await prefill(c)
    else:
        gate = await hold_device(engine)
        async with trio.open_nursery() as nursery:
            for c in order:
                nursery.start_soon(prefill, c)
            await release_when_queued(engine, gate, len(order))
    rest: dict[int, Streamed] = {}

    async def drain(choice: int) -> None:
        rest[choice] = await collect(target, rids[choice])

    async with trio.open_nursery() as nursery:
        for c in order:
            if decode is None:
                await engine.decode_held(rids[c], prompt, firsts[c].first_token, choice_of(group, c))
            else:
                payload = (await engine.export_held(rids[c])).joined()
                await engine.release_held(rids[c])
                await decode.install(rids[c], payload, prompt, firsts[c].first_token, choice_of(group, c))
            nursery.start_soon(drain, c)
            if c != order[-1]:
                await steps_taken_or_gathering(target, steps_apart)
    return [[(firsts[c].first_token, firsts[c].first_logprobs),
             *zip(rest[c].tokens, rest[c].logprobs, strict=True)] for c in sorted(order)]


# llama: a prompt of one chunk (short prompts waiting together may share a padded prefill call);
# gemma3: one past its sliding window (16).
@pytest.mark.parametrize(("family", "length"), [("llama", 14), ("gemma3_text", 40)])
async def test_the_choices_of_one_request_decode_the_same_bytes_however_they_arrive(
    open_engine: Opener, family: str, length: int
) -> None:
    path = cached_checkpoint(family)
    decodes: list[frozenset[str]] = []  # the requests each decode call computed

    def note(stage: str, request_ids: Sequence[str]) -> None:
        if stage == "decode":
            decodes.append(frozenset(request_ids))

    engine = await open_engine(path, model_call_hook=note)
    decode_node = await open_engine(path, model_call_hook=note)
    prompt = prompt_of(length, salt=1)
    arrivals = [((0, 1), 3), ((0, 1), 0), ((1, 0), 2), ((0, 1), 6), ((1, 0), 0)]
    runs = [await choices_decoded(engine, f"r{i}", prompt, order, apart)
            for i, (order, apart) in enumerate(arrivals)]
    handed = await choices_decoded(engine, "h", prompt, (0, 1), 4, decode=decode_node)
    for run in [*runs[1:], handed]:
        assert run == runs[0]  # every token and every logprob float, to the bit
    assert runs[0][0] != runs[0][1]  # the choices differ
    # From its first decode call on, a request's choices decode side by side. (The reference BLAS
    # of these tests keeps a slot-lane row's bits when it decodes alone; OpenBLAS does not.)
    for group in [*(f"r{i}" for i in range(len(arrivals))), "h"]:
        first = next(ids for ids in decodes if group in ids or f"{group}.1" in ids)
        assert first == {group, f"{group}.1"}, first
    # Queued together, the choices' prefills never shared a padded call: under OpenBLAS its rows
    # differ from a prompt's own call in their last bits.
    assert engine.device_profile()["prefill_batched"][0] == 0
    assert all(len(choice) == 12 and all(lp is not None for _, lp in choice) for choice in runs[0])


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
async def test_a_choice_waits_for_its_siblings_only_while_they_may_come(
    open_engine: Opener, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    engine = await open_engine(cached_checkpoint(family))
    prompt = prompt_of(40)
    # Choice 1 never reaches this node (another one decodes it): choice 0 waits its patience out.
    monkeypatch.setattr(choices_module, "CHOICE_PATIENCE_S", 0.2)
    _, alone = await run_request(engine, RequestId("p"), prompt, choice_of("p", 0))
    assert len(alone.tokens) == 11 and alone.finish == "length"
    # Choice 1 ends at its first token (its held cache is released): nobody waits for it.
    monkeypatch.setattr(choices_module, "CHOICE_PATIENCE_S", 600.0)
    first = await engine.prefill(RequestId("e"), prompt, choice_of("e", 0))
    await engine.prefill(RequestId("e.1"), prompt, choice_of("e", 1))
    await engine.decode_held(RequestId("e"), prompt, first.first_token, choice_of("e", 0))
    assert engine._device.gathering  # choice 1 is held here: on its way
    await engine.release_held(RequestId("e.1"))
    with trio.fail_after(60):
        assert len((await collect(engine, RequestId("e"))).tokens) == 11
    # Cancelled while it waits: it leaves, and holds nothing.
    first = await engine.prefill(RequestId("c"), prompt, choice_of("c", 0))
    await engine.decode_held(RequestId("c"), prompt, first.first_token, choice_of("c", 0))
    await engine.cancel(RequestId("c"))
    await flush(engine)
    assert not engine._device.gathering and holdings(engine) == IDLE


# ---------------------------------------------------------------------------------------------
# Structured output: response_format by constrained decoding


def bounded_answer(doc: object) -> bool:
    """`doc` validates against BOUNDED_SCHEMA."""
    return (isinstance(doc, dict) and set(doc) == {"ok", "color"} and isinstance(doc["ok"], bool)
            and doc["color"] in ("red", "green", "blue"))


def an_object(doc: object) -> bool:
    return isinstance(doc, dict)


VALID: dict[str, Callable[[object], bool]] = {JSON_SCHEMA: bounded_answer, JSON_OBJECT: an_object}
# A random model's free JSON object may never close (a string of random letters runs to max_tokens):
# on this prompt both tiny models close it at once; the bounded schema always ends.
PROMPTS = {JSON_SCHEMA: prompt_of(30, salt=5), JSON_OBJECT: prompt_of(30)}


async def finished(engine: MlxEngine, rid: RequestId, prompt: Sequence[int], sampling: SamplingParams,
                   decode: MlxEngine | None = None) -> tuple[list[int], str | None]:
    """Every token sent and the finish reason; with `decode`, decoded there after a handoff."""
    outcome, items = await run_request(engine, rid, prompt, sampling, decode)
    return [outcome.first_token, *items.tokens], items.finish


def json_of(path: Path, tokens: Sequence[int], eos: frozenset[int]) -> object:
    """The output's text, parsed as JSON (its ending EOS is never sent)."""
    assert not eos & set(tokens)
    return json.loads(load_tokenizer(path).decode(list(tokens)))  # type: ignore[no-untyped-call]


# llama decodes constrained rows in the slot lane, gemma3 (mlx-lm's batch generator) in the solo lane.
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
async def test_structured_output_parses_validates_and_is_the_same_after_a_handoff(
    open_engine: Opener, family: str
) -> None:
    path = cached_checkpoint(family)
    prefill_node, decode_node = await open_engine(path), await open_engine(path)
    eos = prefill_node.info.eos_token_ids
    for sampling in (replace(GREEDY, max_tokens=48), replace(SEEDED, max_tokens=48)):
        for response_format, valid in VALID.items():
            prompt = PROMPTS[response_format]
            constrained = replace(sampling, response_format=response_format)
            alone, finish = await finished(prefill_node, RequestId("a"), prompt, constrained)
            assert finish == "stop", (sampling, response_format, alone)
            doc = json_of(path, alone, eos)
            assert valid(doc), doc
            handed = await finished(prefill_node, RequestId("a"), prompt, constrained, decode=decode_node)
            assert handed == (alone, "stop")
        free, _ = await finished(prefill_node, RequestId("f"), prompt, sampling)
        assert free[: len(alone)] != alone  # the grammar made the difference
    # A first token the grammar refuses is a client error, and the cache stays held for a good one.
    prompt, schema_bound = PROMPTS[JSON_SCHEMA], replace(GREEDY, response_format=JSON_SCHEMA)
    outcome = await prefill_node.prefill(RequestId("b"), prompt, schema_bound)
    with pytest.raises(StatecoreError) as caught:
        await prefill_node.decode_held(RequestId("b"), prompt, 9, schema_bound)
    assert caught.value.info.fault is Fault.CLIENT and caught.value.info.param == "response_format"
    await prefill_node.decode_held(RequestId("b"), prompt, outcome.first_token, schema_bound)
    rest = (await collect(prefill_node, RequestId("b"))).tokens
    assert bounded_answer(json_of(path, [outcome.first_token, *rest], eos))


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
async def test_a_step_that_raises_after_a_grammar_took_its_token_is_rolled_back(
    open_engine: Opener, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """The draw of a constrained row raises once after its grammar consumed the token before (in
    the slot lane the batch's call, in the solo lane the row's, is computed again): the grammar
    rolls back with the rest of the sampler, and every output is as without the error."""
    path = cached_checkpoint(family)
    prompts = six_prompts("t")
    expected = await run_together(await open_engine(path), prompts, CONSTRAINED_AMONG_FREE)
    engine = await open_engine(path)
    draw = PositionSampler.next_token
    raised: list[int] = []

    def raising_once(sampler: PositionSampler, logits: Any) -> Any:
        token = draw(sampler, logits)
        constraint = sampler.constraint
        if constraint is not None and constraint.mark()[0] >= 3 and not raised:  # decoding, mid-JSON
            raised.append(sampler.position)
            raise RuntimeError("injected: a draw raised after its grammar took the previous token")
        return token

    monkeypatch.setattr(PositionSampler, "next_token", raising_once)
    assert await run_together(engine, prompts, CONSTRAINED_AMONG_FREE) == expected
    assert raised and engine.statistics().step_retries == 1


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
async def test_constrained_rows_leave_the_free_rows_beside_them_as_they_were(
    open_engine: Opener, family: str
) -> None:
    path = cached_checkpoint(family)
    engine = await open_engine(path)
    prompts = six_prompts("t")
    formats = {rid: sampling.response_format for rid, sampling in CONSTRAINED_AMONG_FREE.items()}
    free = {rid: prompt for rid, prompt in prompts.items() if formats[rid] is None}
    alone = await run_together(engine, free, CONSTRAINED_AMONG_FREE)
    together = await run_together(engine, prompts, CONSTRAINED_AMONG_FREE)
    assert {rid: together[rid] for rid in free} == alone
    if family == "llama":
        assert alone[RequestId("t1")] == reference(path, prompts[RequestId("t1")])
    for rid in prompts.keys() - free.keys():
        tokens = together[rid]
        assert isinstance(tokens, list)
        assert VALID[str(formats[rid])](json_of(path, tokens, engine.info.eos_token_ids))


# ---------------------------------------------------------------------------------------------
# Quantized KV: the solo lane


@pytest.mark.parametrize("kv_bits", [4, 8])
async def test_quantized_solo_lane_matches_single_node(
    open_engine: Opener, quantizable_dir: Path, kv_bits: int
) -> None:
    prefill_node = await open_engine(quantizable_dir, kv_bits=kv_bits)
    decode_node = await open_engine(quantizable_dir, kv_bits=kv_bits)
    assert {layer.class_name for layer in decode_node.info.layers} == {"QuantizedKVCache"}
    assert decode_node.info.can_travel
    plain = await open_engine(quantizable_dir)
    assert plain.info.fingerprint != decode_node.info.fingerprint

    prompts = {RequestId("q0"): prompt_of(40), RequestId("q1"): prompt_of(9, salt=3)}
    expected = {rid: reference(quantizable_dir, prompt, kv_bits=kv_bits) for rid, prompt in prompts.items()}
    for rid, prompt in prompts.items():
        assert await single(prefill_node, rid, prompt) == expected[rid]
    if kv_bits == 4:  # 4-bit KV really changes the tokens (8-bit happens not to, here)
        assert expected[RequestId("q0")] != reference(quantizable_dir, prompts[RequestId("q0")])

    # Two quantized requests decoding side by side, next to a request in the batch
    # (unquantized engines batch; here everything goes through the solo lane).
    assert await all_at_once(partial(handoff, prefill_node, decode_node), prompts) == expected


async def test_kv_bits_refused_at_load_when_a_cache_cannot_quantize(
    open_engine: Opener,
) -> None:
    with pytest.raises(StatecoreError) as caught:
        await open_engine(cached_checkpoint("gemma3_text"), kv_bits=4)
    assert caught.value.info.code is Code.UNSUPPORTED_CACHE
    assert "RotatingKVCache" in caught.value.info.message


async def test_state_space_model_with_kv_bits_still_batches(open_engine: Opener) -> None:
    path = cached_checkpoint("mamba2")  # ArraysCache only: nothing to quantize
    prefill_node = await open_engine(path, kv_bits=8)
    decode_node = await open_engine(path, kv_bits=8)
    prompt = prompt_of(33)
    assert await handoff(prefill_node, decode_node, RequestId("m"), prompt) == reference(
        path, prompt, kv_bits=8
    )


# ---------------------------------------------------------------------------------------------
# Finish reasons


async def test_finish_reasons_eos_length_and_first_token(open_engine: Opener, tmp_path: Path) -> None:
    base = cached_checkpoint("llama")
    prompt = prompt_of(33)
    expected = reference(base, prompt)
    stop_at = next(i for i in range(5, 32) if expected[i] not in expected[:i])
    eos_token = expected[stop_at]
    model_dir = tmp_path / "llama-eos"
    shutil.copytree(base, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], eos_token]
    (model_dir / "config.json").write_text(json.dumps(config))
    engine = await open_engine(model_dir)
    assert eos_token in engine.info.eos_token_ids

    outcome = await engine.prefill(RequestId("eos"), prompt, GREEDY)
    await engine.decode_held(RequestId("eos"), prompt, outcome.first_token, GREEDY)
    items = await collect(engine, RequestId("eos"))
    assert [outcome.first_token, *items.tokens] == expected[:stop_at]  # the EOS ends it, unsent
    assert items.finish == "stop"

    five = SamplingParams(max_tokens=5)  # stops before the EOS at stop_at >= 5
    outcome = await engine.prefill(RequestId("len"), prompt, five)
    await engine.decode_held(RequestId("len"), prompt, outcome.first_token, five)
    items = await collect(engine, RequestId("len"))
    assert (items.tokens, items.finish) == (expected[1:5], "length")

    one = SamplingParams(max_tokens=1)
    outcome = await engine.prefill(RequestId("one"), prompt, one)
    await engine.decode_held(RequestId("one"), prompt, outcome.first_token, one)
    assert (await collect(engine, RequestId("one"))).tokens == []

    # A first token that is EOS: nothing more to decode.
    await engine.prefill(RequestId("first"), prompt, GREEDY)
    await engine.decode_held(RequestId("first"), prompt, eos_token, GREEDY)
    assert (await collect(engine, RequestId("first"))).tokens == []
    assert holdings(engine) == IDLE


# ---------------------------------------------------------------------------------------------
# Cancellation and leaks


async def test_cancel_frees_the_slot_and_ends_the_stream(open_engine: Opener) -> None:
    engine = await open_engine(cached_checkpoint("llama"))
    long = SamplingParams(max_tokens=500)
    prompt = prompt_of(10)
    rid = RequestId("c")
    outcome = await engine.prefill(rid, prompt, long)
    await engine.decode_held(rid, prompt, outcome.first_token, long)
    assert engine.statistics().decoding == 1
    seen: list[Decoded] = []
    async for item in engine.stream(rid):
        seen.append(item)
        if len(seen) == 3:
            await engine.cancel(rid)
            assert holdings(engine) == IDLE
    # The stream ends after what was already buffered, long before max_tokens, and never says finished.
    assert 3 <= len(seen) < long.max_tokens - 1
    assert all(isinstance(item, TokensGenerated) for item in seen)
    await engine.cancel(rid)  # idempotent
    assert holdings(engine) == IDLE

    # Cancel before the stream was ever read.
    outcome = await engine.prefill(RequestId("d"), prompt, long)
    await engine.decode_held(RequestId("d"), prompt, outcome.first_token, long)
    await engine.cancel(RequestId("d"))
    assert holdings(engine) == IDLE

    # Cancel frees a held (prefilled, not yet decoding) cache too.
    await engine.prefill(RequestId("h"), prompt, long)
    assert engine.statistics().held_caches == 1
    await engine.cancel(RequestId("h"))
    assert holdings(engine) == IDLE


async def test_leaving_a_stream_early_cancels_the_request(open_engine: Opener) -> None:
    engine = await open_engine(cached_checkpoint("llama"))
    long = SamplingParams(max_tokens=500)
    prompt = prompt_of(10)
    outcome = await engine.prefill(RequestId("x"), prompt, long)
    await engine.decode_held(RequestId("x"), prompt, outcome.first_token, long)
    stream = engine.stream(RequestId("x"))
    async for _ in stream:
        break
    await stream.aclose()
    await flush(engine)
    assert holdings(engine) == IDLE


async def test_cancelled_callers_leak_nothing(open_engine: Opener) -> None:
    engine = await open_engine(cached_checkpoint("llama"))
    prompt = prompt_of(257)
    for delay in (0.0, 0.001, 0.01, 0.02, 0.05, 0.1):
        rid = RequestId(f"p{delay}")
        with trio.move_on_after(delay) as scope:
            await engine.prefill(rid, prompt, GREEDY)
        if not scope.cancelled_caught:  # it finished in time: an ordinary held cache
            await engine.release_held(rid)
        await flush(engine)
        assert holdings(engine) == IDLE, delay
    outcome = await engine.prefill(RequestId("i"), prompt, GREEDY)
    with trio.CancelScope() as scope:
        scope.cancel()
        await engine.decode_held(RequestId("i"), prompt, outcome.first_token, GREEDY)
    await flush(engine)
    await engine.cancel(RequestId("i"))
    assert holdings(engine) == IDLE


# ---------------------------------------------------------------------------------------------
# Bad payloads and bad requests fail alone


async def test_bad_payloads_are_rejected_and_change_nothing(open_engine: Opener) -> None:
    path = cached_checkpoint("llama")
    prefill_node = await open_engine(path)
    decode_node = await open_engine(path)
    other_chunking = await open_engine(path, prefill_chunk_size=CHUNK + 1)
    prompt = prompt_of(33)

    # Something already decoding on the decode node must be untouched.
    running = SamplingParams(max_tokens=500)
    outcome = await decode_node.prefill(RequestId("run"), prompt, running)
    await decode_node.decode_held(RequestId("run"), prompt, outcome.first_token, running)

    outcome = await prefill_node.prefill(RequestId("p"), prompt, GREEDY)
    payload = (await prefill_node.export_held(RequestId("p"))).joined()
    await prefill_node.release_held(RequestId("p"))
    flipped = bytearray(payload)
    flipped[len(flipped) // 2] ^= 0xFF
    await other_chunking.prefill(RequestId("w"), prompt, GREEDY)
    foreign = (await other_chunking.export_held(RequestId("w"))).joined()
    await other_chunking.release_held(RequestId("w"))
    whole = codec.decode_cache(payload, fingerprint=decode_node.info.fingerprint)
    one_head = b"".join(codec.encode_cache(whole.caches, fingerprint=decode_node.info.fingerprint,
                                             token_count=whole.token_count, heads=(0, 1)))

    cases: list[tuple[bytes, list[int], Code]] = [
        (bytes(flipped), prompt, Code.KV_CHECKSUM),
        (payload[: len(payload) - 7], prompt, Code.KV_TRUNCATED),
        (b"not a kv payload at all", prompt, Code.KV_MALFORMED),
        (foreign, prompt, Code.KV_WRONG_MODEL),
        (payload, prompt[:-1], Code.KV_MALFORMED),  # covers another prompt length
        (one_head, prompt, Code.KV_MALFORMED),  # a TP rank's slice: a one-rank node needs every head
    ]
    before = holdings(decode_node)
    for i, (body, for_prompt, code) in enumerate(cases):
        rid = RequestId(f"bad{i}")
        with pytest.raises(StatecoreError) as caught:
            await decode_node.install(rid, body, for_prompt, outcome.first_token, GREEDY)
        assert caught.value.info.code is code, caught.value
        assert holdings(decode_node) == before
        with pytest.raises(StatecoreError):
            await collect(decode_node, rid)  # no stream was left behind

    # The good payload still installs, and decodes right.
    await decode_node.install(RequestId("good"), payload, prompt, outcome.first_token, GREEDY)
    got = [outcome.first_token, *(await collect(decode_node, RequestId("good"))).tokens]
    assert got == reference(path, prompt)
    await decode_node.cancel(RequestId("run"))


@pytest.mark.parametrize(
    ("prompt", "sampling", "code"),
    [
        ([], GREEDY, Code.INVALID_REQUEST),
        ([3, 512], GREEDY, Code.INVALID_REQUEST),
        ([3, -1], GREEDY, Code.INVALID_REQUEST),
        ([3, 4], SamplingParams(max_tokens=0), Code.INVALID_REQUEST),
        ([3, 4], SamplingParams(max_tokens=4, temperature=1.0, top_p=0.0), Code.INVALID_REQUEST),
        ([3, 4], SamplingParams(max_tokens=4, response_format='{"type":"json_schema","schema":{"anyOf":[]}}'),
         Code.INVALID_REQUEST),
    ],
)
async def test_bad_requests_fail_alone(
    open_engine: Opener, prompt: list[int], sampling: SamplingParams, code: Code
) -> None:
    engine = await open_engine(cached_checkpoint("llama"))
    with pytest.raises(StatecoreError) as caught:
        await engine.prefill(RequestId("bad"), prompt, sampling)
    assert caught.value.info.fault is Fault.CLIENT
    assert caught.value.info.code is code
    assert holdings(engine) == IDLE
    good = prompt_of(5)
    assert await single(engine, RequestId("good"), good) == reference(cached_checkpoint("llama"), good)


async def test_misuse_of_request_ids_is_typed(open_engine: Opener) -> None:
    engine = await open_engine(cached_checkpoint("llama"))
    prompt = prompt_of(5)
    with pytest.raises(StatecoreError) as caught:
        await engine.decode_held(RequestId("none"), prompt, 3, GREEDY)
    assert caught.value.info.code is Code.KV_NOT_FOUND
    with pytest.raises(StatecoreError) as caught:
        await engine.export_held(RequestId("none"))
    assert caught.value.info.code is Code.KV_NOT_FOUND
    assert await engine.release_held(RequestId("none")) == 0

    outcome = await engine.prefill(RequestId("dup"), prompt, GREEDY)
    with pytest.raises(StatecoreError) as caught:
        await engine.prefill(RequestId("dup"), prompt, GREEDY)
    assert caught.value.info.fault is Fault.CLIENT
    with pytest.raises(StatecoreError) as caught:
        await engine.decode_held(RequestId("dup"), prompt[:-1], outcome.first_token, GREEDY)
    assert engine.statistics().held_caches == 1  # still held after the refused decode
    await engine.release_held(RequestId("dup"))


async def test_max_batch_bounds_live_decodes(open_engine: Opener) -> None:
    engine = await open_engine(cached_checkpoint("llama"), max_batch=2)
    long = SamplingParams(max_tokens=500)
    for i in range(2):
        outcome = await engine.prefill(RequestId(f"m{i}"), prompt_of(5, i), long)
        await engine.decode_held(RequestId(f"m{i}"), prompt_of(5, i), outcome.first_token, long)
    outcome = await engine.prefill(RequestId("m2"), prompt_of(5, 2), long)
    with pytest.raises(StatecoreError) as caught:
        await engine.decode_held(RequestId("m2"), prompt_of(5, 2), outcome.first_token, long)
    assert caught.value.info.code is Code.OVERLOADED
    assert engine.statistics().held_caches == 1
    for i in range(3):
        await engine.cancel(RequestId(f"m{i}"))


# ---------------------------------------------------------------------------------------------
# Models that bring their own code; a dead device thread


async def test_custom_model_code_needs_trust_and_decodes_solo(open_engine: Opener, tmp_path: Path) -> None:
    path = build_custom_cache_checkpoint(tmp_path / "opaque")
    with pytest.raises(StatecoreError) as caught:
        await open_engine(path)
    assert caught.value.info.fault is Fault.UNSUPPORTED
    assert "trust_remote_code" in caught.value.info.message

    engine = await open_engine(path, trust_remote_code=True)
    assert not engine.info.can_travel
    assert engine.info.untravelable_classes == ("OpaqueCache",)
    prompt = prompt_of(20)
    rid = RequestId("o")
    outcome = await engine.prefill(rid, prompt, GREEDY)
    with pytest.raises(StatecoreError) as caught:
        await engine.export_held(rid)
    assert caught.value.info.code is Code.UNSUPPORTED_CACHE
    await engine.decode_held(rid, prompt, outcome.first_token, GREEDY)
    tokens = [outcome.first_token, *(await collect(engine, rid)).tokens]
    assert tokens == reference(path, prompt, trust_remote_code=True)


async def _one_stream_decoding(open_engine: Opener) -> tuple[MlxEngine, AsyncIterator[Any]]:
    """An engine with request "live" (5 prompt tokens, 500 to come) decoding, its first token read."""
    engine = await open_engine(cached_checkpoint("llama"))
    long = SamplingParams(max_tokens=500)
    prompt = prompt_of(5)
    outcome = await engine.prefill(RequestId("live"), prompt, long)
    await engine.decode_held(RequestId("live"), prompt, outcome.first_token, long)
    stream = engine.stream(RequestId("live"))
    await stream.__anext__()
    return engine, stream


async def test_dead_device_thread_fails_every_call(open_engine: Opener) -> None:
    engine, stream = await _one_stream_decoding(open_engine)
    prompt = prompt_of(5)

    engine.crash_device_thread()
    with pytest.raises(StatecoreError) as caught:
        async for _ in stream:
            pass
    # the node's loss, not the request's: a router retries it elsewhere before its first token
    assert caught.value.info.fault is Fault.TRANSPORT and caught.value.info.code is Code.ENGINE_FAILED
    assert not engine.statistics().device_thread_alive
    for call in (
        lambda: engine.prefill(RequestId("after"), prompt, GREEDY),
        lambda: engine.export_held(RequestId("live")),
        lambda: engine.decode_held(RequestId("live"), prompt, 3, GREEDY),
    ):
        with pytest.raises(StatecoreError) as caught:
            await call()
        assert caught.value.info.fault is Fault.TRANSPORT
        assert caught.value.info.code is Code.ENGINE_FAILED
    await engine.cancel(RequestId("live"))  # cleanup stays quiet on a dead engine


async def test_a_job_taken_with_the_crash_that_ends_the_loop_fails_with_it(open_engine: Opener) -> None:
    """Jobs taken off the queue in one go with what ends the loop (here the crash; in a
    tensor-parallel instance, a broadcast that fails or hangs) are never computed: their callers
    fail with the loop rather than waiting on it forever (which kept a node from exiting)."""
    engine, stream = await _one_stream_decoding(open_engine)
    loop = engine._device
    stepping, release = threading.Event(), threading.Event()
    step = loop.executor.step

    def held_step() -> None:
        loop.executor.step = step  # type: ignore[method-assign]  # once
        stepping.set()
        release.wait(30)
        step()

    loop.executor.step = held_step  # type: ignore[method-assign]
    await trio.to_thread.run_sync(stepping.wait, 30)
    engine.crash_device_thread()  # queued ahead of the export below: both are taken at once

    async def release_when_queued() -> None:
        while loop.inbox.queue.qsize() < 2:
            await trio.sleep(0.005)
        release.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(release_when_queued)
        with trio.fail_after(30), pytest.raises(StatecoreError) as caught:
            await engine.export_held(RequestId("other"))
    assert caught.value.info.fault is Fault.TRANSPORT and caught.value.info.code is Code.ENGINE_FAILED
    assert not engine.statistics().device_thread_alive
    with pytest.raises(StatecoreError):
        async for _ in stream:
            pass


async def test_missing_model_dir_is_typed(open_engine: Opener, tmp_path: Path) -> None:
    with pytest.raises(StatecoreError) as caught:
        await open_engine(tmp_path / "nothing-here")
    assert caught.value.info.code is Code.MODEL_NOT_FOUND


def test_mlx_engine_is_an_engine() -> None:
    def conforms(engine: MlxEngine) -> Engine:
        return engine  # mypy checks MlxEngine against the port

    assert callable(conforms)


async def test_numpy_token_ids_are_accepted(open_engine: Opener) -> None:
    engine = await open_engine(cached_checkpoint("llama"))
    prompt = np.array(prompt_of(9), dtype=np.int64)
    got = await single(engine, RequestId("np"), list(prompt))
    assert got == reference(cached_checkpoint("llama"), prompt_of(9))


def test_sampling_keys_are_pure() -> None:
    from adapters.mlx import position_key_seed, request_seed

    assert position_key_seed(1, 10) == position_key_seed(1, 10)
    assert len({position_key_seed(1, p) for p in range(100)}) == 100
    assert position_key_seed(1, 10) != position_key_seed(2, 10)
    unseeded = SamplingParams(max_tokens=1, temperature=1.0)
    assert request_seed("a", unseeded) == request_seed("a", unseeded) != request_seed("b", unseeded)
    assert request_seed("a", SamplingParams(max_tokens=1, seed=7)) == 7
