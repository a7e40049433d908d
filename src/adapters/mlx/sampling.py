"""Sampling: pure functions of (log-probabilities, parameters, seed, position).

Greedy (temperature 0) is argmax. Otherwise the token at absolute position p (the first token sits
at p = len(prompt)) is drawn with the key `mx.random.key(blake2b("statecore-sample-v1", seed, p))`
after temperature, top-k and top-p filtering; MLX's global RNG is never used, so a draw does not
depend on the node, the batch or its neighbours. An unseeded request gets its seed from a hash of
its request id: both nodes of a handoff derive the same one. `sample_rows` samples a whole batch:
greedy rows in one argmax, seeded rows each with its own key.

Structured output: a request with a `response_format` samples under its grammar
(`adapters.mlx.grammar.TokenConstraint`): after the shaping, every token the grammar does not
allow next gets -inf, then the log-softmax and the draw as for any other row (logprobs are those
of the masked distribution). Its state follows from the tokens generated, so the decode node
rebuilds it from the first token.

Logits shaping (`logit_bias`, then the repetition, presence and frequency penalties, as mlx-lm
defines them) comes before the log-softmax, greedy rows included. The penalties look at the
request's last tokens (prompt, then generated), which each sampler keeps on the device: the token
it just drew joins them without a round trip to the host, so a batch step is built before the
previous one is read back. Both nodes of a handoff start from the same tokens (the prefill node
from the prompt, the decode node from the prompt and the first token): the same draws follow.
This module imports mlx; it must never import trio.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from adapters.mlx.grammar import ConstraintMark, TokenConstraint
from effects.engine_port import SamplingParams
from statecore.events import TokenLogprobs

__all__ = ["PositionSampler", "SamplerMark", "exclude_top_choices", "log_softmax",
           "pick_logprobs", "position_key_seed", "read_logprobs", "request_seed", "sample", "sample_rows",
           "shape_logits"]

_SAMPLE_KEY_DOMAIN = b"statecore-sample-v1"

SamplerMark = tuple[int, Any, ConstraintMark | None]  # (position, recent tokens, grammar state)


def request_seed(request_id: str, sampling: SamplingParams) -> int:
    """The seed a request samples with: its own, else one derived from its request id."""
    if sampling.seed is not None:
        return sampling.seed
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, person=b"statecore-seed").digest()
    return int.from_bytes(digest, "little")


def position_key_seed(seed: int, position: int) -> int:
    """The 64-bit seed of the MLX key for the token at absolute `position`."""
    h = hashlib.blake2b(_SAMPLE_KEY_DOMAIN, digest_size=8)
    h.update((seed % 2**64).to_bytes(8, "little"))
    h.update(position.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


def log_softmax(logits: Any) -> Any:
    """generate_step's log-probabilities (greedy is the argmax of these, not of the logits)."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def sample(logprobs: Any, sampling: SamplingParams, seed: int, position: int) -> Any:
    """One token from a (1, vocab) row of log-probabilities; returns a (1,) array.

    temperature scales the logits first; min_p keeps the tokens at least min_p times as likely as
    the most likely one; XTC (when its coin, drawn with the position's own key, comes up) leaves
    out the tokens above its threshold but the least likely of them; top_k keeps the k most likely
    tokens; top_p keeps the smallest set of the most likely tokens whose probability reaches top_p
    (the most likely one always stays); then a categorical draw with the position's own key.
    """
    if sampling.greedy:
        return greedy_sampler(logprobs)
    x = logprobs.astype(mx.float32) * (1.0 / sampling.temperature)
    x = x - mx.logsumexp(x, axis=-1, keepdims=True)
    vocab = x.shape[-1]
    neg_inf = mx.array(-float("inf"), dtype=x.dtype)
    if sampling.min_p > 0.0:
        floor = mx.max(x, axis=-1, keepdims=True) + math.log(sampling.min_p)
        x = mx.where(x >= floor, x, neg_inf)
    if sampling.xtc_probability > 0.0:
        x = exclude_top_choices(x, sampling, seed, position)
    if 0 < sampling.top_k < vocab:
        dropped = mx.argpartition(-x, kth=sampling.top_k - 1, axis=-1)[..., sampling.top_k :]
        x = mx.put_along_axis(x, dropped, neg_inf, axis=-1)
    if 0.0 < sampling.top_p < 1.0:
        order = mx.argsort(-x, axis=-1)
        ranked = mx.take_along_axis(x, order, axis=-1)
        probs = mx.softmax(ranked, axis=-1)
        mass_before = mx.cumsum(probs, axis=-1) - probs
        ranked = mx.where(mass_before < sampling.top_p, ranked, neg_inf)
        x = mx.put_along_axis(x, order, ranked, axis=-1)
    key = mx.random.key(position_key_seed(seed, position))
    return mx.random.categorical(x, axis=-1, key=key)


_XTC_DOMAIN = 0x58544320  # "XTC ": the coin's key is the position's, moved to another domain


def exclude_top_choices(x: Any, sampling: SamplingParams, seed: int, position: int) -> Any:
    """mlx-lm's XTC on a (1, vocab) row of log-probabilities: with probability xtc_probability,
    every token more likely than xtc_threshold but the least likely of them is left out (the
    special tokens never are). The coin is seeded by (seed, position), as the draw is."""
    probs = mx.exp(x)
    above = mx.where(probs > sampling.xtc_threshold, probs, mx.inf)
    left_out = probs > mx.min(above, axis=-1, keepdims=True)
    if sampling.xtc_special_tokens:
        left_out[..., list(sampling.xtc_special_tokens)] = False
    coin = mx.random.uniform(key=mx.random.key(position_key_seed(seed ^ _XTC_DOMAIN, position)))
    return mx.where(coin < sampling.xtc_probability, mx.where(left_out, -mx.inf, x), x)


def shape_logits(logits: Any, sampling: SamplingParams, recent: Any) -> Any:
    """`logit_bias`, then each penalty over its last `context_size` of the `recent` tokens, on
    a (1, vocab) row of logits (mlx-lm's processors: a repeated token counts once for the
    repetition and presence penalties, once per occurrence for the frequency penalty)."""
    if sampling.logit_bias:
        ids = mx.array([token for token, _ in sampling.logit_bias])
        biases = mx.array([bias for _, bias in sampling.logit_bias], dtype=logits.dtype)
        logits = logits.at[:, ids].add(biases)
    for kind, penalty, size in sampling.penalties:
        tokens = recent[-size:]
        if kind == "frequency":
            logits = logits.at[:, tokens].subtract(penalty)
            continue
        chosen = logits[:, tokens]
        if kind == "repetition":
            changed = mx.where(chosen < 0, chosen * penalty, chosen / penalty)
        else:
            changed = chosen - penalty
        logits = mx.put_along_axis(logits, tokens[None], changed.astype(logits.dtype), axis=-1)
    return logits


def pick_logprobs(logprobs: Any, token: Any, top: int) -> tuple[Any, ...]:
    """From a (1, vocab) row of log-probabilities and the (1,) token drawn from it: the token's
    log-probability and the `top` most likely tokens' ids and log-probabilities, most likely
    first, as lazy arrays (`read_logprobs` turns them into values once evaluated)."""
    row = logprobs[0].astype(mx.float32)
    chosen = mx.take(row, token.astype(mx.int32))
    if top == 0:
        return (chosen,)
    ids = mx.argpartition(-row, kth=top - 1)[:top]
    values = row[ids]
    order = mx.argsort(-values)
    return chosen, ids[order], values[order]


def read_logprobs(picked: tuple[Any, ...] | None) -> TokenLogprobs | None:
    """Values of `pick_logprobs`' arrays (None: none were picked); alternatives a grammar ruled out
    (-inf) are left out."""
    if picked is None:
        return None
    chosen = float(picked[0].item())
    if len(picked) == 1:
        return TokenLogprobs(chosen)
    pairs = zip(picked[1].tolist(), picked[2].tolist(), strict=True)
    return TokenLogprobs(chosen, tuple((token, value) for token, value in pairs if value != -math.inf))


class PositionSampler:
    """A per-request sampler: each call draws the token at the next position. With a penalty
    in force it also keeps the request's last tokens (`recent`, on the device) from `context`;
    with a `constraint` (a response_format) it draws only what the grammar allows."""

    def __init__(self, sampling: SamplingParams, seed: int, position: int,
                 context: Sequence[int] = (), constraint: TokenConstraint | None = None) -> None:
        self.sampling = sampling
        self.seed = seed
        self.position = position
        self.window = max((size for _, _, size in sampling.penalties), default=0)
        self.recent: Any = None
        self.pending_logprobs: Any = None
        self.constraint: TokenConstraint | None = None
        self.restart(context)
        self.constraint = constraint  # as given: its grammar may already have taken the first token

    @property
    def plain_greedy(self) -> bool:
        """An argmax of the log-probabilities, as any other greedy row's (batched in one call)."""
        return (self.sampling.greedy and not self.sampling.shapes_logits and self.sampling.logprobs is None
                and self.constraint is None)

    def take_logprobs(self) -> Any:
        """The last draw's log-probability arrays (`pick_logprobs`), lazily; None when the request
        did not ask for them. Taken once."""
        pending, self.pending_logprobs = self.pending_logprobs, None
        return pending

    def restart(self, context: Sequence[int]) -> None:
        """The tokens before the next draw are `context` (the prompt and what was generated); a
        grammar starts again from its beginning (only a prefill computed again restarts a
        constrained sampler: constrained rows never decode in the batch lane)."""
        if self.window:
            self.recent = mx.array(list(context[-self.window :]), dtype=mx.int32)
        if self.constraint is not None:
            self.constraint.restart()

    def mark(self) -> SamplerMark:
        return self.position, self.recent, None if self.constraint is None else self.constraint.mark()

    def reset(self, mark: SamplerMark) -> None:
        """Back to `mark`: undo what a failed call's draws advanced."""
        self.position, self.recent, constraint = mark
        if self.constraint is not None and constraint is not None:
            self.constraint.reset(constraint)

    def __call__(self, logprobs: Any) -> Any:
        position = self.position
        self.position += 1
        return sample(logprobs, self.sampling, self.seed, position)

    def next_token(self, logits: Any) -> Any:
        """The next token from a (1, vocab) row of logits: shaped, log-softmaxed, drawn; it
        joins the recent tokens. Returns a (1,) array."""
        if self.sampling.shapes_logits:
            logits = shape_logits(logits, self.sampling, self.recent)
        if self.constraint is not None:
            logits = mx.where(self.constraint.allowed(), logits, mx.array(-math.inf, dtype=logits.dtype))
        logprobs = log_softmax(logits)
        token = self(logprobs)
        if self.constraint is not None:
            self.constraint.drew(token)
        if self.sampling.logprobs is not None:
            self.pending_logprobs = pick_logprobs(logprobs, token, self.sampling.logprobs)
        if self.window:
            joined = mx.concatenate([self.recent, token.astype(mx.int32)])
            self.recent = joined[-self.window :]
        return token


def sample_rows(logits: Any, samplers: Sequence[PositionSampler | None]) -> Any:
    """One token per row of a (rows, vocab) batch of logits: a None or plain greedy sampler takes
    the argmax (all of them in one call), the others draw their own; returns a (rows,) array."""
    greedy = greedy_sampler(log_softmax(logits))
    if all(s is None or s.plain_greedy for s in samplers):
        return greedy
    parts = [
        greedy[row : row + 1] if s is None or s.plain_greedy else s.next_token(logits[row : row + 1])
        for row, s in enumerate(samplers)
    ]
    return mx.concatenate(parts, axis=0)
