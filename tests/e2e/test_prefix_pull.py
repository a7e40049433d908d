"""A prefill node pulls a decode node's cached prefix, on real processes (1 prefill + 1 decode node,
`--prefix-pull always`): a conversation's first turn is short and prefills on the decode node,
which keeps its blocks; the next turn's new part is long, so the router sends it to the prefill
node and tells it where the start is (route prefill_node_prefix); the prefill node pulls those
blocks, prefills only the rest, hands off to that decode node, and the client sees the pulled
tokens as cached; the output is a single node's, greedy and seeded. A pull that finds nothing
(the holder no longer holds the blocks) costs only the pull: the same output still."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from effects.faults import ENABLE_ENV
from statecore.routing import prompt_summary_keys
from support.tiny_models import cached_checkpoint
from tests.e2e.harness import Cluster, Node, assert_no_leaks, metric, outcomes, post, start_cluster

pytestmark = pytest.mark.e2e

CHUNK = 16
LOCAL_BELOW = 64


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with pytest.MonkeyPatch.context() as env:  # the nodes' fault flag arms only with it
        env.setenv(ENABLE_ENV, "1")
        built = start_cluster(cached_checkpoint("llama"), tmp_path_factory.mktemp("logs-prefix-pull"),
                              prefills=1, decodes=1,
                              node_args=("--prefill-chunk-size", str(CHUNK), "--prefix-pull", "always",
                                         "--inject-fault", "prefill"),
                              router_args=("--local-prefill-below", str(LOCAL_BELOW),
                                           "--enable-prompt-tokens-details"))
    try:
        yield built
    finally:
        built.stop()


def _tokens(n: int, salt: int) -> list[int]:
    return [(7 * i + 3 + 11 * salt) % 400 + 5 for i in range(n)]


def _wait_until_router_sees(router: Node, node: Node, prompt: list[int], blocks: int) -> None:
    """Until `node` keeps the first `blocks` blocks of `prompt` and the router's pulled summary
    of it is at least that recent (a count of blocks could grow with an earlier request's blocks
    summarized late, and the route then not see this prompt's)."""
    deadline = time.monotonic() + 20
    while True:
        summary = httpx.get(f"{node.url}/internal/prefix", timeout=5).json()
        keys = prompt_summary_keys(prompt, summary["block_tokens"], summary["block_ends"])[:blocks]
        if len(keys) == blocks and {key.hex() for key in keys} <= set(summary["keys"]):
            break
        assert time.monotonic() < deadline, f"{node.url} does not keep the prompt's {blocks} blocks"
        time.sleep(0.05)
    while router.stats()["prefix_versions"].get(node.url, -1) < summary["version"]:
        assert time.monotonic() < deadline, router.stats()["prefix_versions"]
        time.sleep(0.05)


def _held_start(built: Cluster, salt: int, sampling: dict[str, Any]) -> list[int]:
    """A short first turn, prefilled on the decode node, which keeps 3 blocks of 16: its prompt,
    once the router's summary of the decode node lists them."""
    (decode,), router = built.decode, built.router
    opening = _tokens(60, salt)
    first = post(router, "/v1/completions", {"prompt": opening, "max_tokens": 8, **sampling})
    assert first.status_code == 200, first.text
    _wait_until_router_sees(router, decode, opening, 3)
    return opening


def _two_turns(built: Cluster, salt: int, sampling: dict[str, Any]) -> None:
    (prefill,), router = built.prefill, built.router
    opening = _held_start(built, salt, sampling)
    body = {"prompt": [*opening, *_tokens(120, salt + 50)], "max_tokens": 16, **sampling}
    routed = metric(router.url, "statecore:router_routes_total", route="prefill_node_prefix")
    pulled = metric(prefill.url, "statecore:prefix_pulls_total", outcome="pulled")
    tokens = metric(prefill.url, "statecore:prefix_pull_tokens_total")
    second = post(router, "/v1/completions", body)
    assert second.status_code == 200, second.text
    assert metric(router.url, "statecore:router_routes_total", route="prefill_node_prefix") == routed + 1
    assert metric(prefill.url, "statecore:prefix_pulls_total", outcome="pulled") == pulled + 1
    assert metric(prefill.url, "statecore:prefix_pull_tokens_total") == tokens + 48
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    alone = post(built.single, "/v1/completions", body)
    assert alone.status_code == 200, alone.text
    assert second.json()["choices"] == alone.json()["choices"]
    records = httpx.get(f"{prefill.url}/internal/handoffs", timeout=5).json()["records"]
    assert records[-1]["prefix_pull_tokens"] == 48 and records[-1]["prefix_pull_bytes"] > 0


def test_a_long_next_turn_pulls_its_start_from_the_decode_node_and_matches_a_single_node(
    cluster: Cluster
) -> None:
    _two_turns(cluster, 1, {"temperature": 0})
    assert "route prefill_node_prefix" in cluster.router.log.read_text()
    assert "pulled 48 prompt tokens" in cluster.prefill[0].log.read_text()
    assert_no_leaks(cluster.nodes)


def test_a_seeded_turn_from_pulled_blocks_matches_a_single_node(cluster: Cluster) -> None:
    _two_turns(cluster, 2, {"temperature": 1.0, "top_k": 40, "seed": 17})
    assert_no_leaks(cluster.nodes)


def _decoded(node: Node, body: dict[str, Any]) -> list[int]:
    """Every token of a decode node's stream (the first from its prefill, or the one given): a
    line holds one token, or a step's several when the reader fell behind (a loaded box)."""
    tokens = [] if body.get("first_token") is None else [body["first_token"]]
    with httpx.stream("POST", f"{node.url}/internal/decode", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            doc = json.loads(line) if line else {}
            if "first_token" in doc and not tokens:
                tokens.append(doc["first_token"])
            elif "token" in doc:
                tokens.append(doc["token"])
            elif "tokens" in doc:
                tokens.extend(doc["tokens"])
    return tokens


def test_a_pull_that_finds_nothing_costs_only_the_pull(cluster: Cluster) -> None:
    """The router's hint names blocks the decode node does not hold (forgotten since its summary):
    the prefill node's pull gets a 404, is counted as failed, and the prefill computes everything;
    the tokens handed off and decoded are the single node's."""
    (decode,), (prefill,) = cluster.decode, cluster.prefill
    prompt = _tokens(100, 90)
    sampling = {"max_tokens": 10}
    asked = httpx.post(f"{decode.url}/internal/prefix_kv", json={"tokens": prompt[:64]}, timeout=10)
    assert asked.status_code == 404 and asked.json()["error"]["code"] == "prefix_not_cached"
    failed = metric(prefill.url, "statecore:prefix_pulls_total", outcome="failed")
    reply = httpx.post(f"{prefill.url}/internal/prefill", timeout=60, json={
        "request_id": "hinted", "prompt": prompt, "sampling": sampling,
        "prefix_from": {"url": decode.url, "tokens": 64}})
    assert reply.status_code == 200, reply.text
    assert metric(prefill.url, "statecore:prefix_pulls_total", outcome="failed") == failed + 1
    handed_off = _decoded(decode, {"request_id": "hinted", "prompt": prompt, "sampling": sampling,
                                   "first_token": reply.json()["first_token"], "prefill_url": prefill.url})
    alone = _decoded(cluster.single, {"request_id": "alone", "prompt": prompt, "sampling": sampling})
    assert handed_off == alone and len(alone) == 10
    assert_no_leaks(cluster.nodes)


def test_a_fault_in_a_prefix_pulling_prefill_fails_on_the_prefill_node(cluster: Cluster) -> None:
    """A next turn routed to the prefill node with the decode node's start to pull, marked to
    fail at prefill: it fails there, the client is told where, and the prefill node counts it."""
    opening = _held_start(cluster, 40, {"temperature": 0})
    router, (prefill,) = cluster.router, cluster.prefill
    failed = [outcomes(node.url).get(("failed", "injected_fault"), 0) for node in (router, prefill)]
    routed = metric(router.url, "statecore:router_routes_total", route="prefill_node_prefix")
    body = {"prompt": [*opening, *_tokens(120, 90)], "max_tokens": 4}
    response = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120,
                          headers={"x-request-id": "route-pull-inject-fault-prefill"})
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["code"] == "injected_fault" and "at prefill on the prefill node" in error["message"], error
    assert metric(router.url, "statecore:router_routes_total", route="prefill_node_prefix") == routed + 1
    assert_no_leaks(cluster.nodes)
    now = [outcomes(node.url).get(("failed", "injected_fault"), 0) for node in (router, prefill)]
    assert [b - a for a, b in zip(failed, now, strict=True)] == [1, 1]
