"""Operability on real processes, through the official `openai` client: `/metrics` on every
node agrees with what the client saw (usage, tokens, the KV that moved), a request id sent by
the client is echoed back and appears in the logs of the router, the prefill and the decode
node, and a KV cache nobody takes shows up as held, then as a lease expiry."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from adapters.blas import child_pids, process_role
from adapters.serve.cluster import HANDOFF_PROMPT
from support.tiny_models import cached_checkpoint
from tests.e2e.harness import Cluster, Node, assert_no_leaks, openai_client, start_cluster

pytestmark = pytest.mark.e2e

STORY = "A small boat drifted past the harbour wall while the gulls argued over bread."
LEASE_S = 8.0

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    built = start_cluster(cached_checkpoint("llama"), tmp_path_factory.mktemp("logs-ops"),
                          router_args=("--force-disaggregation", "--log-json"),
                          node_args=("--kv-lease", str(LEASE_S)))
    try:
        yield built
    finally:
        built.stop()


def scrape(node: Node) -> Samples:
    response = httpx.get(f"{node.url}/metrics", timeout=5.0)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of every sample called `name` whose labels include `labels`."""
    return sum(v for (n, have), v in samples.items()
               if n == name and set(labels.items()) <= set(have))


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def eventually(check: Callable[[], None], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _four_requests(client: OpenAI, model: str) -> list[tuple[int, int]]:
    """Chat and completions, streaming (with usage) and not: (prompt, completion) tokens each."""
    messages: Any = [{"role": "user", "content": STORY}]
    usages: list[tuple[int, int]] = []
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert chat.usage is not None and chat.choices[0].message.content
    usages.append((chat.usage.prompt_tokens, chat.usage.completion_tokens))
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usages.append((usage.prompt_tokens, usage.completion_tokens))
    completion = client.completions.create(model=model, prompt=STORY, max_tokens=10, temperature=0)
    assert completion.usage is not None and completion.choices[0].text
    usages.append((completion.usage.prompt_tokens, completion.usage.completion_tokens))
    parts = list(client.completions.create(model=model, prompt=STORY, max_tokens=5, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
    usage = parts[-1].usage
    assert usage is not None
    usages.append((usage.prompt_tokens, usage.completion_tokens))
    assert all(completion_tokens > 0 for _, completion_tokens in usages), usages
    return usages


def test_metrics_on_every_node_agree_with_the_openai_client(cluster: Cluster) -> None:
    router, prefill, decode = cluster.router, cluster.prefill[0], cluster.decode[0]
    client = openai_client(router)
    model = client.models.list().data[0].id
    before = {node.role: scrape(node) for node in (router, prefill, decode)}
    usages = _four_requests(client, model)
    n = len(usages)
    prompt_tokens = sum(p for p, _ in usages)
    generated = sum(c for _, c in usages)

    def agrees() -> None:
        after = {node.role: scrape(node) for node in (router, prefill, decode)}

        def d(role: str, name: str, **labels: str) -> float:
            return delta(before[role], after[role], name, **labels)

        # the router: what the client saw
        assert d("router", "statecore:generation_tokens_total") == generated
        assert d("router", "statecore:prompt_tokens_total") == prompt_tokens
        assert d("router", "statecore:time_to_first_token_seconds_count") == n
        assert d("router", "statecore:time_to_first_token_seconds_sum") > 0
        assert d("router", "statecore:inter_token_latency_seconds_count") == generated - n
        assert d("router", "statecore:e2e_request_latency_seconds_count") == n
        assert d("router", "statecore:requests_total", state="done") == n
        assert value(after["router"], "statecore:peer_up", node=prefill.url, node_role="prefill") == 1
        assert value(after["router"], "statecore:peer_up", node=decode.url, node_role="decode") == 1
        # the prefill node computed every prompt and the first tokens; the decode node the rest
        assert d("prefill", "statecore:prompt_tokens_by_source_total", source="computed_locally") \
            == prompt_tokens
        assert d("prefill", "statecore:time_to_first_token_seconds_count") == n
        assert d("prefill", "statecore:generation_tokens_total") \
            + d("decode", "statecore:generation_tokens_total") == generated
        assert d("prefill", "statecore:requests_total", state="done") == n
        # the KV moved once per request, and both ends count the same bytes
        served = d("prefill", "statecore:kv_transfer_bytes_total", direction="served")
        assert served > 0
        assert d("decode", "statecore:kv_transfer_bytes_total", direction="received") == served
        assert d("decode", "statecore:kv_transfer_seconds_count") == n
        assert d("decode", "statecore:kv_transfer_failures_total") == 0
        assert d("decode", "statecore:prompt_tokens_by_source_total", source="transferred") == prompt_tokens
        assert d("decode", "statecore:prompt_tokens_by_source_total", source="computed_locally") == 0
        assert d("decode", "statecore:requests_total", state="done") == n
        for role in ("router", "prefill", "decode"):
            assert value(after[role], "statecore:num_requests_running") == 0
            assert value(after[role], "statecore:loop_ready") == 1
        assert value(after["prefill"], "statecore:kv_held_bytes") == 0

    eventually(agrees)
    assert_no_leaks(cluster.nodes)


def test_single_node_metrics_agree_with_usage(cluster: Cluster) -> None:
    client = openai_client(cluster.single)
    model = client.models.list().data[0].id
    before = scrape(cluster.single)
    usages = _four_requests(client, model)
    after = scrape(cluster.single)
    assert delta(before, after, "statecore:generation_tokens_total") == sum(c for _, c in usages)
    assert delta(before, after, "statecore:prompt_tokens_total") == sum(p for p, _ in usages)
    assert delta(before, after, "statecore:prompt_tokens_by_source_total", source="computed_locally") \
        == sum(p for p, _ in usages)
    assert delta(before, after, "statecore:time_to_first_token_seconds_count") == len(usages)
    assert delta(before, after, "statecore:kv_transfer_bytes_total") == 0


def test_a_request_id_is_echoed_and_logged_by_every_node(cluster: Cluster) -> None:
    rid = f"ops-{uuid.uuid4().hex[:12]}"
    client = openai_client(cluster.router)
    model = client.models.list().data[0].id
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": STORY}], max_tokens=6, temperature=0,
        stream=True, extra_headers={"X-Request-Id": rid})
    assert raw.headers["x-request-id"] == rid
    chunks = list(raw.parse())
    assert chunks[0].id == f"chatcmpl-{rid}"
    done = re.compile(rf"(prefill|decode)\s+INFO request {re.escape(rid)} \w+ -> done on \w+")

    def logged() -> None:
        for node in (cluster.prefill[0], cluster.decode[0]):
            lines = [line for line in node.log.read_text().splitlines() if rid in line]
            assert any(done.search(line) for line in lines), (node.role, lines)
        # the router logs JSON (--log-json): one object per transition, with its fields
        docs = [json.loads(line) for line in cluster.router.log.read_text().splitlines()
                if line.startswith("{") and rid in line]
        moves = [(d["from"], d["to"], d["event"]) for d in docs if d.get("request_id") == rid and "from" in d]
        assert all(d["role"] == "router" for d in docs if "role" in d)
        assert moves and moves[-1][1] == "done", moves

    eventually(logged)


def test_a_kv_cache_nobody_takes_is_held_then_expires(cluster: Cluster) -> None:
    prefill = cluster.prefill[0]
    before = scrape(prefill)
    rid = f"ops-lease-{uuid.uuid4().hex[:8]}"
    body = {"request_id": rid, "prompt": [1, 2, 3, 4, 5, 6], "sampling": {"max_tokens": 4}}
    response = httpx.post(f"{prefill.url}/internal/prefill", json=body, timeout=30.0)
    assert response.status_code == 200, response.text
    held = scrape(prefill)
    assert value(held, "statecore:kv_held_caches") == 1
    assert value(held, "statecore:kv_held_bytes") > 0

    def expired() -> None:
        after = scrape(prefill)
        assert delta(before, after, "statecore:kv_lease_expired_total") == 1
        assert delta(before, after, "statecore:requests_total", state="failed",
                     reason="kv_lease_expired") == 1
        assert value(after, "statecore:kv_held_bytes") == 0

    eventually(expired, timeout_s=LEASE_S + 10)
    line = f"request {rid} handoff -> failed on timer_fired reason=kv_lease_expired"
    assert line in prefill.log.read_text()


def test_a_local_cluster_hands_its_flags_to_every_node(tmp_path: Path) -> None:
    """`statecore run --log-json --internal-token T --max-in-flight 7 --api-key K`: every child
    logs JSON, the router and the engine nodes all want the token, the router's public API wants
    the key (and still reaches its peers, which never see it), and neither secret is on a child's
    command line."""
    cluster = Node("cluster", ["--log-json", "--internal-token", "s3cret", "--max-in-flight", "7",
                               "--api-key", "publ1c-key"], tmp_path / "cluster.log")
    cluster.start()
    try:
        cluster.wait_healthy()
        assert cluster.process is not None
        children = {process_role(pid): pid for pid in child_pids(cluster.process.pid)}
        assert set(children) == {"router", "prefill", "decode"}, children
        for pid in children.values():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert b"s3cret" not in argv and b"publ1c-key" not in argv and b"--log-json" in argv
            assert argv[argv.index(b"--max-in-flight") + 1] == b"7"
        stats = httpx.get(f"{cluster.url}/internal/stats", timeout=5)
        assert stats.status_code == 401
        assert httpx.get(f"{cluster.url}/internal/stats", timeout=5,
                         headers={"x-statecore-token": "s3cret"}).status_code == 200
        refused = httpx.get(f"{cluster.url}/v1/models", timeout=5)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{cluster.url}/health", timeout=5).status_code == 200
        client = OpenAI(base_url=f"{cluster.url}/v1", api_key="publ1c-key", max_retries=0, timeout=60.0)
        reply = client.chat.completions.create(model="demo_model", max_tokens=8,  # through prefill
                                               messages=[{"role": "user", "content": HANDOFF_PROMPT}])
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        urls: list[str] = []

        def banner_printed() -> None:  # it names the nodes
            found = re.search(r"cluster ready: router \S+ +\(prefill (\S+), decode", cluster.log.read_text())
            assert found, cluster.tail()
            urls.append(found[1])

        eventually(banner_printed)
        prefill = httpx.get(f"{urls[0]}/internal/stats", timeout=5, headers={"x-statecore-token": "s3cret"})
        assert prefill.json()["outcomes"].get("done", 0) == 1, prefill.json()  # the KV was handed off
        lines = [line for line in cluster.log.read_text().splitlines() if line.startswith("{")]
        roles = {json.loads(line).get("role") for line in lines}
        assert {"prefill", "decode", "router"} <= roles, cluster.tail()
    finally:
        assert cluster.stop() == 0, cluster.tail()



def test_token_times_name_a_streams_tokens_where_they_passed(cluster: Cluster) -> None:
    """`GET /internal/token_times` on the decode node and the router: a streamed request's decoded
    tokens, applied then read on each, in the order they travelled (the decode node's line before
    the router read it)."""
    rid = f"times-{uuid.uuid4().hex[:12]}"
    since = time.time()
    with httpx.stream("POST", f"{cluster.router.url}/v1/completions", timeout=60,
                      headers={"X-Request-Id": rid},
                      json={"prompt": STORY, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as response:
        assert response.status_code == 200
        chunks = [line for line in response.iter_lines() if line.startswith("data:") and '"text"' in line]
    assert chunks
    decode, router = ({k: v.get(rid, []) for k, v in httpx.get(
        f"{node.url}/internal/token_times", params={"since": since}, timeout=5.0).json().items()
        if isinstance(v, dict)} for node in (cluster.decode[0], cluster.router))
    # the first token is the prefill's: no decode step applies it; the router writes it, and the
    # decode node too where it took a streamed handoff (a pulled one's reached the router directly)
    assert len(decode["applied"]) == len(router["applied"]) == 7
    assert len(router["read"]) == 8
    first = len(decode["read"]) - 7
    assert first in (0, 1), decode
    for i, applied in enumerate(decode["applied"]):
        assert applied <= decode["read"][i + first] <= router["applied"][i] <= router["read"][i + 1]
