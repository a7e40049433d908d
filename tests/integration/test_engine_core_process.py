"""The engine core in its own process (`ProcessEngine`, `--engine-core process`) on a tiny real
checkpoint: it answers byte for byte as the thread core does (greedy and seeded, batched); KV
leaves and arrives through shared memory, whole and streamed piece by piece, both ways between a
process core and a thread core; cancels leave nothing held; and a core killed mid-stream fails
its requests as a transport fault and every later call, and its node's loop ends as it does when
a device thread dies.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial
from typing import Any

import pytest
import trio

from adapters.http.node_api import CORE_PROCESS
from adapters.kv.pull import ReceiveBuffers
from adapters.kv.shm_landing import ShmLanding
from adapters.kv.shm_region import ShmRef
from adapters.mlx import MlxEngine
from adapters.mlx.core_client import SILENT_S, ProcessEngine
from adapters.serve.node import watch_engine
from effects.engine_port import Decoded, EngineStatistics, KvPieces, SamplingParams
from effects.fakes import FakeEngine
from effects.interpret import EnginePerformer
from effects.runner import NodeRunner
from statecore.errors import Code, Fault, StatecoreError
from statecore.ids import RequestId
from statecore.phases import LoopPhase
from statecore.table import DECODE_REQUEST
from support.tiny_models import cached_checkpoint
from tests.integration.engines import (
    ENGINE_DEADLINE_S,
    close_engine,
    load_engine,
    sent_tokens,
    served_whole,
    streamed_prefill,
)

CHUNK = 16
GREEDY = SamplingParams(max_tokens=12)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
LONG = SamplingParams(max_tokens=2000, ignore_eos=True)
Engine = MlxEngine | ProcessEngine


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + 11 * salt) % 500 + 2 for i in range(n)]


def holdings(engine: Engine) -> tuple[int, int, int, int]:
    s = engine.statistics()
    return s.decoding, s.held_caches, s.held_bytes, s.kv_reserved_bytes


async def idle(engine: Engine) -> None:
    """Every request gone (a stream's own cancel is posted without a reply: poll the snapshot)."""
    with trio.fail_after(10):
        while holdings(engine) != (0, 0, 0, 0):
            await trio.sleep(0.02)


OPTIONS: dict[str, Any] = {"prefill_chunk_size": CHUNK, "step_target_ms": 0.0}


@pytest.fixture
async def core() -> AsyncIterator[ProcessEngine]:
    """An engine core process; at the end it holds nothing (unless it was killed), then it stops."""
    with trio.fail_after(ENGINE_DEADLINE_S):
        engine = await ProcessEngine.load(cached_checkpoint("llama"), **OPTIONS)
    try:
        yield engine
        if engine.statistics().device_thread_alive:
            await idle(engine)
    finally:
        with trio.fail_after(ENGINE_DEADLINE_S):
            await engine.aclose()


@pytest.fixture
async def thread() -> AsyncIterator[MlxEngine]:
    """The same engine on a thread of this process, to compare with."""
    engine = await load_engine(cached_checkpoint("llama"), **OPTIONS)
    try:
        yield engine
        await idle(engine)
    finally:
        await close_engine(engine)


async def decoded(engine: Engine, rid: str, prompt: list[int], first: int, sampling: SamplingParams,
                  payload: Any = None) -> list[int]:
    if payload is None:
        await engine.decode_held(RequestId(rid), prompt, first, sampling)
    else:
        await engine.install(RequestId(rid), payload, prompt, first, sampling)
    return [first] + await sent_tokens(engine.stream(RequestId(rid)))


async def test_the_process_core_answers_as_the_thread_core_and_kv_crosses_it(core: ProcessEngine,
                                                                           thread: MlxEngine) -> None:
    assert core.info == thread.info
    cases = [(f"r{i}", prompt_of(n, i), sampling)
             for i, (n, sampling) in enumerate([(9, GREEDY), (40, SEEDED), (23, GREEDY), (57, SEEDED)])]
    results: dict[tuple[int, str], Any] = {}
    for engine in (core, thread):  # alone, then all at once (batched)
        for rid, prompt, sampling in cases:
            results[(id(engine), rid)] = await served_whole(engine, rid, prompt, sampling)

        async def one(engine: Engine, rid: str, prompt: list[int], sampling: SamplingParams,
                      into: dict[str, Any]) -> None:
            into[rid] = await served_whole(engine, rid, prompt, sampling)

        together: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:
            for rid, prompt, sampling in cases:
                nursery.start_soon(one, engine, f"b{rid}", prompt, sampling, together)
        for rid, _, _ in cases:
            assert together[f"b{rid}"][3] == results[(id(engine), rid)][3]  # the tokens
        for rid, _, _ in cases:
            await engine.release_held(RequestId(rid))
            await engine.release_held(RequestId(f"b{rid}"))
    for rid, _, _ in cases:
        assert results[(id(core), rid)] == results[(id(thread), rid)], rid  # tokens and the KV's bytes
    await kv_crosses_both_ways(core, thread)


def received(landing: ShmLanding, payload: bytes) -> memoryview:
    """`payload` as a receive over the network leaves it: in the buffer the node's peers took."""
    view = landing.take(len(payload))
    view[:] = payload
    return view


async def kv_crosses_both_ways(core: ProcessEngine, thread: MlxEngine) -> None:
    """Whole and streamed, from the process core into the thread core and back; into the process
    core as a receive over the network leaves it: in the node's shared memory already, handed on
    with no copy."""
    prompt = prompt_of(70)
    expected = None
    landing = core.kv_landing(ReceiveBuffers(1 << 24).take)
    copies = core.copies_into_shared_memory()
    for source, target in ((core, thread), (thread, core)):
        # whole: a pulled payload
        rid = RequestId(f"w{id(source)}")
        outcome = await source.prefill(rid, prompt, GREEDY)
        payload = (await source.export_held(rid)).joined()
        await source.release_held(rid)
        arrived = received(landing, payload) if target is core else payload
        del payload
        tokens = await decoded(target, rid, prompt, outcome.first_token, GREEDY, arrived)
        del arrived
        expected = expected or tokens
        assert tokens == expected
        # streamed: pieces as the prompt is computed, installed as they arrive
        rid = RequestId(f"s{id(source)}")
        outcome, pieces = await streamed_prefill(source, rid, prompt, GREEDY)
        assert pieces and pieces[-1].stop == len(prompt)
        for piece in pieces:
            if target is core:
                piece = replace(piece, payload=KvPieces((received(landing, piece.payload.joined()),)))
            await target.receive_segment(rid, piece, len(prompt), max_tokens=GREEDY.max_tokens)
        del piece
        await source.release_held(rid)
        await target.install_segments(rid, prompt, outcome.first_token, GREEDY)
        assert [outcome.first_token] + await sent_tokens(target.stream(rid)) == expected
    assert core.copies_into_shared_memory() == copies  # nothing received was copied again
    assert landing.statistics().claimed == 1 + len(pieces)
    assert landing.statistics().held == 0  # each region went back when its call ended
    # pieces already in shared memory (the core's own, as a prefill node's core hands them on)
    # go into the core by reference, with no copy on the node's side
    rid = RequestId("by-reference")
    outcome, pieces = await streamed_prefill(core, rid, prompt, GREEDY)
    assert all(isinstance(piece.payload.shared, ShmRef) for piece in pieces)
    copies = core.copies_into_shared_memory()
    into = RequestId("by-reference-in")
    for piece in pieces:
        await core.receive_segment(into, piece, len(prompt), max_tokens=GREEDY.max_tokens)
    assert core.copies_into_shared_memory() == copies
    await core.release_held(rid)
    await core.install_segments(into, prompt, outcome.first_token, GREEDY)
    assert [outcome.first_token] + await sent_tokens(core.stream(into)) == expected
    # a prefix's blocks leave the process core and come back into it
    blocks = prompt[:2 * CHUNK]
    exported = (await core.export_prefix(blocks)).joined()
    assert await core.import_prefix(exported, blocks) >= 0


async def test_cancels_leave_nothing_held_and_a_killed_core_fails_typed(core: ProcessEngine) -> None:
    prompt = prompt_of(10)
    outcome = await core.prefill(RequestId("c"), prompt, LONG)
    await core.decode_held(RequestId("c"), prompt, outcome.first_token, LONG)
    seen: list[Decoded] = []
    async for item in core.stream(RequestId("c")):
        seen.append(item)
        if len(seen) == 3:
            await core.cancel(RequestId("c"))
            assert holdings(core) == (0, 0, 0, 0)
    assert 3 <= len(seen) < LONG.max_tokens - 1
    # leaving a stream early cancels the request
    outcome = await core.prefill(RequestId("x"), prompt, LONG)
    await core.decode_held(RequestId("x"), prompt, outcome.first_token, LONG)
    stream = core.stream(RequestId("x"))
    async for _ in stream:
        break
    await stream.aclose()
    await idle(core)
    # callers cancelled while their prefill waits in the core, at several moments
    for delay in (0.0, 0.005, 0.02, 0.05):
        rid = RequestId(f"p{delay}")
        with trio.move_on_after(delay) as scope:
            await core.prefill(rid, prompt_of(257), GREEDY)
        if not scope.cancelled_caught:
            await core.release_held(rid)
        await idle(core)
    await killed_mid_stream(core)


async def killed_mid_stream(core: ProcessEngine) -> None:
    """Its requests fail as a transport fault, and so does every later call; the node's loop ends."""
    runner: NodeRunner[Any] = NodeRunner(DECODE_REQUEST, EnginePerformer(FakeEngine()), name="decode")
    reasons: list[str] = []
    prompt = prompt_of(10)
    outcome = await core.prefill(RequestId("k"), prompt, LONG)
    await core.decode_held(RequestId("k"), prompt, outcome.first_token, LONG)
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        watch = partial(watch_engine, runner, core.liveness, 0.0, reasons.append, what=CORE_PROCESS)
        nursery.start_soon(watch)
        seen = 0
        with pytest.raises(StatecoreError) as failed:
            async for _ in core.stream(RequestId("k")):
                seen += 1
                if seen == 3:  # a core stopped whole (not only its device thread) reads as stalled
                    os.kill(core.core_pid, signal.SIGSTOP)
                    with trio.fail_after(10):
                        while core.liveness().stalled_s <= SILENT_S:
                            await trio.sleep(0.05)
                    os.kill(core.core_pid, signal.SIGCONT)
                if seen == 5:
                    os.kill(core.core_pid, signal.SIGKILL)
        assert (failed.value.info.fault, failed.value.info.code) == (Fault.TRANSPORT, Code.ENGINE_FAILED)
        assert seen < LONG.max_tokens - 1
        assert not core.statistics().device_thread_alive
        with pytest.raises(StatecoreError) as later:
            await core.prefill(RequestId("after"), prompt, GREEDY)
        assert later.value.info.fault is Fault.TRANSPORT
        with trio.fail_after(10):
            while runner.statistics().phase is not LoopPhase.STOPPED:
                await trio.sleep(0.02)
        assert reasons == ["the engine core process died"]
    assert replace(core.statistics(), step_retries=0, rows_isolated=0) == EngineStatistics(0, 0, 0, False)
    await core.cancel(RequestId("k"))  # quiet no-ops once it is gone
    assert await core.release_held(RequestId("k")) == 0
