"""Conversations stay where their KV is, on real processes (1 prefill + 2 decode nodes): a turn's
decode node keeps its prompt and answer's whole chunks, the router sends the next turn to that
node, which prefills only the new message (route prefix_hit_local, in the router's log and
/metrics), the client sees the cached tokens (--enable-prompt-tokens-details), and the output is
the single node's without any hit, and with one, greedy and seeded."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.tiny_models import cached_checkpoint
from tests.e2e.harness import Cluster, Node, assert_no_leaks, post, start_cluster

pytestmark = pytest.mark.e2e

CHUNK = 16
# A first turn (~240 tokens) goes to the prefill node; the next one's tokens past the first prompt's
# blocks are fewer. (Its text is the first prompt's and answer's, encoded again: the answer's tokens
# need not come back the same, so only the first prompt's blocks are sure to match.)
LOCAL_BELOW = 64
OPENING = " ".join(f"The lighthouse keeper counted ship number {i} at dawn." for i in range(9))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    built = start_cluster(cached_checkpoint("llama"), tmp_path_factory.mktemp("logs-conversations"),
                          prefills=1, decodes=2,
                          node_args=("--prefill-chunk-size", str(CHUNK), "--enable-prompt-tokens-details"),
                          router_args=("--local-prefill-below", str(LOCAL_BELOW),
                                       "--enable-prompt-tokens-details"))
    try:
        yield built
    finally:
        built.stop()


def _metric(server: Node, name: str, **labels: str) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}{labels} in /metrics")


def _wait_for_blocks(router: Node, node: Node, blocks: int) -> None:
    """Until the router's pulled summary of `node` lists at least `blocks` blocks."""
    deadline = time.monotonic() + 20
    while router.stats()["prefix_blocks"].get(node.url, 0) < blocks:
        assert time.monotonic() < deadline, router.stats()["prefix_blocks"]
        time.sleep(0.1)


def _two_turns(built: Cluster, opening: str, sampling: dict[str, Any]) -> None:
    first_body = {"prompt": opening, "max_tokens": 24, "ignore_eos": True, **sampling}
    kept_before = [node.stats()["conversations_kept"] for node in built.decode]
    blocks_before = dict(built.router.stats()["prefix_blocks"])  # what earlier tests left there
    first = post(built.router, "/v1/completions", first_body)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["prompt_tokens"] >= LOCAL_BELOW  # so it went through the prefill node
    deadline = time.monotonic() + 20
    while [node.stats()["conversations_kept"] for node in built.decode] == kept_before:
        assert time.monotonic() < deadline, "no decode node kept the first turn"
        time.sleep(0.1)
    (served,) = [node for node, before in zip(built.decode, kept_before, strict=True)
                 if node.stats()["conversations_kept"] > before]
    history = opening + first.json()["choices"][0]["text"]
    usage = first.json()["usage"]
    conversation_blocks = (usage["prompt_tokens"] + usage["completion_tokens"]) // CHUNK
    _wait_for_blocks(built.router, served, blocks_before.get(served.url, 0) + conversation_blocks)
    hits = [node.stats()["prefix_cache_hits"] for node in built.decode]
    second_body = {"prompt": history + " And the fog?", "max_tokens": 12, **sampling}
    routed_locally = _metric(built.router, "statecore:router_routes_total", route="prefix_hit_local")
    second = post(built.router, "/v1/completions", second_body)
    assert second.status_code == 200, second.text
    # on the node that served the first turn (which got its prompt's KV from the prefill node), from its cache
    assert [node.stats()["prefix_cache_hits"] - h for node, h in zip(built.decode, hits, strict=True)] == [
        int(node is served) for node in built.decode]
    first_blocks = (first.json()["usage"]["prompt_tokens"] - 1) // CHUNK * CHUNK
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= first_blocks
    routes = _metric(built.router, "statecore:router_routes_total", route="prefix_hit_local")
    assert routes == routed_locally + 1
    # the single node never saw the first turn: no hit there, the same output
    alone = post(built.single, "/v1/completions", second_body)
    assert alone.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second.json()["choices"] == alone.json()["choices"]
    # and on the single node, the same turn again, now from its own cache: the same output still
    again = post(built.single, "/v1/completions", second_body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first_blocks
    assert again["choices"] == alone.json()["choices"]


def test_a_next_turn_goes_to_the_decode_node_holding_its_conversation_and_matches_a_single_node(
    cluster: Cluster
) -> None:
    _two_turns(cluster, OPENING, {"temperature": 0})
    log = cluster.router.log.read_text()
    assert "route prefill_node" in log and "route prefix_hit_local" in log
    assert _metric(cluster.router, "statecore:router_routes_total", route="prefill_node") >= 1
    assert _metric(cluster.decode[0], "statecore:conversations_kept_total") + _metric(
        cluster.decode[1], "statecore:conversations_kept_total") >= 1
    assert_no_leaks(cluster.nodes)


def test_a_seeded_next_turn_from_the_cache_matches_a_single_node(cluster: Cluster) -> None:
    opening = " ".join(f"A gull circled mast {i} of the old schooner, crying twice." for i in range(8))
    _two_turns(cluster, opening, {"temperature": 1.0, "top_k": 40, "seed": 17})
    assert_no_leaks(cluster.nodes)
