"""Metrics, one instrument of a real runner over a fake engine: token counts and timings,
requests by terminal state and reason, prompt sources, another instrument beside it, KV bytes
served, and `/metrics` itself."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from adapters.http.node_api import NodeApi
from adapters.metrics import Metrics
from effects.engine_port import SamplingParams
from effects.fakes import FakeEngine, Faults
from effects.handoffs import HandoffLog
from effects.interpret import EnginePerformer, NodeRequest, local_backend
from effects.ports import Backend, GenerationRequest, Output
from effects.runner import Instrument, NodeRunner, Timeouts
from statecore.errors import ErrorInfo
from statecore.ids import RequestId
from statecore.intents import Complete, Reject, RespondTokens, StartDecode
from statecore.table import DECODE_REQUEST, PREFILL_REQUEST

MARKER = 999


async def settled(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll until `condition` holds: both requests' ends are counted as their loops finish."""
    with trio.fail_after(timeout_s):
        while not condition():
            await trio.sleep(0.01)


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, {"role": metrics.role, **labels})
    return value or 0.0


class Node:
    def __init__(self, role: str) -> None:
        self.metrics = Metrics(role)
        self.engine = FakeEngine(Faults(marker=MARKER, fail={"prefill"}))
        performer = EnginePerformer(self.engine)
        self.runner = NodeRunner(DECODE_REQUEST, performer, timeouts=Timeouts(deadline_s=5.0), name=role)
        self.logged: list[tuple[str, str, str | None]] = []
        logged = self.logged

        class Log(Instrument):
            def transition(self, request_id: RequestId, old: str, new: str, event: str,
                           error: ErrorInfo | None, outcome: str | None, context: object) -> None:
                logged.append((old, new, error.code.value if error else None))

        self.runner.instruments.add(Log())
        self.metrics.watch(self.runner, engine=self.engine, handoffs=performer.handoffs)
        self.backend: Backend = local_backend(self.runner, performer)
        self.count = 0

    async def generate(self, prompt: list[int], max_tokens: int) -> list[Output]:
        self.count += 1
        request = GenerationRequest(RequestId(f"r{self.count}"), tuple(prompt), SamplingParams(max_tokens))
        generation = await self.backend.start(request)
        return [out async for out in generation]


@pytest.fixture(params=["single", "decode"])
async def node(request: pytest.FixtureRequest, nursery: trio.Nursery) -> AsyncIterator[Node]:
    built = Node(request.param)
    await nursery.start(built.runner.run)
    yield built


async def test_tokens_timings_and_outcomes_are_counted(node: Node) -> None:
    outputs = await node.generate([3, 4, 5], max_tokens=5)
    assert isinstance(outputs[-1], Complete)
    assert sum(isinstance(o, RespondTokens) for o in outputs) == 5
    failed = await node.generate([3, MARKER], max_tokens=5)
    assert isinstance(failed[-1], Reject)
    m = node.metrics
    await settled(lambda: sample(m, "statecore:e2e_request_latency_seconds_count") == 2)
    assert sample(m, "statecore:generation_tokens_total") == 5
    assert sample(m, "statecore:time_to_first_token_seconds_count") == 1
    assert sample(m, "statecore:inter_token_latency_seconds_count") == 4
    assert sample(m, "statecore:e2e_request_latency_seconds_count") == 2
    assert sample(m, "statecore:prompt_tokens_by_source_total", source="computed_locally") == 3
    assert sample(m, "statecore:prompt_tokens_by_source_total", source="transferred") == 0
    assert sample(m, "statecore:requests_total", state="done", reason="length") == 1
    failure = node.logged[-1]
    assert failure[1] == "failed" and failure[2] is not None  # the logger still sees the reason
    assert sample(m, "statecore:requests_total", state="failed", reason=failure[2]) == 1
    assert sample(m, "statecore:num_requests_running") == 0
    assert sample(m, "statecore:kv_held_bytes") == 0
    assert sample(m, "statecore:loop_ready") == 1


async def test_a_cancellation_and_a_stop_are_not_failures(node: Node) -> None:
    request = GenerationRequest(RequestId("gone"), (3, 4, 5), SamplingParams(10_000))
    cancelled = await node.backend.start(request)
    stopped = await node.backend.start(
        GenerationRequest(RequestId("stop"), (3, 4, 6), SamplingParams(10_000)))
    async for _ in cancelled:
        await cancelled.cancel()
        break
    async for _ in stopped:
        await stopped.stop()
        break
    m = node.metrics
    await settled(lambda: sum(sample(m, "statecore:requests_total", state=state, reason=reason)
                              for state, reason in (("cancelled", "cancelled"), ("done", "stop"))) == 2)
    assert sample(m, "statecore:requests_total", state="cancelled", reason="cancelled") == 1
    assert sample(m, "statecore:requests_total", state="done", reason="stop") == 1
    assert not [entry for entry in node.logged if entry[1] == "failed"]


async def test_prompt_tokens_are_counted_once_per_node(node: Node) -> None:
    await node.generate([3, 4, 5, 6], max_tokens=2)
    assert sample(node.metrics, "statecore:prompt_tokens_total") == 4


async def test_kv_bytes_served_and_the_metrics_route(nursery: trio.Nursery) -> None:
    """A prefill node's node API tells the metrics each pulled payload it sent (a refused pull
    sends none), and `/metrics` shows it."""
    metrics = Metrics("prefill")
    engine = FakeEngine()
    performer = EnginePerformer(engine)
    runner: NodeRunner[Any] = NodeRunner(PREFILL_REQUEST, performer, timeouts=Timeouts(deadline_s=5.0))
    api = NodeApi("prefill", engine, runner, performer, kv_served=metrics.kv_served)
    app = Starlette(routes=[*api.routes(), metrics.route()])
    await nursery.start(runner.run)
    prompt = list(range(1, 41))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as client:
        held = await client.post("/internal/prefill", json={"request_id": "a", "prompt": prompt,
                                                            "sampling": {"max_tokens": 4}})
        assert held.status_code == 200, held.text
        pulled = await client.get("/internal/kv/a")
        assert pulled.status_code == 200 and len(pulled.content) == len(b"FAKE") + len(prompt)
        assert (await client.get("/internal/kv/nobody")).status_code == 404
        response = await client.get("/metrics")
    assert response.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    served = [s.value for s in families["statecore:kv_transfer_bytes"].samples
              if s.labels.get("direction") == "served" and s.name.endswith("_total")]
    assert served == [float(len(pulled.content))]


async def test_kv_bytes_of_a_prefix_pulled_from_a_node_are_served(nursery: trio.Nursery) -> None:
    """A node's `/internal/prefix_kv` answer (kept prefix blocks another node pulls) counts as
    KV served, as a pulled payload does; an answer of none counts nothing."""
    metrics = Metrics("decode")
    engine = FakeEngine()
    engine.prefixes.add(tuple(range(1, 17)))
    performer = EnginePerformer(engine)
    runner: NodeRunner[Any] = NodeRunner(DECODE_REQUEST, performer, timeouts=Timeouts(deadline_s=5.0))
    api = NodeApi("decode", engine, runner, performer, kv_served=metrics.kv_served)
    app = Starlette(routes=api.routes())
    await nursery.start(runner.run)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as client:
        missed = await client.post("/internal/prefix_kv", json={"tokens": [7, 8, 9]})
        assert missed.status_code == 404
        assert sample(metrics, "statecore:kv_transfer_bytes_total", direction="served") == 0
        pulled = await client.post("/internal/prefix_kv", json={"tokens": list(range(1, 41))})
    assert pulled.status_code == 200 and len(pulled.content) == len(b"FAKP") + 4 * 16
    assert sample(metrics, "statecore:kv_transfer_bytes_total", direction="served") == len(pulled.content)


def test_a_handoff_is_observed_from_its_record_and_no_record_is_opened_for_it() -> None:
    """A decode node's handoff metrics read the handoff's record as its work ends; a request
    whose record the ring no longer holds (or never held) is not observed, and reading it opens
    no record: `GET /internal/handoffs` counts only the handoffs that happened."""
    metrics = Metrics("decode")
    engine = FakeEngine()
    log = HandoffLog("decode", capacity=1)
    performer = EnginePerformer(engine, handoffs=log)
    runner: NodeRunner[Any] = NodeRunner(DECODE_REQUEST, performer, timeouts=Timeouts(deadline_s=5.0))
    metrics.watch(runner, engine=engine, handoffs=log)
    pulled = NodeRequest((1, 2, 3), SamplingParams(4), prefill_url="http://prefill")
    name = "statecore:kv_first_to_second_token_seconds_count"

    log.record("held").first_to_second_s = 0.25
    metrics.work_ended(StartDecode(RequestId("held")), pulled, None)
    assert sample(metrics, name, transport="pull") == 1

    metrics.work_ended(StartDecode(RequestId("gone")), pulled, None)
    assert sample(metrics, name, transport="pull") == 1
    assert log.total == 1
    assert [r["request_id"] for r in log.snapshot()["records"]] == ["held"]
