"""What a person reads in a node's log and scrapes from its `/metrics` (issue 36): one INFO line
per public API request when it ends, one per refusal with its code, the transitions at DEBUG
(INFO with `--log-transitions`); no `_created` series, vLLM's names beside ours, and a role's
families only where it can move them.

A single node in-process: the front end over the demo model's tokenizer, a real runner and the
fake engine, both wrapped as `statecore run` wraps them (`Metrics`, `RequestLines`)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from adapters.frontend.app import build_app
from adapters.frontend.frontend import Frontend
from adapters.metrics import Metrics
from adapters.serve.flags import demo_model_dir
from adapters.serve.logs import RequestLines, log_transitions
from effects.fakes import FakeEngine
from effects.interpret import EnginePerformer, local_backend
from effects.runner import NodeRunner, Timeouts
from statecore.table import DECODE_REQUEST

CHAT = "/v1/chat/completions"
MODEL = FakeEngine().info.name


@dataclass
class SingleNode:
    client: httpx.AsyncClient
    metrics: Metrics
    runner: NodeRunner[Any]


def build(every_transition: bool = False) -> tuple[Starlette, Metrics, NodeRunner[Any]]:
    metrics = Metrics("single", model_name=MODEL)
    engine = FakeEngine()
    performer = EnginePerformer(engine)
    runner: NodeRunner[Any] = NodeRunner(DECODE_REQUEST, performer,
                                            timeouts=Timeouts(deadline_s=10.0), name="single")
    log_transitions(runner, "single", every=every_transition)
    metrics.watch(runner, engine=engine, handoffs=performer.handoffs)
    lines = RequestLines()
    lines.watch(runner)
    frontend = Frontend.load(demo_model_dir(), local_backend(runner, performer))
    app = build_app(frontend, extra_routes=[metrics.route()])
    lines.instrument(app)
    return app, metrics, runner


async def serving(nursery: trio.Nursery, every_transition: bool = False) -> AsyncIterator[SingleNode]:
    app, metrics, runner = build(every_transition)
    await nursery.start(runner.run)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://node", timeout=30.0) as client:
        yield SingleNode(client, metrics, runner)


@pytest.fixture
async def node(nursery: trio.Nursery) -> AsyncIterator[SingleNode]:
    async for built in serving(nursery):
        yield built


def info_lines(caplog: pytest.LogCaptureFixture, request_id: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.INFO and r.name.startswith("statecore") and request_id in r.getMessage()]


def chat(content: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": content}], **extra}


async def test_a_request_is_one_info_line_when_it_ends(node: SingleNode,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="statecore")
    for stream in (False, True):
        rid = f"line-{int(stream)}"
        reply = await node.client.post(CHAT, json=chat("Hi", stream=stream), headers={"X-Request-Id": rid})
        assert reply.status_code == 200
        (line,) = info_lines(caplog, rid)
        assert line.startswith(f"POST {CHAT} 200 in ") and f"request {rid}" in line, line
        assert "5 completion tokens" in line and "finish length" in line and "first token" in line, line
        if not stream:
            assert f"{reply.json()['usage']['prompt_tokens']} prompt + 5 completion tokens" in line, line
        # its transitions were logged, at DEBUG
        moves = [r for r in caplog.records
                 if r.levelno == logging.DEBUG and f"request {rid} " in r.getMessage()]
        assert moves, "the transitions are DEBUG lines"


JSON = {"content-type": "application/json"}
HI = f'{{"model": "{MODEL}", "max_tokens": 2, "messages": [{{"role": "user", "content": "Hi"}}]}}'.encode()


@pytest.mark.parametrize(("body", "headers", "status", "code"), [
    (b'{"max_tokens": 0, "messages": []}', JSON, 400, "invalid_request"),
    (b"{not json", JSON, 400, "invalid_json"),
    (HI, {"content-type": "text/plain"}, 415, "unsupported_media_type"),
    (b'{"messages": [{"role": "user", "content": ""}]}', JSON, 400, "invalid_request"),
    (HI.replace(MODEL.encode(), b"other"), JSON, 404, "model_not_found"),
])
async def test_a_refusal_is_one_info_line_with_its_code(node: SingleNode, caplog: pytest.LogCaptureFixture,
                                                        body: bytes, headers: dict[str, str], status: int,
                                                        code: str) -> None:
    caplog.set_level(logging.INFO, logger="statecore")
    rid = f"refused-{code}"
    reply = await node.client.post(CHAT, content=body, headers={**headers, "X-Request-Id": rid})
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["code"] == code
    (line,) = info_lines(caplog, rid)
    assert line.startswith(f"POST {CHAT} {status} in ") and f"refused: {code}: " in line, line


async def test_a_json_body_labelled_with_a_charset_or_curls_default_is_read(node: SingleNode) -> None:
    body = HI
    for label in ("application/json; charset=utf-8", "application/x-www-form-urlencoded", None):
        headers = {"content-type": label} if label else {}
        assert (await node.client.post(CHAT, content=body, headers=headers)).status_code == 200, label


async def test_log_transitions_puts_them_at_info(nursery: trio.Nursery,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="statecore")
    async for built in serving(nursery, every_transition=True):
        reply = await built.client.post(CHAT, json=chat("Hi"), headers={"X-Request-Id": "every"})
        assert reply.status_code == 200
        lines = info_lines(caplog, "every")
        assert any(" -> done on " in line for line in lines), lines
        assert sum(line.startswith("POST ") for line in lines) == 1, lines


async def test_metrics_have_no_created_series_and_vllms_names(node: SingleNode) -> None:
    assert (await node.client.post(CHAT, json=chat("Hi"))).status_code == 200
    text = (await node.client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {s.name: s for f in families.values() for s in f.samples}
    assert not [name for name in samples if name.endswith("_created")]
    aliases = [("time_to_first_token_seconds_count", "time_to_first_token_seconds_count"),
               ("inter_token_latency_seconds_count", "inter_token_latency_seconds_count"),
               ("inter_token_latency_seconds_count", "time_per_output_token_seconds_count"),
               ("e2e_request_latency_seconds_count", "e2e_request_latency_seconds_count"),
               ("prompt_tokens_total", "prompt_tokens_total"),
               ("generation_tokens_total", "generation_tokens_total"),
               ("num_requests_running", "num_requests_running")]
    for ours, theirs in ((f"statecore:{a}", f"vllm:{b}") for a, b in aliases):
        assert samples[theirs].value == samples[ours].value > 0 or ours.endswith("running"), (ours, theirs)
        assert samples[theirs].labels == {"model_name": MODEL}, samples[theirs].labels
    done = [s for s in families["vllm:request_success"].samples if s.labels["finished_reason"] == "length"]
    assert done[0].value == 1
    assert "vllm:num_requests_waiting" in samples
    # a single node hands nothing off: no KV transfer series
    assert not [name for name in samples if "kv_transfer" in name or "kv_lease_expired" in name]


@pytest.mark.parametrize(("role", "present", "absent"), [
    ("router", {"statecore:inter_token_latency_seconds"},
     {"statecore:kv_transfer_bytes", "statecore:kv_transfer_seconds", "statecore:prompt_tokens_by_source"}),
    ("prefill", {"statecore:kv_transfer_bytes", "statecore:kv_lease_expired"},
     {"statecore:inter_token_latency_seconds", "statecore:kv_transfer_seconds"}),
    ("decode", {"statecore:kv_transfer_bytes", "statecore:kv_transfer_seconds"},
     {"statecore:kv_lease_expired"}),
])
def test_a_role_exports_only_what_it_can_move(role: str, present: set[str], absent: set[str]) -> None:
    names = {metric.name for metric in Metrics(role).registry.collect()}
    assert present <= names and not absent & names, names
    directions = {s.labels["direction"] for m in Metrics(role).registry.collect() for s in m.samples
                  if m.name == "statecore:kv_transfer_bytes"}
    assert directions <= {"prefill": {"served"}, "decode": {"received", "served"}}.get(role, set())

