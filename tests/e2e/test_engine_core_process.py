"""A single node whose engine core runs in its own process (`--engine-core process`): it answers
batched as it does one request at a time (greedy and seeded; that the process core answers as the
thread core, and moves KV both ways, is tests/integration/test_engine_core_process.py's), and when
its core process is killed mid-stream the stream ends with a typed error and the node exits 3, as
it does when its device thread dies.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.tiny_models import cached_checkpoint
from tests.e2e.harness import Node, start_nodes, stream_killing_a_rank

pytestmark = pytest.mark.e2e

PROCESS = ("--engine-core", "process")
BODIES = [
    {"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0},
    {"prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0},
    {"prompt": "Once upon a time there was", "max_tokens": 16, "temperature": 0.9, "seed": 7},
]


def answers(node: Node, *, together: bool) -> list[Any]:
    def one(body: dict[str, Any]) -> Any:
        r = httpx.post(f"{node.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"]

    if not together:
        return [one(body) for body in BODIES]
    with ThreadPoolExecutor(len(BODIES)) as pool:  # decoded in one batch
        return list(pool.map(one, BODIES))


def core_pid(node: Node) -> int:
    found = re.search(r"started the engine core process \(pid (\d+)\)", node.log.read_text())
    assert found, node.tail()
    return int(found.group(1))


def test_a_process_core_serves_and_its_death_ends_the_node_typed(tmp_path: Path) -> None:
    model = cached_checkpoint("llama")
    node = Node("single", ["--model", str(model), *PROCESS, "--stall-timeout", "5"], tmp_path / "node.log")
    start_nodes([node])
    try:
        assert answers(node, together=True) == answers(node, together=False)
        events, took = stream_killing_a_rank(node, core_pid(node))
        assert took < 30
        assert "error" in events[-1], events[-1]
        assert events[-1]["error"]["code"] in {"engine_failed", "transport_lost"}, events[-1]
        assert node.process is not None and node.process.wait(timeout=30) == 3
        assert "transport is lost" in node.log.read_text()
    finally:
        if node.process is not None and node.process.poll() is None:
            node.process.kill()
