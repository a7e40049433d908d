"""The official `openai` and `anthropic` clients against a single node and a 1 prefill + 1 decode
cluster on real processes: every served parameter and endpoint, whole and streamed, and the same
answer from both where the output is deterministic (greedy, or seeded), ids and times aside.
Every engine node serves a LoRA adapter (`--adapters story=...`, a request names it in
`adapters`; one more single node applies it to every request, `--adapter-path`), and the decode
node drafts with a draft model (`--draft-model`, the model itself, so its drafts stand): every
case below that may speculate (no adapter named, no logprobs, no logits shaping, no grammar)
runs through verify steps on the router's path and must still give the single node's bytes.

The tiny random model never calls a tool by itself, so tools are checked here for what reaches
the model (the same prompt on both paths, and a reply); parsing calls is tested on a scripted
backend (tests/integration/test_tool_calls_api.py, test_other_apis.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from support.tiny_adapter import build_lora_adapter
from support.tiny_models import cached_checkpoint
from tests.e2e.harness import Cluster, Node, assert_no_leaks, openai_client, start_cluster

pytestmark = pytest.mark.e2e

STORY = ("The lighthouse keeper counted the steps every evening and wrote the colour of the sky "
         "in a small notebook, with the names of the ships that passed the rocks.")
USER = [{"role": "user", "content": STORY}]
TOOLS: Any = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


BOUNDED_TOOLS: Any = [{"type": "function", "function": {
    "name": "set_unit", "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
                                       "required": ["unit"], "additionalProperties": False}}}]


MODEL = cached_checkpoint("llama").name  # the served name: the model directory's


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lora_adapter(cached_checkpoint("llama"), tmp_path_factory.mktemp("adapter"))


@pytest.fixture(scope="module")
def adapted_loading(tmp_path_factory: pytest.TempPathFactory, adapter: Path) -> Iterator[Node]:
    """A single node applying the adapter to every request (`--adapter-path`, mlx_lm.server's
    flag), started before the cluster so that it loads while the cluster does."""
    node = Node("single", ["--model", str(cached_checkpoint("llama")), "--adapter-path", str(adapter)],
                tmp_path_factory.mktemp("logs-adapted") / "single.log")
    node.start()
    try:
        yield node
    finally:
        assert node.stop() == 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, adapter: Path,
            adapted_loading: Node) -> Iterator[Cluster]:
    model = cached_checkpoint("llama")
    built = start_cluster(model, tmp_path_factory.mktemp("logs-clients"),
                          node_args=("--adapters", f"story={adapter}"),
                          decode_args=("--draft-model", str(model), "--num-draft-tokens", "3"))
    try:
        yield built
    finally:
        built.stop()


# Typed loosely: these calls pass parameters the SDKs' typed signatures do not list.
def client(node: Node) -> Any:
    return openai_client(node)


def anthropic_client(node: Node) -> Any:
    return anthropic.Anthropic(base_url=node.url, api_key="unused", max_retries=0, timeout=60.0)


_DIFFERENT = ("id", "item_id", "created", "created_at", "call_id")


def stable(doc: Any) -> Any:
    """A client's answer as data, without what differs between two answers to one request."""
    if isinstance(doc, dict):
        return {k: stable(v) for k, v in doc.items() if k not in _DIFFERENT}
    if isinstance(doc, list):
        return [stable(v) for v in doc]
    return doc


def same_on_both(cluster: Cluster, call: Callable[[Node], Any]) -> Any:
    """`call` on the single node and through the router: the answers must agree; returns one."""
    alone, routed = stable(call(cluster.single)), stable(call(cluster.router))
    assert routed == alone
    return alone


def dumped(items: Any) -> list[Any]:
    return [item.model_dump() for item in items]


OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}

CHAT_CASES: list[dict[str, Any]] = [
    {"max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 3},
    {"max_tokens": 12, "temperature": 0.8, "seed": 5, "top_p": 0.9, "stop": ["the"],
     "extra_body": {"top_k": 30, "min_p": 0.05, "xtc_probability": 0.5, "xtc_threshold": 0.05}},
    {"max_tokens": 12, "temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 0.5,
     "logit_bias": {"17": 5.0}, "extra_body": {"repetition_penalty": 1.3, "repetition_context_size": 8}},
    {"max_tokens": 8, "temperature": 0.9, "seed": 2, "n": 3, "logprobs": True, "top_logprobs": 3},
    {"max_tokens": 8, "temperature": 0, "tools": TOOLS},
    {"max_tokens": 120, "temperature": 0.8, "seed": 4, "tools": BOUNDED_TOOLS, "tool_choice": "required"},
    {"max_tokens": 40, "temperature": 0.7, "seed": 9, "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": OK_SCHEMA}}},
    {"max_tokens": 80, "temperature": 0.7, "seed": 2, "response_format": {"type": "json_object"}},
]


@pytest.mark.parametrize("params", CHAT_CASES)
def test_chat_completions_whole_and_streamed(cluster: Cluster, params: dict[str, Any]) -> None:
    whole = same_on_both(cluster, lambda node: client(node).chat.completions.create(
        model=MODEL, messages=USER, **params).model_dump())
    assert len(whole["choices"]) == params.get("n", 1)
    if params.get("tool_choice") == "required":  # the grammar forces one call, and nothing else
        [choice] = whole["choices"]
        assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "set_unit"
        assert json.loads(call["function"]["arguments"])["unit"] in ("c", "f")
    else:
        assert all(choice["message"]["content"] for choice in whole["choices"])
    if "response_format" in params:
        assert whole["choices"][0]["finish_reason"] == "stop"
        answer = json.loads(whole["choices"][0]["message"]["content"])
        assert isinstance(answer, dict) and (params["response_format"]["type"] == "json_object"
                                             or isinstance(answer["ok"], bool))
    if params.get("logprobs"):
        entries = [entry for choice in whole["choices"] for entry in choice["logprobs"]["content"]]
        assert len(entries) == whole["usage"]["completion_tokens"]
        assert all(len(entry["top_logprobs"]) == 3 for entry in entries)

    def streamed(node: Node) -> Any:
        stream = client(node).chat.completions.create(model=MODEL, messages=USER, stream=True,
                                                             stream_options={"include_usage": True}, **params)
        return dumped(stream)

    chunks = same_on_both(cluster, streamed)
    for index, choice in enumerate(whole["choices"]):
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"] and c["choices"][0]["index"] == index)
        assert text == (choice["message"]["content"] or "")
    assert chunks[-1]["usage"] == whole["usage"]


def test_completions_with_logprobs_and_the_tokenizer_endpoints(cluster: Cluster) -> None:
    whole = same_on_both(cluster, lambda node: client(node).completions.create(
        model=MODEL, prompt=STORY, max_tokens=10, temperature=0, logprobs=2).model_dump())
    choice = whole["choices"][0]
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    tokens = same_on_both(cluster, lambda node: httpx.post(f"{node.url}/tokenize",
                                                           json={"prompt": STORY}).json())
    assert tokens["count"] == whole["usage"]["prompt_tokens"]
    text = same_on_both(cluster, lambda node: httpx.post(f"{node.url}/detokenize",
                                                         json={"tokens": tokens["tokens"]}).json())
    assert STORY in text["prompt"]


def test_responses_whole_and_streamed(cluster: Cluster) -> None:
    params: dict[str, Any] = {"model": MODEL, "input": STORY, "instructions": "Be brief.",
                              "max_output_tokens": 10, "temperature": 0}
    whole = same_on_both(cluster, lambda node: client(node).responses.create(**params).model_dump())
    assert whole["status"] == "incomplete" and whole["output"][0]["content"][0]["text"]

    def streamed(node: Node) -> Any:  # the events (the SDK's stream helper wants response.completed)
        return dumped(client(node).responses.create(**params, stream=True))

    events = same_on_both(cluster, streamed)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole["output"][0]["content"][0]["text"] and events[-1]["type"] == "response.incomplete"
    with_tools = same_on_both(cluster, lambda node: client(node).responses.create(
        **params, tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
    ).model_dump())
    assert with_tools["tools"][0]["name"] == "get_weather"
    as_json = same_on_both(cluster, lambda node: client(node).responses.create(
        **{**params, "max_output_tokens": 40}, text={"format": {"type": "json_schema", "name": "answer",
                                                                "schema": OK_SCHEMA}}).model_dump())
    assert as_json["status"] == "completed" and as_json["text"]["format"]["name"] == "answer"
    assert isinstance(json.loads(as_json["output"][0]["content"][0]["text"])["ok"], bool)


def test_responses_logprobs_are_the_chats_whole_and_streamed(cluster: Cluster) -> None:
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: the numbers the chat's
    `logprobs` gives for the same prompt (greedy), on a single node and through the cluster."""
    params: dict[str, Any] = {"model": MODEL, "input": STORY, "instructions": "Be brief.",
                              "max_output_tokens": 10, "temperature": 0, "top_logprobs": 3,
                              "include": ["message.output_text.logprobs"]}
    chat = same_on_both(cluster, lambda node: client(node).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *USER], max_tokens=10,
        temperature=0, logprobs=True, top_logprobs=3).model_dump())
    expected = chat["choices"][0]["logprobs"]["content"]
    assert len(expected) == 10 and all(len(entry["top_logprobs"]) == 3 for entry in expected)
    whole = same_on_both(cluster, lambda node: client(node).responses.create(**params).model_dump())
    [part] = whole["output"][0]["content"]
    assert whole["top_logprobs"] == 3 and part["logprobs"] == expected
    assert part["text"] == chat["choices"][0]["message"]["content"]
    events = same_on_both(cluster, lambda node: dumped(client(node).responses.create(**params, stream=True)))
    in_events = [{"token": e["token"], "logprob": e["logprob"], "top_logprobs": [
        {"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]} for e in expected]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [entry for delta in deltas for entry in delta["logprobs"]] == in_events
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == expected


def test_messages_whole_and_streamed(cluster: Cluster) -> None:
    params: dict[str, Any] = {"model": MODEL, "max_tokens": 10, "system": "Be brief.",
                              "messages": [{"role": "user", "content": STORY}], "stop_sequences": ["the"],
                              "extra_body": {"temperature": 0}}
    whole = same_on_both(cluster, lambda node: anthropic_client(node).messages.create(**params).model_dump())
    assert whole["stop_reason"] in ("max_tokens", "stop_sequence") and whole["content"][0]["text"]

    def streamed(node: Node) -> Any:
        with anthropic_client(node).messages.stream(**params) as stream:
            return stream.get_final_message().model_dump()

    assert same_on_both(cluster, streamed)["content"] == whole["content"]
    tools = [{"name": "get_weather", "description": "The weather", "input_schema": {"type": "object"}}]
    with_tools = same_on_both(cluster, lambda node: anthropic_client(node).messages.create(
        **params, tools=tools).model_dump())
    assert with_tools["content"]
    as_json = same_on_both(cluster, lambda node: anthropic_client(node).messages.create(
        **{**params, "max_tokens": 40, "stop_sequences": None, "extra_body": {
            "temperature": 0, "output_format": {"type": "json_schema", "schema": OK_SCHEMA}}},
    ).model_dump())
    assert as_json["stop_reason"] == "end_turn"
    counted = same_on_both(cluster, lambda node: anthropic_client(node).messages.count_tokens(
        model=MODEL, system="Be brief.", messages=params["messages"]).model_dump())
    assert counted["input_tokens"] == whole["usage"]["input_tokens"]
    assert isinstance(json.loads(as_json["content"][0]["text"])["ok"], bool)


def speculated(cluster: Cluster) -> dict[str, int]:
    """The decode node's speculation counters (verify steps, drafts checked, drafts that stood)."""
    counts: dict[str, int] = cluster.decode[0].stats()["speculative"]
    return counts


def test_a_request_s_adapter_through_the_openai_client(cluster: Cluster) -> None:
    """`adapters` (mlx_lm.server's field, in `extra_body`) on chat and completions: the same answer
    on the single node and through the cluster, and not the base model's; the decode node, which
    speculates, decodes a request naming an adapter without it (and the base model's request
    with it); a name the nodes do not serve is a 400 listing the one they do."""
    chat: dict[str, Any] = {"model": MODEL, "messages": USER, "max_tokens": 24, "temperature": 0}
    before = speculated(cluster)
    adapted = same_on_both(cluster, lambda node: client(node).chat.completions.create(
        **chat, extra_body={"adapters": "story"}).model_dump())
    assert speculated(cluster) == before
    base = same_on_both(cluster, lambda node: client(node).chat.completions.create(**chat).model_dump())
    assert speculated(cluster)["steps"] > before["steps"]
    assert adapted["choices"][0]["message"]["content"] != base["choices"][0]["message"]["content"]
    completion = same_on_both(cluster, lambda node: client(node).completions.create(
        model=MODEL, prompt=STORY, max_tokens=10, temperature=0.7, seed=3,
        extra_body={"adapters": "story"}).model_dump())
    assert completion["choices"][0]["text"]
    for node in (cluster.single, cluster.router):
        with pytest.raises(openai.BadRequestError) as refused:
            client(node).completions.create(model=MODEL, prompt=STORY, max_tokens=4,
                                            extra_body={"adapters": "poem"})
        assert refused.value.param == "adapters" and "'story'" in refused.value.message


@pytest.fixture(scope="module")
def adapted(adapted_loading: Node) -> Node:
    adapted_loading.wait_healthy()
    return adapted_loading


def test_a_node_started_with_an_adapter_path_answers_as_mlx_lm_with_that_adapter(
        cluster: Cluster, adapted: Node, adapter: Path) -> None:
    """`--adapter-path` through the openai client: a greedy completion is the text of mlx-lm's own
    tokens with the adapter applied (not the base model's), whole and streamed; a chat, greedy and
    seeded, is what a request naming the same adapter (`adapters`) gets on a node serving it."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load as mlx_lm_load

    gpt = client(adapted)
    ids = [(7 * i + 3) % 400 + 20 for i in range(40)]
    model, tokenizer = mlx_lm_load(str(cached_checkpoint("llama")), adapter_path=str(adapter))[:2]
    expected = [int(token) for token, _ in generate_step(mx.array(ids), model, max_tokens=24)]
    whole = gpt.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0).model_dump()
    streamed = "".join(chunk.choices[0].text for chunk in gpt.completions.create(
        model=MODEL, prompt=ids, max_tokens=24, temperature=0, stream=True) if chunk.choices)
    base = client(cluster.single).completions.create(model=MODEL, prompt=ids, max_tokens=24,
                                                     temperature=0).model_dump()
    assert whole["choices"][0]["text"] == streamed == tokenizer.decode(expected)
    assert base["choices"][0]["text"] != streamed
    for params in ({"temperature": 0}, {"temperature": 0.8, "seed": 11, "top_p": 0.9}):
        chat: dict[str, Any] = {"model": MODEL, "messages": USER, "max_tokens": 24, **params}
        applied = client(adapted).chat.completions.create(**chat).model_dump()
        named = client(cluster.single).chat.completions.create(
            **chat, extra_body={"adapters": "story"}).model_dump()
        assert stable(applied) == stable(named)
    assert_no_leaks([adapted])


def test_chat_template_kwargs_through_the_official_clients(cluster: Cluster) -> None:
    """`chat_template_kwargs` (in `extra_body`) reach the template on chat, Responses and Messages
    (the tiny template writes `date_string`): each prompt is what `/tokenize` makes of the same
    messages and arguments, on the single node and through the cluster; an argument the server
    passes itself is a 400 naming the field, in each API's error shape."""
    kwargs = {"chat_template_kwargs": {"date_string": "1 Jan"}}
    counted = same_on_both(cluster, lambda node: httpx.post(f"{node.url}/tokenize",
                                                            json={"messages": USER, **kwargs}).json())
    plain = same_on_both(cluster, lambda node: httpx.post(f"{node.url}/tokenize",
                                                          json={"messages": USER}).json())
    assert counted["count"] > plain["count"]
    chat = same_on_both(cluster, lambda node: client(node).chat.completions.create(
        model=MODEL, messages=USER, max_tokens=4, temperature=0, extra_body=kwargs).model_dump())
    response = same_on_both(cluster, lambda node: client(node).responses.create(
        model=MODEL, input=STORY, max_output_tokens=4, temperature=0, extra_body=kwargs).model_dump())
    message = same_on_both(cluster, lambda node: anthropic_client(node).messages.create(
        model=MODEL, max_tokens=4, messages=USER, extra_body={"temperature": 0, **kwargs}).model_dump())
    assert (chat["usage"]["prompt_tokens"], response["usage"]["input_tokens"],
            message["usage"]["input_tokens"]) == (counted["count"],) * 3
    refused = {"chat_template_kwargs": {"tokenize": False}}
    for node in (cluster.single, cluster.router):
        gpt = client(node)
        with pytest.raises(openai.BadRequestError) as chat_error:
            gpt.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, extra_body=refused)
        with pytest.raises(openai.BadRequestError) as responses_error:
            gpt.responses.create(model=MODEL, input=STORY, max_output_tokens=4, extra_body=refused)
        assert chat_error.value.param == responses_error.value.param == "chat_template_kwargs"
        with pytest.raises(anthropic.BadRequestError) as messages_error:
            anthropic_client(node).messages.create(model=MODEL, max_tokens=4, messages=USER,
                                                   extra_body=refused)
        error: Any = messages_error.value.body
        assert error["error"]["type"] == "invalid_request_error"
        assert "chat_template_kwargs" in error["error"]["message"]


@pytest.mark.parametrize("params", [{"temperature": 0}, {"temperature": 0.8, "seed": 11, "top_p": 0.9}],
                         ids=["greedy", "seeded"])
def test_a_draft_model_on_the_decode_node_changes_no_token(cluster: Cluster, params: dict[str, Any]) -> None:
    """A chat through the cluster, whose decode node checks its draft model's guesses in verify
    steps, whole and streamed: the single node's bytes (it decodes without speculation), and
    drafts stood."""
    before = speculated(cluster)
    whole = same_on_both(cluster, lambda node: client(node).chat.completions.create(
        model=MODEL, messages=USER, max_tokens=30, **params).model_dump())
    chunks = same_on_both(cluster, lambda node: dumped(client(node).chat.completions.create(
        model=MODEL, messages=USER, max_tokens=30, stream=True, **params)))
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == whole["choices"][0]["message"]["content"]
    after = speculated(cluster)
    assert after["steps"] > before["steps"] and after["accepted"] > before["accepted"], (before, after)
    assert cluster.single.stats()["speculative"]["steps"] == 0


def test_a_request_s_num_draft_tokens(cluster: Cluster) -> None:
    """`num_draft_tokens` (mlx_lm.server's, in `extra_body`) travels with the request to the
    decode node: 0 decodes it without speculation, 1 checks one draft per verify step (the node's
    3 is the most); the tokens are the single node's either way; -1 is a 400 naming the field."""
    chat: dict[str, Any] = {"model": MODEL, "messages": USER, "max_tokens": 30, "temperature": 0}
    expected = same_on_both(cluster, lambda node: client(node).chat.completions.create(**chat).model_dump())
    for asked in (0, 1):
        before = speculated(cluster)
        answer = same_on_both(cluster, lambda node: client(node).chat.completions.create(
            **chat, extra_body={"num_draft_tokens": asked}).model_dump())  # noqa: B023 (called at once)
        assert answer == expected
        after = speculated(cluster)
        steps, drafted = after["steps"] - before["steps"], after["drafted"] - before["drafted"]
        assert (steps > 0, drafted) == (asked > 0, steps * asked), (asked, before, after)
    for node in (cluster.single, cluster.router):
        with pytest.raises(openai.BadRequestError) as refused:
            client(node).chat.completions.create(**chat, extra_body={"num_draft_tokens": -1})
        assert refused.value.param == "num_draft_tokens"


def test_nothing_is_left_behind(cluster: Cluster) -> None:
    assert_no_leaks(cluster.nodes)
    for node in (*cluster.prefill, *cluster.decode):
        outcomes = node.stats()["outcomes"]
        assert outcomes.get("done", 0) > 0 and not outcomes.get("failed"), outcomes
