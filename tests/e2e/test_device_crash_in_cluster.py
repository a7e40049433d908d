"""A device crash on one of a cluster's engine nodes (its MLX thread dies, the `device_crash`
fault): that node's loop ends and it exits 3, the router routes around it, and every other
request is answered exactly as a single node answers it. A crash on a prefill node comes before
the first token, so its request is retried on the other prefill node; a crash on a decode node
(while it installs a handed-off KV) fails the one request it was installing, typed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from effects.faults import ENABLE_ENV
from support.tiny_models import cached_checkpoint
from tests.e2e.harness import Cluster, Node, assert_no_leaks, post, router, start_nodes

pytestmark = pytest.mark.e2e


def armed_cluster(logs: Path, role: str) -> Cluster:
    """1 single node, 2 prefill and 2 decode nodes, the first node of `role` armed to crash."""
    model = cached_checkpoint("llama")
    logs.mkdir(parents=True, exist_ok=True)
    common = ["--model", str(model)]
    armed = [*common, "--inject-fault", "device_crash"]

    def node(kind: str, index: int) -> Node:
        return Node(kind, armed if kind == role and index == 0 else common, logs / f"{kind}{index}.log")

    single = Node("single", common, logs / "single.log")
    prefill = [node("prefill", i) for i in range(2)]
    decode = [node("decode", i) for i in range(2)]
    start_nodes([single, *prefill, *decode])
    front = router(model, logs / "router.log", prefill, decode, "--force-disaggregation")
    start_nodes([front])
    return Cluster(single, front, prefill, decode)


def marked(cluster: Cluster, index: int) -> tuple[dict[str, Any], httpx.Response]:
    body = {"prompt": f"Crash test {index}", "max_tokens": 6, "temperature": 0}
    response = httpx.post(f"{cluster.router.url}/v1/completions", json=body, timeout=120,
                          headers={"x-request-id": f"inject-fault-device_crash-{index}"})
    return body, response


def wait_for_down(cluster: Cluster, node: Node, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while cluster.router.stats()["peers"][node.url] != "down":
        assert time.monotonic() < deadline, "the router never marked the crashed node down"
        time.sleep(0.1)


def test_a_device_crash_on_a_prefill_node_is_retried_on_the_other(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENABLE_ENV, "1")
    cluster = armed_cluster(tmp_path / "logs", "prefill")
    crashed = cluster.prefill[0]
    try:
        for index in range(8):
            body, routed = marked(cluster, index)
            assert routed.status_code == 200, routed.text
            assert routed.json()["choices"] == post(cluster.single, "/v1/completions", body).json()["choices"]
        assert crashed.process is not None
        assert crashed.process.wait(timeout=30) == 3  # the node's transport: its loop ended
        crashed.process = None
        assert "-> routed on retry" in cluster.router.log.read_text()
        wait_for_down(cluster, crashed)
        assert_no_leaks([cluster.router, cluster.prefill[1], *cluster.decode])
    finally:
        cluster.stop()


def test_a_device_crash_on_a_decode_node_fails_only_its_install(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENABLE_ENV, "1")
    cluster = armed_cluster(tmp_path / "logs", "decode")
    crashed, survivor = cluster.decode
    try:
        failed: list[httpx.Response] = []
        for index in range(8):
            body, routed = marked(cluster, index)
            if routed.status_code != 200:
                failed.append(routed)
                wait_for_down(cluster, crashed)  # then every later request goes to the survivor
                continue
            assert routed.json()["choices"] == post(cluster.single, "/v1/completions", body).json()["choices"]
        assert len(failed) == 1, [r.text for r in failed]
        assert failed[0].status_code >= 500
        assert failed[0].json()["error"]["code"] in {"transport_lost", "engine_failed", "peer_unavailable"}
        assert crashed.process is not None
        assert crashed.process.wait(timeout=30) == 3
        crashed.process = None
        assert survivor.stats()["outcomes"].get("done", 0) == 7  # the crashed node finished none
        assert_no_leaks([cluster.router, *cluster.prefill, survivor])
    finally:
        cluster.stop()
