"""API keys on the public HTTP API: a pure ASGI middleware in front of the single node's and the
router's app (`adapters.frontend.app.build_app`), and the parsing of `--api-key` / `STATECORE_API_KEY`.

With keys set, a request needs one of them in `Authorization: Bearer KEY` (OpenAI's clients) or
`x-api-key: KEY` (Anthropic's), compared in constant time against every key; otherwise it gets
401 `invalid_api_key` in OpenAI's error shape with `WWW-Authenticate: Bearer`. The guard denies by
default: every path needs the key except `/internal/*` (the nodes' own endpoints, behind the
internal token) and `/health`, `/metrics` and `/ui` unless `protects` names them, so a public route
added later is guarded without being listed here. The key stops at the front end: a backend gets
only a `GenerationRequest` (request id, token ids, sampling), so the router has no key to pass on
to its peers. This module sees only ASGI scopes and headers: it must never import the front end,
the engine, the peers, trio or httpx.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from statecore.errors import Code, ErrorInfo, Fault

__all__ = ["API_KEY_ENV", "PROTECTABLE", "ApiKeyGuard", "ApiKeys", "keys_from", "parse_key",
           "parse_protects"]

API_KEY_ENV = "STATECORE_API_KEY"
PROTECTABLE = ("health", "metrics", "ui")
"""Paths open by default that `--api-key-protects` may close: `/health`, `/metrics`, `/ui` and `/ui/*`."""

_KEY = re.compile(r"[\x21-\x2b\x2d-\x7e]+")  # printable ASCII but space and comma


def parse_key(text: str) -> str:
    """One API key as given; ValueError (which never repeats the key) when it is not usable."""
    if not _KEY.fullmatch(text):
        raise ValueError("an API key must be printable ASCII without spaces or commas")
    return text


def keys_from(flags: Sequence[str], env: str | None) -> tuple[str, ...]:
    """Every key: those given as flags, then those in the environment (comma-separated)."""
    from_env = [parse_key(key.strip()) for key in (env or "").split(",") if key.strip()]
    return tuple(dict.fromkeys([*flags, *from_env]))


def parse_protects(text: str) -> frozenset[str]:
    """`health,metrics` as a set; ValueError for a name not in PROTECTABLE."""
    names = frozenset(name.strip() for name in text.split(",") if name.strip())
    unknown = sorted(names - set(PROTECTABLE))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not one of {', '.join(PROTECTABLE)}")
    return names


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """The keys a public endpoint accepts, and which of the paths open by default they close."""

    keys: tuple[str, ...]
    protects: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("ApiKeys needs at least one key")
        for key in self.keys:
            parse_key(key)
        parse_protects(",".join(self.protects))

    def guards(self, path: str) -> bool:
        """Whether a request for `path` needs a key."""
        if _under(path, "/internal"):
            return False
        if path in ("/health", "/metrics"):
            return path[1:] in self.protects
        if _under(path, "/ui"):
            return "ui" in self.protects
        return True

    def refusal(self, headers: Headers) -> ErrorInfo | None:
        """None when the request carries one of the keys; otherwise why it is refused."""
        given = _given(headers)
        if not given:
            return ErrorInfo(Fault.CLIENT, Code.INVALID_API_KEY,
                             "this server needs an API key: send it as 'Authorization: Bearer <key>' "
                             "or 'x-api-key: <key>'")
        expected = [key.encode() for key in self.keys]
        matched = False
        for value in given:  # every pair compared, in constant time each: no early exit
            for key in expected:
                matched |= hmac.compare_digest(value, key)
        if matched:
            return None
        return ErrorInfo(Fault.CLIENT, Code.INVALID_API_KEY, "the API key given is not valid")


def _given(headers: Headers) -> list[bytes]:
    """The keys a request offers (Starlette decodes header values as latin-1)."""
    found: list[str] = []
    authorization = headers.get("authorization")
    if authorization is not None:
        scheme, _, credentials = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            found.append(credentials.strip())
    found += [value.strip() for value in headers.getlist("x-api-key") if value.strip()]
    return [value.encode("latin-1") for value in found]


def _has_body(headers: Headers) -> bool:
    return "transfer-encoding" in headers or headers.get("content-length", "0") not in ("", "0")


class ApiKeyGuard:
    """ASGI middleware: a request for a guarded path without one of the keys gets the 401."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.guards(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        info = self.keys.refusal(headers)
        if info is None:
            await self.app(scope, receive, send)
            return
        challenge = "Bearer" if not _given(headers) else 'Bearer error="invalid_token"'
        answer = {"WWW-Authenticate": challenge}
        if _has_body(headers):
            # the body stays unread: the server drops the connection, and says so (as the front end does)
            answer["Connection"] = "close"
        response = JSONResponse(info.to_openai(), status_code=info.http_status, headers=answer)
        await response(scope, receive, send)

