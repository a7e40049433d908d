"""A prefill and a decode node whose engine cores run in their own processes (`--engine-core
process`): through the router, a streamed handoff (its pieces through shared memory) and a pulled
one answer byte for byte as a single node with its core on a thread (the prefill node hands its
core's shared memory on to the decode node, copying none of it) (greedy and seeded, streamed
and not, and several requests batched); and when the decode node's core process is killed
mid-stream the stream ends with a typed error and the node exits 3, as it does when its device
thread dies. (That the process core answers as the thread core call by call, and moves KV both
ways, is tests/integration/test_engine_core_process.py's.)
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.tiny_models import cached_checkpoint
from tests.e2e.harness import (
    Node,
    assert_no_leaks,
    post,
    router,
    start_nodes,
    stream_killing_a_rank,
    without_ids,
)

pytestmark = pytest.mark.e2e

PROCESS = ("--engine-core", "process")
BODIES = [
    {"prompt": "The old lighthouse keeper climbed the stairs every evening, counting each step. "
               "He listened to the sea and wrote down the names of the ships.", "max_tokens": 10,
     "temperature": 0},
    {"prompt": "Once upon a time in a village by a forest there lived a king with three daughters.",
     "max_tokens": 10, "temperature": 0.9, "seed": 5},
    {"prompt": "def add(a, b):", "max_tokens": 10, "temperature": 0.7, "top_p": 0.9, "seed": 11},
]


def core_pid(node: Node) -> int:
    found = re.search(r"started the engine core process \(pid (\d+)\)", node.log.read_text())
    assert found, node.tail()
    return int(found.group(1))


def loaded_libraries(pid: int) -> str:
    """The files a process has mapped (Linux's /proc: the end-to-end suite runs on Linux). The
    system OpenBLAS and the libraries it needs may be preloaded in both (`adapters.blas`)."""
    return Path(f"/proc/{pid}/maps").read_text()


def shm_regions(pid: int) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"statecore-kv-{pid}-*")]


def answer(response: httpx.Response, stream: bool) -> Any:
    """The body without the fields allowed to differ; a stream's events in order."""
    assert response.status_code == 200, response.text
    if not stream:
        return without_ids(response.json())
    return [line[6:] if line == "data: [DONE]" else without_ids(json.loads(line[6:]))
            for line in response.text.splitlines() if line.startswith("data: ")]


def test_process_cores_hand_off_as_a_thread_core_answers_and_a_dead_core_ends_a_node(tmp_path: Path) -> None:
    model = cached_checkpoint("llama")
    single = Node("single", ["--model", str(model)], tmp_path / "single.log")
    prefill = Node("prefill", ["--model", str(model), *PROCESS], tmp_path / "prefill.log")
    decode = Node("decode", ["--model", str(model), *PROCESS, "--stall-timeout", "5"],
                  tmp_path / "decode.log")
    start_nodes([single, prefill, decode])
    streamed = router(model, tmp_path / "router.log", [prefill], [decode], "--force-disaggregation")
    pulled = router(model, tmp_path / "router-pull.log", [prefill], [decode], "--force-disaggregation",
                    "--kv-handoff", "pull")
    nodes = [single, prefill, decode, streamed, pulled]
    try:
        start_nodes([streamed, pulled])
        for body in BODIES:
            for stream in (False, True):
                asked = {**body, "stream": stream}
                expected = answer(post(single, "/v1/completions", asked), stream)
                for front in (streamed, pulled):
                    got = answer(post(front, "/v1/completions", asked), stream)
                    assert got == expected, (front.args, asked)
        with ThreadPoolExecutor(2 * len(BODIES)) as pool:  # batched on the decode node, both ways at once
            together = list(pool.map(lambda job: answer(post(job[0], "/v1/completions", job[1]), False),
                                     [(front, body) for front in (streamed, pulled) for body in BODIES]))
        alone = [answer(post(single, "/v1/completions", body), False) for body in BODIES]
        assert together == alone + alone
        records = httpx.get(f"{decode.url}/internal/handoffs", timeout=5).json()["records"]
        assert {(r["streamed"], r["transport"]) for r in records} == {(True, "shm"), (False, None)}, records
        assert_no_leaks([streamed, pulled, prefill, decode])
        # the prefill node handed its core's regions on: it made none of its own but its probe
        assert prefill.process is not None
        assert [name for name in shm_regions(prefill.process.pid) if not name.endswith("-probe")] == []
        assert shm_regions(core_pid(prefill))
        for node in (prefill, decode):  # the core loads mlx; the node itself never does
            assert node.process is not None
            assert "libmlx" not in loaded_libraries(node.process.pid), node.role
            assert "libmlx" in loaded_libraries(core_pid(node)), node.role

        events, took = stream_killing_a_rank(streamed, core_pid(decode))
        assert took < 30
        assert "error" in events[-1], events[-1]
        assert events[-1]["error"]["code"] in {"engine_failed", "transport_lost"}, events[-1]
        assert decode.process is not None and decode.process.wait(timeout=30) == 3
        assert "the engine core process died: the loop's transport is lost" in decode.log.read_text()
    finally:
        for node in nodes:
            node.stop()
