"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) and OpenAI's
Responses API (`POST /v1/responses`), text in and text out, on the single node and the router alike.

Each request is mapped onto the /v1/chat/completions body it means (system, then the messages,
through the model's chat template) and started by `openai_api.Frontend.start_chat`, so it shares
everything with a chat completion but the shapes: the request id (`X-Request-Id`), the body limit,
the validation ranges, the template, the stop strings, admission, cancel-on-disconnect and the
backend. Only the answers are made here: the JSON bodies, the SSE event sequences and the error
bodies, each in its API's own shape with the status of the `ErrorInfo`; an error about a field of
the mapped chat names the field as this API's client wrote it. Tools map onto the chat's (its
tool calls come back as `tool_use` blocks or `function_call` items), and so do the Responses
API's logprobs (`include: ["message.output_text.logprobs"]`, `top_logprobs`: the chat's
`logprobs: true` and `top_logprobs`, the same numbers in the output text and the text events,
in OpenAI's Responses shapes). A reasoning model's thinking (split off by the chat) comes back
as `thinking` blocks and `reasoning` items, and earlier turns' go back to the template; Anthropic's
`thinking` turns it on or off and may cap it (`budget_tokens`, enforced by the chat's
`_ThinkBudget`), the Responses API's `reasoning.effort` is the chat's `reasoning_effort`, and both
take the chat's `chat_template_kwargs`. What would change the output
and is not served yet (images and other non-text content, previous_response_id,
background, ...) is refused with 422 `unsupported_parameter`, never ignored; fields that change
nothing (`metadata`, `store`, `user`, ...) are ignored, as unknown fields are on the chat. An
adapter: `openai_api` imports it to serve its routes, so it imports `openai_api` for types only;
nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from adapters.http.streaming import cancel_on_disconnect
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, bug, client_error

if TYPE_CHECKING:
    from adapters.http.openai_api import CalledTool, ChatEnd, ChatRun, ChatStep, Frontend

__all__ = ["other_api_routes"]

logger = logging.getLogger(__name__)


def other_api_routes(frontend: Frontend) -> list[BaseRoute]:
    """`POST /v1/messages` and `POST /v1/responses` over `frontend`."""
    apis = _OtherApis(frontend)
    return [Route("/v1/messages", apis.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", apis.count_tokens, methods=["POST"]),
            Route("/v1/responses", apis.responses, methods=["POST"])]


# ---------------------------------------------------------------------------------------------
# Shared: refusals, field names, SSE


class _Strict(BaseModel):
    """As strict as the chat's bodies: no coercion, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def _unsupported(message: str, param: str) -> StatecoreError:
    return StatecoreError(ErrorInfo(Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER, message, param))


def _refuse_unsupported(data: Mapping[str, object], neutral: Mapping[str, Callable[[object], bool]]) -> None:
    """Parameters that would change the output and are not served: refused unless neutral."""
    names = [name for name, is_neutral in neutral.items() if name in data and not is_neutral(data[name])]
    if names:
        raise _unsupported(f"unsupported parameter{'s' if len(names) > 1 else ''}: {', '.join(names)} "
                           "(not served yet on this endpoint)", names[0])


def _absent(value: object) -> bool:
    return value is None


def _empty(value: object) -> bool:
    return value is None or (isinstance(value, list | dict) and not value)


def _refuse_other_types(where: str, items: object, allowed: tuple[str, ...], what: str,
                        default: str | None = None) -> None:
    """An entry of the list `items` whose `type` (else `default`) is not `allowed` (images, tool
    calls, ...) is refused with its place; a missing or non-string type is left to validation."""
    if not isinstance(items, list):
        return
    for index, item in enumerate(items):
        kind = item.get("type", default) if isinstance(item, dict) else None
        if isinstance(kind, str) and kind not in allowed:
            raise _unsupported(f"{where}[{index}]: {what} of type {kind!r} are not served yet "
                               f"(only {' and '.join(allowed)})", f"{where}[{index}]")


def _renamed(info: ErrorInfo, names: Mapping[str, str]) -> ErrorInfo:
    """An error about the mapped chat, naming its fields as this API's client wrote them."""
    message, param = info.message, info.param
    for chat_name, own in names.items():
        message = re.sub(rf"\b{chat_name}(?=: | is )", own, message)
        if param is not None and re.match(rf"{chat_name}\b", param):
            param = own + param[len(chat_name):]
    return replace(info, message=message, param=param)


def _sse(event: str, data: object) -> bytes:
    """One server-sent event with its name (both APIs name theirs); JSON has no raw newline."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return f"event: {event}\ndata: {text}\n\n".encode()


def _given(**fields: object) -> dict[str, object]:
    return {name: value for name, value in fields.items() if value is not None}


def _parts(content: str | Sequence[_Text | _InputText]) -> str | list[dict[str, str]]:
    """Content as the chat takes it: a string, or text parts (which its template joins with newlines)."""
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part.text} for part in content]


async def _advance(run: ChatRun) -> ChatStep:
    from adapters.http.openai_api import ChatStep

    try:
        return await run.advance()
    except Exception:
        logger.exception("request %s: unexpected error while generating", run.request_id)
        return ChatStep("", (), bug("internal error while generating"))


_Logprob = dict[str, Any]  # an entry of the chat's logprobs.content: {token, logprob, bytes, top_logprobs}


async def _answer(request: Request, run: ChatRun, *, stream: bool,
                  body: Callable[[str, Sequence[CalledTool], ChatEnd, Sequence[_Logprob], str], object],
                  events: Callable[[ChatStep], AsyncGenerator[bytes, None]]) -> Response:
    """As /v1/chat/completions answers: a whole body (with every token's logprobs, when the chat
    asked for them; the model's thinking apart), or a stream that starts with the first text
    (or the end), so that a failure
    before any output still gets its own status; the client going away before then cancels the
    generation."""
    steps: list[ChatStep] = []
    try:
        async with cancel_on_disconnect(request.receive) as watch:
            steps.append(await _advance(run))
            while not stream and steps[-1].end is None:
                steps.append(await _advance(run))
        if watch.disconnected:
            await run.cancel()
            return Response(status_code=499, headers=run.headers)
        end = steps[-1].end
        if isinstance(end, ErrorInfo):
            await run.cancel()
            return run.error_response(end)
        if stream:
            return run.event_stream(events(steps[0]))
        assert end is not None
        calls = [call for step in steps for call in step.calls]
        logprobs = [entry for step in steps for entry in step.logprobs]
        text = "".join(step.text for step in steps)
        reasoning = "".join(step.reasoning for step in steps)
        return JSONResponse(body(text, calls, end, logprobs, reasoning), headers=run.headers)
    except Exception:
        logger.exception("request %s: unexpected error", run.request_id)
        await run.cancel()
        return run.error_response(bug("internal error while generating"))
    except BaseException:  # cancelled from outside (server shutdown): free the backend too
        await run.cancel()
        raise


# ---------------------------------------------------------------------------------------------
# Anthropic's Messages API


class _Text(_Strict):
    type: Literal["text"]
    text: str  # cache_control, citations: ignored (hints that change no output)


class _ToolUse(_Strict):
    """An earlier assistant turn's tool call, sent back by the client."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class _Thinking(_Strict):
    """An earlier assistant turn's thinking, sent back by the client (its signature, ours or
    another server's, is not checked: the text goes to the template as it is)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class _ToolResult(_Strict):
    """A tool's answer to a `tool_use`, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[_Text] = ""
    is_error: bool | None = None


def _by_type(*models: type[BaseModel]) -> Any:
    """A union of `models` told apart by their `type` field, each branch tagged with its class
    name (which an error's field path leaves out, as it leaves out any union branch)."""
    tags: dict[str, str] = {}
    for model in models:
        for kind in get_args(model.model_fields["type"].annotation):
            tags[kind] = model.__name__

    def tag_of(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind) if isinstance(kind, str) else None

    branches = tuple(Annotated[model, Tag(model.__name__)] for model in models)
    return Annotated[Union[branches], Discriminator(tag_of)]  # noqa: UP007 (a tuple of branches)


if TYPE_CHECKING:
    _Block = _Text | _ToolUse | _ToolResult | _Thinking
else:
    _Block = _by_type(_Text, _ToolUse, _ToolResult, _Thinking)


class _AnthropicMessage(_Strict):
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
                                          "content": _parts(result.content)} for result in results]
        if uses:
            chat.append({"role": "assistant", "content": _parts(texts) if texts else None, **thought,
                         "tool_calls": [{"id": use.id, "type": "function", "function": {
                             "name": use.name, "arguments": json.dumps(use.input, ensure_ascii=False)}}
                             for use in uses]})
        elif texts or not results or thought:
            chat.append({"role": self.role, "content": _parts(texts), **thought})
        return chat


class _AnthropicTool(_Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # server tools (web search, ...) are refused

    def to_chat(self) -> dict[str, object]:
        return {"type": "function", "function": _given(name=self.name, description=self.description,
                                                       parameters=self.input_schema)}


class _AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def to_chat(self) -> object:
        """The chat's tool_choice: "any" is "required", a named tool the chat's named function."""
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name or ""}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class _OutputFormat(_Strict):
    """Anthropic's structured outputs: the reply is JSON valid against `schema`."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    def to_chat(self) -> dict[str, object]:
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": self.schema_}}


class _ThinkingConfig(_Strict):
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


class _MessagesBody(_Strict):
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
    "mcp_servers": _empty,
    "container": _absent,
}


def _parse_messages(data: dict[str, object]) -> tuple[dict[str, object], _MessagesBody]:
    _refuse_unsupported(data, _MESSAGES_NEUTRAL)
    _refuse_other_types("system", data.get("system"), ("text",), "content blocks")
    messages = data.get("messages")
    for index, message in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(message, dict):
            _refuse_other_types(f"messages[{index}].content", message.get("content"),
                                ("text", "tool_use", "tool_result", "thinking"), "content blocks")
    body = _MessagesBody.model_validate(data)
    if body.messages[-1].role == "assistant":
        raise _unsupported("messages: a last message from the assistant (a prefill for the reply to "
                           "continue) is not served yet", f"messages[{len(body.messages) - 1}]")
    chat: list[dict[str, object]] = []
    if body.system:
        chat.append({"role": "system", "content": _parts(body.system)})
    chat += [turn for message in body.messages for turn in message.to_chat()]
    tools = [tool.to_chat() for tool in body.tools] if body.tools else None
    return _given(model=body.model, max_tokens=body.max_tokens, messages=chat, stop=body.stop_sequences,
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


def _anthropic_error(info: ErrorInfo) -> dict[str, object]:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}."""
    info = _renamed(info, _MESSAGES_NAMES)
    return {"type": "error", "error": {"type": _anthropic_error_type(info), "message": info.message}}


def _stop_reason(end: ChatEnd) -> str:
    if end.stop_string is not None:
        return "stop_sequence"
    return {"length": "max_tokens", "tool_calls": "tool_use"}.get(end.reason, "end_turn")


def _arguments(call: CalledTool) -> dict[str, object]:
    """A call's arguments as the object both APIs' clients expect (text that is not a JSON object
    is kept whole under "arguments")."""
    try:
        parsed = json.loads(call.arguments)
    except ValueError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"arguments": call.arguments}


def _tool_use(call: CalledTool) -> dict[str, object]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": _arguments(call)}


def _thinking_block(thinking: str) -> dict[str, object]:
    """A thinking block. Its signature is empty: nothing here signs the thinking, and a block sent
    back goes to the template as it is."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def _thinking_shown(body: _MessagesBody, run: ChatRun, reasoning: str) -> str | None:
    """The thinking block's text: none when the model did not think, "" when `display` omits it."""
    if not run.reasons or not reasoning:
        return None
    return reasoning if body.shows_thinking else ""


# ---------------------------------------------------------------------------------------------
# OpenAI's Responses API


class _InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str  # an output_text's annotations and logprobs: ignored


class _InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[_InputText]  # id, status (of an earlier output message): ignored


class _FunctionCallItem(_Strict):
    """An earlier output's function call, sent back by the client."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text; id, status: ignored


class _FunctionCallOutput(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class _ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class _ReasoningItem(_Strict):
    """An earlier output's reasoning, sent back by the client: its text (this server's reasoning
    items carry it; a summary or encrypted content, which only another server could read, is left
    out) goes to the template as the next assistant turn's `reasoning_content`."""

    type: Literal["reasoning"]
    content: list[_ReasoningText] | None = None  # id, summary, encrypted_content, status: not read

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or ())


if TYPE_CHECKING:
    _Item = _InputMessage | _FunctionCallItem | _FunctionCallOutput | _ReasoningItem
else:
    _Item = _by_type(_InputMessage, _FunctionCallItem, _FunctionCallOutput, _ReasoningItem)


class _FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat(self) -> dict[str, object]:
        return {"type": "function", "function": _given(name=self.name, description=self.description,
                                                       parameters=self.parameters)}


class _NamedFunction(_Strict):
    type: Literal["function"]
    name: str


def _items_to_chat(items: Sequence[_InputMessage | _FunctionCallItem | _FunctionCallOutput | _ReasoningItem]
                   ) -> list[dict[str, object]]:
    """Input items as chat messages: consecutive function calls are one assistant turn's
    tool_calls, a call's output a `tool` message, reasoning the `reasoning_content` of the
    assistant turn that follows it (dropped when none does)."""
    chat: list[dict[str, object]] = []
    calls: list[dict[str, object]] | None = None  # the open assistant turn's tool calls
    thought: list[str] = []  # reasoning waiting for its assistant turn

    def reasoning() -> dict[str, object]:
        text = "".join(thought)
        thought.clear()
        return {"reasoning_content": text} if text else {}

    for item in items:
        if isinstance(item, _ReasoningItem):
            thought.append(item.text)
            continue
        if isinstance(item, _FunctionCallItem):
            if calls is None:
                calls = []
                chat.append({"role": "assistant", "content": None, "tool_calls": calls, **reasoning()})
            calls.append({"id": item.call_id, "type": "function",
                          "function": {"name": item.name, "arguments": item.arguments}})
            continue
        calls = None
        if isinstance(item, _InputMessage):
            shown = reasoning() if item.role == "assistant" else {}
            chat.append({"role": item.role, "content": _parts(item.content), **shown})
        else:
            chat.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return chat


class _TextFormat(_Strict):
    """The Responses API's `text.format`: free text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def to_chat(self) -> dict[str, object] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        schema = _given(name=self.name, schema=self.schema_, description=self.description, strict=self.strict)
        return {"type": "json_schema", "json_schema": schema}

    def echoed(self) -> dict[str, object]:
        return self.model_dump(by_alias=True, exclude_none=True)


class _TextConfig(_Strict):
    format: _TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one that asks for nothing different


_OUTPUT_LOGPROBS = "message.output_text.logprobs"
# served as it stands: a reasoning item's text is in its `content`, and `encrypted_content` is null
# (nothing is encrypted, nothing stored: a client that sends the item back sends its text back)
_ENCRYPTED_REASONING = "reasoning.encrypted_content"
_SERVED_INCLUDES = (_OUTPUT_LOGPROBS, _ENCRYPTED_REASONING)
# OpenAI's `include` values (openai.types.responses.ResponseIncludable): only the output text's
# logprobs are served; the others are refused as not served yet, anything else is invalid
_Includable = Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                      "message.input_image.image_url", "computer_call_output.output.image_url",
                      "code_interpreter_call.outputs", "reasoning.encrypted_content",
                      "message.output_text.logprobs"]
_MAX_TOP_LOGPROBS = 20  # the chat's range (openai_api.MAX_TOP_LOGPROBS; OpenAI's too)


class _ReasoningConfig(_Strict):
    """The Responses API's `reasoning`: `effort` is the chat's `reasoning_effort`; no summaries
    are made (a reasoning item's `summary` is empty, its text the model's own), so `summary`
    changes nothing."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the old name of summary

    def echoed(self) -> dict[str, object]:
        return {"effort": self.effort, "summary": self.summary or self.generate_summary}


class _ResponsesBody(_Strict):
    model: str | None = None
    input: str | list[_Item]
    instructions: str | None = None
    max_output_tokens: int | None = None  # the chat's max_tokens: its range and default
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None  # echoed, as OpenAI does; nothing is kept
    tools: list[_FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | _NamedFunction | None = None
    text: _TextConfig | None = None
    parallel_tool_calls: bool | None = None
    include: list[_Includable] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=_MAX_TOP_LOGPROBS)
    reasoning: _ReasoningConfig | None = None
    chat_template_kwargs: dict[str, object] | None = None  # the chat's (checked there)

    @property
    def logprobs(self) -> bool:
        """Whether the output text comes with its tokens' logprobs (`include` asks for them)."""
        return _OUTPUT_LOGPROBS in (self.include or ())

    def response_format(self) -> dict[str, object] | None:
        return None if self.text is None or self.text.format is None else self.text.format.to_chat()

    def text_format(self) -> dict[str, object]:
        if self.text is None or self.text.format is None:
            return {"type": "text"}
        return self.text.format.echoed()

    def chat_tool_choice(self) -> object:
        if isinstance(self.tool_choice, _NamedFunction):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice


_RESPONSES_NEUTRAL: dict[str, Callable[[object], bool]] = {
    "previous_response_id": _absent,  # nothing is stored to continue from
    "conversation": _absent,
    "prompt": _absent,
    "background": lambda value: value is None or value is False,
    "truncation": lambda value: value is None or value == "disabled",
}


def _refuse_other_includes(include: object) -> None:
    """`include` values OpenAI knows but that are not served (a value it does not know is left
    to validation: a 400)."""
    for index, value in enumerate(include if isinstance(include, list) else []):
        if value not in _SERVED_INCLUDES and value in get_args(_Includable):
            raise _unsupported(f"include[{index}]: {value!r} is not served yet (only "
                               f"{' and '.join(map(repr, _SERVED_INCLUDES))})", f"include[{index}]")


def _parse_responses(data: dict[str, object]) -> tuple[dict[str, object], _ResponsesBody]:
    _refuse_unsupported(data, _RESPONSES_NEUTRAL)
    _refuse_other_includes(data.get("include"))
    items = data.get("input")
    # an item without a type is a message (OpenAI's "easy input message")
    _refuse_other_types("input", items, ("message", "function_call", "function_call_output", "reasoning"),
                        "input items", default="message")
    for index, item in enumerate(items if isinstance(items, list) else []):
        if isinstance(item, dict) and item.get("type") != "reasoning":  # its content is reasoning text
            _refuse_other_types(f"input[{index}].content", item.get("content"),
                                ("input_text", "output_text"), "content parts")
    if isinstance(items, list):  # typed, for the validation that tells the items apart
        data = {**data, "input": [{"type": "message", **item} if isinstance(item, dict) and "type" not in item
                                  else item for item in items]}
    body = _ResponsesBody.model_validate(data)
    chat: list[dict[str, object]] = []
    if body.instructions:
        chat.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        chat.append({"role": "user", "content": body.input})
    else:
        chat += _items_to_chat(body.input)
    if body.top_logprobs and not body.logprobs:
        raise StatecoreError(client_error(f"top_logprobs needs include: [{_OUTPUT_LOGPROBS!r}] (the "
                                          "logprobs come with the output text)", param="top_logprobs"))
    tools = [tool.to_chat() for tool in body.tools] if body.tools else None
    return _given(model=body.model, max_tokens=body.max_output_tokens, messages=chat,
                  temperature=body.temperature, top_p=body.top_p, tools=tools,
                  tool_choice=body.chat_tool_choice(), response_format=body.response_format(),
                  parallel_tool_calls=body.parallel_tool_calls, logprobs=body.logprobs or None,
                  top_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                  reasoning_effort=body.reasoning.effort if body.reasoning else None,
                  chat_template_kwargs=body.chat_template_kwargs), body


_RESPONSES_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
                    "tool_choice.function.name": "tool_choice.name", "reasoning_effort": "reasoning.effort"}


def _event_logprobs(entries: Sequence[_Logprob]) -> list[dict[str, object]]:
    """Logprobs as the stream's text events carry them (OpenAI's ResponseTextDeltaEvent and
    ResponseTextDoneEvent): `{token, logprob, top_logprobs: [{token, logprob}]}`, no `bytes`."""
    return [{"token": entry["token"], "logprob": entry["logprob"],
             "top_logprobs": [{"token": top["token"], "logprob": top["logprob"]}
                              for top in entry["top_logprobs"]]} for entry in entries]


def _reasoning_text(text: str) -> dict[str, object]:
    return {"type": "reasoning_text", "text": text}


def _status(end: ChatEnd) -> str:
    return "incomplete" if end.reason == "length" else "completed"


def _openai_error(info: ErrorInfo) -> object:
    return _renamed(info, _RESPONSES_NAMES).to_openai()


# ---------------------------------------------------------------------------------------------
# The endpoints


class _OtherApis:
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    # -- /v1/messages ------------------------------------------------------------------------

    async def messages(self, request: Request) -> Response:
        started = await self.frontend.start_chat(request, _parse_messages, _anthropic_error,
                                                 think_budget=lambda body: body.think_budget)
        if isinstance(started, Response):
            return started
        run, body = started
        return await _answer(request, run, stream=bool(body.stream),
                             body=lambda text, calls, end, _, reasoning: self._message(
                                 run, text, end, calls, _thinking_shown(body, run, reasoning)),
                             events=lambda first: self._message_events(run, body, first))

    async def count_tokens(self, request: Request) -> Response:
        """`POST /v1/messages/count_tokens`: the prompt tokens the same body would be (no
        `max_tokens` needed), as the chat template encodes it with its tools."""
        counted = await self.frontend.count_chat(
            request, lambda data: _parse_messages({"max_tokens": 1, **data}), _anthropic_error)
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

    async def _message_events(self, run: ChatRun, body: _MessagesBody, first: ChatStep
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
            return _sse("content_block_start", {"type": "content_block_start", "index": blocks - 1,
                                                "content_block": block})

        def end_block() -> bytes:
            return _sse("content_block_stop", {"type": "content_block_stop", "index": blocks - 1})

        def start(kind: str) -> list[bytes]:
            nonlocal open_kind
            events = stop()
            events.append(begin({"type": "text", "text": ""} if kind == "text" else _thinking_block("")))
            open_kind = kind
            return events

        def delta(content: dict[str, object]) -> bytes:
            return _sse("content_block_delta", {"type": "content_block_delta", "index": blocks - 1,
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
            yield _sse("message_start", {"type": "message_start", "message": self._message(run, None, None)})
            for event in start("thinking" if run.reasons and first.reasoning else "text"):
                yield event
            yield _sse("ping", {"type": "ping"})
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
                    arguments = json.dumps(_arguments(call), ensure_ascii=False)
                    events += [*stop(), begin({**_tool_use(call), "input": {}}),
                               delta({"type": "input_json_delta", "partial_json": arguments}), end_block()]
                for event in events:
                    yield event
                if step.end is not None:
                    break
                step = await _advance(run)
            end = step.end
            if isinstance(end, ErrorInfo):
                yield _sse("error", _anthropic_error(end))
                return
            for event in stop():
                yield event
            yield _sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": _stop_reason(end),
                                                   "stop_sequence": end.stop_string},
                                         "usage": {"output_tokens": end.completion_tokens}})
            yield _sse("message_stop", {"type": "message_stop"})
        finally:
            await run.cancel()

    # -- /v1/responses -----------------------------------------------------------------------

    async def responses(self, request: Request) -> Response:
        started = await self.frontend.start_chat(request, _parse_responses, _openai_error)
        if isinstance(started, Response):
            return started
        run, body = started
        return await _answer(request, run, stream=bool(body.stream),
                             body=lambda text, calls, end, logprobs, reasoning: self._response(
                                 run, body, text, end, calls, logprobs if body.logprobs else None,
                                 reasoning=[reasoning] if run.reasons and reasoning else []),
                             events=lambda first: self._response_events(run, body, first))

    @staticmethod
    def _text_part(text: str, logprobs: Sequence[_Logprob] | None) -> dict[str, object]:
        """An output_text part; with the logprobs of its tokens when `include` asked for them."""
        part: dict[str, object] = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = list(logprobs)
        return part

    @staticmethod
    def _reasoning_item(run: ChatRun, number: int, text: str | None, status: str) -> dict[str, object]:
        """A reasoning output item: the model's thinking as it wrote it, no summary (no content
        while it is only announced); the reply's first is `rs_<request id>`, a later one `..._<n>`."""
        content = [] if text is None else [_reasoning_text(text)]
        return {"id": f"rs_{run.request_id}" + (f"_{number}" if number else ""), "type": "reasoning",
                "summary": [], "content": content, "encrypted_content": None, "status": status}

    def _item(self, run: ChatRun, text: str | None, status: str,
              logprobs: Sequence[_Logprob] | None = None) -> dict[str, object]:
        """The one output message (no content while it is only announced)."""
        content = [] if text is None else [self._text_part(text, logprobs)]
        return {"id": f"msg_{run.request_id}", "type": "message", "status": status, "role": "assistant",
                "content": content}

    @staticmethod
    def _tool_choice(body: _ResponsesBody) -> object:
        """The tool_choice in force, as the response object echoes it."""
        if body.tool_choice is None:
            return "auto" if body.tools else "none"
        return body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.model_dump()

    @staticmethod
    def _function_call(call: CalledTool, arguments: str | None = None, status: str = "completed"
                       ) -> dict[str, object]:
        """A function call output item (`arguments` "" while it is only announced)."""
        return {"id": f"fc_{call.id}", "type": "function_call", "status": status, "call_id": call.id,
                "name": call.name, "arguments": call.arguments if arguments is None else arguments}

    @staticmethod
    def _top_logprobs(body: _ResponsesBody) -> dict[str, object]:
        """`top_logprobs` as the response object echoes it: where the request gave it or asked for
        logprobs (a body without either stays as it was before logprobs were served)."""
        if body.top_logprobs is None and not body.logprobs:
            return {}
        return {"top_logprobs": body.top_logprobs or 0}

    def _response(self, run: ChatRun, body: _ResponsesBody, text: str | None,
                  end: ChatEnd | ErrorInfo | None, calls: Sequence[CalledTool] = (),
                  logprobs: Sequence[_Logprob] | None = None, *, streamed: bool = False,
                  reasoning: Sequence[str] = (), late_reasoning: str = "") -> dict[str, object]:
        """The response object: in progress (no text, no end), completed, incomplete, or failed.
        A reply of tool calls alone has no message item, unless a stream announced it already.
        `logprobs` (when `include` asked for them) are every generated token's, as the chat's.
        The model's thinking comes first as a reasoning item (`reasoning`), and thinking a stream
        met after the answer began (`late_reasoning`) as one more after the message."""
        thought_status = ("in_progress" if end is None else "incomplete" if isinstance(end, ErrorInfo)
                          else _status(end))
        output = [self._reasoning_item(run, 0, thought, thought_status) for thought in reasoning]
        later = [self._reasoning_item(run, 1, late_reasoning, thought_status)] if late_reasoning else []
        usage: dict[str, object] | None = None
        error: dict[str, str] | None = None
        incomplete: dict[str, str] | None = None
        if end is None:
            status = "in_progress"
        elif isinstance(end, ErrorInfo):
            status = "failed"
            error = {"code": end.code.value, "message": end.message}
            if text:
                output.append(self._item(run, text, "incomplete", logprobs))
        else:
            status = _status(end)
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
            if text or not calls or streamed:
                output.append(self._item(run, text or "", status, logprobs))
            output += later
            output += [self._function_call(call) for call in calls]
            usage = {"input_tokens": run.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": run.cached_tokens or 0},
                     "output_tokens": end.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": end.reasoning_tokens},
                     "total_tokens": run.prompt_tokens + end.completion_tokens}
        return {
            "id": f"resp_{run.request_id}",
            "object": "response",
            "created_at": run.created,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.frontend.model_name,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": body.reasoning.echoed() if body.reasoning else {"effort": None, "summary": None},
            "store": False,  # nothing is stored, whatever `store` asked
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": body.text_format()},
            "tool_choice": self._tool_choice(body),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            **self._top_logprobs(body),
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": body.metadata or {},
        }

    async def _response_events(self, run: ChatRun, body: _ResponsesBody, first: ChatStep
                               ) -> AsyncGenerator[bytes, None]:
        """response.created, response.in_progress, response.output_item.added,
        response.content_part.added, response.output_text.delta..., response.output_text.done,
        response.content_part.done, response.output_item.done, then each function call as an
        item of its own (added, function_call_arguments.delta and .done, output_item.done), then
        response.completed (or response.incomplete at max_output_tokens, as OpenAI sends it); each
        with its sequence_number. A failure on the way: response.failed.

        A reply that starts with thinking starts with a reasoning item (output_item.added,
        content_part.added of a `reasoning_text`, response.reasoning_text.delta...,
        reasoning_text.done, content_part.done, output_item.done) and its message item follows
        once the answer begins; thinking after that is one more reasoning item after the message.

        With `include` asking for logprobs, each delta carries those of the tokens its step
        consumed, and a step whose tokens show no text yet (held back for a stop string, a tool
        call's, the thinking's) sends them in a delta of "" (as the chat's stream sends them in a
        chunk of ""), so the deltas' logprobs are the done event's and the final output text's, in
        order; the events' entries are OpenAI's (no `bytes`), the output text's have them."""
        sequence = 0
        items = 0  # output items announced so far

        def event(kind: str, **fields: object) -> bytes:
            nonlocal sequence
            sequence += 1
            return _sse(kind, {"type": kind, **fields, "sequence_number": sequence - 1})

        def reasoning_item(number: int, deltas: Sequence[str]) -> list[bytes]:
            """A reasoning item's start, and `deltas` of its text."""
            nonlocal items
            index, items = items, items + 1
            item = self._reasoning_item(run, number, None, "in_progress")
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            return [event("response.output_item.added", output_index=index, item=item),
                    event("response.content_part.added", **where, part=_reasoning_text("")),
                    *(event("response.reasoning_text.delta", **where, delta=delta) for delta in deltas)]

        def reasoning_done(number: int, text: str, status: str) -> list[bytes]:
            item = self._reasoning_item(run, number, text, status)
            where = {"item_id": item["id"], "output_index": items - 1, "content_index": 0}
            return [event("response.reasoning_text.done", **where, text=text),
                    event("response.content_part.done", **where, part=_reasoning_text(text)),
                    event("response.output_item.done", output_index=items - 1, item=item)]

        step = first
        texts: list[str] = []
        thoughts: list[str] = []  # the first reasoning item's, while it is open
        late: list[str] = []  # thinking after the answer began
        calls: list[CalledTool] = []
        logprobs: list[_Logprob] = []  # the steps' (none unless `include` asked for them)
        unsent: list[_Logprob] = []  # of steps before the message began
        shown = logprobs if body.logprobs else None  # as the output text carries them
        where: dict[str, object] = {}  # the message's place, once it is announced
        try:
            yield event("response.created", response=self._response(run, body, None, None))
            yield event("response.in_progress", response=self._response(run, body, None, None))
            thinking = run.reasons and bool(first.reasoning)
            if thinking:
                for frame in reasoning_item(0, ()):
                    yield frame
            while True:
                frames: list[bytes] = []
                logprobs += step.logprobs
                if step.reasoning:
                    (thoughts if thinking else late).append(step.reasoning)
                    if thinking:
                        frames.append(event("response.reasoning_text.delta", item_id=f"rs_{run.request_id}",
                                            output_index=0, content_index=0, delta=step.reasoning))
                if not where and (step.text or step.end is not None or not thinking):
                    if thinking:
                        frames += reasoning_done(0, "".join(thoughts), "completed")
                        thinking = False
                    where = {"item_id": f"msg_{run.request_id}", "output_index": items, "content_index": 0}
                    frames += [event("response.output_item.added", output_index=items,
                                     item=self._item(run, None, "in_progress")),
                               event("response.content_part.added", **where,
                                     part=self._text_part("", [] if body.logprobs else None))]
                    items += 1
                if not where:
                    unsent += step.logprobs
                elif step.text or step.logprobs or unsent:
                    texts.append(step.text)
                    frames.append(event("response.output_text.delta", **where, delta=step.text,
                                        logprobs=_event_logprobs([*unsent, *step.logprobs])))
                    unsent = []
                calls += step.calls
                for frame in frames:
                    yield frame
                if step.end is not None:
                    break
                step = await _advance(run)
            whole, end = "".join(texts), step.end
            reasoning = ["".join(thoughts)] if thoughts else []
            if isinstance(end, ErrorInfo):
                yield event("response.failed", response=self._response(
                    run, body, whole, end, (), shown, reasoning=reasoning, late_reasoning="".join(late)))
                return
            yield event("response.output_text.done", **where, text=whole,
                        logprobs=_event_logprobs(logprobs))
            yield event("response.content_part.done", **where, part=self._text_part(whole, shown))
            yield event("response.output_item.done", output_index=where["output_index"],
                        item=self._item(run, whole, _status(end), shown))
            if late:
                for frame in [*reasoning_item(1, late), *reasoning_done(1, "".join(late), _status(end))]:
                    yield frame
            for index, call in enumerate(calls, start=items):
                item_id = f"fc_{call.id}"
                yield event("response.output_item.added", output_index=index,
                            item=self._function_call(call, "", "in_progress"))
                yield event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                            delta=call.arguments)
                yield event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                            arguments=call.arguments)
                yield event("response.output_item.done", output_index=index, item=self._function_call(call))
            final = self._response(run, body, whole, end, calls, shown, streamed=True, reasoning=reasoning,
                                   late_reasoning="".join(late))
            yield event(f"response.{_status(end)}", response=final)
        finally:
            await run.cancel()
