"""The progress watchdog of an engine node (`adapters.serve.node.watch_engine`) over a fake engine
whose reported stall is set by the test, on trio's autojump clock: below `--stall-timeout`
nothing happens; past it the node says why in `/health` (503), and its loop stops on
`TransportLost`, failing what was live; a dead device thread is lost the same way.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import httpx
import trio
from starlette.applications import Starlette
from starlette.routing import Route

from adapters.http.node_api import CORE_PROCESS, DEVICE_THREAD, NodeApi
from adapters.serve.node import watch_engine
from effects.engine_port import EngineLiveness, EngineStatistics
from effects.fakes import FakeEngine
from effects.interpret import EnginePerformer
from effects.runner import NodeRunner
from statecore.phases import LoopPhase
from statecore.table import DECODE_REQUEST


async def _health(api: NodeApi) -> httpx.Response:
    app = Starlette(routes=[Route("/health", api.health, methods=["GET"])])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as client:
        return await client.get("/health")


async def _watch(report: list[EngineLiveness], timeout_s: float
                 ) -> tuple[NodeApi, NodeRunner[Any], list[str]]:
    """A decode node's loop and API with the watchdog reading `report[-1]`, in the background."""
    engine = FakeEngine()
    performer = EnginePerformer(engine)
    runner: NodeRunner[Any] = NodeRunner(DECODE_REQUEST, performer, name="decode")
    api = NodeApi("decode", engine, runner, performer)
    reasons: list[str] = []

    def lose(reason: str) -> None:
        reasons.append(reason)
        api.lose(reason)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            await watch_engine(runner, lambda: report[-1], timeout_s, lose)

    trio.lowlevel.spawn_system_task(run)
    await trio.sleep(0)
    return api, runner, reasons


async def _wait_stopped(runner: NodeRunner[Any]) -> None:
    while runner.statistics().phase is not LoopPhase.STOPPED:
        await trio.sleep(0.01)


async def test_a_stall_past_the_timeout_loses_the_engine(autojump_clock: trio.abc.Clock) -> None:
    busy = EngineLiveness(alive=True)
    report = [busy]
    api, runner, reasons = await _watch(report, timeout_s=5.0)
    report.append(replace(busy, stalled_s=4.9))  # a slow step, not a hang
    await trio.sleep(10)
    assert reasons == []
    assert (await _health(api)).status_code == 200
    report.append(replace(busy, stalled_s=5.2))
    with trio.fail_after(1):
        await _wait_stopped(runner)
    assert len(reasons) == 1 and "no progress for 5.2 s" in reasons[0]
    health = await _health(api)
    assert health.status_code == 503 and health.json()["reason"] == reasons[0]


async def test_a_zero_timeout_never_fires_but_a_dead_thread_still_does(
    autojump_clock: trio.abc.Clock,
) -> None:
    stalled = EngineLiveness(alive=True, stalled_s=3600.0)
    report = [stalled]
    api, runner, reasons = await _watch(report, timeout_s=0.0)
    await trio.sleep(60)
    assert reasons == [] and runner.statistics().phase is not LoopPhase.STOPPED
    report.append(replace(stalled, alive=False))
    with trio.fail_after(1):
        await _wait_stopped(runner)
    assert reasons == ["the MLX device thread died"]
    assert (await _health(api)).json()["reason"] == "the MLX device thread died"


async def test_health_names_what_runs_the_engine_when_it_is_not_running() -> None:
    """Before the watchdog has said why, `/health` says what is not running: the device thread,
    or the engine core process of a node started with `--engine-core process`."""
    dead = EngineStatistics(decoding=0, held_caches=0, held_bytes=0, device_thread_alive=False)
    for runs_engine, said in ((DEVICE_THREAD, "the MLX device thread is not running"),
                              (CORE_PROCESS, "the engine core process is not running")):
        engine = FakeEngine()
        engine.statistics = lambda: dead  # type: ignore[method-assign]
        performer = EnginePerformer(engine)
        runner: NodeRunner[Any] = NodeRunner(DECODE_REQUEST, performer, name="decode")
        api = NodeApi("decode", engine, runner, performer, runs_engine=runs_engine)
        health = await _health(api)
        assert health.status_code == 503 and health.json()["reason"] == said
