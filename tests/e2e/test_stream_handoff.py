"""Streamed handoffs over each transport: byte-identical to a single node over HTTP and with the
whole-payload pull (shared memory: the parity module, whose nodes share this host); and one that
loses its prefill node mid-stream: the request fails alone with a typed error, the decode node
frees the pieces it kept, the other prefill node takes the next requests, nothing is left in
/dev/shm."""

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
from tests.e2e.harness import Node, assert_no_leaks, post, router, start_cluster, start_nodes, without_ids

pytestmark = pytest.mark.e2e

BODY = {"prompt": "The harbour lights came on one by one over the water.", "max_tokens": 12,
        "temperature": 0, "stream": True}
# the prefill node waits 30 s between its last piece (and the first token) and the stream's end
SLOW_END = ("--inject-fault", "kv_encode:slow=30")


PARITY = [
    {"prompt": "The old lighthouse keeper climbed the stairs every evening, counting each step. "
               "He listened to the sea and wrote down the names of the ships.", "max_tokens": 10,
     "temperature": 0},
    {"prompt": "Once upon a time in a village by a forest there lived a king with three daughters.",
     "max_tokens": 10, "temperature": 0.9, "seed": 5},
]


def test_streamed_over_http_and_pulled_answers_are_the_single_nodes(tmp_path: Path) -> None:
    """Each way a handoff goes: the stream the router starts (the default), the stream the decode
    node asks for (`stream-via-decode`), and the pull."""
    model = cached_checkpoint("llama")
    cluster = start_cluster(model, tmp_path / "logs", node_args=("--kv-transport", "http"))
    logs = tmp_path / "logs"
    pull = router(model, logs / "router-pull.log", cluster.prefill, cluster.decode,
                  "--force-disaggregation", "--kv-handoff", "pull")
    via_decode = router(model, logs / "router-via-decode.log", cluster.prefill, cluster.decode,
                        "--force-disaggregation", "--kv-handoff", "stream-via-decode")
    try:
        start_nodes([pull, via_decode])
        for body in PARITY:
            for stream in (False, True):
                asked = {**body, "stream": stream}
                single = post(cluster.single, "/v1/completions", asked)
                for front in (cluster.router, via_decode, pull):
                    routed = post(front, "/v1/completions", asked)
                    assert routed.status_code == single.status_code == 200, routed.text
                    assert _answer(routed, stream) == _answer(single, stream), (front.args, asked)
        records = httpx.get(f"{cluster.decode[0].url}/internal/handoffs", timeout=5).json()["records"]
        ways = {(r["streamed"], r["attached"], r["transport"]) for r in records}
        # every way was taken
        assert ways == {(True, True, "http"), (True, False, "http"), (False, False, None)}, ways
        # every KV body left on the prefill nodes' KV plane (the socket beside the HTTP port)
        for node in cluster.prefill:
            info = httpx.get(f"{node.url}/internal/info", timeout=5).json()
            plane = f"http://127.0.0.1:{info['kv_port']}"
            stats = httpx.get(f"{node.url}/internal/stats", timeout=5).json()
            assert stats["kv_plane_bodies"] >= 1, stats
            unknown = httpx.get(f"{plane}/internal/kv/no-such-request", timeout=5)
            assert unknown.status_code == 404, unknown.text
            assert unknown.json()["error"]["code"] == "kv_not_found", unknown.text
        assert_no_leaks([cluster.router, pull, via_decode, *cluster.prefill, *cluster.decode])
    finally:
        pull.stop()
        via_decode.stop()
        cluster.stop()


def _answer(response: httpx.Response, stream: bool) -> Any:
    """The body without the fields allowed to differ; a stream's events in order."""
    if not stream:
        return without_ids(response.json())
    return [line[6:] if line == "data: [DONE]" else without_ids(json.loads(line[6:]))
            for line in response.text.splitlines() if line.startswith("data: ")]


def _wait_until_arriving(decode: Node, timeout_s: float = 20.0) -> None:
    """The decode node keeps a streamed handoff's pieces (`kv_arriving`): it attached to the
    stream and took its first piece, which may come after the first token reached the client."""
    deadline = time.monotonic() + timeout_s
    while (arriving := decode.stats()["kv_arriving"]) != 1:
        assert time.monotonic() < deadline, f"kv_arriving {arriving}, not 1"
        time.sleep(0.05)


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
                    # the first token is out (from the prefill node's answer to the router, or
                    # through the decode node), the stream's end is not: once the decode node
                    # keeps its pieces, lose the prefill node that streams them
                    victim = next(node for node in cluster.prefill if node.stats()["live_requests"] == 1)
                    _wait_until_arriving(cluster.decode[0])
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
