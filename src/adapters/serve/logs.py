"""How a node logs: one line per record (or one JSON object with `--log-json`), tagged with the
node's role since a local cluster's nodes share one stream.

What a person reads at INFO: one line per public API request when its response ends (method,
path, status, time, tokens, first token, finish, route; a refusal with its code), written by the
node that answers the client (`RequestLines`); one line per request an engine node ends (not
under a local cluster, whose router's line says it all); every retry and peer change with its
cause. Each request's state transitions are DEBUG, or INFO with `--log-transitions`.
This module may import anything.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from effects.runner import Instrument, NodeRunner, Reply
from statecore.errors import ErrorInfo
from statecore.events import Event, RetryRequested
from statecore.ids import RequestId
from statecore.intents import Complete, Reject, RespondTokens
from statecore.policy import text_finish

log = logging.getLogger("statecore")


class _JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role  # several nodes may share one log stream (a local cluster does)

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {"ts": record.created, "level": record.levelname, "role": self.role,
                               "logger": record.name, "msg": record.getMessage()}
        doc.update(getattr(record, "fields", {}))
        return json.dumps(doc)


def setup_logging(args: argparse.Namespace, role: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if args.log_json:
        handler.setFormatter(_JsonFormatter(role))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {role:7s} %(levelname)s %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler], force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per peer call is noise


class TransitionLines(Instrument):
    """Each request transition as a DEBUG line (INFO with `every`). An engine node's request that
    ends is an INFO line too, unless the node belongs to a local cluster: its router's request
    line tells the client's side of it (single nodes and routers write `RequestLines`)."""

    def __init__(self, role: str, terminal: frozenset[str], *, every: bool, in_local_cluster: bool) -> None:
        self.role = role
        self.terminal = terminal
        self.every = every
        self.ends_at_info = role in ("prefill", "decode") and not in_local_cluster

    def transition(self, request_id: RequestId, old: str, new: str, event: str,
                   error: ErrorInfo | None, outcome: str | None, context: object) -> None:
        # a failure names its code and message; any other end its reason (stop, length, ...)
        failed = error is not None and outcome == error.code.value
        said = (f" reason={outcome}: {error.message}" if failed and error else
                f" reason={outcome}" if outcome else "")
        fields = {"request_id": request_id, "role": self.role, "from": old, "to": new, "event": event,
                  "reason": outcome}
        level = logging.INFO if self.every or (self.ends_at_info and new in self.terminal) else logging.DEBUG
        log.log(level, "request %s %s -> %s on %s%s", request_id, old, new, event, said,
                extra={"fields": fields})


def log_transitions(runner: NodeRunner[Any], role: str, *, every: bool = False,
                    in_local_cluster: bool = False) -> None:
    """Log the runner's transitions (`TransitionLines`)."""
    terminal = frozenset(phase.value for phase in runner.machine.terminal)
    runner.instruments.add(TransitionLines(role, terminal, every=every, in_local_cluster=in_local_cluster))


class RetryLines(Instrument):
    """The router's retries, one INFO line each, which the client never sees: which request,
    and the failure that caused it."""

    def applied(self, request_id: RequestId, event: Event, context: object) -> None:
        if isinstance(event, RetryRequested):
            log.info("request %s: retrying on another node after %s: %s", request_id,
                     event.error.code.value, event.error.message,
                     extra={"fields": {"request_id": request_id, "retry_cause": event.error.code.value}})


def quiet_peer_changes() -> None:
    """A deliberate stop: the router's peers drain too, and their going down is expected, not
    news (the stop's own line says what happened)."""
    logging.getLogger("statecore.health").setLevel(logging.WARNING)


# ---------------------------------------------------------------------------------------------
# One line per public API request


@dataclass(slots=True)
class GenerationNote:
    """One generation of a request (a choice), as its request line tells it."""

    request_id: str
    prompt_tokens: int
    started: float
    first_token_s: float | None = None
    completion_tokens: int = 0
    finish: str | None = None
    error: str | None = None

    def tokens(self, count: int) -> None:
        if self.first_token_s is None:
            self.first_token_s = time.monotonic() - self.started
        self.completion_tokens += count


_NOTES: ContextVar[list[GenerationNote] | None] = ContextVar("statecore_request_notes", default=None)

_LOGGED_PATHS = ("/v1/", "/tokenize", "/detokenize")
_ROUTES_KEPT = 4096


class RequestLines(Instrument):
    """Writes one INFO line per public API request when its response ends (`instrument`), from
    what it notes of each generation the front end reads (an instrument of the runner: `watch`)
    and, on a router, the route each request took (`routed`)."""

    def __init__(self) -> None:
        self._routes: OrderedDict[str, str] = OrderedDict()
        self._notes: dict[RequestId, GenerationNote] = {}  # generations being read now

    def instrument(self, app: Starlette) -> None:
        app.add_middleware(_RequestLineMiddleware, lines=self)

    def watch(self, runner: NodeRunner[Any]) -> None:
        runner.instruments.add(self)

    def generation_started(self, request_id: RequestId, prompt_tokens: int) -> None:
        """A generation admitted for the request being served now (not noted outside one)."""
        notes = _NOTES.get()
        if notes is None:
            return
        note = GenerationNote(request_id, prompt_tokens, time.monotonic())
        notes.append(note)
        self._notes[request_id] = note

    def reply_read(self, request_id: RequestId, reply: Reply, generated: int) -> None:
        note = self._notes.get(request_id)
        if note is None:
            return
        match reply:
            case RespondTokens():
                note.tokens(generated)
            case Complete(finish_reason=reason):
                note.finish = reason
                note.completion_tokens += generated  # the EOS token, as usage counts it
                del self._notes[request_id]
            case Reject(error=error):
                note.error = error.code.value
                del self._notes[request_id]

    def generation_stopped(self, request_id: RequestId) -> None:
        note = self._notes.pop(request_id, None)
        if note is not None and note.finish is None:
            note.finish = text_finish(None, stop_string_matched=True)

    def generation_cancelled(self, request_id: RequestId) -> None:
        note = self._notes.pop(request_id, None)
        if note is not None and note.finish is None:
            note.finish = "cancelled"

    def routed(self, request_id: str, route: str) -> None:
        self._routes[request_id] = route
        while len(self._routes) > _ROUTES_KEPT:  # a request that never wrote its line
            self._routes.popitem(last=False)

    def _route_of(self, request_id: str) -> str | None:
        """The route of a generation: its last attempt's (a retry's id is `<id>.retryN`)."""
        found = None
        for key in [k for k in self._routes if k == request_id or k.startswith(request_id + ".retry")]:
            found = self._routes.pop(key)
        return found

    def line(self, method: str, path: str, status: int, seconds: float, request_id: str | None,
             notes: list[GenerationNote], refusal: tuple[str, str] | None) -> tuple[str, dict[str, Any]]:
        """The line and its JSON fields."""
        fields: dict[str, Any] = {"method": method, "path": path, "status": status,
                                  "seconds": round(seconds, 4), "request_id": request_id}
        parts = [f"{method} {path} {status} in {seconds:.2f} s", f"request {request_id or '-'}"]
        if refusal is not None:
            code, message = refusal
            fields["code"] = code
            parts.append(f"refused: {code}: {_short(message)}")
        if notes:
            prompt = notes[0].prompt_tokens
            completion = sum(n.completion_tokens for n in notes)
            firsts = [n.first_token_s for n in notes if n.first_token_s is not None]
            finishes = sorted({n.error or n.finish or "unfinished" for n in notes})
            routes = sorted({r for n in notes if (r := self._route_of(n.request_id))})
            fields.update(prompt_tokens=prompt, completion_tokens=completion, finish=finishes,
                          first_token_seconds=round(min(firsts), 4) if firsts else None, route=routes)
            parts.append(f"{prompt} prompt + {completion} completion tokens")
            if firsts:
                parts.append(f"first token {min(firsts):.2f} s")
            parts.append(f"finish {','.join(finishes)}")
            if routes:
                parts.append(f"route {','.join(routes)}")
        return ", ".join(parts), fields


def _short(message: str, limit: int = 160) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _refusal(body: bytes) -> tuple[str, str]:
    """The code and message of an error body: OpenAI's `{"error": {"code", "message"}}`, or
    Anthropic's `{"type": "error", "error": {"type", "message"}}`."""
    try:
        error = json.loads(body).get("error") or {}
        code = error.get("code") or error.get("type") or "error"
        return str(code), str(error.get("message", ""))
    except (ValueError, AttributeError):
        return "error", body[:160].decode("utf-8", "replace")


class _RequestLineMiddleware:
    """ASGI middleware: one INFO line per public API request, when its last byte is sent."""

    def __init__(self, app: ASGIApp, lines: RequestLines) -> None:
        self.app = app
        self.lines = lines

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(_LOGGED_PATHS):
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        notes: list[GenerationNote] = []
        token = _NOTES.set(notes)
        status = 0
        request_id: str | None = None
        error_body = bytearray()
        written = False

        def write() -> None:
            nonlocal written
            if written:
                return
            written = True
            refusal = _refusal(bytes(error_body)) if status >= 400 else None
            text, fields = self.lines.line(scope.get("method", "?"), path, status,
                                           time.monotonic() - started, request_id, notes, refusal)
            log.info("%s", text, extra={"fields": fields})

        async def observed_send(message: Message) -> None:
            nonlocal status, request_id
            if message["type"] == "http.response.start":
                status = message["status"]
                for name, value in message.get("headers", []):
                    if name.lower() == b"x-request-id":
                        request_id = value.decode("latin-1")
            elif message["type"] == "http.response.body":
                if status >= 400 and len(error_body) < 65536:
                    error_body.extend(message.get("body", b""))
                if not message.get("more_body", False):
                    await send(message)
                    write()
                    return
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            _NOTES.reset(token)
            if status:  # a client that went away mid-stream: its line still says what it got
                write()


__all__ = ["GenerationNote", "RequestLines", "RetryLines", "TransitionLines", "log_transitions",
           "quiet_peer_changes", "setup_logging"]
