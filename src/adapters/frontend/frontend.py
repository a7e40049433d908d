"""The front end's shared core, one per node over one `Backend`: a body becomes the job it asks for,
and a job its runs. `Job` is a validated, tokenized request (`job_of`: the prompt's token ids, the
sampling parameters with every default filled in, the stop strings, the constraint (a
response_format, a forced tool call), the tools offered, the thinking and its cap, how many choices;
whether it fits the model's context, and the room it leaves for the answer, are
`statecore.policy.context_overflow`'s and `context_room`'s, asked here). `Frontend` holds the
tokenizer and model name and the body limit, reads a request for every API alike (`read_object`: the
body within its limit, as a JSON object, labelled as JSON; `check_model`; `request_id_of`: its
`X-Request-Id`), and has the two verbs every API of the public surface uses: `prepare` (read and
validate a chat or completion body into a `Job`) and `start` (start each choice's generation as a
`Run`). The APIs served as a chat (Messages, Responses) start theirs through `chat_run.start_chat`.

Both the single node and the router serve through it: on a single node the backend is the local
engine, on the router it is prefill and decode peers. The backend only ever yields token ids;
everything a client sees is made by the front end, so the output through the cluster is
byte-identical to a single node's by construction. The routes and their answers live in the
per-API modules (`openai_api`, `tokenize_api`, `messages_api`, `responses_api`) and `app`
assembles them. An adapter: it imports the bodies, `prompts`, the generation driver and nothing
of the per-API modules (they import it); nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import enum
import json
import re
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import trio
from pydantic import ValidationError
from starlette.requests import Request

from adapters.frontend.generation import LogprobsFormat, Reply, Run, StopText, ThinkBudget
from adapters.frontend.intake import REQUEST_ID_HEADER, Reject, validation_error
from adapters.frontend.openai_bodies import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatBody,
    CompletionBody,
    Sampling,
    TemplateValue,
    check_grammar_ends,
    check_unsupported,
    given,
    stop_strings,
)
from adapters.frontend.prompts import Prompts
from adapters.grammar import format_error, refused, response_format_text
from adapters.reasoning import ReasoningSplitter, ThinkMarkers, opens_thinking
from adapters.tool_calls import ToolCallSplitter
from effects.faults import Faults, Phase
from effects.ports import Backend, Generation, GenerationRequest, SamplingParams
from statecore.errors import Code, ErrorInfo, Fault, client_error
from statecore.ids import RequestId
from statecore.policy import context_overflow, context_room

__all__ = ["Frontend", "Job", "Kind", "job_of", "request_id_of"]

class Kind(enum.Enum):
    COMPLETION = "text_completion"
    CHAT = "chat.completion"


@dataclass(frozen=True, slots=True)
class Job:
    """A validated, tokenized request."""

    kind: Kind
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
        prefix = "cmpl-" if self.kind is Kind.COMPLETION else "chatcmpl-"
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


async def job_of(prompts: Prompts, kind: Kind, request_id: RequestId, body: CompletionBody | ChatBody,
                 context_length: int, think_budget: int | None = None) -> Job:
    """The job `body` asks for, with its thinking budget if another API gave one; a refusal is a
    `Reject`."""
    stream = bool(body.stream)
    if body.stream_options is not None and not stream:
        raise Reject(client_error("stream_options is only allowed when stream is true",
                                  param="stream_options"))
    stops = stop_strings(body.stop)
    offers_tools = isinstance(body, ChatBody) and bool(body.tools) and body.tool_choice != "none"
    response_format = await response_format_of(body, stops, offers_tools) or await prompts.forced_call(
        body, stops)

    thinking: bool | None = None
    if isinstance(body, CompletionBody):
        prompt = await prompts.encode_prompt(body.prompt)
        max_tokens = body.max_tokens
    else:
        tools = prompts.tools(body)
        template_kwargs = prompts.template_kwargs(body.chat_template_kwargs, body.reasoning_effort)
        prompt = await prompts.encode_chat(body.messages, tools, template_kwargs)
        # a grammar (response_format, a forced call) writes the answer from the first token:
        # nothing in it is thinking, whatever the prompt opened
        if prompts.think_markers is not None and response_format is None:
            thinking = opens_thinking(prompt, prompts.think_markers)
        both = (body.max_tokens, body.max_completion_tokens)
        if None not in both and both[0] != both[1]:
            raise Reject(client_error("max_tokens and max_completion_tokens disagree",
                                      param="max_completion_tokens"))
        max_tokens = body.max_completion_tokens or body.max_tokens

    room = context_room(len(prompt), context_length)
    overflow = context_overflow(len(prompt), max_tokens, context_length)
    if overflow == "prompt":
        raise Reject(
            client_error(
                f"the prompt has {len(prompt)} tokens, which leaves no room in this model's "
                f"context of {context_length} tokens",
                Code.CONTEXT_LENGTH_EXCEEDED,
                "prompt" if kind is Kind.COMPLETION else "messages",
            )
        )
    if overflow == "max_tokens":
        raise Reject(
            client_error(
                f"the prompt has {len(prompt)} tokens and max_tokens is {max_tokens}: together "
                f"more than this model's context of {context_length} tokens",
                Code.CONTEXT_LENGTH_EXCEEDED,
                "max_tokens",
            )
        )
    if max_tokens is None:
        max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, room) if kind is Kind.COMPLETION else room
    top_k = body.top_k if body.top_k is not None else 0
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature if body.temperature is not None else 1.0,
        top_p=body.top_p if body.top_p is not None else 1.0,
        top_k=max(top_k, 0),
        seed=body.seed,
        ignore_eos=bool(body.ignore_eos),
        min_p=body.min_p or 0.0,
        **prompts.xtc(body),
        logit_bias=prompts.logit_bias(body.logit_bias),
        repetition_penalty=body.repetition_penalty or 0.0,
        repetition_context_size=given(body.repetition_context_size, 20),
        presence_penalty=body.presence_penalty or 0.0,
        presence_context_size=given(body.presence_context_size, 20),
        frequency_penalty=body.frequency_penalty or 0.0,
        frequency_context_size=given(body.frequency_context_size, 20),
        logprobs=logprobs_of(body),
        response_format=response_format,
        adapter=prompts.adapter(body.adapters),
        num_draft_tokens=body.num_draft_tokens,
    )
    return Job(
        kind=kind,
        request_id=request_id,
        created=int(time.time()),
        prompt=prompt,
        sampling=sampling,
        stops=stops,
        stream=stream,
        include_usage=stream and body.stream_options is not None and body.stream_options.include_usage,
        choices=body.n or 1,
        tools=tools if isinstance(body, ChatBody) else (),
        quiet_stops=prompts.one_call_only(body, tools if isinstance(body, ChatBody) else (),
                                        response_format),
        thinking=thinking,
        think_budget=checked_budget(prompts, think_budget, max_tokens, thinking),
    )


def checked_budget(prompts: Prompts, budget: int | None, max_tokens: int, thinking: bool | None
                   ) -> int | None:
    """A thinking budget (Anthropic's `budget_tokens`): under max_tokens, as Anthropic wants it,
    and only for a model with think markers."""
    if budget is None:
        return None
    if prompts.think_markers is None:
        raise Reject(ErrorInfo(Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
                               "thinking: this model has no think markers that mlx-lm knows, so "
                               "its thinking cannot be told apart or capped", "thinking"))
    if thinking is None:
        raise Reject(client_error("thinking: a structured output or forced tool call is written from "
                                  "the first token, so there is no thinking to cap", param="thinking"))
    if budget >= max_tokens:
        raise Reject(client_error(f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                                  f"({max_tokens})", param="thinking.budget_tokens"))
    return budget


def logprobs_of(body: CompletionBody | ChatBody) -> int | None:
    """How many alternatives each token's logprobs list (None: no logprobs)."""
    if isinstance(body, CompletionBody):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise Reject(client_error("top_logprobs needs logprobs: true", param="top_logprobs"))
    return (body.top_logprobs or 0) if body.logprobs else None

async def response_format_of(body: Sampling, stops: Sequence[str], offers_tools: bool) -> str | None:
    """A non-text `response_format` as the constraint's canonical text (None: free text),
    checked by llguidance here, before any engine; what would break the JSON is refused."""
    given = body.response_format
    if given is None or given.type == "text":
        return None
    check_grammar_ends(body, stops, "the JSON that response_format asks for")
    if offers_tools:
        raise Reject(ErrorInfo(Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
                               "response_format with tools: the grammar would keep the model from "
                               "calling a tool", "response_format"))
    schema = given.json_schema.schema_ if given.json_schema is not None else None
    try:
        text = response_format_text(given.type, schema)
    except ValueError as exc:  # NaN or Infinity in the schema: not JSON
        raise Reject(refused(str(exc)).info) from None
    error = await trio.to_thread.run_sync(format_error, text)
    if error is not None:
        raise Reject(refused(error).info)
    return text


# -- reading a request, for every API alike ------------------------------------------------------

_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")

# What a JSON body may be labelled: JSON itself, nothing, or curl's default for `-d`
# (application/x-www-form-urlencoded), which many a `curl -d '{...}'` sends without meaning it.
_JSON_MEDIA_TYPES = ("application/json", "application/x-www-form-urlencoded")


def request_id_of(request: Request) -> tuple[RequestId, ErrorInfo | None]:
    """The request's id: its `X-Request-Id` header, else a fresh one (also when the header is bad,
    which the error says)."""
    incoming = request.headers.get(REQUEST_ID_HEADER)
    if incoming is not None and not _REQUEST_ID_RE.fullmatch(incoming):
        info = client_error(f"{REQUEST_ID_HEADER} must be 1 to 128 characters of A-Z a-z 0-9 . _ -")
        return RequestId(uuid.uuid4().hex), info
    return RequestId(incoming if incoming is not None else uuid.uuid4().hex), None


def _check_media_type(content_type: str | None) -> None:
    """Refuse a body labelled as something other than JSON (text/plain, multipart/form-data, ...)
    with 415, rather than read it as JSON anyway."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media and media not in _JSON_MEDIA_TYPES and not media.endswith("+json"):
        raise Reject(ErrorInfo(Fault.CLIENT, Code.UNSUPPORTED_MEDIA_TYPE,
                               f"the request body is labelled {media}: send JSON with "
                               "'Content-Type: application/json'"))


class Frontend:
    """The front end over one `Backend`: tokenizer, model name, backend, limits."""

    def __init__(
        self,
        tokenizer: Any,
        backend: Backend,
        *,
        model_name: str | None = None,
        max_body_bytes: int = 4 << 20,
        prompt_tokens_details: bool = False,
        template_args: Mapping[str, TemplateValue] | None = None,
    ) -> None:
        """`tokenizer` is an mlx-lm `TokenizerWrapper`; the model name defaults to the backend's.
        `prompt_tokens_details` (vLLM's `--enable-prompt-tokens-details`) reports the prompt tokens
        each prefill took from a prefix cache in usage (`prompt_tokens_details.cached_tokens`, the
        Responses API's `input_tokens_details`, Messages' `cache_read_input_tokens`).
        `template_args` (`--chat-template-args`) go to the chat template of every chat, under the
        request's own (`TemplateArgsRefused` when the template cannot take them)."""
        self.tokenizer = tokenizer
        self.backend = backend
        self.model_name = model_name if model_name is not None else backend.model_info.name
        self.max_body_bytes = max_body_bytes
        self.prompt_tokens_details = prompt_tokens_details
        self.created = int(time.time())
        self.prompts = Prompts(tokenizer, backend, template_args)
        self.faults = Faults.none()  # tests only: see effects.faults
        self.warnings: list[str] = []  # start-up warnings, repeated in /health

    @property
    def think_markers(self) -> ThinkMarkers | None:
        return self.prompts.think_markers

    @classmethod
    def load(
        cls,
        model_dir: Path,
        backend: Backend,
        *,
        model_name: str | None = None,
        max_body_bytes: int = 4 << 20,
        prompt_tokens_details: bool = False,
        template_args: Mapping[str, TemplateValue] | None = None,
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
                   prompt_tokens_details=prompt_tokens_details, template_args=template_args)

    async def read_object(self, request: Request) -> dict[str, object]:
        """The body as a JSON object, labelled as JSON, within `max_body_bytes`."""
        _check_media_type(request.headers.get("content-type"))
        raw = await self._read_body(request)
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise Reject(client_error(f"the request body is not valid JSON: {exc}",
                                      Code.INVALID_JSON)) from None
        if not isinstance(data, dict):
            raise Reject(client_error("the request body must be a JSON object"))
        return data

    async def _read_body(self, request: Request) -> bytes:
        too_large = ErrorInfo(Fault.CLIENT, Code.BODY_TOO_LARGE,
                              f"the request body exceeds {self.max_body_bytes} bytes")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise Reject(too_large)
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise Reject(too_large)
            chunks.append(chunk)
        request.state.body_read = True  # read whole (`intake.unless_body_unread`)
        return b"".join(chunks)

    def check_model(self, model: str | None) -> None:
        """A body's `model` names the one model this server serves, or nothing."""
        if model is not None and model != self.model_name:
            raise Reject(ErrorInfo(Fault.CLIENT, Code.MODEL_NOT_FOUND, f"the model {model!r} does not "
                                   f"exist; this server serves {self.model_name!r}", "model"))

    async def prepare(self, request: Request, kind: Kind, request_id: RequestId,
                      data: dict[str, object] | None = None, think_budget: int | None = None) -> Job:
        """The request's job; `data` is its body when already read (another API's, as a chat's),
        with its thinking budget if it has one."""
        if self.faults.armed:
            await self.faults.at(Phase.TOKENIZE, request_id)
        if data is None:
            data = await self.read_object(request)
        schema: type[CompletionBody | ChatBody] = CompletionBody if kind is Kind.COMPLETION else ChatBody
        try:
            body = schema.model_validate(data)
        except ValidationError as exc:
            raise Reject(validation_error(exc)) from None
        self.check_model(body.model)
        check_unsupported(data)
        return await job_of(self.prompts, kind, request_id, body, self.backend.model_info.context_length,
                            think_budget)

    async def start(self, job: Job) -> list[Run]:
        """Start every choice's generation; if one cannot start, the started ones are cancelled."""
        runs: list[Run] = []
        try:
            for index in range(job.choices):
                generation = await self.backend.start(job.choice_request(index))
                reasoning = None
                if job.thinking is not None and self.think_markers is not None:
                    reasoning = ReasoningSplitter(self.think_markers, thinking=job.thinking)
                stops = StopText(self.tokenizer.detokenizer, job.stops, job.quiet_stops, reasoning)
                runs.append(Run(generation, stops, self._budget_of(job, index)))
        except BaseException:
            for run in runs:
                await run.cancel()
            raise
        return runs

    def _budget_of(self, job: Job, index: int) -> ThinkBudget | None:
        if job.think_budget is None or self.think_markers is None:
            return None
        request = job.choice_request(index)

        async def resume(generated: tuple[int, ...], max_tokens: int) -> Generation:
            # one generation of its own (never grouped with other choices), its id derived from
            # the choice's, so that its draws are the same on every node
            sampling = replace(request.sampling, max_tokens=max_tokens, choice_group="", choice=0, choices=1)
            return await self.backend.start(GenerationRequest(
                RequestId(f"{request.request_id}.answer"), request.prompt + generated, sampling))

        return ThinkBudget(job.think_budget, job.sampling.max_tokens, self.think_markers.end_tokens, resume)

    def reply(self, job: Job, index: int) -> Reply:
        if not job.tools:
            return Reply(None, "")
        t = self.tokenizer
        return Reply(ToolCallSplitter(t.tool_call_start, t.tool_call_end, t.tool_parser, job.tools),
                      job.choice_request(index).request_id)

    def cached_tokens(self, runs: Sequence[Run]) -> int | None:
        """The prompt tokens choice 0's prefill took from a prefix cache (the prompt is counted
        once, as usage counts it); None unless prompt tokens details are on."""
        return runs[0].first_generation.cached_tokens if self.prompt_tokens_details else None

    def logprobs_format(self, job: Job) -> LogprobsFormat:
        return LogprobsFormat(self.tokenizer, job.kind is Kind.CHAT, job.sampling.logprobs)
