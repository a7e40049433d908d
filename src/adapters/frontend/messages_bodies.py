"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the request
body, and the /v1/chat/completions body it means (system, then the messages, through the model's
chat template; tool results as `tool` messages, tool uses as `tool_calls`, earlier thinking as
`reasoning_content`; `thinking` as the template's `enable_thinking` and its cap as the chat's
thinking budget). What would change the output and is not served yet (images, a last assistant
message to continue, MCP servers, ...) is refused with 422 `unsupported_parameter`, never
ignored; the error body is Anthropic's, naming the fields as its client wrote them. An adapter:
nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from adapters.frontend.as_chat import (
    absent,
    by_type,
    empty,
    present,
    refuse_other_types,
    refuse_unsupported,
    renamed,
    text_parts,
    unsupported,
)
from adapters.frontend.intake import Strict
from statecore.errors import ErrorInfo, Fault

__all__ = ["MessagesBody", "anthropic_error", "parse_messages"]


class _Text(Strict):
    type: Literal["text"]
    text: str  # cache_control, citations: ignored (hints that change no output)


class _ToolUse(Strict):
    """An earlier assistant turn's tool call, sent back by the client."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class _Thinking(Strict):
    """An earlier assistant turn's thinking, sent back by the client (its signature, ours or
    another server's, is not checked: the text goes to the template as it is)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class _ToolResult(Strict):
    """A tool's answer to a `tool_use`, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[_Text] = ""
    is_error: bool | None = None


if TYPE_CHECKING:
    _Block = _Text | _ToolUse | _ToolResult | _Thinking
else:
    _Block = by_type(_Text, _ToolUse, _ToolResult, _Thinking)


class _AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[_Block]

    def to_chat(self) -> list[dict[str, object]]:
        """The chat messages this turn is: a user turn's tool results become `tool` messages
        (before its text), an assistant turn's tool uses its `tool_calls`."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        texts = [block for block in self.content if isinstance(block, _Text)]
        uses = [block for block in self.content if isinstance(block, _ToolUse)]
        results = [block for block in self.content if isinstance(block, _ToolResult)]
        thoughts = [block.thinking for block in self.content if isinstance(block, _Thinking)]
        thought = {"reasoning_content": "\n".join(thoughts)} if thoughts and self.role == "assistant" else {}
        chat: list[dict[str, object]] = [{"role": "tool", "tool_call_id": result.tool_use_id,
                                          "content": text_parts(result.content)} for result in results]
        if uses:
            chat.append({"role": "assistant", "content": text_parts(texts) if texts else None, **thought,
                         "tool_calls": [{"id": use.id, "type": "function", "function": {
                             "name": use.name, "arguments": json.dumps(use.input, ensure_ascii=False)}}
                             for use in uses]})
        elif texts or not results or thought:
            chat.append({"role": self.role, "content": text_parts(texts), **thought})
        return chat


class _AnthropicTool(Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # server tools (web search, ...) are refused

    def to_chat(self) -> dict[str, object]:
        return {"type": "function", "function": present(name=self.name, description=self.description,
                                                       parameters=self.input_schema)}


class _AnthropicToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def to_chat(self) -> object:
        """The chat's tool_choice: "any" is "required", a named tool the chat's named function."""
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name or ""}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class _OutputFormat(Strict):
    """Anthropic's structured outputs: the reply is JSON valid against `schema`."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    def to_chat(self) -> dict[str, object]:
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": self.schema_}}


class _ThinkingConfig(Strict):
    """Anthropic's `thinking`: `enabled` (with a cap on the thinking's tokens), `adaptive` (the
    model thinks as long as it likes) or `disabled`; `display: "omitted"` sends the thinking
    blocks without their text."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> _ThinkingConfig:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError("budget_tokens is given with type enabled, and only there")
        return self

    def template_kwargs(self) -> dict[str, object]:
        return {"enable_thinking": self.type != "disabled"}


class MessagesBody(Strict):
    model: str  # required, as Anthropic requires it
    max_tokens: int  # required, as Anthropic requires it; its range is the chat's
    messages: list[_AnthropicMessage] = Field(min_length=1)
    system: str | list[_Text] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None  # the chat's range (0 to 2), not Anthropic's (0 to 1)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    tools: list[_AnthropicTool] | None = None
    tool_choice: _AnthropicToolChoice | None = None
    output_format: _OutputFormat | None = None
    thinking: _ThinkingConfig | None = None
    chat_template_kwargs: dict[str, object] | None = None  # the chat's (checked there)

    @property
    def think_budget(self) -> int | None:
        return None if self.thinking is None else self.thinking.budget_tokens

    @property
    def shows_thinking(self) -> bool:
        return self.thinking is None or self.thinking.display != "omitted"

    def template_kwargs(self) -> dict[str, object] | None:
        """`thinking` as the template's `enable_thinking` (none: the template's default), then the
        client's own `chat_template_kwargs` over it."""
        if self.thinking is None and self.chat_template_kwargs is None:
            return None
        thinking = self.thinking.template_kwargs() if self.thinking else {}
        return {**thinking, **(self.chat_template_kwargs or {})}


_MESSAGES_NEUTRAL: dict[str, Callable[[object], bool]] = {
    "mcp_servers": empty,
    "container": absent,
}


def parse_messages(data: dict[str, object]) -> tuple[dict[str, object], MessagesBody]:
    refuse_unsupported(data, _MESSAGES_NEUTRAL)
    refuse_other_types("system", data.get("system"), ("text",), "content blocks")
    messages = data.get("messages")
    for index, message in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(message, dict):
            refuse_other_types(f"messages[{index}].content", message.get("content"),
                                ("text", "tool_use", "tool_result", "thinking"), "content blocks")
    body = MessagesBody.model_validate(data)
    if body.messages[-1].role == "assistant":
        raise unsupported("messages: a last message from the assistant (a prefill for the reply to "
                           "continue) is not served yet", f"messages[{len(body.messages) - 1}]")
    chat: list[dict[str, object]] = []
    if body.system:
        chat.append({"role": "system", "content": text_parts(body.system)})
    chat += [turn for message in body.messages for turn in message.to_chat()]
    tools = [tool.to_chat() for tool in body.tools] if body.tools else None
    return present(model=body.model, max_tokens=body.max_tokens, messages=chat, stop=body.stop_sequences,
                  temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, tools=tools,
                  tool_choice=None if body.tool_choice is None else body.tool_choice.to_chat(),
                  response_format=None if body.output_format is None else body.output_format.to_chat(),
                  chat_template_kwargs=body.template_kwargs(),
                  parallel_tool_calls=False if body.tool_choice and body.tool_choice.disable_parallel_tool_use
                  else None), body


_MESSAGES_NAMES = {"stop": "stop_sequences", "response_format": "output_format",
                   "tool_choice.function.name": "tool_choice.name"}


def _anthropic_error_type(info: ErrorInfo) -> str:
    """Anthropic's `error.type` for our status (their vocabulary; 422 is an invalid request too)."""
    by_status = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                 413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error"}
    if info.http_status in by_status:
        return by_status[info.http_status]
    if info.http_status < 500:
        return "invalid_request_error"
    return "overloaded_error" if info.fault is Fault.OVERLOADED else "api_error"


def anthropic_error(info: ErrorInfo) -> dict[str, object]:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}."""
    info = renamed(info, _MESSAGES_NAMES)
    return {"type": "error", "error": {"type": _anthropic_error_type(info), "message": info.message}}
