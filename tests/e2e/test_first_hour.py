"""The first hour on a clean clone (issue 36), end to end: `statecore run` with its inner nodes on
chosen ports, a greeting answered with text, a tool call's shape, one log line per request on
the router and none per transition, and Ctrl-C's one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from adapters.serve.listeners import free_port
from tests.e2e.harness import ROOT

pytestmark = pytest.mark.e2e

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_newcomers_cluster(tmp_path: Path) -> None:
    port, prefill_port, decode_port = free_port(), free_port(), free_port()
    log = tmp_path / "cluster.log"
    with log.open("wb") as out:
        parent = subprocess.Popen(
            [sys.executable, "-m", "adapters.cli", "run", "--port", str(port), "--prefill-port",
             str(prefill_port), "--decode-port", str(decode_port)],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while "cluster ready" not in log.read_text():
            assert parent.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        banner = log.read_text()
        assert f"prefill http://127.0.0.1:{prefill_port}" in banner, banner
        assert f"decode http://127.0.0.1:{decode_port}" in banner, banner

        hi = httpx.post(f"{url}/v1/chat/completions", timeout=60, headers={"X-Request-Id": "first-hi"},
                        json={"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 16})
        assert hi.status_code == 200, hi.text
        assert hi.json()["choices"][0]["message"]["content"].strip(), hi.text

        tool = httpx.post(f"{url}/v1/chat/completions", timeout=60, headers={"X-Request-Id": "first-tool"},
                          json={"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                                "tools": [WEATHER], "temperature": 0})
        choice = tool.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", tool.text
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert list(json.loads(call["function"]["arguments"])) == ["city"]

        # The router logs a request's line after its answer has left: wait for both lines so that
        # none of them is taken for a word of the shutdown below.
        text = wait_for_log(log, ["first-hi", "first-tool"], parent)
        about_hi = [line for line in text.splitlines() if "first-hi" in line]
        assert len(about_hi) == 1 and "POST /v1/chat/completions 200" in about_hi[0], about_hi
        assert " -> " not in text.split("cluster ready", 1)[1], "transitions are DEBUG lines"

        before = len(log.read_text())
        parent.send_signal(signal.SIGINT)
        assert parent.wait(timeout=60) == 0, log.read_text()[-3000:]
        after = log.read_text()[before:].strip().splitlines()
        assert after == ["statecore: stopped on SIGINT: every node drained and stopped cleanly"], after
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def wait_for_log(log: Path, request_ids: list[str], parent: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + 30
    while True:
        text = log.read_text()
        if all(f"request {request_id}" in text for request_id in request_ids):
            return text
        assert parent.poll() is None and time.monotonic() < deadline, text[-3000:]
        time.sleep(0.1)
