"""Serving behaviour a user would notice, on real processes: concurrency over 2 prefill + 2
decode nodes, stop strings, byte-fallback usage, bad input, and a model whose cache cannot
travel."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters.serve.listeners import open_listener
from support.tiny_adapter import build_lora_adapter
from support.tiny_models import build_custom_cache_checkpoint, cached_checkpoint
from tests.e2e.harness import (
    ROOT,
    Cluster,
    Node,
    assert_no_leaks,
    outcomes,
    post,
    router,
    start_cluster,
    start_nodes,
    stream_events,
    without_ids,
)

pytestmark = pytest.mark.e2e

STORY = "A small boat drifted past the harbour wall while the gulls argued over bread."
TEMPLATE_ARGS = '{"date_string": "5 Dec 2026"}'  # the router's and the single node's, at start


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # every engine node serves one LoRA adapter (`--adapters`), the router learns its name from them
    adapter = build_lora_adapter(cached_checkpoint("llama"), tmp_path_factory.mktemp("adapter"))
    built = start_cluster(cached_checkpoint("llama"), tmp_path_factory.mktemp("logs-2x2"),
                          prefills=2, decodes=2, node_args=("--adapters", f"story={adapter}"),
                          public_args=("--chat-template-args", TEMPLATE_ARGS))
    try:
        yield built
    finally:
        built.stop()


def _text(response: httpx.Response) -> str:
    choice = response.json()["choices"][0]
    text: str = choice["text"] if "text" in choice else choice["message"]["content"]
    return text


def test_eight_concurrent_requests_all_correct_on_both_decode_nodes(cluster: Cluster) -> None:
    bodies = [{"prompt": f"{STORY} Number {i}.", "max_tokens": 12, "temperature": 0.5, "seed": i}
              for i in range(8)]
    expected = [post(cluster.single, "/v1/completions", b).json() for b in bodies]
    before = [n.stats()["outcomes"].get("done", 0) for n in cluster.decode]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda b: post(cluster.router, "/v1/completions", b), bodies))
    assert [r.status_code for r in got] == [200] * 8
    assert [without_ids(r.json()) for r in got] == [without_ids(e) for e in expected]
    after = [n.stats()["outcomes"].get("done", 0) for n in cluster.decode]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    assert all(p.stats()["outcomes"].get("done", 0) > 0 for p in cluster.prefill)
    assert_no_leaks(cluster.nodes)


def test_the_choices_of_one_request_decode_side_by_side_on_one_decode_node(cluster: Cluster) -> None:
    """n = 3 with logprobs over two decode nodes: the router sends every choice to the node the
    first one went to, where they decode together as on the single node: the same floats."""
    body = {"prompt": STORY, "max_tokens": 10, "temperature": 0.9, "seed": 4, "n": 3, "logprobs": 2}
    expected = post(cluster.single, "/v1/completions", body).json()
    for _ in range(2):  # each time on the decode node that the first choice was routed to
        before = [n.stats()["outcomes"].get("done", 0) for n in cluster.decode]
        routed = post(cluster.router, "/v1/completions", body)
        assert routed.status_code == 200, routed.text
        assert without_ids(routed.json()) == without_ids(expected)
        after = [n.stats()["outcomes"].get("done", 0) for n in cluster.decode]
        assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 3], (before, after)
    assert_no_leaks(cluster.nodes)


def test_the_start_s_template_args_make_the_same_prompt_on_the_router_and_a_single_node(
        cluster: Cluster) -> None:
    """`--chat-template-args` reach the tiny template's `date_string` on both, a request's
    `chat_template_kwargs` go over them, and the chats' answers are byte-identical."""
    for kwargs, date in (({}, "5 Dec 2026"), ({"chat_template_kwargs": {"date_string": "1 Jan"}}, "1 Jan")):
        body = {"messages": [{"role": "user", "content": STORY}], **kwargs}
        nodes = (cluster.single, cluster.router)
        prompts = [post(node, "/tokenize", body).json()["tokens"] for node in nodes]
        assert prompts[0] == prompts[1]
        text = post(cluster.single, "/detokenize", {"tokens": prompts[0]}).json()["prompt"]
        assert f"<date>{date}\n<user>\n{STORY}" in text, text
        chat = {**body, "max_tokens": 8, "temperature": 0}
        answers = [post(node, "/v1/chat/completions", chat) for node in nodes]
        assert without_ids(answers[0].json()) == without_ids(answers[1].json())
        assert answers[0].json()["usage"]["prompt_tokens"] == len(prompts[0])


def test_a_request_s_adapter_answers_alike_through_the_cluster(cluster: Cluster) -> None:
    """A request naming the nodes' adapter is prefilled and decoded with it on both nodes of a
    handoff: the router's answer is the single node's, and not the base model's."""
    for path, body in (("/v1/completions", {"prompt": STORY, "max_tokens": 10, "temperature": 0}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": STORY}],
                                                 "max_tokens": 10, "temperature": 0.7, "seed": 3})):
        adapted = {**body, "adapters": "story"}
        single, routed = (post(node, path, adapted) for node in (cluster.single, cluster.router))
        assert single.status_code == routed.status_code == 200, (single.text, routed.text)
        assert without_ids(routed.json()) == without_ids(single.json())
        assert without_ids(post(cluster.single, path, body).json()) != without_ids(single.json())
    refused = post(cluster.router, "/v1/completions", {"prompt": STORY, "adapters": "poem"})
    assert refused.status_code == 400 and "'story'" in refused.json()["error"]["message"], refused.text


def test_stop_string_ends_the_text_through_the_cluster(cluster: Cluster) -> None:
    base = {"prompt": STORY, "max_tokens": 24, "temperature": 0}
    full = _text(post(cluster.single, "/v1/completions", base))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop and stop in full
    body = {**base, "stop": [stop]}
    single = post(cluster.single, "/v1/completions", body).json()
    routed = post(cluster.router, "/v1/completions", body).json()
    assert without_ids(single) == without_ids(routed)
    assert routed["choices"][0]["finish_reason"] == "stop"
    assert routed["choices"][0]["text"] == full[: full.index(stop)]
    streamed = {**body, "stream": True}
    routed_events = stream_events(cluster.router, "/v1/completions", streamed)[:-1]
    single_events = stream_events(cluster.single, "/v1/completions", streamed)[:-1]
    assert [without_ids(json.loads(e)) for e in routed_events] == [
        without_ids(json.loads(e)) for e in single_events
    ]
    assert_no_leaks(cluster.nodes)


def test_messages_and_responses_answer_byte_identically_through_the_cluster(cluster: Cluster) -> None:
    """Anthropic's /v1/messages and OpenAI's /v1/responses (also with logprobs: the first token's
    from the prefill node, the rest from the decode node), greedy, whole and streamed, with the
    same request id: the router's bytes are the single node's (a response's `created_at` aside)."""
    model = httpx.get(f"{cluster.single.url}/v1/models", timeout=30).json()["data"][0]["id"]
    calls: list[tuple[str, dict[str, Any]]] = [
        ("/v1/messages", {"model": model, "max_tokens": 12, "temperature": 0, "system": "Be brief.",
                          "messages": [{"role": "user", "content": STORY}]}),
        ("/v1/responses", {"model": model, "max_output_tokens": 12, "temperature": 0,
                           "instructions": "Be brief.", "input": STORY}),
        ("/v1/responses", {"model": model, "max_output_tokens": 12, "temperature": 0, "input": STORY,
                           "include": ["message.output_text.logprobs"], "top_logprobs": 3}),
    ]
    for number, (path, body) in enumerate(calls):
        for stream in (False, True):
            answers = []
            request_id = f"same{path.replace('/', '-')}-{number}-{stream}"
            for node in (cluster.router, cluster.single):
                response = httpx.post(f"{node.url}{path}", json={**body, "stream": stream},
                                      headers={"X-Request-Id": request_id}, timeout=120)
                assert response.status_code == 200, (node.role, response.text)
                answers.append(re.sub(rb'"created_at":\d+', b'"created_at":0', response.content))
            assert answers[0] == answers[1], (path, stream)
            if not stream:
                doc = json.loads(answers[0])
                content = doc["content"] if path == "/v1/messages" else doc["output"][0]["content"]
                assert content[0]["text"], doc  # something was generated to compare
                if "include" in body:
                    assert content[0]["logprobs"], doc
    assert_no_leaks(cluster.nodes)


BAD_BODIES: list[tuple[str, Any, int]] = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", [1, 2, 3], 400),
    ("/v1/completions", {"prompt": 42, "max_tokens": 5}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10_000_000}, 400),
    ("/v1/completions", {"prompt": "", "max_tokens": 5}, 400),
    ("/v1/completions", {"prompt": "word " * 5000, "max_tokens": 5}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 422),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": "hello"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400),
]


@pytest.mark.parametrize(("path", "body", "status"), BAD_BODIES)
def test_bad_input_gets_a_4xx_and_the_next_request_succeeds(
    cluster: Cluster, path: str, body: Any, status: int
) -> None:
    for node in (cluster.router, cluster.single):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = httpx.post(f"{node.url}{path}", content=raw,
                              headers={"content-type": "application/json"}, timeout=30)
        assert response.status_code == status, (node.role, response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"] and error["code"]
        good = post(node, "/v1/completions", {"prompt": "hello", "max_tokens": 3})
        assert good.status_code == 200


def test_local_prefill_path_is_identical_too(cluster: Cluster, tmp_path: Path) -> None:
    """A router that prefills short prompts on the decode node gives the same bytes."""
    local = router(Path(cluster.single.args[1]), tmp_path / "router-local.log", cluster.prefill,
                   cluster.decode)
    start_nodes([local])
    try:
        for body in ({"prompt": STORY, "max_tokens": 10, "temperature": 0},
                     {"prompt": STORY, "max_tokens": 10, "temperature": 1.0, "seed": 3}):
            assert without_ids(post(local, "/v1/completions", body).json()) == without_ids(
                post(cluster.single, "/v1/completions", body).json())
    finally:
        assert local.stop() == 0
    assert_no_leaks(cluster.nodes)


def test_byte_fallback_non_ascii_usage_is_exact(tmp_path: Path) -> None:
    built = start_cluster(cached_checkpoint("llama", tokenizer="byte_fallback"), tmp_path / "logs")
    try:
        body = {"prompt": "Café au lait, s'il vous plaît: naïve façade", "max_tokens": 40,
                "temperature": 1.0, "seed": 1}
        single = post(built.single, "/v1/completions", body).json()
        routed = post(built.router, "/v1/completions", body).json()
        text = single["choices"][0]["text"]
        assert any(ord(c) > 127 for c in text), f"premise: output must be non-ASCII: {text!r}"
        assert without_ids(single) == without_ids(routed)
        assert routed["usage"]["completion_tokens"] == 40
        assert routed["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]
        assert_no_leaks(built.nodes)
    finally:
        built.stop()


def test_a_cache_that_cannot_travel_is_refused_422_and_the_router_serves_on_locally(tmp_path: Path) -> None:
    """A model whose cache class cannot travel: every prompt that needs a handoff is refused at
    the router's intake with 422 unsupported_cache naming the class (the same answer each time,
    each refusal counted once), and a short prompt through the same router, prefilled on the
    decode node itself, still answers 200, as a single node does."""
    model = build_custom_cache_checkpoint(tmp_path / "opaque")
    local_below = 64  # tokens: the short prompts below prefill locally, the long ones hand off
    built = start_cluster(model, tmp_path / "logs", node_args=("--trust-remote-code",),
                          router_args=("--local-prefill-below", str(local_below)))
    try:
        story = "Once upon a time, in a small village at the edge of a great forest, there lived " * 6
        handed_off = [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": story}], "max_tokens": 5}),
            ("/v1/completions", {"prompt": story, "max_tokens": 5}),
        ]
        local = [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                                      "temperature": 0}),
            ("/v1/completions", {"prompt": "hello there", "max_tokens": 5, "temperature": 0}),
        ]
        before = outcomes(built.router.url)
        refused = 0
        for (path, long_body), (short_path, short_body) in zip(handed_off, local, strict=True):
            for _ in range(2):  # the same answer again: the loop keeps serving, nothing is held
                r = post(built.router, path, long_body)
                assert r.status_code == 422, r.text
                assert r.json()["error"]["code"] == "unsupported_cache"
                assert "OpaqueCache" in r.json()["error"]["message"]
                refused += 1
            served = post(built.router, short_path, short_body)
            assert served.status_code == 200, served.text
            single = post(built.single, short_path, short_body)
            assert without_ids(served.json()) == without_ids(single.json())
            assert single.json()["usage"]["prompt_tokens"] < local_below
            assert post(built.single, path, long_body).json()["usage"]["prompt_tokens"] >= local_below
        after = outcomes(built.router.url)
        key = ("rejected", "unsupported_cache")
        assert after.get(key, 0) - before.get(key, 0) == refused
        assert after.get(("done", "stop"), 0) + after.get(("done", "length"), 0) - (
            before.get(("done", "stop"), 0) + before.get(("done", "length"), 0)) == len(local)
        assert built.prefill[0].stats()["outcomes"] == {}  # no prefill node ever saw a request
        assert_no_leaks(built.nodes)
    finally:
        built.stop()


def test_untrusted_custom_code_is_refused_at_start(tmp_path: Path) -> None:
    model = build_custom_cache_checkpoint(tmp_path / "opaque")
    node = Node("single", ["--model", str(model)], tmp_path / "refused.log")
    node.start()
    assert node.process is not None
    assert node.process.wait(timeout=60) != 0
    assert "trust-remote-code" in node.log.read_text() or "trust_remote_code" in node.log.read_text()


@pytest.mark.parametrize("role", ["single", "router", "cluster"])
def test_a_port_in_use_is_one_clear_line_before_anything_loads(tmp_path: Path, role: str) -> None:
    taken = open_listener("127.0.0.1", 0)
    port = taken.getsockname()[1]
    flags = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"] if role == "router" else []
    with taken:
        done = subprocess.run(
            [sys.executable, "-m", "adapters.cli", "run", "--role", role, "--port", str(port), *flags],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )
    assert done.returncode == 1, done.stderr
    words = {"single": "single node", "router": "router", "cluster": "local cluster"}[role]
    assert done.stderr.strip().splitlines() == [  # the role, what happened, what to do: one line
        f"statecore: {words}: cannot listen on 127.0.0.1:{port}: Address already in use (another process "
        "holds it: stop that one, or choose another port with --port)"], done.stderr
    assert "Traceback" not in done.stderr and "loading" not in done.stderr, done.stderr


def test_the_router_warns_at_start_when_its_nodes_serve_different_builds(tmp_path: Path) -> None:
    """A prefill chunk size that differs changes the fingerprint: handoffs between the two nodes
    will be refused, and the router says so once at start, naming every node's build."""
    model = cached_checkpoint("llama")
    prefill = Node("prefill", ["--model", str(model), "--prefill-chunk-size", "1024"], tmp_path / "p.log")
    decode = Node("decode", ["--model", str(model)], tmp_path / "d.log")
    start_nodes([prefill, decode])
    front = router(model, tmp_path / "router.log", [prefill], [decode])
    try:
        start_nodes([front])
        warning = next(line for line in front.log.read_text().splitlines() if "nodes differ" in line)
        fingerprints = {node.url: httpx.get(f"{node.url}/internal/info", timeout=5).json()["fingerprint"]
                        for node in (prefill, decode)}
        assert len(set(fingerprints.values())) == 2
        for url, fingerprint in fingerprints.items():
            assert f"'{url}': 'fingerprint {fingerprint}, BLAS " in warning, warning
        assert "no answer" not in warning
    finally:
        for node in (front, prefill, decode):
            node.stop()
