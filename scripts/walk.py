"""Count one request's walk through the code: the files under `src/` its code runs in, and the
caller -> callee file pairs that cross a layer (`statecore`, `effects`, `adapters`), with the
instruments the runner tells (metrics, logs) named apart from the request's own path.

Two walks, as issue 35 asks: one streamed chat request on a single node (`single`: the demo model
on the real MLX engine, wired as `statecore run` wires it), and one handoff through an in-process
1P1D cluster (`handoff`: router, prefill and decode nodes over ASGI, fake engines; `--pull` for the
pulled handoff), which also lists the HTTP calls between the nodes. The engine's own files
(`adapters/mlx`, `effects/fakes.py`) are counted apart; the last line counts everything (the
request's path, the observers and the engine), which is how issue 35 counted the walks before.
Each crossing names the functions it enters, so a detour shows where it is. The MLX engine's
device thread starts at the load, before the trace, and is not traced: of the engine, `single`
counts the files its trio side enters (the device thread's are the same for every request;
docs/engine.md's package table names them). A second request is the one traced, so that start-up
and first-call work stays out.

    .venv/bin/python scripts/walk.py single
    .venv/bin/python scripts/walk.py handoff [--pull]

This file is a tool, not part of the package; it imports the package as any client would.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import trio
from starlette.applications import Starlette

from adapters.frontend.app import build_app
from adapters.frontend.frontend import Frontend
from adapters.http.node_api import NodeApi
from adapters.http.peers_httpx import HttpxPeers
from adapters.metrics import Metrics
from adapters.mlx.engine import MlxEngine
from adapters.serve.flags import demo_model_dir
from adapters.serve.logs import RequestLines, log_transitions
from effects.fakes import FakeEngine
from effects.interpret import EnginePerformer, RouterPerformer, local_backend, router_backend
from effects.runner import NodeRunner
from statecore.routing import RouteCandidate, RouteChoice, choose_route
from statecore.table import DECODE_REQUEST, PREFILL_REQUEST, ROUTER_REQUEST

SRC = str(Path(__file__).resolve().parent.parent / "src") + "/"
ENGINE = ("adapters/mlx/", "effects/fakes.py")
OBSERVERS = ("adapters/metrics.py", "adapters/serve/logs.py")  # told by the runner's instruments
CHAT = {"max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


class Walk:
    """What a profile hook saw while it was set: files entered, and who called into each."""

    def __init__(self) -> None:
        self.files: Counter[str] = Counter()
        self.pairs: Counter[tuple[str, str]] = Counter()
        self.entered: dict[tuple[str, str], set[str]] = {}  # each pair's callee functions

    def hook(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(SRC):
            return
        callee = frame.f_code.co_filename[len(SRC):]
        self.files[callee] += 1
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(SRC):
            caller = caller.f_back
        if caller is not None and caller.f_code.co_filename[len(SRC):] != callee:
            pair = (caller.f_code.co_filename[len(SRC):], callee)
            self.pairs[pair] += 1
            self.entered.setdefault(pair, set()).add(frame.f_code.co_qualname)

    def __enter__(self) -> Walk:
        threading.setprofile(self.hook)  # the device thread too
        sys.setprofile(self.hook)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)

    def report(self) -> None:
        own = [f for f in self.files if not f.startswith(ENGINE)]
        path = [f for f in own if f not in OBSERVERS]
        print(f"files: {len(own)} ({len(path)} on the request's path, "
              f"{len(own) - len(path)} observers: {', '.join(f for f in own if f in OBSERVERS)})")
        for name in path:
            print(f"  {name}")
        print(f"engine files: {sorted(f for f in self.files if f.startswith(ENGINE))}")
        crossing = sorted((a, b) for a, b in self.pairs if a.split("/")[0] != b.split("/")[0]
                          and not (a.startswith(ENGINE) or b.startswith(ENGINE)))
        told = [(a, b) for a, b in crossing if a in OBSERVERS or b in OBSERVERS]
        print(f"layer crossings (caller -> callee file pairs, engine left out): {len(crossing) - len(told)} "
              f"on the request's path, {len(told)} to and from the observers")
        for a, b in crossing:
            print(f"  {a} -> {b}  ({', '.join(sorted(self.entered[(a, b)]))})")
        every = sorted((a, b) for a, b in self.pairs if a.split("/")[0] != b.split("/")[0])
        print("layer crossings to and from the engine:")
        for a, b in every:
            if (a, b) not in crossing:
                print(f"  {a} -> {b}  ({', '.join(sorted(self.entered[(a, b)]))})")
        print(f"everything counted (path, observers and engine): {len(self.files)} files, "
              f"{len(every)} layer crossings")


async def _chat_twice(app: Any, model: str, before_trace: Callable[[], None] = lambda: None) -> Walk:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as client:
        body = {"model": model, **CHAT}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        before_trace()
        with Walk() as walk:
            response = await client.post("/v1/chat/completions", json=body)
            await trio.sleep(0.2)  # the runner's cleanup after the last byte
        assert response.status_code == 200, response.text
        return walk


async def single() -> Walk:
    engine = await MlxEngine.load(demo_model_dir())
    performer = EnginePerformer(engine)
    runner: NodeRunner[Any] = NodeRunner(DECODE_REQUEST, performer, name="single")
    log_transitions(runner, "single")
    metrics = Metrics("single")
    metrics.watch(runner, engine=engine, handoffs=performer.handoffs)
    lines = RequestLines()
    lines.watch(runner)
    frontend = Frontend.load(demo_model_dir(), local_backend(runner, performer))
    app = build_app(frontend, extra_routes=[metrics.route()])
    lines.instrument(app)
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        walk = await _chat_twice(app, frontend.model_name)
        nursery.cancel_scope.cancel()
    await engine.aclose()
    return walk


class _Hosts(httpx.AsyncBaseTransport):
    """Each node's app by its URL's host; every call between nodes noted."""

    def __init__(self) -> None:
        self.apps: dict[str, httpx.ASGITransport] = {}
        self.calls: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(f"{request.method} {request.url.host} {request.url.path}")
        return await self.apps[request.url.host].handle_async_request(request)


async def handoff(streamed: bool) -> Walk:
    hosts = _Hosts()
    async with trio.open_nursery() as nursery:
        for role in ("prefill", "decode"):
            engine = FakeEngine()
            performer = EnginePerformer(engine, HttpxPeers(transport=hosts) if role == "decode" else None)
            runner: NodeRunner[Any] = NodeRunner(PREFILL_REQUEST if role == "prefill" else DECODE_REQUEST,
                                                 performer, name=role)
            log_transitions(runner, role)
            metrics = Metrics(role)
            metrics.watch(runner, engine=engine, handoffs=performer.handoffs)
            await nursery.start(runner.run)
            api = NodeApi(role, engine, runner, performer, kv_stream=streamed, kv_served=metrics.kv_served)
            hosts.apps[role] = httpx.ASGITransport(app=Starlette(routes=[*api.routes(), metrics.route()]))
        urls = {"prefill": "http://prefill", "decode": "http://decode"}
        def route(avoid: set[str], prompt: Sequence[int], request_id: str) -> RouteChoice:
            return choose_route(len(prompt), [RouteCandidate(urls["decode"], 0)], 0, 0)  # a handoff

        router = RouterPerformer(HttpxPeers(transport=hosts), lambda role, *_: urls[role], route,
                                 streams=lambda prefill, decode: streamed,
                                 attaches=lambda prefill, decode: streamed)  # the default stream
        runner = NodeRunner(ROUTER_REQUEST, router, name="router")
        log_transitions(runner, "router")
        metrics = Metrics("router")
        metrics.watch(runner)
        lines = RequestLines()
        lines.watch(runner)
        await nursery.start(runner.run)
        backend = router_backend(runner, router, lambda: FakeEngine().info, local_prefill_below=0)
        frontend = Frontend.load(demo_model_dir(), backend)
        app = build_app(frontend, extra_routes=[metrics.route()])
        lines.instrument(app)
        walk = await _chat_twice(app, frontend.model_name, hosts.calls.clear)
        nursery.cancel_scope.cancel()
    print(f"HTTP calls between nodes: {len(hosts.calls)}: {'; '.join(hosts.calls)}")
    return walk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("walk", choices=["single", "handoff"])
    parser.add_argument("--pull", action="store_true", help="the pulled handoff (default: streamed)")
    args = parser.parse_args()
    walk = trio.run(single) if args.walk == "single" else trio.run(handoff, not args.pull)
    walk.report()


if __name__ == "__main__":
    main()
