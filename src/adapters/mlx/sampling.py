"""Sampling: pure functions of (log-probabilities, parameters, seed, position).

Greedy (temperature 0) is argmax. Otherwise the token at absolute position p (the first token sits
at p = len(prompt)) is drawn with the key `mx.random.key(blake2b("statecore-sample-v1", seed, p))`
after temperature, top-k and top-p filtering; MLX's global RNG is never used, so a draw does not
depend on the node, the batch or its neighbours. An unseeded request gets its seed from a hash of
its request id: both nodes of a handoff derive the same one. `sample_rows` samples a whole batch:
greedy rows in one argmax, seeded rows each with its own key. This module imports mlx; it must
never import trio.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from effects.engine_port import SamplingParams

__all__ = ["PositionSampler", "log_softmax", "position_key_seed", "request_seed", "sample", "sample_rows"]

_SAMPLE_KEY_DOMAIN = b"statecore-sample-v1"


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

    temperature scales the logits first; top_k keeps the k most likely tokens; top_p keeps the
    smallest set of the most likely tokens whose probability reaches top_p (the most likely one
    always stays); then a categorical draw with the position's own key.
    """
    if sampling.greedy:
        return greedy_sampler(logprobs)
    x = logprobs.astype(mx.float32) * (1.0 / sampling.temperature)
    x = x - mx.logsumexp(x, axis=-1, keepdims=True)
    vocab = x.shape[-1]
    neg_inf = mx.array(-float("inf"), dtype=x.dtype)
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


class PositionSampler:
    """A per-request sampler: each call draws the token at the next position."""

    def __init__(self, sampling: SamplingParams, seed: int, position: int) -> None:
        self.sampling = sampling
        self.seed = seed
        self.position = position

    def __call__(self, logprobs: Any) -> Any:
        position = self.position
        self.position += 1
        return sample(logprobs, self.sampling, self.seed, position)


def sample_rows(logprobs: Any, samplers: Sequence[PositionSampler | None]) -> Any:
    """One token per row of a (rows, vocab) batch: a None or greedy sampler takes the argmax
    (all of them in one call), the others draw their own; returns a (rows,) array."""
    greedy = greedy_sampler(logprobs)
    if all(s is None or s.sampling.greedy for s in samplers):
        return greedy
    parts = [
        greedy[row : row + 1] if s is None or s.sampling.greedy else s(logprobs[row : row + 1])
        for row, s in enumerate(samplers)
    ]
    return mx.concatenate(parts, axis=0)
