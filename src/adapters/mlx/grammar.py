"""One constrained request's grammar state, as its sampler uses it on the device thread.

A `TokenConstraint` holds the request's llguidance matcher (from `adapters.grammar.Grammars`)
and turns it into the allowed-token mask that the sampler applies before the log-softmax: EOS is
allowed exactly where the grammar accepts, and a finished grammar allows nothing but EOS. The
matcher's state is a function of the tokens generated so far, so a decode node rebuilds it from
the first token (`generated`) and then draws what a single node draws.

A drawn token stays on the device (`drew`) and is read back and consumed only when the next mask
is needed: in the slot lane that is while the next step is built, so a batch with a constrained
row waits there for the previous step instead of building beside it; the other rows' tokens do
not change. `mark` / `reset` undo what a failed call consumed (llguidance's rollback); `restart`
goes back to the grammar's start (a prefill computed again). `constraint_after` builds a request's
constraint, a first token that does not fit being the client's error. This module imports mlx and numpy
and calls llguidance through the matcher it is given; it must never import trio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from effects.engine_port import ModelInfo
from statecore.errors import StatecoreError, client_error

__all__ = ["ConstraintMark", "TokenConstraint", "constraint_after"]

ConstraintMark = tuple[int, Any]  # (tokens consumed, the last draw not yet consumed)


class TokenConstraint:
    def __init__(self, matcher: Any, vocab_size: int, eos: frozenset[int],
                 generated: Sequence[int] = ()) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._eos = eos
        self._consumed = 0
        self._pending: Any = None  # the last draw, a (1,) array, not yet consumed
        self._bits = mx.arange(32, dtype=mx.uint32)
        for token in generated:
            self._consume(int(token))

    def allowed(self) -> Any:
        """The next token's (vocab,) boolean mask, on the device (vocab / 8 bytes cross over)."""
        self._flush()
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint32)
        if self._matcher.is_error():
            raise RuntimeError(f"the grammar failed: {self._matcher.get_error()}")
        if not words.any():
            raise RuntimeError("the grammar allows no token at all")
        bits = (mx.array(words)[:, None] >> self._bits) & 1
        return bits.reshape(-1)[: self._vocab].astype(mx.bool_)

    def drew(self, token: Any) -> None:
        """The token drawn under the last mask (lazy); consumed when the next mask is needed."""
        self._flush()
        self._pending = token

    def mark(self) -> ConstraintMark:
        return self._consumed, self._pending

    def reset(self, mark: ConstraintMark) -> None:
        """Back to `mark`: tokens consumed since are rolled back, its pending draw is pending again."""
        consumed, pending = mark
        if self._consumed > consumed and not self._matcher.rollback(self._consumed - consumed):
            raise RuntimeError(f"the grammar could not roll back: {self._matcher.get_error()}")
        self._consumed, self._pending = min(consumed, self._consumed), pending

    def restart(self) -> None:
        """Back to the grammar's start, nothing generated."""
        self._matcher.reset()
        self._consumed, self._pending = 0, None

    def _flush(self) -> None:
        if self._pending is not None:
            token, self._pending = int(self._pending.item()), None
            self._consume(token)

    def _consume(self, token: int) -> None:
        if token in self._eos and self._matcher.is_stopped():
            return  # the throwaway draw after the end (a row computes one token past its last)
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"token {token} does not fit the grammar: {self._matcher.get_error()}")
        self._consumed += 1


def constraint_after(matcher: Any, info: ModelInfo, generated: Sequence[int]) -> TokenConstraint | None:
    """A request's grammar state after `generated` (None: free text, no matcher)."""
    if matcher is None:
        return None
    try:
        return TokenConstraint(matcher, info.vocab_size, info.eos_token_ids, generated)
    except RuntimeError as exc:
        raise StatecoreError(client_error(f"the first token does not fit the response_format: {exc}",
                                          param="response_format")) from exc
