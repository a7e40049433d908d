"""The internal HTTP API of an engine-backed node (prefill, decode or single): its routes, put
together from the parts that serve them. `node_status` (health, info, stats, handoffs, and whether
the node takes a request now), `node_requests` (the router's prefill, decode and cancel),
`kv_handoff` (a prefill node's held KV and streamed handoff, over HTTP and the KV plane),
`prefix_blocks` (the prefix cache's summary and blocks); `internal_wire.guarded` gives each route the
shared token check (`X-Statecore-Token`, when one is configured), the body limit and the error
mapping. Prefill node: `/internal/prefill`, `/internal/prefill_stream`, `GET` / `DELETE
/internal/kv/{id}`; decode and single nodes: `/internal/decode`, `/internal/prefix_kv`; every
node: `/internal/info`, `/internal/stats`, `/internal/handoffs`, `/internal/prefix`,
`/internal/cancel/{id}` (and `/health`, which the serving command mounts). This module may import
anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from adapters.http.internal_wire import MAX_INTERNAL_BODY, guarded
from adapters.http.kv_handoff import KvHandoff
from adapters.http.kv_send import SharedPieces
from adapters.http.node_requests import NodeRequests
from adapters.http.node_status import CORE_PROCESS, DEVICE_THREAD, NodeStatus
from adapters.http.prefix_blocks import PrefixBlocks
from adapters.kv.plane import PlaneAnswer, PlaneRequest
from adapters.kv.shm_outbox import ShmOutbox
from effects.interpret import EnginePerformer
from effects.ports import Engine
from effects.runner import NodeRunner


class NodeApi:
    """The internal routes of one engine-backed node, and what its serving command asks of them
    (health, the engine's loss, the KV plane's handler, the KV plane's port and the BLAS for info)."""

    def __init__(
        self,
        role: str,
        engine: Engine,
        runner: NodeRunner[Any],
        performer: EnginePerformer,
        *,
        token: str | None = None,
        max_live: int = 256,
        kv_buffer_bytes: Callable[[], int] = lambda: 0,
        warnings: list[str] | None = None,
        kv_stream: bool = True,
        shm: ShmOutbox | None = None,
        kv_served: Callable[[int], None] = lambda nbytes: None,
        runs_engine: str = DEVICE_THREAD,
    ) -> None:
        self.role = role
        self.token = token
        self.status = NodeStatus(role, engine, runner, performer, max_live=max_live,
                                 kv_buffer_bytes=kv_buffer_bytes, warnings=warnings or [],
                                 kv_stream=kv_stream, shm=shm, runs_engine=runs_engine,
                                 kv_plane_bodies=lambda: self.kv_handoff.plane_bodies)
        shared = SharedPieces(shm, performer)
        self.kv_handoff = KvHandoff(self.status, engine, runner, performer, shared, token=token,
                                    kv_served=kv_served)
        self.requests = NodeRequests(self.status, runner, performer.faults, kv_stream=kv_stream,
                                     ended=shared.release, start_stream=self.kv_handoff.start_stream)
        self.prefix_blocks = PrefixBlocks(engine, kv_served)

    def routes(self) -> list[BaseRoute]:
        g, status, requests = self.token, self.status, self.requests
        kv, prefix = self.kv_handoff, self.prefix_blocks
        common: list[BaseRoute] = [
            Route("/internal/info", guarded(g, status.info), methods=["GET"]),
            Route("/internal/stats", guarded(g, status.stats), methods=["GET"]),
            Route("/internal/handoffs", guarded(g, status.handoffs), methods=["GET"]),
            Route("/internal/cancel/{request_id}", guarded(g, requests.cancel), methods=["POST"]),
            Route("/internal/prefix", guarded(g, prefix.summary), methods=["GET"]),
        ]
        if self.role == "prefill":
            return [
                *common,
                Route("/internal/prefill", guarded(g, requests.prefill), methods=["POST"]),
                Route("/internal/prefill_stream", guarded(g, kv.prefill_stream), methods=["POST"]),
                Route("/internal/kv/{request_id}", guarded(g, kv.send_kv), methods=["GET"]),
                Route("/internal/kv/{request_id}", guarded(g, kv.kv_taken), methods=["DELETE"]),
            ]
        return [*common, Route("/internal/decode", guarded(g, requests.decode), methods=["POST"]),
                Route("/internal/prefix_kv", guarded(g, prefix.blocks), methods=["POST"])]

    async def health(self, request: Request) -> Response:
        return await self.status.health(request)

    def lose(self, reason: str) -> None:
        """The engine (this node's transport) is lost: health says why from now on."""
        self.status.lose(reason)

    @property
    def lost_reason(self) -> str | None:
        return self.status.lost_reason

    @property
    def kv_port(self) -> int | None:
        """The KV plane's port, once it listens (a prefill node's): info advertises it."""
        return self.status.kv_port

    @kv_port.setter
    def kv_port(self, port: int | None) -> None:
        self.status.kv_port = port

    @property
    def blas(self) -> str | None:
        """What the engine computes with, when its node knows (else info asks MLX)."""
        return self.status.blas

    @blas.setter
    def blas(self, blas: str | None) -> None:
        self.status.blas = blas

    async def plane(self, request: PlaneRequest) -> PlaneAnswer:
        """The KV plane's handler (`adapters.kv.plane`): a prefill node's KV routes on its socket."""
        return await self.kv_handoff.plane(request)


# CORE_PROCESS, DEVICE_THREAD, MAX_INTERNAL_BODY and guarded are named here for the serving command.
__all__ = ["CORE_PROCESS", "DEVICE_THREAD", "MAX_INTERNAL_BODY", "NodeApi", "guarded"]
