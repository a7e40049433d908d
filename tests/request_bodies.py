"""Request bodies for the OpenAI-compatible API, valid, wrong in one known way, or anything at
all, and what a well-formed answer to each is: shared by the in-process front-end test
(tests/integration/test_request_bodies.py, every body) and the live cluster's sample
(tests/e2e/test_failure_isolation.py).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import strategies as st

__all__ = ["VIOLATIONS", "assert_openai_error", "assert_well_formed", "bodies", "valid_calls"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False)
    | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
          "stream", "stream_options", "model", "logprobs", "max_completion_tokens"]
bodies = st.one_of(
    json_values,
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
    st.fixed_dictionaries(
        {"prompt": st.text(max_size=40)},
        # a whole answer or a 4xx whatever its length: short ones keep 1000 bodies quick
        optional={"max_tokens": st.integers(-5, 16), "temperature": st.floats(0, 3),
                  "stop": st.lists(st.text(max_size=4), max_size=3), "stream": st.booleans()},
    ),
)


def assert_well_formed(response: httpx.Response, body: Any) -> None:
    """A 200 is a whole answer: JSON with a choice and usage, or an SSE stream of JSON chunks that
    ends in [DONE] and carries no error event."""
    assert response.status_code == 200, (response.status_code, response.text, body)
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (events, body)
        chunks = [json.loads(event) for event in events[:-1]]
        assert chunks and not any("error" in chunk for chunk in chunks), (chunks, body)
        assert all(isinstance(chunk["choices"], list) for chunk in chunks)
        return
    answer = response.json()
    [choice] = answer["choices"]
    assert choice["finish_reason"] in ("stop", "length"), answer
    assert isinstance(choice.get("text", choice.get("message", {}).get("content")), str), answer
    assert answer["usage"]["completion_tokens"] >= 1, answer


def assert_openai_error(response: httpx.Response, body: Any) -> dict[str, Any]:
    assert 400 <= response.status_code < 500, (response.status_code, response.text, body)
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], (error, body)
    return error


WORDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz ,.", min_size=1, max_size=40)
valid_sampling = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 12)},
    optional={"temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(0, 50),
              "seed": st.integers(0, 1000), "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
              "stream": st.booleans(), "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0, 3),
              "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
              "frequency_context_size": st.integers(0, 64),
              "logit_bias": st.dictionaries(st.integers(0, 255).map(str), st.floats(-100, 100), max_size=3)},
)
valid_calls = st.one_of(
    st.tuples(st.just("/v1/completions"), st.builds(lambda p, s: {"prompt": p, **s}, WORDS, valid_sampling)),
    st.tuples(st.just("/v1/chat/completions"), st.builds(
        lambda p, s: {"messages": [{"role": "user", "content": p}], **s}, WORDS, valid_sampling)),
)
# One known violation each: (field, value, status, code, the param the error must name).
VIOLATIONS = [
    ("max_tokens", 0, 400, "invalid_request", "max_tokens"),
    ("max_tokens", -3, 400, "invalid_request", "max_tokens"),
    ("max_tokens", "many", 400, "invalid_request", "max_tokens"),
    ("temperature", 2.5, 400, "invalid_request", "temperature"),
    ("temperature", -0.1, 400, "invalid_request", "temperature"),
    ("top_p", 1.5, 400, "invalid_request", "top_p"),
    ("top_p", 0, 400, "invalid_request", "top_p"),
    ("top_k", -2, 400, "invalid_request", "top_k"),
    ("seed", "a", 400, "invalid_request", "seed"),
    ("stream", "yes", 400, "invalid_request", "stream"),
    ("stop", 5, 400, "invalid_request", "stop"),
    ("n", 17, 400, "invalid_request", "n"),
    ("min_p", 1.5, 400, "invalid_request", "min_p"),
    ("repetition_penalty", -1, 400, "invalid_request", "repetition_penalty"),
    ("presence_context_size", 2.5, 400, "invalid_request", "presence_context_size"),
    ("logit_bias", {"99999999": 1.0}, 400, "invalid_request", "logit_bias"),
    ("logit_bias", {"a": 1.0}, 400, "invalid_request", "logit_bias"),
    ("echo", True, 422, "unsupported_parameter", "echo"),
    ("model", "no-such-model", 404, "model_not_found", "model"),
]
