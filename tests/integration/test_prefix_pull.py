"""A prefill node pulling a decode node's cached prefix: `MlxEngine.export_prefix` on one engine,
`import_prefix` on another, on a tiny real checkpoint; and `PrefixPuller` over the fake engine.

The imported blocks must be the ones the importing engine's own chunks would have computed: a
prompt starting with them reports them as cached, and its first token, its held KV (to the bit)
and its tokens equal an engine's without any cache. A payload of another chunk size is refused
typed (the fingerprint says so) and the prefill still works. Whatever fails in a pull, the
puller counts it and the prefill goes on. On the wire, the router's hint is sent only when set
(a node of an older version sees the body it knows), and a pull posts the prefix's tokens.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from adapters.http.internal_wire import PrefillBody, PrefixFromBody, error_json
from adapters.http.peers_httpx import HttpxPeers
from adapters.mlx import MlxEngine
from effects.engine_port import SamplingParams
from effects.fakes import FakeEngine
from effects.handoffs import HandoffRecord
from effects.ports import PrefixSource, PulledPrefix
from effects.prefix_pull import PrefixPuller
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.ids import RequestId
from support.tiny_models import cached_checkpoint
from tests.integration.engines import load_into, opened_engines, served_whole

CHUNK = 16
GREEDY = SamplingParams(max_tokens=12)
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, top_k=40, seed=5)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + 11 * salt) % 500 + 2 for i in range(n)]


@pytest.fixture
async def engines() -> AsyncIterator[list[MlxEngine]]:
    async with opened_engines() as opened:
        yield opened


async def load(opened: list[MlxEngine], path: Path, **kw: Any) -> MlxEngine:
    return await load_into(opened, path, **{"prefill_chunk_size": CHUNK, **kw})


async def prefilled(engine: MlxEngine, rid: str, prompt: Sequence[int],
                    sampling: SamplingParams = GREEDY) -> tuple[int, int, bytes, list[int]]:
    return await served_whole(engine, rid, prompt, sampling)


async def test_imported_prefix_blocks_are_reused_and_give_a_cache_less_engine_s_numbers(
    engines: list[MlxEngine]
) -> None:
    path = cached_checkpoint("llama")
    holder = await load(engines, path)
    puller = await load(engines, path)
    fresh = await load(engines, path, prefix_cache_bytes=0)
    first = prompt_of(70)  # blocks of 16 end at 16, 32, 48, 64
    await prefilled(holder, "turn1", first)
    with pytest.raises(StatecoreError) as none_held:
        await holder.export_prefix(prompt_of(40, salt=3))
    assert none_held.value.info.code is Code.PREFIX_NOT_CACHED
    assert none_held.value.info.http_status == 404

    payload = (await holder.export_prefix(first)).joined()
    assert await puller.import_prefix(payload, first) == 64
    assert puller.statistics().prefix_cache_bytes > 0
    second = [*first, *prompt_of(50, salt=7)]
    pulled = await prefilled(puller, "turn2", second)
    alone = await prefilled(fresh, "turn2", second)
    assert pulled[1] == 64 and alone[1] == 0
    assert pulled[0] == alone[0] and pulled[3] == alone[3]
    assert pulled[2] == alone[2]  # the KV handed off: the same bytes to the bit
    # seeded too, from blocks of a longer pull (the holder now keeps the second turn's as well)
    third = [*second, *prompt_of(30, salt=9)]
    await prefilled(holder, "turn2", second)
    again = await load(engines, path)
    assert await again.import_prefix((await holder.export_prefix(third)).joined(), third) == 112
    seeded = await prefilled(again, "turn3", third, SEEDED)
    assert seeded[1] == 112
    alone_seeded = await prefilled(fresh, "turn3", third, SEEDED)
    assert (seeded[0], seeded[2], seeded[3]) == (alone_seeded[0], alone_seeded[2], alone_seeded[3])


async def test_a_prefix_of_another_chunk_size_is_refused_and_the_prefill_still_works(
    engines: list[MlxEngine]
) -> None:
    path = cached_checkpoint("llama")
    holder = await load(engines, path)
    other = await load(engines, path, prefill_chunk_size=CHUNK * 2)
    first = prompt_of(70, salt=1)
    await prefilled(holder, "a", first)
    payload = (await holder.export_prefix(first)).joined()
    with pytest.raises(StatecoreError) as refused:
        await other.import_prefix(payload, first)
    assert refused.value.info.code is Code.KV_WRONG_MODEL
    with pytest.raises(StatecoreError) as cut:
        await holder.import_prefix(payload[:-5], first)
    assert cut.value.info.code in (Code.KV_TRUNCATED, Code.KV_MALFORMED)
    with pytest.raises(StatecoreError) as longer:  # covers more tokens than were asked for
        await holder.import_prefix(payload, first[:40])
    assert longer.value.info.code is Code.KV_MALFORMED
    assert other.statistics().prefix_cache_bytes == 0
    first_token, cached, _, tokens = await prefilled(other, "b", [*first, 9, 9, 9])
    assert cached == 0 and len(tokens) == GREEDY.max_tokens and tokens[0] == first_token


# ---------------------------------------------------------------------------------------------
# The puller over the fake engine


class Holder:
    """The decode node's side, as `Peers.fetch_prefix` sees it: an engine's export, or a failure."""

    def __init__(self, engine: FakeEngine, error: ErrorInfo | None = None) -> None:
        self.engine = engine
        self.error = error
        self.asked: list[tuple[str, tuple[int, ...]]] = []

    async def fetch_prefix(self, node: str, tokens: Sequence[int]) -> PulledPrefix:
        self.asked.append((node, tuple(tokens)))
        if self.error is not None:
            raise StatecoreError(self.error)
        return PulledPrefix((await self.engine.export_prefix(tokens)).joined(), 0.001, 0.002)


def fake_with_cache() -> FakeEngine:
    engine = FakeEngine()
    engine.summary_block_tokens = 16
    return engine


PROMPT = tuple(range(1, 101))
HINT = PrefixSource("http://decode", 96)


@pytest.mark.parametrize(("mode", "error", "outcome", "cached"), [
    ("always", None, "pulled", 96),
    ("never", None, "skipped", 0),
    ("auto", None, "skipped", 0),  # no prefill rate measured yet
    ("always", ErrorInfo(Fault.TRANSPORT, Code.TRANSPORT_LOST, "gone"), "failed", 0),
    ("always", ErrorInfo(Fault.PEER, Code.PREFIX_NOT_CACHED, "evicted"), "failed", 0),
    ("always", ErrorInfo(Fault.PEER, Code.KV_WRONG_MODEL, "other chunks"), "failed", 0),
])
async def test_the_puller_pulls_by_its_mode_and_a_failed_pull_only_costs_the_pull(
    mode: str, error: ErrorInfo | None, outcome: str, cached: int
) -> None:
    decode = FakeEngine()
    decode.prefixes.add(PROMPT[:96])
    prefill = fake_with_cache()
    holder = Holder(decode, error)
    puller = PrefixPuller(prefill, holder, mode)  # type: ignore[arg-type]  # fetch_prefix only
    record = HandoffRecord("r", "prefill")
    assert await puller.before_prefill("r", PROMPT, HINT, record) == cached
    result = await prefill.prefill(RequestId("r"), PROMPT, GREEDY)
    assert result.cached_tokens == cached
    stats = puller.statistics()
    assert {name: getattr(stats, name) for name in ("pulled", "skipped", "failed")} == {
        name: int(name == outcome) for name in ("pulled", "skipped", "failed")}
    assert holder.asked == ([("http://decode", PROMPT[:96])] if outcome != "skipped" else [])
    assert (record.prefix_pull_tokens, stats.tokens) == ((96, 96) if outcome == "pulled" else (None, 0))


async def test_auto_pulls_once_its_own_prefill_rate_says_computing_is_slower() -> None:
    decode = FakeEngine()
    decode.prefixes.add(PROMPT[:96])
    prefill = fake_with_cache()
    puller = PrefixPuller(prefill, Holder(decode), "auto")  # type: ignore[arg-type]
    # a first prompt computed at 100 tokens a second (the fake's cache is a byte a token): 96
    # tokens take 0.96 s to compute and far less to move at the prior 1 GB/s
    measured = await prefill.prefill(RequestId("warm"), [7] * 200, GREEDY)
    puller.prefilled(measured, 2.0, 64)
    assert puller.rates.prefill_tokens_per_s == 100.0
    assert await puller.before_prefill("r", PROMPT, HINT) == 96
    assert puller.statistics().pulled == 1


async def test_a_pull_slower_than_its_deadline_is_given_up() -> None:
    class Stalled(Holder):
        async def fetch_prefix(self, node: str, tokens: Sequence[int]) -> PulledPrefix:
            await trio.sleep_forever()

    stalled = Stalled(FakeEngine())
    puller = PrefixPuller(fake_with_cache(), stalled, "always", timeout_s=0.05)  # type: ignore[arg-type]
    assert await puller.before_prefill("r", PROMPT, HINT) == 0
    assert puller.statistics().failed == 1


# ---------------------------------------------------------------------------------------------
# The wire: the hint travels only when set; fetch_prefix posts the tokens and maps errors


async def test_the_hint_is_sent_only_when_set_and_a_prefix_pull_posts_its_tokens() -> None:
    seen: list[tuple[str, str, dict[str, Any]]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        seen.append((request.method, request.url.path, body))
        if request.url.path == "/internal/prefill":
            return httpx.Response(200, json={"first_token": 7, "is_eos": False, "held_bytes": 1})
        if body.get("tokens") == [1, 2, 3]:
            return httpx.Response(200, content=b"FAKP-bytes")
        missing = ErrorInfo(Fault.PEER, Code.PREFIX_NOT_CACHED, "none held")
        return httpx.Response(404, json=error_json(missing))

    peers = HttpxPeers(transport=httpx.MockTransport(answer))
    try:
        await peers.prefill("http://p", RequestId("a"), [1, 2, 3], GREEDY)
        await peers.prefill("http://p", RequestId("b"), [1, 2, 3], GREEDY, PrefixSource("http://d", 2))
        pulled = await peers.fetch_prefix("http://d", [1, 2, 3])
        with pytest.raises(StatecoreError) as missing:
            await peers.fetch_prefix("http://d", [4, 5])
    finally:
        await peers.aclose()
    assert "prefix_from" not in seen[0][2]  # what a node of an older version accepts
    assert seen[1][2]["prefix_from"] == {"url": "http://d", "tokens": 2}
    assert PrefillBody.model_validate_json(json.dumps(seen[1][2])).prefix_from == PrefixFromBody(
        url="http://d", tokens=2)
    assert seen[2][:2] == ("POST", "/internal/prefix_kv") and bytes(pulled.payload) == b"FAKP-bytes"
    assert missing.value.info.code is Code.PREFIX_NOT_CACHED
