"""The public API as one ASGI app: OpenAI's routes, vLLM's tokenize routes, Anthropic's Messages
and OpenAI's Responses over one `Frontend`, plus a node's or the router's own routes; API keys
(`adapters.http.api_keys`) and CORS in front; an unknown path or method and an unexpected error
answered in OpenAI's error shape. The one module that knows every API. An adapter: nothing in
`statecore` or `effects`, and nothing else of the front end, may import it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from adapters.frontend.frontend import Frontend
from adapters.frontend.intake import REQUEST_ID_HEADER, error_response
from adapters.frontend.messages_api import MessagesApi
from adapters.frontend.openai_api import OpenAiApi
from adapters.frontend.responses_api import ResponsesApi
from adapters.frontend.tokenize_api import TokenizeApi
from adapters.http.api_keys import ApiKeyGuard, ApiKeys
from statecore.errors import bug, client_error

__all__ = ["CORS_EXPOSED_HEADERS", "build_app"]

logger = logging.getLogger(__name__)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    info = client_error(f"{request.method} {request.url.path}: {exc.detail}")
    return JSONResponse(info.to_openai(), status_code=exc.status_code, headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> Response:
    logger.error("unexpected error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(bug("internal error"))


CORS_EXPOSED_HEADERS = (REQUEST_ID_HEADER, "Retry-After")


def build_app(frontend: Frontend, *, extra_routes: Sequence[BaseRoute] = (),
              health: Callable[[Request], Awaitable[Response]] | None = None,
              api_keys: ApiKeys | None = None, allowed_origins: Sequence[str] = ()) -> Starlette:
    """The ASGI app: the OpenAI routes plus `extra_routes` (a node's or the router's own).
    `health` replaces the front end's `/health` where a node knows more (why it is unavailable).
    `api_keys` guards the public paths (`adapters.http.api_keys`); `allowed_origins` (`*` for any)
    turns CORS on, outside the key check so that a browser's preflight needs no key and a 401
    still reaches the page. Any request header is allowed (the SDKs send their own)."""
    openai, tokenize = OpenAiApi(frontend), TokenizeApi(frontend)
    messages, responses = MessagesApi(frontend), ResponsesApi(frontend)
    routes: list[BaseRoute] = [
        Route("/v1/completions", openai.completions, methods=["POST"]),
        Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
        Route("/v1/models", openai.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", openai.model, methods=["GET"]),
        Route("/tokenize", tokenize.tokenize, methods=["POST"]),
        Route("/detokenize", tokenize.detokenize, methods=["POST"]),
        Route("/v1/messages", messages.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
        Route("/v1/responses", responses.responses, methods=["POST"]),
        Route("/health", health or openai.health, methods=["GET"]),
        *extra_routes,
    ]
    middleware: list[Middleware] = []  # the first is the outermost
    if allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                                     allow_methods=["GET", "POST"], allow_headers=["*"],
                                     expose_headers=list(CORS_EXPOSED_HEADERS)))
    if api_keys is not None:
        middleware.append(Middleware(ApiKeyGuard, keys=api_keys))
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={HTTPException: _http_error, Exception: _unexpected})
