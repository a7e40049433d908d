"""Events already waiting go out in one body write, and the bytes are the same as one at a time.

A stream whose generation has outputs queued (the HTTP side behind its tokens) renders them all
and sends them as one `http.response.body` message. Each request here runs twice over the same
script through raw ASGI calls: with the fake backend's outputs taken one at a time (each waited
for), and with them all already waiting. The bodies must be byte-identical (the `created` second
aside), and the second must take fewer writes.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator, Callable
from typing import Any

import pytest
import trio
import trio.testing
from starlette.applications import Starlette
from starlette.types import Message, Scope

from adapters.frontend.app import build_app
from adapters.frontend.frontend import Frontend
from adapters.http.streaming import EVENTS_PER_WRITE, WatchedStream
from statecore.errors import peer_error
from statecore.events import TokenLogprobs
from tests.integration.fake_backend import HANG, FakeBackend, ScriptItem, completed, rejected, replied

_USER = [{"role": "user", "content": "Hi"}]
_TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
_TEXT = 'The "quick" brown\\fox\n jumps, café 日本'


def _ids(frontend: Frontend, text: str) -> list[int]:
    return [int(t) for t in frontend.tokenizer.encode(text, add_special_tokens=False)]


def _say(text: str, end: str = "length") -> Callable[[Frontend], list[ScriptItem]]:
    return lambda frontend: [*(replied(t) for t in _ids(frontend, text)), completed(end)]


def _with_logprobs(text: str) -> Callable[[Frontend], list[ScriptItem]]:
    return lambda frontend: [
        *(replied(t, TokenLogprobs(-0.5 * i, ((t, -0.5 * i), (7, -9.0))))
          for i, t in enumerate(_ids(frontend, text))), completed("length")]


def _failing(text: str) -> Callable[[Frontend], list[ScriptItem]]:
    return lambda frontend: [*(replied(t) for t in _ids(frontend, text)),
                             rejected(peer_error("the decode node went away"))]


# (name, path, body, scripts: one per choice)
_CASES: list[tuple[str, str, dict[str, Any], list[Callable[[Frontend], list[ScriptItem]]]]] = [
    ("completion", "/v1/completions", {"prompt": "Hi", "max_tokens": 60}, [_say(_TEXT)]),
    ("completion with a stop string", "/v1/completions",
     {"prompt": "Hi", "max_tokens": 60, "stop": ["fox"]}, [_say(_TEXT)]),
    ("chat with usage", "/v1/chat/completions",
     {"messages": _USER, "max_tokens": 60, "stream_options": {"include_usage": True}}, [_say(_TEXT, "stop")]),
    ("two choices", "/v1/completions", {"prompt": "Hi", "max_tokens": 60, "n": 2},
     [_say(_TEXT), _say("Another, shorter one.", "stop")]),
    ("chat logprobs", "/v1/chat/completions",
     {"messages": _USER, "max_tokens": 60, "logprobs": True, "top_logprobs": 2}, [_with_logprobs(_TEXT)]),
    ("completion logprobs", "/v1/completions",
     {"prompt": "Hi", "max_tokens": 60, "logprobs": 1}, [_with_logprobs(_TEXT)]),
    ("an error mid-stream", "/v1/chat/completions", {"messages": _USER, "max_tokens": 60},
     [_failing(_TEXT)]),
    ("tool calls", "/v1/chat/completions", {"messages": _USER, "max_tokens": 120, "tools": _TOOLS},
     [_say("Checking." + _CALL + " done", "stop")]),
    ("more events than one write takes", "/v1/completions", {"prompt": "Hi", "max_tokens": 400},
     [_say(" word" * (3 * EVENTS_PER_WRITE))]),
]


async def _call(app: Starlette, path: str, body: dict[str, Any],
                disconnect: Callable[[list[dict[str, Any]]], bool] | None = None) -> list[dict[str, Any]]:
    """One raw ASGI request; every message the app sends. The client stays, or leaves once
    `disconnect` says so of what was sent."""
    sent: list[dict[str, Any]] = []
    changed = trio.Condition()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        async with changed:
            while disconnect is None or not disconnect(sent):
                await changed.wait()
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(dict(message))
        async with changed:
            changed.notify_all()

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"node"), (b"x-request-id", b"r-1")],
        "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 8000),
    }
    with trio.fail_after(10):
        await app(scope, receive, send)
    return sent


async def _writes(frontend: Frontend, backend: FakeBackend, path: str, body: dict[str, Any],
                  scripts: list[Callable[[Frontend], list[ScriptItem]]], *, ready_ahead: bool
                  ) -> tuple[int, list[bytes]]:
    """The response's status and its body writes (but empty ones)."""
    backend.ready_ahead = ready_ahead
    backend.scripts.extend(script(frontend) for script in scripts)
    sent = await _call(build_app(frontend), path, body)
    assert sent[0]["type"] == "http.response.start"
    assert sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body", False)
    return sent[0]["status"], [m["body"] for m in sent[1:] if m["body"]]


def _same_second(body: bytes) -> bytes:
    return re.sub(rb'"created":\d+', b'"created":0', body)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("name", "path", "body", "scripts"), _CASES, ids=[case[0] for case in _CASES])
async def test_waiting_events_go_out_together_with_the_same_bytes(
    frontend: Frontend, backend: FakeBackend, name: str, path: str, body: dict[str, Any],
    scripts: list[Callable[[Frontend], list[ScriptItem]]], stream: bool,
) -> None:
    body = {**body, "stream": stream}
    status, one_by_one = await _writes(frontend, backend, path, body, scripts, ready_ahead=False)
    assert all(generation.taken_nowait == 0 for generation in backend.generations)
    backend.generations.clear()
    batched_status, batched = await _writes(frontend, backend, path, body, scripts, ready_ahead=True)
    assert (batched_status, _same_second(b"".join(batched))) == (status, _same_second(b"".join(one_by_one)))
    if not stream or status != 200:
        return
    assert all(generation.taken_nowait > 0 for generation in backend.generations)
    assert b"".join(batched).count(b"data: ") > 4
    assert len(batched) < len(one_by_one)
    if name == "more events than one write takes":  # a write once the cap's worth is waiting
        assert len(batched) > 2
        assert all(write.count(b"data: ") == EVENTS_PER_WRITE for write in batched[:-1])


async def test_events_are_not_held_while_the_backend_works(
    frontend: Frontend, backend: FakeBackend
) -> None:
    """What is made goes out before the stream waits: the text before a hang reaches the client
    (which then leaves)."""
    backend.scripts.append([*_say("Hello world")(frontend)[:-1], HANG])

    def has_the_text(sent: list[dict[str, Any]]) -> bool:
        blocks = b"".join(m.get("body", b"") for m in sent).split(b"\n\n")[:-1]
        texts = [json.loads(block.removeprefix(b"data: "))["choices"][0]["text"] for block in blocks]
        return "".join(texts) == "Hello world"

    sent = await _call(build_app(frontend), "/v1/completions",
                       {"prompt": "Hi", "max_tokens": 8, "stream": True}, disconnect=has_the_text)
    assert has_the_text(sent)
    assert backend.last.taken_nowait > 0
    assert backend.last.cancels == 1


async def test_the_head_waits_for_the_first_chunk_and_leaves_with_it() -> None:
    """A stream's head is sent once its first chunk is made, right before it (no task of the
    event loop runs between them), not while the chunk is still being made."""
    made = trio.Event()
    sent: list[dict[str, Any]] = []

    async def chunks() -> AsyncGenerator[bytes, None]:
        await made.wait()
        yield b"data: one\n\n"
        yield b"data: two\n\n"

    async def receive() -> Message:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(dict(message))

    response = WatchedStream(chunks(), media_type="text/event-stream")
    async with trio.open_nursery() as nursery:
        scope: Scope = {"type": "http"}
        nursery.start_soon(response, scope, receive, send)
        await trio.testing.wait_all_tasks_blocked()
        assert sent == []
        made.set()
    assert [(m["type"], m.get("body")) for m in sent] == [
        ("http.response.start", None), ("http.response.body", b"data: one\n\n"),
        ("http.response.body", b"data: two\n\n"), ("http.response.body", b"")]
