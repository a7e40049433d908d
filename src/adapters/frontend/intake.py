"""How the public API refuses a request, for every API alike: the strict bodies (`Strict`,
`Exact`), `Reject` (how an answer decided while reading travels up to the endpoint), pydantic's
validation errors as one 400 naming the fields as the client wrote them, and an error as an answer
(its status, the request id, the `Retry-After` of a 429 or 503, `Connection: close` when the body
was left unread). Reading a request (its body, its id) is the `Frontend`'s. An adapter: it imports
starlette and pydantic and no other module of the front end; nothing in `statecore` or `effects`
may import it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from statecore.errors import Code, ErrorInfo, Fault

__all__ = ["REQUEST_ID_HEADER", "RETRY_AFTER_S", "Exact", "Reject", "Strict", "error_response", "neutral",
           "parsed", "unless_body_unread", "validation_error"]

REQUEST_ID_HEADER = "X-Request-Id"
RETRY_AFTER_S = 1
_MAX_ERRORS_SHOWN = 3


class Strict(BaseModel):
    """No coercion ("5" is not a number, true is not 1), unknown fields ignored (as vLLM does)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

class Exact(BaseModel):
    """Strict like the generation bodies, and an unknown field is refused: these bodies are small
    and new, so a misspelt field would only ever have been a mistake."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class Reject(Exception):
    """An error answer decided while reading a request (internal control flow)."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


def _same(value: object, neutral: object) -> bool:
    return type(value) is type(neutral) and value == neutral


def neutral(*values: object) -> Callable[[object], bool]:
    return lambda value: value is None or any(_same(value, v) for v in values)


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


def validation_error(exc: ValidationError) -> ErrorInfo:
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


_Body = TypeVar("_Body", bound=BaseModel)


def parsed(schema: type[_Body], data: Mapping[str, object]) -> _Body:
    """`data` validated by `schema`; a refusal is a `Reject` naming the fields at fault."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise Reject(validation_error(exc)) from None


def unless_body_unread(request: Request, response: Response) -> Response:
    """An answer given before the request's body was read whole (too large, a fault at intake)
    closes the connection: the unread rest would otherwise be taken for the next request, and
    the server drops it anyway; `Connection: close` tells a keep-alive client so."""
    if not getattr(request.state, "body_read", False):
        response.headers["Connection"] = "close"
    return response


def error_response(info: ErrorInfo, request_id: str | None = None, body: object = None) -> JSONResponse:
    """`info` as an answer: its status, OpenAI's shape unless `body` is given (another API's)."""
    headers = {REQUEST_ID_HEADER: request_id} if request_id is not None else {}
    if info.http_status in (429, 503):  # overloaded or draining: tell the client when to retry
        headers["Retry-After"] = str(RETRY_AFTER_S)
    return JSONResponse(info.to_openai() if body is None else body, status_code=info.http_status,
                        headers=headers or None)
