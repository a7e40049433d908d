"""A prefill node and a decode node over fake engines, in process: each node's internal routes
(`NodeApi`) behind one httpx transport that finds the node by its URL's host (`http://prefill`,
`http://decode`), so routers and the decode node's own peers call them as over HTTP. Every query of
a prefill and decode call is kept (`Hosts.queries`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import trio
from starlette.applications import Starlette

from adapters.http.node_api import NodeApi
from adapters.http.peers_httpx import HttpxPeers
from adapters.kv.shm_outbox import ShmOutbox
from effects.fakes import FakeEngine
from effects.interpret import EnginePerformer
from effects.ports import ModelInfo
from effects.runner import NodeRunner, Timeouts
from statecore.table import DECODE_REQUEST, PREFILL_REQUEST


class Hosts(httpx.AsyncBaseTransport):
    """Each node's app by its URL's host; the query of every prefill and decode call kept. A
    request's `trace` extension is told that its body was sent as it reaches the app, as httpcore
    tells it once the body is written (`sent`: a subclass may hold that back)."""

    def __init__(self) -> None:
        self.transports: dict[str, httpx.ASGITransport] = {}
        self.queries: list[tuple[str, str]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/internal/prefill", "/internal/decode"):
            self.queries.append((request.url.path, request.url.query.decode()))
        await self.sent(request)
        if (trace := request.extensions.get("trace")) is not None:
            await trace("http11.send_request_body.complete", {"return_value": None})
        return await self.transports[request.url.host].handle_async_request(request)

    async def sent(self, request: httpx.Request) -> None:
        """Before the request's body counts as written."""


@dataclass
class FakeNodes:
    prefill: FakeEngine
    decode: FakeEngine
    hosts: Hosts
    peers: HttpxPeers  # the decode node's own (its KV pulls and streams): close it at the end
    performers: dict[str, EnginePerformer]
    runners: dict[str, NodeRunner[Any]]


async def start_fake_nodes(nursery: trio.Nursery, hosts: Hosts | None = None, *,
                           prefill_info: ModelInfo | None = None, shm: ShmOutbox | None = None,
                           prefill_engine: FakeEngine | None = None,
                           decode_engine: FakeEngine | None = None) -> FakeNodes:
    """Both nodes' runners started in `nursery`, their routes behind `hosts` (a new `Hosts` by
    default); each node's engine is `prefill_engine` or `decode_engine` (a new `FakeEngine` by
    default); the prefill node's says `prefill_info` and offers `shm` where given."""
    hosts = Hosts() if hosts is None else hosts
    prefill = FakeEngine(info=prefill_info) if prefill_engine is None else prefill_engine
    engines = {"prefill": prefill, "decode": FakeEngine() if decode_engine is None else decode_engine}
    node_peers = HttpxPeers(transport=hosts)
    performers: dict[str, EnginePerformer] = {}
    runners: dict[str, NodeRunner[Any]] = {}
    for role, engine in engines.items():
        performer = EnginePerformer(engine, node_peers if role == "decode" else None)
        machine = PREFILL_REQUEST if role == "prefill" else DECODE_REQUEST
        runner: NodeRunner[Any] = NodeRunner(machine, performer, timeouts=Timeouts(deadline_s=5.0), name=role)
        await nursery.start(runner.run)
        api = NodeApi(role, engine, runner, performer, shm=shm if role == "prefill" else None)
        app = Starlette(routes=api.routes())
        hosts.transports[role] = httpx.ASGITransport(app=app)
        performers[role], runners[role] = performer, runner
    return FakeNodes(engines["prefill"], engines["decode"], hosts, node_peers, performers, runners)


__all__ = ["FakeNodes", "Hosts", "start_fake_nodes"]
