"""One choice of a chat as the APIs served as chats (Messages, Responses) read it: how such a
request starts (`start_chat`: mapped onto the /v1/chat/completions body it means, then prepared
and started as a chat by the `Frontend`) or is counted (`count_chat`), its text steps with the
tool calls split off and the logprobs shaped as the chat's, how it ended, and its answers (an
error in the API's own shape, an SSE response that cancels the generation when the client
leaves). The caller only shapes the answer. An adapter: it imports the front end's core and the
generation driver; nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from adapters.frontend.frontend import Frontend, Job, Kind, request_id_of
from adapters.frontend.generation import Finish, LogprobsFormat, Reply, Run
from adapters.frontend.intake import (
    REQUEST_ID_HEADER,
    Reject,
    error_response,
    unless_body_unread,
    validation_error,
)
from adapters.frontend.openai_bodies import ChatBody
from adapters.http.streaming import event_stream
from statecore.errors import ErrorInfo, StatecoreError, bug

__all__ = ["CalledTool", "ChatEnd", "ChatRun", "ChatStep", "count_chat", "start_chat"]

logger = logging.getLogger(__name__)

_Parsed = TypeVar("_Parsed")


@dataclass(frozen=True, slots=True)
class ChatEnd:
    """How a chat started by `start_chat` ended."""

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
    """One generation of a chat started by `start_chat`: its text comes out as
    /v1/chat/completions sends it (stop strings applied, tool calls split off when the chat
    offered tools); the caller only shapes the answer."""

    def __init__(self, job: Job, run: Run, reply: Reply, logprobs: LogprobsFormat,
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
        if isinstance(step.end, Finish):
            pieces.append(self._reply.close())
        text = "".join(piece for piece, _ in pieces)
        calls = tuple(CalledTool(call["id"], call["function"]["name"], call["function"]["arguments"])
                      for _, found in pieces for _, call in found)
        shaped = self._logprobs.of(step.logprobs) if step.logprobs else None
        logprobs = tuple(shaped["content"]) if shaped is not None else ()
        if isinstance(step.end, Finish):
            end = ChatEnd(self._reply.finish_reason(step.end.reason), step.end.completion_tokens,
                          self._run.matched_stop, self._run.reasoning_tokens)
            return ChatStep(text, calls, end, logprobs, step.reasoning)
        return ChatStep(text, calls, step.end, logprobs, step.reasoning)

    async def cancel(self) -> None:
        """Free the backend (shielded, bounded; nothing if it is done already)."""
        await self._run.cancel()

    def error_response(self, info: ErrorInfo) -> Response:
        """`info` with its status and headers, in the caller's error shape."""
        return error_response(info, self.request_id, self._error_body(info))

    def event_stream(self, events: AsyncGenerator[bytes, None]) -> Response:
        """An SSE response of `events`, sent as they come; the client leaving cancels the generation."""
        return event_stream(events, self.headers, self.cancel)


# ---------------------------------------------------------------------------------------------


async def start_chat(
    frontend: Frontend,
    request: Request,
    parse: Callable[[dict[str, object]], tuple[dict[str, object], _Parsed]],
    error_body: Callable[[ErrorInfo], object],
    think_budget: Callable[[_Parsed], int | None] = lambda _: None,
) -> tuple[ChatRun, _Parsed] | Response:
    """Start another API's request (`messages_api`, `responses_api`) as the /v1/chat/completions
    body that `parse` maps its JSON body to, with whatever else `parse` keeps of it. Everything
    but the shapes is the chat's: request id, body limit, validation, template, stop strings,
    admission, backend. `parse` may raise pydantic's ValidationError or StatecoreError; a refusal
    comes back as the answer to send, its body `error_body(info)`. `think_budget` reads the cap on
    the thinking (Anthropic's `budget_tokens`) from what `parse` kept, when the API has one."""
    request_id, bad = request_id_of(request)
    try:
        if bad is not None:
            raise Reject(bad)
        try:
            chat, parsed = parse(await frontend.read_object(request))
        except ValidationError as exc:
            raise Reject(validation_error(exc)) from None
        job = await frontend.prepare(request, Kind.CHAT, request_id, chat, think_budget(parsed))
        [run] = await frontend.start(job)
    except (Reject, StatecoreError) as exc:
        return unless_body_unread(request, error_response(exc.info, request_id, error_body(exc.info)))
    except ClientDisconnect:
        return Response(status_code=499, headers={REQUEST_ID_HEADER: request_id})
    except Exception:
        logger.exception("request %s: unexpected error before generation", request_id)
        info = bug("internal error while starting the request")
        return unless_body_unread(request, error_response(info, request_id, error_body(info)))
    return ChatRun(job, run, frontend.reply(job, 0), frontend.logprobs_format(job), error_body,
                   details=frontend.prompt_tokens_details), parsed


async def count_chat(
    frontend: Frontend,
    request: Request,
    parse: Callable[[dict[str, object]], tuple[dict[str, object], _Parsed]],
    error_body: Callable[[ErrorInfo], object],
) -> int | Response:
    """How many prompt tokens another API's body is, mapped by `parse` to a chat body as
    `start_chat` maps it (template, tools), without generating; or the refusal to send."""
    try:
        try:
            chat, _ = parse(await frontend.read_object(request))
            body = ChatBody.model_validate(chat)
        except ValidationError as exc:
            raise Reject(validation_error(exc)) from None
        frontend.check_model(body.model)
        prompts = frontend.prompts
        return len(await prompts.encode_chat(
            body.messages, prompts.tools(body),
            prompts.template_kwargs(body.chat_template_kwargs, body.reasoning_effort)))
    except (Reject, StatecoreError) as exc:
        return unless_body_unread(request, error_response(exc.info, body=error_body(exc.info)))
    except ClientDisconnect:
        return Response(status_code=499)
