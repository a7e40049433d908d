"""Tensor-parallel instances (`--tensor-parallel 2`): two ranks on 127.0.0.1 over MLX's ring
backend on the CPU. A two-rank single node answers as a one-rank node does (greedy and seeded, one
at a time and batched: on these models the shards' summation order changes no token, see
docs/engine.md); KV hands off between instances of different degrees both ways; a rank killed
mid-stream ends its instance's requests with a typed error and the instance exits 3, never a hang.
Each rank reports in `/internal/info` the parameter bytes it holds: its shard, not the model."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest

from support.tiny_models import cached_checkpoint
from tests.e2e.harness import Node, assert_no_leaks, rank_pid, router, start_nodes, stream_killing_a_rank

pytestmark = pytest.mark.e2e

TP2 = ("--tensor-parallel", "2")
BODIES = [
    {"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0},
    {"prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0},
    {"prompt": "Once upon a time there was", "max_tokens": 16, "temperature": 0.9, "seed": 7},
    {"prompt": "hello world", "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "seed": 11},
]


def answers(node: Node, bodies: list[dict[str, Any]], *, together: bool) -> list[Any]:
    def one(body: dict[str, Any]) -> Any:
        r = httpx.post(f"{node.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"]

    if not together:
        return [one(body) for body in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:  # decoded in one batch
        return list(pool.map(one, bodies))


def parameter_bytes_by_rank(node: Node) -> list[int]:
    by_rank: list[int] = httpx.get(f"{node.url}/internal/info", timeout=10).json()["parameter_bytes_by_rank"]
    return by_rank


def assert_each_rank_holds_a_shard(whole: Node, sharded: Node, model: Path, *, ranks: int) -> None:
    """Each rank of `sharded` reports the parameter bytes it holds: 1/ranks of the weights
    mlx-lm's `model.shard` splits (the attention and MLP projections), plus what it leaves whole
    on every rank (embeddings, lm_head, norms: in a tiny model a large part). The one-rank node
    `whole` holds the checkpoint's every byte. A rank that skipped `model.shard` would hold it all."""
    loaded = mx.load(str(model / "model.safetensors"))
    assert isinstance(loaded, dict)
    sizes = {name: int(w.nbytes) for name, w in loaded.items()}
    total = sum(sizes.values())
    split = sum(size for name, size in sizes.items() if name.endswith("proj.weight"))
    assert parameter_bytes_by_rank(whole) == [total]
    held = parameter_bytes_by_rank(sharded)
    assert held == [total - split + split // ranks] * ranks, (held, total, split)
    assert split > total / 3  # the shards really are a large part of the model


def stop_all(nodes: list[Node]) -> None:
    codes = {node.log.name: node.stop() for node in nodes}
    assert set(codes.values()) == {0}, codes


def test_a_two_rank_single_node_answers_as_one_rank(tmp_path: Path) -> None:
    model = cached_checkpoint("qwen3")
    common = ["--model", str(model)]
    one = Node("single", common, tmp_path / "one.log")
    two = Node("single", [*common, *TP2], tmp_path / "two.log")
    start_nodes([one, two])
    try:
        expected = answers(one, BODIES, together=False)
        assert answers(two, BODIES, together=False) == expected
        assert answers(two, BODIES, together=True) == expected
        # Streams left after their first token: each cancel reaches rank 1 in a plan, so the ranks
        # still hold the same rows and answer as before.
        for index in range(3):
            body = {"prompt": f"left early {index}", "max_tokens": 200, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{two.url}/v1/completions", json=body, timeout=30) as response:
                assert response.status_code == 200
                next(line for line in response.iter_lines() if line.startswith("data: "))
        assert answers(two, BODIES, together=True) == expected
        assert_no_leaks([two])
        log = two.log.read_text()
        assert "rank 0 of a single instance of 2 ranks" in log
        assert_each_rank_holds_a_shard(one, two, model, ranks=2)
    finally:
        stop_all([one, two])
    assert "rank 1 exiting 0" in two.log.read_text()  # rank 0's stop reached the other rank


def test_kv_hands_off_between_instances_of_different_degrees(tmp_path: Path) -> None:
    """TP2 prefill -> TP1 decode and TP1 prefill -> TP2 decode answer as a one-rank single node."""
    model = cached_checkpoint("llama")
    common = ["--model", str(model)]
    single = Node("single", common, tmp_path / "single.log")
    prefill2 = Node("prefill", [*common, *TP2], tmp_path / "prefill2.log")
    decode1 = Node("decode", common, tmp_path / "decode1.log")
    prefill1 = Node("prefill", common, tmp_path / "prefill1.log")
    decode2 = Node("decode", [*common, *TP2], tmp_path / "decode2.log")
    engines = [single, prefill2, decode1, prefill1, decode2]
    to_one = router(model, tmp_path / "router_a.log", [prefill2], [decode1], "--force-disaggregation")
    to_two = router(model, tmp_path / "router_b.log", [prefill1], [decode2], "--force-disaggregation")
    start_nodes([*engines, to_one, to_two])  # a router waits for its nodes
    try:
        expected = answers(single, BODIES, together=False)
        assert answers(to_one, BODIES, together=True) == expected
        assert answers(to_two, BODIES, together=True) == expected
        for node in (decode1, decode2):
            assert node.stats()["outcomes"].get("done", 0) == len(BODIES)
    finally:
        stop_all([to_one, to_two, *engines])


@pytest.fixture(scope="module")
def doomed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Node]]:
    """A two-rank llama node for each test that kills or stops one of its ranks: started
    together (a start is mostly waiting, so two cost about what one does), one per test."""
    logs = tmp_path_factory.mktemp("doomed")
    model = ["--model", str(cached_checkpoint("llama")), *TP2]
    nodes = {"killed": Node("single", [*model, "--stall-timeout", "5"], logs / "killed.log"),
             "stalled": Node("single", [*model, "--stall-timeout", "2"], logs / "stalled.log")}
    try:
        start_nodes(list(nodes.values()))
        yield nodes
    finally:
        for node in nodes.values():
            if node.process is not None and node.process.poll() is None:
                node.process.kill()
            node.stop()


def test_a_rank_killed_mid_stream_fails_its_instance_typed(doomed: dict[str, Node]) -> None:
    node = doomed["killed"]
    assert node.process is not None
    try:
        rank1 = rank_pid(node)
        healths: list[httpx.Response] = []
        killed = threading.Event()

        def watch_health() -> None:
            killed.wait()
            while node.process is not None and node.process.poll() is None:
                with contextlib.suppress(httpx.HTTPError):
                    healths.append(httpx.get(f"{node.url}/health", timeout=2))
                time.sleep(0.02)

        watcher = threading.Thread(target=watch_health)
        watcher.start()
        events, took = stream_killing_a_rank(node, rank1, killed=killed.set)
        killed.set()
        watcher.join()
        assert took < 30
        assert "error" in events[-1], events[-1]
        assert events[-1]["error"]["code"] in {"engine_failed", "transport_lost"}, events[-1]
        assert len(events) < 3000
        assert node.process.wait(timeout=30) == 3
        lost = [h.json() for h in healths if h.status_code == 503]
        assert all(h.status_code in (200, 503) for h in healths)
        assert not lost or lost[-1]["reason"], lost  # it may exit before a probe sees the 503
        assert "transport is lost" in node.log.read_text()
    finally:
        if node.process.poll() is None:
            node.process.kill()


def test_a_stalled_rank_fails_its_instance_within_the_stall_timeout(doomed: dict[str, Node]) -> None:
    """A rank that stops answering (SIGSTOP) leaves rank 0 waiting inside a collective, which MLX
    cannot time out: the watchdog turns it into a typed failure and exit 3 after --stall-timeout."""
    node = doomed["stalled"]
    assert node.process is not None
    rank1 = rank_pid(node)
    try:
        os.kill(rank1, signal.SIGSTOP)
        started = time.monotonic()
        r = httpx.post(f"{node.url}/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "transport_lost", r.text
        assert "no progress" in r.json()["error"]["message"]
        assert node.process.wait(timeout=30) == 3
        assert time.monotonic() - started < 20
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank1, signal.SIGKILL)
        if node.process.poll() is None:
            node.process.kill()
