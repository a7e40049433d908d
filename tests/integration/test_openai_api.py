"""The OpenAI-compatible front end over a scripted fake backend, with real tiny tokenizers.

The app is driven in-process through `httpx.ASGITransport` (which buffers a streamed body whole:
fine for checking bodies), and through raw ASGI calls where a test needs the client to go away.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from adapters.frontend.app import build_app
from adapters.frontend.frontend import Frontend
from adapters.http.api_keys import ApiKeys
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, peer_error
from statecore.events import TokenLogprobs
from statecore.intents import RespondTokens
from support.tiny_models import build_tokenizer
from tests.integration.fake_backend import (
    HANG,
    FakeBackend,
    ScriptItem,
    completed,
    fake_model_info,
    rejected,
    replied,
)

CONTEXT = 64
MAX_BODY = 4096


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("byte_fallback")
    build_tokenizer(path, "byte_fallback")
    return path


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(fake_model_info(context_length=CONTEXT))


@pytest.fixture
def frontend(bpe_dir: Path, backend: FakeBackend) -> Frontend:
    return Frontend.load(bpe_dir, backend, max_body_bytes=MAX_BODY)


def say(frontend: Frontend, text: str, end: str = "length") -> list[ScriptItem]:
    """The script of a backend that generates exactly `text`, then ends with `end`."""
    ids = frontend.tokenizer.encode(text, add_special_tokens=False)
    return [*(replied(int(t)) for t in ids), completed(end)]


def events(body: str) -> list[Any]:
    """SSE `data:` payloads of a streamed body, JSON-decoded except the final "[DONE]"."""
    assert body.endswith("\n\n")
    out: list[Any] = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def strip_ids(obj: Any) -> Any:
    return {k: v for k, v in obj.items() if k not in ("id", "created")} if isinstance(obj, dict) else obj


def streamed_text(chunks: Sequence[Any]) -> str:
    parts = []
    for chunk in chunks:
        if isinstance(chunk, dict) and chunk.get("choices"):
            choice = chunk["choices"][0]
            parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(parts)


async def good_request(client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend) -> None:
    backend.scripts.append(say(frontend, "Hello world"))
    response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "Hello world"


# ---------------------------------------------------------------------------------------------
# Happy paths


async def test_completion_body_shape_and_usage(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.scripts.append(say(frontend, "Hello world"))
    response = await client.post("/v1/completions", json={"model": "tiny", "prompt": "The quick brown fox"})
    assert response.status_code == 200
    body = response.json()
    prompt_ids = frontend.tokenizer.encode("The quick brown fox")
    n_out = len(say(frontend, "Hello world")) - 1
    assert strip_ids(body) == {
        "object": "text_completion",
        "model": "tiny",
        "choices": [{"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": n_out,
            "total_tokens": len(prompt_ids) + n_out,
        },
    }
    request_id = response.headers["x-request-id"]
    assert len(request_id) == 32
    assert body["id"] == f"cmpl-{request_id}"
    assert isinstance(body["created"], int)
    started = backend.last.request
    assert started.request_id == request_id
    assert started.prompt == tuple(prompt_ids)
    assert started.prompt[0] == frontend.tokenizer.bos_token_id  # the tokenizer's default specials
    assert started.sampling.max_tokens == 16
    assert (started.sampling.temperature, started.sampling.top_p, started.sampling.top_k) == (1.0, 1.0, 0)
    assert started.sampling.seed is None


async def test_chat_body_shape_prompt_and_default_max_tokens(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.scripts.append(say(frontend, "Hello world", end="stop"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    response = await client.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 200
    body = response.json()
    prompt = frontend.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert strip_ids(body) == {
        "object": "chat.completion",
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello world"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        # 7 tokens of text and the EOS token that ended it (counted, as vLLM and mlx-lm count it)
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": 8, "total_tokens": len(prompt) + 8},
    }
    assert body["id"] == "chatcmpl-" + response.headers["x-request-id"]
    assert backend.last.request.prompt == tuple(prompt)
    assert backend.last.request.sampling.max_tokens == CONTEXT - len(prompt)


async def test_sampling_parameters_and_token_prompt(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.default_script = say(frontend, "ok")
    params = {"temperature": 0.5, "top_p": 0.9, "top_k": -1, "seed": 7, "max_tokens": 5}
    response = await client.post("/v1/completions", json={"prompt": [5, 6, 7], **params})
    assert response.status_code == 200
    started = backend.last.request
    assert started.prompt == (5, 6, 7)
    sampling = started.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed) == (0.5, 0.9, 0, 7)
    assert sampling.max_tokens == 5
    # chat: content parts, max_completion_tokens, integer temperature
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}
    ]
    body = {"messages": messages, "max_completion_tokens": 3, "temperature": 0, "top_k": 4}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    expected = frontend.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi\nthere"}], add_generation_prompt=True, tokenize=True
    )
    assert backend.last.request.prompt == tuple(expected)
    assert backend.last.request.sampling.max_tokens == 3
    assert backend.last.request.sampling.greedy
    assert backend.last.request.sampling.top_k == 4


async def test_logits_shaping_parameters_reach_the_engine_under_mlx_lms_names(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.default_script = say(frontend, "ok")
    params = {"min_p": 0.1, "logit_bias": {"12": 2.5, "3": -100}, "repetition_penalty": 1.2,
              "repetition_context_size": 40, "presence_penalty": -0.5, "frequency_penalty": 1,
              "frequency_context_size": 0}
    response = await client.post("/v1/completions", json={"prompt": "Hi", **params})
    assert response.status_code == 200, response.text
    sampling = backend.last.request.sampling
    assert sampling.min_p == 0.1 and sampling.logit_bias == ((3, -100.0), (12, 2.5))
    assert (sampling.repetition_penalty, sampling.repetition_context_size) == (1.2, 40)
    assert (sampling.presence_penalty, sampling.presence_context_size) == (-0.5, 20)
    assert sampling.penalties == (("repetition", 1.2, 40), ("presence", -0.5, 20))  # context 0: off
    assert sampling.xtc_probability == 0.0  # XTC off unless asked
    response = await client.post("/v1/completions", json={"prompt": "Hi", "xtc_probability": 0.3})
    xtc = backend.last.request.sampling
    newline = frontend.tokenizer.encode("\n", add_special_tokens=False)
    assert (xtc.xtc_probability, xtc.xtc_threshold) == (0.3, 0.1)  # mlx_lm.server's default threshold
    assert set(xtc.xtc_special_tokens) == {*newline, *backend.model_info.eos_token_ids}
    refused = await client.post("/v1/completions", json={"prompt": "Hi", "xtc_threshold": 0.6})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "xtc_threshold"
    chat = {"messages": [{"role": "user", "content": "Hi"}], "presence_penalty": 0.3}
    response = await client.post("/v1/chat/completions", json=chat)
    assert response.status_code == 200 and backend.last.request.sampling.presence_penalty == 0.3


_BOUNDED = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "blue"]}},
            "required": ["ok", "color"], "additionalProperties": False}


async def test_response_format_reaches_the_engine_as_its_canonical_text(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.default_script = say(frontend, '{"ok": true}', "stop")
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    formats: list[tuple[dict[str, Any], str | None]] = [
        ({"type": "json_schema", "json_schema": {"name": "answer", "schema": _BOUNDED, "strict": True}},
         json.dumps({"type": "json_schema", "schema": _BOUNDED}, separators=(",", ":"))),
        ({"type": "json_object"}, '{"type":"json_object"}'),
        ({"type": "json_schema", "json_schema": {"name": "anything"}}, '{"type":"json_schema","schema":{}}'),
        ({"type": "text"}, None),
    ]
    for given, canonical in formats:
        response = await client.post("/v1/chat/completions", json={**chat, "response_format": given})
        assert response.status_code == 200, response.text
        assert backend.last.request.sampling.response_format == canonical
    # the schema's own key order is kept: it is the order the object's properties are written in
    assert list(json.loads(str(formats[0][1]))["schema"]["properties"]) == ["ok", "color"]
    response = await client.post("/v1/completions", json={"prompt": "Hi", "response_format": formats[1][0]})
    assert response.status_code == 200, response.text
    assert backend.last.request.sampling.response_format == '{"type":"json_object"}'
    assert response.json()["choices"][0]["text"] == '{"ok": true}'


@pytest.mark.parametrize(("extra", "status", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objekt"}}}},
     400, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object", "required": ["x"], "additionalProperties": False}}}},
     400, "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "a", "schema": {"$ref": "#/nowhere"}}}},
     400, "response_format"),
    ({"response_format": {"type": "json_schema"}}, 400, "response_format"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "a"}}}, 400, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "no spaces", "schema": {}}}},
     400, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_object"}, "stop": ["}"]}, 400, "stop"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, 400, "ignore_eos"),
    ({"response_format": {"type": "json_object"},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 422, "response_format"),
], ids=["bad type", "unsatisfiable", "dangling ref", "no json_schema", "json_schema with json_object",
        "bad name", "stop", "ignore_eos", "tools"])
async def test_a_response_format_that_cannot_be_enforced_is_refused_naming_it(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend, extra: dict[str, Any], status: int,
    param: str,
) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], **extra}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param, response.text
    assert backend.generations == []
    await good_request(client, backend, frontend)


async def test_a_schema_with_nan_is_refused(client: httpx.AsyncClient, backend: FakeBackend) -> None:
    body = ('{"prompt": "Hi", "response_format": {"type": "json_schema", "json_schema": {"name": "a", '
            '"schema": {"type": "number", "maximum": NaN}}}}')
    headers = {"content-type": "application/json"}
    response = await client.post("/v1/completions", content=body, headers=headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format"
    assert backend.generations == []


async def test_default_completion_max_tokens_is_cut_to_the_room_left(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.default_script = say(frontend, "ok")
    prompt = list(range(10, 10 + CONTEXT - 5))
    response = await client.post("/v1/completions", json={"prompt": prompt})
    assert response.status_code == 200
    assert backend.last.request.sampling.max_tokens == 5


async def test_harmless_unknown_and_neutral_fields_are_accepted(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.default_script = say(frontend, "ok")
    extras = {
        "user": "me",
        "metadata": {"a": "b"},
        "some_vendor_extra": [1, 2],
        "n": 1,
        "logprobs": None,
        "echo": False,
        "best_of": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "stop": None,
        "temperature": None,
        "stream": False,
        "stream_options": None,
    }
    response = await client.post("/v1/completions", json={"prompt": "Hi", **extras})
    assert response.status_code == 200, response.text
    chat_extras = {"tools": [], "logprobs": False, "response_format": {"type": "text"}, "user": "me"}
    messages = [{"role": "user", "content": "Hi", "extra": 1}]
    response = await client.post("/v1/chat/completions", json={"messages": messages, **chat_extras})
    assert response.status_code == 200, response.text


async def test_completion_streaming_matches_non_streaming(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    text = "The quick brown fox jumps, café 日本"
    backend.scripts.extend([say(frontend, text, "stop"), say(frontend, text, "stop")])
    plain = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 40})
    streamed = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 40, "stream": True})
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.headers["x-request-id"]
    chunks = events(streamed.text)
    assert chunks[-1] == "[DONE]"
    assert streamed_text(chunks) == plain.json()["choices"][0]["text"] == text
    assert len(chunks) > 3  # really incremental
    head = {"object": "text_completion", "model": "tiny"}
    response_id = "cmpl-" + streamed.headers["x-request-id"]
    for chunk in chunks[:-1]:
        assert chunk["id"] == response_id
        assert strip_ids(chunk) == {**head, "choices": chunk["choices"]}
        assert "usage" not in chunk
    for chunk in chunks[:-2]:
        assert chunk["choices"][0]["finish_reason"] is None
        assert chunk["choices"][0]["text"]
    assert chunks[-2]["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]


async def test_n_choices_are_generations_of_their_own_in_one_body(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    texts = ["alpha beta", "gamma", "delta epsilon zeta"]
    backend.scripts.extend(say(frontend, text, "stop") for text in texts)
    response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 9, "n": 3, "seed": 7},
                                 headers={"x-request-id": "abc"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (i, text, "stop") for i, text in enumerate(texts)]
    generated = [len(frontend.tokenizer.encode(t, add_special_tokens=False)) + 1 for t in texts]  # + EOS
    assert body["usage"]["completion_tokens"] == sum(generated)
    assert body["usage"]["prompt_tokens"] == len(backend.last.request.prompt)
    requests = [g.request for g in backend.generations]
    assert [r.request_id for r in requests] == ["abc", "abc.1", "abc.2"]
    assert [r.sampling.seed for r in requests] == [7, 8, 9]
    # each says which choice of which request it is (the engine decodes them side by side)
    assert [(r.sampling.choice_group, r.sampling.choice, r.sampling.choices) for r in requests] == [
        ("abc", 0, 3), ("abc", 1, 3), ("abc", 2, 3)]
    backend.scripts.extend(say(frontend, text, "stop") for text in texts[:2])
    await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 9, "n": 2})
    assert [g.request.sampling.seed for g in backend.generations[-2:]] == [None, None]  # from the ids


async def test_n_choices_stream_in_turn_with_their_own_finish_and_one_usage(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    texts = ["one two three four", "five"]
    backend.scripts.extend(say(frontend, text, "length") for text in texts)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = events((await client.post("/v1/chat/completions", json=body)).text)
    assert chunks[-1] == "[DONE]"
    deltas = [c for c in chunks[:-1] if c["choices"]]
    assert [c["choices"][0]["delta"] for c in deltas[:2]] == [{"role": "assistant", "content": ""}] * 2
    for index, text in enumerate(texts):
        mine = [c["choices"][0] for c in deltas if c["choices"][0]["index"] == index]
        assert "".join(c["delta"].get("content", "") for c in mine) == text
        assert [c["finish_reason"] for c in mine][-1] == "length" and mine[-1]["delta"] == {}
    assert [c["choices"][0]["index"] for c in deltas[2:5]] == [0, 1, 0]  # in turn, while both run
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] == sum(
        len(frontend.tokenizer.encode(t, add_special_tokens=False)) for t in texts)


@pytest.mark.parametrize("stream", [False, True])
async def test_one_failing_choice_fails_the_request_and_frees_the_others(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend, stream: bool
) -> None:
    overloaded = rejected(ErrorInfo(Fault.OVERLOADED, Code.OVERLOADED, "full"))
    backend.scripts.extend([[*say(frontend, "fine")[:-1], HANG], [overloaded]])
    response = await client.post("/v1/completions", json={"prompt": "Hi", "n": 2, "stream": stream})
    assert response.status_code == 429 and response.json()["error"]["code"] == "overloaded"
    assert backend.generations[0].cancels == 1


def with_logprobs(frontend: Frontend, text: str) -> list[ScriptItem]:
    """`say`, each token carrying a made-up logprob (-0.5 x its place) and two alternatives."""
    ids = frontend.tokenizer.encode(text, add_special_tokens=False)
    tokens = [replied(int(t), TokenLogprobs(-0.5 * i, ((int(t), -0.5 * i), (7, -9.0))))
              for i, t in enumerate(ids)]
    return [*tokens, completed("length")]


async def test_chat_logprobs_whole_and_streamed_are_openais_shape(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    text = "Hello world, again"
    ids = frontend.tokenizer.encode(text, add_special_tokens=False)
    backend.scripts.extend([with_logprobs(frontend, text), with_logprobs(frontend, text)])
    body = {"messages": _USER, "max_tokens": 30, "logprobs": True, "top_logprobs": 2}
    whole = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["logprobs"]
    assert backend.last.request.sampling.logprobs == 2
    pieces = [frontend.tokenizer.decode([t]) for t in ids]
    assert [e["token"] for e in whole["content"]] == pieces and "".join(pieces) == text
    first, seven = whole["content"][0], frontend.tokenizer.decode([7])
    assert first == {"token": pieces[0], "logprob": 0.0, "bytes": list(pieces[0].encode()), "top_logprobs": [
        {"token": pieces[0], "logprob": 0.0, "bytes": list(pieces[0].encode())},
        {"token": seven, "logprob": -9.0, "bytes": list(seven.encode())}]}
    chunks = events((await client.post("/v1/chat/completions", json={**body, "stream": True})).text)
    streamed = [e for c in chunks[:-1] if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == whole["content"]  # every token once, in order, over the chunks


async def test_completion_logprobs_are_the_legacy_shape_and_off_unless_asked(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    text = "one two"
    backend.scripts.extend([with_logprobs(frontend, text), with_logprobs(frontend, text)])
    got = (await client.post("/v1/completions", json={"prompt": "Hi", "logprobs": 1})).json()["choices"][0]
    ids = frontend.tokenizer.encode(text, add_special_tokens=False)
    pieces = [frontend.tokenizer.decode([t]) for t in ids]
    assert got["logprobs"]["tokens"] == pieces
    assert got["logprobs"]["token_logprobs"] == [-0.5 * i for i in range(len(pieces))]
    assert got["logprobs"]["text_offset"] == [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    assert got["logprobs"]["top_logprobs"][0] == {pieces[0]: 0.0, frontend.tokenizer.decode([7]): -9.0}
    plain = (await client.post("/v1/completions", json={"prompt": "Hi"})).json()["choices"][0]
    assert plain["logprobs"] is None and backend.last.request.sampling.logprobs is None


async def test_chat_streaming_with_usage(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.scripts.append(say(frontend, "Hello world", "length"))
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    chunks = events(response.text)
    assert chunks[-1] == "[DONE]"
    first, *middle, final, usage, _ = chunks
    assert strip_ids(first) == {
        "object": "chat.completion.chunk",
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "usage": None,
    }
    assert all(c["choices"][0]["delta"].keys() == {"content"} and c["usage"] is None for c in middle)
    assert streamed_text(middle) == "Hello world"
    assert final["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    assert final["usage"] is None
    prompt = len(backend.last.request.prompt)
    assert strip_ids(usage) == {
        "object": "chat.completion.chunk",
        "model": "tiny",
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": 7, "total_tokens": prompt + 7},
    }
    assert {c["id"] for c in chunks[:-1]} == {"chatcmpl-" + response.headers["x-request-id"]}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_identical_outputs_give_identical_bodies_but_for_id_and_created(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend, path: str, stream: bool
) -> None:
    backend.default_script = say(frontend, "She opened the window, and the rain… stopped", "stop")
    body: dict[str, Any] = {"max_tokens": 30, "stream": stream, "stop": ["zz"]}
    body.update(
        {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    if stream:
        body["stream_options"] = {"include_usage": True}
    first = await client.post(path, json=body)
    second = await client.post(path, json=body)
    assert first.status_code == second.status_code == 200
    if stream:
        a, b = events(first.text), events(second.text)
        assert [strip_ids(c) for c in a] == [strip_ids(c) for c in b]
        # the same encoding everywhere: compact JSON, UTF-8 kept as is
        assert '"model":"tiny"' in first.text and "…" in first.text
    else:
        assert strip_ids(first.json()) == strip_ids(second.json())
        assert '"model":"tiny"' in first.text and "…" in first.text


# ---------------------------------------------------------------------------------------------
# Stop strings


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("stop", "text", "tokens"),
    [
        ("world", "Hello ", 7),  # " w" + "or" + "ld": matched on the "ld" token
        (["xyz", "lo wor"], "Hel", 6),  # split across "ll", "o", " w", "or"
        (["o", "ll"], "He", 3),  # the earliest match wins
        ("Hello world", "", 7),
    ],
)
async def test_stop_strings(
    client: httpx.AsyncClient,
    backend: FakeBackend,
    frontend: Frontend,
    stop: str | list[str],
    text: str,
    tokens: int,
    stream: bool,
) -> None:
    script = say(frontend, "Hello world and more")
    assert [frontend.tokenizer.decode([t.tokens[0]]) for t in script[:7] if isinstance(t, RespondTokens)] == [
        "H",
        "e",
        "ll",
        "o",
        " w",
        "or",
        "ld",
    ]
    backend.scripts.append(script)
    body = {"prompt": "Hi", "max_tokens": 10, "stop": stop, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200
    if stream:
        chunks = events(response.text)
        got = streamed_text(chunks)
        finish = chunks[-3]["choices"][0]["finish_reason"]
        usage = chunks[-2]["usage"]
    else:
        choice = response.json()["choices"][0]
        got, finish, usage = choice["text"], choice["finish_reason"], response.json()["usage"]
    assert got == text
    assert finish == "stop"
    assert usage["completion_tokens"] == tokens
    assert backend.last.stops == 1
    assert backend.last.cancels == 0
    assert backend.last.yielded == tokens  # nothing was read past the stop


async def test_streaming_never_sends_a_partial_stop_string(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    """Text that could begin a stop string is held back, then released when it does not."""
    backend.scripts.append(say(frontend, "Hello world"))
    body = {"prompt": "Hi", "max_tokens": 10, "stop": "llo there", "stream": True}
    response = await client.post("/v1/completions", json=body)
    chunks = events(response.text)
    pieces = [c["choices"][0]["text"] for c in chunks[:-1]]
    assert "".join(pieces) == "Hello world"
    assert pieces[:3] == ["H", "e", "llo w"]  # "ll" and "llo" waited: they could begin "llo there"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert backend.last.stops == 0


async def test_stop_string_matched_in_the_final_flush(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    """The BPE detokenizer holds a trailing lone space until the end: a stop can match only then."""
    script = say(frontend, "Hello world ")
    last = script[-2]
    assert isinstance(last, RespondTokens) and frontend.tokenizer.decode(list(last.tokens)) == " "
    backend.scripts.append(script)
    response = await client.post("/v1/completions", json={"prompt": "Hi", "stop": "d "})
    choice = response.json()["choices"][0]
    assert choice["text"] == "Hello worl"
    assert choice["finish_reason"] == "stop"
    assert response.json()["usage"]["completion_tokens"] == len(script) - 1
    assert backend.last.stops == 0  # it had ended already


@pytest.mark.parametrize("stream", [False, True])
async def test_byte_fallback_usage_counts_tokens_not_characters(
    spm_dir: Path, backend: FakeBackend, stream: bool
) -> None:
    frontend = Frontend.load(spm_dir, backend)
    text = "café 日本"
    script = say(frontend, text)
    n_tokens = len(script) - 1
    assert n_tokens > len(text.replace(" ", "")) + 2  # several tokens make one character
    backend.scripts.append(script)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=build_app(frontend)), base_url="http://n"
    ) as c:
        body = {"prompt": "Hi", "max_tokens": 30, "stream": stream, "stream_options": {"include_usage": True}}
        if not stream:
            del body["stream_options"]
        response = await c.post("/v1/completions", json=body)
    if stream:
        chunks = events(response.text)
        got, usage = streamed_text(chunks), chunks[-2]["usage"]
        assert all("\ufffd" not in c["choices"][0]["text"] for c in chunks[:-2])
    else:
        got, usage = response.json()["choices"][0]["text"], response.json()["usage"]
    assert got.strip() == text
    assert usage["completion_tokens"] == n_tokens


# ---------------------------------------------------------------------------------------------
# Bad requests: the right status and shape, and the next good request still works


def _json(obj: object) -> bytes:
    return json.dumps(obj).encode()


_USER = [{"role": "user", "content": "Hi"}]

BAD_REQUESTS: list[tuple[str, str, bytes, int, str]] = [
    ("malformed json", "/v1/completions", b'{"prompt": "Hi",', 400, "invalid_json"),
    ("not utf-8", "/v1/completions", b'{"prompt": "\xff"}', 400, "invalid_json"),
    ("deep nesting", "/v1/completions", b"[" * 4000, 400, "invalid_json"),
    ("array body", "/v1/completions", b"[1, 2]", 400, "invalid_request"),
    ("string body", "/v1/completions", b'"hi"', 400, "invalid_request"),
    ("empty body", "/v1/completions", b"", 400, "invalid_json"),
    ("missing prompt", "/v1/completions", _json({"max_tokens": 3}), 400, "invalid_request"),
    ("prompt wrong type", "/v1/completions", _json({"prompt": 5}), 400, "invalid_request"),
    ("batched prompt", "/v1/completions", _json({"prompt": ["a", "b"]}), 400, "invalid_request"),
    (
        "max_tokens string",
        "/v1/completions",
        _json({"prompt": "Hi", "max_tokens": "5"}),
        400,
        "invalid_request",
    ),
    (
        "max_tokens bool",
        "/v1/completions",
        _json({"prompt": "Hi", "max_tokens": True}),
        400,
        "invalid_request",
    ),
    (
        "max_tokens float",
        "/v1/completions",
        _json({"prompt": "Hi", "max_tokens": 5.0}),
        400,
        "invalid_request",
    ),
    ("max_tokens zero", "/v1/completions", _json({"prompt": "Hi", "max_tokens": 0}), 400, "invalid_request"),
    (
        "max_tokens negative",
        "/v1/completions",
        _json({"prompt": "Hi", "max_tokens": -2}),
        400,
        "invalid_request",
    ),
    (
        "temperature string",
        "/v1/completions",
        _json({"prompt": "Hi", "temperature": "hot"}),
        400,
        "invalid_request",
    ),
    (
        "temperature negative",
        "/v1/completions",
        _json({"prompt": "Hi", "temperature": -1}),
        400,
        "invalid_request",
    ),
    ("temperature NaN", "/v1/completions", b'{"prompt": "Hi", "temperature": NaN}', 400, "invalid_request"),
    ("top_p zero", "/v1/completions", _json({"prompt": "Hi", "top_p": 0}), 400, "invalid_request"),
    ("seed float", "/v1/completions", _json({"prompt": "Hi", "seed": 1.5}), 400, "invalid_request"),
    ("stream string", "/v1/completions", _json({"prompt": "Hi", "stream": "yes"}), 400, "invalid_request"),
    ("stop number", "/v1/completions", _json({"prompt": "Hi", "stop": 3}), 400, "invalid_request"),
    (
        "too many stops",
        "/v1/completions",
        _json({"prompt": "Hi", "stop": ["a"] * 17}),
        400,
        "invalid_request",
    ),
    ("empty prompt", "/v1/completions", _json({"prompt": ""}), 400, "invalid_request"),
    ("empty token prompt", "/v1/completions", _json({"prompt": []}), 400, "invalid_request"),
    ("token out of vocab", "/v1/completions", _json({"prompt": [1, 512]}), 400, "invalid_request"),
    ("negative token", "/v1/completions", _json({"prompt": [-1]}), 400, "invalid_request"),
    (
        "stream_options without stream",
        "/v1/completions",
        _json({"prompt": "Hi", "stream_options": {"include_usage": True}}),
        400,
        "invalid_request",
    ),
    (
        "max_tokens beyond context",
        "/v1/completions",
        _json({"prompt": "Hi", "max_tokens": CONTEXT}),
        400,
        "context_length_exceeded",
    ),
    (
        "prompt fills the context",
        "/v1/completions",
        _json({"prompt": list(range(CONTEXT))}),
        400,
        "context_length_exceeded",
    ),
    (
        "long text prompt",
        "/v1/completions",
        _json({"prompt": "The quick brown fox jumps over the lazy dog. " * 10}),
        400,
        "context_length_exceeded",
    ),
    ("n is 17", "/v1/completions", _json({"prompt": "Hi", "n": 17}), 400, "invalid_request"),
    ("n is 0", "/v1/completions", _json({"prompt": "Hi", "n": 0}), 400, "invalid_request"),
    ("logprobs over 20", "/v1/completions", _json({"prompt": "Hi", "logprobs": 21}), 400, "invalid_request"),
    ("logprobs as a bool on completions", "/v1/completions", _json({"prompt": "Hi", "logprobs": True}), 400,
     "invalid_request"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     _json({"messages": _USER, "top_logprobs": 2}), 400, "invalid_request"),
    ("best_of", "/v1/completions", _json({"prompt": "Hi", "best_of": 3}), 422, "unsupported_parameter"),
    ("echo", "/v1/completions", _json({"prompt": "Hi", "echo": True}), 422, "unsupported_parameter"),
    ("web_search_options", "/v1/chat/completions", _json({"messages": _USER, "web_search_options": {}}), 422,
     "unsupported_parameter"),
    ("min_p over 1", "/v1/completions", _json({"prompt": "Hi", "min_p": 1.5}), 400, "invalid_request"),
    ("negative repetition penalty", "/v1/completions", _json({"prompt": "Hi", "repetition_penalty": -1}), 400,
     "invalid_request"),
    ("logit_bias id outside the vocabulary", "/v1/completions",
     _json({"prompt": "Hi", "logit_bias": {"99999999": 5}}), 400, "invalid_request"),
    ("logit_bias key not a number", "/v1/completions", _json({"prompt": "Hi", "logit_bias": {"x": 5}}), 400,
     "invalid_request"),
    ("logit_bias value not a number", "/v1/completions",
     _json({"prompt": "Hi", "logit_bias": {"3": "up"}}), 400, "invalid_request"),
    ("unknown model", "/v1/completions", _json({"prompt": "Hi", "model": "gpt-4"}), 404, "model_not_found"),
    ("body too large", "/v1/completions", _json({"prompt": "x" * MAX_BODY}), 413, "body_too_large"),
    ("chat no messages", "/v1/chat/completions", _json({"messages": []}), 400, "invalid_request"),
    ("chat missing messages", "/v1/chat/completions", _json({"prompt": "Hi"}), 400, "invalid_request"),
    ("chat messages string", "/v1/chat/completions", _json({"messages": "Hi"}), 400, "invalid_request"),
    (
        "chat unknown role",
        "/v1/chat/completions",
        _json({"messages": [{"role": "tool", "content": "x"}]}),
        400,
        "invalid_request",
    ),
    (
        "chat null content",
        "/v1/chat/completions",
        _json({"messages": [{"role": "user", "content": None}]}),
        400,
        "invalid_request",
    ),
    (
        "chat image part",
        "/v1/chat/completions",
        _json(
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
        ),
        400,
        "invalid_request",
    ),
    (
        "chat max_completion_tokens zero",
        "/v1/chat/completions",
        _json({"messages": _USER, "max_completion_tokens": 0}),
        400,
        "invalid_request",
    ),
    (
        "chat max_tokens beyond context",
        "/v1/chat/completions",
        _json({"messages": _USER, "max_tokens": CONTEXT}),
        400,
        "context_length_exceeded",
    ),
    (
        "chat legacy functions",
        "/v1/chat/completions",
        _json({"messages": _USER, "functions": [{"name": "f"}]}),
        422,
        "unsupported_parameter",
    ),
    (
        "chat logprobs as a count",
        "/v1/chat/completions",
        _json({"messages": _USER, "logprobs": 2}),
        400,
        "invalid_request",
    ),
    (
        "chat response_format of an unknown type",
        "/v1/chat/completions",
        _json({"messages": _USER, "response_format": {"type": "regex"}}),
        400,
        "invalid_request",
    ),
    (
        "chat unknown model",
        "/v1/chat/completions",
        _json({"messages": _USER, "model": "x"}),
        404,
        "model_not_found",
    ),
]


@pytest.mark.parametrize(
    ("path", "content", "status", "code"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
async def test_bad_request(
    client: httpx.AsyncClient,
    backend: FakeBackend,
    frontend: Frontend,
    path: str,
    content: bytes,
    status: int,
    code: str,
) -> None:
    response = await client.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    assert response.headers["x-request-id"]
    assert backend.generations == []  # nothing reached the backend
    await good_request(client, backend, frontend)


async def test_validation_message_names_the_field(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 0})
    assert "max_tokens" in response.json()["error"]["message"]
    response = await client.post("/v1/completions", json={"prompt": "Hi", "echo": True, "best_of": 2})
    assert response.json()["error"]["message"].startswith("unsupported parameters: best_of, echo")


async def test_body_too_large_by_content_length_alone(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b"x" * 10
        raise AssertionError("the body should not have been read")  # pragma: no cover

    response = await client.post(
        "/v1/completions", content=body(), headers={"content-length": str(MAX_BODY + 1)}
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "body_too_large"
    await good_request(client, backend, frontend)


async def test_unknown_route_and_wrong_method_have_the_openai_shape(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/nope")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "invalid_request_error"
    response = await client.get("/v1/completions")
    assert response.status_code == 405
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


async def test_one_model_by_its_id(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/models/tiny")
    assert response.status_code == 200
    assert {k: v for k, v in response.json().items() if k != "created"} == {
        "id": "tiny", "object": "model", "owned_by": "statecore"}
    missing = await client.get("/v1/models/mlx-community/other")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    assert missing.json()["error"]["param"] == "model"


async def test_validation_errors_name_the_field_as_the_client_wrote_it(client: httpx.AsyncClient) -> None:
    """No pydantic internals (`messages.0.content.list[_TextPart]...`); OpenAI's `param`."""
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    error = (await client.post("/v1/chat/completions", json=body)).json()["error"]
    assert error["param"] == "messages[0].content[0].text", error
    assert "_TextPart" not in error["message"] and "list[" not in error["message"], error
    assert error["message"].startswith("invalid request: messages[0].content"), error


@pytest.mark.parametrize(("temperature", "status"), [(0.0, 200), (2.0, 200), (2.5, 400), (5, 400)])
async def test_temperature_is_in_openais_range(client: httpx.AsyncClient, backend: FakeBackend,
                                               frontend: Frontend, temperature: float, status: int) -> None:
    backend.default_script = say(frontend, "Hi")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": temperature}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == status, response.text
    if status == 400:
        assert response.json()["error"]["param"] == "temperature"


# ---------------------------------------------------------------------------------------------
# Backend failures


@pytest.mark.parametrize(
    ("error", "status", "code", "kind"),
    [
        (
            StatecoreError(ErrorInfo(Fault.OVERLOADED, Code.OVERLOADED, "busy")),
            429,
            "overloaded",
            "server_overloaded",
        ),
        (
            StatecoreError(ErrorInfo(Fault.TRANSPORT, Code.NO_HEALTHY_PEER, "none")),
            503,
            "no_healthy_peer",
            None,
        ),
        (
            StatecoreError(ErrorInfo(Fault.UNSUPPORTED, Code.UNSUPPORTED_CACHE, "no")),
            422,
            "unsupported_cache",
            None,
        ),
        (RuntimeError("boom"), 500, "internal_error", "server_error"),
    ],
)
async def test_backend_start_errors(
    client: httpx.AsyncClient,
    backend: FakeBackend,
    frontend: Frontend,
    error: BaseException,
    status: int,
    code: str,
    kind: str | None,
) -> None:
    backend.start_error = error
    response = await client.post("/v1/chat/completions", json={"messages": _USER, "stream": True})
    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    if kind is not None:
        assert response.json()["error"]["type"] == kind
    assert "boom" not in response.text  # internals are logged, not sent
    backend.start_error = None
    await good_request(client, backend, frontend)


async def test_generation_error_non_streaming(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    info = peer_error("the decode node went away")
    backend.scripts.append([*say(frontend, "Hello")[:-1], rejected(info)])
    response = await client.post("/v1/completions", json={"prompt": "Hi"})
    assert response.status_code == 502
    assert response.json() == info.to_openai()
    assert response.headers["x-request-id"]
    assert backend.last.cancels == 0
    await good_request(client, backend, frontend)


async def test_generation_error_mid_stream(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    info = peer_error("the decode node went away")
    backend.scripts.append([*say(frontend, "Hello")[:-1], rejected(info)])
    body = {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200
    chunks = events(response.text)
    assert streamed_text(chunks[:-2]) == "Hello"
    assert chunks[-2] == info.to_openai()
    assert chunks[-1] == "[DONE]"
    await good_request(client, backend, frontend)


async def test_generation_error_before_any_text_streaming_gets_its_status(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    info = ErrorInfo(Fault.UNSUPPORTED, Code.UNSUPPORTED_CACHE, "this cache cannot travel")
    backend.scripts.append([rejected(info)])
    response = await client.post("/v1/chat/completions", json={"messages": _USER, "stream": True})
    assert response.status_code == 422
    assert response.json() == info.to_openai()


@pytest.mark.parametrize("stream", [False, True])
async def test_backend_iterator_raising_is_an_internal_error(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend, stream: bool
) -> None:
    backend.scripts.append([*say(frontend, "Hello world")[:-1], RuntimeError("kaboom")])
    response = await client.post("/v1/completions", json={"prompt": "Hi", "stream": stream})
    if stream:
        assert response.status_code == 200
        chunks = events(response.text)
        assert chunks[-2]["error"]["code"] == "internal_error"
        assert chunks[-1] == "[DONE]"
    else:
        assert response.status_code == 500
        assert response.json()["error"]["code"] == "internal_error"
    assert "kaboom" not in response.text
    assert backend.last.cancels == 1
    await good_request(client, backend, frontend)


async def test_backend_ending_without_an_end_is_a_bug(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.scripts.append(say(frontend, "Hello")[:-1])
    response = await client.post("/v1/completions", json={"prompt": "Hi"})
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"


async def test_immediate_end_streams_an_empty_completion(
    client: httpx.AsyncClient, backend: FakeBackend
) -> None:
    backend.scripts.append([completed("stop")])
    response = await client.post("/v1/chat/completions", json={"messages": _USER, "stream": True})
    chunks = events(response.text)
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [{"role": "assistant", "content": ""}, {}]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


# ---------------------------------------------------------------------------------------------
# Health, models, request ids, extra routes


async def test_health_follows_backend_ready(client: httpx.AsyncClient, backend: FakeBackend) -> None:
    response = await client.get("/health")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})
    backend.is_ready = False
    response = await client.get("/health")
    assert response.status_code == 503
    backend.is_ready = True
    assert (await client.get("/health")).status_code == 200


async def test_models_lists_the_one_model(bpe_dir: Path, backend: FakeBackend) -> None:
    frontend = Frontend.load(bpe_dir, backend, model_name="served-name")
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=build_app(frontend)), base_url="http://n"
    ) as c:
        body = (await c.get("/v1/models")).json()
        assert body["object"] == "list"
        assert [(m["id"], m["object"]) for m in body["data"]] == [("served-name", "model")]
        backend.default_script = [completed("stop")]
        ok = await c.post("/v1/completions", json={"prompt": "Hi", "model": "served-name"})
        assert ok.status_code == 200
        assert ok.json()["model"] == "served-name"
        wrong = await c.post("/v1/completions", json={"prompt": "Hi", "model": "tiny"})
        assert wrong.status_code == 404


async def test_incoming_request_id_is_used_and_echoed(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.default_script = say(frontend, "ok")
    response = await client.post(
        "/v1/completions", json={"prompt": "Hi"}, headers={"X-Request-Id": "trace.42-a_b"}
    )
    assert response.headers["x-request-id"] == "trace.42-a_b"
    assert response.json()["id"] == "cmpl-trace.42-a_b"
    assert backend.last.request.request_id == "trace.42-a_b"
    response = await client.post(
        "/v1/chat/completions", json={"messages": _USER, "stream": True}, headers={"X-Request-Id": "r2"}
    )
    assert response.headers["x-request-id"] == "r2"
    assert events(response.text)[0]["id"] == "chatcmpl-r2"
    bad = await client.post(
        "/v1/completions", json={"prompt": "Hi"}, headers={"X-Request-Id": "no spaces/here"}
    )
    assert bad.status_code == 400
    assert bad.headers["x-request-id"] != "no spaces/here"
    error = await client.post("/v1/completions", json={"prompt": ""}, headers={"X-Request-Id": "r3"})
    assert error.headers["x-request-id"] == "r3"


async def test_extra_routes_are_served(frontend: Frontend) -> None:
    async def ping(request: Request) -> Response:
        return PlainTextResponse("pong")

    app = build_app(frontend, extra_routes=[Route("/internal/ping", ping)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://n") as c:
        assert (await c.get("/internal/ping")).text == "pong"
        assert (await c.get("/health")).status_code == 200


# ---------------------------------------------------------------------------------------------
# Client disconnects


async def _call_until_disconnect(
    app: Starlette, path: str, body: dict[str, Any], disconnect: trio.Event
) -> list[dict[str, Any]]:
    """One raw ASGI request whose client disconnects once `disconnect` is set."""
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": _json(body), "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(dict(message))

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"node")],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 8000),
    }
    with trio.fail_after(10):
        await app(scope, receive, send)
    return sent


async def test_client_disconnect_mid_stream_cancels(
    app: Starlette, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.scripts.append([*say(frontend, "Hello world")[:-1], HANG])
    disconnect = trio.Event()

    async def watch() -> None:
        while not (backend.generations and backend.last.yielded >= 3):
            await trio.sleep(0.001)
        disconnect.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        sent = await _call_until_disconnect(
            app, "/v1/completions", {"prompt": "Hi", "stream": True}, disconnect
        )
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert b"data: " in b"".join(m.get("body", b"") for m in sent)
    assert backend.last.cancels == 1
    assert backend.last.stops == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_before_output_cancels(
    app: Starlette, backend: FakeBackend, stream: bool
) -> None:
    backend.scripts.append([HANG])
    disconnect = trio.Event()

    async def watch() -> None:
        while not backend.generations:
            await trio.sleep(0.001)
        disconnect.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        body = {"messages": _USER, "stream": stream}
        sent = await _call_until_disconnect(app, "/v1/chat/completions", body, disconnect)
    assert sent[0]["status"] == 499
    assert backend.last.cancels == 1


async def test_completed_stream_does_not_cancel(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.scripts.append(say(frontend, "Hello"))
    response = await client.post("/v1/completions", json={"prompt": "Hi", "stream": True})
    assert events(response.text)[-1] == "[DONE]"
    assert backend.last.cancels == 0
    assert backend.last.stops == 0


async def test_disconnect_as_the_stream_opens_cancels(
    app: Starlette, backend: FakeBackend, frontend: Frontend
) -> None:
    """The client goes away between the first text and the first byte sent: still cancelled."""
    for _ in range(20):
        backend.scripts.append([*say(frontend, "Hello world")[:-1], HANG])
        calls = 0

        async def receive() -> dict[str, Any]:
            nonlocal calls
            calls += 1
            if calls == 1:
                return {
                    "type": "http.request",
                    "body": _json({"prompt": "Hi", "stream": True}),
                    "more_body": False,
                }
            if calls == 2:  # the front end's own watch while it waits for the first text
                await trio.sleep_forever()
            return {"type": "http.disconnect"}

        async def send(message: Any) -> None:
            await trio.lowlevel.checkpoint()

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "headers": [],
            "query_string": b"",
        }
        with trio.fail_after(10):
            await app(scope, receive, send)
        assert backend.last.cancels == 1


# ---------------------------------------------------------------------------------------------
# Over a real socket (hypercorn): how a streamed exchange ends


async def _raw_exchange(stream: trio.SocketStream, request: bytes) -> bytes:
    """Send one request; read until the chunked body's last chunk."""
    await stream.send_all(request)
    received = b""
    while not received.endswith(b"0\r\n\r\n"):
        chunk = await stream.receive_some(65536)
        assert chunk, f"the connection closed mid-response: {received[-200:]!r}"
        received += chunk
    return received


@pytest.mark.parametrize("connection", ["close", "keep-alive"])
async def test_a_streamed_response_ends_the_exchange_as_the_client_asked(
    app: Starlette, backend: FakeBackend, frontend: Frontend, nursery: trio.Nursery, connection: str
) -> None:
    """`Connection: close`: the server closes the socket after the stream. Keep-alive: the same
    connection serves the next request. (The disconnect watcher once cancelled the server's own
    end-of-exchange work: a `close` client waited forever for the socket to close.)"""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from adapters.serve.listeners import open_listener

    listener = open_listener("127.0.0.1", 0)
    port = listener.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{listener.detach()}"]
    config.accesslog = None
    stop = trio.Event()
    await nursery.start(lambda task_status: serve(app, config,  # type: ignore[arg-type]
                                                  shutdown_trigger=stop.wait, task_status=task_status))
    body = json.dumps({"prompt": "Hi", "max_tokens": 8, "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: n\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\nConnection: %s\r\n\r\n%s" % (len(body), connection.encode(), body))
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            for _ in range(1 if connection == "close" else 2):
                backend.scripts.append(say(frontend, "Hello world"))
                answer = await _raw_exchange(stream, request)
                assert answer.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in answer
            if connection == "close":
                with trio.fail_after(5):
                    assert await stream.receive_some(65536) == b""
    finally:
        stop.set()


async def test_an_answer_before_the_body_was_read_closes_the_connection(client: httpx.AsyncClient) -> None:
    """A 413 on the declared length leaves the body unread: the server must say it closes the
    connection, or a keep-alive client sends its next request into a dropped one."""
    big = await client.post("/v1/completions", content=b"x" * (MAX_BODY + 1),
                            headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.headers["connection"] == "close"
    read = await client.post("/v1/completions", content=b'{"prompt": 5',
                             headers={"content-type": "application/json"})
    assert read.status_code == 400 and read.headers.get("connection") != "close"


# ---------------------------------------------------------------------------------------------
# /tokenize and /detokenize


async def test_tokenize_gives_the_ids_a_completion_is_fed_and_detokenize_gives_the_text_back(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    text = "The quick brown fox"
    backend.default_script = say(frontend, "ok")
    completion = await client.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
    fed = list(backend.last.request.prompt)
    response = await client.post("/tokenize", json={"prompt": text, "model": "tiny"})
    assert response.status_code == 200, response.text
    assert response.json() == {"tokens": fed, "count": len(fed), "max_model_len": CONTEXT}
    assert response.json()["count"] == completion.json()["usage"]["prompt_tokens"]
    assert fed[0] == frontend.tokenizer.bos_token_id  # the completions path adds the specials
    plain = (await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})).json()
    assert plain["tokens"] == fed[1:]
    back = await client.post("/detokenize", json={"tokens": plain["tokens"], "model": "tiny"})
    assert (back.status_code, back.json()) == (200, {"prompt": text})
    with_bos = (await client.post("/detokenize", json={"tokens": fed})).json()["prompt"]
    assert with_bos == frontend.tokenizer.decode(fed) and with_bos != text  # specials are kept
    empty = await client.post("/detokenize", json={"tokens": []})
    assert (empty.status_code, empty.json()) == (200, {"prompt": ""})


async def test_tokenize_messages_gives_what_a_chat_completion_is_fed(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    backend.default_script = say(frontend, "ok")
    chat = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    fed = list(backend.last.request.prompt)
    response = await client.post("/tokenize", json={"messages": messages, "add_special_tokens": False})
    assert response.status_code == 200, response.text
    assert response.json() == {"tokens": fed, "count": len(fed), "max_model_len": CONTEXT}
    assert response.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    prompt_only = (await client.post("/tokenize", json={"prompt": "Hi there"})).json()
    assert prompt_only["tokens"] != fed  # the template made a difference


BAD_TOKENIZE: list[tuple[str, str, bytes, int, str, str | None]] = [
    ("not json", "/tokenize", b"{nope", 400, "invalid_json", None),
    ("not an object", "/tokenize", _json(["Hi"]), 400, "invalid_request", None),
    ("nothing to tokenize", "/tokenize", _json({}), 400, "invalid_request", "prompt"),
    ("prompt not a string", "/tokenize", _json({"prompt": [1, 2]}), 400, "invalid_request", "prompt"),
    ("unknown field", "/tokenize", _json({"prompt": "Hi", "max_tokens": 3}), 400, "invalid_request",
     "max_tokens"),
    ("both prompt and messages", "/tokenize", _json({"prompt": "Hi", "messages": _USER}), 400,
     "invalid_request", "messages"),
    ("no messages", "/tokenize", _json({"messages": []}), 400, "invalid_request", "messages"),
    ("chat special tokens", "/tokenize", _json({"messages": _USER, "add_special_tokens": True}), 400,
     "invalid_request", "add_special_tokens"),
    ("specials not a bool", "/tokenize", _json({"prompt": "Hi", "add_special_tokens": 1}), 400,
     "invalid_request", "add_special_tokens"),
    ("unknown model", "/tokenize", _json({"prompt": "Hi", "model": "x"}), 404, "model_not_found", "model"),
    ("too large", "/tokenize", _json({"prompt": "x" * MAX_BODY}), 413, "body_too_large", None),
    ("id past the vocabulary", "/detokenize", _json({"tokens": [5, 512]}), 400, "invalid_request", "tokens"),
    ("negative id", "/detokenize", _json({"tokens": [-1]}), 400, "invalid_request", "tokens"),
    ("id not an int", "/detokenize", _json({"tokens": [5.0]}), 400, "invalid_request", "tokens[0]"),
    ("no tokens", "/detokenize", _json({"prompt": "Hi"}), 400, "invalid_request", "tokens"),
    ("detokenize unknown model", "/detokenize", _json({"tokens": [5], "model": "x"}), 404, "model_not_found",
     "model"),
]


@pytest.mark.parametrize(
    ("path", "content", "status", "code", "param"),
    [case[1:] for case in BAD_TOKENIZE],
    ids=[case[0] for case in BAD_TOKENIZE],
)
async def test_bad_tokenize_bodies(client: httpx.AsyncClient, path: str, content: bytes, status: int,
                                   code: str, param: str | None) -> None:
    response = await client.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["type"]) == (code, "invalid_request_error")
    if param is not None:
        assert error["param"] == param, error
    assert (await client.post("/tokenize", json={"prompt": "Hi"})).status_code == 200


# ---------------------------------------------------------------------------------------------
# API keys and CORS

KEYS = ApiKeys(("key-one", "key-two"))
ORIGIN = "https://app.example"


PUBLIC_REQUESTS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": _USER, "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/tiny", None),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [5, 6]}),
]


def _keyed_client(frontend: Frontend, **options: Any) -> httpx.AsyncClient:
    """A client of an app with `build_app(**options)` and a node's other paths beside the API."""
    extra = [Route("/metrics", lambda r: PlainTextResponse("m 1\n"), methods=["GET"]),
             Route("/internal/stats", lambda r: PlainTextResponse("{}"), methods=["GET"]),
             Route("/ui", lambda r: PlainTextResponse("<html>"), methods=["GET"])]
    app = build_app(frontend, extra_routes=extra, **options)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node")


async def test_every_public_path_needs_one_of_the_keys(backend: FakeBackend, frontend: Frontend) -> None:
    backend.default_script = say(frontend, "ok")
    async with _keyed_client(frontend, api_keys=KEYS) as c:
        for method, path, body in [*PUBLIC_REQUESTS, ("GET", "/v1/nope", None)]:
            wrong = 'Bearer error="invalid_token"'
            for headers, challenge in [({}, "Bearer"), ({"Authorization": "Bearer key-three"}, wrong),
                                       ({"x-api-key": "key-one-and-more"}, wrong),
                                       ({"Authorization": "Basic key-one"}, "Bearer")]:
                refused = await c.request(method, path, json=body, headers=headers)
                assert refused.status_code == 401, (path, headers, refused.text)
                assert refused.headers["www-authenticate"] == challenge
                error = refused.json()["error"]
                assert (error["code"], error["type"]) == ("invalid_api_key", "invalid_request_error")
                assert error["message"]
                assert (refused.headers.get("connection") == "close") == (body is not None)
        assert backend.generations == []  # nothing got past the guard
        for method, path, body in PUBLIC_REQUESTS:
            for headers in [{"Authorization": "Bearer key-one"}, {"authorization": "bearer key-two"},
                            {"x-api-key": "key-two"}]:
                served = await c.request(method, path, json=body, headers=headers)
                assert served.status_code == 200, (path, headers, served.text)
        assert len(backend.generations) == 6


async def test_health_and_metrics_stay_open_unless_the_key_protects_them(frontend: Frontend) -> None:
    key = {"x-api-key": "key-one"}
    async with _keyed_client(frontend, api_keys=KEYS) as c:
        for path in ("/health", "/metrics", "/ui", "/internal/stats"):
            assert (await c.get(path)).status_code == 200, path
        assert (await c.get("/v1/models")).status_code == 401
    protected = ApiKeys(KEYS.keys, frozenset({"health", "metrics"}))
    async with _keyed_client(frontend, api_keys=protected) as c:
        for path in ("/health", "/metrics"):
            assert (await c.get(path)).status_code == 401, path
            assert (await c.get(path, headers=key)).status_code == 200, path
        assert (await c.get("/ui")).status_code == 200
        assert (await c.get("/internal/stats")).status_code == 200  # its own token, not the API key
    assert not ApiKeys(KEYS.keys, frozenset({"ui"})).guards("/internal/kv/1")
    assert ApiKeys(KEYS.keys, frozenset({"ui"})).guards("/ui/events")
    with pytest.raises(ValueError, match="docs"):
        ApiKeys(KEYS.keys, frozenset({"docs"}))


async def test_cors_answers_a_preflight_without_a_key_and_marks_real_responses(
    backend: FakeBackend, frontend: Frontend
) -> None:
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, x-api-key, content-type, x-stainless-os"}
    async with _keyed_client(frontend, api_keys=KEYS, allowed_origins=[ORIGIN]) as c:
        answer = await c.options("/v1/chat/completions", headers=preflight)
        assert answer.status_code == 200, answer.text
        assert answer.headers["access-control-allow-origin"] == ORIGIN
        allowed = {h.strip().lower() for h in answer.headers["access-control-allow-headers"].split(",")}
        assert {"authorization", "x-api-key", "content-type"} <= allowed
        assert "POST" in answer.headers["access-control-allow-methods"]
        stranger = await c.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert stranger.status_code == 400 and "access-control-allow-origin" not in stranger.headers
        real = await c.post("/tokenize", json={"prompt": "Hi"},
                            headers={"Origin": ORIGIN, "x-api-key": "key-one"})
        assert real.status_code == 200
        assert real.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in real.headers["access-control-expose-headers"].lower()
        refused = await c.post("/tokenize", json={"prompt": "Hi"}, headers={"Origin": ORIGIN})
        assert refused.status_code == 401  # and the page may read why
        assert refused.headers["access-control-allow-origin"] == ORIGIN
        other = await c.get("/v1/models", headers={"Origin": "https://evil.example", "x-api-key": "key-one"})
        assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    async with _keyed_client(frontend, allowed_origins=["*"]) as c:
        anyone = await c.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert anyone.headers["access-control-allow-origin"] == "*"


async def test_no_cors_headers_by_default(client: httpx.AsyncClient) -> None:
    preflight = await client.options("/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 405
    real = await client.post("/tokenize", json={"prompt": "Hi"}, headers={"Origin": ORIGIN})
    assert real.status_code == 200
    for response in (preflight, real):
        assert not [h for h in response.headers if h.startswith("access-control-")], response.headers
