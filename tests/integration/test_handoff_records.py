"""Per-request handoff records: a prefill node and a decode node, each a real `NodeRunner` and
`NodeApi` over a fake engine, the decode node pulling the KV through `HttpxPeers` over an ASGI
transport (and once through `kv_pull` from a prefill node served on a real socket). After one
handoff, `GET /internal/handoffs` on each node shows one record with the
bytes and the timings that node measured; the endpoint wants the internal token; the ring stays
bounded. Also: `kv_wire.declared_tensor_bytes` reads the raw tensor bytes off a real payload,
and a pull of held KV is answered by the core whatever the request's phase (refused before the
KV is held or for a request the node does not hold; told when the request ends while it waits).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import trio
from starlette.applications import Starlette

from adapters.http.internal_wire import TOKEN_HEADER
from adapters.http.node_api import NodeApi
from adapters.http.peers_httpx import HttpxPeers
from effects.fakes import FakeEngine, Faults
from effects.faults import NoFaults, Phase
from effects.handoffs import HandoffLog
from effects.interpret import EnginePerformer
from effects.runner import NodeRunner, Timeouts
from statecore.errors import Code, StatecoreError
from statecore.ids import RequestId
from statecore.phases import PrefillPhase
from statecore.table import DECODE_REQUEST, PREFILL_REQUEST

TOKEN = "s3cret"
PROMPT = list(range(1, 41))


@dataclass
class Pair:
    prefill: httpx.AsyncClient
    decode: httpx.AsyncClient


def _node(role: str, peers: HttpxPeers | None, handoffs: HandoffLog) -> tuple[NodeRunner[Any], Starlette]:
    engine = FakeEngine()
    performer = EnginePerformer(engine, peers, handoffs=handoffs)
    machine = PREFILL_REQUEST if role == "prefill" else DECODE_REQUEST
    runner: NodeRunner[Any] = NodeRunner(machine, performer, timeouts=Timeouts(deadline_s=5.0), name=role)
    api = NodeApi(role, engine, runner, performer, token=TOKEN)
    return runner, Starlette(routes=api.routes())


@pytest.fixture
async def pair(nursery: trio.Nursery) -> AsyncIterator[Pair]:
    prefill_runner, prefill_app = _node("prefill", None, HandoffLog("prefill"))
    decode_log = HandoffLog("decode")
    peers = HttpxPeers(token=TOKEN, transport=httpx.ASGITransport(app=prefill_app), handoffs=decode_log)
    decode_runner, decode_app = _node("decode", peers, decode_log)
    await nursery.start(prefill_runner.run)
    await nursery.start(decode_runner.run)
    headers = {TOKEN_HEADER: TOKEN}
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(app=prefill_app), base_url="http://prefill",
                          headers=headers) as prefill,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=decode_app), base_url="http://decode",
                          headers=headers) as decode,
    ):
        yield Pair(prefill, decode)
    await peers.aclose()


async def _hand_off(pair: Pair, request_id: str) -> None:
    sampling = {"max_tokens": 4}
    reply = await pair.prefill.post(
        "/internal/prefill", json={"request_id": request_id, "prompt": PROMPT, "sampling": sampling}
    )
    assert reply.status_code == 200, reply.text
    stream = await pair.decode.post("/internal/decode", json={
        "request_id": request_id, "prompt": PROMPT, "sampling": sampling,
        "first_token": reply.json()["first_token"], "prefill_url": "http://prefill",
    })
    assert stream.status_code == 200
    assert stream.text.strip().splitlines()[-1] == '{"finish_reason":"length"}'


async def test_each_node_records_its_side_of_a_handoff(pair: Pair) -> None:
    await _hand_off(pair, "h1")
    sent = (await pair.prefill.get("/internal/handoffs")).json()
    got = (await pair.decode.get("/internal/handoffs")).json()
    payload_bytes = len(b"FAKE") + len(PROMPT)  # what the fake engine exports

    assert (sent["role"], sent["total"]) == ("prefill", 1)
    [out] = sent["records"]
    assert out["request_id"] == "h1" and out["wire_bytes"] == payload_bytes
    assert out["raw_bytes"] is None  # a fake payload has no end frame to read
    assert 0 <= out["encode_s"] < 5
    assert out["transfer_s"] is None and out["install_s"] is None

    assert (got["role"], got["total"]) == ("decode", 1)
    [into] = got["records"]
    assert into["request_id"] == "h1" and into["wire_bytes"] == payload_bytes
    assert into["encode_s"] is None
    assert 0 <= into["first_byte_s"] <= into["transfer_s"] < 5
    assert into["body_s"] == pytest.approx(into["transfer_s"] - into["first_byte_s"])
    assert 0 <= into["install_s"] < 5


async def test_the_endpoint_wants_the_token(pair: Pair) -> None:
    denied = await pair.prefill.get("/internal/handoffs", headers={TOKEN_HEADER: "wrong"})
    assert denied.status_code == 401


class StalledExport(NoFaults):
    """Every export of held KV stalls (so a pull waits on it)."""

    armed = True  # serving asks a fault port nothing unless it is armed

    async def at(self, phase: Phase, request_id: RequestId | str) -> None:
        if phase is Phase.KV_ENCODE:
            await trio.sleep_forever()


async def test_a_pull_is_answered_by_the_core_in_every_phase(nursery: trio.Nursery) -> None:
    engine = FakeEngine(Faults(stall={"prefill"}))  # a prompt with the marker (999) never prefills
    performer = EnginePerformer(engine, faults=StalledExport())
    runner: NodeRunner[Any] = NodeRunner(PREFILL_REQUEST, performer, timeouts=Timeouts(deadline_s=30.0))
    app = Starlette(routes=NodeApi("prefill", engine, runner, performer).routes())
    await nursery.start(runner.run)
    slow, held = RequestId("slow"), RequestId("held")

    async def prefill(rid: str, prompt: list[int]) -> httpx.Response:
        return await node.post("/internal/prefill", json={"request_id": rid, "prompt": prompt,
                                                          "sampling": {"max_tokens": 4}})

    async def pull_until_it_ends() -> None:
        gone = await node.get(f"/internal/kv/{held}")
        assert gone.status_code == 404 and "ended before its KV was sent" in gone.text, gone.text
        done.set()

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://prefill") as node:
        unknown = await node.get("/internal/kv/nobody")
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "kv_not_found"
        nursery.start_soon(prefill, slow, [1, 2, 999])
        while runner.phase_of(slow) is not PrefillPhase.PREFILL:
            await trio.sleep(0.001)
        early = await node.get(f"/internal/kv/{slow}")
        assert early.status_code == 404 and "it is in prefill" in early.text, early.text
        assert runner.phase_of(slow) is PrefillPhase.PREFILL  # the refused pull left it alone
        assert (await prefill(held, PROMPT)).status_code == 200
        done = trio.Event()
        nursery.start_soon(pull_until_it_ends)
        while not len(performer.kv_pulls):
            await trio.sleep(0.001)
        for rid in (held, slow):
            await node.post(f"/internal/cancel/{rid}")
        await done.wait()
    assert not len(performer.kv_pulls)


async def test_a_prefill_reply_says_the_bytes_its_own_cache_holds(nursery: trio.Nursery) -> None:
    engine = FakeEngine()
    performer = EnginePerformer(engine)
    runner: NodeRunner[Any] = NodeRunner(PREFILL_REQUEST, performer, timeouts=Timeouts(deadline_s=30.0))
    app = Starlette(routes=NodeApi("prefill", engine, runner, performer).routes())
    await nursery.start(runner.run)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://prefill") as node:
        for rid, prompt in (("first", list(range(1, 40))), ("second", [1, 2, 3])):
            reply = await node.post("/internal/prefill", json={"request_id": rid, "prompt": prompt,
                                                                "sampling": {"max_tokens": 4}})
            assert reply.status_code == 200, reply.text
            # the request's own cache, not every cache the node holds (the first one is held too)
            assert reply.json()["held_bytes"] == len(engine.held[RequestId(rid)]) == len(prompt)
        for rid in ("first", "second"):
            await node.post(f"/internal/cancel/{rid}")


def test_the_ring_keeps_the_newest_records() -> None:
    log = HandoffLog("decode", capacity=2)
    for rid in ("a", "b", "c"):
        log.record(rid).wire_bytes = 1
    log.record("c").install_s = 0.5  # the open record, not a new one
    snapshot = log.snapshot()
    assert snapshot["total"] == 3
    assert [(r["request_id"], r["install_s"]) for r in snapshot["records"]] == [("b", None), ("c", 0.5)]


def test_declared_tensor_bytes_reads_the_end_frame() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from adapters.kv import codec, frames

    make_cache: Any = KVCache  # mlx-lm is untyped
    cache = make_cache()
    cache.update_and_fetch(mx.ones((1, 2, 7, 8)), mx.zeros((1, 2, 7, 8)))
    payload = b"".join(codec.encode_cache([cache], fingerprint="f", token_count=7))
    assert frames.declared_tensor_bytes(payload) == codec.raw_tensor_bytes([cache]) == 2 * 7 * 2 * 8 * 4
    assert frames.declared_tensor_bytes(payload[:-1]) is None
    assert frames.declared_tensor_bytes(b"FAKE") is None


async def test_a_pull_over_a_real_socket_records_the_same_fields(nursery: trio.Nursery) -> None:
    """No injected transport: the decode node pulls through kv_pull from a served prefill node."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from adapters.serve.listeners import listener_url, open_listener

    prefill_runner, prefill_app = _node("prefill", None, HandoffLog("prefill"))
    decode_log = HandoffLog("decode")
    peers = HttpxPeers(token=TOKEN, handoffs=decode_log)
    decode_runner, decode_app = _node("decode", peers, decode_log)
    await nursery.start(prefill_runner.run)
    await nursery.start(decode_runner.run)
    config = Config()
    listener = open_listener("127.0.0.1", 0)
    url = listener_url(listener)
    config.bind = [f"fd://{listener.detach()}"]
    config.accesslog = None
    stop = trio.Event()
    await nursery.start(lambda task_status: serve(prefill_app, config,  # type: ignore[arg-type]
                                                  shutdown_trigger=stop.wait, task_status=task_status))
    headers = {TOKEN_HEADER: TOKEN}
    try:
        async with (
            httpx.AsyncClient(base_url=url, headers=headers) as prefill,
            httpx.AsyncClient(transport=httpx.ASGITransport(app=decode_app), base_url="http://decode",
                              headers=headers) as decode,
        ):
            sampling = {"max_tokens": 4}
            reply = await prefill.post(
                "/internal/prefill", json={"request_id": "h2", "prompt": PROMPT, "sampling": sampling}
            )
            stream = await decode.post("/internal/decode", json={
                "request_id": "h2", "prompt": PROMPT, "sampling": sampling,
                "first_token": reply.json()["first_token"], "prefill_url": url,
            })
            assert stream.text.strip().splitlines()[-1] == '{"finish_reason":"length"}'
            [into] = (await decode.get("/internal/handoffs")).json()["records"]
            assert into["wire_bytes"] == len(b"FAKE") + len(PROMPT)
            assert 0 < into["first_byte_s"] <= into["transfer_s"] < 5 and into["install_s"] >= 0
            with pytest.raises(StatecoreError) as missing:
                await peers.fetch_kv(url, RequestId("nobody"))
            assert missing.value.info.code is Code.KV_NOT_FOUND
    finally:
        stop.set()
        await peers.aclose()
