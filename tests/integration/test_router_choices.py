"""Where the router sends a choice of a client request with n > 1: to the decode node its siblings
decode on (they decode side by side there, whose bytes they then are), unless its attempt avoids
that node because it failed the choice (`statecore.routing.avoiding`): the retry then goes where
the route says, as any request's does. Decode nodes here are scripted peers that prefill locally."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, NoReturn

import trio

from effects.fakes import fake_info
from effects.interpret import RouterPerformer, router_backend
from effects.ports import DecodeCall, DecodeMessage, GenerationRequest, PrefillReply, SamplingParams
from effects.runner import NodeRunner, Timeouts
from statecore.errors import Code, ErrorInfo, Fault
from statecore.events import Finished
from statecore.ids import RequestId
from statecore.intents import Complete
from statecore.routing import RouteCandidate, RouteChoice, avoiding, choose_route
from statecore.table import ROUTER_REQUEST


class _DecodeNodes:
    """Decode nodes that prefill every prompt themselves and end at once: choice 0's stream waits
    for `release` (it stays live while its sibling is routed); `failing` nodes fail choice 1."""

    def __init__(self, failing: set[str]) -> None:
        self.failing = failing
        self.calls: list[tuple[str, int]] = []  # (node, choice) of every decode call
        self.release = trio.Event()
        self.first_decoding = trio.Event()

    async def decode(self, node: str, call: DecodeCall) -> AsyncIterator[DecodeMessage]:
        choice = call.sampling.choice
        self.calls.append((node, choice))
        if choice == 1 and node in self.failing:
            yield ErrorInfo(Fault.PEER, Code.ENGINE_FAILED, "this node fails the choice", origin=node)
            return
        yield PrefillReply(first_token=7, is_eos=False, held_bytes=0)
        if choice == 0:
            self.first_decoding.set()
            await self.release.wait()
        yield Finished("length")

    async def cancel(self, node: str, request_id: RequestId, *, finish_reason: str | None = None) -> None:
        pass

    async def release_kv(self, node: str, request_id: RequestId) -> None:
        pass

    def __getattr__(self, name: str) -> NoReturn:
        raise AssertionError(f"a local prefill asks no {name}")


async def _choices_routed(nursery: trio.Nursery, nodes: _DecodeNodes, order: list[str]) -> None:
    """Two choices of one client request through one router whose route takes the first node of
    `order` that the attempt does not avoid (the test changes `order` between the choices)."""

    def route(avoid: set[str], prompt: Sequence[int], request_id: str) -> RouteChoice:
        candidates = [RouteCandidate(node, 0) for node in avoiding(order, avoid)][:1]
        return choose_route(len(prompt), candidates, 1000, 0)  # short: the decode node prefills

    performer = RouterPerformer(nodes, lambda role, *_: "", route)
    runner: NodeRunner[Any] = NodeRunner(ROUTER_REQUEST, performer, timeouts=Timeouts(deadline_s=30.0))
    await nursery.start(runner.run)
    backend = router_backend(runner, performer, fake_info, local_prefill_below=1000)

    def request(choice: int) -> GenerationRequest:
        sampling = SamplingParams(4, choice_group="client", choice=choice, choices=2)
        return GenerationRequest(RequestId(f"client-{choice}"), (1, 2, 3), sampling)

    first = await backend.start(request(0))
    ended: list[Any] = []

    async def read_first() -> None:
        ended.extend([output async for output in first])

    nursery.start_soon(read_first)
    await nodes.first_decoding.wait()
    order.reverse()  # the route now prefers the other node: a choice that follows its sibling shows
    second = [output async for output in await backend.start(request(1))]
    nodes.release.set()
    with trio.fail_after(5):
        while not ended:
            await trio.sleep(0.01)
    assert isinstance(second[-1], Complete) and isinstance(ended[-1], Complete)


async def test_a_choice_decodes_beside_its_sibling(nursery: trio.Nursery) -> None:
    nodes = _DecodeNodes(failing=set())
    await _choices_routed(nursery, nodes, ["d1", "d2"])
    assert nodes.calls == [("d1", 0), ("d1", 1)]  # not the route's pick (d2)


async def test_a_retry_avoids_the_siblings_node_that_failed_it_and_takes_the_routes_pick(
        nursery: trio.Nursery, autojump_clock: trio.abc.Clock) -> None:
    nodes = _DecodeNodes(failing={"d1"})
    await _choices_routed(nursery, nodes, ["d1", "d2"])
    assert nodes.calls == [("d1", 0), ("d1", 1), ("d2", 1)]
