"""Stacked prefill calls (`--prefill-stacking`): prompts whose next call has one shape compute it as
rows of one model call, and their tokens are still a cache-less engine's to the bit, greedy and
seeded. The calls are counted by the engine's test hook (every model call, with the requests it
computes) and its device profile; the prompts are queued behind a parked device thread so that
one step plans them together."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Sequence
from functools import partial

import pytest
import trio
import trio.testing
from mlx_lm.utils import load as mlx_lm_load

from adapters.mlx import MlxEngine
from adapters.mlx.prefill import stack_row_counts
from effects.engine_port import SamplingParams
from statecore.ids import RequestId
from support.tiny_models import cached_checkpoint
from tests.integration.engines import close_engine, load_engine, sent_tokens

CHUNK = 16
GREEDY = SamplingParams(max_tokens=8)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, top_k=40, seed=3)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + 11 * salt) % 500 + 2 for i in range(n)]


@pytest.fixture
async def engines() -> AsyncIterator[list[MlxEngine]]:
    opened: list[MlxEngine] = []
    yield opened
    for engine in opened:
        await close_engine(engine)


async def served(engine: MlxEngine, rid: str, prompt: Sequence[int], sampling: SamplingParams
                 ) -> tuple[int, list[int]]:
    """One request on one node: the prompt tokens it took from the prefix cache, and its tokens."""
    outcome = await engine.prefill(RequestId(rid), prompt, sampling)
    await engine.decode_held(RequestId(rid), prompt, outcome.first_token, sampling)
    generated = await sent_tokens(engine.stream(RequestId(rid)))
    return outcome.cached_tokens, [outcome.first_token, *generated]


class Calls:
    """The engine's model calls (the test hook), and a gate that parks the device thread in the
    call of the request named "gate" until opened."""

    def __init__(self) -> None:
        self.prefill: list[tuple[str, ...]] = []
        self.gate, self.parked = threading.Event(), threading.Event()

    def __call__(self, stage: str, request_ids: Sequence[str]) -> None:
        if stage == "prefill":
            self.prefill.append(tuple(request_ids))
        if stage == "prefill" and "gate" in request_ids and not self.gate.is_set():
            self.parked.set()
            self.gate.wait(30)

    def of(self, rid: str) -> list[tuple[str, ...]]:
        return [call for call in self.prefill if rid in call]


async def together(engine: MlxEngine, calls: Calls, prompts: dict[str, list[int]],
                   samplings: dict[str, SamplingParams]) -> dict[str, tuple[int, list[int]]]:
    """The prompts served at once: queued while the device thread is parked, so one step plans
    them all."""
    got: dict[str, tuple[int, list[int]]] = {}

    async def one(rid: str) -> None:
        got[rid] = await served(engine, rid, prompts[rid], samplings[rid])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(served, engine, "gate", prompt_of(5, salt=9), GREEDY))
        await trio.to_thread.run_sync(calls.parked.wait, 30)
        calls.prefill.clear()
        for rid in prompts:
            nursery.start_soon(one, rid)
        await trio.testing.wait_all_tasks_blocked()  # every prompt's job is queued
        calls.gate.set()
    return got


async def test_first_turns_on_a_cached_system_message_compute_their_tails_in_stacked_calls(
    engines: list[MlxEngine]
) -> None:
    """Five first turns on a cached system message, their user messages of one length, arrive
    together: their user messages (with the assistant's header) are one call of five rows, their
    last tokens another, where each would make two calls alone; a sixth, whose user message is
    longer, makes its own two. Every one's tokens are the cache-less engine's, greedy and seeded."""
    path = cached_checkpoint("llama")
    calls = Calls()
    load = partial(load_engine, path, prefill_chunk_size=CHUNK, step_target_ms=0.0)
    stacked = await load(prefill_stacking="on", prefill_batch=8, model_call_hook=calls)
    engines.append(stacked)
    engines.append(plain := await load(prefix_cache_bytes=0))
    end = min(stacked.info.eos_token_ids)
    system = [*prompt_of(40, salt=11), end]
    header = prompt_of(3, salt=15)

    def chat(own: list[int]) -> list[int]:
        return [*system, *own, end, *header]

    assert (await served(stacked, "warm", chat(prompt_of(10, salt=1)), GREEDY))[0] == 0
    prompts = {f"c{i}": chat(prompt_of(10 if i < 5 else 12, salt=20 + i)) for i in range(6)}
    samplings = {rid: GREEDY if i % 2 else SEEDED for i, rid in enumerate(prompts)}
    got = await together(stacked, calls, prompts, samplings)
    assert {rid: cached for rid, (cached, _) in got.items()} == {rid: len(system) for rid in prompts}
    five = {f"c{i}" for i in range(5)}  # (their rows in the order they arrived in)
    assert all([set(call) for call in calls.of(rid)] == [five, five] for rid in five), calls.prefill
    assert calls.of("c5") == [("c5",), ("c5",)]
    assert stacked.device_profile()["prefill_stacked"][0] == 10
    for rid, (_, tokens) in got.items():
        assert tokens == (await served(plain, rid, prompts[rid], samplings[rid]))[1], rid


async def test_cold_prompts_of_one_length_stack_every_call_without_a_prefix_cache(
    engines: list[MlxEngine]
) -> None:
    """Without a prefix cache every call of equal prompts arriving together stacks, their first
    chunks (from an empty cache) included, and a call that raises starts its rows again alone
    (each once): the tokens are an unstacked engine's, greedy and seeded."""
    path = cached_checkpoint("llama")
    calls = Calls()
    raised: list[tuple[str, ...]] = []

    def hook(stage: str, request_ids: Sequence[str]) -> None:
        calls(stage, request_ids)
        if stage == "prefill" and "p3" in request_ids and len(request_ids) > 1 and not raised:
            raised.append(tuple(request_ids))
            raise RuntimeError("injected: a stacked call fails once")

    load = partial(load_engine, path, prefill_chunk_size=CHUNK, step_target_ms=0.0, prefix_cache_bytes=0)
    stacked = await load(prefill_stacking="on", prefill_batch=4, model_call_hook=hook)
    engines.append(stacked)
    engines.append(plain := await load())
    prompts = {f"p{i}": prompt_of(30, salt=30 + i) for i in range(4)}  # chunks of 16, 13, 1
    samplings: dict[str, SamplingParams] = {rid: SEEDED if i % 2 else GREEDY for i, rid in enumerate(prompts)}
    got = await together(stacked, calls, prompts, samplings)
    assert [set(call) for call in raised] == [set(prompts)]  # the first chunks' call: all start again
    assert all([set(call) for call in calls.of(rid)] == [set(prompts)] * 4 for rid in prompts), calls.prefill
    assert stacked.device_profile()["prefill_stacked"][0] == 3 * 4
    for rid, (_, tokens) in got.items():
        assert tokens == (await served(plain, rid, prompts[rid], samplings[rid]))[1], rid


async def test_tails_of_one_padded_length_stack_and_their_last_tokens_go_alone(
    engines: list[MlxEngine]
) -> None:
    """With a shape bucket, user messages of 10, 11 and 12 tokens (tails of 14-16 tokens, padded
    to 16) are rows of one call, each trimmed to its own length after it; their last tokens stand
    at three positions, so each is its own call; a tail padded to 24 computes alone. The tokens
    are those of a cache-less engine with the same bucket."""
    path = cached_checkpoint("llama")
    calls = Calls()
    load = partial(load_engine, path, prefill_chunk_size=CHUNK, step_target_ms=0.0, shape_bucket=8)
    stacked = await load(prefill_stacking="on", prefill_batch=4, model_call_hook=calls)
    engines.append(stacked)
    engines.append(plain := await load(prefix_cache_bytes=0))
    end = min(stacked.info.eos_token_ids)
    system = [*prompt_of(40, salt=11), end]
    header = prompt_of(3, salt=15)
    assert (await served(stacked, "warm", [*system, *prompt_of(9, salt=1), end, *header], GREEDY))[0] == 0
    prompts = {f"c{own}": [*system, *prompt_of(own, salt=own), end, *header] for own in (10, 11, 12, 13)}
    samplings = {rid: GREEDY if i % 2 else SEEDED for i, rid in enumerate(prompts)}
    got = await together(stacked, calls, prompts, samplings)
    three = {"c10", "c11", "c12"}
    assert all([set(call) for call in calls.of(rid)] == [three, {rid}] for rid in three), calls.prefill
    assert calls.of("c13") == [("c13",), ("c13",)]
    for rid, (cached, tokens) in got.items():
        assert cached == len(system)
        assert tokens == (await served(plain, rid, prompts[rid], samplings[rid]))[1], rid


def test_the_load_check_finds_every_row_count_alike_on_the_cpu() -> None:
    """On the CPU (OpenBLAS or the bundled BLAS) a row computes the same in a stacked call of any
    count, for a call of several tokens and a call of one: every count stacks, all one class."""
    model = mlx_lm_load(str(cached_checkpoint("llama")))[0]
    assert stack_row_counts(model, 4, 8, 500) == ((2, 3, 4), (2, 3, 4), (1, 1, 1, 1), (1, 1, 1, 1))
