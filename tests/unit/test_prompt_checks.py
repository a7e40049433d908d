"""A prompt's token ids are checked before anything computes them (`adapters.mlx.limits.checked_tokens`):
plain ints in the vocabulary pass as they are, numpy integers become ints, and anything else is refused
with a client error naming the first token at fault, whichever way the check finds it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.mlx.limits import checked_token, checked_tokens
from effects.engine_port import ModelInfo
from statecore.errors import Fault, StatecoreError

INFO = ModelInfo("m", "f", context_length=64, vocab_size=10, eos_token_ids=frozenset(), prefill_chunk_size=8)


def test_plain_and_numpy_ids_in_the_vocabulary_pass_as_ints() -> None:
    assert checked_tokens((0, 9, 3), "prompt token", INFO) == [0, 9, 3]
    numpy_ids: list[object] = [np.int64(4), 5, np.int32(9)]
    mixed = checked_tokens(numpy_ids, "prompt token", INFO)  # type: ignore[arg-type]
    assert mixed == [4, 5, 9] and all(type(token) is int for token in mixed)
    assert checked_tokens((), "prompt token", INFO) == []


@given(st.lists(st.one_of(st.integers(-3, 12), st.booleans(), st.floats(0, 9), st.just("1")), min_size=1,
                max_size=12))
def test_the_first_token_at_fault_is_named_as_a_token_at_a_time_names_it(tokens: list[object]) -> None:
    try:
        expected: list[int] | str = [checked_token(token, "prompt token", INFO) for token in tokens]
    except StatecoreError as exc:
        assert exc.info.fault is Fault.CLIENT
        expected = exc.info.message
    try:
        found: list[int] | str = checked_tokens(tokens, "prompt token", INFO)  # type: ignore[arg-type]
    except StatecoreError as exc:
        found = exc.info.message
    assert found == expected


def test_an_id_outside_the_vocabulary_or_a_bool_is_refused() -> None:
    for bad, words in (([1, 10], "10 is outside the vocabulary of 10"), ([-1], "-1 is outside"),
                       ([True], "True is not an integer")):
        with pytest.raises(StatecoreError, match=words):
            checked_tokens(bad, "prompt token", INFO)
