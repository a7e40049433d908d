"""Anthropic's `POST /v1/messages` and OpenAI's `POST /v1/responses` over a scripted fake backend,
through the official `anthropic` and `openai` clients and raw HTTP: the prompt is the chat
template's encoding of the equivalent chat completion, stop sequences, max tokens, streaming event
sequences, errors in each API's own shape, refusals of what is not served, and cancel on
disconnect.

The SDKs talk HTTP through `httpx2`, so they get an `httpx2.AsyncClient` over the ASGI app; raw
requests use httpx as the other front-end tests do. Both transports buffer a streamed body whole.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio
from starlette.applications import Starlette

from adapters.frontend.frontend import Frontend
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, peer_error
from statecore.events import TokenLogprobs
from tests.integration.fake_backend import (
    HANG,
    FakeBackend,
    ScriptItem,
    completed,
    fake_model_info,
    rejected,
    replied,
)
from tests.integration.scripted_text import say, token_ids

CONTEXT = 256
SYSTEM = "Be brief."
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(fake_model_info(context_length=CONTEXT))




def no_ids(doc: Any) -> Any:
    """A body without its ids and creation time, the only fields two answers may differ in."""
    if isinstance(doc, dict):
        return {k: no_ids(v) for k, v in doc.items() if k not in ("id", "created_at")}
    if isinstance(doc, list):
        return [no_ids(v) for v in doc]
    return doc


def named_events(body: str) -> list[tuple[str, Any]]:
    """(event name, JSON data) of each server-sent event; each names itself as its `type` says."""
    assert body.endswith("\n\n")
    out: list[tuple[str, Any]] = []
    for block in body.split("\n\n")[:-1]:
        name_line, data_line = block.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert (name_line, data["type"]) == (f"event: {name}", name)
        out.append((name, data))
    return out


async def chat_prompt(client: httpx.AsyncClient, backend: FakeBackend, body: dict[str, Any]) -> Any:
    """The prompt and sampling the backend gets for a chat completion `body`."""
    backend.scripts.append([completed("stop")])
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return backend.last.request.prompt, backend.last.request.sampling


# ---------------------------------------------------------------------------------------------
# /v1/messages


async def test_a_message_is_the_chat_of_system_and_messages(
    claude: anthropic.AsyncAnthropic, client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.scripts.append(say(frontend, "Hello world"))
    messages: Any = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                     {"role": "user", "content": [{"type": "text", "text": "How"},
                                                  {"type": "text", "text": "are you?", "cache_control":
                                                   {"type": "ephemeral"}}]}]
    message = await claude.messages.create(
        model="tiny", max_tokens=20, system=[{"type": "text", "text": SYSTEM}], messages=messages,
        metadata={"user_id": "u1"}, extra_headers={"X-Request-Id": "m1"},
        # anthropic 1.x dropped these from its signature; the API (and older clients) still send them
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 4})
    got = backend.last.request
    assert got.request_id == "m1"
    assert message.id == "msg_m1" and message.model == "tiny" and message.role == "assistant"
    assert [(block.type, block.text) for block in message.content] == [("text", "Hello world")]  # type: ignore[union-attr]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    # the EOS token that ended it is counted, as the chat's completion_tokens counts it
    assert (message.usage.input_tokens, message.usage.output_tokens) == (
        len(got.prompt), len(token_ids(frontend, "Hello world")) + 1)
    chat = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}, *messages]
    assert (got.prompt, got.sampling) == await chat_prompt(client, backend, {
        "messages": chat, "max_tokens": 20, "temperature": 0.5, "top_p": 0.9, "top_k": 4})
    assert "Hi" in frontend.tokenizer.decode(list(got.prompt))


async def test_a_message_ends_at_the_earliest_stop_sequence_and_names_it(
    claude: anthropic.AsyncAnthropic, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.scripts.append(say(frontend, "Hello world. Bye now", end="length"))
    message = await claude.messages.create(model="tiny", max_tokens=30, messages=HI,  # type: ignore[arg-type]
                                           stop_sequences=["Bye", "zz", "world."])
    assert message.content[0].text == "Hello "  # type: ignore[union-attr]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "world.")
    assert backend.last.stops == 1
    assert backend.last.request.sampling.max_tokens == 30
    backend.scripts.append(say(frontend, "Hello world", end="length"))
    cut = await claude.messages.create(model="tiny", max_tokens=30, messages=HI)  # type: ignore[arg-type]
    assert (cut.content[0].text, cut.stop_reason, cut.stop_sequence) == (  # type: ignore[union-attr]
        "Hello world", "max_tokens", None)


async def test_a_streamed_message_has_anthropics_event_sequence(
    claude: anthropic.AsyncAnthropic, client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    body: Any = {"model": "tiny", "max_tokens": 30, "messages": HI, "stop_sequences": ["now"]}
    backend.scripts.append(say(frontend, "Hello world. Bye now"))
    whole = (await client.post("/v1/messages", json=body)).json()
    backend.scripts.append(say(frontend, "Hello world. Bye now"))
    response = await client.post("/v1/messages", json={**body, "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = named_events(response.text)
    names = [name for name, _ in events]
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * len(deltas),
                     "content_block_stop", "message_delta", "message_stop"]
    assert len(deltas) > 1 and {d["type"] for d in deltas} == {"text_delta"}
    assert "".join(d["text"] for d in deltas) == whole["content"][0]["text"] == "Hello world. Bye "
    start = events[0][1]["message"]
    assert start == {**whole, "id": start["id"], "content": [], "stop_reason": None, "stop_sequence": None,
                     "usage": {"input_tokens": whole["usage"]["input_tokens"], "output_tokens": 0}}
    assert start["id"] == "msg_" + response.headers["x-request-id"]
    assert events[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "stop_sequence",
                                                                "stop_sequence": "now"},
                             "usage": {"output_tokens": whole["usage"]["output_tokens"]}}
    # the SDK's stream helper puts the same message together
    backend.scripts.append(say(frontend, "Hello world. Bye now"))
    async with claude.messages.stream(**body) as stream:
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == "Hello world. Bye "
    assert {**final.model_dump(exclude_none=True), "id": whole["id"]} == {
        **whole, "content": [{"type": "text", "text": "Hello world. Bye "}]}


BAD_MESSAGES: list[tuple[dict[str, Any], int, str, str]] = [
    ({"model": "tiny", "messages": HI}, 400, "invalid_request_error", "max_tokens: Field required"),
    ({"model": "tiny", "max_tokens": "5", "messages": HI}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "tiny", "max_tokens": 0, "messages": HI}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 5, "messages": HI}, 400, "invalid_request_error", "model: Field required"),
    ({"model": "tiny", "max_tokens": 5, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"model": "tiny", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error", "messages[0].role"),
    ({"model": "tiny", "max_tokens": 5, "messages": HI, "temperature": 2.5}, 400, "invalid_request_error",
     "temperature"),
    ({"model": "tiny", "max_tokens": 5, "messages": HI, "stop_sequences": ["x"] * 17}, 400,
     "invalid_request_error", "stop_sequences: at most 16"),
    ({"model": "tiny", "max_tokens": 5000, "messages": HI}, 400, "invalid_request_error",
     "max_tokens is 5000"),
    ({"model": "other", "max_tokens": 5, "messages": HI}, 404, "not_found_error", "'other'"),
    ({"model": "tiny", "max_tokens": 5, "messages": HI,
      "tools": [{"type": "web_search_20250305", "name": "w"}]}, 400, "invalid_request_error", "tools[0]"),
    ({"model": "tiny", "max_tokens": 5, "messages": HI, "tools": [{"name": "f", "input_schema": {}}],
      "tool_choice": {"type": "tool", "name": "g"}}, 400, "invalid_request_error", "no tool is named 'g'"),
    ({"model": "tiny", "max_tokens": 5, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 9}},
     422, "invalid_request_error", "thinking"),
    ({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     422, "invalid_request_error", "messages[0].content[1]: content blocks of type 'image'"),
    ({"model": "tiny", "max_tokens": 5, "messages": [*HI, {"role": "assistant", "content": "Sure,"}]}, 422,
     "invalid_request_error", "prefill"),
]


@pytest.mark.parametrize(("body", "status", "kind", "says"), BAD_MESSAGES)
async def test_bad_messages_get_anthropics_error_shape(
    client: httpx.AsyncClient, backend: FakeBackend, body: dict[str, Any], status: int, kind: str, says: str
) -> None:
    response = await client.post("/v1/messages", json=body)
    assert response.status_code == status, response.text
    error = response.json()
    assert error == {"type": "error", "error": {"type": kind, "message": error["error"]["message"]}}
    assert says in error["error"]["message"]
    assert backend.generations == []


async def test_the_anthropic_client_raises_on_refusals_and_backend_errors(
    claude: anthropic.AsyncAnthropic, backend: FakeBackend, frontend: Frontend
) -> None:
    tools: Any = [{"name": "f", "input_schema": {"type": "object"}}]
    forced: Any = {"type": "tool", "name": "g"}
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        await claude.messages.create(model="tiny", max_tokens=5, messages=HI, tools=tools,  # type: ignore[arg-type]
                                     tool_choice=forced)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        await claude.messages.create(model="tiny", max_tokens=0, messages=HI)  # type: ignore[arg-type]
    backend.start_error = StatecoreError(ErrorInfo(Fault.OVERLOADED, Code.OVERLOADED, "the queue is full"))
    with pytest.raises(anthropic.RateLimitError) as limited:
        await claude.messages.create(model="tiny", max_tokens=5, messages=HI)  # type: ignore[arg-type]
    assert limited.value.response.headers["retry-after"] == "1"
    assert limited.value.body == {"type": "error", "error": {"type": "rate_limit_error",
                                                             "message": "the queue is full"}}
    backend.start_error = None
    backend.scripts.append([rejected(peer_error("the decode node failed"))])
    with pytest.raises(anthropic.APIStatusError) as failed:
        await claude.messages.create(model="tiny", max_tokens=5, messages=HI)  # type: ignore[arg-type]
    assert failed.value.status_code == 502 and "decode node failed" in failed.value.message
    # a failure after the stream began: an `error` event, which the client raises
    backend.scripts.append([*say(frontend, "Hello")[:-1], rejected(peer_error("lost mid-way"))])
    with pytest.raises(anthropic.APIStatusError, match="lost mid-way"):
        async with claude.messages.stream(model="tiny", max_tokens=5, messages=HI) as stream:  # type: ignore[arg-type]
            await stream.get_final_message()


async def test_a_mid_stream_failure_is_anthropics_error_event(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.scripts.append([*say(frontend, "Hello")[:-1], rejected(peer_error("lost mid-way"))])
    response = await client.post("/v1/messages", json={"model": "tiny", "max_tokens": 9, "messages": HI,
                                                       "stream": True})
    assert response.status_code == 200
    events = named_events(response.text)
    assert [name for name, _ in events][-2:] == ["content_block_delta", "error"]
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "lost mid-way"}}


# ---------------------------------------------------------------------------------------------
# /v1/responses


async def test_a_response_is_the_chat_of_instructions_and_input(
    gpt: openai.AsyncOpenAI, client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.scripts.append(say(frontend, "Hello world"))
    items: Any = [
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                     {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
        {"role": "user", "content": "How are you?"},
    ]
    response = await gpt.responses.create(
        model="tiny", input=items, instructions=SYSTEM, max_output_tokens=20, temperature=0.5, top_p=0.9,
        metadata={"k": "v"}, store=True, user="u1", extra_headers={"X-Request-Id": "r1"})
    got = backend.last.request
    assert got.request_id == "r1"
    assert (response.id, response.object, response.status, response.model) == ("resp_r1", "response",
                                                                               "completed", "tiny")
    assert response.output_text == "Hello world"
    [item] = response.output
    assert (item.type, item.id, item.status, item.role) == ("message", "msg_r1", "completed", "assistant")  # type: ignore[union-attr]
    echoed = response.to_dict()  # nothing is stored, whatever `store` asked; metadata comes back
    assert (echoed["store"], echoed["metadata"], echoed["incomplete_details"]) == (False, {"k": "v"}, None)
    assert response.usage is not None
    out = len(token_ids(frontend, "Hello world")) + 1
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
        len(got.prompt), out, len(got.prompt) + out)
    chat = [{"role": "system", "content": SYSTEM}, items[0],
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]}, items[3]]
    assert (got.prompt, got.sampling) == await chat_prompt(client, backend, {
        "messages": chat, "max_tokens": 20, "temperature": 0.5, "top_p": 0.9})
    # a string input is one user message
    backend.scripts.append(say(frontend, "ok"))
    await gpt.responses.create(model="tiny", input="Hi")
    plain = backend.last.request
    assert (plain.prompt, plain.sampling) == await chat_prompt(client, backend, {"messages": HI})


async def test_a_response_cut_at_max_output_tokens_is_incomplete(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    body = {"input": "Hi", "max_output_tokens": 3}
    backend.scripts.append(say(frontend, "Hello", end="length"))
    whole = (await client.post("/v1/responses", json=body)).json()
    assert (whole["status"], whole["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert whole["output"][0]["status"] == "incomplete"
    assert whole["output"][0]["content"] == [{"type": "output_text", "text": "Hello", "annotations": []}]
    backend.scripts.append(say(frontend, "Hello", end="length"))
    streamed = named_events((await client.post("/v1/responses", json={**body, "stream": True})).text)
    assert streamed[-1][0] == "response.incomplete"  # as OpenAI ends such a stream
    last = streamed[-1][1]["response"]
    assert no_ids(last) == no_ids(whole)


async def test_a_streamed_response_has_the_responses_event_sequence(
    gpt: openai.AsyncOpenAI, client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    body = {"model": "tiny", "input": "Hi", "instructions": SYSTEM}
    backend.scripts.append(say(frontend, "Hello world"))
    whole = (await client.post("/v1/responses", json=body)).json()
    backend.scripts.append(say(frontend, "Hello world"))
    response = await client.post("/v1/responses", json={**body, "stream": True})
    assert response.status_code == 200
    events = named_events(response.text)
    names = [name for name, _ in events]
    deltas = [data["delta"] for name, data in events if name == "response.output_text.delta"]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert len(deltas) > 1 and "".join(deltas) == "Hello world"
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    request_id = response.headers["x-request-id"]
    created = events[0][1]["response"]
    assert (created["id"], created["status"], created["output"], created["usage"]) == (
        f"resp_{request_id}", "in_progress", [], None)
    item = {"id": f"msg_{request_id}", "type": "message", "role": "assistant"}
    assert events[2][1]["item"] == {**item, "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": "Hello world", "annotations": []}
    assert events[-4][1]["text"] == "Hello world" and events[-3][1]["part"] == part
    assert events[-2][1]["item"] == {**item, "status": "completed", "content": [part]}
    assert no_ids(events[-1][1]["response"]) == no_ids(whole)
    # the official client, streaming
    backend.scripts.append(say(frontend, "Hello world"))
    stream = await gpt.responses.create(model="tiny", input="Hi", instructions=SYSTEM, stream=True)
    got = [event async for event in stream]
    assert [event.type for event in got] == names
    assert got[-1].response.output_text == "Hello world"  # type: ignore[union-attr]
    backend.scripts.append(say(frontend, "Hello world"))
    async with gpt.responses.stream(model="tiny", input="Hi") as helper:
        assert (await helper.get_final_response()).output_text == "Hello world"


BAD_RESPONSES: list[tuple[dict[str, Any], int, str, str]] = [
    ({}, 400, "input", "Field required"),
    ({"input": 5}, 400, "input", "input"),
    ({"input": "Hi", "temperature": "hot"}, 400, "temperature", "temperature"),
    ({"input": "Hi", "max_output_tokens": 0}, 400, "max_output_tokens", "max_output_tokens: Input should be"),
    ({"input": "Hi", "max_output_tokens": 5000}, 400, "max_output_tokens", "max_output_tokens is 5000"),
    ({"input": "word " * 400}, 400, "input", "leaves no room"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input[0].role", "input[0].role"),
    ({"input": "Hi", "model": "other"}, 404, "model", "'other'"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": {}}],
      "tool_choice": {"type": "function", "name": "g"}}, 400, "tool_choice.name", "no tool is named 'g'"),
    ({"input": "Hi", "tools": [{"type": "web_search_preview"}]}, 400, "tools[0].type", "tools[0].type"),
    ({"input": "Hi", "previous_response_id": "resp_1"}, 422, "previous_response_id", "previous_response_id"),
    ({"input": "Hi", "background": True}, 422, "background", "background"),
    ({"input": "Hi", "text": {"format": {"type": "grammar"}}}, 400, "text.format.type", "text.format.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is it?"},
                                             {"type": "input_image", "image_url": "https://x/y.png"}]}]},
     422, "input[0].content[1]", "content parts of type 'input_image'"),
    ({"input": [*HI, {"type": "web_search_call", "id": "ws_1"}]}, 422, "input[1]",
     "input items of type 'web_search_call'"),
    ({"input": "Hi", "top_logprobs": 21}, 400, "top_logprobs", "top_logprobs: Input should be less than"),
    ({"input": "Hi", "top_logprobs": "2"}, 400, "top_logprobs", "top_logprobs: Input should be a valid int"),
    ({"input": "Hi", "top_logprobs": 2}, 400, "top_logprobs",
     "needs include: ['message.output_text.logprobs']"),
    ({"input": "Hi", "include": ["message.output_text.logprobs", "file_search_call.results"]}, 422,
     "include[1]", "'file_search_call.results' is not served yet"),
    ({"input": "Hi", "include": ["message.output_text.logprob"]}, 400, "include[0]",
     "include[0]: Input should be"),
    ({"input": "Hi", "include": "message.output_text.logprobs"}, 400, "include", "include: Input should be"),
]


@pytest.mark.parametrize(("body", "status", "param", "says"), BAD_RESPONSES)
async def test_bad_responses_requests_get_openais_error_shape(
    client: httpx.AsyncClient, backend: FakeBackend, body: dict[str, Any], status: int, param: str, says: str
) -> None:
    response = await client.post("/v1/responses", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and says in error["message"], error
    assert error["code"] == {400: error["code"], 404: "model_not_found", 422: "unsupported_parameter"}[status]
    assert backend.generations == []


async def test_the_openai_client_raises_on_refusals_and_sees_a_failed_stream(
    gpt: openai.AsyncOpenAI, client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    with pytest.raises(openai.BadRequestError, match="max_output_tokens"):
        await gpt.responses.create(model="tiny", input="Hi", max_output_tokens=0)
    with pytest.raises(openai.UnprocessableEntityError, match="previous_response_id"):
        await gpt.responses.create(model="tiny", input="Hi", previous_response_id="resp_1")
    backend.scripts.append([rejected(peer_error("the decode node failed"))])
    with pytest.raises(openai.APIStatusError) as failed:
        await gpt.responses.create(model="tiny", input="Hi", stream=True)
    assert failed.value.status_code == 502
    # after the stream began: response.failed, with the error and what was made
    backend.scripts.append([*say(frontend, "Hello")[:-1], rejected(peer_error("lost mid-way"))])
    stream = await gpt.responses.create(model="tiny", input="Hi", stream=True)
    last = [event async for event in stream][-1]
    assert last.type == "response.failed"
    assert last.response.status == "failed" and last.response.error is not None
    assert (last.response.error.code, last.response.error.message) == ("peer_failed", "lost mid-way")
    assert last.response.output_text == "Hello"


# ---------------------------------------------------------------------------------------------
# Both: request ids, disconnects


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": HI}), ("/v1/responses", {"input": "Hi"})])
async def test_a_bad_request_id_is_refused_in_each_apis_shape(
    client: httpx.AsyncClient, backend: FakeBackend, path: str, body: dict[str, Any]
) -> None:
    response = await client.post(path, json=body, headers={"X-Request-Id": "no spaces"})
    assert response.status_code == 400
    assert "X-Request-Id" in json.dumps(response.json())
    assert ("type" in response.json()) is (path == "/v1/messages")
    assert len(response.headers["x-request-id"]) == 32
    assert backend.generations == []


@pytest.mark.parametrize(("path", "shape"), [
    ("/v1/messages", lambda status, message: {"type": "error", "error": {
        "type": {400: "invalid_request_error", 413: "request_too_large"}[status], "message": message}}),
    ("/v1/responses", lambda status, message: {"error": {
        "message": message, "type": "invalid_request_error", "param": None,
        "code": {400: "invalid_json", 413: "body_too_large"}[status]}}),
])
async def test_unreadable_bodies_get_each_apis_error_shape(
    client: httpx.AsyncClient, backend: FakeBackend, path: str, shape: Any
) -> None:
    response = await client.post(path, content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json() == shape(400, response.json()["error"]["message"])
    assert "not valid JSON" in response.json()["error"]["message"]
    response = await client.post(path, content=b"x" * (5 << 20))
    assert response.status_code == 413
    assert response.json() == shape(413, response.json()["error"]["message"])
    assert response.headers["connection"] == "close"  # the unread rest is not taken for a request
    assert backend.generations == []


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body"), [
    ("/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": HI}), ("/v1/responses", {"input": "Hi"})])
async def test_a_client_that_goes_away_cancels_its_generation(
    app: Starlette, backend: FakeBackend, path: str, body: dict[str, Any], stream: bool
) -> None:
    backend.scripts.append([HANG])
    gone = trio.Event()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            raw = json.dumps({**body, "stream": stream}).encode()
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def leave_once_started() -> None:
        while not backend.generations:
            await trio.sleep(0.001)
        gone.set()

    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(leave_once_started)
        with trio.fail_after(10):
            await app(scope, receive, send)
    assert sent[0]["status"] == 499
    assert backend.last.cancels == 1


# ---------------------------------------------------------------------------------------------
# Tool calls: the tools through the chat template, the model's calls back in each API's shape

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


async def test_the_anthropic_client_gets_tool_use_blocks_whole_and_streamed_and_sends_results_back(
    claude: anthropic.AsyncAnthropic, client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.info = fake_model_info(context_length=2048)  # the tools take room in each prompt
    tools: Any = [{"name": "get_weather", "description": "The weather", "input_schema": SCHEMA}]
    backend.scripts.append(say(frontend, "Checking." + CALL))
    whole = await claude.messages.create(model="tiny", max_tokens=60, messages=HI,  # type: ignore[arg-type]
                                         tools=tools)
    chat = {"messages": HI, "max_tokens": 60,
            "tools": [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                                        "parameters": SCHEMA}}]}
    sent = backend.generations[-1].request.prompt
    assert sent == (await chat_prompt(client, backend, chat))[0]
    assert whole.stop_reason == "tool_use"
    assert [block.type for block in whole.content] == ["text", "tool_use"]
    use: Any = whole.content[1]
    assert (whole.content[0].text, use.name, use.input) == ("Checking.", "get_weather", {"city": "Paris"})  # type: ignore[union-attr]
    backend.scripts.append(say(frontend, "Checking." + CALL))
    async with claude.messages.stream(model="tiny", max_tokens=60, messages=HI, tools=tools) as stream:  # type: ignore[arg-type]
        streamed = await stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[1].input == {"city": "Paris"}  # type: ignore[union-attr]

    backend.scripts.append(say(frontend, "Sunny."))
    turn: Any = [*HI, {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                                        {"type": "tool_use", "id": use.id, "name": use.name,
                                                         "input": use.input}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "24 C"}]}]
    answer = await claude.messages.create(model="tiny", max_tokens=60, messages=turn, tools=tools)
    assert answer.stop_reason == "end_turn" and answer.content[0].text == "Sunny."  # type: ignore[union-attr]
    prompt = frontend.tokenizer.decode(backend.generations[-1].request.prompt)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt and "<tool>\n24 C" in prompt


async def test_the_openai_client_gets_function_calls_whole_and_streamed_and_sends_outputs_back(
    gpt: openai.AsyncOpenAI, client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.info = fake_model_info(context_length=2048)  # the tools take room in each prompt
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
    backend.scripts.extend([say(frontend, CALL), say(frontend, CALL)])
    whole = await gpt.responses.create(model="tiny", input="Weather in Paris?", tools=tools)
    [call] = [item for item in whole.output if item.type == "function_call"]
    assert [item.type for item in whole.output] == ["function_call"] and whole.status == "completed"
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert whole.tool_choice == "auto" and whole.tools[0].name == "get_weather"  # type: ignore[union-attr]
    assert whole.parallel_tool_calls is True
    # parallel_tool_calls false: the reply stops after its first call
    backend.scripts.insert(0, say(frontend, CALL + "\n" + CALL))
    one = await gpt.responses.create(model="tiny", input="Weather?", tools=tools, parallel_tool_calls=False)
    assert one.parallel_tool_calls is False
    assert [item.type for item in one.output] == ["function_call"]
    async with gpt.responses.stream(model="tiny", input="Weather in Paris?", tools=tools) as stream:
        streamed = await stream.get_final_response()
    calls = [item for item in streamed.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [(call.name, call.arguments)]

    backend.scripts.append(say(frontend, "Sunny."))
    items: Any = [{"role": "user", "content": "Weather in Paris?"},
                  {"type": "function_call", "call_id": call.call_id, "name": "get_weather",
                   "arguments": call.arguments},
                  {"type": "function_call_output", "call_id": call.call_id, "output": "24 C"}]
    answer = await gpt.responses.create(model="tiny", input=items, tools=tools)
    assert answer.output_text == "Sunny."
    prompt = frontend.tokenizer.decode(backend.generations[-1].request.prompt)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt and "<tool>\n24 C" in prompt


_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


async def test_structured_output_is_the_chats_response_format_in_both_apis(
    gpt: openai.AsyncOpenAI, claude: anthropic.AsyncAnthropic, client: httpx.AsyncClient,
    backend: FakeBackend, frontend: Frontend
) -> None:
    """Responses' `text.format` and Messages' `output_format` reach the engine as the chat's
    `response_format` would (same prompt, same sampling), the format is echoed, and a schema the
    grammar refuses is a 400 naming each API's own field."""
    chat_format = {"type": "json_schema",
                   "json_schema": {"name": "answer", "schema": _SCHEMA, "strict": True}}
    backend.scripts.append(say(frontend, '{"ok": true}'))
    as_json: Any = {"format": {"type": "json_schema", "name": "answer", "schema": _SCHEMA, "strict": True}}
    response = await gpt.responses.create(model="tiny", input="Hi", text=as_json)
    echoed = {"type": "json_schema", "name": "answer", "schema": _SCHEMA, "strict": True}
    assert response.to_dict()["text"]["format"] == echoed  # type: ignore[index]
    got = backend.last.request
    assert (got.prompt, got.sampling) == await chat_prompt(client, backend, {
        "messages": HI, "response_format": chat_format})
    backend.scripts.append(say(frontend, "{}"))
    await gpt.responses.create(model="tiny", input="Hi", text={"format": {"type": "json_object"}})
    assert backend.last.request.sampling.response_format == '{"type":"json_object"}'
    backend.scripts.append(say(frontend, "free"))
    plain = await gpt.responses.create(model="tiny", input="Hi", text={"format": {"type": "text"}})
    assert backend.last.request.sampling.response_format is None
    assert plain.to_dict()["text"]["format"] == {"type": "text"}

    backend.scripts.append(say(frontend, '{"ok": true}'))
    message = await claude.messages.create(model="tiny", max_tokens=16, messages=HI, extra_body={
        "output_format": {"type": "json_schema", "schema": _SCHEMA}})
    assert message.content[0].text == '{"ok": true}'
    got = backend.last.request
    assert (got.prompt, got.sampling) == await chat_prompt(client, backend, {
        "messages": HI, "max_tokens": 16,
        "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": _SCHEMA}}})

    bad = {"type": "objekt"}
    refused = await client.post("/v1/responses", json={"input": "Hi", "text": {"format": {
        "type": "json_schema", "name": "a", "schema": bad}}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "text.format", refused.text
    body = {"model": "tiny", "max_tokens": 8, "messages": HI,
            "output_format": {"type": "json_schema", "schema": bad}}
    refused = await client.post("/v1/messages", json=body)
    assert refused.status_code == 400 and "output_format" in refused.text, refused.text


async def test_count_tokens_is_the_prompt_a_message_would_be(
    claude: anthropic.AsyncAnthropic, client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    """`/v1/messages/count_tokens` counts the prompt the same body sends to the backend (system,
    messages, the template), without generating, and refuses as /v1/messages does."""
    messages: Any = [{"role": "user", "content": "Hi there"}]
    counted = await claude.messages.count_tokens(model="tiny", system=SYSTEM, messages=messages)
    assert backend.generations == []
    backend.scripts.append(say(frontend, "ok"))
    await claude.messages.create(model="tiny", max_tokens=4, system=SYSTEM, messages=messages)
    assert counted.input_tokens == len(backend.last.request.prompt)
    wrong = await client.post("/v1/messages/count_tokens", json={"model": "other", "messages": messages})
    assert wrong.status_code == 404 and wrong.json()["type"] == "error", wrong.text
    empty = await client.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": []})
    assert empty.status_code == 400 and empty.json()["error"]["type"] == "invalid_request_error", empty.text


# ---------------------------------------------------------------------------------------------
# Logprobs on /v1/responses: the chat's, in the output text and the stream's text events

LOGPROBS: Any = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}


def with_logprobs(frontend: Frontend, text: str) -> list[ScriptItem]:
    """`say`, each token carrying a made-up logprob (-0.25 x its place) and two alternatives."""
    ids = frontend.tokenizer.encode(text, add_special_tokens=False)
    return [*(replied(int(t), TokenLogprobs(-0.25 * i, ((int(t), -0.25 * i), (7, -9.5))))
              for i, t in enumerate(ids)), completed("stop")]


def in_events(entries: list[Any]) -> list[Any]:
    """The chat's logprobs entries as the Responses stream's text events carry them (no bytes)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]


async def chat_logprobs(client: httpx.AsyncClient, backend: FakeBackend, body: dict[str, Any]) -> Any:
    """The chat's logprobs content for `body` (its script already queued) and its sampling."""
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["content"], backend.last.request.sampling


async def test_response_logprobs_are_the_chats_in_the_output_text_and_each_text_event(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    text = "Hello world, and again"
    backend.scripts.extend([with_logprobs(frontend, text) for _ in range(5)])
    expected, sampling = await chat_logprobs(client, backend, {"messages": HI, "logprobs": True,
                                                               "top_logprobs": 2})
    whole = (await client.post("/v1/responses", json={"input": "Hi", **LOGPROBS})).json()
    assert backend.last.request.sampling == sampling and sampling.logprobs == 2
    assert whole["top_logprobs"] == 2
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": expected}
    assert whole["output"][0]["content"] == [part] and len(expected) == len(token_ids(frontend, text))

    events = named_events((await client.post("/v1/responses", json={"input": "Hi", "stream": True,
                                                                    **LOGPROBS})).text)
    by_name = dict(events)
    assert by_name["response.content_part.added"]["part"] == {**part, "text": "", "logprobs": []}
    deltas = [data for name, data in events if name == "response.output_text.delta"]
    assert len(deltas) > 1
    for delta in deltas:  # each delta carries its own tokens'
        assert delta["delta"] and "".join(entry["token"] for entry in delta["logprobs"]) == delta["delta"]
    assert [entry for delta in deltas for entry in delta["logprobs"]] == in_events(expected)
    assert by_name["response.output_text.done"]["logprobs"] == in_events(expected)
    assert by_name["response.content_part.done"]["part"] == part
    assert by_name["response.output_item.done"]["item"]["content"] == [part]
    assert no_ids(by_name["response.completed"]["response"]) == no_ids(whole)
    assert by_name["response.created"]["response"]["top_logprobs"] == 2

    # include alone asks for the chosen tokens' logprobs without alternatives (top_logprobs 0)
    expected, sampling = await chat_logprobs(client, backend, {"messages": HI, "logprobs": True})
    alone = (await client.post("/v1/responses", json={"input": "Hi", "include": LOGPROBS["include"]})).json()
    assert backend.last.request.sampling == sampling and sampling.logprobs == 0
    assert alone["top_logprobs"] == 0 and alone["output"][0]["content"][0]["logprobs"] == expected
    # a stream that fails on the way: response.failed has the text made so far, with its logprobs
    backend.scripts.append([*with_logprobs(frontend, "Hello")[:-1], rejected(peer_error("lost"))])
    events = named_events((await client.post("/v1/responses", json={"input": "Hi", "stream": True,
                                                                    **LOGPROBS})).text)
    assert events[-1][0] == "response.failed"
    [part] = events[-1][1]["response"]["output"][0]["content"]
    assert part["text"] == "Hello" == "".join(entry["token"] for entry in part["logprobs"])


async def test_without_include_a_response_has_no_logprobs_as_before(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    """No `include`: nothing asked of the engine, and the body and events are what they were
    before logprobs were served (`logprobs: []` on the text events, as OpenAI sends them)."""
    bodies: list[dict[str, Any]] = [{"input": "Hi"}, {"input": "Hi", "include": [], "top_logprobs": None}]
    for body in bodies:
        backend.scripts.append(with_logprobs(frontend, "Hello world"))
        whole = (await client.post("/v1/responses", json=body)).json()
        assert backend.last.request.sampling.logprobs is None
        assert "top_logprobs" not in whole
        assert whole["output"][0]["content"] == [
            {"type": "output_text", "text": "Hello world", "annotations": []}]
        backend.scripts.append(with_logprobs(frontend, "Hello world"))
        events = named_events((await client.post("/v1/responses", json={**body, "stream": True})).text)
        assert [data["logprobs"] for name, data in events if name.startswith("response.output_text.")] == [
            [] for name, _ in events if name.startswith("response.output_text.")]
        assert "top_logprobs" not in events[0][1]["response"] and '"logprobs":[{' not in json.dumps(events)
    # top_logprobs 0 without include asks for nothing either; it is echoed
    backend.scripts.append(with_logprobs(frontend, "Hello world"))
    zero = (await client.post("/v1/responses", json={"input": "Hi", "top_logprobs": 0})).json()
    assert backend.last.request.sampling.logprobs is None and zero["top_logprobs"] == 0
    assert "logprobs" not in zero["output"][0]["content"][0]


async def test_a_response_range_error_on_top_logprobs_is_the_chats(client: httpx.AsyncClient) -> None:
    for value in (21, -1, 2.5):
        chat = await client.post("/v1/chat/completions", json={"messages": HI, "logprobs": True,
                                                               "top_logprobs": value})
        response = await client.post("/v1/responses", json={"input": "Hi", **LOGPROBS, "top_logprobs": value})
        assert response.status_code == chat.status_code == 400 and response.json() == chat.json()


async def test_logprobs_of_text_held_back_for_a_tool_call_come_in_empty_deltas(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    """The tokens of a call's text show no output text: their logprobs still come, in deltas of
    "" (as the chat's stream sends them in chunks of ""), and the output text has every token's."""
    backend.info = fake_model_info(context_length=2048)  # the tools take room in each prompt
    reply = "Let me look. " + CALL
    backend.scripts.extend([with_logprobs(frontend, reply) for _ in range(3)])
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    expected, sampling = await chat_logprobs(client, backend, {
        "messages": HI, "tools": chat_tools, "logprobs": True, "top_logprobs": 2})
    body = {"input": "Hi", "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}],
            **LOGPROBS}
    same = {"X-Request-Id": "held"}  # the call ids are the request's
    whole = (await client.post("/v1/responses", json=body, headers=same)).json()
    assert backend.last.request.sampling == sampling
    assert [item["type"] for item in whole["output"]] == ["message", "function_call"]
    [part] = whole["output"][0]["content"]
    assert part["logprobs"] == expected and len(expected) == len(token_ids(frontend, reply))
    streamed = await client.post("/v1/responses", json={**body, "stream": True}, headers=same)
    events = named_events(streamed.text)
    deltas = [data for name, data in events if name == "response.output_text.delta"]
    assert "".join(delta["delta"] for delta in deltas) == part["text"]
    assert [delta["delta"] for delta in deltas if not delta["delta"]]  # the call's tokens'
    assert [entry for delta in deltas for entry in delta["logprobs"]] == in_events(expected)
    assert no_ids(events[-1][1]["response"]) == no_ids(whole)


async def test_the_openai_client_reads_response_logprobs_whole_and_streamed(
    gpt: openai.AsyncOpenAI, backend: FakeBackend, frontend: Frontend
) -> None:
    text = "Hello world, and again"
    backend.scripts.extend([with_logprobs(frontend, text) for _ in range(4)])
    messages: Any = HI
    chat = await gpt.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=2)
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
    expected = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    asked: Any = {"model": "tiny", "input": "Hi", "top_logprobs": 2,
                  "include": ["message.output_text.logprobs"]}
    response = await gpt.responses.create(**asked)
    assert response.top_logprobs == 2 and response.output_text == text
    item: Any = response.output[0]
    part = item.content[0]
    assert part.type == "output_text" and [entry.model_dump() for entry in part.logprobs] == expected

    stream = await gpt.responses.create(**asked, stream=True)
    got: list[Any] = [event async for event in stream]
    deltas = [event for event in got if event.type == "response.output_text.delta"]
    assert [entry.model_dump() for event in deltas for entry in event.logprobs] == in_events(expected)
    [done] = [event for event in got if event.type == "response.output_text.done"]
    assert [entry.model_dump() for entry in done.logprobs] == in_events(expected)
    final = got[-1].response.output[0].content[0]
    assert [entry.model_dump() for entry in final.logprobs] == expected
    async with gpt.responses.stream(**asked) as helper:
        finished: Any = await helper.get_final_response()
    assert [entry.model_dump() for entry in finished.output[0].content[0].logprobs] == expected
