"""Limits a client meets and a loss a cluster survives, on real processes: the request deadline
(504), the in-flight limit (429 with Retry-After), the fault flags' environment interlock, and a
router killed mid-stream (its nodes free everything and keep serving a new router).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from effects.faults import ENABLE_ENV
from support.tiny_models import cached_checkpoint
from tests.e2e.harness import ROOT, Node, assert_no_leaks, post, router, start_cluster, start_nodes

pytestmark = pytest.mark.e2e

GOOD = {"prompt": "The harbour lights came on one by one.", "max_tokens": 8, "temperature": 0}
SLOW_PREFILL = {"x-request-id": "inject-fault-slow-prefill-1"}


def _single(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> Node:
    monkeypatch.setenv(ENABLE_ENV, "1")  # the node's fault flags arm only with it; undone after the test
    node = Node("single", ["--model", str(cached_checkpoint("llama")), *args], tmp_path / "single.log")
    start_nodes([node])
    return node


def _wait_for(condition: Any, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_request_past_its_deadline_gets_504_and_frees_everything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = _single(tmp_path, monkeypatch, "--request-deadline", "1", "--inject-fault", "prefill:slow=5")
    try:
        started = time.monotonic()
        r = httpx.post(f"{node.url}/v1/completions", json=GOOD, headers=SLOW_PREFILL, timeout=30)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "timeout"
        assert time.monotonic() - started < 4  # the deadline, not the end of the stall
        assert_no_leaks([node])
        assert post(node, "/v1/completions", GOOD).status_code == 200
        assert node.stats()["bugs"] == 0
        assert node.stop() == 0
    finally:
        node.stop()


def test_the_in_flight_limit_answers_429_with_retry_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = _single(tmp_path, monkeypatch, "--max-in-flight", "1", "--inject-fault", "prefill:slow=2")
    try:
        first: list[httpx.Response] = []
        slow = threading.Thread(target=lambda: first.append(httpx.post(
            f"{node.url}/v1/completions", json=GOOD, headers=SLOW_PREFILL, timeout=30)))
        slow.start()
        _wait_for(lambda: node.stats()["live_requests"] == 1, "the slow request to be admitted")
        second = httpx.post(f"{node.url}/v1/completions", json=GOOD, timeout=30)
        assert second.status_code == 429, second.text
        assert second.json()["error"]["code"] == "overloaded"
        assert int(second.headers["retry-after"]) >= 1
        slow.join()
        assert first[0].status_code == 200  # the admitted one was never disturbed
        assert_no_leaks([node])
        assert node.stop() == 0
    finally:
        node.stop()


def test_fault_flags_refuse_to_arm_without_the_environment_switch(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != ENABLE_ENV}
    peers = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]
    started: dict[str, subprocess.Popen[bytes]] = {}
    for role in ("single", "router"):  # side by side: each is refused before it loads anything
        extra = peers if role == "router" else []
        started[role] = subprocess.Popen(
            [sys.executable, "-m", "adapters.cli", "run", "--role", role, "--model",
             str(cached_checkpoint("llama")), "--port", "0", *extra, "--inject-fault", "prefill"],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
    for role, process in started.items():
        output, _ = process.communicate(timeout=120)
        said = output.decode()
        assert process.returncode != 0 and f"needs {ENABLE_ENV}=1" in said, (role, process.returncode, said)
        assert "Traceback" not in said


def test_a_router_killed_mid_stream_leaves_its_nodes_clean_and_serving(tmp_path: Path) -> None:
    model = cached_checkpoint("llama")
    cluster = start_cluster(model, tmp_path / "logs", prefills=1, decodes=1)
    second: Node | None = None
    try:
        body = {**GOOD, "max_tokens": 2500, "stream": True}
        lines: list[str] = []

        def stream() -> None:
            try:
                with httpx.stream("POST", f"{cluster.router.url}/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        lines.append(line)
            except httpx.HTTPError:
                pass  # the router is gone: exactly what this test does

        client = threading.Thread(target=stream)
        client.start()
        decode = cluster.decode[0]
        _wait_for(lambda: decode.stats()["decoding"] == 1, "the request to decode")
        assert cluster.router.process is not None
        cluster.router.process.send_signal(signal.SIGKILL)
        cluster.router.process.wait(timeout=10)
        client.join(timeout=30)
        assert_no_leaks([*cluster.prefill, decode], timeout_s=15)  # the broken stream cancelled it
        for node in (*cluster.prefill, decode):
            assert httpx.get(f"{node.url}/health", timeout=5).status_code == 200
        second = router(model, tmp_path / "logs" / "router2.log", cluster.prefill, cluster.decode,
                        "--force-disaggregation")
        start_nodes([second])
        assert post(second, "/v1/completions", GOOD).status_code == 200
        assert cluster.prefill[0].stats()["bugs"] == 0 and decode.stats()["bugs"] == 0
    finally:
        if second is not None:
            second.stop()
        cluster.stop()
