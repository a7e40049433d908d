"""A reasoning model through /v1/chat/completions, on a scripted backend and through the official
`openai` client: the thinking comes apart from the answer (`reasoning_content` and `reasoning`,
whole and streamed), and the two are the unparsed completion's text; stop strings end the answer
only; `chat_template_kwargs` and `reasoning_effort` reach the template, and what it refuses is
a 400 naming them. The tokenizer is the tiny bpe one with think markers (`support.tiny_models`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from openai import AsyncOpenAI
from starlette.applications import Starlette

from adapters.cli import build_parser
from adapters.frontend.app import build_app
from adapters.frontend.frontend import Frontend
from adapters.frontend.prompts import TemplateArgsRefused
from adapters.serve.node import load_frontend
from support.tiny_models import THINK_END
from tests.integration.fake_backend import FakeBackend
from tests.integration.scripted_text import prompt_text, say, token_ids
from tests.integration.test_tool_calls_api import CALL, TOOLS

ASK = [{"role": "user", "content": "What is two and two?"}]
THOUGHT = "Two and two: count them.\nThat is four."
ANSWER = "\n\nIt is four."
REPLY = THOUGHT + THINK_END + ANSWER  # as the model writes it: the prompt opened the think block


@pytest.fixture
def app(thinking: Frontend) -> Starlette:
    return build_app(thinking)


async def test_the_thinking_comes_apart_from_the_answer(
        client: httpx.AsyncClient, backend: FakeBackend, thinking: Frontend) -> None:
    backend.scripts.append(say(thinking, REPLY))
    response = await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 100})
    assert response.status_code == 200, response.text
    assert prompt_text(thinking, backend).endswith("<assistant>\n<think>\n")  # the template opened it
    body = response.json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ANSWER,
                                             "reasoning_content": THOUGHT, "reasoning": THOUGHT}
    thought_tokens = len(token_ids(thinking, THOUGHT + THINK_END))
    assert body["usage"]["completion_tokens"] == len(token_ids(thinking, REPLY)) + 1  # and EOS
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": thought_tokens}


async def test_streamed_through_the_openai_client_the_parts_are_the_unparsed_completion(
        client: httpx.AsyncClient, backend: FakeBackend, thinking: Frontend) -> None:
    sdk: Any = AsyncOpenAI(base_url="http://node/v1", api_key="none", http_client=cast(Any, client))
    backend.scripts.append(say(thinking, REPLY))
    stream = await sdk.chat.completions.create(model="tiny", messages=ASK, max_tokens=100, stream=True,
                                               stream_options={"include_usage": True})
    reasoning, content, usage = "", "", cast(Any, None)
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            assert extra.get("reasoning_content") == extra.get("reasoning")
            reasoning += extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
    # the same tokens as a completion of the same prompt: the text as the model wrote it
    prompt = list(backend.last.request.prompt)
    backend.scripts.append(say(thinking, REPLY))
    raw = await sdk.completions.create(model="tiny", prompt=prompt, max_tokens=100)
    assert (reasoning, content) == (THOUGHT, ANSWER)
    assert reasoning + THINK_END + content == raw.choices[0].text
    assert usage.completion_tokens_details.reasoning_tokens == len(token_ids(thinking, THOUGHT + THINK_END))


async def test_without_its_end_marker_the_whole_reply_is_thinking(
        client: httpx.AsyncClient, backend: FakeBackend, thinking: Frontend) -> None:
    backend.scripts.append(say(thinking, THOUGHT, end="length"))
    body = (await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 100})).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"] == ""
    assert body["choices"][0]["message"]["reasoning_content"] == THOUGHT


async def test_stop_strings_end_the_answer_never_the_thinking(
        client: httpx.AsyncClient, backend: FakeBackend, thinking: Frontend) -> None:
    backend.scripts.append(say(thinking, REPLY))
    response = await client.post("/v1/chat/completions",
                                 json={"messages": ASK, "max_tokens": 100, "stop": ["four"]})
    message = response.json()["choices"][0]["message"]
    assert message["reasoning_content"] == THOUGHT  # "four" is in it too
    assert message["content"] == "\n\nIt is "
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    assert backend.last.stops == 1


async def test_chat_template_kwargs_reach_the_template(
        client: httpx.AsyncClient, backend: FakeBackend, thinking: Frontend) -> None:
    backend.scripts.append(say(thinking, "Four."))
    response = await client.post("/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 20, "chat_template_kwargs": {"enable_thinking": False}})
    assert prompt_text(thinking, backend).endswith("<assistant>\n<think>\n\n</think>\n\n")
    message = response.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Four.", "reasoning_content": None, "reasoning": None}
    # /tokenize takes them too, and counts the same prompt
    counted = await client.post("/tokenize", json={"messages": ASK,
                                                   "chat_template_kwargs": {"enable_thinking": False}})
    assert counted.json()["tokens"] == list(backend.last.request.prompt)


async def test_reasoning_effort_none_turns_the_thinking_off_where_the_template_has_no_effort(
        client: httpx.AsyncClient, backend: FakeBackend, thinking: Frontend) -> None:
    backend.scripts.extend([say(thinking, "Four."), say(thinking, REPLY)])
    await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 20,
                                                    "reasoning_effort": "none"})
    assert prompt_text(thinking, backend).endswith("<think>\n\n</think>\n\n")
    await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 99,
                                                    "reasoning_effort": "low"})
    assert prompt_text(thinking, backend).endswith("<assistant>\n<think>\n")


async def test_reasoning_effort_goes_to_a_template_that_reads_it(
        tmp_path: Path, thinking_dir: Path, backend: FakeBackend) -> None:
    config = json.loads((thinking_dir / "tokenizer_config.json").read_text())
    config["chat_template"] += ("{% if reasoning_effort is defined %}[effort: {{ reasoning_effort }}]"
                                "{% endif %}")
    for name in ("tokenizer.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((thinking_dir / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    frontend = Frontend.load(tmp_path, backend)
    backend.scripts.append(say(frontend, "Four."))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(frontend)),
                                 base_url="http://node") as client:
        await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 9,
                                                        "reasoning_effort": "high"})
    assert prompt_text(frontend, backend).endswith("<think>\n[effort: high]")


async def test_the_earlier_turns_thinking_goes_back_into_the_template(
        client: httpx.AsyncClient, backend: FakeBackend, thinking: Frontend) -> None:
    backend.scripts.append(say(thinking, REPLY))
    turn = [*ASK, {"role": "assistant", "content": "Four.", "reasoning_content": "Easy."},
            {"role": "user", "content": "And three and three?"}]
    await client.post("/v1/chat/completions", json={"messages": turn, "max_tokens": 100})
    assert "<assistant>\n<think>\nEasy.\n</think>\n\nFour." in prompt_text(thinking, backend)


async def test_a_tool_call_after_the_thinking(
        client: httpx.AsyncClient, backend: FakeBackend, thinking: Frontend) -> None:
    backend.scripts.append(say(thinking, "I should call it." + THINK_END + CALL))
    body = (await client.post("/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 100, "tools": TOOLS})).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "I should call it."
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"enable_thinking": "yes"}, "chat_template_kwargs"),  # the template raises
    ({"tokenize": False}, "chat_template_kwargs"),  # the server's own argument
    ({"nested": {"a": 1}}, "chat_template_kwargs.nested"),  # not a scalar
    ([1], "chat_template_kwargs"),
])
async def test_what_the_template_cannot_take_is_a_400(
        client: httpx.AsyncClient, kwargs: object, param: str) -> None:
    response = await client.post("/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 5, "chat_template_kwargs": kwargs})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_a_model_without_think_markers_answers_as_before(
        frontend: Frontend, backend: FakeBackend) -> None:
    backend.scripts.append(say(frontend, REPLY))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(frontend)),
                                 base_url="http://node") as client:
        body = (await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 100})).json()
        assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
        assert "completion_tokens_details" not in body["usage"]
        refused = await client.post("/v1/chat/completions",
                                    json={"messages": ASK, "max_tokens": 5, "reasoning_effort": "low"})
        assert refused.status_code == 422 and refused.json()["error"]["param"] == "reasoning_effort"


async def test_a_grammar_writes_the_answer_from_the_first_token_so_nothing_is_thinking(
        client: httpx.AsyncClient, backend: FakeBackend, thinking: Frontend) -> None:
    backend.scripts.append(say(thinking, '{"a": "<think>"}'))
    body = (await client.post("/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 30, "response_format": {"type": "json_object"}})).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": '{"a": "<think>"}'}
    assert backend.last.request.sampling.response_format is not None


async def test_the_node_s_template_args_go_under_the_request_s(thinking_dir: Path,
                                                                backend: FakeBackend) -> None:
    """`--chat-template-args` (here thinking off) reach every chat's template and /tokenize's;
    a request's `chat_template_kwargs` and `reasoning_effort` are put over them."""
    frontend = Frontend.load(thinking_dir, backend, template_args={"enable_thinking": False})
    closed, opened = "<assistant>\n<think>\n\n</think>\n\n", "<assistant>\n<think>\n"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(frontend)),
                                 base_url="http://node") as client:
        for given, ends in (({}, closed), ({"chat_template_kwargs": {"enable_thinking": True}}, opened),
                            ({"reasoning_effort": "high"}, opened)):
            backend.scripts.append(say(frontend, "Four."))
            response = await client.post("/v1/chat/completions",
                                         json={"messages": ASK, "max_tokens": 9, **given})
            assert response.status_code == 200, response.text
            assert prompt_text(frontend, backend).endswith(ends), given
            if "reasoning_effort" not in given:  # /tokenize takes no effort (vLLM's shape)
                counted = await client.post("/tokenize", json={"messages": ASK, **given})
                assert counted.json()["tokens"] == list(backend.last.request.prompt)
        # the request's own arguments that the template refuses are still the request's fault
        refused = await client.post("/v1/chat/completions", json={
            "messages": ASK, "max_tokens": 5, "chat_template_kwargs": {"enable_thinking": "yes"}})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"


def test_template_args_the_template_refuses_are_refused_at_start(thinking_dir: Path, backend: FakeBackend,
                                                                 frontend: Frontend) -> None:
    with pytest.raises(TemplateArgsRefused, match="enable_thinking must be true or false"):
        Frontend.load(thinking_dir, backend, template_args={"enable_thinking": "yes"})
    # a node ends its start in one line
    args = build_parser().parse_args(["run", "--chat-template-args", '{"enable_thinking": "yes"}'])
    with pytest.raises(SystemExit, match=r"^statecore: --chat-template-args: the chat template refused"):
        load_frontend(thinking_dir, backend, args)
    frontend.tokenizer.has_chat_template = False  # a model with no chat template at all
    with pytest.raises(TemplateArgsRefused, match="no chat template"):
        Frontend(frontend.tokenizer, backend, template_args={"enable_thinking": True})
