"""OpenAI's routes: `POST /v1/completions`, `POST /v1/chat/completions` (streaming as server-sent
events, or not), `GET /v1/models`, `GET /v1/models/{id}` and `GET /health` (200 only while
`backend.ready()`). What the API accepts and how it answers is `docs/api.md`'s; the bodies are
`openai_bodies`, the job `jobs`, the generation `generation`, the answers `openai_render`.

A streaming response waits for every choice's first step (or the end) before it sends its
headers, so that a failure before any output still gets its own HTTP status; later failures
become an SSE event `data: {"error": {...}}` followed by `data: [DONE]`. A client that goes away
(streaming or not) cancels its generation. An adapter: nothing in `statecore` or `effects` may
import it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from adapters.frontend.frontend import Frontend
from adapters.frontend.generation import Finish, Run, Step
from adapters.frontend.intake import (
    REQUEST_ID_HEADER,
    Reject,
    error_response,
    request_id_of,
    unless_body_unread,
)
from adapters.frontend.jobs import Job, Kind
from adapters.frontend.openai_render import chat_body, stream_events
from adapters.frontend.sse import event_stream
from adapters.http.streaming import cancel_on_disconnect
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, bug
from statecore.events import TokenLogprobs

__all__ = ["OpenAiApi"]

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
