"""Reading a request of the public API, for every API alike: the body within its size limit, as
a JSON object, labelled as JSON; the request id (`X-Request-Id`); pydantic's validation errors as
one 400 naming the fields as the client wrote them; and an error as an answer (its status, the
`Retry-After` of a 429 or 503, `Connection: close` when the body was left unread).

`Reject` is how an answer decided while reading travels up to the endpoint. An adapter: it
imports starlette and pydantic and no other module of the front end; nothing in `statecore` or
`effects` may import it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from statecore.errors import Code, ErrorInfo, Fault, client_error
from statecore.ids import RequestId

__all__ = ["REQUEST_ID_HEADER", "RETRY_AFTER_S", "Exact", "Reject", "Strict", "check_model", "error_response",
           "neutral", "parsed", "read_object", "request_id_of", "unless_body_unread", "validation_error"]

REQUEST_ID_HEADER = "X-Request-Id"
RETRY_AFTER_S = 1
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
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


# What a JSON body may be labelled: JSON itself, nothing, or curl's default for `-d`
# (application/x-www-form-urlencoded), which many a `curl -d '{...}'` sends without meaning it.
_JSON_MEDIA_TYPES = ("application/json", "application/x-www-form-urlencoded")


def _check_media_type(content_type: str | None) -> None:
    """Refuse a body labelled as something other than JSON (text/plain, multipart/form-data, ...)
    with 415, rather than read it as JSON anyway."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media and media not in _JSON_MEDIA_TYPES and not media.endswith("+json"):
        raise Reject(ErrorInfo(Fault.CLIENT, Code.UNSUPPORTED_MEDIA_TYPE,
                               f"the request body is labelled {media}: send JSON with "
                               "'Content-Type: application/json'"))


async def _read_body(request: Request, max_body_bytes: int) -> bytes:
    too_large = ErrorInfo(Fault.CLIENT, Code.BODY_TOO_LARGE,
                          f"the request body exceeds {max_body_bytes} bytes")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise Reject(too_large)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise Reject(too_large)
        chunks.append(chunk)
    request.state.body_read = True
    return b"".join(chunks)


async def read_object(request: Request, max_body_bytes: int) -> dict[str, object]:
    """The body as a JSON object (within `max_body_bytes`)."""
    _check_media_type(request.headers.get("content-type"))
    raw = await _read_body(request, max_body_bytes)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise Reject(client_error(f"the request body is not valid JSON: {exc}", Code.INVALID_JSON)) from None
    if not isinstance(data, dict):
        raise Reject(client_error("the request body must be a JSON object"))
    return data


def check_model(model: str | None, served: str) -> None:
    """A body's `model` names the one model this server serves, or nothing."""
    if model is not None and model != served:
        raise Reject(ErrorInfo(Fault.CLIENT, Code.MODEL_NOT_FOUND, f"the model {model!r} does not "
                               f"exist; this server serves {served!r}", "model"))


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


def request_id_of(request: Request) -> tuple[RequestId, ErrorInfo | None]:
    """The request's id: its `X-Request-Id` header, else a fresh one (also when the header is bad,
    which the error says)."""
    incoming = request.headers.get(REQUEST_ID_HEADER)
    if incoming is not None and not _REQUEST_ID_RE.fullmatch(incoming):
        info = client_error(f"{REQUEST_ID_HEADER} must be 1 to 128 characters of A-Z a-z 0-9 . _ -")
        return RequestId(uuid.uuid4().hex), info
    return RequestId(incoming if incoming is not None else uuid.uuid4().hex), None
