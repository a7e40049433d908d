"""Reasoning in a reply: the text a reasoning model writes between its think markers (the
tokenizer's `think_start` / `think_end`, which mlx-lm finds in the vocabulary: `<think>` and
`</think>` for Qwen3 and DeepSeek-R1, and the like) is its thinking; the rest is its answer.
`ReasoningSplitter` splits a reply's text, piece by piece as it streams, into the two: the
markers are dropped and nothing else is, so the reasoning and the content together are the
generated text without its markers. A marker split across pieces is held back until it is
known. Whether a reply starts inside its thinking (a template that opens the think block in the
generation prompt, as DeepSeek-R1's does) is read from the prompt's tokens by `opens_thinking`,
as mlx_lm.server reads it. Pure text and token handling, beside `adapters.tool_calls` (whose
splitter runs on the content this one leaves): it never imports starlette, trio or MLX.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from adapters.tool_calls import partial_marker

__all__ = ["ReasoningSplitter", "ThinkMarkers", "opens_thinking"]


@dataclass(frozen=True, slots=True)
class ThinkMarkers:
    """A model's think markers, as text and as the token ids the tokenizer encodes them to."""

    start: str
    end: str
    start_tokens: tuple[int, ...]
    end_tokens: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: object) -> ThinkMarkers | None:
        """The markers mlx-lm's `TokenizerWrapper` knows for its model (None: it knows none)."""
        start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
        start_tokens = getattr(tokenizer, "think_start_tokens", None)
        end_tokens = getattr(tokenizer, "think_end_tokens", None)
        if not (isinstance(start, str) and isinstance(end, str) and start and end
                and start_tokens and end_tokens):
            return None
        return cls(start, end, tuple(int(t) for t in start_tokens), tuple(int(t) for t in end_tokens))


def _rfind(tokens: Sequence[int], marker: Sequence[int]) -> int:
    """Where `marker` last occurs in `tokens` (-1: nowhere)."""
    size = len(marker)
    for at in range(len(tokens) - size, -1, -1):
        if tuple(tokens[at:at + size]) == tuple(marker):
            return at
    return -1


def opens_thinking(prompt: Sequence[int], markers: ThinkMarkers) -> bool:
    """Whether the prompt leaves a think block open (its last start marker comes after its last
    end marker), so that the reply begins inside the thinking."""
    start = _rfind(prompt, markers.start_tokens)
    return start >= 0 and start > _rfind(prompt, markers.end_tokens)


class ReasoningSplitter:
    """`feed(text)` and then `close()` each return (reasoning, content) to send now.

    A start marker in the content opens the thinking and an end marker in the thinking closes
    it, wherever they come (a model may think again later in a reply); an end marker in the
    content, or a start marker in the thinking, is text like any other."""

    def __init__(self, markers: ThinkMarkers, *, thinking: bool) -> None:
        self._start, self._end = markers.start, markers.end
        self.thinking = thinking  # inside a think block now
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            marker = self._end if self.thinking else self._start
            into = reasoning if self.thinking else content
            at = self._pending.find(marker)
            if at < 0:
                keep = partial_marker(self._pending, marker)
                into.append(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                return "".join(reasoning), "".join(content)
            into.append(self._pending[:at])
            self._pending = self._pending[at + len(marker):]
            self.thinking = not self.thinking

    def close(self) -> tuple[str, str]:
        """The end of the reply: held-back text is what it was being read as."""
        rest, self._pending = self._pending, ""
        return (rest, "") if self.thinking else ("", rest)
