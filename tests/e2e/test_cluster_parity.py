"""Through a 3-node cluster, responses are byte-identical to a single node's.

For each cache layout whose path through a cluster differs (plain KV in slots, sliding window,
hybrid linear attention, CacheList; the rest are pinned across processes by the handoff
tests): completions and chat, streaming and not,
greedy and seeded, with and without logits shaping (bias, penalties, min_p), under a JSON schema
(response_format), several choices (n) with logprobs, a reasoning model's thinking split from its
answer (the llama checkpoint has think markers and a template that opens a think block; a bias on
the end marker makes it answer too); bodies equal once
`id` and `created` are dropped; every SSE chunk equal; usage
equal; prompts long enough to wrap gemma3's window. Then many pulls back to back, which reuse
the decode node's receive buffers, each one equal to the single node. The llama cluster's decode
node speculates (`--speculative ngram`) and the single node does not: every case above runs
through it, and a prompt that repeats itself makes it draft and verify.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.tiny_models import cached_checkpoint
from tests.e2e.harness import Cluster, Node, assert_no_leaks, post, start_cluster, stream_events, without_ids

pytestmark = pytest.mark.e2e

LONG = (
    "The old lighthouse keeper climbed the stairs every evening, counting each step and "
    "listening to the sea. He kept a small notebook where he wrote the colour of the sky, "
    "the direction of the wind and the names of the ships that passed the rocks. "
) * 3

ASK_LONG: Any = [{"role": "user", "content": LONG}]

ANSWER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color"],
                 "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}}}

CASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": LONG, "max_tokens": 24, "temperature": 0}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.9,
                         "top_p": 0.9, "seed": 11}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 20,
                              "temperature": 0.7, "top_k": 40, "seed": 5}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Tell me about ships."}],
                              "max_tokens": 20, "temperature": 0}),
    # Logits shaping (the penalties look back on prompt + generated tokens on both nodes) and
    # logprobs (the first token's come from the prefill node, the rest from the decode node).
    ("/v1/completions", {"prompt": LONG, "max_tokens": 16, "temperature": 0, "repetition_penalty": 1.3,
                         "presence_penalty": 0.5, "frequency_penalty": 0.3, "frequency_context_size": 8,
                         "logit_bias": {"17": 4.0, "30": -100}, "logprobs": 2}),
    # Seeded shaping and XTC; n: choice 1 runs as its own request with seed + 1, on both, and the
    # two join mlx-lm's batch generator (gemma3_text, qwen3_next, falcon_h1, mamba2) in one step on
    # either node, so even their logprob floats are equal.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me about ships."}],
                              "max_tokens": 14, "temperature": 0.8, "min_p": 0.05, "seed": 3,
                              "presence_penalty": 2.0, "repetition_context_size": 5, "xtc_probability": 0.5,
                              "xtc_threshold": 0.05, "n": 2, "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 12, "temperature": 0.9, "seed": 21, "n": 3,
                         "logprobs": 3}),
    # Structured output: the decode node's grammar starts from the prefill node's first token.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Is the sea blue? Answer in JSON."}],
                              "max_tokens": 48, "temperature": 0.8, "seed": 7,
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "answer", "strict": True, "schema": ANSWER_SCHEMA}}}),
    # Thinking, then an answer (on the llama checkpoint, whose last token is the think end marker;
    # elsewhere a bias on an ordinary token), a stop string in both parts, and the thinking of
    # an earlier turn sent back.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG},
                                           {"role": "assistant", "content": "Ships.", "reasoning": "Hm."},
                                           {"role": "user", "content": "Tell me about ships."}],
                              "max_tokens": 24, "temperature": 0.7, "seed": 13, "stop": [" the"],
                              "logit_bias": {"511": 10.0}}),
]


# The families whose cluster path differs: the slot layout (llama), a rotating window the long
# prompts wrap (gemma3_text), the batch generator with linear attention (qwen3_next) and a
# CacheList (falcon_h1). The engine and the wire are pinned bit-exact across processes for every
# family (mamba2 and llama4 too) in every dtype by tests/integration/test_handoff_cross_process.py,
# which also joins a handed-off request to a running decoder for each layout; a cluster here per
# dtype or per remaining family would start four more clusters to check that path again.
MODELS = [
    ("llama", "float32"),  # plain KV (the slot layout)
    ("gemma3_text", "float32"),  # rotating KV (sliding window)
    ("qwen3_next", "float32"),  # arrays (linear attention) + KV
    ("falcon_h1", "float32"),  # CacheList
]


def _model_id(model: tuple[str, str]) -> str:
    return f"{model[0]}-{model[1]}"


# Tests of what only llama's cluster has (a reasoning model's think markers, a speculating decode
# node) run on it alone: the same module-scoped cluster, not one more.
LLAMA_CLUSTER = pytest.mark.parametrize("cluster", [MODELS[0]], indirect=True, ids=_model_id)


@pytest.fixture(scope="module", params=MODELS, ids=_model_id)
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    family, dtype = request.param
    # llama's tokenizer is a reasoning model's (think markers, a template that opens a think
    # block), so every chat case through it has its thinking split off, on both paths
    model = cached_checkpoint(family, dtype=dtype, thinking=True) if family == "llama" else cached_checkpoint(
        family, dtype=dtype)
    speculating = ("--speculative", "ngram", "--num-draft-tokens", "4") if family == "llama" else ()
    built = start_cluster(model, tmp_path_factory.mktemp(f"logs-{family}-{dtype}"), decode_args=speculating)
    try:
        yield built
    finally:
        built.stop()


def _distinct_text(text: str) -> None:
    assert len(set(text)) >= 4, f"degenerate output: {text!r}"


@pytest.mark.parametrize(("path", "body"), CASES)
def test_non_streaming_identical(cluster: Cluster, path: str, body: dict[str, Any]) -> None:
    single = post(cluster.single, path, body)
    routed = post(cluster.router, path, body)
    assert single.status_code == routed.status_code == 200, (single.text, routed.text)
    assert without_ids(routed.json()) == without_ids(single.json())
    choice = single.json()["choices"][0]
    message = choice.get("message", {})
    _distinct_text(choice["text"] if "text" in choice else
                   (message.get("reasoning_content") or "") + (message["content"] or ""))
    if "response_format" in body:  # a bounded schema always ends, and its answer validates
        answer = json.loads(choice["message"]["content"])
        assert choice["finish_reason"] == "stop" and set(answer) == {"ok", "color"}, answer


@pytest.mark.parametrize(("path", "body"), CASES)
def test_streaming_identical(cluster: Cluster, path: str, body: dict[str, Any]) -> None:
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    single = stream_events(cluster.single, path, streamed)
    routed = stream_events(cluster.router, path, streamed)
    assert single[-1] == routed[-1] == "[DONE]"
    assert [without_ids(json.loads(e)) for e in routed[:-1]] == [
        without_ids(json.loads(e)) for e in single[:-1]
    ]
    completion_tokens = json.loads(single[-2])["usage"]["completion_tokens"]
    if "response_format" in body:  # ends with EOS, as its grammar says
        assert completion_tokens < body["max_tokens"]
    elif "stop" not in body:
        assert completion_tokens == body["max_tokens"] * body.get("n", 1)


@LLAMA_CLUSTER
def test_thinking_and_answer_are_the_unparsed_completion(cluster: Cluster) -> None:
    """On the reasoning model (llama's checkpoint): a streamed chat's reasoning_content and content
    are, with the end marker between them, the text a completion of the same prompt ids generates,
    through the router as on the single node."""
    messages = [{"role": "user", "content": LONG}]
    shared = {"max_tokens": 32, "temperature": 0, "logit_bias": {"511": 10.0}}  # 511: "</think>"
    chat = {**shared, "messages": messages, "stream": True}
    for node in (cluster.single, cluster.router):
        events = stream_events(node, "/v1/chat/completions", chat)[:-1]
        deltas = [json.loads(e)["choices"][0]["delta"] for e in events]
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
        prompt = post(node, "/tokenize", {"messages": messages}).json()["tokens"]
        raw = post(node, "/v1/completions", {**shared, "prompt": prompt}).json()["choices"][0]["text"]
        assert "</think>" in raw and content, raw  # it thought, then answered
        assert reasoning + "</think>" + content == raw


@LLAMA_CLUSTER
def test_thinking_through_the_official_clients_with_a_budget(cluster: Cluster) -> None:
    """On the reasoning model: Anthropic's thinking blocks, capped by `budget_tokens` (the answer
    goes on as a continuation request, handed off like any other), and the Responses API's
    reasoning items, through the official clients: the same on the single node and the router."""
    import anthropic

    from tests.e2e.harness import openai_client

    model = Path(cluster.single.args[cluster.single.args.index("--model") + 1])

    def message(node: Node) -> Any:
        claude = anthropic.Anthropic(base_url=node.url, api_key="unused", max_retries=0, timeout=60.0)
        return claude.messages.create(model=model.name, max_tokens=30, messages=ASK_LONG,
                                      thinking={"type": "enabled", "budget_tokens": 6},
                                      extra_body={"temperature": 0}).model_dump()

    def response(node: Node) -> Any:
        return openai_client(node).responses.create(model=model.name, input=LONG, max_output_tokens=24,
                                                    temperature=0, reasoning={"effort": "high"}).model_dump()

    capped = [message(node) for node in (cluster.single, cluster.router)]
    assert without_ids(capped[0]) == without_ids(capped[1])
    thought, answer = capped[0]["content"][0], capped[0]["content"][1]
    assert thought["type"] == "thinking" and answer["type"] == "text" and answer["text"]
    prompt = post(cluster.single, "/tokenize", {"messages": ASK_LONG}).json()["tokens"]
    six = post(cluster.single, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert thought["thinking"] == six.json()["choices"][0]["text"]  # cut at the budget
    reasoned = [without_ids({k: v for k, v in response(node).items() if k != "created_at"})
                for node in (cluster.single, cluster.router)]
    assert reasoned[0] == reasoned[1]
    assert reasoned[0]["output"][0]["type"] == "reasoning"


@LLAMA_CLUSTER
def test_reasoning_in_chat_and_in_streamed_messages_through_the_official_clients(cluster: Cluster) -> None:
    """On the reasoning model: the openai client's chat has the thinking in `reasoning_content`
    (and `reasoning`) beside `content`, whole and in the streamed deltas; the anthropic client's
    streamed thinking deltas make the thinking block its whole message has (cut at
    `budget_tokens`); the same on the single node and the router."""
    import anthropic

    from tests.e2e.harness import openai_client

    model = Path(cluster.single.args[cluster.single.args.index("--model") + 1]).name
    chat: dict[str, Any] = {"model": model, "messages": ASK_LONG, "max_tokens": 32, "temperature": 0,
                            "logit_bias": {"511": 10.0}}  # 511: "</think>", so that it answers too
    nodes = (cluster.single, cluster.router)
    whole = [without_ids(openai_client(node).chat.completions.create(**chat).model_dump()) for node in nodes]
    assert whole[0] == whole[1]
    message = whole[0]["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] and message["reasoning_content"]
    assert message["content"]
    for node in nodes:
        reasoning = content = ""
        for chunk in openai_client(node).chat.completions.create(**chat, stream=True):
            for choice in chunk.choices:
                extra = choice.delta.model_extra or {}
                assert extra.get("reasoning") == extra.get("reasoning_content")
                reasoning += extra.get("reasoning_content") or ""
                content += choice.delta.content or ""
        assert (reasoning, content) == (message["reasoning_content"], message["content"])
    capped: dict[str, Any] = {"model": model, "max_tokens": 30, "messages": ASK_LONG,
                              "thinking": {"type": "enabled", "budget_tokens": 6},
                              "extra_body": {"temperature": 0}}
    finals = []
    for node in nodes:
        claude = anthropic.Anthropic(base_url=node.url, api_key="unused", max_retries=0, timeout=60.0)
        thoughts, texts = "", ""
        with claude.messages.stream(**capped) as stream:
            for event in stream:
                if event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                    thoughts += event.delta.thinking
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    texts += event.delta.text
            final = stream.get_final_message().model_dump()
        assert [block["type"] for block in final["content"]] == ["thinking", "text"]
        assert (thoughts, texts) == (final["content"][0]["thinking"], final["content"][1]["text"])
        finals.append(without_ids(final))
    assert finals[0] == finals[1]
    assert finals[0]["content"] == without_ids(claude.messages.create(**capped).model_dump())["content"]


def test_nothing_leaks_after_the_cases(cluster: Cluster) -> None:
    assert_no_leaks(cluster.nodes)
    for node in (*cluster.prefill, *cluster.decode):
        outcomes = node.stats()["outcomes"]
        assert outcomes.get("done", 0) >= len(CASES) and not outcomes.get("failed"), outcomes


def test_handoffs_really_happened(cluster: Cluster, tmp_path: Path) -> None:
    """The forced-disaggregation router sent every request through the prefill node."""
    assert cluster.prefill[0].stats()["outcomes"].get("done", 0) >= 2 * len(CASES)
    # the KV streamed to the decode node, through shared memory (the nodes share this host)
    token = cluster.decode[0].args[cluster.decode[0].args.index("--internal-token") + 1] \
        if "--internal-token" in cluster.decode[0].args else ""
    records = httpx.get(f"{cluster.decode[0].url}/internal/handoffs", timeout=5,
                        headers={"x-statecore-token": token}).json()["records"]
    assert records and all(r["streamed"] and r["transport"] == "shm" for r in records), records[:2]
    assert cluster.decode[0].stats()["kv_receive_buffer_bytes"] <= 1 << 30


def test_many_pulls_back_to_back_stay_identical(cluster: Cluster) -> None:
    """Prompts of growing then shrinking length, one after another: each pull lands in a receive
    buffer a previous pull used (bigger or smaller than it), and every answer stays the single
    node's."""
    for words in (*range(4, 60, 8), *range(60, 4, -12)):
        body = {"prompt": " ".join(LONG.split()[:words]), "max_tokens": 6, "temperature": 0}
        single = post(cluster.single, "/v1/completions", body)
        routed = post(cluster.router, "/v1/completions", body)
        assert single.status_code == routed.status_code == 200, (single.text, routed.text)
        assert without_ids(routed.json()) == without_ids(single.json()), words
    assert_no_leaks(cluster.nodes)


@LLAMA_CLUSTER
def test_a_speculating_decode_node_answers_as_the_single_node(cluster: Cluster) -> None:
    """The tiny llama's greedy answer to this prompt soon repeats itself: the decode node drafts
    from it by prompt lookup (only llama's cluster speculates), and every answer is still the
    single node's."""
    assert "--speculative" in cluster.decode[0].args
    prompt = ("The old lighthouse keeper climbed the stairs every evening, counting each step and "
              "listening to the sea.")
    for body in ({"prompt": prompt, "max_tokens": 40, "temperature": 0},
                 {"prompt": f"{prompt} {prompt}", "max_tokens": 40, "temperature": 0.6, "seed": 4}):
        single = post(cluster.single, "/v1/completions", body)
        routed = post(cluster.router, "/v1/completions", body)
        assert single.status_code == routed.status_code == 200, (single.text, routed.text)
        assert without_ids(routed.json()) == without_ids(single.json())
    speculated = cluster.decode[0].stats()["speculative"]
    assert speculated["steps"] > 0 and speculated["accepted"] > 0, speculated
    assert cluster.single.stats()["speculative"]["steps"] == 0
