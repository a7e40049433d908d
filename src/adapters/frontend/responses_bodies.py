"""OpenAI's Responses API (`POST /v1/responses`): the request body, and the /v1/chat/completions
body it means (`instructions` as the system message, then the input items: messages, function
calls and their outputs, earlier reasoning as `reasoning_content`; `text.format` as the chat's
`response_format`, `reasoning.effort` as its `reasoning_effort`, `include:
["message.output_text.logprobs"]` and `top_logprobs` as its logprobs). What would change the
output and is not served yet (images, previous_response_id, background, ...) is refused with 422
`unsupported_parameter`, never ignored; `store` is accepted but nothing is stored. Errors have
OpenAI's shape, naming the fields as this API's client wrote them. An adapter: nothing in
`statecore` or `effects` may import it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import Field

from adapters.frontend.as_chat import (
    absent,
    by_type,
    present,
    refuse_other_types,
    refuse_unsupported,
    renamed,
    text_parts,
    unsupported,
)
from adapters.frontend.intake import Strict
from adapters.frontend.openai_bodies import MAX_TOP_LOGPROBS
from statecore.errors import ErrorInfo, StatecoreError, client_error

__all__ = ["ResponsesBody", "openai_error", "parse_responses"]


class _InputText(Strict):
    type: Literal["input_text", "output_text"]
    text: str  # an output_text's annotations and logprobs: ignored


class _InputMessage(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[_InputText]  # id, status (of an earlier output message): ignored


class _FunctionCallItem(Strict):
    """An earlier output's function call, sent back by the client."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text; id, status: ignored


class _FunctionCallOutput(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class _ReasoningText(Strict):
    type: Literal["reasoning_text"]
    text: str


class _ReasoningItem(Strict):
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
    _Item = by_type(_InputMessage, _FunctionCallItem, _FunctionCallOutput, _ReasoningItem)


class _FunctionTool(Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat(self) -> dict[str, object]:
        return {"type": "function", "function": present(name=self.name, description=self.description,
                                                       parameters=self.parameters)}


class _NamedFunction(Strict):
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
            chat.append({"role": item.role, "content": text_parts(item.content), **shown})
        else:
            chat.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return chat


class _TextFormat(Strict):
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
        schema = present(name=self.name, schema=self.schema_, description=self.description,
                         strict=self.strict)
        return {"type": "json_schema", "json_schema": schema}

    def echoed(self) -> dict[str, object]:
        return self.model_dump(by_alias=True, exclude_none=True)


class _TextConfig(Strict):
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


class _ReasoningConfig(Strict):
    """The Responses API's `reasoning`: `effort` is the chat's `reasoning_effort`; no summaries
    are made (a reasoning item's `summary` is empty, its text the model's own), so `summary`
    changes nothing."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the old name of summary

    def echoed(self) -> dict[str, object]:
        return {"effort": self.effort, "summary": self.summary or self.generate_summary}


class ResponsesBody(Strict):
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
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
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
    "previous_response_id": absent,  # nothing is stored to continue from
    "conversation": absent,
    "prompt": absent,
    "background": lambda value: value is None or value is False,
    "truncation": lambda value: value is None or value == "disabled",
}


def _refuse_other_includes(include: object) -> None:
    """`include` values OpenAI knows but that are not served (a value it does not know is left
    to validation: a 400)."""
    for index, value in enumerate(include if isinstance(include, list) else []):
        if value not in _SERVED_INCLUDES and value in get_args(_Includable):
            raise unsupported(f"include[{index}]: {value!r} is not served yet (only "
                               f"{' and '.join(map(repr, _SERVED_INCLUDES))})", f"include[{index}]")


def parse_responses(data: dict[str, object]) -> tuple[dict[str, object], ResponsesBody]:
    refuse_unsupported(data, _RESPONSES_NEUTRAL)
    _refuse_other_includes(data.get("include"))
    items = data.get("input")
    # an item without a type is a message (OpenAI's "easy input message")
    refuse_other_types("input", items, ("message", "function_call", "function_call_output", "reasoning"),
                        "input items", default="message")
    for index, item in enumerate(items if isinstance(items, list) else []):
        if isinstance(item, dict) and item.get("type") != "reasoning":  # its content is reasoning text
            refuse_other_types(f"input[{index}].content", item.get("content"),
                                ("input_text", "output_text"), "content parts")
    if isinstance(items, list):  # typed, for the validation that tells the items apart
        data = {**data, "input": [{"type": "message", **item} if isinstance(item, dict) and "type" not in item
                                  else item for item in items]}
    body = ResponsesBody.model_validate(data)
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
    return present(model=body.model, max_tokens=body.max_output_tokens, messages=chat,
                  temperature=body.temperature, top_p=body.top_p, tools=tools,
                  tool_choice=body.chat_tool_choice(), response_format=body.response_format(),
                  parallel_tool_calls=body.parallel_tool_calls, logprobs=body.logprobs or None,
                  top_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                  reasoning_effort=body.reasoning.effort if body.reasoning else None,
                  chat_template_kwargs=body.chat_template_kwargs), body


_RESPONSES_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
                    "tool_choice.function.name": "tool_choice.name", "reasoning_effort": "reasoning.effort"}


def openai_error(info: ErrorInfo) -> object:
    return renamed(info, _RESPONSES_NAMES).to_openai()


# ---------------------------------------------------------------------------------------------
# The endpoints
