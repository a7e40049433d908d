"""The request bodies of OpenAI's `POST /v1/completions` and `POST /v1/chat/completions`, and the
checks a body gets before it is tokenized: the parameters that are not served (refused unless
neutral) and the stop strings. These models are also what the other APIs map their bodies onto
(`adapters.frontend.messages_bodies`, `responses_bodies`). An adapter: it imports pydantic and
`adapters.frontend.intake` and the core; nothing in `statecore` or `effects` may import it.

Defaults and limits (vLLM's where OpenAI leaves a choice):
- `max_tokens`: completions 16 (cut to the room left in the context); chat: the whole room left
  in the context. An explicit `max_tokens` (chat also `max_completion_tokens`) must be at least
  1 and fit: prompt + max_tokens > context is `context_length_exceeded` (400).
- `temperature` 1.0, `top_p` 1.0, `top_k` 0 (off; -1 also means off), `min_p` 0 (off), `seed`
  none (the engine then derives one from the request id). `ignore_eos` (vLLM's) generates
  through EOS until max_tokens.
- `n` (1 to 16): each choice is a generation of its own; choice i > 0 runs as `<request id>.<i>`
  with seed + i (when a seed is given), so the choices differ and repeat exactly. Streams send
  each choice's steps in turn; usage counts the prompt once and every choice's tokens.
- `response_format` (both endpoints): `{"type": "text"}` (the default) is free text;
  `{"type": "json_object"}` any JSON object and `{"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}}` JSON valid against the schema, by constrained decoding (`adapters.grammar`,
  llguidance; the schema is enforced whatever `strict` says). A schema llguidance refuses is a
  400 naming `response_format`; with stop strings or `ignore_eos` (which would cut or run past the
  JSON) a 400; with tools a 422 (the grammar would keep the model from calling one).
- `tools` with `tool_choice` "auto" (the default) or "none": the tools go through the model's
  chat template; the reply's text between the tokenizer's tool-call markers is parsed by mlx-lm's
  parser for the model (`adapters.tool_calls`) and answered as OpenAI `tool_calls` (streamed as
  one delta per complete call), finish_reason "tool_calls"; ids are `call_<request id>_<n>`.
  "required" or a named function forces one call by constrained decoding (`adapters.grammar`):
  the model writes a call of one of the tools (of that one) between its markers, as JSON valid
  against the tool's parameters, and then ends; served where mlx-lm's parser for the model is
  json_tools (else 422). A model whose template has no tool-call markers mlx-lm knows: 400.
  Messages may carry an assistant's `tool_calls` (arguments as JSON text) and `tool` answers
  (`tool_call_id`).
- A reasoning model (think markers mlx-lm knows): a chat's reply is split by
  `adapters.reasoning` into its thinking (`reasoning_content`, also as `reasoning`; streamed in
  deltas of those) and its answer (`content`), markers left out; stop strings and tool calls are
  looked for in the answer only; `usage.completion_tokens_details.reasoning_tokens`. Another API
  may cap the thinking (`generation.ThinkBudget`: Anthropic's `budget_tokens`).
- `chat_template_kwargs`: the template's extra variables, scalars only (not the names this module
  passes itself), over the node's `--chat-template-args` (`parse_template_args`);
  `reasoning_effort` is the template's own variable where it reads one, else `enable_thinking`.
  What the template raises on is a 400 naming the field.
- `xtc_probability` / `xtc_threshold` (mlx-lm's XTC, threshold at most 0.5): when a draw's coin
  (keyed by seed and position) comes up, the tokens above the threshold but the least likely of
  them are left out; a newline and EOS never are.
- `logprobs`: chat `logprobs: true` + `top_logprobs` (0-20), completions `logprobs` (0-20):
  each token's log-probability under the shaped distribution before temperature (mlx-lm's),
  and the most likely alternatives, in OpenAI's shapes; a token's text is its own decoding.
- Logits shaping, as mlx_lm.server names and ranges it: `logit_bias` (`{"token id": bias}`),
  `repetition_penalty` (>= 0), `presence_penalty`, `frequency_penalty`, each over the last
  `*_context_size` tokens (default 20; 0 turns it off) of prompt + generated text.
- `usage.completion_tokens` counts the EOS token that ended a reply (it makes no text), as vLLM
  and mlx-lm do: a reply whose first token is EOS is empty with completion_tokens 1.
- `usage.prompt_tokens_details.cached_tokens` (only with `prompt_tokens_details`, vLLM's
  `--enable-prompt-tokens-details`; always there then, 0 included, as OpenAI sends it): the
  prompt tokens the prefill took from the node's prefix cache (choice 0's prefill when `n` > 1).
  Off by default: where the prompt was cached depends on the node, so this is the one number by
  which a cluster's body may differ from a single node's.
- `stop`: a string or a list of at most 16 strings of at most 256 characters; empty strings are
  ignored. The text ends before the earliest stop string, with finish_reason "stop".
- The request id is the `X-Request-Id` header when it is given (1-128 of `A-Za-z0-9._-`),
  otherwise a fresh uuid4 hex; it is echoed in the `X-Request-Id` response header, and the
  response `id` is `cmpl-<request id>` or `chatcmpl-<request id>`.
- Bodies above `max_body_bytes` (4 MiB) are refused with 413.

Validation: strict pydantic models (no coercion: `"5"` is not a number, `true` is not 1).
Parameters that would change the result and are not served (`best_of`, `echo`, `suffix`,
`functions`,
`function_call`, vLLM's `guided_*`, ...) are refused with 422 `unsupported_parameter`
unless they carry their neutral value (`logprobs: false`, ...). Other
unknown fields (`user`, `metadata`, vendor extras) are ignored, as vLLM does. Every error has
OpenAI's shape `{"error": {"message", "type", "code"}}` and the status of its `ErrorInfo`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from pydantic import Field, model_validator

from adapters.frontend.intake import Reject, Strict, neutral
from statecore.errors import Code, ErrorInfo, Fault, client_error
from statecore.policy import grammar_end_conflict

__all__ = ["DEFAULT_COMPLETION_MAX_TOKENS", "MAX_CHOICES", "MAX_STOP_LENGTH", "MAX_STOP_STRINGS",
           "MAX_TOP_LOGPROBS", "TEMPLATE_OWN_ARGUMENTS", "ChatBody", "CompletionBody", "Message", "Sampling",
           "TemplateValue", "ToolChoice", "check_grammar_ends", "check_unsupported", "given",
           "parse_template_args", "stop_strings"]

DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # n: each choice takes a row of the batch
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (completions: 5; vLLM allows 20 for both)
MAX_STOP_LENGTH = 256


def given(value: int | None, default: int) -> int:
    return default if value is None else value


class StreamOptions(Strict):
    include_usage: bool = False


class JsonSchema(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule; it changes nothing here
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # none: any JSON value
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only there")
        return self


class Sampling(Strict):
    """Fields shared by both endpoints; None means "not given" everywhere."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # OpenAI's range
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    ignore_eos: bool | None = None  # vLLM's: generate through EOS until max_tokens
    # mlx_lm.server's names and ranges (a context size of 0 turns its penalty off)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    xtc_probability: float | None = Field(default=None, ge=0.0, le=1.0)
    adapters: str | None = Field(default=None, min_length=1)  # mlx_lm.server's: a LoRA adapter, by name
    # mlx_lm.server's: the most draft tokens a verify step checks for this request (0: none)
    num_draft_tokens: int | None = Field(default=None, ge=0)
    xtc_threshold: float | None = Field(default=None, ge=0.0, le=0.5)  # mlx-lm's sampler refuses more
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI's) -> added to its logit
    repetition_penalty: float | None = Field(default=None, ge=0.0)
    repetition_context_size: int | None = Field(default=None, ge=0)
    presence_penalty: float | None = None
    presence_context_size: int | None = Field(default=None, ge=0)
    frequency_penalty: float | None = None
    frequency_context_size: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None


class CompletionBody(Sampling):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # the legacy shape: a count


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as OpenAI sends it

    @model_validator(mode="after")
    def _arguments_are_json(self) -> FunctionCall:
        try:
            json.loads(self.arguments)
        except ValueError:
            raise ValueError(f"arguments must be JSON text, got {self.arguments[:80]!r}") from None
        return self


class ToolCallIn(Strict):
    """A tool call of an earlier assistant turn, sent back by the client."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant turn of tool calls
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only: the call this answers
    # an earlier assistant turn's thinking, as this API answered it (either name); templates that
    # show it (Qwen3's) read `reasoning_content`
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _fits_its_role(self) -> Message:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant turn of tool calls)")
        return self

    def to_template(self) -> dict[str, Any]:
        if self.content is None or isinstance(self.content, str):
            content = self.content or ""
        else:
            content = "\n".join(part.text for part in self.content)
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thought is not None and self.role == "assistant":
            message["reasoning_content"] = thought
        if self.tool_calls:
            # Chat templates read the arguments as a mapping (Hugging Face's convention; mlx-lm's too).
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": json.loads(call.function.arguments)}}
                for call in self.tool_calls]
        return message


class FunctionSpec(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Strict):
    name: str


class ToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


TemplateValue = str | int | float | bool | None
# apply_chat_template's own parameters (Hugging Face's), which the front end sets: never a template
# variable a client may give
TEMPLATE_OWN_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # OpenAI's reasoning efforts


def parse_template_args(text: str) -> dict[str, TemplateValue]:
    """`--chat-template-args` (mlx_lm.server's flag): a JSON object of the chat template's extra
    variables for every request, held to what a request's `chat_template_kwargs` may be (scalars,
    none of the names the front end passes itself); ValueError says what is wrong."""
    try:
        given = json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(given, dict):
        raise ValueError(f"must be a JSON object of template variables, not {type(given).__name__}")
    nested = sorted(name for name, value in given.items()
                    if value is not None and not isinstance(value, str | int | float | bool))
    if nested:
        raise ValueError(f"{', '.join(nested)}: a template variable must be a string, number, boolean "
                         "or null")
    taken = sorted(TEMPLATE_OWN_ARGUMENTS.intersection(given))
    if taken:
        raise ValueError(f"{', '.join(taken)} is set by the server, not by a template argument")
    return given


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)
    chat_template_kwargs: dict[str, TemplateValue] | None = None  # extra variables of the chat template
    reasoning_effort: Effort | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _something_to_answer(self) -> ChatBody:
        # as an empty prompt is refused: a last user message with no text asks nothing
        last = self.messages[-1]
        if last.role == "user" and not last.to_template()["content"]:
            raise ValueError("the last message is an empty user message: there is nothing to answer")
        return self


# Parameters that change what is generated and are not served: refused unless neutral.
_UNSUPPORTED: dict[str, Callable[[object], bool]] = {
    "best_of": neutral(1),
    "echo": neutral(False),
    "suffix": neutral(""),
    "min_tokens": neutral(0),
    "functions": neutral([]),
    "function_call": neutral("none"),
    "guided_json": neutral(),
    "guided_regex": neutral(),
    "guided_choice": neutral(),
    "guided_grammar": neutral(),
    "modalities": neutral(["text"]),
    "audio": neutral(),
    "prediction": neutral(),
    "web_search_options": neutral(),  # OpenAI searches the web before answering; nothing here does
}


def check_unsupported(data: Mapping[str, object]) -> None:
    """A parameter that would change the output and is not served is refused (unless neutral)."""
    names = [name for name, is_neutral in _UNSUPPORTED.items() if name in data and not is_neutral(data[name])]
    if names:
        raise Reject(
            ErrorInfo(
                Fault.UNSUPPORTED,
                Code.UNSUPPORTED_PARAMETER,
                f"unsupported parameter{'s' if len(names) > 1 else ''}: {', '.join(names)} "
                "(no echo, suffix, best_of, functions, guided_* decoding or web search are served)",
                names[0],
            )
        )


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """`stop` as the distinct non-empty stop strings, within their limits."""
    listed = [stop] if isinstance(stop, str) else list(stop or [])
    if len(listed) > MAX_STOP_STRINGS:
        raise Reject(client_error(f"stop: at most {MAX_STOP_STRINGS} stop strings are allowed",
                                  param="stop"))
    if any(len(s) > MAX_STOP_LENGTH for s in listed):
        raise Reject(client_error(f"stop: a stop string may have at most {MAX_STOP_LENGTH} characters",
                                  param="stop"))
    return tuple(dict.fromkeys(s for s in listed if s))


def check_grammar_ends(body: Sampling, stops: Sequence[str], what: str) -> None:
    """A constrained reply (`what`) and the parameters that would cut it or run past its end
    (`statecore.policy.grammar_end_conflict` decides which) are refused together."""
    conflict = grammar_end_conflict(has_stop_strings=bool(stops), ignore_eos=bool(body.ignore_eos))
    if conflict == "stop":
        raise Reject(client_error(f"stop: stop strings would cut {what}", param="stop"))
    if conflict == "ignore_eos":
        raise Reject(client_error(f"ignore_eos: {what} ends with EOS", param="ignore_eos"))
