"""Prefix-aware routing on real processes: a follow-up prompt goes to the prefill node whose prefix
cache holds its start (not the least-loaded one), reuses the blocks there, and its output is the
single node's. A router with --enable-prompt-tokens-details tells the client how many prompt
tokens came from that cache."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from support.tiny_models import cached_checkpoint
from tests.e2e.harness import (
    Cluster,
    Node,
    assert_no_leaks,
    metric,
    post,
    router,
    start_cluster,
    start_nodes,
    stream_events,
    without_ids,
)

pytestmark = pytest.mark.e2e

# A prompt of ~90 tokens: five whole blocks of 16 before its last token.
OPENING = " ".join(f"The lighthouse keeper counted ship number {i} at dawn." for i in range(9))
FOLLOW_UP = OPENING + " Then the fog rolled in and every bell in the harbour rang."


Routers = tuple[Cluster, Node, Node, Node]  # the cluster; the primer, plain and detailed routers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routers]:
    logs = tmp_path_factory.mktemp("logs-prefix")
    model = cached_checkpoint("llama")
    built = start_cluster(model, logs, prefills=2, decodes=1, node_args=("--prefill-chunk-size", "16"),
                          router_args=("--force-disaggregation", "--log-level", "DEBUG"))  # its route lines
    # A second router that knows only the second prefill node: it puts the opening's blocks there,
    # where least-loaded routing (which prefers the first node on a tie) would never send it.
    primer = router(model, logs / "primer.log", built.prefill[1:], built.decode, "--force-disaggregation")
    # The routers of the last two tests, each used by its test alone: started beside the primer.
    plain = router(model, logs / "plain.log", built.prefill, built.decode, "--force-disaggregation",
                   "--prefix-routing", "off")
    detailed = router(model, logs / "details.log", built.prefill, built.decode, "--force-disaggregation",
                      "--enable-prompt-tokens-details")
    try:
        start_nodes([primer, plain, detailed])
        yield built, primer, plain, detailed
    finally:
        for node in (primer, plain, detailed):
            node.stop()
        built.stop()


def test_a_follow_up_goes_where_its_prefix_is_cached_and_matches_a_single_node(cluster: Routers) -> None:
    built, primer, _, _ = cluster
    first, second = built.prefill
    body = {"prompt": OPENING, "max_tokens": 8, "temperature": 0}
    assert post(primer, "/v1/completions", body).status_code == 200
    assert second.stats()["prefix_cache_bytes"] > 0 and first.stats()["prefix_cache_bytes"] == 0
    deadline = time.monotonic() + 20
    while built.router.stats()["prefix_blocks"].get(second.url, 0) == 0:  # its next pull of summaries
        assert time.monotonic() < deadline, built.router.stats()
        time.sleep(0.1)
    held_version = httpx.get(f"{second.url}/internal/prefix", timeout=10).json()["version"]
    assert 0 < built.router.stats()["prefix_versions"][second.url] <= held_version
    hits, queries = second.stats()["prefix_cache_hits"], second.stats()["prefix_cache_queries"]
    follow = {"prompt": FOLLOW_UP, "max_tokens": 12, "temperature": 0}
    routed = post(built.router, "/v1/completions", follow)
    assert routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["text"] == post(built.single, "/v1/completions", follow).json()[
        "choices"][0]["text"]
    assert second.stats()["prefix_cache_hits"] == hits + 1 and first.stats()["prefix_cache_hits"] == 0
    assert second.stats()["prefix_cache_queries"] == queries + 1
    assert metric(second.url, "statecore:prefix_cache_queries_total") == queries + 1
    assert metric(built.router.url, "statecore:router_routed_total", node=second.url, basis="prefix",
                   node_role="prefill") == 1
    assert metric(built.router.url, "statecore:router_expected_cached_tokens_total", node=second.url) >= 16
    assert "by prefix" in built.router.log.read_text()
    assert_no_leaks([*built.nodes, primer])


def test_with_prefix_routing_off_the_same_follow_up_goes_to_the_least_loaded_node(cluster: Routers) -> None:
    built, _, plain, _ = cluster
    try:
        assert plain.stats()["prefix_blocks"] == {} and plain.stats()["prefix_versions"] == {}
        reference = [n.stats()["prefix_cache_hits"] for n in built.prefill]
        follow = {"prompt": FOLLOW_UP + " Once more.", "max_tokens": 4, "temperature": 0}
        assert post(plain, "/v1/completions", follow).status_code == 200
        # the first node, least loaded on a tie, though only the second holds the opening
        assert [n.stats()["prefix_cache_hits"] for n in built.prefill] == reference
        assert metric(plain.url, "statecore:router_routed_total", node=built.prefill[0].url, basis="load",
                       node_role="prefill") == 1
    finally:
        assert plain.stop() == 0


def test_with_prompt_tokens_details_the_client_sees_the_prefill_nodes_cached_tokens(cluster: Routers) -> None:
    """The count travels from the prefill node's engine through its reply to the router's usage
    (whole and streamed); the router without the flag answers today's body, less the details."""
    built, _, _, detailed = cluster
    try:
        prompt = " ".join(f"A gull circled mast {i} of the old schooner." for i in range(8))
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
        first = post(detailed, "/v1/completions", body).json()
        tokens = first["usage"]["prompt_tokens"]
        assert tokens > 32 and first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        hits = sum(node.stats()["prefix_cache_hits"] for node in built.prefill)
        events = stream_events(detailed, "/v1/completions",
                               {**body, "stream": True, "stream_options": {"include_usage": True}})
        usage = json.loads(events[-2])["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": (tokens - 1) // 16 * 16}  # whole blocks
        assert sum(node.stats()["prefix_cache_hits"] for node in built.prefill) == hits + 1
        plain = post(built.router, "/v1/completions", body).json()
        assert "prompt_tokens_details" not in plain["usage"]
        del first["usage"]["prompt_tokens_details"]
        assert without_ids(plain) == without_ids(first)
        assert_no_leaks([*built.nodes, detailed])
    finally:
        assert detailed.stop() == 0
