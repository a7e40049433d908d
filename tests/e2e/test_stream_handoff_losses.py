"""A streamed handoff that loses its prefill node, over each transport (shared memory between
nodes of one host, HTTP): the request fails alone with a typed error, the decode node frees the
pieces it kept, the other prefill node takes the next requests, and nothing is left in /dev/shm."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from effects.faults import ENABLE_ENV
from support.tiny_models import cached_checkpoint
from tests.e2e.harness import Node, assert_no_leaks, post, start_cluster

pytestmark = pytest.mark.e2e

BODY = {"prompt": "The harbour lights came on one by one over the water.", "max_tokens": 12,
        "temperature": 0, "stream": True}
# the prefill node waits 30 s between its last piece (and the first token) and the stream's end
SLOW_END = ("--inject-fault", "kv_encode:slow=30")


def _shm_regions(pid: int) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"statecore-kv-{pid}-*")]


@pytest.mark.parametrize("transport", ["shm", "http"])
def test_a_prefill_node_lost_mid_stream_fails_that_request_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    monkeypatch.setenv(ENABLE_ENV, "1")
    cluster = start_cluster(cached_checkpoint("llama"), tmp_path / "logs", prefills=2, decodes=1,
                            node_args=("--kv-transport", transport, *SLOW_END))
    pids: list[int] = []
    try:
        events: list[Any] = []
        victim: Node | None = None
        with httpx.stream("POST", f"{cluster.router.url}/v1/completions", json=BODY, timeout=60,
                          headers={"x-request-id": "inject-fault-slow-kv_encode-lost"}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                if victim is None and len(events) == 1:
                    # the first token came through the decode node: the pieces are in, the
                    # stream's end is not; lose the prefill node that streams them
                    victim = next(node for node in cluster.prefill if node.stats()["live_requests"] == 1)
                    assert cluster.decode[0].stats()["kv_arriving"] == 1
                    assert victim.process is not None
                    pid = victim.process.pid
                    if transport == "shm":
                        assert _shm_regions(pid), "the pieces went through shared memory"
                    victim.process.send_signal(signal.SIGKILL)
        assert victim is not None
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
        assert events[-2]["error"]["code"] == "transport_lost", events[-2]
        decode = cluster.decode[0]
        assert_no_leaks([cluster.router, decode])  # the kept pieces went with the request
        assert decode.stats()["device_thread_alive"] and decode.stats()["bugs"] == 0
        survivor = next(node for node in cluster.prefill if node is not victim)
        for i in range(3):  # the router goes around the dead node (retrying before a first token)
            r = post(cluster.router, "/v1/completions", {"prompt": f"After the loss {i}", "max_tokens": 4})
            assert r.status_code == 200, r.text
        assert survivor.stats()["outcomes"].get("done", 0) >= 3
        # a node started after the loss sweeps the killed node's orphaned regions
        victim.process = None
        victim.start()
        victim.wait_healthy()
        pids = [node.process.pid for node in cluster.prefill if node.process is not None]
        deadline = time.monotonic() + 10
        while _shm_regions(pid):
            assert time.monotonic() < deadline, _shm_regions(pid)
            time.sleep(0.05)
    finally:
        cluster.stop()
    assert not [name for p in pids for name in _shm_regions(p)], "a stopped node left shared memory"
