"""The runner with a fake engine: per-request failure, deadlines, cancellation, drain,
transport loss — and nothing left held afterwards."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from effects import faults as fault_injection
from effects.engine_port import SamplingParams
from effects.fakes import FakeEngine, Faults, next_token
from effects.faults import NO_FAULTS, Phase
from effects.interpret import EnginePerformer, local_backend
from effects.ports import GenerationRequest, Output
from effects.runner import NodeRunner, Timeouts
from statecore.errors import Code, StatecoreError
from statecore.events import DrainRequested, TransportLost
from statecore.ids import RequestId
from statecore.intents import Reject, RespondTokens
from statecore.table import DECODE_REQUEST
from tests.integration.fake_backend import as_scripted, completed, replied

MARKER = 999


class Node:
    def __init__(self, nursery: trio.Nursery, faults: Faults, timeouts: Timeouts) -> None:
        self.engine = FakeEngine(faults)
        self.performer = EnginePerformer(self.engine)
        self.runner = NodeRunner(DECODE_REQUEST, self.performer, timeouts=timeouts, name="test")
        self.backend = local_backend(self.runner, self.performer)
        self.counter = 0

    async def generate(self, prompt: list[int], max_tokens: int = 6) -> list[Output]:
        self.counter += 1
        request = GenerationRequest(
            RequestId(f"r{self.counter}"), tuple(prompt), SamplingParams(max_tokens)
        )
        generation = await self.backend.start(request)
        return [out async for out in generation]

    def held(self) -> dict[str, int]:
        """What the node still holds: decoder rows, held caches, live requests, entries (every
        request's entry is forgotten, its context let go, once its cleanup ran)."""
        engine, runner = self.engine.statistics(), self.runner.statistics()
        counts = {"decoding": engine.decoding, "held_caches": engine.held_caches,
                  "live_requests": runner.live_requests, "entries": runner.entries}
        return {name: count for name, count in counts.items() if count}

    async def wait_nothing_held(self) -> None:
        """Until the cleanup that follows the last answers has run (polled, at most 10 s)."""
        with trio.move_on_after(10):
            while self.held():
                await trio.sleep(0.01)
        assert not self.held(), self.held()


@pytest.fixture
async def node(nursery: trio.Nursery) -> AsyncIterator[Node]:
    built = Node(nursery, Faults(marker=MARKER, fail={"prefill"}), Timeouts(deadline_s=5.0))
    await nursery.start(built.runner.run)
    yield built


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    history = list(prompt)
    for _ in range(n):
        history.append(next_token(history))
    return history[len(prompt) :]


async def test_a_request_generates_the_predicted_tokens(node: Node) -> None:
    outputs = await node.generate([5, 6, 7], max_tokens=6)
    assert [as_scripted(o) for o in outputs[:-1]] == [replied(t) for t in expected_tokens([5, 6, 7], 6)]
    assert as_scripted(outputs[-1]) == completed("length")
    await node.wait_nothing_held()


async def test_one_failing_request_changes_no_other(node: Node) -> None:
    results: dict[int, list[Output]] = {}

    async def one(i: int, prompt: list[int]) -> None:
        results[i] = await node.generate(prompt)

    async with trio.open_nursery() as n:
        for i in range(6):
            n.start_soon(one, i, [i + 1, 2, 3] if i != 3 else [MARKER, 1])
    failed = results.pop(3)
    assert isinstance(failed[-1], Reject)
    assert failed[-1].error.code is Code.INJECTED_FAULT
    for i, outputs in results.items():
        assert as_scripted(outputs[-1]) == completed("length"), i
    assert node.runner.ready()
    assert as_scripted((await node.generate([1, 2]))[-1]) == completed("length")  # the next one succeeds
    await node.wait_nothing_held()
    assert node.runner.statistics().outcomes == {"done": 6, "failed": 1}


async def test_a_stalled_request_times_out_alone(nursery: trio.Nursery, autojump_clock: object) -> None:
    node = Node(nursery, Faults(marker=MARKER, stall={"prefill"}), Timeouts(deadline_s=3.0))
    await nursery.start(node.runner.run)
    outputs = await node.generate([MARKER])
    assert isinstance(outputs[-1], Reject) and outputs[-1].error.code is Code.TIMEOUT
    assert as_scripted((await node.generate([4]))[-1]) == completed("length")
    await node.wait_nothing_held()
    assert node.runner.statistics().live_tasks == 0


async def test_client_cancel_frees_the_decoder_slot(node: Node) -> None:
    request = GenerationRequest(RequestId("c1"), (1, 2, 3), SamplingParams(10_000))
    generation = await node.backend.start(request)
    seen = 0
    async for output in generation:
        assert isinstance(output, RespondTokens)
        seen += 1
        if seen == 3:
            await generation.cancel()
            break
    await node.wait_nothing_held()
    assert node.runner.statistics().outcomes == {"cancelled": 1}  # a cancellation is no failure


async def test_stop_ends_the_request_as_done(node: Node) -> None:
    generation = await node.backend.start(
        GenerationRequest(RequestId("s1"), (1, 2), SamplingParams(10_000))
    )
    async for output in generation:
        assert isinstance(output, RespondTokens)
        await generation.stop()
        break
    await node.wait_nothing_held()
    assert node.runner.statistics().outcomes == {"done": 1}


async def test_transport_lost_fails_live_requests_and_stops_the_loop(nursery: trio.Nursery) -> None:
    node = Node(nursery, Faults(marker=MARKER, stall={"prefill"}), Timeouts())
    await nursery.start(node.runner.run)
    generation = await node.backend.start(
        GenerationRequest(RequestId("t1"), (MARKER,), SamplingParams(4))
    )
    await node.runner.post_loop(TransportLost("device thread died"))
    outputs = [out async for out in generation]
    assert isinstance(outputs[-1], Reject)
    assert outputs[-1].error.code is Code.TRANSPORT_LOST
    with trio.fail_after(5):
        await node.runner.wait_stopped()
    assert not node.runner.ready()


async def test_drain_finishes_in_flight_requests_then_stops(nursery: trio.Nursery) -> None:
    node = Node(nursery, Faults(), Timeouts())
    await nursery.start(node.runner.run)
    generation = await node.backend.start(
        GenerationRequest(RequestId("d1"), (3, 4), SamplingParams(20))
    )
    await node.runner.post_loop(DrainRequested())
    outputs = [out async for out in generation]
    assert as_scripted(outputs[-1]) == completed("length") and len(outputs) == 21
    with trio.fail_after(5):
        await node.runner.wait_stopped()
    with pytest.raises(Exception, match="not accepting"):
        await node.backend.start(GenerationRequest(RequestId("d2"), (1,), SamplingParams(2)))


async def test_one_entry_per_request_from_open_to_forget(node: Node) -> None:
    """`open` registers the request's one entry (with the role's context); a second request
    under a live id is refused there and changes nothing; the entry goes once cleanup ran."""
    generation = await node.backend.start(
        GenerationRequest(RequestId("e1"), (1, 2), SamplingParams(10_000))
    )
    first = await generation.__aiter__().__anext__()
    assert isinstance(first, RespondTokens)
    assert node.runner.statistics().entries == 1
    assert node.runner.context(RequestId("e1")) is generation.context
    with pytest.raises(StatecoreError, match="duplicate request id"):
        await node.backend.start(GenerationRequest(RequestId("e1"), (3,), SamplingParams(2)))
    assert node.runner.statistics().live_requests == 1
    await generation.cancel()
    await node.wait_nothing_held()
    assert node.runner.context(RequestId("e1")) is None
    assert as_scripted((await node.generate([4, 5]))[-1]) == completed("length")  # the id space is free


def test_production_faults_are_a_no_op_port() -> None:
    assert fault_injection.Faults.parse([]) is NO_FAULTS and not NO_FAULTS.armed
    assert not NO_FAULTS.applies(Phase.PREFILL, "inject-fault-prefill")
    assert NO_FAULTS.model_call_hook() is None
    trio.run(NO_FAULTS.at, Phase.PREFILL, "inject-fault-prefill")  # returns, raises nothing
