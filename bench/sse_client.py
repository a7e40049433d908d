"""Reading a streaming OpenAI-compatible `/v1/completions` response (server-sent events).

Shared by the load generators (serve_bench, mixed_load): each keeps its own per-chunk timing and
bookkeeping and leaves the HTTP status, the `data:` lines, `[DONE]` and error documents to
`completion_stream`. Bench code: it may import anything, and nothing under src/ may import it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx

__all__ = ["CompletionStreamError", "completion_stream"]


class CompletionStreamError(Exception):
    """The server refused a streaming completion (a non-200 status) or sent an `error` document."""


async def completion_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: Mapping[str, str] | None = None
) -> AsyncIterator[tuple[list[str], dict[str, Any] | None]]:
    """POST a streaming `/v1/completions` and yield, per `data:` document up to `[DONE]`, its
    non-empty choice texts and its `usage` (None when absent). Raises CompletionStreamError with
    a short message for a non-200 status or an error document; transport errors and bad JSON
    propagate as httpx / json exceptions. `headers`: extra request headers (e.g. X-Request-Id, so
    that the nodes' records can be joined with the client's timings)."""
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:200]
            raise CompletionStreamError(f"HTTP {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            doc = json.loads(data)
            if "error" in doc:
                raise CompletionStreamError(f"stream error: {json.dumps(doc['error'])[:200]}")
            texts = [text for choice in doc.get("choices") or [] if (text := choice.get("text") or "")]
            yield texts, doc.get("usage") or None
