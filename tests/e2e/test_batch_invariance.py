"""A request's bits do not depend on which other requests share its decode steps, on a real node:
a float32 llama with 64-wide heads (the width real models have; the other tests' checkpoints
have 16), on the BLAS a node picks by default (the system OpenBLAS where it is installed, as on
CI). Its logprobs alone and while a long request decodes beside it are equal, bit for bit. With
MLX's masked attention over the batch's longest row they were not under OpenBLAS (the node then
chooses `exact rows`, `adapters.mlx.attention.masked_matches_alone`), and `--decode-attention
masked` still shows it where that BLAS is in use."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.tiny_models import build_tiny_checkpoint
from tests.e2e.harness import Node, assert_no_leaks, start_nodes

pytestmark = pytest.mark.e2e

SHORT = [5 + (7 * i) % 400 for i in range(40)]
LONG = [5 + (13 * i) % 450 for i in range(900)]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    model = build_tiny_checkpoint(tmp_path_factory.mktemp("llama-h64"), "llama", hidden_size=256,
                                  head_dim=64, num_layers=2)
    log = tmp_path_factory.mktemp("logs-invariance") / "single.log"
    single = Node("single", ["--model", str(model)], log)
    start_nodes([single])
    try:
        yield single
    finally:
        single.stop()


def _logprobs(node: Node) -> list[Any]:
    reply = httpx.post(f"{node.url}/v1/completions", timeout=120, json={
        "prompt": SHORT, "max_tokens": 16, "temperature": 0, "logprobs": 5})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return [choice["logprobs"]["tokens"], choice["logprobs"]["top_logprobs"]]


def test_a_requests_logprobs_alone_and_beside_a_long_one_are_equal(node: Node) -> None:
    alone = _logprobs(node)
    decoding = threading.Event()
    finished = threading.Event()

    def long_request() -> None:
        body = {"prompt": LONG, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{node.url}/v1/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    decoding.set()  # its first token is out: it decodes from now on
        finished.set()

    beside_thread = threading.Thread(target=long_request)
    beside_thread.start()
    try:
        assert decoding.wait(120), node.tail()
        beside = _logprobs(node)
        assert not finished.is_set(), "the long request ended before the short one decoded beside it"
    finally:
        beside_thread.join()
    assert beside == alone
    assert_no_leaks([node])
