"""Server-sent events as every API of the front end frames them: one JSON encoding for every
body and event, `data:` events (OpenAI's chat and completions) and named ones (Anthropic's
Messages, OpenAI's Responses), a per-choice template for the chat's text chunks, and the
text/event-stream response that sends events the moment they are made and cancels the
generation when the client leaves. An adapter: it imports nothing of the front end but
`adapters.http.streaming`; nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass

from adapters.http.streaming import WatchedStream

__all__ = ["EVENTS_PER_WRITE", "TEXT_MARK", "TextEvent", "data_event", "dumps", "event_stream", "named_event"]


def dumps(obj: object) -> str:
    """The one JSON encoding of every body and event (Starlette's JSONResponse's settings)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def data_event(obj: object) -> bytes:
    """One server-sent event: `data: <json or [DONE]>` and a blank line (JSON has no raw newline)."""
    return b"data: " + (obj if isinstance(obj, str) else dumps(obj)).encode() + b"\n\n"



def named_event(event: str, data: object) -> bytes:
    """One server-sent event with its name (Messages' and Responses' events); JSON has no raw newline."""
    return f"event: {event}\ndata: {dumps(data)}\n\n".encode()



# What `dumps` writes for a string (json.dumps' own encoder with ensure_ascii=False): quotes,
# backslashes and control characters escaped, everything else as it is.
_json_string: Callable[[str], str] = json.encoder.encode_basestring
TEXT_MARK = "\ue000text\ue001"  # stands in for the text when a template is made


@dataclass(frozen=True, slots=True)
class TextEvent:
    """A template of one choice's text chunk event: its bytes before and after the text. A
    stream's text chunks differ only in the text, so their JSON is made once per choice; `of`
    gives exactly the bytes `data_event` would for the chunk with that text."""

    head: bytes
    tail: bytes

    @classmethod
    def around(cls, event: bytes) -> TextEvent | None:
        """The template of `event`, a chunk whose text is `TEXT_MARK`; None unless the mark is
        in it exactly once (a model name could hold it too)."""
        mark = _json_string(TEXT_MARK).encode()
        head, found, tail = event.partition(mark)
        if not found or mark in tail:
            return None
        return cls(head, tail)

    def of(self, text: str) -> bytes:
        return self.head + _json_string(text).encode() + self.tail


# A stream sends the events it has made in one body write (one ASGI message) before it waits
# for the backend, or once this many are waiting.
EVENTS_PER_WRITE = 64


def event_stream(events: AsyncGenerator[bytes, None], headers: Mapping[str, str],
                  on_close: Callable[[], Awaitable[None]]) -> WatchedStream:
    """A text/event-stream response whose events go out the moment they are made."""
    return WatchedStream(events, media_type="text/event-stream", on_close=on_close,
                         headers={**headers, "Cache-Control": "no-store", "X-Accel-Buffering": "no"})
