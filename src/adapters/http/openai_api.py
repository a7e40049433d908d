"""The OpenAI-compatible front end, shared by a single node and the router.

Both serve the public API through this module over a `Backend` (see `effects.ports`): on a
single node the backend is the local engine, on the router it is prefill and decode peers. The
backend only ever yields token ids; everything a client sees (text, stop strings, usage, the
JSON bodies and the SSE framing) is made here, so the output through the cluster is byte-identical
to a single node's by construction. For identical backend outputs, two responses differ only in
`id` and `created`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (streaming as
server-sent events, or not), `GET /v1/models`, `GET /health` (200 only while `backend.ready()`),
and vLLM's `POST /tokenize` / `POST /detokenize` (the prompt ids a completion or a chat would be
fed, and text back from ids; these two refuse unknown fields). `build_app` also serves
Anthropic's `POST /v1/messages` and OpenAI's `POST /v1/responses` (`adapters.http.other_apis`, as chats
started by `Frontend.start_chat`), and can put API keys (`adapters.http.api_keys`) and CORS in front.

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
  may cap the thinking (`_ThinkBudget`: Anthropic's `budget_tokens`).
- `chat_template_kwargs`: the template's extra variables, scalars only (not the names this module
  passes itself); `reasoning_effort` is the template's own variable where it reads one, else
  `enable_thinking`. What the template raises on is a 400 naming the field.
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

A streaming response waits for the first piece of text (or the end) before it sends its headers,
so that a failure before any output still gets its own HTTP status; later failures become an SSE
event `data: {"error": {...}}` followed by `data: [DONE]`. A client that goes away (streaming or
not) cancels its generation. This is an adapter: it may import anything, and nothing in
`statecore` or `effects` may import it.
"""

from __future__ import annotations

import enum
import json
import logging
import re
import sys
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal, TypeVar, assert_never

import trio
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from adapters.grammar import format_error, refused, response_format_text, tool_call_text
from adapters.http.api_keys import ApiKeyGuard, ApiKeys
from adapters.http.other_apis import other_api_routes
from adapters.http.streaming import WatchedStream, cancel_on_disconnect
from adapters.reasoning import ReasoningSplitter, ThinkMarkers, opens_thinking
from adapters.tool_calls import ToolCall, ToolCallSplitter
from effects.faults import Faults, Phase
from effects.ports import (
    Backend,
    Generation,
    GenerationEnd,
    GenerationError,
    GenerationRequest,
    Output,
    SamplingParams,
    TokenOut,
)
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, bug, client_error
from statecore.events import TokenLogprobs
from statecore.ids import RequestId

__all__ = ["DEFAULT_COMPLETION_MAX_TOKENS", "MAX_STOP_STRINGS", "CalledTool", "ChatEnd", "ChatRun",
           "ChatStep", "Frontend", "build_app"]

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # n: each choice takes a row of the batch
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (completions: 5; vLLM allows 20 for both)
MAX_STOP_LENGTH = 256
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
_CANCEL_GRACE_S = 10.0
"""How long a cancel or stop sent to the backend may take while the request is being torn down."""
_MAX_ERRORS_SHOWN = 3


# ---------------------------------------------------------------------------------------------
# Request bodies


def _given(value: int | None, default: int) -> int:
    return default if value is None else value


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class _StreamOptions(_Strict):
    include_usage: bool = False


class _JsonSchema(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule; it changes nothing here
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # none: any JSON value
    strict: bool | None = None


class _ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> _ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only there")
        return self


class _Sampling(_Strict):
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
    stream_options: _StreamOptions | None = None
    response_format: _ResponseFormat | None = None


class _CompletionBody(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # the legacy shape: a count


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class _FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as OpenAI sends it

    @model_validator(mode="after")
    def _arguments_are_json(self) -> _FunctionCall:
        try:
            json.loads(self.arguments)
        except ValueError:
            raise ValueError(f"arguments must be JSON text, got {self.arguments[:80]!r}") from None
        return self


class _ToolCallIn(_Strict):
    """A tool call of an earlier assistant turn, sent back by the client."""

    id: str
    type: Literal["function"] = "function"
    function: _FunctionCall


class _Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None  # None only for an assistant turn of tool calls
    name: str | None = None
    tool_calls: list[_ToolCallIn] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only: the call this answers
    # an earlier assistant turn's thinking, as this API answered it (either name); templates that
    # show it (Qwen3's) read `reasoning_content`
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _fits_its_role(self) -> _Message:
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


class _FunctionSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Tool(_Strict):
    type: Literal["function"]
    function: _FunctionSpec


class _NamedFunction(_Strict):
    name: str


class _ToolChoice(_Strict):
    type: Literal["function"]
    function: _NamedFunction


_TemplateValue = str | int | float | bool | None
# apply_chat_template's own parameters (Hugging Face's), which the front end sets: never a template
# variable a client may give
_TEMPLATE_OWN_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
_Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # OpenAI's reasoning efforts


class _ChatBody(_Sampling):
    messages: list[_Message] = Field(min_length=1)
    chat_template_kwargs: dict[str, _TemplateValue] | None = None  # extra variables of the chat template
    reasoning_effort: _Effort | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[_Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | _ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _something_to_answer(self) -> _ChatBody:
        # as an empty prompt is refused: a last user message with no text asks nothing
        last = self.messages[-1]
        if last.role == "user" and not last.to_template()["content"]:
            raise ValueError("the last message is an empty user message: there is nothing to answer")
        return self


# What a JSON body may be labelled: JSON itself, nothing, or curl's default for `-d`
# (application/x-www-form-urlencoded), which many a `curl -d '{...}'` sends without meaning it.
_JSON_MEDIA_TYPES = ("application/json", "application/x-www-form-urlencoded")


def _check_media_type(content_type: str | None) -> None:
    """Refuse a body labelled as something other than JSON (text/plain, multipart/form-data, ...)
    with 415, rather than read it as JSON anyway."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media and media not in _JSON_MEDIA_TYPES and not media.endswith("+json"):
        raise _Reject(ErrorInfo(Fault.CLIENT, Code.UNSUPPORTED_MEDIA_TYPE,
                                f"the request body is labelled {media}: send JSON with "
                                "'Content-Type: application/json'"))


def _same(value: object, neutral: object) -> bool:
    return type(value) is type(neutral) and value == neutral


def _neutral(*values: object) -> Callable[[object], bool]:
    return lambda value: value is None or any(_same(value, v) for v in values)


# Parameters that change what is generated and are not served: refused unless neutral.
_UNSUPPORTED: dict[str, Callable[[object], bool]] = {
    "best_of": _neutral(1),
    "echo": _neutral(False),
    "suffix": _neutral(""),
    "min_tokens": _neutral(0),
    "adapters": _neutral(),  # mlx_lm.server's LoRA adapter per request
    "functions": _neutral([]),
    "function_call": _neutral("none"),
    "guided_json": _neutral(),
    "guided_regex": _neutral(),
    "guided_choice": _neutral(),
    "guided_grammar": _neutral(),
    "modalities": _neutral(["text"]),
    "audio": _neutral(),
    "prediction": _neutral(),
    "web_search_options": _neutral(),  # OpenAI searches the web before answering; nothing here does
}


_UNION_BRANCH = re.compile(r"^(str|int|float|bool|list|dict|none)(\[.*\])?$|^_[A-Z]\w*$|.*\[.*\]$")


def _param_path(loc: Sequence[int | str]) -> str:
    """A field's path as a client wrote it (`messages[0].content`): pydantic's own steps, the
    union branch it tried (`list[_TextPart]`, `str`), are no business of the client's."""
    path = ""
    for step in loc:
        if isinstance(step, int):
            path += f"[{step}]"
        elif not _UNION_BRANCH.match(step):
            path += f".{step}" if path else step
    return path or "body"


def _validation_error(exc: ValidationError) -> ErrorInfo:
    """One 400 naming the fields at fault (the first one as OpenAI's `param`)."""
    found: dict[str, str] = {}
    # deepest first: of a union's branches, the one that went furthest says what is wrong
    for error in sorted(exc.errors(include_url=False), key=lambda e: -len(e["loc"])):
        found.setdefault(_param_path(error["loc"]), error["msg"])
    shown = [f"{where}: {message}" for where, message in list(found.items())[:_MAX_ERRORS_SHOWN]]
    if len(found) > _MAX_ERRORS_SHOWN:
        shown.append(f"and {len(found) - _MAX_ERRORS_SHOWN} more")
    first = next(iter(found), None)
    return ErrorInfo(Fault.CLIENT, Code.INVALID_REQUEST, "invalid request: " + "; ".join(shown),
                     param=None if first == "body" else first)


# ---------------------------------------------------------------------------------------------
# Text: incremental detokenization and stop strings


def _held_back(text: str, stops: Sequence[str]) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
        while i != -1 and len(text) - i > best:
            if stop.startswith(text[i:]):
                best = len(text) - i
                break
            i = text.find(stop[0], i + 1)
    return best


@dataclass(frozen=True, slots=True)
class _Text:
    """What some tokens make: reasoning and content that may be sent now, and whether a stop
    string ended the content."""

    reasoning: str
    content: str
    stopped: bool = False


class _StopText:
    """Token ids in, text out: mlx-lm's streaming detokenizer, the reasoning split off (when the
    model has think markers: `adapters.reasoning`), and stop strings, which end the content only
    (the thinking is never cut by them).

    Text is released only when no stop string can still begin inside it, so a stop string split
    across tokens is never half sent.
    """

    def __init__(self, detokenizer: Any, stops: Sequence[str], quiet: Sequence[str] = (),
                 reasoning: ReasoningSplitter | None = None) -> None:
        self._detokenizer = detokenizer
        self._given = tuple(stops)
        self._stops = (*stops, *(q for q in quiet if q not in stops))
        self._pending = ""
        self._reasoning = reasoning
        self.reasoning_tokens = 0  # tokens generated inside the thinking, its markers included
        self.matched: str | None = None  # the client's stop string the text ended before, once one has

    @property
    def thinking(self) -> bool:
        """Whether the text is inside the model's thinking now."""
        return self._reasoning is not None and self._reasoning.thinking

    def add(self, token: int) -> _Text:
        """Text that may be sent now, and whether a stop string was matched."""
        was_thinking = self.thinking
        self._detokenizer.add_token(token)
        text = self._split(self._detokenizer.last_segment, final=False)
        if was_thinking or self.thinking:
            self.reasoning_tokens += 1
        return text

    def close(self) -> _Text:
        """Flush everything held back at the end of the generation."""
        self._detokenizer.finalize()
        return self._split(self._detokenizer.last_segment, final=True)

    def _split(self, segment: str, *, final: bool) -> _Text:
        if self._reasoning is None:
            return _Text("", *self._scan(segment, final=final))
        reasoning, content = self._reasoning.feed(segment)
        if final:
            rest = self._reasoning.close()
            reasoning, content = reasoning + rest[0], content + rest[1]
        text, stopped = self._scan(content, final=final)
        if stopped:
            self._reasoning = None  # the reply ends here: nothing after the stop string is sent
        return _Text(reasoning, text, stopped)

    def _scan(self, segment: str, *, final: bool) -> tuple[str, bool]:
        text = self._pending + segment
        cuts = [(i, stop) for stop in self._stops if (i := text.find(stop)) != -1]
        if cuts:
            self._pending = ""
            cut, stop = min(cuts, key=lambda found: found[0])  # the earliest (a tie: first listed)
            self.matched = stop if stop in self._given else None  # a quiet stop is the server's own
            return text[:cut], True
        keep = 0 if final else _held_back(text, self._stops)
        self._pending = text[len(text) - keep :]
        return text[: len(text) - keep], False


@dataclass(frozen=True, slots=True)
class _Finish:
    reason: str
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class _Step:
    """Some text (maybe empty) and, on the last step, how the generation ended; with the
    logprobs of the tokens this step consumed when the request asked for them."""

    text: str
    end: _Finish | ErrorInfo | None = None
    logprobs: tuple[tuple[int, TokenLogprobs], ...] = ()
    reasoning: str = ""  # the model's thinking, before `text` (a model without think markers: "")


@dataclass(frozen=True, slots=True)
class _ThinkBudget:
    """A cap on a reply's thinking (Anthropic's `budget_tokens`): once `tokens` tokens of it are
    generated, the generation is stopped, the think end marker (`end_tokens`) is written for the
    model, and `resume` starts the rest of the reply (the prompt and everything generated so
    far, with the max_tokens left) as a continuation, on whatever node the backend picks."""

    tokens: int
    max_tokens: int
    end_tokens: tuple[int, ...]
    resume: Callable[[tuple[int, ...], int], Awaitable[Generation]]  # (generated, max_tokens left)


class _Run:
    """Drives one generation: outputs in, text steps out. Never raises for backend errors."""

    def __init__(self, generation: Generation, text: _StopText, budget: _ThinkBudget | None = None) -> None:
        self.generation = generation  # the one running now (a thinking budget may start a second)
        self.first_generation = generation  # the one that prefilled the client's prompt
        self.finished = False  # the backend is done with it: ended, failed, or stopped by us
        self._outputs = aiter(generation)
        self._text = text
        self._budget = budget
        self._tokens = 0
        self._generated: list[int] = []  # kept only while a thinking budget may need them
        self._logprobs: list[tuple[int, TokenLogprobs]] = []  # of the tokens the next step consumes

    async def advance(self) -> _Step:
        """The next step with some text, or the last step."""
        assert not self.finished
        while True:
            try:
                output: Output = await anext(self._outputs)
            except StopAsyncIteration:
                self.finished = True
                return _Step("", bug("the backend ended a generation without an end or an error"))
            step = await self._take(output)
            if step is not None:
                return step

    async def advance_ready(self) -> _Step | None:
        """`advance` from the outputs already waiting only: None when they run out before a
        step is whole (what they gave is kept for the next one). It never waits for the
        backend (it may await telling it a stop string matched)."""
        assert not self.finished
        while (output := self.generation.receive_nowait()) is not None:
            step = await self._take(output)
            if step is not None:
                return step
        return None

    async def _take(self, output: Output) -> _Step | None:
        """One output in; the step it completes, if it does."""
        match output:
            case TokenOut(token=token, logprobs=carried):
                self._tokens += 1
                if carried is not None:
                    self._logprobs.append((token, carried))
                text = self._text.add(token)
                if text.stopped:
                    await self.generation.stop()
                    self.finished = True
                    return self._step(text, _Finish("stop", self._tokens))
                if self._budget is not None:
                    self._generated.append(token)
                    if self._text.thinking and self._text.reasoning_tokens >= self._budget.tokens:
                        return await self._end_thinking(self._budget, text)
                return self._step(text) if text.reasoning or text.content else None
            case GenerationEnd(finish_reason=reason):
                self.finished = True
                if reason == "stop":
                    self._tokens += 1  # the EOS token: no text, but generated (vLLM, mlx-lm)
                text = self._text.close()
                return self._step(text, _Finish("stop" if text.stopped else reason, self._tokens))
            case GenerationError(error=error):
                self.finished = True
                return _Step("", error)
            case _:
                assert_never(output)

    async def _end_thinking(self, budget: _ThinkBudget, text: _Text) -> _Step:
        """The thinking budget is spent: stop, write the end marker for the model, and go on with
        the continuation (none when max_tokens is reached)."""
        self._budget = None
        await self.generation.stop()
        pieces = [text, *(self._text.add(token) for token in budget.end_tokens)]
        self._tokens += len(budget.end_tokens)
        self._generated += budget.end_tokens
        step = _Text("".join(p.reasoning for p in pieces), "".join(p.content for p in pieces))
        if self._tokens >= budget.max_tokens:
            self.finished = True
            rest = self._text.close()
            return self._step(_Text(step.reasoning + rest.reasoning, step.content + rest.content),
                              _Finish("length", self._tokens))
        try:
            self.generation = await budget.resume(tuple(self._generated), budget.max_tokens - self._tokens)
        except StatecoreError as exc:
            self.finished = True
            return _Step("", exc.info)
        self._outputs = aiter(self.generation)
        self._generated = []
        return self._step(step)

    def _step(self, text: _Text, end: _Finish | None = None) -> _Step:
        logprobs, self._logprobs = tuple(self._logprobs), []
        return _Step(text.content, end, logprobs, text.reasoning)

    @property
    def reasoning_tokens(self) -> int:
        return self._text.reasoning_tokens

    async def cancel(self) -> None:
        """Tear the generation down (shielded, bounded): the client is gone or we failed."""
        if self.finished:
            return
        self.finished = True
        with trio.move_on_after(_CANCEL_GRACE_S, shield=True):
            try:
                await self.generation.cancel()
            except Exception:
                logger.exception("cancelling a generation failed")


class _LogprobsFormat:
    """One choice's logprobs as OpenAI shapes them: chat `{"content": [{token, logprob, bytes,
    top_logprobs}]}`, completions `{tokens, token_logprobs, top_logprobs, text_offset}` (offsets
    run on across a stream's chunks). A token's text is its own decoding; None when not asked."""

    def __init__(self, tokenizer: Any, chat: bool, top: int | None) -> None:
        self._tokenizer, self._chat, self._top = tokenizer, chat, top
        self._offset = 0

    def _text(self, token: int) -> str:
        return str(self._tokenizer.decode([token]))

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def of(self, entries: Sequence[tuple[int, TokenLogprobs]]) -> dict[str, Any] | None:
        if self._top is None:
            return None
        if self._chat:
            content = [{**self._entry(token, lp.logprob),
                        "top_logprobs": [self._entry(t, v) for t, v in lp.top]} for token, lp in entries]
            return {"content": content, "refusal": None}
        texts = [self._text(token) for token, _ in entries]
        offsets = []
        for text in texts:
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": texts, "token_logprobs": [lp.logprob for _, lp in entries],
                "top_logprobs": [{self._text(t): v for t, v in lp.top} for _, lp in entries],
                "text_offset": offsets}


class _Reply:
    """One choice's text as the client gets it: as generated, or, when the model was offered
    tools, split into content and numbered tool calls (ids from the choice's request id, the
    same on every node)."""

    def __init__(self, splitter: ToolCallSplitter | None, request_id: str) -> None:
        self._splitter = splitter
        self._request_id = request_id
        self._calls = 0

    def add(self, text: str) -> tuple[str, list[tuple[int, dict[str, Any]]]]:
        if self._splitter is None:
            return text, []
        content, calls = self._splitter.feed(text)
        return content, self._numbered(calls)

    def close(self) -> tuple[str, list[tuple[int, dict[str, Any]]]]:
        if self._splitter is None:
            return "", []
        content, calls = self._splitter.close()
        return content, self._numbered(calls)

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self._calls and reason == "stop" else reason

    def _numbered(self, calls: list[ToolCall]) -> list[tuple[int, dict[str, Any]]]:
        numbered = []
        for call in calls:
            numbered.append((self._calls, {"id": f"call_{self._request_id}_{self._calls}", "type": "function",
                                           "function": {"name": call.name, "arguments": call.arguments}}))
            self._calls += 1
        return numbered


# ---------------------------------------------------------------------------------------------
# Responses


class _Kind(enum.Enum):
    COMPLETION = "text_completion"
    CHAT = "chat.completion"


@dataclass(frozen=True, slots=True)
class _Job:
    """A validated, tokenized request."""

    kind: _Kind
    request_id: RequestId
    created: int
    prompt: tuple[int, ...]
    sampling: SamplingParams
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    choices: int = 1  # n: each choice is a generation of its own (a row of its own in the batch)
    tools: tuple[dict[str, Any], ...] = ()  # offered to the model: its replies are split into text and calls
    quiet_stops: tuple[str, ...] = ()  # the server's own stop strings (not reported as the client's)
    # a chat of a model with think markers: whether its reply starts inside the thinking (the
    # prompt opened it); None: no reasoning is split off (completions, a model without markers)
    thinking: bool | None = None
    think_budget: int | None = None  # at most this many tokens of thinking (Anthropic's budget_tokens)

    def choice_request(self, index: int) -> GenerationRequest:
        """Choice 0 is the request itself; choice i > 0 runs as `<request id>.<i>`, with seed + i
        when a seed was given (else its seed derives from that id): both are the same on every
        node, so the cluster's choices equal a single node's. With n > 1 each one says which
        choice of the request it is, so that the engine decodes them side by side."""
        if self.choices == 1:
            return GenerationRequest(self.request_id, self.prompt, self.sampling)
        grouped = replace(self.sampling, choice_group=self.request_id, choice=index, choices=self.choices)
        if index == 0:
            return GenerationRequest(self.request_id, self.prompt, grouped)
        seed = None if self.sampling.seed is None else (self.sampling.seed + index) % 2**64
        return GenerationRequest(RequestId(f"{self.request_id}.{index}"), self.prompt,
                                 replace(grouped, seed=seed))

    @property
    def response_id(self) -> str:
        prefix = "cmpl-" if self.kind is _Kind.COMPLETION else "chatcmpl-"
        return prefix + self.request_id

    def usage(self, completion_tokens: int, cached_tokens: int | None = None, reasoning_tokens: int = 0
              ) -> dict[str, Any]:
        """Usage; with `cached_tokens` (prompt tokens details on) also `prompt_tokens_details`;
        a chat of a reasoning model also `completion_tokens_details.reasoning_tokens` (OpenAI's)."""
        prompt_tokens = len(self.prompt)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if self.thinking is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        if cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return usage


def _dumps(obj: object) -> str:
    """The one JSON encoding of every body and event (Starlette's JSONResponse's settings)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def _event(obj: object) -> bytes:
    """One server-sent event: `data: <json or [DONE]>` and a blank line (JSON has no raw newline)."""
    return b"data: " + (obj if isinstance(obj, str) else _dumps(obj)).encode() + b"\n\n"


# What `_dumps` writes for a string (json.dumps' own encoder with ensure_ascii=False): quotes,
# backslashes and control characters escaped, everything else as it is.
_json_string: Callable[[str], str] = json.encoder.encode_basestring
_TEXT_MARK = "\ue000text\ue001"  # stands in for the text when a template is made


@dataclass(frozen=True, slots=True)
class _TextEvent:
    """A template of one choice's text chunk event: its bytes before and after the text. A
    stream's text chunks differ only in the text, so their JSON is made once per choice; `of`
    gives exactly the bytes `_event` would for the chunk with that text."""

    head: bytes
    tail: bytes

    @classmethod
    def around(cls, event: bytes) -> _TextEvent | None:
        """The template of `event`, a chunk whose text is `_TEXT_MARK`; None unless the mark is
        in it exactly once (a model name could hold it too)."""
        mark = _json_string(_TEXT_MARK).encode()
        head, found, tail = event.partition(mark)
        if not found or mark in tail:
            return None
        return cls(head, tail)

    def of(self, text: str) -> bytes:
        return self.head + _json_string(text).encode() + self.tail


# A stream sends the events it has made in one body write (one ASGI message) before it waits
# for the backend, or once this many are waiting.
_EVENTS_PER_WRITE = 64


def _event_stream(events: AsyncGenerator[bytes, None], headers: Mapping[str, str],
                  on_close: Callable[[], Awaitable[None]]) -> WatchedStream:
    """A text/event-stream response whose events go out the moment they are made."""
    return WatchedStream(events, media_type="text/event-stream", on_close=on_close,
                         headers={**headers, "Cache-Control": "no-store", "X-Accel-Buffering": "no"})


RETRY_AFTER_S = 1


def _unless_body_unread(request: Request, response: Response) -> Response:
    """An answer given before the request's body was read whole (too large, a fault at intake)
    closes the connection: the unread rest would otherwise be taken for the next request, and
    the server drops it anyway; `Connection: close` tells a keep-alive client so."""
    if not getattr(request.state, "body_read", False):
        response.headers["Connection"] = "close"
    return response


def _check_grammar_ends(body: _Sampling, stops: Sequence[str], what: str) -> None:
    """A constrained reply ends where its grammar is whole (EOS): stop strings could cut it short
    and `ignore_eos` would run past it, so both are refused."""
    if stops:
        raise _Reject(client_error(f"stop: stop strings would cut {what}", param="stop"))
    if body.ignore_eos:
        raise _Reject(client_error(f"ignore_eos: {what} ends with EOS", param="ignore_eos"))


def _error_response(info: ErrorInfo, request_id: str | None = None, body: object = None) -> JSONResponse:
    """`info` as an answer: its status, OpenAI's shape unless `body` is given (another API's)."""
    headers = {REQUEST_ID_HEADER: request_id} if request_id is not None else {}
    if info.http_status in (429, 503):  # overloaded or draining: tell the client when to retry
        headers["Retry-After"] = str(RETRY_AFTER_S)
    return JSONResponse(info.to_openai() if body is None else body, status_code=info.http_status,
                        headers=headers or None)


def _request_id(request: Request) -> tuple[RequestId, ErrorInfo | None]:
    """The request's id: its `X-Request-Id` header, else a fresh one (also when the header is bad,
    which the error says)."""
    incoming = request.headers.get(REQUEST_ID_HEADER)
    if incoming is not None and not _REQUEST_ID_RE.fullmatch(incoming):
        info = client_error(f"{REQUEST_ID_HEADER} must be 1 to 128 characters of A-Z a-z 0-9 . _ -")
        return RequestId(uuid.uuid4().hex), info
    return RequestId(incoming if incoming is not None else uuid.uuid4().hex), None


class _Reject(Exception):
    """An error answer decided while reading a request (internal control flow)."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


class _Disconnected(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# A chat started for another API (adapters.http.other_apis: /v1/messages, /v1/responses)


_Parsed = TypeVar("_Parsed")


@dataclass(frozen=True, slots=True)
class ChatEnd:
    """How a chat started by `Frontend.start_chat` ended."""

    reason: str  # "stop" (EOS or a stop string), "length" (max_tokens) or "tool_calls"
    completion_tokens: int  # counts the EOS token, as /v1/chat/completions' usage does
    stop_string: str | None  # the stop string the text ends before, when one ended it
    reasoning_tokens: int = 0  # of completion_tokens, those of the model's thinking


@dataclass(frozen=True, slots=True)
class CalledTool:
    """A tool call the model made: its id (`call_<request id>_<n>`), name and JSON arguments."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ChatStep:
    """Some text (maybe empty), the tool calls completed with it, and on the last step the end;
    when the chat asked for logprobs, those of the tokens this step consumed, each as an entry
    of the chat's `logprobs.content` (`{token, logprob, bytes, top_logprobs}`), the same numbers
    /v1/chat/completions sends (tokens whose text is held back or became a tool call included)."""

    text: str
    calls: tuple[CalledTool, ...] = ()
    end: ChatEnd | ErrorInfo | None = None
    logprobs: tuple[dict[str, Any], ...] = ()
    reasoning: str = ""  # the model's thinking (before `text`), for a model with think markers


class ChatRun:
    """One generation of a chat started by `Frontend.start_chat`: its text comes out as
    /v1/chat/completions sends it (stop strings applied, tool calls split off when the chat
    offered tools); the caller only shapes the answer."""

    def __init__(self, job: _Job, run: _Run, reply: _Reply, logprobs: _LogprobsFormat,
                 error_body: Callable[[ErrorInfo], object], *, details: bool = False) -> None:
        self.request_id = job.request_id
        self.created = job.created
        self.prompt_tokens = len(job.prompt)
        self.reasons = job.thinking is not None  # the model's thinking comes apart from its text
        self.headers = {REQUEST_ID_HEADER: job.request_id}
        self._run = run
        self._reply = reply
        self._error_body = error_body
        self._logprobs = logprobs
        self._details = details

    @property
    def cached_tokens(self) -> int | None:
        """The prompt tokens the prefill took from a prefix cache (known after the first step);
        None unless the front end reports prompt tokens details."""
        return self._run.first_generation.cached_tokens if self._details else None

    async def advance(self) -> ChatStep:
        """The next piece of text and tool calls and, on the last step, how it ended (backend
        errors included)."""
        step = await self._run.advance()
        pieces = [self._reply.add(step.text)]
        if isinstance(step.end, _Finish):
            pieces.append(self._reply.close())
        text = "".join(piece for piece, _ in pieces)
        calls = tuple(CalledTool(call["id"], call["function"]["name"], call["function"]["arguments"])
                      for _, found in pieces for _, call in found)
        shaped = self._logprobs.of(step.logprobs) if step.logprobs else None
        logprobs = tuple(shaped["content"]) if shaped is not None else ()
        if isinstance(step.end, _Finish):
            end = ChatEnd(self._reply.finish_reason(step.end.reason), step.end.completion_tokens,
                          self._run._text.matched, self._run.reasoning_tokens)
            return ChatStep(text, calls, end, logprobs, step.reasoning)
        return ChatStep(text, calls, step.end, logprobs, step.reasoning)

    async def cancel(self) -> None:
        """Free the backend (shielded, bounded; nothing if it is done already)."""
        await self._run.cancel()

    def error_response(self, info: ErrorInfo) -> Response:
        """`info` with its status and headers, in the caller's error shape."""
        return _error_response(info, self.request_id, self._error_body(info))

    def event_stream(self, events: AsyncGenerator[bytes, None]) -> Response:
        """An SSE response of `events`, sent as they come; the client leaving cancels the generation."""
        return _event_stream(events, self.headers, self.cancel)


# ---------------------------------------------------------------------------------------------
# The front end


class Frontend:
    """The OpenAI-compatible API over one `Backend`: tokenizer, model name, backend, limits."""

    def __init__(
        self,
        tokenizer: Any,
        backend: Backend,
        *,
        model_name: str | None = None,
        max_body_bytes: int = 4 << 20,
        prompt_tokens_details: bool = False,
    ) -> None:
        """`tokenizer` is an mlx-lm `TokenizerWrapper`; the model name defaults to the backend's.
        `prompt_tokens_details` (vLLM's `--enable-prompt-tokens-details`) reports the prompt tokens
        each prefill took from a prefix cache in usage (`prompt_tokens_details.cached_tokens`, the
        Responses API's `input_tokens_details`, Messages' `cache_read_input_tokens`)."""
        self.tokenizer = tokenizer
        self.backend = backend
        self.model_name = model_name if model_name is not None else backend.model_info.name
        self.max_body_bytes = max_body_bytes
        self.prompt_tokens_details = prompt_tokens_details
        self.created = int(time.time())
        self._tokenizing = trio.CapacityLimiter(1)
        self.faults = Faults.none()  # tests only: see effects.faults
        self.think_markers = ThinkMarkers.of(tokenizer)  # a reasoning model's (adapters.reasoning)
        template = getattr(tokenizer, "chat_template", None)
        sources = template.values() if isinstance(template, dict) else [template]
        self._template_reads_effort = any(isinstance(source, str) and "reasoning_effort" in source
                                          for source in sources)
        self.warnings: list[str] = []  # start-up warnings, repeated in /health

    @classmethod
    def load(
        cls,
        model_dir: Path,
        backend: Backend,
        *,
        model_name: str | None = None,
        max_body_bytes: int = 4 << 20,
        prompt_tokens_details: bool = False,
    ) -> Frontend:
        """Load only the tokenizer and chat template from `model_dir` (never the weights)."""
        from mlx_lm.utils import load_tokenizer

        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            # mlx-lm would take a missing path for a Hugging Face repo and try to download it.
            raise FileNotFoundError(f"model directory {model_dir} does not exist")
        tokenizer = load_tokenizer(model_dir)  # type: ignore[no-untyped-call]
        inner = getattr(tokenizer, "_tokenizer", None)
        if inner is not None and hasattr(inner, "model_max_length"):
            # The context is checked here, after tokenizing, with a clear 400; transformers'
            # "Token indices sequence length is longer than ..." warning only added a log line.
            inner.model_max_length = sys.maxsize
        return cls(tokenizer, backend, model_name=model_name, max_body_bytes=max_body_bytes,
                   prompt_tokens_details=prompt_tokens_details)

    # -- endpoints ---------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        details = {"warnings": self.warnings} if self.warnings else {}
        if self.backend.ready():
            return JSONResponse({"status": "ok", **details})
        return JSONResponse({"status": "unavailable", **details}, status_code=503)

    def _card(self) -> dict[str, object]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "statecore"}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        """`GET /v1/models/{id}` (an id may hold slashes: `mlx-community/...`)."""
        if request.path_params["model_id"] != self.model_name:
            return _error_response(ErrorInfo(Fault.CLIENT, Code.MODEL_NOT_FOUND,
                                             f"the model {request.path_params['model_id']!r} does not "
                                             f"exist; this server serves {self.model_name!r}", "model"))
        return JSONResponse(self._card())

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, _Kind.COMPLETION)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, _Kind.CHAT)

    async def tokenize(self, request: Request) -> Response:
        """`POST /tokenize` (vLLM's): `prompt` encoded as /v1/completions encodes it, or `messages`
        through the chat template as /v1/chat/completions does; the ids and the context length."""
        try:
            data = await self._read_object(request)
            if "prompt" in data and "messages" in data:
                raise _Reject(client_error("give either prompt or messages, not both", param="messages"))
            if "messages" in data:
                chat = _parsed(_TokenizeChat, data)
                self._check_model(chat.model)
                if chat.add_special_tokens:
                    raise _Reject(client_error(
                        "add_special_tokens: with messages only false is allowed (the chat template "
                        "places the special tokens, as in /v1/chat/completions)", param="add_special_tokens"))
                tokens = await self._encode_chat(chat.messages, (), self._template_kwargs(chat))
            else:
                text = _parsed(_TokenizePrompt, data)
                self._check_model(text.model)
                encode = partial(self.tokenizer.encode, text.prompt,
                                 add_special_tokens=text.add_special_tokens)
                ids = await trio.to_thread.run_sync(encode, limiter=self._tokenizing)
                tokens = tuple(int(t) for t in ids)
        except _Reject as exc:
            return _unless_body_unread(request, _error_response(exc.info))
        except ClientDisconnect:
            return Response(status_code=499)
        return JSONResponse({"tokens": list(tokens), "count": len(tokens),
                             "max_model_len": self.backend.model_info.context_length})

    async def detokenize(self, request: Request) -> Response:
        """`POST /detokenize` (vLLM's): the text of token ids, special tokens included."""
        try:
            body = _parsed(_Detokenize, await self._read_object(request))
            self._check_model(body.model)
            vocab = self.backend.model_info.vocab_size
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            if bad:
                raise _Reject(client_error(
                    f"tokens: token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens"))
            decode = partial(self.tokenizer.decode, body.tokens)
            text = await trio.to_thread.run_sync(decode, limiter=self._tokenizing)
        except _Reject as exc:
            return _unless_body_unread(request, _error_response(exc.info))
        except ClientDisconnect:
            return Response(status_code=499)
        return JSONResponse({"prompt": str(text)})

    async def _read_object(self, request: Request) -> dict[str, object]:
        """The body as a JSON object (within `max_body_bytes`)."""
        _check_media_type(request.headers.get("content-type"))
        raw = await self._read_body(request)
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise _Reject(
                client_error(f"the request body is not valid JSON: {exc}", Code.INVALID_JSON)) from None
        if not isinstance(data, dict):
            raise _Reject(client_error("the request body must be a JSON object"))
        return data

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise _Reject(ErrorInfo(Fault.CLIENT, Code.MODEL_NOT_FOUND, f"the model {model!r} does not "
                                    f"exist; this server serves {self.model_name!r}", "model"))

    # -- for the other APIs ------------------------------------------------------------------

    async def start_chat(
        self,
        request: Request,
        parse: Callable[[dict[str, object]], tuple[dict[str, object], _Parsed]],
        error_body: Callable[[ErrorInfo], object],
        think_budget: Callable[[_Parsed], int | None] = lambda _: None,
    ) -> tuple[ChatRun, _Parsed] | Response:
        """Start another API's request (`adapters.http.other_apis`) as the /v1/chat/completions body that
        `parse` maps its JSON body to, with whatever else `parse` keeps of it. Everything but the
        shapes is the chat's: request id, body limit, validation, template, stop strings, admission,
        backend. `parse` may raise pydantic's ValidationError or StatecoreError; a refusal comes
        back as the answer to send, its body `error_body(info)`. `think_budget` reads the cap on the
        thinking (Anthropic's `budget_tokens`) from what `parse` kept, when the API has one."""
        request_id, bad = _request_id(request)
        try:
            if bad is not None:
                raise _Reject(bad)
            try:
                chat, parsed = parse(await self._read_object(request))
            except ValidationError as exc:
                raise _Reject(_validation_error(exc)) from None
            job = await self._prepare(request, _Kind.CHAT, request_id, chat, think_budget(parsed))
            [run] = await self._start(job)
        except (_Reject, StatecoreError) as exc:
            return _unless_body_unread(request, _error_response(exc.info, request_id, error_body(exc.info)))
        except ClientDisconnect:
            return Response(status_code=499, headers={REQUEST_ID_HEADER: request_id})
        except Exception:
            logger.exception("request %s: unexpected error before generation", request_id)
            info = bug("internal error while starting the request")
            return _unless_body_unread(request, _error_response(info, request_id, error_body(info)))
        return ChatRun(job, run, self._reply(job, 0), self._logprobs_format(job), error_body,
                       details=self.prompt_tokens_details), parsed

    async def count_chat(
        self,
        request: Request,
        parse: Callable[[dict[str, object]], tuple[dict[str, object], _Parsed]],
        error_body: Callable[[ErrorInfo], object],
    ) -> int | Response:
        """How many prompt tokens another API's body is, mapped by `parse` to a chat body as
        `start_chat` maps it (template, tools), without generating; or the refusal to send."""
        try:
            try:
                chat, _ = parse(await self._read_object(request))
                body = _ChatBody.model_validate(chat)
            except ValidationError as exc:
                raise _Reject(_validation_error(exc)) from None
            self._check_model(body.model)
            return len(await self._encode_chat(body.messages, self._tools(body), self._template_kwargs(body)))
        except (_Reject, StatecoreError) as exc:
            return _unless_body_unread(request, _error_response(exc.info, body=error_body(exc.info)))
        except ClientDisconnect:
            return Response(status_code=499)

    # -- one request -------------------------------------------------------------------------

    async def _serve(self, request: Request, kind: _Kind) -> Response:
        request_id, bad = _request_id(request)
        if bad is not None:
            return _error_response(bad, request_id)
        try:
            job = await self._prepare(request, kind, request_id)
            runs = await self._start(job)
        except _Reject as exc:
            return _unless_body_unread(request, _error_response(exc.info, request_id))
        except StatecoreError as exc:
            return _unless_body_unread(request, _error_response(exc.info, request_id))
        except ClientDisconnect:
            return Response(status_code=499, headers={REQUEST_ID_HEADER: request_id})
        except Exception:
            logger.exception("request %s: unexpected error before generation", request_id)
            return _unless_body_unread(
                request, _error_response(bug("internal error while starting the request"), request_id))
        async def cancel_all() -> None:
            for run in runs:
                await run.cancel()

        try:
            return await self._respond(request, job, runs, cancel_all)
        except Exception:
            logger.exception("request %s: unexpected error", request_id)
            await cancel_all()
            return _error_response(bug("internal error while generating"), request_id)
        except BaseException:  # cancelled from outside (server shutdown): free the backend too
            await cancel_all()
            raise

    async def _start(self, job: _Job) -> list[_Run]:
        """Start every choice's generation; if one cannot start, the started ones are cancelled."""
        runs: list[_Run] = []
        try:
            for index in range(job.choices):
                generation = await self.backend.start(job.choice_request(index))
                reasoning = None
                if job.thinking is not None and self.think_markers is not None:
                    reasoning = ReasoningSplitter(self.think_markers, thinking=job.thinking)
                stops = _StopText(self.tokenizer.detokenizer, job.stops, job.quiet_stops, reasoning)
                runs.append(_Run(generation, stops, self._think_budget(job, index)))
        except BaseException:
            for run in runs:
                await run.cancel()
            raise
        return runs

    def _think_budget(self, job: _Job, index: int) -> _ThinkBudget | None:
        if job.think_budget is None or self.think_markers is None:
            return None
        request = job.choice_request(index)

        async def resume(generated: tuple[int, ...], max_tokens: int) -> Generation:
            # one generation of its own (never grouped with other choices), its id derived from
            # the choice's, so that its draws are the same on every node
            sampling = replace(request.sampling, max_tokens=max_tokens, choice_group="", choice=0, choices=1)
            return await self.backend.start(GenerationRequest(
                RequestId(f"{request.request_id}.answer"), request.prompt + generated, sampling))

        return _ThinkBudget(job.think_budget, job.sampling.max_tokens, self.think_markers.end_tokens, resume)

    async def _respond(self, request: Request, job: _Job, runs: list[_Run],
                       cancel_all: Callable[[], Awaitable[None]]) -> Response:
        """Read the choices in turn, one step each (a fixed order: the same bytes on every node,
        while the backend computes them side by side). A stream starts once every choice has its
        first step; a failure before then, or anywhere in a whole body, is the response's status."""
        headers = {REQUEST_ID_HEADER: job.request_id}
        texts: list[list[str]] = [[] for _ in runs]
        reasonings: list[list[str]] = [[] for _ in runs]
        logprobs: list[list[tuple[int, TokenLogprobs]]] = [[] for _ in runs]
        steps: list[_Step] = [_Step("") for _ in runs]
        async with cancel_on_disconnect(request.receive) as watch:
            for index, run in enumerate(runs):
                steps[index] = await run.advance()
            while not job.stream and not any(isinstance(step.end, ErrorInfo) for step in steps):
                open_choices = [i for i, step in enumerate(steps) if step.end is None]
                if not open_choices:
                    break
                for index in open_choices:
                    texts[index].append(steps[index].text)
                    reasonings[index].append(steps[index].reasoning)
                    logprobs[index].extend(steps[index].logprobs)
                    steps[index] = await runs[index].advance()
        if watch.disconnected:
            await cancel_all()
            return Response(status_code=499, headers=headers)
        failed = next((step.end for step in steps if isinstance(step.end, ErrorInfo)), None)
        if failed is not None:
            await cancel_all()
            return _error_response(failed, job.request_id)
        if job.stream:
            return _event_stream(self._events(job, runs, steps), headers, cancel_all)
        finishes: list[_Finish] = []
        for index, step in enumerate(steps):
            assert isinstance(step.end, _Finish)
            texts[index].append(step.text)
            reasonings[index].append(step.reasoning)
            logprobs[index].extend(step.logprobs)
            finishes.append(step.end)
        body = self._body(job, ["".join(t) for t in texts], finishes, logprobs, self._cached_tokens(runs),
                          ["".join(r) for r in reasonings], sum(run.reasoning_tokens for run in runs))
        return JSONResponse(body, headers=headers)

    async def _events(self, job: _Job, runs: list[_Run], first_steps: list[_Step]
                      ) -> AsyncGenerator[bytes, None]:
        """The SSE stream of started generations, from their first steps on: each choice's steps
        in turn, its own finish chunk as it ends; usage (all choices) after the last.

        Each item is one body write: the events made since the last one. A choice whose next
        step needs outputs that are not there yet sends what is made before it waits, so
        nothing is held back while the backend works; steps whose outputs are already waiting
        (a stream behind its tokens) go out together, a write per `_EVENTS_PER_WRITE` events.
        Text chunks without logprobs come from a template per choice (`_text_event`)."""
        pending: list[_Step | None] = list(first_steps)
        completion_tokens = 0
        frames: list[bytes] = []
        try:
            replies = [self._reply(job, index) for index in range(len(runs))]
            formats = [self._logprobs_format(job) for _ in runs]
            text_events = [self._text_event(job, index) for index in range(len(runs))]
            if job.kind is _Kind.CHAT:
                for index in range(len(runs)):
                    frames.append(_event(self._chunk(job, {"role": "assistant", "content": ""}, index=index)))
            failed: ErrorInfo | None = None
            open_choices = list(range(len(runs)))
            while open_choices and failed is None:
                for index in list(open_choices):
                    step = pending[index]
                    pending[index] = None
                    if step is None:
                        if len(frames) >= _EVENTS_PER_WRITE:
                            yield b"".join(frames)
                            frames = []
                        step = await self._stream_step(job, runs[index], wait=False)
                        if step is None:
                            if frames:
                                yield b"".join(frames)
                                frames = []
                            step = await self._stream_step(job, runs[index], wait=True)
                    assert step is not None
                    reply = replies[index]
                    pieces = [reply.add(step.text)]
                    if isinstance(step.end, _Finish):
                        pieces.append(reply.close())
                    unsent = formats[index].of(step.logprobs)  # goes with this step's first chunk
                    if step.reasoning:
                        frames.append(_event(self._chunk(job, self._reasoning_delta(step.reasoning),
                                                         index=index, logprobs=unsent)))
                        unsent = None
                    for text, calls in pieces:
                        if text:
                            if unsent is None:
                                frames.append(text_events[index](text))
                            else:
                                frames.append(_event(self._chunk(job, text, index=index, logprobs=unsent)))
                            unsent = None
                        if calls:
                            frames.append(_event(self._chunk(job, {"tool_calls": [
                                {"index": number, **call} for number, call in calls]}, index=index)))
                    if unsent is not None and step.logprobs:  # tokens whose text is held back
                        frames.append(_event(self._chunk(job, "", index=index, logprobs=unsent)))
                    if isinstance(step.end, _Finish):
                        reason = reply.finish_reason(step.end.reason)
                        frames.append(_event(self._chunk(job, None, reason, index=index)))
                        completion_tokens += step.end.completion_tokens
                        open_choices.remove(index)
                    elif isinstance(step.end, ErrorInfo):
                        failed = step.end
                        break
            if failed is not None:
                frames.append(_event(failed.to_openai()))
            elif job.include_usage:
                frames.append(_event(self._usage_chunk(job, completion_tokens, self._cached_tokens(runs),
                                                       sum(run.reasoning_tokens for run in runs))))
            frames.append(_event("[DONE]"))
            yield b"".join(frames)
        finally:
            # Done, failed, or the client went away (cancelled or closed at a yield): free the backend.
            for run in runs:
                await run.cancel()

    @staticmethod
    async def _stream_step(job: _Job, run: _Run, *, wait: bool) -> _Step | None:
        """`run`'s next step (None: not without waiting, when `wait` is False); an unexpected
        error is the step's failure."""
        try:
            return await run.advance() if wait else await run.advance_ready()
        except Exception:
            logger.exception("request %s: unexpected error while streaming", job.request_id)
            return _Step("", bug("internal error while generating"))

    # -- bodies ------------------------------------------------------------------------------

    def _head(self, job: _Job, object_name: str) -> dict[str, Any]:
        return {
            "id": job.response_id,
            "object": object_name,
            "created": job.created,
            "model": self.model_name,
        }

    def _reply(self, job: _Job, index: int) -> _Reply:
        if not job.tools:
            return _Reply(None, "")
        t = self.tokenizer
        return _Reply(ToolCallSplitter(t.tool_call_start, t.tool_call_end, t.tool_parser, job.tools),
                      job.choice_request(index).request_id)

    def _cached_tokens(self, runs: Sequence[_Run]) -> int | None:
        """The prompt tokens choice 0's prefill took from a prefix cache (the prompt is counted
        once, as usage counts it); None unless prompt tokens details are on."""
        return runs[0].first_generation.cached_tokens if self.prompt_tokens_details else None

    def _body(self, job: _Job, texts: list[str], finishes: list[_Finish],
              logprobs: list[list[tuple[int, TokenLogprobs]]], cached_tokens: int | None,
              reasonings: list[str], reasoning_tokens: int) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for index, (text, finish) in enumerate(zip(texts, finishes, strict=True)):
            choice: dict[str, Any] = {"index": index}
            reply = self._reply(job, index)
            pieces = [reply.add(text), reply.close()]
            content = "".join(piece for piece, _ in pieces)
            calls = [call for _, found in pieces for _, call in found]
            if job.kind is _Kind.CHAT:
                choice["message"] = {"role": "assistant", "content": content or (None if calls else "")}
                if job.thinking is not None:
                    choice["message"].update(self._reasoning_delta(reasonings[index] or None))
                if calls:
                    choice["message"]["tool_calls"] = calls
            else:
                choice["text"] = content
            choice["logprobs"] = self._logprobs_format(job).of(logprobs[index])
            choice["finish_reason"] = reply.finish_reason(finish.reason)
            choices.append(choice)
        return {
            **self._head(job, job.kind.value),
            "choices": choices,
            "usage": job.usage(sum(finish.completion_tokens for finish in finishes), cached_tokens,
                               reasoning_tokens),
        }

    @staticmethod
    def _reasoning_delta(reasoning: str | None) -> dict[str, Any]:
        """The thinking under both names clients read: `reasoning_content` (vLLM's, DeepSeek's)
        and `reasoning` (mlx_lm.server's)."""
        return {"reasoning_content": reasoning, "reasoning": reasoning}

    def _logprobs_format(self, job: _Job) -> _LogprobsFormat:
        return _LogprobsFormat(self.tokenizer, job.kind is _Kind.CHAT, job.sampling.logprobs)

    def _chunk(
        self, job: _Job, content: str | dict[str, Any] | None, finish: str | None = None, *, index: int = 0,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk of choice `index`: `content` is text, a chat delta, or None for its
        final chunk."""
        choice: dict[str, Any] = {"index": index}
        if job.kind is _Kind.CHAT:
            object_name = "chat.completion.chunk"
            if isinstance(content, dict):
                choice["delta"] = content
            else:
                choice["delta"] = {} if content is None else {"content": content}
        else:
            object_name = "text_completion"
            choice["text"] = content if isinstance(content, str) else ""
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        chunk = {**self._head(job, object_name), "choices": [choice]}
        if job.include_usage:
            chunk["usage"] = None
        return chunk

    def _text_event(self, job: _Job, index: int) -> Callable[[str], bytes]:
        """The event of choice `index`'s chunk of some text without logprobs: from a template
        made here (the bytes `_event(self._chunk(job, text, index=index))` would be)."""
        template = _TextEvent.around(_event(self._chunk(job, _TEXT_MARK, index=index)))
        if template is not None:
            return template.of
        return lambda text: _event(self._chunk(job, text, index=index))

    def _usage_chunk(self, job: _Job, completion_tokens: int, cached_tokens: int | None,
                     reasoning_tokens: int) -> dict[str, Any]:
        object_name = "chat.completion.chunk" if job.kind is _Kind.CHAT else "text_completion"
        return {**self._head(job, object_name), "choices": [],
                "usage": job.usage(completion_tokens, cached_tokens, reasoning_tokens)}

    # -- reading a request -------------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        too_large = ErrorInfo(
            Fault.CLIENT, Code.BODY_TOO_LARGE, f"the request body exceeds {self.max_body_bytes} bytes"
        )
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _Reject(too_large)
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _Reject(too_large)
            chunks.append(chunk)
        request.state.body_read = True
        return b"".join(chunks)

    async def _prepare(self, request: Request, kind: _Kind, request_id: RequestId,
                       data: dict[str, object] | None = None, think_budget: int | None = None) -> _Job:
        """The request's job; `data` is its body when already read (another API's, as a chat's),
        with its thinking budget if it has one."""
        await self.faults.at(Phase.TOKENIZE, request_id)
        if data is None:
            data = await self._read_object(request)
        schema: type[_CompletionBody | _ChatBody] = _CompletionBody if kind is _Kind.COMPLETION else _ChatBody
        try:
            body = schema.model_validate(data)
        except ValidationError as exc:
            raise _Reject(_validation_error(exc)) from None
        self._check_model(body.model)
        self._check_unsupported(data, body)
        stream = bool(body.stream)
        if body.stream_options is not None and not stream:
            raise _Reject(client_error("stream_options is only allowed when stream is true",
                                       param="stream_options"))
        stops = self._stops(body.stop)
        offers_tools = isinstance(body, _ChatBody) and bool(body.tools) and body.tool_choice != "none"
        response_format = await self._response_format(body, stops, offers_tools) or await self._forced_call(
            body, stops)

        thinking: bool | None = None
        if isinstance(body, _CompletionBody):
            prompt = await self._encode_prompt(body.prompt)
            max_tokens = body.max_tokens
        else:
            tools = self._tools(body)
            prompt = await self._encode_chat(body.messages, tools, self._template_kwargs(body))
            # a grammar (response_format, a forced call) writes the answer from the first token:
            # nothing in it is thinking, whatever the prompt opened
            if self.think_markers is not None and response_format is None:
                thinking = opens_thinking(prompt, self.think_markers)
            both = (body.max_tokens, body.max_completion_tokens)
            if None not in both and both[0] != both[1]:
                raise _Reject(client_error("max_tokens and max_completion_tokens disagree",
                                           param="max_completion_tokens"))
            max_tokens = body.max_completion_tokens or body.max_tokens

        context = self.backend.model_info.context_length
        room = context - len(prompt)
        if room < 1:
            raise _Reject(
                client_error(
                    f"the prompt has {len(prompt)} tokens, which leaves no room in this model's "
                    f"context of {context} tokens",
                    Code.CONTEXT_LENGTH_EXCEEDED,
                    "prompt" if kind is _Kind.COMPLETION else "messages",
                )
            )
        if max_tokens is None:
            max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, room) if kind is _Kind.COMPLETION else room
        elif max_tokens > room:
            raise _Reject(
                client_error(
                    f"the prompt has {len(prompt)} tokens and max_tokens is {max_tokens}: together "
                    f"more than this model's context of {context} tokens",
                    Code.CONTEXT_LENGTH_EXCEEDED,
                    "max_tokens",
                )
            )
        top_k = body.top_k if body.top_k is not None else 0
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature if body.temperature is not None else 1.0,
            top_p=body.top_p if body.top_p is not None else 1.0,
            top_k=max(top_k, 0),
            seed=body.seed,
            ignore_eos=bool(body.ignore_eos),
            min_p=body.min_p or 0.0,
            **self._xtc(body),
            logit_bias=self._logit_bias(body.logit_bias),
            repetition_penalty=body.repetition_penalty or 0.0,
            repetition_context_size=_given(body.repetition_context_size, 20),
            presence_penalty=body.presence_penalty or 0.0,
            presence_context_size=_given(body.presence_context_size, 20),
            frequency_penalty=body.frequency_penalty or 0.0,
            frequency_context_size=_given(body.frequency_context_size, 20),
            logprobs=self._logprobs(body),
            response_format=response_format,
        )
        return _Job(
            kind=kind,
            request_id=request_id,
            created=int(time.time()),
            prompt=prompt,
            sampling=sampling,
            stops=stops,
            stream=stream,
            include_usage=stream and body.stream_options is not None and body.stream_options.include_usage,
            choices=body.n or 1,
            tools=tools if isinstance(body, _ChatBody) else (),
            quiet_stops=self._one_call_only(body, tools if isinstance(body, _ChatBody) else (),
                                            response_format),
            thinking=thinking,
            think_budget=self._checked_budget(think_budget, max_tokens, thinking),
        )

    def _checked_budget(self, budget: int | None, max_tokens: int, thinking: bool | None) -> int | None:
        """A thinking budget (Anthropic's `budget_tokens`): under max_tokens, as Anthropic wants it,
        and only for a model with think markers."""
        if budget is None:
            return None
        if self.think_markers is None:
            raise _Reject(ErrorInfo(Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
                                    "thinking: this model has no think markers that mlx-lm knows, so "
                                    "its thinking cannot be told apart or capped", "thinking"))
        if thinking is None:
            raise _Reject(client_error("thinking: a structured output or forced tool call is written from "
                                       "the first token, so there is no thinking to cap", param="thinking"))
        if budget >= max_tokens:
            raise _Reject(client_error(f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                                       f"({max_tokens})", param="thinking.budget_tokens"))
        return budget

    def _template_kwargs(self, body: _ChatBody | _TokenizeChat) -> dict[str, Any]:
        """The chat template's extra variables: `reasoning_effort` where the template reads it (else,
        for a model with think markers, "none" turns the thinking off and any other effort on),
        then the client's `chat_template_kwargs` over it; the names the front end gives the
        template itself are refused."""
        given = dict(body.chat_template_kwargs or {})
        taken = sorted(_TEMPLATE_OWN_ARGUMENTS.intersection(given))
        if taken:
            raise _Reject(client_error(f"chat_template_kwargs: {', '.join(taken)} is set by the server, "
                                       "not by a template argument", param="chat_template_kwargs"))
        effort = body.reasoning_effort if isinstance(body, _ChatBody) else None
        return {**self._effort(effort, "reasoning_effort"), **given}

    def _effort(self, effort: str | None, param: str) -> dict[str, Any]:
        if effort is None:
            return {}
        if self._template_reads_effort:
            return {"reasoning_effort": effort}
        if self.think_markers is not None:
            return {"enable_thinking": effort != "none"}
        raise _Reject(ErrorInfo(Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
                                f"{param}: this model does not reason (its chat template reads no "
                                "reasoning_effort and it has no think markers that mlx-lm knows)", param))

    def _one_call_only(self, body: _Sampling, tools: Sequence[Mapping[str, Any]], constraint: str | None
                       ) -> tuple[str, ...]:
        """`parallel_tool_calls: false`: the generation stops where the first call's end marker
        would be (the open call is parsed as it stands), so a reply holds at most one call. A
        forced call needs nothing: its grammar allows one call."""
        if not tools or constraint is not None or not isinstance(body, _ChatBody):
            return ()
        return (self.tokenizer.tool_call_end,) if body.parallel_tool_calls is False else ()

    def _xtc(self, body: _Sampling) -> dict[str, Any]:
        """XTC's settings; the tokens it never leaves out are mlx_lm.server's: a newline and EOS."""
        if not body.xtc_probability:
            return {}
        newline = self.tokenizer.encode("\n", add_special_tokens=False)
        special = sorted({*(int(t) for t in newline), *self.backend.model_info.eos_token_ids})
        return {"xtc_probability": body.xtc_probability,
                "xtc_threshold": 0.1 if body.xtc_threshold is None else body.xtc_threshold,
                "xtc_special_tokens": tuple(special)}

    @staticmethod
    def _logprobs(body: _CompletionBody | _ChatBody) -> int | None:
        """How many alternatives each token's logprobs list (None: no logprobs)."""
        if isinstance(body, _CompletionBody):
            return body.logprobs
        if body.top_logprobs is not None and not body.logprobs:
            raise _Reject(client_error("top_logprobs needs logprobs: true", param="top_logprobs"))
        return (body.top_logprobs or 0) if body.logprobs else None

    @staticmethod
    async def _response_format(body: _Sampling, stops: Sequence[str], offers_tools: bool) -> str | None:
        """A non-text `response_format` as the constraint's canonical text (None: free text),
        checked by llguidance here, before any engine; what would break the JSON is refused."""
        given = body.response_format
        if given is None or given.type == "text":
            return None
        _check_grammar_ends(body, stops, "the JSON that response_format asks for")
        if offers_tools:
            raise _Reject(ErrorInfo(Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
                                    "response_format with tools: the grammar would keep the model from "
                                    "calling a tool", "response_format"))
        schema = given.json_schema.schema_ if given.json_schema is not None else None
        try:
            text = response_format_text(given.type, schema)
        except ValueError as exc:  # NaN or Infinity in the schema: not JSON
            raise _Reject(refused(str(exc)).info) from None
        error = await trio.to_thread.run_sync(format_error, text)
        if error is not None:
            raise _Reject(refused(error).info)
        return text

    def _tools(self, body: _ChatBody) -> tuple[dict[str, Any], ...]:
        """The tools the model is offered (none with `tool_choice: "none"`), checked against what
        it can do."""
        if not body.tools or body.tool_choice == "none":
            return ()
        if not getattr(self.tokenizer, "has_tool_calling", False):
            raise _Reject(client_error("tools: this model's chat template has no tool calling "
                                       "(no tool-call markers that mlx-lm knows)", param="tools"))
        return tuple(tool.model_dump(exclude_none=True) for tool in body.tools)

    async def _forced_call(self, body: _Sampling, stops: Sequence[str]) -> str | None:
        """`tool_choice` "required" or a named function as the constraint of one call (None when
        nothing is forced): the model writes a call of one of the tools (of that one) between its
        tool-call markers, as JSON valid against the tool's parameters, and then ends."""
        if not isinstance(body, _ChatBody) or not body.tools or body.tool_choice in (None, "auto", "none"):
            return None
        parser = getattr(self.tokenizer, "tool_parser", None)
        if not getattr(self.tokenizer, "has_tool_calling", False):
            return None  # `_tools` refuses the tools themselves
        if not getattr(parser, "__module__", "").endswith(".json_tools"):
            raise _Reject(ErrorInfo(
                Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
                f"tool_choice: forcing a call is served for models whose calls are JSON between markers "
                f"(mlx-lm's json_tools parser); this model's parser is {getattr(parser, '__module__', '?')}",
                "tool_choice"))
        tools = [(tool.function.name, tool.function.parameters) for tool in body.tools]
        if isinstance(body.tool_choice, _ToolChoice):
            wanted = body.tool_choice.function.name
            tools = [tool for tool in tools if tool[0] == wanted]
            if not tools:
                raise _Reject(client_error(f"tool_choice: no tool is named {wanted!r}",
                                           param="tool_choice.function.name"))
        _check_grammar_ends(body, stops, "the tool call that tool_choice forces")
        try:
            text = tool_call_text(self.tokenizer.tool_call_start, self.tokenizer.tool_call_end, tools)
        except ValueError as exc:  # NaN or Infinity in a schema: not JSON
            raise _Reject(client_error(f"tools: a parameters schema is not JSON: {exc}",
                                       param="tools")) from None
        error = await trio.to_thread.run_sync(format_error, text)
        if error is not None:
            raise _Reject(client_error(f"tools: the parameters cannot be enforced for tool_choice: {error}",
                                       param="tools"))
        return text

    def _logit_bias(self, given: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs in id order; an id must be a token of the model."""
        if not given:
            return ()
        vocab = self.backend.model_info.vocab_size
        biases: dict[int, float] = {}
        for key, bias in given.items():
            token = int(key) if key.strip().isdigit() else -1
            if not 0 <= token < vocab:
                raise _Reject(client_error(f"logit_bias: {key!r} is not a token id of this model "
                                           f"(0 to {vocab - 1})", param="logit_bias"))
            biases[token] = bias
        return tuple(sorted(biases.items()))

    @staticmethod
    def _check_unsupported(data: Mapping[str, object], body: _Sampling) -> None:
        names = [name for name, neutral in _UNSUPPORTED.items() if name in data and not neutral(data[name])]
        if names:
            raise _Reject(
                ErrorInfo(
                    Fault.UNSUPPORTED,
                    Code.UNSUPPORTED_PARAMETER,
                    f"unsupported parameter{'s' if len(names) > 1 else ''}: {', '.join(names)} "
                    "(no echo, suffix, best_of, functions, guided_* decoding or web search are served)",
                    names[0],
                )
            )

    @staticmethod
    def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
        given = [stop] if isinstance(stop, str) else list(stop or [])
        if len(given) > MAX_STOP_STRINGS:
            raise _Reject(client_error(f"stop: at most {MAX_STOP_STRINGS} stop strings are allowed",
                                       param="stop"))
        if any(len(s) > MAX_STOP_LENGTH for s in given):
            raise _Reject(client_error(f"stop: a stop string may have at most {MAX_STOP_LENGTH} characters",
                                       param="stop"))
        return tuple(dict.fromkeys(s for s in given if s))

    async def _encode_prompt(self, prompt: str | list[int]) -> tuple[int, ...]:
        if not prompt:
            raise _Reject(client_error("prompt must not be empty", param="prompt"))
        if isinstance(prompt, list):
            vocab = self.backend.model_info.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise _Reject(client_error(
                    f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt"))
            return tuple(prompt)
        ids = await trio.to_thread.run_sync(self.tokenizer.encode, prompt, limiter=self._tokenizing)
        return tuple(int(t) for t in ids)

    async def _encode_chat(self, messages: list[_Message], tools: Sequence[Mapping[str, Any]] = (),
                           template_kwargs: Mapping[str, Any] | None = None) -> tuple[int, ...]:
        if not getattr(self.tokenizer, "has_chat_template", False):
            raise _Reject(
                ErrorInfo(
                    Fault.UNSUPPORTED,
                    Code.UNSUPPORTED_PARAMETER,
                    "this model has no chat template: use /v1/completions",
                )
            )
        apply = partial(
            self.tokenizer.apply_chat_template,
            [m.to_template() for m in messages],
            add_generation_prompt=True,
            tokenize=True,
            **({"tools": list(tools)} if tools else {}),
        )
        try:
            ids = await trio.to_thread.run_sync(partial(apply, **(template_kwargs or {})),
                                                limiter=self._tokenizing)
        except (TemplateError, TypeError, ValueError) as exc:
            if not template_kwargs:
                if isinstance(exc, TemplateError):
                    raise _Reject(client_error(f"messages: the chat template refused them: {exc}",
                                               param="messages")) from None
                raise
            # whose fault: the messages alone, or the arguments given with them
            try:
                await trio.to_thread.run_sync(apply, limiter=self._tokenizing)
            except TemplateError:
                raise _Reject(client_error(f"messages: the chat template refused them: {exc}",
                                           param="messages")) from None
            raise _Reject(client_error(f"chat_template_kwargs: the chat template refused them: "
                                       f"{type(exc).__name__}: {exc}",
                                       param="chat_template_kwargs")) from None
        return tuple(int(t) for t in ids)


# ---------------------------------------------------------------------------------------------
# /tokenize and /detokenize: bodies and reading them


class _Exact(BaseModel):
    """Strict like the generation bodies, and an unknown field is refused: these bodies are small
    and new, so a misspelt field would only ever have been a mistake."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _TokenizePrompt(_Exact):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # as /v1/completions encodes a text prompt


class _TokenizeChat(_Exact):
    model: str | None = None
    messages: list[_Message] = Field(min_length=1)
    chat_template_kwargs: dict[str, _TemplateValue] | None = None  # as /v1/chat/completions takes them
    add_special_tokens: bool = False  # vLLM's default; the chat template places them


class _Detokenize(_Exact):
    model: str | None = None
    tokens: list[int]


_Body = TypeVar("_Body", bound=BaseModel)


def _parsed(schema: type[_Body], data: Mapping[str, object]) -> _Body:
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise _Reject(_validation_error(exc)) from None


# ---------------------------------------------------------------------------------------------
# The app


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    info = client_error(f"{request.method} {request.url.path}: {exc.detail}")
    return JSONResponse(info.to_openai(), status_code=exc.status_code, headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> Response:
    logger.error("unexpected error in %s %s", request.method, request.url.path, exc_info=exc)
    return _error_response(bug("internal error"))


CORS_EXPOSED_HEADERS = (REQUEST_ID_HEADER, "Retry-After")


def build_app(frontend: Frontend, *, extra_routes: Sequence[BaseRoute] = (),
              health: Callable[[Request], Awaitable[Response]] | None = None,
              api_keys: ApiKeys | None = None, allowed_origins: Sequence[str] = ()) -> Starlette:
    """The ASGI app: the OpenAI routes plus `extra_routes` (a node's or the router's own).
    `health` replaces the front end's `/health` where a node knows more (why it is unavailable).
    `api_keys` guards the public paths (`adapters.http.api_keys`); `allowed_origins` (`*` for any)
    turns CORS on, outside the key check so that a browser's preflight needs no key and a 401
    still reaches the page. Any request header is allowed (the SDKs send their own)."""
    routes: list[BaseRoute] = [
        Route("/v1/completions", frontend.completions, methods=["POST"]),
        Route("/v1/chat/completions", frontend.chat_completions, methods=["POST"]),
        Route("/v1/models", frontend.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", frontend.model, methods=["GET"]),
        Route("/tokenize", frontend.tokenize, methods=["POST"]),
        Route("/detokenize", frontend.detokenize, methods=["POST"]),
        *other_api_routes(frontend),  # /v1/messages, /v1/responses
        Route("/health", health or frontend.health, methods=["GET"]),
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
