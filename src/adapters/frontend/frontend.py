"""The front end's shared core, one per node over one `Backend`: the tokenizer and model name,
the body limit, and the two verbs every API of the public surface uses, `prepare` (read and
validate a chat or completion body into a `Job`) and `start` (start each choice's generation as
a `Run`), plus `start_chat` / `count_chat` for the APIs served as a chat (Messages, Responses).

Both the single node and the router serve through it: on a single node the backend is the local
engine, on the router it is prefill and decode peers. The backend only ever yields token ids;
everything a client sees is made by the front end, so the output through the cluster is
byte-identical to a single node's by construction. The routes and their answers live in the
per-API modules (`openai_api`, `tokenize_api`, `messages_api`, `responses_api`) and `app`
assembles them. An adapter: it imports nothing of the per-API modules (they import it);
nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from adapters.frontend import intake
from adapters.frontend.chat_run import ChatRun
from adapters.frontend.generation import LogprobsFormat, Reply, Run, StopText, ThinkBudget
from adapters.frontend.intake import (
    REQUEST_ID_HEADER,
    Reject,
    error_response,
    request_id_of,
    unless_body_unread,
    validation_error,
)
from adapters.frontend.jobs import Job, Kind, job_of
from adapters.frontend.openai_bodies import ChatBody, CompletionBody, TemplateValue, check_unsupported
from adapters.frontend.prompts import Prompts
from adapters.reasoning import ReasoningSplitter, ThinkMarkers
from adapters.tool_calls import ToolCallSplitter
from effects.faults import Faults, Phase
from effects.ports import Backend, Generation, GenerationRequest
from statecore.errors import ErrorInfo, StatecoreError, bug
from statecore.ids import RequestId

__all__ = ["Frontend"]

logger = logging.getLogger(__name__)

_Parsed = TypeVar("_Parsed")


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
        """The body as a JSON object (within `max_body_bytes`)."""
        return await intake.read_object(request, self.max_body_bytes)

    def check_model(self, model: str | None) -> None:
        intake.check_model(model, self.model_name)

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

    # -- for the other APIs ------------------------------------------------------------------

    async def start_chat(
        self,
        request: Request,
        parse: Callable[[dict[str, object]], tuple[dict[str, object], _Parsed]],
        error_body: Callable[[ErrorInfo], object],
        think_budget: Callable[[_Parsed], int | None] = lambda _: None,
    ) -> tuple[ChatRun, _Parsed] | Response:
        """Start another API's request (`messages_api`, `responses_api`) as the /v1/chat/completions body that
        `parse` maps its JSON body to, with whatever else `parse` keeps of it. Everything but the
        shapes is the chat's: request id, body limit, validation, template, stop strings, admission,
        backend. `parse` may raise pydantic's ValidationError or StatecoreError; a refusal comes
        back as the answer to send, its body `error_body(info)`. `think_budget` reads the cap on the
        thinking (Anthropic's `budget_tokens`) from what `parse` kept, when the API has one."""
        request_id, bad = request_id_of(request)
        try:
            if bad is not None:
                raise Reject(bad)
            try:
                chat, parsed = parse(await self.read_object(request))
            except ValidationError as exc:
                raise Reject(validation_error(exc)) from None
            job = await self.prepare(request, Kind.CHAT, request_id, chat, think_budget(parsed))
            [run] = await self.start(job)
        except (Reject, StatecoreError) as exc:
            return unless_body_unread(request, error_response(exc.info, request_id, error_body(exc.info)))
        except ClientDisconnect:
            return Response(status_code=499, headers={REQUEST_ID_HEADER: request_id})
        except Exception:
            logger.exception("request %s: unexpected error before generation", request_id)
            info = bug("internal error while starting the request")
            return unless_body_unread(request, error_response(info, request_id, error_body(info)))
        return ChatRun(job, run, self.reply(job, 0), self.logprobs_format(job), error_body,
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
                chat, _ = parse(await self.read_object(request))
                body = ChatBody.model_validate(chat)
            except ValidationError as exc:
                raise Reject(validation_error(exc)) from None
            self.check_model(body.model)
            return len(await self.prompts.encode_chat(
                body.messages, self.prompts.tools(body),
                self.prompts.template_kwargs(body.chat_template_kwargs, body.reasoning_effort)))
        except (Reject, StatecoreError) as exc:
            return unless_body_unread(request, error_response(exc.info, body=error_body(exc.info)))
        except ClientDisconnect:
            return Response(status_code=499)
