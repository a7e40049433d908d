"""Early first tokens (`adapters.mlx.prefill_build`): prompts that finish in one step are answered
as the step goes, each once the next one's calls are built, not all when the step ends; the last
one with the step. First turns on a cached system message, queued behind a parked device thread so
that one step plans every tail, observed from the engine's test hook (every model call, with the
requests it computes): while the last prompt's last call is built, the first prompt's caller has
its first token already. The tokens are still a cache-less engine's, greedy and seeded."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial

import trio
import trio.testing

from adapters.mlx import MlxEngine
from effects.engine_port import SamplingParams
from statecore.ids import RequestId
from support.tiny_models import cached_checkpoint
from tests.integration.engines import load_into, opened_engines, sent_tokens

CHUNK = 16
GREEDY = SamplingParams(max_tokens=6)
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, top_k=40, seed=5)
ANSWERED_WAIT_S = 10  # how long the last call waits to see the first prompt answered (never, before)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + 11 * salt) % 500 + 2 for i in range(n)]


class Watch:
    """The test hook: parks the device thread in the call of "gate"; in the last prompt's last call
    it waits (bounded) for the first prompt's caller to hold its first token, and notes whether it did."""

    def __init__(self, last: str) -> None:
        self.last = last
        self.gate, self.parked = threading.Event(), threading.Event()
        self.first_answered = threading.Event()
        self.calls: list[tuple[str, ...]] = []
        self.answered_before_last: bool | None = None

    def __call__(self, stage: str, request_ids: Sequence[str]) -> None:
        if stage != "prefill":
            return
        self.calls.append(tuple(request_ids))
        if "gate" in request_ids and not self.gate.is_set():
            self.parked.set()
            self.gate.wait(30)
        if list(request_ids) == [self.last] and self.calls.count((self.last,)) == 2:  # its last call
            self.answered_before_last = self.first_answered.wait(ANSWERED_WAIT_S)


async def served(engine: MlxEngine, rid: str, prompt: Sequence[int], sampling: SamplingParams,
                 answered: threading.Event | None = None) -> tuple[int, list[int]]:
    """One request: the prompt tokens it took from the prefix cache, and its tokens; `answered` is
    set as soon as its first token is back."""
    outcome = await engine.prefill(RequestId(rid), prompt, sampling)
    if answered is not None:
        answered.set()
    await engine.decode_held(RequestId(rid), prompt, outcome.first_token, sampling)
    generated = await sent_tokens(engine.stream(RequestId(rid)))
    return outcome.cached_tokens, [outcome.first_token, *generated]


async def test_first_turns_finishing_in_one_step_are_answered_as_it_goes() -> None:
    async with opened_engines() as engines:
        await first_turns_answered_as_the_step_goes(engines)


async def first_turns_answered_as_the_step_goes(engines: list[MlxEngine]) -> None:
    path = cached_checkpoint("llama")
    prompts_count = 5
    last = f"c{prompts_count - 1}"
    watch = Watch(last)
    load = partial(load_into, engines, path, prefill_chunk_size=CHUNK, step_target_ms=0.0)
    cached = await load(model_call_hook=watch)
    plain = await load(prefix_cache_bytes=0)
    end = min(cached.info.eos_token_ids)
    system = [*prompt_of(40, salt=11), end]  # a block ends after it: kept by the first turn

    def chat(own: list[int]) -> list[int]:
        return [*system, *own, end, *prompt_of(3, salt=15)]

    assert (await served(cached, "warm", chat(prompt_of(9, salt=1)), GREEDY))[0] == 0
    prompts = {f"c{i}": chat(prompt_of(8 + i, salt=20 + i)) for i in range(prompts_count)}
    samplings = {rid: GREEDY if i % 2 else SEEDED for i, rid in enumerate(prompts)}
    got: dict[str, tuple[int, list[int]]] = {}

    async def one(rid: str) -> None:
        answered = watch.first_answered if rid == "c0" else None
        got[rid] = await served(cached, rid, prompts[rid], samplings[rid], answered)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(served, cached, "gate", prompt_of(5, salt=9), GREEDY))
        await trio.to_thread.run_sync(watch.parked.wait, 30)
        watch.calls.clear()
        for rid in prompts:  # in this order: c0's tail is built first
            nursery.start_soon(one, rid)
            await trio.testing.wait_all_tasks_blocked()
        watch.gate.set()
    # each prompt's two calls (its own message, its last token), none stacked or padded with another's
    calls = [call for call in watch.calls if call != ("gate",)]
    assert sorted(calls) == sorted([(rid,) for rid in prompts] * 2), watch.calls
    assert watch.answered_before_last is True
    assert {rid: taken for rid, (taken, _) in got.items()} == {rid: len(system) for rid in prompts}
    for rid, (_, tokens) in got.items():
        assert tokens == (await served(plain, rid, prompts[rid], samplings[rid]))[1], rid
