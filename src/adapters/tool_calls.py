"""Tool calls in a chat reply: the text between the model's tool-call markers (the tokenizer's
`tool_call_start` / `tool_call_end`, found by mlx-lm from the chat template) is a call, parsed by
mlx-lm's parser for that model; all other text is the reply's content. Text arrives piece by
piece, so a marker split across pieces is held back until it is known. A call that does not
parse stays in the content, markers and all (nothing the model wrote is dropped). Pure text
handling: never imports starlette, trio or MLX.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ToolCall", "ToolCallSplitter", "partial_marker"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (0 when none does)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class ToolCallSplitter:
    """`feed(text)` and then `close()` each return (content to send now, calls completed now)."""

    def __init__(self, start: str, end: str, parse: Callable[[str, Any], Any],
                 tools: Sequence[Mapping[str, Any]]) -> None:
        self._start, self._end, self._parse, self._tools = start, end, parse, list(tools)
        self._pending = ""
        self._in_call = False
        self.made_calls = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_call:
                at = self._pending.find(self._end)
                if at < 0:
                    break
                self._finish_call(self._pending[:at], content, calls, closed=True)
                self._pending = self._pending[at + len(self._end):]
                self._in_call = False
            else:
                at = self._pending.find(self._start)
                if at < 0:
                    keep = partial_marker(self._pending, self._start)
                    content.append(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                content.append(self._pending[:at])
                self._pending = self._pending[at + len(self._start):]
                self._in_call = True
        return "".join(content), calls

    def close(self) -> tuple[str, list[ToolCall]]:
        """The end of the reply: a call left open is parsed as it stands (the reply may have
        stopped right before its end marker), held-back text is content."""
        content: list[str] = []
        calls: list[ToolCall] = []
        if self._in_call:
            self._finish_call(self._pending, content, calls, closed=False)
        else:
            content.append(self._pending)
        self._pending, self._in_call = "", False
        return "".join(content), calls

    def _finish_call(self, text: str, content: list[str], calls: list[ToolCall], *, closed: bool) -> None:
        try:
            parsed = self._parse(text, self._tools)
            found = [_call(item) for item in (parsed if isinstance(parsed, list) else [parsed])]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("a tool call did not parse (%s: %s); it stays in the content",
                           type(exc).__name__, exc)
            content.append(self._start + text + (self._end if closed else ""))
            return
        calls.extend(found)
        self.made_calls = self.made_calls or bool(found)


def _call(parsed: Any) -> ToolCall:
    name = parsed["name"]
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tool call needs a name, got {name!r}")
    arguments = parsed.get("arguments", {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name, text)
