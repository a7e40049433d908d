"""Speculative decoding's policy, pure: what to draft, how much of it a verify step may check, what
it kept, and when a row stops trying.

Prompt lookup (`NgramIndex`): the draft for a row is what followed the most recent earlier
occurrence of its last n tokens (the longest n from `max_n` down to `min_n` that occurred before),
so a reply that copies from its prompt (code editing, summaries, retrieval answers) is drafted
from the prompt itself. `draft_room`: how many draft tokens a verify step may carry so that it
computes each row's numbers exactly as an ordinary decode step would (a step's row count picks
its matmul kernels; the engine measures at load which counts compute alike, `row_classes`).
`kept_drafts`: a draft token stands while it equals the token the target draws at its position
(greedy: the argmax; seeded: the draw with the (seed, position) key), so a speculating row emits
exactly the tokens it would have emitted one step at a time. `SpeculationPace`: a row whose
drafts keep failing, or that finds none, waits ever longer (up to `MAX_PAUSE` steps) before it
tries again, so a workload that does not repeat itself pays almost nothing.
This module imports only the standard library; never trio, httpx or mlx.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

__all__ = ["MAX_PAUSE", "SPECULATIVE_MODES", "NgramIndex", "SpeculationPace", "draft_room", "kept_drafts",
           "prompt_draft", "row_classes"]

SPECULATIVE_MODES = ("off", "ngram", "draft")
MAX_PAUSE = 16  # the most ordinary steps a row waits between tries


@dataclass(eq=False)
class NgramIndex:
    """A row's tokens so far, with where each n-gram of them last ended (n in min_n..max_n)."""

    max_n: int = 3
    min_n: int = 2
    tokens: list[int] = field(default_factory=list)
    # n -> the n-gram -> the position after its latest occurrence that is not the row's suffix
    _ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    _pending: dict[int, tuple[tuple[int, ...], int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, not {self.min_n}..{self.max_n}")
        seed, self.tokens = self.tokens, []
        # n = min_n - 1 too: whether a draft may follow the next token (`may_draft_next`)
        self._ends = {n: {} for n in range(max(1, self.min_n - 1), self.max_n + 1)}
        self.extend(seed)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n, ends in self._ends.items():
                # The suffix's own gram goes in only once a later token makes it an earlier one.
                pending = self._pending.pop(n, None)
                if pending is not None:
                    ends[pending[0]] = pending[1]
                if end >= n:
                    self._pending[n] = (tuple(self.tokens[end - n : end]), end)

    def may_draft_next(self) -> bool:
        """Whether a draft could follow the row's next token, whatever it is: its last min_n - 1
        tokens occurred before (the next min_n-gram must have). Lets a decode step that does not
        know its row's latest token yet skip reading it back when no draft could follow."""
        short = self.min_n - 1
        return short == 0 or (len(self.tokens) >= short and tuple(self.tokens[-short:]) in self._ends[short])

    def draft(self, count: int) -> list[int]:
        """Up to `count` tokens that followed the latest earlier occurrence of the longest suffix
        n-gram seen before (empty when none was)."""
        if count <= 0:
            return []
        tokens = self.tokens
        for n in range(self.max_n, self.min_n - 1, -1):  # (n = min_n - 1 is kept, never drafted from)
            if len(tokens) < n:
                continue
            start = self._ends[n].get(tuple(tokens[-n:]))
            if start is not None:
                return _what_followed(tokens, start, count)
        return []


def _what_followed(tokens: Sequence[int], start: int, count: int) -> list[int]:
    """`count` tokens from `start` on, the draft of an occurrence ending there: past the row's
    last token the copy goes on into what it has copied (a row that repeats a period drafts whole
    periods)."""
    draft = list(tokens[start : start + count])
    while len(draft) < count:
        draft.append(draft[len(draft) - (len(tokens) - start)])
    return draft


def prompt_draft(tokens: Sequence[int], count: int, max_n: int = 3, min_n: int = 2) -> list[int]:
    """`NgramIndex(max_n, min_n, tokens).draft(count)`, found by searching the tokens once instead
    of indexing every n-gram of them: a prompt's first draft, wanted before its first token (a long
    prompt's index would take tens of ms of Python; the search runs in C)."""
    if count <= 0:
        return []
    width = 4
    if any(not 0 <= token < 2**32 for token in tokens[-max_n:]):
        return NgramIndex(max_n, min_n, list(tokens)).draft(count)
    earlier = array("I", tokens[:-1]).tobytes()  # where an earlier occurrence ends: not the suffix
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n:
            continue
        gram = array("I", tokens[len(tokens) - n :]).tobytes()
        end = len(earlier)
        while (found := earlier.rfind(gram, 0, end)) >= 0:
            if found % width == 0:  # a match across token boundaries is no match
                return _what_followed(tokens, found // width + n, count)
            end = found + len(gram) - 1
    return []


def row_classes(equal: Sequence[Sequence[bool]]) -> tuple[int, ...]:
    """Group row counts 1..N by whether a step of that many rows computes a row as a step of each
    other count does: `equal[a][b]` says counts a + 1 and b + 1 agree. Returns each count's class
    (the smallest count it agrees with, as 1-based), index 0 for one row."""
    classes: list[int] = []
    for count in range(len(equal)):
        same = next((c for c in range(count) if equal[count][c] and classes[c] == c + 1), None)
        classes.append(count + 1 if same is None else same + 1)
    return tuple(classes)


def draft_room(classes: Sequence[int], reference_rows: int, rows: int, wanted: int) -> int:
    """How many draft tokens (up to `wanted`, all rows together) a verify step over `rows` rows may
    carry: its row count (`rows` + drafts) must compute alike with `reference_rows`, the row count
    an ordinary step would have (0 when no such count is within the measured classes)."""
    if not 1 <= reference_rows <= len(classes):
        return 0
    target = classes[reference_rows - 1]
    for drafts in range(min(wanted, len(classes) - rows), 0, -1):
        if classes[rows + drafts - 1] == target:
            return drafts
    return 0


def kept_drafts(drafts: Sequence[int], drawn: Sequence[int]) -> int:
    """How many leading draft tokens stand: draft i stands while it equals `drawn[i]`, the token
    the target drew at its position (given every draft before it)."""
    kept = 0
    for draft, token in zip(drafts, drawn, strict=False):
        if draft != token:
            break
        kept += 1
    return kept


@dataclass(frozen=True, slots=True)
class SpeculationPace:
    """When a row tries again: after `wait` more ordinary steps. Each try that keeps no draft (or
    finds none) doubles the wait, up to MAX_PAUSE; a try that keeps one resets it."""

    wait: int = 0
    pause: int = 0  # the wait the next failure sets (doubling)

    @property
    def due(self) -> bool:
        return self.wait <= 0

    def stepped(self) -> SpeculationPace:
        """An ordinary step passed."""
        return replace(self, wait=max(0, self.wait - 1))

    def tried(self, kept: int) -> SpeculationPace:
        """A try ended, keeping `kept` draft tokens (0: none kept, or no draft found)."""
        if kept > 0:
            return SpeculationPace()
        pause = min(MAX_PAUSE, max(1, 2 * self.pause))
        return SpeculationPace(wait=pause, pause=pause)
