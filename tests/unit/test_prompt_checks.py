"""What an engine takes of a request is decided once, purely (`statecore.policy.token_ids`,
`engine_request`): plain ints in the vocabulary pass as they are, numpy integers become ints, and
anything else is refused with a reason naming the first token at fault, whichever way the check
finds it; an empty prompt and sampling values out of range are refused too. The engine's door and
the front end ask it (`adapters.mlx.engine.checked_prompt` raises its refusal as a client error)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.mlx.engine import checked_prompt, checked_token
from effects.engine_port import ModelInfo, SamplingParams
from statecore.errors import Fault, StatecoreError
from statecore.policy import engine_request, token_ids

INFO = ModelInfo("m", "f", context_length=64, vocab_size=10, eos_token_ids=frozenset(), prefill_chunk_size=8)


def test_plain_and_numpy_ids_in_the_vocabulary_pass_as_ints() -> None:
    assert token_ids((0, 9, 3), 10, "prompt token") == [0, 9, 3]
    mixed = token_ids([np.int64(4), 5, np.int32(9)], 10, "prompt token")
    assert mixed == [4, 5, 9] and isinstance(mixed, list) and all(type(token) is int for token in mixed)
    assert token_ids((), 10, "prompt token") == []


@given(st.lists(st.one_of(st.integers(-3, 12), st.booleans(), st.floats(0, 9), st.just("1")), min_size=1,
                max_size=12))
def test_the_first_token_at_fault_is_named_as_a_token_at_a_time_names_it(tokens: list[object]) -> None:
    one_at_a_time = [token_ids((token,), 10, "prompt token") for token in tokens]
    expected = next((reason for reason in one_at_a_time if isinstance(reason, str)),
                    [ids[0] for ids in one_at_a_time if isinstance(ids, list)])
    assert token_ids(tokens, 10, "prompt token") == expected


def test_an_id_outside_the_vocabulary_or_a_bool_is_refused() -> None:
    for bad, words in (([1, 10], "prompt token 10 is outside the vocabulary [0, 10)"),
                       ([-1], "prompt token -1 is outside"), ([True], "prompt token True is not an integer"),
                       ([2.0], "prompt token 2.0 is not an integer")):
        refusal = token_ids(bad, 10, "prompt token")
        assert isinstance(refusal, str) and refusal.startswith(words)


def test_an_engine_refuses_an_empty_prompt_and_sampling_values_out_of_range() -> None:
    def refusal(prompt: list[object], **changed: float) -> list[int] | str:
        values: dict[str, float] = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0, **changed}
        return engine_request(prompt, 10, max_tokens=int(values["max_tokens"]),
                              temperature=values["temperature"],
                              top_p=values["top_p"], top_k=int(values["top_k"]))

    assert refusal([1, 2]) == [1, 2]
    assert refusal([]) == "the prompt is empty"
    assert refusal([10]) == "prompt token 10 is outside the vocabulary [0, 10)"
    assert refusal([1], max_tokens=0) == "max_tokens must be >= 1"
    assert refusal([1], temperature=-0.5) == "temperature must be >= 0"
    assert refusal([1], temperature=float("nan")) == "temperature must be >= 0"
    assert refusal([1], top_p=0.0) == refusal([1], top_p=1.5) == "top_p must be in (0, 1]"
    assert refusal([1], top_k=-1) == "top_k must be >= 0"


def test_the_engine_s_door_raises_a_refusal_as_a_client_error() -> None:
    assert checked_prompt([np.int64(3), 4], SamplingParams(max_tokens=2), INFO) == [3, 4]  # type: ignore[list-item]
    assert checked_token(np.int64(9), "first_token", INFO) == 9  # type: ignore[arg-type]
    for call in (lambda: checked_prompt([], SamplingParams(max_tokens=2), INFO),
                 lambda: checked_token(10, "first_token", INFO)):
        with pytest.raises(StatecoreError) as caught:
            call()
        assert caught.value.info.fault is Fault.CLIENT
