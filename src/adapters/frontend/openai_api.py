"""OpenAI's routes and answers: `POST /v1/completions`, `POST /v1/chat/completions` (streaming as
server-sent events, or not), `GET /v1/models`, `GET /v1/models/{id}` and `GET /health` (200 only
while `backend.ready()`). What the API accepts and how it answers is `docs/api.md`'s; the bodies
are `openai_bodies`, the job `frontend.Job`, the generation `generation`.

A streaming response waits for every choice's first step (or the end) before it sends its
headers, so that a failure before any output still gets its own HTTP status; later failures
become an SSE event `data: {"error": {...}}` followed by `data: [DONE]`. A client that goes away
(streaming or not) cancels its generation. The answers: the whole body, and the server-sent
events of a stream (each choice's chunks in turn, its finish chunk as it ends, usage after the
last, `data: [DONE]`). Text chunks without logprobs come from a template per choice
(`adapters.http.streaming.TextEvent`), so a stream behind its tokens costs one JSON encoding per
choice. An adapter: nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from adapters.frontend.frontend import Frontend, Job, Kind, request_id_of
from adapters.frontend.generation import Finish, Run, Step
from adapters.frontend.intake import (
    REQUEST_ID_HEADER,
    Reject,
    error_response,
    unless_body_unread,
)
from adapters.http.streaming import (
    EVENTS_PER_WRITE,
    TEXT_MARK,
    TextEvent,
    cancel_on_disconnect,
    data_event,
    event_stream,
)
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, bug
from statecore.events import TokenLogprobs

__all__ = ["OpenAiApi", "chat_body", "chunk", "stream_events", "text_event"]

logger = logging.getLogger(__name__)


class OpenAiApi:
    """OpenAI's endpoints over a `Frontend`."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def health(self, request: Request) -> Response:
        details = {"warnings": self.frontend.warnings} if self.frontend.warnings else {}
        if self.frontend.backend.ready():
            return JSONResponse({"status": "ok", **details})
        return JSONResponse({"status": "unavailable", **details}, status_code=503)

    def _card(self) -> dict[str, object]:
        return {"id": self.frontend.model_name, "object": "model", "created": self.frontend.created,
                "owned_by": "statecore"}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        """`GET /v1/models/{id}` (an id may hold slashes: `mlx-community/...`)."""
        if request.path_params["model_id"] != self.frontend.model_name:
            return error_response(ErrorInfo(Fault.CLIENT, Code.MODEL_NOT_FOUND,
                                            f"the model {request.path_params['model_id']!r} does not exist; "
                                            f"this server serves {self.frontend.model_name!r}", "model"))
        return JSONResponse(self._card())

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, Kind.COMPLETION)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, Kind.CHAT)

    async def _serve(self, request: Request, kind: Kind) -> Response:
        request_id, bad = request_id_of(request)
        if bad is not None:
            return error_response(bad, request_id)
        try:
            job = await self.frontend.prepare(request, kind, request_id)
            runs = await self.frontend.start(job)
        except Reject as exc:
            return unless_body_unread(request, error_response(exc.info, request_id))
        except StatecoreError as exc:
            return unless_body_unread(request, error_response(exc.info, request_id))
        except ClientDisconnect:
            return Response(status_code=499, headers={REQUEST_ID_HEADER: request_id})
        except Exception:
            logger.exception("request %s: unexpected error before generation", request_id)
            return unless_body_unread(
                request, error_response(bug("internal error while starting the request"), request_id))
        async def cancel_all() -> None:
            for run in runs:
                await run.cancel()

        try:
            return await self._respond(request, job, runs, cancel_all)
        except Exception:
            logger.exception("request %s: unexpected error", request_id)
            await cancel_all()
            return error_response(bug("internal error while generating"), request_id)
        except BaseException:  # cancelled from outside (server shutdown): free the backend too
            await cancel_all()
            raise

    async def _respond(self, request: Request, job: Job, runs: list[Run],
                       cancel_all: Callable[[], Awaitable[None]]) -> Response:
        """Read the choices in turn, one step each (a fixed order: the same bytes on every node,
        while the backend computes them side by side). A stream starts once every choice has its
        first step; a failure before then, or anywhere in a whole body, is the response's status."""
        headers = {REQUEST_ID_HEADER: job.request_id}
        texts: list[list[str]] = [[] for _ in runs]
        reasonings: list[list[str]] = [[] for _ in runs]
        logprobs: list[list[tuple[int, TokenLogprobs]]] = [[] for _ in runs]
        steps: list[Step] = [Step("") for _ in runs]
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
            return error_response(failed, job.request_id)
        if job.stream:
            return event_stream(stream_events(self.frontend, job, runs, steps), headers, cancel_all)
        finishes: list[Finish] = []
        for index, step in enumerate(steps):
            assert isinstance(step.end, Finish)
            texts[index].append(step.text)
            reasonings[index].append(step.reasoning)
            logprobs[index].extend(step.logprobs)
            finishes.append(step.end)
        body = chat_body(self.frontend, job, ["".join(t) for t in texts], finishes, logprobs,
                         self.frontend.cached_tokens(runs), ["".join(r) for r in reasonings],
                         sum(run.reasoning_tokens for run in runs))
        return JSONResponse(body, headers=headers)


# ---------------------------------------------------------------------------------------------
# The answers


def _head(job: Job, model: str, object_name: str) -> dict[str, Any]:
    return {
        "id": job.response_id,
        "object": object_name,
        "created": job.created,
        "model": model,
    }


def chat_body(frontend: Frontend, job: Job, texts: list[str], finishes: list[Finish],
          logprobs: list[list[tuple[int, TokenLogprobs]]], cached_tokens: int | None,
          reasonings: list[str], reasoning_tokens: int) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    for index, (text, finish) in enumerate(zip(texts, finishes, strict=True)):
        choice: dict[str, Any] = {"index": index}
        reply = frontend.reply(job, index)
        pieces = [reply.add(text), reply.close()]
        content = "".join(piece for piece, _ in pieces)
        calls = [call for _, found in pieces for _, call in found]
        if job.kind is Kind.CHAT:
            choice["message"] = {"role": "assistant", "content": content or (None if calls else "")}
            if job.thinking is not None:
                choice["message"].update(reasoning_delta(reasonings[index] or None))
            if calls:
                choice["message"]["tool_calls"] = calls
        else:
            choice["text"] = content
        choice["logprobs"] = frontend.logprobs_format(job).of(logprobs[index])
        choice["finish_reason"] = reply.finish_reason(finish.reason)
        choices.append(choice)
    return {
        **_head(job, frontend.model_name, job.kind.value),
        "choices": choices,
        "usage": job.usage(sum(finish.completion_tokens for finish in finishes), cached_tokens,
                           reasoning_tokens),
    }

def reasoning_delta(reasoning: str | None) -> dict[str, Any]:
    """The thinking under both names clients read: `reasoning_content` (vLLM's, DeepSeek's)
    and `reasoning` (mlx_lm.server's)."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}


def chunk(
    job: Job, model: str, content: str | dict[str, Any] | None, finish: str | None = None, *, index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk of choice `index`: `content` is text, a chat delta, or None for its
    final chunk."""
    choice: dict[str, Any] = {"index": index}
    if job.kind is Kind.CHAT:
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
    made = {**_head(job, model, object_name), "choices": [choice]}
    if job.include_usage:
        made["usage"] = None
    return made

def text_event(job: Job, model: str, index: int) -> Callable[[str], bytes]:
    """The event of choice `index`'s chunk of some text without logprobs: from a template
    made here (the bytes `data_event(chunk(job, model, text, index=index))` would be)."""
    template = TextEvent.around(data_event(chunk(job, model, TEXT_MARK, index=index)))
    if template is not None:
        return template.of
    return lambda text: data_event(chunk(job, model, text, index=index))

def _usage_chunk(job: Job, model: str, completion_tokens: int, cached_tokens: int | None,
                 reasoning_tokens: int) -> dict[str, Any]:
    object_name = "chat.completion.chunk" if job.kind is Kind.CHAT else "text_completion"
    return {**_head(job, model, object_name), "choices": [],
            "usage": job.usage(completion_tokens, cached_tokens, reasoning_tokens)}


async def stream_events(frontend: Frontend, job: Job, runs: list[Run], first_steps: list[Step]
                  ) -> AsyncGenerator[bytes, None]:
    """The SSE stream of started generations, from their first steps on: each choice's steps
    in turn, its own finish chunk as it ends; usage (all choices) after the last.

    Each item is one body write: the events made since the last one. A choice whose next
    step needs outputs that are not there yet sends what is made before it waits, so
    nothing is held back while the backend works; steps whose outputs are already waiting
    (a stream behind its tokens) go out together, a write per `EVENTS_PER_WRITE` events.
    Text chunks without logprobs come from a template per choice (`text_event`)."""
    model = frontend.model_name
    pending: list[Step | None] = list(first_steps)
    completion_tokens = 0
    frames: list[bytes] = []
    try:
        replies = [frontend.reply(job, index) for index in range(len(runs))]
        formats = [frontend.logprobs_format(job) for _ in runs]
        text_events = [text_event(job, model, index) for index in range(len(runs))]
        if job.kind is Kind.CHAT:
            for index in range(len(runs)):
                opening = {"role": "assistant", "content": ""}
                frames.append(data_event(chunk(job, model, opening, index=index)))
        failed: ErrorInfo | None = None
        open_choices = list(range(len(runs)))
        while open_choices and failed is None:
            for index in list(open_choices):
                step = pending[index]
                pending[index] = None
                if step is None:
                    if len(frames) >= EVENTS_PER_WRITE:
                        yield b"".join(frames)
                        frames = []
                    step = await _stream_step(job, runs[index], wait=False)
                    if step is None:
                        if frames:
                            yield b"".join(frames)
                            frames = []
                        step = await _stream_step(job, runs[index], wait=True)
                assert step is not None
                reply = replies[index]
                pieces = [reply.add(step.text)]
                if isinstance(step.end, Finish):
                    pieces.append(reply.close())
                unsent = formats[index].of(step.logprobs)  # goes with this step's first chunk
                if step.reasoning:
                    frames.append(data_event(chunk(job, model, reasoning_delta(step.reasoning),
                                                     index=index, logprobs=unsent)))
                    unsent = None
                for text, calls in pieces:
                    if text:
                        if unsent is None:
                            frames.append(text_events[index](text))
                        else:
                            frames.append(data_event(chunk(job, model, text, index=index, logprobs=unsent)))
                        unsent = None
                    if calls:
                        frames.append(data_event(chunk(job, model, {"tool_calls": [
                            {"index": number, **call} for number, call in calls]}, index=index)))
                if unsent is not None and step.logprobs:  # tokens whose text is held back
                    frames.append(data_event(chunk(job, model, "", index=index, logprobs=unsent)))
                if isinstance(step.end, Finish):
                    reason = reply.finish_reason(step.end.reason)
                    frames.append(data_event(chunk(job, model, None, reason, index=index)))
                    completion_tokens += step.end.completion_tokens
                    open_choices.remove(index)
                elif isinstance(step.end, ErrorInfo):
                    failed = step.end
                    break
        if failed is not None:
            frames.append(data_event(failed.to_openai()))
        elif job.include_usage:
            frames.append(data_event(_usage_chunk(job, model, completion_tokens, frontend.cached_tokens(runs),
                                                   sum(run.reasoning_tokens for run in runs))))
        frames.append(data_event("[DONE]"))
        yield b"".join(frames)
    finally:
        # Done, failed, or the client went away (cancelled or closed at a yield): free the backend.
        for run in runs:
            await run.cancel()

async def _stream_step(job: Job, run: Run, *, wait: bool) -> Step | None:
    """`run`'s next step (None: not without waiting, when `wait` is False); an unexpected
    error is the step's failure."""
    try:
        return await run.advance() if wait else await run.advance_ready()
    except Exception:
        logger.exception("request %s: unexpected error while streaming", job.request_id)
        return Step("", bug("internal error while generating"))

