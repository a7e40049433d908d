"""Pipeline-parallel instances (`--pipeline-parallel 2`): two ranks on 127.0.0.1 over MLX's ring
backend on the CPU, each holding half the layers of a tiny qwen3_next (hybrid: linear-attention
ArraysCache layers and full-attention KVCache layers on each rank). A two-rank single node answers
as a one-rank node does (greedy and seeded, one at a time and batched); a model family mlx-lm
cannot pipeline, or both modes at once, are refused before anything starts (exit 2); a handoff to
or from a pipeline instance fails its request alone with a typed 422 `unsupported_cache`; a rank
killed mid-stream ends the stream with a typed error and the instance exits 3 (as tensor parallel)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from support.tiny_models import cached_checkpoint
from tests.e2e.harness import Node, assert_no_leaks, rank_pid, router, start_nodes, stream_killing_a_rank
from tests.e2e.test_tensor_parallel import BODIES, answers, stop_all

pytestmark = pytest.mark.e2e

PP2 = ("--pipeline-parallel", "2")
SHORT = [{**body, "max_tokens": 8} for body in BODIES]  # greedy and seeded, kept quick
ROOT = Path(__file__).resolve().parents[2]


def hybrid_model() -> Path:
    # Four layers: each rank holds one linear-attention and one full-attention layer.
    return cached_checkpoint("qwen3_next", num_layers=4)


def test_a_two_rank_pipeline_answers_as_one_rank(tmp_path: Path) -> None:
    common = ["--model", str(hybrid_model())]
    one = Node("single", common, tmp_path / "one.log")
    two = Node("single", [*common, *PP2], tmp_path / "two.log")
    start_nodes([one, two])
    try:
        expected = answers(one, SHORT, together=False)
        assert answers(two, SHORT, together=False) == expected
        assert answers(two, SHORT, together=True) == expected  # several prefill calls in one step
        assert_no_leaks([two])
        assert "rank 0 of a single instance of 2 ranks (pipeline parallel" in two.log.read_text()
    finally:
        stop_all([one, two])
    assert "rank 1 exiting 0" in two.log.read_text()


def refused(*argvs: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """Each `statecore run --role single ARGV` run to its end, all started at once (each is
    refused before it loads anything, so the time is Python's start-up, paid side by side)."""
    command = [sys.executable, "-m", "adapters.cli", "run", "--role", "single"]
    started = [(argv, subprocess.Popen([*command, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
               for argv in argvs]
    done: list[subprocess.CompletedProcess[str]] = []
    for argv, process in started:
        out, err = process.communicate(timeout=60)
        done.append(subprocess.CompletedProcess(argv, process.returncode, out, err))
    return done


def test_what_cannot_pipeline_is_refused_before_it_starts() -> None:
    llama, both = refused(["--model", str(cached_checkpoint("llama")), *PP2, "--port", "0"],
                          ["--model", str(hybrid_model()), *PP2, "--tensor-parallel", "2", "--port", "0"])
    assert llama.returncode == 2, llama.stderr
    assert "no pipeline parallelism for model type 'llama'" in llama.stderr
    assert "qwen3_next" in llama.stderr  # the message names the families that have it
    assert both.returncode == 2, both.stderr
    assert "cannot be combined" in both.stderr


def test_a_handoff_to_or_from_a_pipeline_fails_its_request_typed(tmp_path: Path) -> None:
    model = hybrid_model()
    common = ["--model", str(model)]
    prefill2 = Node("prefill", [*common, *PP2], tmp_path / "prefill2.log")
    decode1 = Node("decode", common, tmp_path / "decode1.log")
    prefill1 = Node("prefill", common, tmp_path / "prefill1.log")
    decode2 = Node("decode", [*common, *PP2], tmp_path / "decode2.log")
    engines = [prefill2, decode1, prefill1, decode2]
    from_two = router(model, tmp_path / "router_a.log", [prefill2], [decode1], "--force-disaggregation")
    to_two = router(model, tmp_path / "router_b.log", [prefill1], [decode2], "--force-disaggregation")
    start_nodes([*engines, from_two, to_two])
    try:
        for node in (from_two, to_two):
            r = httpx.post(f"{node.url}/v1/completions", json=SHORT[0], timeout=60)
            assert r.status_code == 422, r.text
            error = r.json()["error"]
            assert error["code"] == "unsupported_cache", error
            assert "pipeline-parallel" in error["message"]
        for node in (prefill2, decode2):  # the instance still serves, and holds nothing
            assert httpx.get(f"{node.url}/health", timeout=5).status_code == 200
        assert_no_leaks([prefill2, decode2])
    finally:
        stop_all([from_two, to_two, *engines])


def test_a_pipeline_rank_killed_mid_stream_fails_its_instance_typed(tmp_path: Path) -> None:
    node = Node("single", ["--model", str(hybrid_model()), *PP2, "--stall-timeout", "5"],
                tmp_path / "two.log")
    start_nodes([node])
    assert node.process is not None
    try:
        events, took = stream_killing_a_rank(node, rank_pid(node))
        assert took < 30
        assert events[-1]["error"]["code"] in {"engine_failed", "transport_lost"}, events[-1]
        assert node.process.wait(timeout=30) == 3
    finally:
        if node.process.poll() is None:
            node.process.kill()
