"""Losing a decode node mid-stream, getting it back, and draining on SIGTERM."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from effects.faults import ENABLE_ENV
from support.tiny_models import cached_checkpoint
from tests.e2e.harness import Node, assert_no_leaks, post, start_cluster, start_nodes

pytestmark = pytest.mark.e2e

LONG = {"prompt": "Write a very long story about the sea.", "max_tokens": 2500, "temperature": 0}


def _wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_killing_a_decode_node_fails_its_request_only_and_it_comes_back(tmp_path: Path) -> None:
    cluster = start_cluster(cached_checkpoint("llama"), tmp_path / "logs", prefills=1, decodes=2)
    try:
        def peers() -> dict[str, str]:
            phases: dict[str, str] = cluster.router.stats()["peers"]
            return phases

        events: list[Any] = []
        started = time.monotonic()
        victim: Node | None = None
        with httpx.stream("POST", f"{cluster.router.url}/v1/completions", json={**LONG, "stream": True},
                          timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                if victim is None and len(events) == 5:
                    victim = next(n for n in cluster.decode if n.stats()["decoding"] == 1)
                    assert victim.process is not None
                    victim.process.send_signal(signal.SIGKILL)
                    killed = time.monotonic()
        assert victim is not None
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
        assert time.monotonic() - killed < 30
        assert time.monotonic() - started < 60
        _wait_for(lambda: peers()[victim.url] == "down", 15, "the router to mark the node down")
        survivor = next(n for n in cluster.decode if n is not victim)
        for i in range(6):
            r = post(cluster.router, "/v1/completions", {"prompt": f"Request {i}", "max_tokens": 5})
            assert r.status_code == 200, r.text
        assert survivor.stats()["outcomes"].get("done", 0) >= 6
        victim.process = None
        victim.start()
        victim.wait_healthy()
        _wait_for(lambda: peers()[victim.url] == "up", 20, "the router to mark the node up again")
        assert_no_leaks([cluster.router, *cluster.prefill, *cluster.decode])
    finally:
        cluster.stop()


def test_sigterm_during_a_long_request_finishes_it_and_exits_zero(tmp_path: Path) -> None:
    node = Node("single", ["--model", str(cached_checkpoint("llama"))], tmp_path / "single.log")
    start_nodes([node])
    result: dict[str, Any] = {}

    def client() -> None:
        result["response"] = post(node, "/v1/completions", LONG, timeout=120)

    thread = threading.Thread(target=client)
    thread.start()
    _wait_for(lambda: node.stats()["decoding"] == 1, 30, "the request to start decoding")
    assert node.process is not None
    node.process.send_signal(signal.SIGTERM)
    _wait_for(lambda: httpx.get(f"{node.url}/health", timeout=2).status_code == 503, 5,
              "health to go non-200 while draining")
    refused = post(node, "/v1/completions", {"prompt": "late", "max_tokens": 3})
    assert refused.status_code == 503 and refused.headers.get("retry-after")
    thread.join(timeout=120)
    response = result["response"]
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == LONG["max_tokens"]
    assert node.process.wait(timeout=30) == 0


def test_a_dead_device_thread_is_transport_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine thread dying ends the loop: health goes non-200 at once, exit code 3."""
    monkeypatch.setenv(ENABLE_ENV, "1")
    node = Node("single", ["--model", str(cached_checkpoint("llama")), "--inject-fault", "device_crash"],
                tmp_path / "single.log")
    start_nodes([node])
    r = httpx.post(f"{node.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30,
                   headers={"x-request-id": "inject-fault-device_crash-1"})
    assert r.status_code >= 500 and r.json()["error"]["code"] in {"engine_failed", "transport_lost"}
    assert node.process is not None
    assert node.process.wait(timeout=30) == 3
    assert "transport" in node.log.read_text().lower()


def test_a_dead_prefill_node_is_retried_around_before_the_first_token(tmp_path: Path) -> None:
    """Requests sent right after a prefill node dies (before any probe notices) still succeed:
    the router retries on the other prefill node, invisibly to the client."""
    cluster = start_cluster(cached_checkpoint("llama"), tmp_path / "logs", prefills=2, decodes=1)
    try:
        dead = cluster.prefill[0]
        assert dead.process is not None
        dead.process.send_signal(signal.SIGKILL)
        dead.process.wait()
        bodies = [{"prompt": f"Failover {i}", "max_tokens": 6, "temperature": 0} for i in range(6)]
        for body in bodies:
            routed = post(cluster.router, "/v1/completions", body)
            assert routed.status_code == 200, routed.text
            single = post(cluster.single, "/v1/completions", body)
            assert routed.json()["choices"] == single.json()["choices"]
        assert cluster.prefill[1].stats()["outcomes"].get("done", 0) == len(bodies)
        assert "-> routed on retry" in cluster.router.log.read_text()  # the retry path was taken
        assert_no_leaks([cluster.router, cluster.prefill[1], *cluster.decode])
    finally:
        cluster.stop()


def test_a_hung_engine_is_caught_by_the_watchdog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model call never returns: after --stall-timeout the node fails its requests with a
    typed error, says why in /health and its log, and exits 3 (for its supervisor to restart)."""
    monkeypatch.setenv(ENABLE_ENV, "1")
    node = Node("single", ["--model", str(cached_checkpoint("llama")), "--stall-timeout", "1",
                           "--inject-fault", "decode_call_hang"], tmp_path / "single.log")
    start_nodes([node])
    try:
        healths: list[httpx.Response] = []

        def watch_health() -> None:
            while node.process is not None and node.process.poll() is None:
                with contextlib.suppress(httpx.HTTPError):
                    healths.append(httpx.get(f"{node.url}/health", timeout=2))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch_health)
        watcher.start()
        started = time.monotonic()
        r = httpx.post(f"{node.url}/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=60,
                       headers={"x-request-id": "inject-fault-decode_call_hang-1"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "transport_lost", r.text
        assert "no progress" in r.json()["error"]["message"]
        assert node.process is not None
        assert node.process.wait(timeout=30) == 3
        assert time.monotonic() - started < 30
        watcher.join()
        assert healths and healths[0].status_code == 200  # healthy while it worked
        stalled = [h.json() for h in healths if h.status_code == 503]
        assert not stalled or "no progress" in stalled[-1]["reason"], stalled  # it may exit first
        assert "made no progress" in node.log.read_text()
    finally:
        if node.process is not None and node.process.poll() is None:
            node.process.kill()  # a hung node never stops by itself


def test_kv_memory_admission_answers_429_then_400_never_an_oom(tmp_path: Path) -> None:
    """--kv-memory-bytes 2000000 on the tiny llama (512 bytes of KV per position, too little for a
    slot layout): a request of 4 + 3000 tokens reserves 512 x (3004 + 256) bytes, so a second one
    while it decodes gets 429 with Retry-After; one of 4 + 3800 tokens could never fit: 400."""
    node = Node("single", ["--model", str(cached_checkpoint("llama")), "--kv-memory-bytes", "2000000"],
                tmp_path / "single.log")
    start_nodes([node])
    try:
        url = f"{node.url}/v1/completions"
        body = {"prompt": "The tide", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
        never = httpx.post(url, json={**body, "max_tokens": 3800}, timeout=30)
        assert never.status_code == 400, never.text
        assert never.json()["error"]["code"] == "kv_memory_exceeded"
        assert "--kv-memory-bytes" in never.json()["error"]["message"]
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # it is decoding now
            second = httpx.post(url, json=body, timeout=30)
            assert second.status_code == 429, second.text
            assert second.json()["error"]["code"] == "overloaded" and second.headers["retry-after"]
            assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
        assert_no_leaks([node])
        stats = node.stats()
        assert stats["kv_reserved_bytes"] == 0
        # --kv-memory-bytes given: the prefill memory cap is on (auto), and these short prompts'
        # estimated activations fit beside the KV reserved
        assert stats["activation_overruns"] == 0 and stats["activation_estimate_peak_bytes"] > 0
        metrics = httpx.get(f"{node.url}/metrics", timeout=10).text
        assert "statecore:engine_activation_overruns_total" in metrics
        again = httpx.post(url, json={**body, "max_tokens": 8}, timeout=60)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 8
        assert node.stop() == 0
    finally:
        node.stop()
