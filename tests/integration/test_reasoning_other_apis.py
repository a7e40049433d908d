"""A reasoning model through Anthropic's `/v1/messages` and OpenAI's `/v1/responses`, on a scripted
backend and through the official clients: thinking blocks and reasoning items (whole and
streamed), Anthropic's `thinking` (disabled, and `budget_tokens` enforced as a cap: the thinking
is cut, its end marker written for the model, and the answer goes on as a continuation),
`reasoning.effort`, `chat_template_kwargs`, and earlier turns' thinking back into the template."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx2
import openai
import pytest
from starlette.applications import Starlette

from adapters.frontend.app import build_app
from adapters.frontend.frontend import Frontend
from support.tiny_models import THINK_END
from tests.integration.fake_backend import FakeBackend, completed, replied
from tests.integration.scripted_text import prompt_text, say, token_ids

ASK: Any = [{"role": "user", "content": "What is two and two?"}]
THOUGHT = "Two and two: count them. That is four."
ANSWER = "\n\nIt is four."
REPLY = THOUGHT + THINK_END + ANSWER


@pytest.fixture
def app(thinking: Frontend) -> Starlette:
    return build_app(thinking)


# ---------------------------------------------------------------------------------------------
# /v1/messages


async def test_messages_answer_with_a_thinking_block_whole_and_streamed(
        claude: anthropic.AsyncAnthropic, backend: FakeBackend, thinking: Frontend) -> None:
    backend.scripts.extend([say(thinking, REPLY), say(thinking, REPLY)])
    whole = await claude.messages.create(model="tiny", max_tokens=100, messages=ASK)
    assert [block.type for block in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == THOUGHT and whole.content[1].text == ANSWER  # type: ignore[union-attr]
    assert whole.usage.output_tokens == len(token_ids(thinking, REPLY)) + 1
    thoughts, texts, kinds = [], [], []
    async with claude.messages.stream(model="tiny", max_tokens=100, messages=ASK) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                thoughts.append(event.delta.thinking)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                texts.append(event.delta.text)
        streamed = await stream.get_final_message()
    assert ("".join(thoughts), "".join(texts)) == (THOUGHT, ANSWER)
    def shown(blocks: Any) -> list[tuple[str, str]]:
        return [(str(block.type), str(getattr(block, "thinking", None) or getattr(block, "text", "")))
                for block in blocks]

    assert shown(streamed.content) == shown(whole.content) == [("thinking", THOUGHT), ("text", ANSWER)]
    assert kinds[:2] == ["message_start", "content_block_start"]


async def test_thinking_disabled_closes_the_think_block_in_the_prompt(
        claude: anthropic.AsyncAnthropic, backend: FakeBackend, thinking: Frontend) -> None:
    backend.scripts.append(say(thinking, "Four."))
    message = await claude.messages.create(model="tiny", max_tokens=20, messages=ASK,
                                           thinking={"type": "disabled"})
    assert prompt_text(thinking, backend).endswith("<think>\n\n</think>\n\n")
    assert [block.type for block in message.content] == ["text"]


async def test_budget_tokens_caps_the_thinking(
        claude: anthropic.AsyncAnthropic, backend: FakeBackend, thinking: Frontend) -> None:
    long_thought = token_ids(thinking, THOUGHT)
    budget = 5
    assert len(long_thought) > budget
    backend.scripts.extend([[*(replied(t) for t in long_thought), completed("length")],
                            say(thinking, "Four.")])
    message = await claude.messages.with_raw_response.create(
        model="tiny", max_tokens=40, messages=ASK, thinking={"type": "enabled", "budget_tokens": budget},
        extra_headers={"x-request-id": "cap"})
    first, rest = backend.generations[-2:]
    assert first.stops == 1  # cut at the budget
    end = token_ids(thinking, THINK_END)
    assert rest.request.prompt == first.request.prompt + tuple(long_thought[:budget]) + tuple(end)
    assert rest.request.request_id == "cap.answer"
    assert rest.request.sampling.max_tokens == 40 - budget - len(end)
    body = await message.parse()
    assert body.content[0].thinking == thinking.tokenizer.decode(long_thought[:budget])  # type: ignore[union-attr]
    assert body.content[1].text == "Four."  # type: ignore[union-attr]
    assert body.usage.output_tokens == budget + len(end) + len(token_ids(thinking, "Four.")) + 1


async def test_a_budget_that_is_never_reached_changes_nothing(
        claude: anthropic.AsyncAnthropic, backend: FakeBackend, thinking: Frontend) -> None:
    backend.scripts.append(say(thinking, REPLY))
    message = await claude.messages.create(model="tiny", max_tokens=100, messages=ASK,
                                           thinking={"type": "enabled", "budget_tokens": 50})
    assert len(backend.generations) == 1 and backend.last.stops == 0
    assert message.content[0].thinking == THOUGHT  # type: ignore[union-attr]


async def test_a_budget_that_leaves_no_room_ends_the_reply_at_max_tokens(
        claude: anthropic.AsyncAnthropic, backend: FakeBackend, thinking: Frontend) -> None:
    backend.scripts.append(say(thinking, THOUGHT, end="length"))
    budget = 8
    message = await claude.messages.create(model="tiny", max_tokens=budget + 1, messages=ASK,
                                           thinking={"type": "enabled", "budget_tokens": budget})
    assert len(backend.generations) == 1
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == budget + 1


@pytest.mark.parametrize(("thinking_config", "status"), [
    ({"type": "enabled", "budget_tokens": 20}, 400),  # not less than max_tokens
    ({"type": "enabled"}, 400),  # no budget
    ({"type": "sometimes"}, 400),
])
async def test_what_thinking_cannot_be_is_refused(
        sdk_http: httpx2.AsyncClient, thinking_config: dict[str, Any], status: int) -> None:
    response = await sdk_http.post("/v1/messages", json={"model": "tiny", "max_tokens": 20, "messages": ASK,
                                                     "thinking": thinking_config})
    assert response.status_code == status, response.text
    assert response.json()["type"] == "error"


async def test_thinking_blocks_sent_back_go_into_the_template(
        claude: anthropic.AsyncAnthropic, backend: FakeBackend, thinking: Frontend) -> None:
    backend.scripts.append(say(thinking, REPLY))
    await claude.messages.create(model="tiny", max_tokens=100, messages=[
        *ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Easy.", "signature": ""},
                                                {"type": "text", "text": "Four."}]},
        {"role": "user", "content": "And three and three?"}])
    assert "<assistant>\n<think>\nEasy.\n</think>\n\nFour." in prompt_text(thinking, backend)


async def test_display_omitted_sends_empty_thinking(
        claude: anthropic.AsyncAnthropic, backend: FakeBackend, thinking: Frontend) -> None:
    backend.scripts.append(say(thinking, REPLY))
    message = await claude.messages.create(model="tiny", max_tokens=100, messages=ASK, thinking={
        "type": "adaptive", "display": "omitted"})
    assert message.content[0].thinking == "" and message.content[1].text == ANSWER  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------
# /v1/responses


async def test_responses_answer_with_a_reasoning_item_whole_and_streamed(
        gpt: openai.AsyncOpenAI, backend: FakeBackend, thinking: Frontend) -> None:
    backend.scripts.extend([say(thinking, REPLY), say(thinking, REPLY)])
    whole = await gpt.responses.create(model="tiny", input=ASK, include=["reasoning.encrypted_content"],
                                       reasoning={"effort": "high", "summary": "auto"})
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert reasoning.summary == [] and [(c.type, c.text) for c in reasoning.content or []] == [
        ("reasoning_text", THOUGHT)]
    assert reasoning.encrypted_content is None  # nothing is encrypted: the text is in the content
    assert whole.output_text == ANSWER
    assert whole.usage is not None
    assert whole.usage.output_tokens_details.reasoning_tokens == len(token_ids(thinking, THOUGHT + THINK_END))
    assert whole.reasoning is not None and whole.reasoning.effort == "high"
    stream = await gpt.responses.create(model="tiny", input=ASK, stream=True)
    deltas, done = [], None
    async for event in stream:
        if event.type == "response.reasoning_text.delta":
            deltas.append(event.delta)
        if event.type == "response.completed":
            done = event.response
    assert "".join(deltas) == THOUGHT
    assert done is not None
    assert [item.model_dump(exclude={"id"}) for item in done.output] == [
        item.model_dump(exclude={"id"}) for item in whole.output]


async def test_reasoning_effort_none_turns_thinking_off_and_reasoning_items_go_back(
        gpt: openai.AsyncOpenAI, backend: FakeBackend, thinking: Frontend) -> None:
    backend.scripts.extend([say(thinking, "Four."), say(thinking, REPLY)])
    await gpt.responses.create(model="tiny", input=ASK, reasoning={"effort": "none"})
    assert prompt_text(thinking, backend).endswith("<think>\n\n</think>\n\n")
    items: Any = [*ASK, {"type": "reasoning", "id": "rs_1", "summary": [],
                         "content": [{"type": "reasoning_text", "text": "Easy."}]},
                  {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three?"}]
    await gpt.responses.create(model="tiny", input=items)
    assert "<assistant>\n<think>\nEasy.\n</think>\n\nFour." in prompt_text(thinking, backend)


async def test_chat_template_kwargs_on_both_apis(
        sdk_http: httpx2.AsyncClient, backend: FakeBackend, thinking: Frontend) -> None:
    backend.scripts.extend([say(thinking, "Four."), say(thinking, "Four.")])
    closed = "<think>\n\n</think>\n\n"
    kwargs = {"enable_thinking": False}
    await sdk_http.post("/v1/responses", json={"input": "Hi", "chat_template_kwargs": kwargs})
    assert prompt_text(thinking, backend).endswith(closed)
    await sdk_http.post("/v1/messages", json={"model": "tiny", "max_tokens": 9, "messages": ASK,
                                          "chat_template_kwargs": kwargs})
    assert prompt_text(thinking, backend).endswith(closed)
    refused = await sdk_http.post("/v1/responses", json={"input": "Hi",
                                                     "chat_template_kwargs": {"enable_thinking": 1}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"
