"""The live view's feed on a runner with a fake engine: what a page is sent (the transitions a
request went through, counts, rates from the metrics), resuming after a reconnect, the stream
ending when the loop stops, and the static files (no address outside the node)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry, Counter
from starlette.applications import Starlette
from starlette.testclient import TestClient

from adapters.http import live_view
from adapters.http.live_view import LiveView, read_totals, sample_between
from adapters.metrics import Metrics
from effects.engine_port import SamplingParams
from effects.fakes import FakeEngine
from effects.interpret import EnginePerformer, local_backend
from effects.ports import GenerationRequest
from effects.runner import Instrument, NodeRunner
from statecore.events import DrainRequested
from statecore.ids import RequestId
from statecore.intents import Complete
from statecore.table import DECODE_REQUEST


class Node:
    def __init__(self) -> None:
        self.performer = EnginePerformer(FakeEngine())
        self.runner = NodeRunner(DECODE_REQUEST, self.performer, name="single")
        self.hooked: list[tuple[object, ...]] = []
        hooked = self.hooked

        class Earlier(Instrument):  # the logger's place: added before the view's
            def transition(self, *args: object) -> None:
                hooked.append(args[:3])

        self.runner.instruments.add(Earlier())
        self.metrics = Metrics("single")
        self.backend = local_backend(self.runner, self.performer)
        self.metrics.watch(self.runner)
        self.live = LiveView("single", self.runner, self.metrics.registry)

    async def generate(self, rid: str, max_tokens: int = 5) -> None:
        generation = await self.backend.start(
            GenerationRequest(RequestId(rid), (5, 6, 7), SamplingParams(max_tokens)))
        outputs = [out async for out in generation]
        assert isinstance(outputs[-1], Complete)


@pytest.fixture
async def node(nursery: trio.Nursery) -> AsyncIterator[Node]:
    built = Node()
    await nursery.start(built.runner.run)
    await nursery.start(built.live.run)
    yield built


async def _wait_for(predicate: Callable[[], object], what: str) -> None:
    with trio.move_on_after(30) as waited:
        while not predicate():
            await trio.sleep(0.01)
    assert not waited.cancelled_caught, f"no {what} within 30 s"


async def test_a_page_is_sent_each_phase_change_and_the_counts(node: Node) -> None:
    await node.generate("first")
    await _wait_for(lambda: node.live.message(after_transition=0, after_sample=0)["ended"], "the end")
    doc = node.live.message(after_transition=0, after_sample=0)
    path = [(t["source"], t["target"]) for t in doc["transitions"] if t["subject"] == "first"]
    assert path == [("intake", "prefilling_locally"), ("prefilling_locally", "installing"),
                    ("installing", "decoding"), ("decoding", "done")]
    assert {t["machine"] for t in doc["transitions"]} == {"request_decode"}
    assert doc["ended"] == {"done": 1} and doc["live"] == {} and doc["loop"] == "serving"
    # the hooks set before the view's still run
    assert ("first", "decoding", "done") in node.hooked
    # only what came after a sequence number is sent again
    last = doc["transitions"][-1]["seq"]
    assert node.live.message(after_transition=last, after_sample=0)["transitions"] == []


async def test_samples_are_rates_of_the_metrics(node: Node, autojump_clock: trio.testing.MockClock) -> None:
    await node.generate("counted", max_tokens=7)
    await _wait_for(lambda: node.live.samples, "a sample")
    first = node.live.samples[0]
    assert first.tokens_per_s == pytest.approx(7.0)  # seven tokens in the first one-second interval
    assert first.ttft_s is not None and first.kv_bytes_per_s == 0.0
    await _wait_for(lambda: len(node.live.samples) >= 2, "a second sample")
    assert node.live.samples[1].tokens_per_s == 0.0 and node.live.samples[1].ttft_s is None


def test_rates_between_two_readings() -> None:
    registry = CollectorRegistry()
    tokens = Counter("statecore:generation_tokens", "", ["role"], registry=registry)
    kv = Counter("statecore:kv_transfer_bytes", "", ["role", "direction"], registry=registry)
    before = read_totals(registry, "decode")
    tokens.labels("decode").inc(30)
    tokens.labels("router").inc(1000)  # another role's family is not this node's
    kv.labels("decode", "received").inc(4096)
    kv.labels("decode", "served").inc(1024)
    sample = sample_between(1, 0.0, before, read_totals(registry, "decode"), 2.0)
    assert (sample.tokens_per_s, sample.kv_bytes_per_s, sample.ttft_s) == (15.0, 2560.0, None)


async def test_the_stream_resumes_after_a_reconnect_and_ends_when_the_loop_stops(node: Node) -> None:
    await node.generate("before")
    await _wait_for(lambda: node.live.message(after_transition=0, after_sample=0)["ended"], "the end")
    seen = node.live.transitions[-1].seq
    assert node.live.resume_point(f"{node.live.boot}.{seen}.0") == (seen, 0)
    # an id from another process (a restarted node) or none at all: start from the beginning
    assert node.live.resume_point(f"other.{seen}.0") == (0, 0)
    assert node.live.resume_point(None) == (0, 0)
    assert node.live.resume_point("garbage") == (0, 0)

    stream = node.live._stream(seen, 0)
    assert await stream.__anext__() == b"retry: 2000\n\n"
    first = await stream.__anext__()
    event_id, data = first.decode().split("\n")[:2]
    assert event_id == f"id: {node.live.boot}.{seen}.0"
    assert json.loads(data.removeprefix("data: "))["transitions"] == []  # all seen already
    await node.runner.post_loop(DrainRequested())
    messages = [json.loads(m.decode().split("\n")[1].removeprefix("data: ")) async for m in stream]
    assert messages[-1]["closing"] is True  # ... and then the generator ended by itself
    assert messages[-1]["loop"] == "stopped"


def test_static_files_and_graph_are_served_from_the_node_alone() -> None:
    node = Node()
    client = TestClient(Starlette(routes=node.live.routes()))
    page = client.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for path, media in (("/ui/live.js", "text/javascript"), ("/ui/live.css", "text/css")):
        response = client.get(path)
        assert response.status_code == 200 and response.headers["content-type"].startswith(media)
        # no build, no CDN: nothing is fetched from anywhere but this node
        addresses = set(re.findall(r"https?://[^\s\"')]+", response.text + page.text))
        assert addresses <= {"http://www.w3.org/2000/svg"}, addresses
    graph = client.get("/ui/graph.json").json()
    assert graph["request_machine"] == "request_decode"
    assert [m["name"] for m in graph["machines"]] == ["request_decode", "role_loop"]
    assert client.get("/ui/nothing").status_code == 404


class _FailsOnce:
    """`read_totals`, raising on its second call only (a collector of the read series broken once;
    the first call is the reading at start)."""

    def __init__(self) -> None:
        self.calls = 0
        self.failed = False

    def __call__(self, registry: CollectorRegistry, role: str) -> Any:
        self.calls += 1
        if self.calls == 2:
            self.failed = True
            raise RuntimeError("a broken collector")
        return read_totals(registry, role)


async def test_a_failing_metrics_read_costs_a_point_not_the_node(
        nursery: trio.Nursery, autojump_clock: trio.testing.MockClock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node()
    await nursery.start(node.runner.run)
    broken = _FailsOnce()
    monkeypatch.setattr(live_view, "read_totals", broken)
    await nursery.start(node.live.run)  # its first reading, at start, works
    await _wait_for(lambda: node.live.samples, "a sample after the failed reading")
    assert broken.failed
    assert node.live.samples[0].seq == 1
    await node.generate("after")  # the node still serves
