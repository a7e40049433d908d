"""The demo model answers what a newcomer types first (issue 36): of 20 short chat messages
(greetings, one-word questions), at most one gets an empty reply (its first token ends the turn),
greedy and sampled; and its chat template does tool calling in a format mlx-lm's parser reads,
so a tool call can be tried out of the box.

The replies go through the model's own chat template and mlx-lm's generation, as the server's
do; the tool call through `adapters.tool_calls`, the splitter the front end uses."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest

from adapters.serve.flags import demo_model_dir
from adapters.tool_calls import ToolCallSplitter

SHORT_MESSAGES = [
    "Hi", "Hi there", "Hello", "hey", "Hello!", "Good morning", "Good evening", "Thanks",
    "How are you?", "Who are you?", "What is your name?", "What?", "Why?", "How?", "Really?",
    "Yes", "No", "OK", "Help", "Bye",
]
MOST_EMPTY = 1
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@cache
def _load() -> tuple[Any, Any]:
    from mlx_lm.utils import load

    loaded: tuple[Any, ...] = tuple(load(str(demo_model_dir())))
    return loaded[0], loaded[1]


def _reply(messages: list[dict[str, str]], *, temperature: float = 0.0, seed: int = 0,
           tools: list[dict[str, Any]] | None = None, max_tokens: int = 6) -> str:
    import mlx.core as mx
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = _load()
    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    mx.random.seed(seed)
    text: str = generate(model, tokenizer, prompt=prompt, max_tokens=max_tokens,
                         sampler=make_sampler(temp=temperature))
    return text


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_short_messages_get_a_reply(temperature: float) -> None:
    replies = {m: _reply([{"role": "user", "content": m}], temperature=temperature, seed=i)
               for i, m in enumerate(SHORT_MESSAGES)}
    empty = [m for m, reply in replies.items() if not reply.strip()]
    assert len(empty) <= MOST_EMPTY, f"empty replies to {empty}: {replies}"


def test_the_template_does_tool_calls_mlx_lm_reads() -> None:
    _, tokenizer = _load()
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"
    assert tokenizer.tool_call_end == "</tool_call>"
    text = _reply([{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
                  max_tokens=64)
    splitter = ToolCallSplitter(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser,
                                [WEATHER])
    _, calls = splitter.feed(text)
    rest, more = splitter.close()
    (call,) = calls + more
    assert call.name == "get_weather", text
    arguments = json.loads(call.arguments)  # the city is a 6 M-parameter guess: the shape is the point
    assert list(arguments) == ["city"] and isinstance(arguments["city"], str) and arguments["city"], text
    assert not rest.strip(), text


def test_a_tool_call_and_its_answer_render_back_through_the_template() -> None:
    _, tokenizer = _load()
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    rendered = tokenizer.apply_chat_template(messages, tools=[WEATHER], add_generation_prompt=True,
                                             tokenize=False)
    assert "get_weather(city): Get the current weather in a city\n" in rendered
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call></s>'
    assert call in rendered
    assert rendered.endswith('<tool_response>\n{"sky": "clear"}\n</tool_response>\n<|assistant|>\n')
