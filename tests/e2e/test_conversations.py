"""Conversations stay where their KV is, on real processes (1 prefill + 2 decode nodes): a turn's
decode node keeps its prompt and answer's whole chunks, the router sends the next turn to that
node, which prefills only the new message (route prefix_hit_local, in the router's log and
/metrics), the client sees the cached tokens (--enable-prompt-tokens-details), and the output is
the single node's without any hit, and with one, greedy and seeded.

The same cluster's nodes are armed with faults (the router is not): a request marked for a
phase fails there on every route the router takes, and exactly the node where it fired counts a
failure: a handoff (the prefill node), a decode node's local prefill, a kept conversation's next
turn (the decode node holding it), a retry on another node (a peer's failure on the first decode
node; the request succeeds on the other, the router counts no failure) and one choice of an
n > 1 request. (A prefix pull's route: tests/e2e/test_prefix_pull.py.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from effects.faults import ENABLE_ENV
from support.tiny_models import cached_checkpoint
from tests.e2e.harness import Cluster, Node, assert_no_leaks, metric, outcomes, post, start_cluster

pytestmark = pytest.mark.e2e

CHUNK = 16
# A first turn (~240 tokens) goes to the prefill node; the next one's tokens past the first prompt's
# blocks are fewer. (Its text is the first prompt's and answer's, encoded again: the answer's tokens
# need not come back the same, so only the first prompt's blocks are sure to match.)
LOCAL_BELOW = 64
OPENING = " ".join(f"The lighthouse keeper counted ship number {i} at dawn." for i in range(9))


FAULTS = ("--inject-fault", "prefill", "--inject-fault", "prefill:peer")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with pytest.MonkeyPatch.context() as env:  # the nodes' fault flags arm only with it
        env.setenv(ENABLE_ENV, "1")
        built = start_cluster(cached_checkpoint("llama"), tmp_path_factory.mktemp("logs-conversations"),
                              prefills=1, decodes=2,
                              node_args=("--prefill-chunk-size", str(CHUNK), "--enable-prompt-tokens-details",
                                         *FAULTS),
                              router_args=("--local-prefill-below", str(LOCAL_BELOW),
                                           "--enable-prompt-tokens-details"))
    try:
        yield built
    finally:
        built.stop()


def _wait_for_blocks(router: Node, node: Node, blocks: int) -> None:
    """Until the router's pulled summary of `node` lists at least `blocks` blocks."""
    deadline = time.monotonic() + 20
    while router.stats()["prefix_blocks"].get(node.url, 0) < blocks:
        assert time.monotonic() < deadline, router.stats()["prefix_blocks"]
        time.sleep(0.1)


def _first_turn(built: Cluster, opening: str, sampling: dict[str, Any]) -> tuple[Node, str, int]:
    """A first turn through the prefill node: the decode node that kept it, once the router's
    summary of that node lists its blocks; the conversation so far; its prompt's tokens."""
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
    usage = first.json()["usage"]
    conversation_blocks = (usage["prompt_tokens"] + usage["completion_tokens"]) // CHUNK
    _wait_for_blocks(built.router, served, blocks_before.get(served.url, 0) + conversation_blocks)
    return served, opening + first.json()["choices"][0]["text"], usage["prompt_tokens"]


def _two_turns(built: Cluster, opening: str, sampling: dict[str, Any]) -> None:
    served, history, first_prompt_tokens = _first_turn(built, opening, sampling)
    hits = [node.stats()["prefix_cache_hits"] for node in built.decode]
    second_body = {"prompt": history + " And the fog?", "max_tokens": 12, **sampling}
    routed_locally = metric(built.router.url, "statecore:router_routes_total", route="prefix_hit_local")
    second = post(built.router, "/v1/completions", second_body)
    assert second.status_code == 200, second.text
    # on the node that served the first turn (which got its prompt's KV from the prefill node), from its cache
    assert [node.stats()["prefix_cache_hits"] - h for node, h in zip(built.decode, hits, strict=True)] == [
        int(node is served) for node in built.decode]
    first_blocks = (first_prompt_tokens - 1) // CHUNK * CHUNK
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= first_blocks
    routes = metric(built.router.url, "statecore:router_routes_total", route="prefix_hit_local")
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
    assert metric(cluster.router.url, "statecore:router_routes_total", route="prefill_node") >= 1
    assert metric(cluster.decode[0].url, "statecore:conversations_kept_total") + metric(
        cluster.decode[1].url, "statecore:conversations_kept_total") >= 1
    assert_no_leaks(cluster.nodes)


def test_a_seeded_next_turn_from_the_cache_matches_a_single_node(cluster: Cluster) -> None:
    opening = " ".join(f"A gull circled mast {i} of the old schooner, crying twice." for i in range(8))
    _two_turns(cluster, opening, {"temperature": 1.0, "top_k": 40, "seed": 17})
    assert_no_leaks(cluster.nodes)


def _chat(system: str, question: str, sampling: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 12, **sampling}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "top_k": 40, "seed": 23}],
                         ids=["greedy", "seeded"])
def test_chats_on_one_system_prompt_reuse_it_to_its_end_and_match_a_single_node(
    cluster: Cluster, sampling: dict[str, Any]
) -> None:
    """A block ends after a message's end-of-turn token too: a second conversation on the same
    system prompt, routed where the first one's KV went, takes the system prompt's blocks to its
    end (not a multiple of the chunk), and its answer is the single node's without any hit, and
    with the same hit there."""
    seed = sampling.get("seed", 0)
    system = " ".join(f"{seed} is rule {i}: answer the harbour master plainly." for i in range(10))
    first = _chat(system, "Which ship came in first?", sampling)
    second = _chat(system, "And the last?", sampling)
    alone = post(cluster.single, "/v1/chat/completions", second)  # the cache-less run
    assert alone.status_code == 200, alone.text
    assert alone.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert post(cluster.router, "/v1/chat/completions", first).status_code == 200
    routed = post(cluster.router, "/v1/chat/completions", second).json()
    cached = routed["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > CHUNK and cached % CHUNK, routed["usage"]  # the system message's end
    assert routed["choices"] == alone.json()["choices"]
    # the single node, having served it once, now from its own cache (every block of its prompt:
    # the system message's, and any whole chunk after it; the user message's end is the prompt's
    # last, no block's end): the same answer
    again = post(cluster.single, "/v1/chat/completions", second).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= cached
    assert again["choices"] == alone.json()["choices"]
    assert_no_leaks(cluster.nodes)


# -- a fault on every route: exactly the node where it fired counts a failure ---------------------


def _counted(nodes: list[Node], phase: str) -> list[int]:
    return [node.stats()["outcomes"].get(phase, 0) for node in nodes]


def _failed(built: Cluster) -> list[int]:
    """Each node's requests failed by an injected fault (requests_total, state failed, reason
    injected_fault): router, prefill, decode 0, decode 1."""
    nodes = [built.router, *built.prefill, *built.decode]
    return [int(outcomes(node.url).get(("failed", "injected_fault"), 0)) for node in nodes]


def _marked(built: Cluster, body: dict[str, Any], request_id: str) -> httpx.Response:
    return httpx.post(f"{built.router.url}/v1/completions", json=body, timeout=120,
                      headers={"x-request-id": request_id})


def _moved(built: Cluster, before: list[int]) -> list[int]:
    assert_no_leaks(built.nodes)  # every node has settled what it was part of
    return [after - was for after, was in zip(_failed(built), before, strict=True)]


def _assert_fired(response: httpx.Response, where: str) -> None:
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["code"] == "injected_fault" and f"at prefill on the {where} node" in error["message"], error


LONG = " ".join(f"Buoy {i} rang as the tide turned over the sandbar." for i in range(8))  # handed off
SHORT = "Fog at noon."  # prefilled on a decode node


@pytest.mark.parametrize(("route", "prompt", "where", "router_and_prefill", "decode_nodes"),
                         ids=["handoff", "local"], argvalues=[
    # the router started the handoff's prefill and hears why from the prefill node; the decode node
    # it paired it with fails its part with the same error where its stream read it first, else the
    # router's cancel ends it: at most one decode node counts it
    ("handoff", LONG, "prefill", [1, 1], ([0, 0], [0, 1])),
    ("local", SHORT, "decode", [1, 0], ([0, 1],)),
])
def test_a_fault_in_a_prefill_fails_where_it_fired(cluster: Cluster, route: str, prompt: str, where: str,
                                                   router_and_prefill: list[int],
                                                   decode_nodes: tuple[list[int], ...]) -> None:
    """A handoff's prefill fails on the prefill node, a short prompt's on the decode node that
    prefilled it (which counts it)."""
    before = _failed(cluster)
    response = _marked(cluster, {"prompt": prompt, "max_tokens": 4}, f"route-{route}-inject-fault-prefill")
    _assert_fired(response, where)
    moved = _moved(cluster, before)
    assert moved[:2] == router_and_prefill and sorted(moved[2:]) in decode_nodes, moved


def test_a_fault_in_a_kept_conversations_next_turn_fails_on_the_node_holding_it(cluster: Cluster) -> None:
    opening = " ".join(f"The ferry to island {i} left the quay at seven." for i in range(9))
    served, history, _ = _first_turn(cluster, opening, {"temperature": 0})
    before = _failed(cluster)
    routed_locally = metric(cluster.router.url, "statecore:router_routes_total", route="prefix_hit_local")
    response = _marked(cluster, {"prompt": history + " And then?", "max_tokens": 4},
                       "route-kept-inject-fault-prefill")
    _assert_fired(response, "decode")
    routed = metric(cluster.router.url, "statecore:router_routes_total", route="prefix_hit_local")
    assert routed == routed_locally + 1
    assert _moved(cluster, before) == [1, 0, *[int(node is served) for node in cluster.decode]]


def test_a_peers_failure_is_retried_on_the_other_decode_node_and_only_the_first_counts_it(
    cluster: Cluster
) -> None:
    before = _failed(cluster)
    done = _counted(cluster.decode, "done")
    body = {"prompt": SHORT, "max_tokens": 4, "temperature": 0}
    response = _marked(cluster, body, "route-retry-inject-fault-peer-prefill")
    assert response.status_code == 200, response.text
    assert response.json()["choices"] == post(cluster.single, "/v1/completions", body).json()["choices"]
    moved = _moved(cluster, before)
    assert moved[:2] == [0, 0] and sorted(moved[2:]) == [0, 1], moved  # the router counts no failure
    finished = [now - was for now, was in zip(_counted(cluster.decode, "done"), done, strict=True)]
    assert finished == [1 - m for m in moved[2:]], (moved, finished)  # the other node served it
    assert "-> routed on retry" in cluster.router.log.read_text()


def test_a_fault_in_one_choice_of_n_fails_that_choice_where_it_fired(cluster: Cluster) -> None:
    before = _failed(cluster)
    body = {"prompt": SHORT, "max_tokens": 4, "n": 2, "temperature": 0.7, "seed": 3}
    _assert_fired(_marked(cluster, body, "route-choice-inject-fault-prefill.choice1-n2"), "decode")
    moved = _moved(cluster, before)
    # choice 1 failed where it was prefilled; choice 0 was freed (cancelled), not failed
    assert moved[:2] == [1, 0] and sorted(moved[2:]) == [0, 1], moved
