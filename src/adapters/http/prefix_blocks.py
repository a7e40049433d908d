"""A node's prefix cache as its peers see it: `GET /internal/prefix` (the summary the router
routes by, `?since=VERSION` answering only whether it changed) and, on decode and single nodes,
`POST /internal/prefix_kv` (the cache's leading whole blocks of the posted token ids in the KV wire
format, which a prefill node pulls before prefilling a prompt that starts with them; 404
`prefix_not_cached` when none is held). Never a live request's cache. This module may import
anything.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from adapters.http.internal_wire import PrefixKvBody, PrefixSummaryBody, error_response, read_body, validated
from adapters.http.kv_send import counted, kv_body, payload_parts
from effects.ports import Engine
from statecore.errors import client_error


class PrefixBlocks:
    """The prefix cache's routes of one node."""

    def __init__(self, engine: Engine, kv_served: Callable[[int], None]) -> None:
        self.engine = engine
        self.kv_served = kv_served  # blocks sent count as KV served, as a pulled payload does

    async def summary(self, request: Request) -> Response:
        """The prefix cache's summary for the router (`?since=VERSION`: only whether it changed)."""
        raw = request.query_params.get("since")
        if raw is not None and not raw.isdigit():
            return error_response(client_error("since must be a version number (a non-negative integer)"))
        since = None if raw is None else int(raw)
        summary = await self.engine.prefix_summary(since)
        return JSONResponse(PrefixSummaryBody.of(summary, since).model_dump())

    async def blocks(self, request: Request) -> Response:
        """The prefix cache's leading whole blocks of the posted tokens, in the KV wire format, or
        PREFIX_NOT_CACHED (404) when it holds none. Counted as KV served once sent."""
        body = validated(PrefixKvBody, await read_body(request))
        payload = await self.engine.export_prefix(body.tokens)
        return kv_body(counted(payload_parts(payload), payload.nbytes, self.kv_served), payload.nbytes)


__all__ = ["PrefixBlocks"]
