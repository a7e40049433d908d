"""Eviction under pressure never changes a running request: a model-based test of the prefix cache.

Hypothesis writes short programs against one real `MlxEngine` (tiny llama, blocks (prefill
chunks) of 16 tokens, at most four of a prompt's blocks computed per step, a prefix cache of five
blocks, and a KV budget that leaves beside the slot pool only two prompts' reservations, one
step's activations and three blocks, so that admission and the prefill memory cap evict kept
blocks on their own). Each program starts from the same full cache and runs its requests side by
side: start a request whose prompt is one of a few shared prefixes (two to four blocks, three of
them extending one another, and one that ends halfway through a block of another: a system
prompt that is not a whole number of blocks, and one that ends with an end-of-turn token there,
so that its last block ends with it) plus a tail of its own (after that system message, a user
message and a header), greedy or seeded; evict kept
blocks at that moment (`MlxEngine.evict_prefixes`, what admission runs); let the engine deliver a
few tokens; wait for the oldest request to end. Every request that finishes must have the tokens
and log-probabilities, to the bit, of the same request alone on an engine without a prefix cache
(computed once per prompt and sampling); a request may be refused (OVERLOADED), never fail
otherwise; whenever looked at, the kept bytes are whole blocks within the capacity; after each
program nothing is held, reserved or decoding, and the cache keeps exactly the arrays its index
counts, whole prefixes only, and a prompt never starts after more than its shared prefix's whole
blocks. Over the whole run blocks must have been evicted beside running requests, by the
programs and by the engine itself, and prompts must have started from kept blocks, some of them at a
block that is not where a step of the cache-less engine starts (its steps take four blocks from the
first) and at a block that ends at a message's end: the test cannot pass by testing nothing. It runs
twice: without a host tier, and with one of four blocks (taken back on every hit, "always"), where
every evicted block goes to the host pool and comes back: then the host copies are exactly what its
index counts, never a block in both tiers, within its capacity, and blocks must have gone out, come
back and been forgotten there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import assert_never

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.mlx import MlxEngine, commands
from effects.engine_port import SamplingParams
from statecore.errors import Code, StatecoreError
from statecore.events import TokenLogprobs, TokensGenerated
from statecore.ids import RequestId
from statecore.prefix import block_bounds
from statecore.scheduling import chunk_activation_bytes, prefill_chunks
from support.tiny_models import cached_checkpoint
from tests.integration.engines import load_engine, streamed

CHUNK = 16
MAX_BATCH = 4
STEP_BLOCKS = 4  # a step computes at most this many blocks of a prompt
SLOT_TOKENS = 100  # a slot's positions: every request below decodes in the slot lane
CAPACITY_BLOCKS = 5
HOST_BLOCKS = 4  # the host tier's capacity, when it is on: fewer than the device's, so it forgets too
LONGEST_TAIL = 20
MOST_TOKENS = 6
EXAMPLES = 40  # per engine: without a host tier, then with one


def tokens_of(n: int, salt: int) -> tuple[int, ...]:
    return tuple((7 * i + 3 + 11 * salt) % 500 + 2 for i in range(n))


_BASE = tokens_of(64, salt=1)
END = 1  # the tiny llama's eos id: a block also ends after it (a chat message's end)
# The first three extend one another, so their blocks are parents and children; the fifth ends
# halfway through the chain's third block (two whole blocks shared with it, then its own tokens);
# the last is a system message of 41 tokens: its third block ends at its end-of-turn token.
PREFIXES = (_BASE[:32], _BASE[:48], _BASE, tokens_of(48, salt=2), _BASE[:40], (*_BASE[:40], END))
LONGEST_PROMPT = max(len(p) for p in PREFIXES) + LONGEST_TAIL
assert LONGEST_PROMPT + MOST_TOKENS + 2 <= SLOT_TOKENS

Token = tuple[int, TokenLogprobs | None]


# -- the program -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    """A new request: prompt PREFIXES[prefix] + tail; seed None is greedy, else seeded sampling."""

    prefix: int
    tail: tuple[int, ...]
    seed: int | None
    max_tokens: int

    @property
    def prompt(self) -> tuple[int, ...]:
        # On the system message a chat: the tail is a user message, then the assistant's header
        # (the prompt's last message end ends no block; the system message's does).
        chat = (END, 3) if PREFIXES[self.prefix][-1] == END else ()
        return PREFIXES[self.prefix] + self.tail + chat

    @property
    def sampling(self) -> SamplingParams:
        if self.seed is None:
            return SamplingParams(max_tokens=self.max_tokens, logprobs=2)
        return SamplingParams(max_tokens=self.max_tokens, temperature=1.0, top_k=40, seed=self.seed,
                              logprobs=2)


@dataclass(frozen=True, slots=True)
class Evict:
    """Free this many blocks' worth of kept bytes now (0: every block)."""

    blocks: int


@dataclass(frozen=True, slots=True)
class Deliver:
    """Let the engine deliver this many more tokens (or end every running request)."""

    tokens: int


@dataclass(frozen=True, slots=True)
class Finish:
    """Wait for the oldest running request to end."""


Op = Start | Evict | Deliver | Finish

starts = st.builds(
    Start,
    # the system message half the time, so that programs start it twice (a hit at its end)
    prefix=st.integers(0, len(PREFIXES) - 1) | st.just(len(PREFIXES) - 1),
    tail=st.lists(st.integers(2, 511), min_size=1, max_size=LONGEST_TAIL).map(tuple),
    seed=st.none() | st.integers(0, 3),
    max_tokens=st.integers(1, MOST_TOKENS),
)
ops: st.SearchStrategy[Op] = st.one_of(
    starts,
    starts,
    st.builds(Evict, st.integers(0, CAPACITY_BLOCKS)),
    st.builds(Deliver, st.integers(1, 8)),
    st.just(Finish()),
)
# Every program starts a request, and starting one is always among the choices.
programs = st.tuples(starts, st.lists(ops, min_size=3, max_size=16)).map(lambda p: (p[0], *p[1]))


# -- the engines ---------------------------------------------------------------------------------


@dataclass
class Engines:
    cached: MlxEngine
    plain: MlxEngine  # no prefix cache: the reference
    block: int  # one kept block's bytes
    capacity: int
    references: dict[tuple[tuple[int, ...], SamplingParams], list[Token]] = field(default_factory=dict)


async def open_engine(path: Path, prefix_cache_bytes: int, kv_memory_bytes: int | None,
                      prefix_host_bytes: int = 0) -> MlxEngine:
    return await load_engine(path, prefill_chunk_size=CHUNK, max_batch=MAX_BATCH,
                             max_num_batched_tokens=MAX_BATCH + STEP_BLOCKS * CHUNK,
                             max_slot_tokens=SLOT_TOKENS - 1, prefix_cache_bytes=prefix_cache_bytes,
                             kv_memory_bytes=kv_memory_bytes, prefix_host_bytes=prefix_host_bytes,
                             prefix_host_pull="always")


@pytest.fixture(scope="module", params=[0, HOST_BLOCKS], ids=["device only", "with a host tier"])
def engines(request: pytest.FixtureRequest) -> Iterator[Engines]:
    """Both engines, shared by every example (each runs in its own trio.run; no request outlives
    one). Closed at the end of the module. The cached one with or without a host tier of
    `request.param` blocks (the CPU backend's default is without: turned on explicitly)."""
    path = cached_checkpoint("llama")
    plain = trio.run(open_engine, path, 0, None)
    cost, pool, shape = plain._device.cost, plain._device.pool_reserved, plain._device.shape
    assert shape is not None
    block = CHUNK * cost.per_token
    # Beside the slot pool: two of the longest prompts' reservations, the largest step's
    # activations (its last blocks) and three blocks. A second prompt beside a full cache evicts
    # blocks at admission; two prompts' steps evict more for their activations.
    largest = sum(chunk_activation_bytes(shape, prefill_chunks(LONGEST_PROMPT, CHUNK))[-STEP_BLOCKS:])
    budget = pool + 2 * cost.of(LONGEST_PROMPT) + largest + 3 * block
    cached = trio.run(open_engine, path, CAPACITY_BLOCKS * block, budget, request.param * block)
    try:
        device = cached._device
        assert device.slot_lane and device.pool_reserved == pool and device.settings.prefill_memory_cap
        assert device.block_ends == {END}
        yield Engines(cached, plain, block, CAPACITY_BLOCKS * block)
    finally:
        trio.run(cached.aclose)
        trio.run(plain.aclose)


async def alone(engine: MlxEngine, rid: RequestId, prompt: tuple[int, ...], sampling: SamplingParams
                ) -> list[Token]:
    outcome = await engine.prefill(rid, prompt, sampling)
    await engine.decode_held(rid, prompt, outcome.first_token, sampling)
    rest = await streamed(engine.stream(rid))
    return [(outcome.first_token, outcome.first_logprobs), *zip(rest.tokens, rest.logprobs, strict=True)]


def _shared(prompt: tuple[int, ...], other: tuple[int, ...]) -> int:
    """How many leading tokens of `prompt` before its last one `other` starts with."""
    count = 0
    for x, y in zip(prompt[:-1], other, strict=False):
        if x != y:
            break
        count += 1
    return count


# -- running a program ---------------------------------------------------------------------------


@dataclass
class Totals:
    """Over every example of the run."""

    started: int = 0
    finished: int = 0
    refused: int = 0
    forced_blocks: int = 0  # blocks the programs evicted
    forced_beside_requests: int = 0  # evictions that freed blocks while requests were running
    engine_blocks: int = 0  # blocks the engine evicted during the programs (capacity, admission, the cap)
    hits: int = 0  # prompts that started from kept blocks
    hits_within_a_step: int = 0  # ... after a number of blocks at which no cache-less step starts
    hits_at_a_message_end: int = 0  # ... after a block that ends at an end-of-turn token


class Program:
    """One program's requests on the cached engine, and what the driver waits on."""

    def __init__(self, engines: Engines, totals: Totals, seen: list[tuple[int, ...]]) -> None:
        self.engines = engines
        self.totals = totals
        self.seen = seen  # every prompt computed since the cache was emptied
        self.running: list[int] = []  # request indices, oldest first
        self.finished: dict[int, tuple[Start, list[Token]]] = {}
        self.delivered = 0
        self._changed = trio.Event()

    def changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._changed.wait()

    def check_cache(self) -> None:
        stats = self.engines.cached.statistics()
        kept = stats.prefix_cache_bytes
        # whole blocks: a block is one chunk or ends earlier, at an end-of-turn token
        assert kept <= self.engines.capacity and kept % (self.engines.block // CHUNK) == 0, kept
        # blocks coming back from the host tier never take what KV admission gave requests
        assert kept + stats.kv_reserved_bytes <= stats.kv_budget_bytes, stats

    async def request(self, index: int, start: Start) -> None:
        engine = self.engines.cached
        rid = RequestId(f"r{self.totals.started}")  # unique over the run: nothing left can clash
        self.totals.started += 1
        try:
            tokens = await self.serve(rid, start)
        except BaseException:
            await engine.cancel(rid)  # (shielded) wherever it is, so that the next example starts idle
            raise
        finally:
            self.running.remove(index)
            self.changed()
        if tokens is None:
            self.totals.refused += 1
        else:
            self.finished[index] = (start, tokens)

    async def serve(self, rid: RequestId, start: Start) -> list[Token] | None:
        """The request's tokens; None when it is refused for now (OVERLOADED)."""
        engine = self.engines.cached
        # Whole blocks, never more than the prompt shares with one computed before it.
        shared = max(_shared(start.prompt, other) for other in self.seen)
        self.seen.append(start.prompt)
        try:
            outcome = await engine.prefill(rid, start.prompt, start.sampling)
        except StatecoreError as exc:
            assert exc.info.code is Code.OVERLOADED, exc
            return None
        bounds = [0, *block_bounds(start.prompt, CHUNK, {END})]
        assert outcome.cached_tokens in bounds and outcome.cached_tokens <= shared, (outcome, start)
        if outcome.cached_tokens:
            self.totals.hits += 1
            self.totals.hits_within_a_step += bounds.index(outcome.cached_tokens) % STEP_BLOCKS != 0
            self.totals.hits_at_a_message_end += outcome.cached_tokens % CHUNK != 0
        tokens: list[Token] = [(outcome.first_token, outcome.first_logprobs)]
        self.token()
        try:
            await engine.decode_held(rid, start.prompt, outcome.first_token, start.sampling)
        except StatecoreError as exc:  # every slot taken
            assert exc.info.code is Code.OVERLOADED, exc
            await engine.release_held(rid)
            return None
        async for item in engine.stream(rid):
            if isinstance(item, TokensGenerated):
                for at, token in enumerate(item.tokens):
                    tokens.append((token, None if item.logprobs is None else item.logprobs[at]))
                    self.token()
        return tokens

    def token(self) -> None:
        self.delivered += 1
        self.check_cache()
        self.changed()

    async def run(self, program: tuple[Op, ...]) -> None:
        async with trio.open_nursery() as nursery:
            for index, op in enumerate(program):
                await self.perform(nursery, index, op)
                self.check_cache()

    async def perform(self, nursery: trio.Nursery, index: int, op: Op) -> None:
        engine = self.engines.cached
        match op:
            case Start():
                self.running.append(index)
                nursery.start_soon(self.request, index, op)
            case Evict(blocks):
                freed = await engine.evict_prefixes(blocks * self.engines.block if blocks
                                                    else self.engines.capacity)
                self.totals.forced_blocks += freed // self.engines.block
                if freed and self.running:
                    self.totals.forced_beside_requests += 1
            case Deliver(tokens):
                target = self.delivered + tokens
                await self.wait_until(lambda: self.delivered >= target or not self.running)
            case Finish():
                if self.running:
                    oldest = self.running[0]
                    await self.wait_until(lambda: oldest not in self.running)
            case _:
                assert_never(op)

    async def check_idle(self) -> None:
        """Nothing held, reserved or decoding; the cache keeps exactly what its index counts."""
        engine = self.engines.cached
        await engine.release_held(RequestId("-flush-"))  # every job posted before now has run
        stats = engine.statistics()
        assert (stats.decoding, stats.held_caches, stats.held_bytes, stats.kv_reserved_bytes) == (0, 0, 0, 0)
        device = engine._device
        assert device.pool is not None and device.pool.free_slots == MAX_BATCH
        assert not device.waiting and not device.live and not device.held
        prefix = device.prefix
        assert prefix is not None
        kept, on_host = prefix.index.device_keys(), prefix.index.host_keys()
        assert set(prefix._blocks) == set(kept), "arrays kept for blocks the index forgot, or none for some"
        assert set(prefix._host) == set(on_host), "host copies the index does not count, or none for some"
        assert not set(kept) & set(on_host), "a block in both tiers"
        parents = [prefix.index.parent(key) for key in kept]
        assert all(parent is None or prefix.index.on_device(parent) for parent in parents), \
            "a block kept alone"
        host_parents = [prefix.index.parent(key) for key in on_host]
        assert all(parent is None or parent in prefix.index for parent in host_parents), \
            "a host block without its parent"
        arrays = sum(int(k.nbytes) + int(v.nbytes) for block in prefix._blocks.values() for k, v in block)
        assert arrays == prefix.nbytes == stats.prefix_cache_bytes
        copies = sum(k[0].nbytes + v[0].nbytes for block in prefix._host.values() for k, v in block)
        assert copies == prefix.host_nbytes == stats.prefix_host_bytes <= stats.prefix_host_capacity_bytes
        self.check_cache()

    async def check_tokens(self) -> None:
        """Each finished request against the same request alone, without a prefix cache."""
        references = self.engines.references
        for index, (start, tokens) in sorted(self.finished.items()):
            key = (start.prompt, start.sampling)
            if key not in references:
                references[key] = await alone(self.engines.plain, RequestId("reference"), *key)
            assert tokens == references[key], f"request {index} ({start}) differs"


async def run_program(engines: Engines, totals: Totals, program: tuple[Op, ...]) -> None:
    # Each example starts from the same full cache: the last prefix's three blocks, then the
    # chain's four (the first of the three is left), each request alone; an empty host tier.
    await engines.cached.evict_prefixes(engines.capacity)
    prefix = engines.cached._device.prefix
    assert prefix is not None
    # (on the device thread: the prefix cache is its)
    await engines.cached._post(commands.Inspect(partial(prefix.evict_host, prefix.host_nbytes)))
    seen = [(*prefix, 2) for prefix in (PREFIXES[3], PREFIXES[2])]
    for prompt in seen:
        await alone(engines.cached, RequestId("warm"), prompt, SamplingParams(max_tokens=1))
    stats = engines.cached.statistics()
    assert stats.prefix_cache_bytes == engines.capacity
    warm, forced = stats.prefix_cache_evictions, totals.forced_blocks
    checked = Program(engines, totals, seen)
    with trio.fail_after(60):
        await checked.run(program)
        await checked.check_idle()
        await checked.check_tokens()
    totals.finished += len(checked.finished)
    evicted = engines.cached.statistics().prefix_cache_evictions - warm
    totals.engine_blocks += evicted - (totals.forced_blocks - forced)


def test_eviction_under_pressure_never_changes_a_running_request(engines: Engines) -> None:
    totals = Totals()
    before = engines.cached.statistics()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(program=programs)
    def example(program: tuple[Op, ...]) -> None:
        trio.run(run_program, engines, totals, program)

    example()
    # The run tested something: blocks were evicted beside running requests, by the programs and
    # by the engine itself, prompts started from kept blocks, and most requests were served.
    after = engines.cached.statistics()
    assert totals.forced_beside_requests > 0 and totals.engine_blocks > 0, totals
    assert after.prefix_cache_evictions > before.prefix_cache_evictions
    assert after.prefix_cache_hits > before.prefix_cache_hits
    assert totals.hits_within_a_step > 0, totals
    assert totals.hits_at_a_message_end > 0, totals
    assert totals.finished > totals.refused, totals
    if after.prefix_host_capacity_bytes:  # blocks went to the host, came back, and were forgotten there
        assert after.prefix_host_out and after.prefix_host_back and after.prefix_host_forgotten, after
