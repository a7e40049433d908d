"""What the APIs served as a chat (Anthropic's Messages, OpenAI's Responses) share: refusing what
they do not serve yet, naming the chat's fields as their own clients wrote them, mapping content
onto the chat's, telling a union's branches apart by `type`, and answering as
/v1/chat/completions does (a whole body, or a stream that starts with the first text so that an
early failure keeps its own status). Each request is mapped onto the chat body it means and
started by `chat_run.start_chat`. An adapter: it imports the front end's chat run and nothing of
the per-API modules; nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Annotated, Any, Protocol, Union, get_args

from pydantic import BaseModel, Discriminator, Tag
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from adapters.frontend.chat_run import CalledTool, ChatEnd, ChatRun, ChatStep
from adapters.http.streaming import cancel_on_disconnect
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, bug

__all__ = ["Logprob", "absent", "advance", "answer", "arguments_object", "by_type", "empty", "present",
           "refuse_other_types", "refuse_unsupported", "renamed", "text_parts", "unsupported"]

logger = logging.getLogger(__name__)

Logprob = dict[str, Any]  # an entry of the chat's logprobs.content: {token, logprob, bytes, top_logprobs}


class _Texted(Protocol):
    @property
    def text(self) -> str: ...


def unsupported(message: str, param: str) -> StatecoreError:
    return StatecoreError(ErrorInfo(Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER, message, param))


def refuse_unsupported(data: Mapping[str, object], neutral: Mapping[str, Callable[[object], bool]]) -> None:
    """Parameters that would change the output and are not served: refused unless neutral."""
    names = [name for name, is_neutral in neutral.items() if name in data and not is_neutral(data[name])]
    if names:
        raise unsupported(f"unsupported parameter{'s' if len(names) > 1 else ''}: {', '.join(names)} "
                           "(not served yet on this endpoint)", names[0])


def absent(value: object) -> bool:
    return value is None


def empty(value: object) -> bool:
    return value is None or (isinstance(value, list | dict) and not value)


def refuse_other_types(where: str, items: object, allowed: tuple[str, ...], what: str,
                        default: str | None = None) -> None:
    """An entry of the list `items` whose `type` (else `default`) is not `allowed` (images, tool
    calls, ...) is refused with its place; a missing or non-string type is left to validation."""
    if not isinstance(items, list):
        return
    for index, item in enumerate(items):
        kind = item.get("type", default) if isinstance(item, dict) else None
        if isinstance(kind, str) and kind not in allowed:
            raise unsupported(f"{where}[{index}]: {what} of type {kind!r} are not served yet "
                               f"(only {' and '.join(allowed)})", f"{where}[{index}]")


def renamed(info: ErrorInfo, names: Mapping[str, str]) -> ErrorInfo:
    """An error about the mapped chat, naming its fields as this API's client wrote them."""
    message, param = info.message, info.param
    for chat_name, own in names.items():
        message = re.sub(rf"\b{chat_name}(?=: | is )", own, message)
        if param is not None and re.match(rf"{chat_name}\b", param):
            param = own + param[len(chat_name):]
    return replace(info, message=message, param=param)


def present(**fields: object) -> dict[str, object]:
    """The fields that are given (not None)."""
    return {name: value for name, value in fields.items() if value is not None}


def text_parts(content: str | Sequence[_Texted]) -> str | list[dict[str, str]]:
    """Content as the chat takes it: a string, or text parts (which its template joins with newlines)."""
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part.text} for part in content]


async def advance(run: ChatRun) -> ChatStep:
    """The run's next step; an unexpected error is the step's failure."""
    try:
        return await run.advance()
    except Exception:
        logger.exception("request %s: unexpected error while generating", run.request_id)
        return ChatStep("", (), bug("internal error while generating"))


async def answer(request: Request, run: ChatRun, *, stream: bool,
                  body: Callable[[str, Sequence[CalledTool], ChatEnd, Sequence[Logprob], str], object],
                  events: Callable[[ChatStep], AsyncGenerator[bytes, None]]) -> Response:
    """As /v1/chat/completions answers: a whole body (with every token's logprobs, when the chat
    asked for them; the model's thinking apart), or a stream that starts with the first text
    (or the end), so that a failure
    before any output still gets its own status; the client going away before then cancels the
    generation."""
    steps: list[ChatStep] = []
    try:
        async with cancel_on_disconnect(request.receive) as watch:
            steps.append(await advance(run))
            while not stream and steps[-1].end is None:
                steps.append(await advance(run))
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


def by_type(*models: type[BaseModel]) -> Any:
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


def arguments_object(call: CalledTool) -> dict[str, object]:
    """A call's arguments as the object both APIs' clients expect (text that is not a JSON object
    is kept whole under "arguments")."""
    try:
        parsed = json.loads(call.arguments)
    except ValueError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"arguments": call.arguments}
