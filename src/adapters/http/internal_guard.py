"""What every internal route of a node does before and after its own work: require the shared
token (when one is configured), read the body up to a limit, validate it, and answer a
`StatecoreError` as its JSON error. Used by the node's internal API (`node_api` and the route
groups it composes) and the KV plane's answers. This module may import anything.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from adapters.http.internal_wire import TOKEN_HEADER, error_json
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error

Handler = Callable[[Request], Awaitable[Response]]
MAX_INTERNAL_BODY = 64 << 20
Body = TypeVar("Body", bound=BaseModel)


def error_response(error: ErrorInfo) -> JSONResponse:
    return JSONResponse(error_json(error), status_code=error.http_status)


def token_refusal(token: str | None, given: str) -> ErrorInfo | None:
    """Why a request that gave `given` as the internal token is refused (None: it is not)."""
    if token is None or hmac.compare_digest(given.encode(), token.encode()):
        return None
    return ErrorInfo(Fault.CLIENT, Code.UNAUTHORIZED, "missing or wrong internal token")


def guarded(token: str | None, handler: Handler) -> Handler:
    """Require the shared token (when one is set) and map StatecoreError to its response."""

    async def wrapped(request: Request) -> Response:
        refused = token_refusal(token, request.headers.get(TOKEN_HEADER, ""))
        if refused is not None:
            return error_response(refused)
        try:
            return await handler(request)
        except StatecoreError as exc:
            return error_response(exc.info)

    return wrapped


async def read_body(request: Request) -> bytes:
    """The request body, refused as soon as it grows past the limit (never buffered whole)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_INTERNAL_BODY:
            raise StatecoreError(client_error("body too large", Code.BODY_TOO_LARGE))
        chunks.append(chunk)
    return b"".join(chunks)


def validated(model: type[Body], raw: bytes) -> Body:
    """`raw` as `model`, or a client error naming the first problems."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise StatecoreError(client_error(f"invalid internal request: {exc.errors()[:3]}")) from exc


__all__ = ["MAX_INTERNAL_BODY", "Handler", "error_response", "guarded", "read_body", "token_refusal",
           "validated"]
