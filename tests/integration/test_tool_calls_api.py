"""Tool calls through /v1/chat/completions, on a scripted backend and through the official
`openai` client: the tools reach the chat template, the reply's `<tool_call>` text comes back as
OpenAI `tool_calls` (whole or streamed), earlier calls and their results go back into the prompt,
and what cannot be served is a clear 4xx."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from openai import AsyncOpenAI

from adapters.frontend.app import build_app
from adapters.frontend.frontend import Frontend
from support.tiny_models import build_tokenizer
from tests.integration.fake_backend import FakeBackend, completed
from tests.integration.scripted_text import say

TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": ASK, "max_tokens": 60, "tools": TOOLS, **extra}


async def test_the_tools_reach_the_template_and_a_call_comes_back_as_tool_calls(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.scripts.append(say(frontend, "Checking." + CALL))
    response = await client.post("/v1/chat/completions", json=chat(), headers={"x-request-id": "r1"})
    assert response.status_code == 200, response.text
    expected = frontend.tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True,
                                                      tokenize=True)
    assert backend.last.request.prompt == tuple(expected)
    assert "get_weather" in frontend.tokenizer.decode(backend.last.request.prompt)
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_r1_0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


async def test_the_openai_client_gets_calls_whole_and_streamed_and_sends_the_results_back(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    # Typed loosely: the SDK's own httpx fork takes our httpx client (the ASGI app) at run time.
    sdk: Any = AsyncOpenAI(base_url="http://node/v1", api_key="none", http_client=cast(Any, client))
    backend.scripts.extend([say(frontend, CALL), say(frontend, "Sun" + CALL.replace("Paris", "Rome"))])
    whole = await sdk.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
    call = whole.choices[0].message.tool_calls[0]
    assert whole.choices[0].message.content is None
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    streamed = await sdk.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, stream=True)
    content, deltas, finish = "", list[Any](), None
    async for chunk in streamed:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        deltas += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Sun" and finish == "tool_calls"
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "get_weather", '{"city": "Rome"}')]

    # The next turn: the assistant's call and the tool's answer go into the prompt.
    backend.scripts.append(say(frontend, "It is sunny."))
    earlier = {"id": call.id, "type": "function",
               "function": {"name": "get_weather", "arguments": call.function.arguments}}
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [earlier]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    answer = await sdk.chat.completions.create(model="tiny", messages=turn, tools=TOOLS)
    assert answer.choices[0].message.content == "It is sunny." and answer.choices[0].finish_reason == "stop"
    prompt = frontend.tokenizer.decode(backend.last.request.prompt)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt and "sunny, 24 C" in prompt


async def test_without_tools_the_same_text_is_plain_content(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    backend.scripts.extend([say(frontend, CALL), say(frontend, CALL)])
    for body in ({"messages": ASK, "max_tokens": 60}, chat(tool_choice="none")):
        message = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": CALL}


@pytest.mark.parametrize(("body", "status", "param"), [
    (chat(tool_choice={"type": "function", "function": {"name": "get_time"}}), 400,
     "tool_choice.function.name"),
    (chat(tool_choice="required", stop=["x"]), 400, "stop"),
    (chat(tool_choice="required", ignore_eos=True), 400, "ignore_eos"),
    (chat(tool_choice="required", tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objekt"}}}]), 400, "tools"),
    (chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), 400, "tools[0].function.name"),
    ({"messages": [{"role": "tool", "content": "x"}], "max_tokens": 5}, 400, "messages[0]"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}], "max_tokens": 5},
     400, "messages[0].tool_calls[0].function"),
])
async def test_what_cannot_be_served_is_a_clear_error(client: httpx.AsyncClient, body: dict[str, Any],
                                                      status: int, param: str) -> None:
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param, response.text


async def test_a_forced_call_is_a_constraint_of_one_call_between_the_markers(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    """`tool_choice` "required" constrains the reply to one call of any of the tools, a named
    function to a call of that one: the engine gets the grammar's canonical text, and the reply
    (the call the grammar let through) is answered as a tool call."""
    from adapters.grammar import tool_call_text

    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    weather = TOOLS[0]["function"]["parameters"]
    backend.default_script = say(frontend, CALL)
    cases: list[tuple[Any, list[tuple[str, Any]]]] = [
        ("required", [("get_weather", weather), ("get_time", {"type": "object"})]),
        ({"type": "function", "function": {"name": "get_weather"}}, [("get_weather", weather)]),
    ]
    for choice, allowed in cases:
        body = chat(tools=[*TOOLS, other], tool_choice=choice)
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert backend.last.request.sampling.response_format == tool_call_text("<tool_call>", "</tool_call>",
                                                                               allowed)
        assert response.json()["choices"][0]["finish_reason"] == "tool_calls"
    # nothing forced: free text, as before
    await client.post("/v1/chat/completions", json=chat(tool_choice="auto"))
    assert backend.last.request.sampling.response_format is None


async def test_parallel_tool_calls_false_keeps_one_call_and_stops_there(
    client: httpx.AsyncClient, backend: FakeBackend, frontend: Frontend
) -> None:
    """With `parallel_tool_calls: false` the generation stops where the first call's end marker
    would be: one call, finish_reason "tool_calls", the rest never generated; by default both."""
    backend.default_script = say(frontend, CALL + "\n" + CALL + " and more text")
    both = (await client.post("/v1/chat/completions", json=chat())).json()["choices"][0]
    assert len(both["message"]["tool_calls"]) == 2
    for stream in (False, True):
        body = chat(parallel_tool_calls=False, stream=stream)
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        if stream:
            chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                      if line.startswith("data: {")]
            calls = [c for chunk in chunks for choice in chunk["choices"]
                     for c in choice["delta"].get("tool_calls") or []]
            assert len(calls) == 1 and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        else:
            [choice] = response.json()["choices"]
            [call] = choice["message"]["tool_calls"]
            assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
            assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
        last = backend.last
        assert (last.stops or last.cancels) and last.yielded < len(last.script)


async def test_a_model_without_tool_calling_refuses_tools(tmp_path: Path, backend: FakeBackend) -> None:
    build_tokenizer(tmp_path, "bpe")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    transport = httpx.ASGITransport(app=build_app(Frontend.load(tmp_path, backend)))
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as plain:
        response = await plain.post("/v1/chat/completions", json=chat())
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.text
        assert "no tool calling" in response.json()["error"]["message"]
        backend.default_script = [completed("stop")]
        assert (await plain.post("/v1/chat/completions", json=chat(tool_choice="none"))).status_code == 200
