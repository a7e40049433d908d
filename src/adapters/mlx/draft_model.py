"""A draft model for speculative decoding (`--draft-model`): a small model of the same vocabulary
that guesses the next few tokens of a speculating row.

Each row keeps its own cache in the draft model and the tokens it holds (`_DraftRow.fed`). To
draft, the cache is first cut back to where it still agrees with the row's tokens (a verify step
may have dropped drafts it held), the tokens it lacks go in with the first draft's call (after a
verify step, the one or two it lacks; the first time, the prompt's last token, its other tokens
in a call before whose logits nobody reads, as generate_step prefills, and a long one's leading
chunks before that: the draft model's prefill happens on the node that decodes), and each draft
is drawn from the last position and fed back, one call per draft, its computation started as it
is drawn. A greedy row drafts the argmax; a
seeded row draws each draft with the key of the position it guesses (`sampling.sample`), the key
the target draws that position with, so the two draws share their noise and agree as often as
the two models do (the verify step keeps a draft only where it equals the target's own draw, so
the coupling changes how often drafts stand, never what a request emits). Once a verify step
is launched, each of its rows' next drafts are drawn beside it (`draft_ahead`, on a stream of
their own), as if every draft stands and the target draws after them what the draft model
guesses: where that comes true, the next verify step takes them at once (only the first call's
token is read first), so the draft model's calls run while the verify step computes rather than
between two verify steps; else what they fed is cut back as any draft that fell. Only models
whose every layer is a plain `KVCache` can draft (they can be cut back). Its caches are not part of the KV
budget: they are a small model's, for the few rows that speculate.
This module imports mlx and mlx_lm; never trio, never the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from adapters.mlx.sampling import PositionSampler, log_softmax, sample
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError

__all__ = ["DraftModel", "check_draft_vocabulary"]

_FEED_CHUNK = 2048  # the most tokens one feeding call computes (a long prompt goes in several)
_CHECK_TOKENS = 24  # the load check's prompt
# Fed with the first draft's call up to this many tokens (a verify step's last draft and the
# token after it); more (a prompt) go in a call of their own first.
_HEAD_AFTER = 2


@dataclass(eq=False)
class _DraftRow:
    cache: list[Any]
    fed: list[int] = field(default_factory=list)  # the tokens the cache holds, in order
    guessed: int = 0  # how many of the last `fed` are drafts (all before them are the row's tokens)
    ahead: _Ahead | None = None  # drafts drawn while a verify step computed (`draft_ahead`)


@dataclass(eq=False, slots=True)
class _Ahead:
    """What `draft_ahead` drew: it fed the verify step's last draft, then each of `drawn` but its
    last; `drawn[0]` guesses the token the verify step draws after its drafts, the rest are the
    next verify step's drafts."""

    drawn: Any  # a lazy (count + 1,) array
    guess: Any  # drawn[0] alone (lazy): the first call's, read without waiting for the others
    last: int | None = None  # the verify step's last draft, once read back (`drafted`)


class DraftModel:
    """The draft model and each speculating row's cache in it (device thread only)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.rows: dict[str, _DraftRow] = {}
        # verify steps whose drafts were drawn ahead and stood as guessed, and those that did not
        self.ahead_taken = self.ahead_missed = 0
        # `draft_ahead`'s stream: beside the verify step's, not behind it (on MLX's CPU backend a
        # launch behind a queued step waits for most of it, and so would the device thread)
        self.ahead_stream = mx.new_stream(mx.default_device())
        probe: list[Any] = make_prompt_cache(model)
        if not all(type(layer) is KVCache for layer in probe):
            raise StatecoreError(ErrorInfo(
                Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
                "a draft model must keep a plain KV cache in every layer (its cache is cut back to "
                f"the tokens that stood); this one keeps {sorted({type(c).__name__ for c in probe})}"))

    def check(self) -> None:
        """A short prompt and one step after it through the draft model, evaluated (the load
        check): raises where this device cannot compute the calls drafting makes."""
        cache: list[Any] = make_prompt_cache(self.model)
        self.model(mx.array([[1 + (7 * i) % 97 for i in range(_CHECK_TOKENS)]]), cache=cache)
        logits = self.model(mx.array([[1]]), cache=cache)[:, -1, :]
        mx.eval(greedy_sampler(log_softmax(logits)))

    def forget(self, request_id: str) -> None:
        self.rows.pop(request_id, None)

    def propose(self, request_id: str, prompt: Sequence[int], generated: Sequence[int], count: int,
                sampler: PositionSampler) -> Any:
        """`count` (at least 1) draft tokens after the row's tokens (`prompt`, then `generated`,
        its latest token last), as a (count,) array whose values the verify step that checks them
        reads back, and hands back (`drafted`)."""
        row = self.rows.get(request_id)
        if row is None:
            row = self.rows[request_id] = _DraftRow(make_prompt_cache(self.model))
        length = len(prompt) + len(generated)
        history = _Tokens(prompt, generated)
        if row.ahead is not None and row.ahead.last is None:  # its verify step never read back
            row = self.rows[request_id] = _DraftRow(make_prompt_cache(self.model))
        if row.ahead is not None:
            ready = self._take_ahead(row, history, length, count)
            if ready is not None:
                return ready
        # Only the drafts fed last time can disagree with the row's tokens: compare those.
        agree = len(row.fed) - row.guessed
        while agree < min(len(row.fed), length) and row.fed[agree] == history[agree]:
            agree += 1
        agree = min(agree, length - 1)  # the latest token is always fed: its logits draft
        for layer in row.cache:
            layer.trim(len(row.fed) - agree)
        del row.fed[agree:]
        missing = rest = history.since(agree)
        while len(rest) > _FEED_CHUNK:  # a long prompt (a row's first try): in evaluated chunks
            self.model(mx.array([rest[:_FEED_CHUNK]]), cache=row.cache)
            mx.eval([layer.state for layer in row.cache])
            rest = rest[_FEED_CHUNK:]
        if len(rest) > _HEAD_AFTER:
            # A prompt (a row's first try): all but its last token go in as a call of their own
            # whose logits nobody reads, so only their keys and values are computed (as
            # generate_step prefills), not the last layer's attention and MLP for every row.
            self.model(mx.array([rest[:-1]]), cache=row.cache)
            rest = rest[-1:]
        # The tokens the cache lacks go in with the first draft's call (after a verify step that
        # kept every draft, the last draft and the token after it): one call, no wait. Each
        # draft starts computing as soon as it is drawn, while the next call is built.
        drafts: list[Any] = []
        feed: Any = mx.array([rest])
        for i in range(count):
            logits = self.model(feed, cache=row.cache)[:, -1, :]
            last = _draw(logits, sampler, i)
            mx.async_eval(last)  # type: ignore[no-untyped-call]
            drafts.append(last)
            feed = last[None]
        row.fed.extend(missing)
        return mx.concatenate(drafts).astype(mx.uint32)

    def drafted(self, request_id: str, proposed: Sequence[int]) -> None:
        """The values of the drafts `propose` gave last: all but the last are in the cache now."""
        row = self.rows.get(request_id)
        if row is not None:
            row.fed.extend(proposed[:-1])
            row.guessed = len(proposed) - 1
            if row.ahead is not None and proposed:
                row.ahead.last = proposed[-1]

    def draft_ahead(self, request_id: str, last: Any, count: int, sampler: PositionSampler,
                    checked: int) -> None:
        """While a verify step of the row's `checked` drafts (`last`, a lazy (1,) array, the last
        of them) computes: feed `last` and draw `count` + 1 tokens, as if every draft stands and
        the target draws after them what the draft model does. Where that comes true (most
        steps, where drafts stand at all), `propose` hands out the next drafts at once, drawn while
        the device computed the verify step rather than after it; else the cache is cut back to
        the row's tokens as after any draft that fell. Called after the verify step is launched,
        and its calls run beside it, on a stream of their own."""
        row = self.rows.get(request_id)
        if row is None or row.ahead is not None or count < 1:
            return
        drawn: list[Any] = []
        feed: Any = last[None]
        with mx.stream(self.ahead_stream):
            for i in range(count + 1):
                logits = self.model(feed, cache=row.cache)[:, -1, :]
                token = _draw(logits, sampler, checked + i)  # the position it guesses: past the drafts
                mx.async_eval(token)  # type: ignore[no-untyped-call]
                drawn.append(token)
                feed = token[None]
            row.ahead = _Ahead(mx.concatenate(drawn).astype(mx.uint32), drawn[0])

    def _take_ahead(self, row: _DraftRow, history: _Tokens, length: int, count: int) -> Any | None:
        """The drafts `draft_ahead` drew, where the row's tokens since are what it guessed (its
        cache then holds them and the drafts but the last, as after `propose`); else None, with
        what it fed counted as guesses (`propose` cuts them back)."""
        ahead, row.ahead = row.ahead, None
        assert ahead is not None and ahead.last is not None
        last, size = ahead.last, int(ahead.drawn.shape[0])
        start = len(row.fed)
        if (length == start + 2 and count <= size - 1 and history[start] == last
                and all(row.fed[i] == history[i] for i in range(start - row.guessed, start))):
            guess = int(ahead.guess.item())  # the first call's token: the others may still compute
            if history[start + 1] == guess:
                self.ahead_taken += 1
                row.fed.extend((last, guess))
                row.guessed = 0
                extra = size - 1 - count  # fed past the drafts handed out now: cut off
                if extra:
                    for layer in row.cache:
                        layer.trim(extra)
                return ahead.drawn[1 : 1 + count]
        self.ahead_missed += 1
        drawn: list[int] = ahead.drawn.tolist()
        row.fed.extend((last, *drawn[:-1]))
        row.guessed += len(drawn)
        return None


class _Tokens:
    """A row's tokens as one sequence, without copying its prompt."""

    def __init__(self, prompt: Sequence[int], generated: Sequence[int]) -> None:
        self.prompt = prompt
        self.generated = generated

    def __getitem__(self, index: int) -> int:
        split = len(self.prompt)
        return self.prompt[index] if index < split else self.generated[index - split]

    def since(self, start: int) -> list[int]:
        split = len(self.prompt)
        if start >= split:
            return list(self.generated[start - split :])
        return [*self.prompt[start:], *self.generated]


def _draw(logits: Any, sampler: PositionSampler, ahead: int) -> Any:
    """The draft for the position `ahead` past the row's next one: its argmax, or for a seeded
    row the draw with that position's key."""
    logprobs = log_softmax(logits)
    if sampler.plain_greedy:
        return greedy_sampler(logprobs)
    return sample(logprobs, sampler.sampling, sampler.seed, sampler.position + ahead)


def check_draft_vocabulary(target: Any, draft: Any) -> None:
    """Refuse a draft model whose tokenizer maps any token to another id than the target's."""
    ours, theirs = _vocabulary(target), _vocabulary(draft)
    if ours is not None and theirs is not None and ours != theirs:
        raise StatecoreError(ErrorInfo(
            Fault.CLIENT, Code.UNSUPPORTED_PARAMETER,
            f"the draft model's vocabulary ({len(theirs)} tokens) is not the model's ({len(ours)} "
            "tokens): a draft model must share the model's tokenizer"))


def _vocabulary(tokenizer: Any) -> dict[str, int] | None:
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    get_vocab = getattr(inner, "get_vocab", None)
    return None if get_vocab is None else dict(get_vocab())
