"""One choice of a chat as the APIs served as chats (Messages, Responses) read it: its text steps
with the tool calls split off and the logprobs shaped as the chat's, how it ended, and its answers
(an error in the API's own shape, an SSE response that cancels the generation when the client
leaves). The caller only shapes the answer. An adapter: it imports the generation driver and the
job; nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from adapters.frontend.generation import Finish, LogprobsFormat, Reply, Run
from adapters.frontend.intake import REQUEST_ID_HEADER, error_response
from adapters.frontend.jobs import Job
from adapters.http.streaming import event_stream
from statecore.errors import ErrorInfo

__all__ = ["CalledTool", "ChatEnd", "ChatRun", "ChatStep"]


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
