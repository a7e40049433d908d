"""When each request's tokens passed two points of one node, for `GET /internal/token_times`.

A stream's gap between tokens, as its client sees it, is made at several places: the decode engine's
step, the decode node's write of the NDJSON line, the router's loop and its write of the SSE chunk.
Each node notes, for its recent token outputs, the wall-clock moment its loop applied them
(`applied`: on an engine node the engine's step handing them over, on a router the decode node's line
read) and the moment its writer took them to send (`read`: the node API's NDJSON line, a front end's
SSE chunk), so that a benchmark can line the hops up per request and find where a gap was made. A
bounded ring per point, a clock read and an append per step and request: never a second truth about
a request, never fed back into serving. An adapter: it may import anything; nothing in `statecore` or
`effects` imports it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from adapters.http.internal_wire import guarded
from effects.runner import Instrument, Reply
from statecore.events import Event, TokensGenerated
from statecore.ids import RequestId
from statecore.intents import RespondTokens

APPLIED: Final = "applied"
READ: Final = "read"
# moments kept per point: 4 streams at 15 tokens/s fill it in ~9 minutes, 256 rows at 50 in ~2 s
DEFAULT_CAPACITY: Final = 32_768

Moment = tuple[float, str, int]  # wall-clock seconds, request id, tokens at that moment


class TokenTimes(Instrument):
    """The recent token moments of one node at its two points (an instrument of its runner)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.points: dict[str, deque[Moment]] = {APPLIED: deque(maxlen=capacity),
                                                 READ: deque(maxlen=capacity)}

    def applied(self, request_id: RequestId, event: Event, context: object) -> None:
        if isinstance(event, TokensGenerated):
            self.points[APPLIED].append((self.clock(), request_id, len(event.tokens)))

    def reply_read(self, request_id: RequestId, reply: Reply, generated: int) -> None:
        if isinstance(reply, RespondTokens):
            self.points[READ].append((self.clock(), request_id, len(reply.tokens)))

    def since(self, start: float) -> dict[str, dict[str, list[float]]]:
        """Per point, per request, the moments at or after `start` (a token each: a step's several
        tokens repeat their moment)."""
        out: dict[str, dict[str, list[float]]] = {}
        for point, moments in self.points.items():
            by_request: dict[str, list[float]] = {}
            for at, rid, tokens in list(moments):  # a copy: the loop may append meanwhile
                if at >= start:
                    by_request.setdefault(rid, []).extend([at] * tokens)
            out[point] = by_request
        return out

    def route(self, token: str | None) -> BaseRoute:
        """`GET /internal/token_times?since=S` (S: Unix seconds, default 0)."""

        async def handler(request: Request) -> Response:
            try:
                start = float(request.query_params.get("since", "0"))
            except ValueError:
                return JSONResponse({"error": "since must be a number (Unix seconds)"}, status_code=400)
            body: dict[str, Any] = {"clock": "unix_s", "capacity": self.points[APPLIED].maxlen,
                                    **self.since(start)}
            return JSONResponse(body)

        return Route("/internal/token_times", guarded(token, handler), methods=["GET"])
