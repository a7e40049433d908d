"""Prefix-aware routing: the core's scoring (`statecore.routing`), the router's summaries
(`effects.routing`) and its pick (`effects.health.PeerSet.pick`)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from effects.engine_port import PrefixSummary
from effects.health import PeerSet
from effects.routing import PrefixSummaries
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.prefix import block_keys
from statecore.routing import (
    DEFAULT_PULL_BYTES_PER_S,
    Overflow,
    PullRates,
    Route,
    RouteCandidate,
    cached_prefix_tokens,
    choose_node,
    choose_route,
    overflows,
    prefix_pull_pays,
    route_cost,
    summary_key,
)

PROMPT = list(range(100))  # blocks of 16 end at 16, 32, 48, 64, 80, 96


def held(tokens: list[int], blocks: int, size: int = 16) -> set[bytes]:
    return {summary_key(key) for key in block_keys(tokens, size)[:blocks]}


@pytest.mark.parametrize(("blocks", "expected"), [(0, 0), (1, 16), (3, 48), (6, 96)])
def test_cached_tokens_are_the_leading_whole_blocks_a_summary_holds(blocks: int, expected: int) -> None:
    assert cached_prefix_tokens(PROMPT, 16, held(PROMPT, blocks)) == expected


def test_a_gap_ends_the_cached_prefix_and_another_block_size_matches_nothing() -> None:
    keys = held(PROMPT, 6) - held(PROMPT, 2) | held(PROMPT, 1)  # blocks 0, 2..5: block 1 missing
    assert cached_prefix_tokens(PROMPT, 16, keys) == 16
    assert cached_prefix_tokens(PROMPT, 32, held(PROMPT, 6)) == 0
    other = [*PROMPT[:20], 999, *PROMPT[21:]]  # differs inside block 1
    assert cached_prefix_tokens(other, 16, held(PROMPT, 6)) == 16


def test_a_summary_with_block_ends_scores_the_blocks_that_node_cuts() -> None:
    # a message ends with token 7 at position 41 (and the last at 102): that node's blocks end at
    # 16, 32, 41, 57, ...
    prompt = [*range(8, 48), 7, *range(100, 160), 7, 8]
    keys = {summary_key(key) for key in block_keys(prompt, 16, {7})[:3]}
    assert cached_prefix_tokens(prompt, 16, keys, {7}) == 41
    assert cached_prefix_tokens(prompt, 16, keys) == 32  # cut without the ends: 32-48 is another block


@pytest.mark.parametrize(("candidates", "load_tokens", "chosen"), [
    # no summaries: least loaded, the first listed on a tie (the router's old rule)
    ([RouteCandidate("a", 2), RouteCandidate("b", 1)], 512, "b"),
    ([RouteCandidate("a", 1), RouteCandidate("b", 1)], 512, "a"),
    # a held prefix outweighs a busier node while it saves more than the load costs
    ([RouteCandidate("a", 0), RouteCandidate("b", 1, cached_tokens=2048)], 512, "b"),
    ([RouteCandidate("a", 0), RouteCandidate("b", 5, cached_tokens=2048)], 512, "a"),
    # load_tokens 0: prefix only, load breaks ties
    ([RouteCandidate("a", 0), RouteCandidate("b", 9, cached_tokens=16)], 0, "b"),
    # prompt tokens still being computed there queue ahead of this one
    ([RouteCandidate("a", 1, prefilling=2000), RouteCandidate("b", 1)], 512, "b"),
    ([RouteCandidate("a", 0, prefilling=300), RouteCandidate("b", 1)], 512, "a"),
    ([RouteCandidate("a", 0, prefilling=3000), RouteCandidate("b", 4)], 512, "b"),
    # a suspect node only when nothing healthy is left, whatever it holds
    ([RouteCandidate("a", 3), RouteCandidate("b", 0, suspect=True, cached_tokens=4000)], 512, "a"),
    ([RouteCandidate("b", 0, suspect=True)], 512, "b"),
])
def test_the_choice_weighs_new_prefill_work_against_load(candidates: list[RouteCandidate], load_tokens: int,
                                                         chosen: str) -> None:
    assert choose_node(4096, candidates, load_tokens).node == chosen


def test_choose_node_refuses_nothing_to_choose_and_negative_load() -> None:
    with pytest.raises(ValueError, match="at least one"):
        choose_node(10, [], 512)
    with pytest.raises(ValueError, match="load_tokens"):
        choose_node(10, [RouteCandidate("a", 0)], -1)


candidate = st.builds(RouteCandidate, st.sampled_from("abcdef"), st.integers(0, 40), st.booleans(),
                      st.integers(0, 5000))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.lists(candidate, min_size=1, max_size=8), st.integers(0, 2000))
def test_the_choice_is_the_cheapest_healthy_candidate(prompt: int, candidates: list[RouteCandidate],
                                                     load_tokens: int) -> None:
    chosen = choose_node(prompt, candidates, load_tokens)
    assert chosen in candidates
    pool = [c for c in candidates if not c.suspect] or candidates
    assert chosen in pool
    cost = route_cost(prompt, chosen, load_tokens)
    assert cost >= 0 and all(cost <= route_cost(prompt, c, load_tokens) for c in pool)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.lists(candidate, min_size=1, max_size=8), st.integers(0, 2000),
       st.data())
def test_holding_more_of_the_prompt_never_makes_a_node_less_preferred(
    prompt: int, candidates: list[RouteCandidate], load_tokens: int, data: st.DataObject
) -> None:
    chosen = choose_node(prompt, candidates, load_tokens)
    index = candidates.index(chosen)
    more = data.draw(st.integers(0, 5000))
    better = RouteCandidate(chosen.node, chosen.in_flight, chosen.suspect, chosen.cached_tokens + more)
    assert choose_node(prompt, [*candidates[:index], better, *candidates[index + 1:]], load_tokens) is better


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.booleans()), min_size=1, max_size=8), st.integers(0, 2000))
def test_without_summaries_the_choice_is_the_least_loaded_healthy_node(
    loads: list[tuple[int, bool]], load_tokens: int
) -> None:
    candidates = [RouteCandidate(f"n{i}", load, suspect) for i, (load, suspect) in enumerate(loads)]
    expected = min(candidates, key=lambda c: (c.suspect, c.in_flight))  # the first such one
    assert choose_node(777, candidates, load_tokens) is expected


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_summaries_go_stale_and_an_unchanged_answer_refreshes_them() -> None:
    clock = Clock()
    answers: list[PrefixSummary | StatecoreError | None] = []
    asked: list[int | None] = []

    async def fetch(node: str, since: int | None) -> PrefixSummary | None:
        asked.append(since)
        answer = answers.pop(0)
        if isinstance(answer, StatecoreError):
            raise answer
        return answer

    summaries = PrefixSummaries(["http://p"], fetch, stale_after_s=5.0, clock=clock)
    keys = tuple(held(PROMPT, 3))
    answers.append(PrefixSummary(16, 7, keys))
    trio.run(summaries.refresh, "http://p")
    assert summaries.cached_tokens(["http://p"], PROMPT) == {"http://p": 48}
    assert summaries.blocks("http://p") == 3
    assert (summaries.version("http://p"), summaries.version("http://elsewhere")) == (7, None)
    clock.now = 4.0
    answers.append(None)  # unchanged since version 7
    trio.run(summaries.refresh, "http://p")
    assert asked == [None, 7]
    clock.now = 8.0  # 4 s after the last answer: still fresh
    assert summaries.cached_tokens(["http://p"], PROMPT)["http://p"] == 48
    answers.append(StatecoreError(ErrorInfo(Fault.TRANSPORT, Code.TRANSPORT_LOST, "gone")))
    trio.run(summaries.refresh, "http://p")
    clock.now = 9.5  # no answer since 4.0: stale, so it counts as holding nothing
    assert summaries.cached_tokens(["http://p"], PROMPT) == {"http://p": 0}
    assert summaries.blocks("http://p") == 0
    assert summaries.cached_tokens(["http://elsewhere"], PROMPT)["http://elsewhere"] == 0


def test_the_prompt_is_hashed_once_per_block_size_for_every_node(monkeypatch: pytest.MonkeyPatch) -> None:
    from statecore.routing import prompt_summary_blocks as original

    hashed: list[int] = []

    def counted(prompt: Sequence[int], block_tokens: int, ends: Collection[int] = ()
                ) -> tuple[list[bytes], list[int]]:
        hashed.append(block_tokens)
        return original(prompt, block_tokens, ends)

    monkeypatch.setattr("effects.routing.prompt_summary_blocks", counted)
    nodes = ["http://a", "http://b", "http://c"]
    answers = {"http://a": PrefixSummary(16, 1, tuple(held(PROMPT, 3))),
               "http://b": PrefixSummary(16, 1, tuple(held(PROMPT, 1))),
               "http://c": PrefixSummary(32, 1, tuple(held(PROMPT, 1)))}

    async def fetch(node: str, since: int | None) -> PrefixSummary | None:
        return answers[node]

    summaries = PrefixSummaries(nodes, fetch, clock=Clock())
    for node in nodes:
        trio.run(summaries.refresh, node)
    assert summaries.cached_tokens(nodes, PROMPT) == {"http://a": 48, "http://b": 16, "http://c": 0}
    assert sorted(hashed) == [16, 32]
    # routing one request asks again (the other role's nodes, what the chosen one will hold): the
    # same prompt is not hashed again, another one is
    summaries.expect("http://b", list(PROMPT))
    assert summaries.cached_tokens(nodes, tuple(PROMPT))["http://b"] == 96
    assert sorted(hashed) == [16, 32]
    assert summaries.cached_tokens(["http://a"], [*PROMPT[:-1], 7])["http://a"] == 48
    assert sorted(hashed) == [16, 16, 32]


def test_a_node_without_a_prefix_cache_counts_as_holding_nothing() -> None:
    async def fetch(node: str, since: int | None) -> PrefixSummary | None:
        return PrefixSummary(0, 0)

    summaries = PrefixSummaries(["http://p"], fetch, clock=Clock())
    trio.run(summaries.refresh, "http://p")
    assert not summaries.fresh("http://p") and summaries.cached_tokens(["http://p"], PROMPT)["http://p"] == 0


def test_the_router_sends_a_prompt_where_its_prefix_is_and_counts_why() -> None:
    nodes = ["http://p0", "http://p1"]

    async def probe(url: str) -> bool:
        return True

    async def fetch(node: str, since: int | None) -> PrefixSummary | None:
        return PrefixSummary(16, 1, tuple(held(PROMPT, 4)) if node == "http://p1" else ())

    summaries = PrefixSummaries(nodes, fetch, clock=Clock())
    peers = PeerSet({"prefill": nodes}, probe, summaries=summaries, load_tokens=16)
    peers.available.update(nodes)
    assert peers.pick("prefill", set(), PROMPT, "r0") == "http://p0"  # no summary yet: least loaded
    for node in nodes:
        trio.run(summaries.refresh, node)
    assert peers.pick("prefill", set(), PROMPT, "r1") == "http://p1"  # holds 64 of the 100 tokens
    # ... and, sent PROMPT, is expected to hold its 96 from now on (before its next summary)
    assert summaries.cached_tokens(nodes, PROMPT) == {"http://p0": 0, "http://p1": 96}
    peers.in_flight["http://p1"] = 6  # 6 x 16 load tokens = what it saves: the tie goes to fewer in flight
    assert peers.pick("prefill", set(), PROMPT, "r2") == "http://p0"
    assert peers.pick("prefill", {"http://p0"}, PROMPT, "r3") == "http://p1"  # p0 avoided (a retry)
    assert peers.pick("prefill", set(), None) == "http://p0"  # nothing to prefill: load only
    assert peers.routed == {("prefill", "http://p0", "load"): 3, ("prefill", "http://p1", "prefix"): 2}
    assert peers.expected_cached_tokens == {"http://p0": 0, "http://p1": 64 + 96}
    trio.run(summaries.refresh, "http://p1")  # a changed summary replaces the guess
    assert summaries.cached_tokens(nodes, PROMPT)["http://p1"] == 64


@pytest.mark.parametrize(("prompt", "candidates", "local_below", "route", "node"), [
    # the decode node holding 2,000 of 2,100 tokens prefills the last 100 itself
    (2100, [RouteCandidate("a", 0), RouteCandidate("b", 0, cached_tokens=2000)], 1000, "prefix_hit_local",
     "b"),
    # ... but not when the rest is the threshold or more: a prefill node, told where the start is,
    # handing off to the node that holds it
    (3000, [RouteCandidate("a", 0), RouteCandidate("b", 0, cached_tokens=2000)], 1000, "prefill_node_prefix",
     "b"),
    (3000, [RouteCandidate("a", 1), RouteCandidate("b", 0, cached_tokens=2000)], 1000, "prefill_node_prefix",
     "b"),
    # nothing held anywhere: a prefill node, the least loaded decode node
    (3000, [RouteCandidate("a", 1), RouteCandidate("b", 0)], 1000, "prefill_node", "b"),
    # a short prompt prefills on a decode node with or without a hit (where it is cheapest)
    (500, [RouteCandidate("a", 0), RouteCandidate("b", 0)], 1000, "local", "a"),
    (500, [RouteCandidate("a", 0), RouteCandidate("b", 0, cached_tokens=256)], 1000, "prefix_hit_local", "b"),
    # a hit on a node too busy for it: the cheaper node has none, so the rest is the whole prompt
    (2100, [RouteCandidate("a", 0), RouteCandidate("b", 9, cached_tokens=2000)], 1000, "prefill_node", "a"),
    # threshold 0 (--force-disaggregation): always a prefill node, whatever a decode node holds
    (2100, [RouteCandidate("a", 0), RouteCandidate("b", 0, cached_tokens=2096)], 0, "prefill_node_prefix",
     "b"),
    (2100, [RouteCandidate("a", 0), RouteCandidate("b", 0)], 0, "prefill_node", "a"),
    # a suspect decode node only when nothing healthy is left
    (2100, [RouteCandidate("a", 3), RouteCandidate("b", 0, True, 2000)], 1000, "prefill_node", "a"),
])
def test_a_turn_is_prefilled_where_its_start_is_when_the_rest_is_short(
    prompt: int, candidates: list[RouteCandidate], local_below: int, route: str, node: str
) -> None:
    choice = choose_route(prompt, candidates, local_below, 512)
    assert (choice.route.value, choice.decode.node) == (route, node)
    assert choice.local is (choice.route not in (Route.PREFILL_NODE, Route.PREFILL_NODE_PREFIX))
    if choice.route is Route.PREFILL_NODE_PREFIX:
        assert choice.held_tokens == choice.decode.cached_tokens > 0


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.lists(candidate, min_size=1, max_size=8), st.integers(0, 3000),
       st.integers(0, 2000))
def test_the_route_is_local_exactly_when_the_uncached_rest_is_below_the_threshold(
    prompt: int, candidates: list[RouteCandidate], local_below: int, load_tokens: int
) -> None:
    choice = choose_route(prompt, candidates, local_below, load_tokens)
    best = choose_node(prompt, candidates, load_tokens)
    rest = prompt - best.cached_tokens if best.cached_tokens > 0 else prompt
    assert choice.local is (rest < local_below or prompt < local_below)
    if choice.route is Route.PREFILL_NODE:  # nothing held where it is cheapest: by load alone
        assert best.cached_tokens == 0 and choice.decode.cached_tokens == 0
        assert choice.decode.node == choose_node(
            prompt, [RouteCandidate(c.node, c.in_flight, c.suspect) for c in candidates], load_tokens).node
    else:
        assert choice.decode is best
    # a prefill node is told where the prompt's start is exactly when the chosen node holds some
    assert (choice.route is Route.PREFILL_NODE_PREFIX) is (not choice.local and best.cached_tokens > 0)
    if not choice.local:
        assert choice.held_tokens == best.cached_tokens
    assert prompt >= local_below or choice.local  # a short prompt never goes to a prefill node


@pytest.mark.parametrize(("prompt", "candidates", "local_below", "backlog", "route", "node"), [
    # the prefill tier has a whole prompt queued: the idle decode node takes it (least loaded first)
    (2000, [RouteCandidate("a", 2), RouteCandidate("b", 1)], 500, 2000, "overflow", "b"),
    (2000, [RouteCandidate("a", 0, prefilling=300), RouteCandidate("b", 4)], 500, 4000, "overflow", "b"),
    # less than the prompt queued there: the prefill node, whose queue is shorter than the prompt
    (2000, [RouteCandidate("a", 0), RouteCandidate("b", 0)], 500, 1999, "prefill_node", "a"),
    # every decode node is already prefilling something of its own
    (2000, [RouteCandidate("a", 0, prefilling=1), RouteCandidate("b", 0, prefilling=900)], 500, 8000,
     "prefill_node", "a"),
    # no prefill node to ask (or overflow off)
    (2000, [RouteCandidate("a", 0), RouteCandidate("b", 0)], 500, None, "prefill_node", "a"),
    # --force-disaggregation (threshold 0): never
    (2000, [RouteCandidate("a", 0), RouteCandidate("b", 0)], 0, 8000, "prefill_node", "a"),
    # a suspect decode node never takes the overflow
    (2000, [RouteCandidate("a", 0, True), RouteCandidate("b", 0, prefilling=5)], 500, 8000,
     "prefill_node", "b"),
    # the node holding the prompt's start takes it when idle (it computes only the rest)...
    (2000, [RouteCandidate("a", 0), RouteCandidate("b", 0, cached_tokens=1024)], 500, 2000, "overflow", "b"),
    # ... and when it is busy, a prefill node pulls from it as before
    (2000, [RouteCandidate("a", 0), RouteCandidate("b", 0, cached_tokens=1024, prefilling=10)], 500, 2000,
     "prefill_node_prefix", "b"),
])
def test_a_busy_prefill_tier_overflows_to_a_decode_node_prefilling_nothing(
    prompt: int, candidates: list[RouteCandidate], local_below: int, backlog: int | None, route: str,
    node: str,
) -> None:
    choice = choose_route(prompt, candidates, local_below, 512, backlog, Overflow.ON)
    assert (choice.route.value, choice.decode.node) == (route, node)
    assert choice.local is (choice.route is Route.OVERFLOW)
    if choice.route is Route.OVERFLOW:
        assert overflows(prompt, backlog, choice.decode, Overflow.ON)
    # off: never; idle (the default): the same unless the node it went to has requests in flight
    off = choose_route(prompt, candidates, local_below, 512, backlog, Overflow.OFF)
    assert off.route is not Route.OVERFLOW
    idle = choose_route(prompt, candidates, local_below, 512, backlog)
    if choice.route is Route.OVERFLOW and choice.decode.in_flight == 0:
        assert idle.route is Route.OVERFLOW


@pytest.mark.parametrize(("candidates", "route", "node"), [
    # every decode node decodes something: the prompt waits for the prefill tier
    ([RouteCandidate("a", 2), RouteCandidate("b", 1)], "prefill_node", "b"),
    # the one with nothing in flight takes it, though another is less loaded by the tokens' measure
    ([RouteCandidate("a", 1), RouteCandidate("b", 0)], "overflow", "b"),
    # a node holding the prompt's start but decoding: a prefill node pulls from it
    ([RouteCandidate("a", 0), RouteCandidate("b", 1, cached_tokens=1200)], "prefill_node_prefix", "b"),
])
def test_by_default_a_prompt_overflows_only_onto_a_decode_node_with_nothing_in_flight(
    candidates: list[RouteCandidate], route: str, node: str,
) -> None:
    choice = choose_route(2000, candidates, 500, 512, 4000)
    assert (choice.route.value, choice.decode.node) == (route, node)
    assert choose_route(2000, candidates, 500, 512, 4000, Overflow.ON).route is Route.OVERFLOW


busy_candidate = st.builds(RouteCandidate, st.sampled_from("abcdef"), st.integers(0, 40), st.booleans(),
                           st.integers(0, 5000), st.sampled_from([0, 0, 1, 3000]))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.lists(busy_candidate, min_size=1, max_size=8), st.integers(0, 3000),
       st.none() | st.integers(0, 10000), st.sampled_from(list(Overflow)))
def test_overflow_only_ever_moves_a_prefill_node_prompt_to_an_idle_decode_node(
    prompt: int, candidates: list[RouteCandidate], local_below: int, backlog: int | None, overflow: Overflow
) -> None:
    without = choose_route(prompt, candidates, local_below, 512)
    choice = choose_route(prompt, candidates, local_below, 512, backlog, overflow)
    if without.local:  # short prompts and prefix hits are untouched
        assert choice == without
    elif choice.route is Route.OVERFLOW:
        assert overflow is not Overflow.OFF
        assert local_below > 0 and backlog is not None and backlog >= prompt
        assert choice.decode.prefilling == 0 and not choice.decode.suspect
        assert overflow is Overflow.ON or choice.decode.in_flight == 0
    else:
        assert choice == without
        # kept on a prefill node although the tier is busy: no decode node it could have gone to
        if local_below > 0 and backlog is not None and backlog >= prompt and overflow is not Overflow.OFF:
            eligible = candidates if without.route is Route.PREFILL_NODE else [without.decode]
            assert not any(c.prefilling == 0 and not c.suspect
                           and (overflow is Overflow.ON or c.in_flight == 0) for c in eligible)


def test_the_router_counts_the_prefill_each_node_computes_until_the_first_token() -> None:
    async def probe(url: str) -> bool:
        return True

    peers = PeerSet({"prefill": ["http://p"], "decode": ["http://d"]}, probe)
    peers.available.update(["http://p", "http://d"])
    long = list(range(2000))
    assert peers.route(set(), long, "r0", 500).route is Route.PREFILL_NODE
    peers.prefilling["http://p"] = 2000  # r0 is computed there
    assert peers.route(set(), long, "r1", 500).route is Route.OVERFLOW
    peers.prefilling["http://d"] = 2000  # r1 on the decode node: the next waits for the prefill node
    assert peers.route(set(), long, "r2", 500).route is Route.PREFILL_NODE
    # p avoided (a retry): no backlog known, no overflow
    assert peers.route({"http://p"}, long, "r3", 500).route is Route.PREFILL_NODE
    off = PeerSet({"prefill": ["http://p"], "decode": ["http://d"]}, probe, overflow=Overflow.OFF)
    off.available.update(["http://p", "http://d"])
    off.prefilling["http://p"] = 9000
    assert off.route(set(), long, "r4", 500).route is Route.PREFILL_NODE
    assert peers.routes == {"prefill_node": 3, "overflow": 1}


def test_choose_route_refuses_a_negative_threshold() -> None:
    with pytest.raises(ValueError, match="local_below"):
        choose_route(10, [RouteCandidate("a", 0)], -1, 512)


def test_the_router_routes_a_turn_to_the_decode_node_holding_its_conversation_and_counts_it() -> None:
    decodes = ["http://d0", "http://d1"]

    async def probe(url: str) -> bool:
        return True

    async def fetch(node: str, since: int | None) -> PrefixSummary | None:
        return PrefixSummary(16, 1, tuple(held(PROMPT, 6)) if node == "http://d1" else ())

    summaries = PrefixSummaries(decodes, fetch, clock=Clock())
    peers = PeerSet({"prefill": ["http://p"], "decode": decodes}, probe, summaries=summaries)
    peers.available.update([*decodes, "http://p"])
    assert peers.route(set(), PROMPT, "r0", 50).route is Route.PREFILL_NODE  # no summaries yet
    for node in decodes:
        trio.run(summaries.refresh, node)
    hit = peers.route(set(), PROMPT, "r1", 50)  # d1 holds 96 of 100: 4 left to prefill
    assert (hit.route, hit.decode.node, hit.decode.cached_tokens) == (Route.PREFIX_HIT_LOCAL, "http://d1", 96)
    assert peers.route({"http://d1"}, PROMPT, "r2", 50).route is Route.PREFILL_NODE  # d1 avoided: a retry
    # a long rest: a prefill node, handing off to (and told of) d1, which holds the start
    pulled = peers.route(set(), [*PROMPT, *range(100, 200)], "r2b", 50)
    assert (pulled.route, pulled.decode.node, pulled.held_tokens) == (
        Route.PREFILL_NODE_PREFIX, "http://d1", 96)
    assert peers.route(set(), PROMPT[:40], "r3", 50).route is Route.PREFIX_HIT_LOCAL
    assert peers.route(set(), [7] * 40, "r4", 50).route is Route.LOCAL  # short, nothing held
    # the next turn of r4's conversation, before any new summary: where r4 went (d0, first on a tie)
    assert summaries.cached_tokens(decodes, [7] * 60)["http://d0"] == 32
    peers.in_flight["http://d1"] = 1
    assert peers.route(set(), [7] * 60, "r5", 50).decode.node == "http://d0"
    assert peers.routes == {"prefill_node": 2, "prefix_hit_local": 3, "local": 1, "prefill_node_prefix": 1}
    assert peers.routed[("decode", "http://d1", "prefix")] == 3
    assert peers.expected_cached_tokens["http://d1"] == 96 + 32


# 1000 tokens/s of prefill, 1 MB/s of pull, 100 bytes a token, 10 ms before the first byte:
# a missing token costs 1 ms to compute and 0.1 ms to pull.
RATES = PullRates(prefill_tokens_per_s=1000.0, pull_bytes_per_s=1e6, pull_latency_s=0.01,
                  kv_bytes_per_token=100.0)


@pytest.mark.parametrize(("held", "own", "rates", "pays"), [
    (512, 0, RATES, True),  # 61 ms of pull against 512 ms of prefill
    (512, 256, RATES, True),  # only the missing 256 count: 35.6 ms against 256 ms
    (512, 512, RATES, False),  # it holds them already
    (256, 512, RATES, False),  # it holds more than the decode node
    (10, 0, RATES, False),  # 11 ms against 10 ms: not quite
    (12, 0, RATES, True),  # 11.2 ms against 12 ms
    (12, 0, replace(RATES, pull_latency_s=0.02), False),  # 21.2 ms against 12 ms
    (512, 0, replace(RATES, pull_bytes_per_s=50_000.0), False),  # 1.03 s against 0.512 s
    (512, 0, replace(RATES, prefill_tokens_per_s=None), False),  # no measured prefill rate yet
    (512, 0, replace(RATES, kv_bytes_per_token=None), False),  # nor the KV's size
    (512, 0, replace(RATES, pull_bytes_per_s=0.0), False),
])
def test_a_prefill_node_pulls_a_held_prefix_when_moving_it_costs_less_than_computing_it(
    held: int, own: int, rates: PullRates, pays: bool
) -> None:
    assert prefix_pull_pays(held, own, rates) is pays


rates = st.builds(PullRates, st.floats(1.0, 1e6), st.floats(1.0, 1e12), st.floats(0.0, 1.0),
                  st.floats(1.0, 1e6))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 100_000), st.integers(0, 100_000), rates, st.floats(1.0, 1e6))
def test_a_pull_pays_less_as_the_network_slows_and_more_as_prefill_slows(
    held: int, own: int, measured: PullRates, factor: float
) -> None:
    pays = prefix_pull_pays(held, own, measured)
    if held <= own:
        assert not pays
    slower_pull = replace(measured, pull_bytes_per_s=measured.pull_bytes_per_s / factor,
                          pull_latency_s=measured.pull_latency_s * factor)
    assert measured.prefill_tokens_per_s is not None
    slower_prefill = replace(measured, prefill_tokens_per_s=measured.prefill_tokens_per_s / factor)
    if not pays:
        assert not prefix_pull_pays(held, own, slower_pull)
    else:
        assert prefix_pull_pays(held, own, slower_prefill)
    # holding more itself never makes a pull pay that did not
    if not pays and own < held:
        assert not prefix_pull_pays(held, own + 1, measured)


def test_the_rates_start_from_priors_and_follow_what_the_node_measures() -> None:
    fresh = PullRates()
    assert (fresh.prefill_tokens_per_s, fresh.kv_bytes_per_token) == (None, None)
    assert fresh.pull_bytes_per_s == DEFAULT_PULL_BYTES_PER_S
    measured = fresh.prefilled(2000, 2.0).held(4000, 100).held(999, 1)  # the first size stays
    assert (measured.prefill_tokens_per_s, measured.kv_bytes_per_token) == (1000.0, 40.0)
    assert measured.prefilled(0, 1.0) == measured and measured.prefilled(10, 0.0) == measured
    later = measured.prefilled(4000, 2.0)  # 2000 tokens/s, weighted in: between the two
    assert later.prefill_tokens_per_s is not None and 1000.0 < later.prefill_tokens_per_s < 2000.0
    pulled = measured.pulled(1_000_000, 0.002, 0.5)  # the first pull replaces the priors
    assert (pulled.pull_bytes_per_s, pulled.pull_latency_s, pulled.pulls_measured) == (2e6, 0.002, 1)
    again = pulled.pulled(1_000_000, 0.004, 0.25)
    assert 2e6 < again.pull_bytes_per_s < 4e6 and 0.002 < again.pull_latency_s < 0.004
    assert pulled.pulled(0, 1.0, 1.0) == pulled
