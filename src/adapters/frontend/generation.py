"""The generation driver every API of the front end shares: one choice's generation, token ids
in, text steps out.

`Run` reads a backend `Generation`'s outputs, turns tokens into text (mlx-lm's streaming
detokenizer, the thinking split off, stop strings applied so that one split across tokens is
never half sent), counts the tokens, caps the thinking when the API asked (`ThinkBudget`), and
ends with a `Finish` or the backend's error; it never raises for backend errors. `Reply` splits
a choice's text into content and numbered tool calls; `LogprobsFormat` shapes its logprobs. How
a generation ends (the finish reason, whether EOS counts) is `statecore.policy`'s decision; this
module only asks. An adapter: it imports `effects.ports`, `adapters.reasoning` and
`adapters.tool_calls`, and nothing of the HTTP side; nothing in `statecore` or `effects` may
import it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, assert_never

import trio

from adapters.reasoning import ReasoningSplitter
from adapters.tool_calls import ToolCall, ToolCallSplitter
from effects.ports import Generation, Output
from statecore.errors import ErrorInfo, StatecoreError, bug
from statecore.events import TokenLogprobs
from statecore.intents import Complete, Reject, RespondTokens
from statecore.policy import length_finish, reply_finish, text_finish

__all__ = ["CANCEL_GRACE_S", "Finish", "LogprobsFormat", "Reply", "Run", "Step", "StopText", "ThinkBudget"]

logger = logging.getLogger(__name__)

CANCEL_GRACE_S = 10.0
"""How long a cancel or stop sent to the backend may take while the request is being torn down."""


def _held_back(text: str, stops: Sequence[str]) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
        while i != -1 and len(text) - i > best:
            if stop.startswith(text[i:]):
                best = len(text) - i
                break
            i = text.find(stop[0], i + 1)
    return best


@dataclass(frozen=True, slots=True)
class TextPiece:
    """What some tokens make: reasoning and content that may be sent now, and whether a stop
    string ended the content."""

    reasoning: str
    content: str
    stopped: bool = False


class StopText:
    """Token ids in, text out: mlx-lm's streaming detokenizer, the reasoning split off (when the
    model has think markers: `adapters.reasoning`), and stop strings, which end the content only
    (the thinking is never cut by them).

    Text is released only when no stop string can still begin inside it, so a stop string split
    across tokens is never half sent.
    """

    def __init__(self, detokenizer: Any, stops: Sequence[str], quiet: Sequence[str] = (),
                 reasoning: ReasoningSplitter | None = None) -> None:
        self._detokenizer = detokenizer
        self._given = tuple(stops)
        self._stops = (*stops, *(q for q in quiet if q not in stops))
        self._pending = ""
        self._reasoning = reasoning
        self.reasoning_tokens = 0  # tokens generated inside the thinking, its markers included
        self.matched: str | None = None  # the client's stop string the text ended before, once one has

    @property
    def thinking(self) -> bool:
        """Whether the text is inside the model's thinking now."""
        return self._reasoning is not None and self._reasoning.thinking

    def add(self, token: int) -> TextPiece:
        """Text that may be sent now, and whether a stop string was matched."""
        was_thinking = self.thinking
        self._detokenizer.add_token(token)
        text = self._split(self._detokenizer.last_segment, final=False)
        if was_thinking or self.thinking:
            self.reasoning_tokens += 1
        return text

    def close(self) -> TextPiece:
        """Flush everything held back at the end of the generation."""
        self._detokenizer.finalize()
        return self._split(self._detokenizer.last_segment, final=True)

    def _split(self, segment: str, *, final: bool) -> TextPiece:
        if self._reasoning is None:
            return TextPiece("", *self._scan(segment, final=final))
        reasoning, content = self._reasoning.feed(segment)
        if final:
            rest = self._reasoning.close()
            reasoning, content = reasoning + rest[0], content + rest[1]
        text, stopped = self._scan(content, final=final)
        if stopped:
            self._reasoning = None  # the reply ends here: nothing after the stop string is sent
        return TextPiece(reasoning, text, stopped)

    def _scan(self, segment: str, *, final: bool) -> tuple[str, bool]:
        text = self._pending + segment
        cuts = [(i, stop) for stop in self._stops if (i := text.find(stop)) != -1]
        if cuts:
            self._pending = ""
            cut, stop = min(cuts, key=lambda found: found[0])  # the earliest (a tie: first listed)
            self.matched = stop if stop in self._given else None  # a quiet stop is the server's own
            return text[:cut], True
        keep = 0 if final else _held_back(text, self._stops)
        self._pending = text[len(text) - keep :]
        return text[: len(text) - keep], False


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Step:
    """Some text (maybe empty) and, on the last step, how the generation ended; with the
    logprobs of the tokens this step consumed when the request asked for them."""

    text: str
    end: Finish | ErrorInfo | None = None
    logprobs: tuple[tuple[int, TokenLogprobs], ...] = ()
    reasoning: str = ""  # the model's thinking, before `text` (a model without think markers: "")


@dataclass(frozen=True, slots=True)
class ThinkBudget:
    """A cap on a reply's thinking (Anthropic's `budget_tokens`): once `tokens` tokens of it are
    generated, the generation is stopped, the think end marker (`end_tokens`) is written for the
    model, and `resume` starts the rest of the reply (the prompt and everything generated so
    far, with the max_tokens left) as a continuation, on whatever node the backend picks."""

    tokens: int
    max_tokens: int
    end_tokens: tuple[int, ...]
    resume: Callable[[tuple[int, ...], int], Awaitable[Generation]]  # (generated, max_tokens left)


class Run:
    """Drives one generation: outputs in, text steps out. Never raises for backend errors."""

    def __init__(self, generation: Generation, text: StopText, budget: ThinkBudget | None = None) -> None:
        self.generation = generation  # the one running now (a thinking budget may start a second)
        self.first_generation = generation  # the one that prefilled the client's prompt
        self.finished = False  # the backend is done with it: ended, failed, or stopped by us
        self._outputs = aiter(generation)
        self._text = text
        self._budget = budget
        self._tokens = 0
        self._generated: list[int] = []  # kept only while a thinking budget may need them
        self._logprobs: list[tuple[int, TokenLogprobs]] = []  # of the tokens the next step consumes
        # steps a decode step's tokens made beyond the one given: each token's text is a step of
        # its own, as if the tokens had come one by one (a client's events do not depend on how
        # many tokens a step gave), given before any output is read again
        self._made: deque[Step] = deque()

    async def advance(self) -> Step:
        """The next step with some text, or the last step."""
        if self._made:
            return self._made.popleft()
        assert not self.finished
        while True:
            try:
                output: Output = await anext(self._outputs)
            except StopAsyncIteration:
                self.finished = True
                return Step("", bug("the backend ended a generation without an end or an error"))
            step = await self._take(output)
            if step is not None:
                return step

    async def advance_ready(self) -> Step | None:
        """`advance` from the outputs already waiting only: None when they run out before a
        step is whole (what they gave is kept for the next one). It never waits for the
        backend (it may await telling it a stop string matched)."""
        if self._made:
            return self._made.popleft()
        assert not self.finished
        while (output := self.generation.receive_nowait()) is not None:
            step = await self._take(output)
            if step is not None:
                return step
        return None

    async def _take(self, output: Output) -> Step | None:
        """One output in; the step it completes, if it does."""
        match output:
            case RespondTokens(tokens=tokens, logprobs=carried):
                return await self._take_tokens(tokens, carried)
            case Complete(finish_reason=reason, ending_tokens=ending):
                self.finished = True
                self._tokens += ending  # an ending EOS, as the core counts it
                text = self._text.close()
                return self._step(text, Finish(text_finish(reason, stop_string_matched=text.stopped),
                                               self._tokens))
            case Reject(error=error):
                self.finished = True
                return Step("", error)
            case _:
                assert_never(output)

    async def _take_tokens(self, tokens: Sequence[int], logprobs: Sequence[TokenLogprobs] | None
                           ) -> Step | None:
        """A step's tokens in their order, each one's text its own step (the first returned, the
        others given next); where one of them ends the reply (a stop string, the thinking budget
        spent) the tokens after it are not taken, as if they had never come."""
        made: list[Step] = []
        for at, token in enumerate(tokens):
            self._tokens += 1
            if logprobs is not None:
                self._logprobs.append((token, logprobs[at]))
            text = self._text.add(token)
            if text.stopped:
                await self.generation.stop()
                self.finished = True
                ended = Finish(text_finish(None, stop_string_matched=True), self._tokens)
                made.append(self._step(text, ended))
                break
            if self._budget is not None:
                self._generated.append(token)
                if self._text.thinking and self._text.reasoning_tokens >= self._budget.tokens:
                    made.append(await self._end_thinking(self._budget, text))
                    break
            if text.reasoning or text.content:
                made.append(self._step(text))
        if not made:
            return None
        self._made.extend(made[1:])
        return made[0]

    async def _end_thinking(self, budget: ThinkBudget, text: TextPiece) -> Step:
        """The thinking budget is spent: stop, write the end marker for the model, and go on with
        the continuation (none when max_tokens is reached)."""
        self._budget = None
        await self.generation.stop()
        pieces = [text, *(self._text.add(token) for token in budget.end_tokens)]
        self._tokens += len(budget.end_tokens)
        self._generated += budget.end_tokens
        step = TextPiece("".join(p.reasoning for p in pieces), "".join(p.content for p in pieces))
        if (ended := length_finish(budget.max_tokens - self._tokens)) is not None:
            self.finished = True
            rest = self._text.close()
            return self._step(TextPiece(step.reasoning + rest.reasoning, step.content + rest.content),
                              Finish(ended, self._tokens))
        try:
            self.generation = await budget.resume(tuple(self._generated), budget.max_tokens - self._tokens)
        except StatecoreError as exc:
            self.finished = True
            return Step("", exc.info)
        self._outputs = aiter(self.generation)
        self._generated = []
        return self._step(step)

    def _step(self, text: TextPiece, end: Finish | None = None) -> Step:
        logprobs, self._logprobs = tuple(self._logprobs), []
        return Step(text.content, end, logprobs, text.reasoning)

    @property
    def reasoning_tokens(self) -> int:
        return self._text.reasoning_tokens

    @property
    def matched_stop(self) -> str | None:
        """The client's stop string the text ended before, once one has."""
        return self._text.matched

    async def cancel(self) -> None:
        """Tear the generation down (shielded, bounded): the client is gone or we failed."""
        if self.finished:
            return
        self.finished = True
        with trio.move_on_after(CANCEL_GRACE_S, shield=True):
            try:
                await self.generation.cancel()
            except Exception:
                logger.exception("cancelling a generation failed")


class LogprobsFormat:
    """One choice's logprobs as OpenAI shapes them: chat `{"content": [{token, logprob, bytes,
    top_logprobs}]}`, completions `{tokens, token_logprobs, top_logprobs, text_offset}` (offsets
    run on across a stream's chunks). A token's text is its own decoding; None when not asked."""

    def __init__(self, tokenizer: Any, chat: bool, top: int | None) -> None:
        self._tokenizer, self._chat, self._top = tokenizer, chat, top
        self._offset = 0

    def _text(self, token: int) -> str:
        return str(self._tokenizer.decode([token]))

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def of(self, entries: Sequence[tuple[int, TokenLogprobs]]) -> dict[str, Any] | None:
        if self._top is None:
            return None
        if self._chat:
            content = [{**self._entry(token, lp.logprob),
                        "top_logprobs": [self._entry(t, v) for t, v in lp.top]} for token, lp in entries]
            return {"content": content, "refusal": None}
        texts = [self._text(token) for token, _ in entries]
        offsets = []
        for text in texts:
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": texts, "token_logprobs": [lp.logprob for _, lp in entries],
                "top_logprobs": [{self._text(t): v for t, v in lp.top} for _, lp in entries],
                "text_offset": offsets}


class Reply:
    """One choice's text as the client gets it: as generated, or, when the model was offered
    tools, split into content and numbered tool calls (ids from the choice's request id, the
    same on every node)."""

    def __init__(self, splitter: ToolCallSplitter | None, request_id: str) -> None:
        self._splitter = splitter
        self._request_id = request_id
        self._calls = 0

    def add(self, text: str) -> tuple[str, list[tuple[int, dict[str, Any]]]]:
        if self._splitter is None:
            return text, []
        content, calls = self._splitter.feed(text)
        return content, self._numbered(calls)

    def close(self) -> tuple[str, list[tuple[int, dict[str, Any]]]]:
        if self._splitter is None:
            return "", []
        content, calls = self._splitter.close()
        return content, self._numbered(calls)

    def finish_reason(self, reason: str) -> str:
        return reply_finish(reason, called_tools=self._calls > 0)

    def _numbered(self, calls: list[ToolCall]) -> list[tuple[int, dict[str, Any]]]:
        numbered = []
        for call in calls:
            numbered.append((self._calls, {"id": f"call_{self._request_id}_{self._calls}", "type": "function",
                                           "function": {"name": call.name, "arguments": call.arguments}}))
            self._calls += 1
        return numbered


# ---------------------------------------------------------------------------------------------
