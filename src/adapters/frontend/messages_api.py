"""Anthropic's Messages API's answers: the message (text, `thinking` and `tool_use` blocks, stop
reason, usage) and the stream's named events (message_start, content blocks and their deltas,
message_delta, message_stop; a failure on the way an `error` event), over a chat started by
`chat_run.start_chat` from the body `messages_bodies` maps. An adapter: nothing in `statecore`
or `effects` may import it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from adapters.frontend.as_chat import advance, answer, arguments_object
from adapters.frontend.chat_run import CalledTool, ChatEnd, ChatRun, ChatStep, count_chat, start_chat
from adapters.frontend.frontend import Frontend
from adapters.frontend.messages_bodies import MessagesBody, anthropic_error, parse_messages
from adapters.http.streaming import named_event
from statecore.errors import ErrorInfo
from statecore.policy import LENGTH, TOOL_CALLS

__all__ = ["MessagesApi"]


def _stop_reason(end: ChatEnd) -> str:
    if end.stop_string is not None:
        return "stop_sequence"
    return {LENGTH: "max_tokens", TOOL_CALLS: "tool_use"}.get(end.reason, "end_turn")


def _tool_use(call: CalledTool) -> dict[str, object]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments_object(call)}


def _thinking_block(thinking: str) -> dict[str, object]:
    """A thinking block. Its signature is empty: nothing here signs the thinking, and a block sent
    back goes to the template as it is."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def _thinking_shown(body: MessagesBody, run: ChatRun, reasoning: str) -> str | None:
    """The thinking block's text: none when the model did not think, "" when `display` omits it."""
    if not run.reasons or not reasoning:
        return None
    return reasoning if body.shows_thinking else ""


# ---------------------------------------------------------------------------------------------
# OpenAI's Responses API


class MessagesApi:
    """`POST /v1/messages` and `POST /v1/messages/count_tokens` over a `Frontend`."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def messages(self, request: Request) -> Response:
        started = await start_chat(self.frontend, request, parse_messages, anthropic_error,
                                   think_budget=lambda body: body.think_budget)
        if isinstance(started, Response):
            return started
        run, body = started
        return await answer(request, run, stream=bool(body.stream),
                             body=lambda text, calls, end, _, reasoning: self._message(
                                 run, text, end, calls, _thinking_shown(body, run, reasoning)),
                             events=lambda first: self._message_events(run, body, first))

    async def count_tokens(self, request: Request) -> Response:
        """`POST /v1/messages/count_tokens`: the prompt tokens the same body would be (no
        `max_tokens` needed), as the chat template encodes it with its tools."""
        counted = await count_chat(
            self.frontend, request, lambda data: parse_messages({"max_tokens": 1, **data}), anthropic_error)
        if isinstance(counted, Response):
            return counted
        return JSONResponse({"input_tokens": counted})

    def _message(self, run: ChatRun, text: str | None, end: ChatEnd | None,
                 calls: Sequence[CalledTool] = (), thinking: str | None = None) -> dict[str, object]:
        """The message: whole, or (no text, no end) as `message_start` announces it; `thinking`
        (None: no thinking block) first."""
        content: list[dict[str, object]] = [] if text is None or (not text and calls) else [
            {"type": "text", "text": text}]
        thought = [] if thinking is None else [_thinking_block(thinking)]
        return {
            "id": f"msg_{run.request_id}",
            "type": "message",
            "role": "assistant",
            "content": thought + content + [_tool_use(call) for call in calls],
            "model": self.frontend.model_name,
            "stop_reason": None if end is None else _stop_reason(end),
            "stop_sequence": None if end is None else end.stop_string,
            "usage": self._message_usage(run, 0 if end is None else end.completion_tokens),
        }

    @staticmethod
    def _message_usage(run: ChatRun, output_tokens: int) -> dict[str, object]:
        """A message's usage; with prompt tokens details on, also the prompt tokens read from the
        prefix cache, which Anthropic's `input_tokens` leaves out (the prompt is the sum of both)."""
        cached = run.cached_tokens
        if cached is None:
            return {"input_tokens": run.prompt_tokens, "output_tokens": output_tokens}
        return {"input_tokens": run.prompt_tokens - cached, "cache_read_input_tokens": cached,
                "output_tokens": output_tokens}

    async def _message_events(self, run: ChatRun, body: MessagesBody, first: ChatStep
                              ) -> AsyncGenerator[bytes, None]:
        """message_start, content_block_start, ping, content_block_delta..., content_block_stop,
        message_delta (stop reason, usage), message_stop; a failure on the way: an `error` event.
        A block is open from the start: a thinking block when the reply starts with thinking
        (`thinking_delta`s, unless `display` omits them, and an empty `signature_delta` before its
        stop), else a text block; text after thinking or a tool call opens a new text block, and
        each tool call is a `tool_use` block of its own (its arguments in one `input_json_delta`)."""
        step = first
        blocks = 0  # blocks started so far; the last one is open while `open_kind` is set
        open_kind: str | None = None

        def begin(block: dict[str, object]) -> bytes:
            nonlocal blocks
            blocks += 1
            return named_event("content_block_start", {"type": "content_block_start", "index": blocks - 1,
                                                "content_block": block})

        def end_block() -> bytes:
            return named_event("content_block_stop", {"type": "content_block_stop", "index": blocks - 1})

        def start(kind: str) -> list[bytes]:
            nonlocal open_kind
            events = stop()
            events.append(begin({"type": "text", "text": ""} if kind == "text" else _thinking_block("")))
            open_kind = kind
            return events

        def delta(content: dict[str, object]) -> bytes:
            return named_event("content_block_delta", {"type": "content_block_delta", "index": blocks - 1,
                                                "delta": content})

        def stop() -> list[bytes]:
            nonlocal open_kind
            events = []
            if open_kind == "thinking":
                events.append(delta({"type": "signature_delta", "signature": ""}))
            if open_kind is not None:
                events.append(end_block())
            open_kind = None
            return events

        try:
            yield named_event("message_start",
                              {"type": "message_start", "message": self._message(run, None, None)})
            for event in start("thinking" if run.reasons and first.reasoning else "text"):
                yield event
            yield named_event("ping", {"type": "ping"})
            while True:
                events: list[bytes] = []
                if step.reasoning:
                    if open_kind != "thinking":
                        events += start("thinking")
                    if body.shows_thinking:
                        events.append(delta({"type": "thinking_delta", "thinking": step.reasoning}))
                if step.text:
                    if open_kind != "text":
                        events += start("text")
                    events.append(delta({"type": "text_delta", "text": step.text}))
                for call in step.calls:
                    arguments = json.dumps(arguments_object(call), ensure_ascii=False)
                    events += [*stop(), begin({**_tool_use(call), "input": {}}),
                               delta({"type": "input_json_delta", "partial_json": arguments}), end_block()]
                for event in events:
                    yield event
                if step.end is not None:
                    break
                step = await advance(run)
            end = step.end
            if isinstance(end, ErrorInfo):
                yield named_event("error", anthropic_error(end))
                return
            for event in stop():
                yield event
            yield named_event("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": _stop_reason(end),
                                                   "stop_sequence": end.stop_string},
                                         "usage": {"output_tokens": end.completion_tokens}})
            yield named_event("message_stop", {"type": "message_stop"})
        finally:
            await run.cancel()

    # -- /v1/responses -----------------------------------------------------------------------
