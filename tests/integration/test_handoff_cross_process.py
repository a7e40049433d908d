"""The engine's "done when" matrix: prefill in one process, decode in another, for every cache.

For every family x dtype (plus llama with 4- and 8-bit KV) and prompts of 1, 33, 257 and 2,100
tokens: a prefill process encodes each cache to a file, a *separate* decode process installs it
into a fresh engine and continues 32 tokens. Greedy tokens must equal mlx-lm's `generate_step`
(same `prefill_step_size`); seeded sampling must equal the same engine doing everything on one
node. Then a handed-off request joining a decoder that already runs three others must produce
the tokens it produces alone. The processes are `tests/integration/handoff_worker.py`: one
invocation per mode covers every case this session runs (each case: one model, every prompt, both
samplings and, for the cases that also join, the joins: the same payloads installed again beside
running neighbours), and the prefill and reference processes run side by side, the decode process
once the prefill one is done. They run once, for the first test that asks (`handoff_of`); every
test reads their results.

CHUNK is 256, so 257 tokens take one full chunk plus the last token, and 2,100 tokens nine chunks
(the last one partial) plus the last token. Prompts are the tiny tokenizer's ids of CORPUS.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from effects.engine_port import SamplingParams
from support.tiny_models import CORPUS, DTYPES, FAMILIES, cached_checkpoint, is_degenerate
from tests.integration.handoff_worker import Spec, read_result

# worker processes for every family and dtype: not in `pytest -m quick`
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 256
LENGTHS = (1, 33, 257, 2100)
GREEDY = SamplingParams(max_tokens=32)
SEEDED = SamplingParams(max_tokens=32, temperature=1.0, top_p=0.9, top_k=40, seed=1234)
WORKER_TIMEOUT_S = 300


@dataclass(frozen=True, slots=True)
class Case:
    family: str
    dtype: str
    kv_bits: int | None = None

    @property
    def id(self) -> str:
        return f"{self.family}-{self.dtype}" + (f"-kv{self.kv_bits}" if self.kv_bits else "")


MATRIX = [Case(family, dtype) for family in FAMILIES for dtype in DTYPES] + [
    Case("llama", "float32", kv_bits=4),
    Case("llama", "float32", kv_bits=8),
]


# ---------------------------------------------------------------------------------------------
# Models, prompts and worker processes


def quantizable_llama(out_dir: Path) -> Path:
    """The tiny llama of hidden size 128 regrouped into 2 query heads of 64 (1 KV head of 64).

    The projection shapes stay those of 8 heads of 16 (q 128x128, k and v 64x128), so
    tiny_models' weights load unchanged; head_dim 64 makes the KV cache quantizable with group
    size 64, the same config change test_engine_mlx.py makes for its quantized llama.
    """
    if (out_dir / "config.json").exists():
        return out_dir
    shutil.copytree(cached_checkpoint("llama", hidden_size=128), out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    config.update(num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


@pytest.fixture(scope="module")
def model_for(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Case], Path]:
    quantizable = tmp_path_factory.mktemp("models") / "llama-head64"

    def resolve(case: Case) -> Path:
        if case.kv_bits is not None:
            assert case.family == "llama" and case.dtype == "float32"
            return quantizable_llama(quantizable)
        return cached_checkpoint(case.family, dtype=case.dtype)

    return resolve


_TOKEN_IDS: dict[Path, list[int]] = {}


def corpus_ids(model_dir: Path, n: int, start: int = 0) -> list[int]:
    """`n` token ids of CORPUS (repeated as needed) from `start`, as this model's tokenizer cuts it."""
    tokenizer_file = model_dir / "tokenizer.json"
    if tokenizer_file not in _TOKEN_IDS:
        text = "\n".join([CORPUS] * 4)
        _TOKEN_IDS[tokenizer_file] = Tokenizer.from_file(str(tokenizer_file)).encode(text).ids
    ids = _TOKEN_IDS[tokenizer_file][start : start + n]
    assert len(ids) == n
    return ids


@dataclass(frozen=True, slots=True)
class Results:
    prefill: dict[str, Any]
    decode: dict[str, Any]
    reference: dict[str, Any]


def _start(mode: str, work: Path, cases: list[Path]) -> subprocess.Popen[bytes]:
    log = (work / f"{mode}.log").open("wb")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.integration.handoff_worker", mode, *map(str, cases)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    finally:
        log.close()


def _wait(mode: str, process: subprocess.Popen[bytes], work: Path, cases: int) -> None:
    try:
        code = process.wait(timeout=WORKER_TIMEOUT_S * cases)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    if code != 0:
        tail = "\n".join((work / f"{mode}.log").read_text(errors="replace").splitlines()[-30:])
        raise AssertionError(f"the {mode} worker exited {code}:\n{tail}")


def run_handoffs(specs: dict[Path, Spec], work: Path) -> None:
    """Every case's prefill and reference processes side by side; decode once the payloads
    exist. Each case's results stay in its directory (a key of `specs`)."""
    for case_dir, spec in specs.items():
        spec.write(case_dir)
    cases = list(specs)
    prefill = _start("prefill", work, cases)
    reference = _start("reference", work, cases)
    try:
        _wait("prefill", prefill, work, len(cases))
        decode = _start("decode", work, cases)
        try:
            _wait("decode", decode, work, len(cases))
        finally:
            if decode.poll() is None:
                decode.kill()
                decode.wait()
        _wait("reference", reference, work, len(cases))
    finally:
        for process in (prefill, reference):
            if process.poll() is None:
                process.kill()
                process.wait()


def results_in(case_dir: Path) -> Results:
    return Results(read_result(case_dir, "prefill"), read_result(case_dir, "decode"),
                   read_result(case_dir, "reference"))


def spec_for(model_dir: Path, case: Case) -> Spec:
    joins = case in JOIN_CASES
    return Spec(
        model=str(model_dir),
        chunk=CHUNK,
        prompts={f"len{n}": corpus_ids(model_dir, n) for n in LENGTHS},
        greedy=GREEDY,
        seeded=SEEDED,
        kv_bits=case.kv_bits,
        neighbours=[(corpus_ids(model_dir, n, start), sampling) for start, n, sampling in NEIGHBOURS]
        if joins else [],
        join=[f"len{n}" for n in JOIN_LENGTHS] if joins else [],
    )


@pytest.fixture(scope="module")
def handoff_of(model_for: Callable[[Case], Path], tmp_path_factory: pytest.TempPathFactory,
               request: pytest.FixtureRequest) -> Callable[[Case], Results]:
    """The three processes, run once for the module over every case this session's tests of
    it ask for: the matrix and the join tests read the same results (a case that joins does its
    joins in the same decode process)."""
    wanted = {case for item in request.session.items
              if isinstance(item, pytest.Function) and item.module is request.module
              and hasattr(item, "callspec") and isinstance(case := item.callspec.params["case"], Case)}
    dirs: dict[Case, Path] = {}

    def results(case: Case) -> Results:
        if not dirs:
            work = tmp_path_factory.mktemp("handoffs")
            dirs.update({each: work / each.id for each in sorted(wanted | {case}, key=MATRIX.index)})
            for case_dir in dirs.values():
                case_dir.mkdir()
            run_handoffs({dirs[each]: spec_for(model_for(each), each) for each in dirs}, work)
        return results_in(dirs[case])

    return results


# ---------------------------------------------------------------------------------------------
# The matrix, and the cases that also join a running decoder

JOIN_LENGTHS = (33, 2100)
# (start in the corpus ids, length, sampling): greedy and seeded neighbours; each decodes on until
# the handed-off request has joined (`handoff_worker._join_running`: on a loaded box a 2,100-token
# payload's check took longer than 92 of their steps), and its first `max_tokens` are compared with
# what it makes alone
NEIGHBOURS = (
    (300, 5, SamplingParams(max_tokens=96)),
    (500, 40, SamplingParams(max_tokens=96, temperature=0.7, seed=5)),
    (700, 90, SamplingParams(max_tokens=96)),
)
JOIN_CASES = [
    Case("llama", "float32"),
    Case("llama", "bfloat16"),
    Case("gemma3_text", "float32"),
    Case("gemma3_text", "bfloat16"),
    Case("qwen3_next", "float32"),
    Case("falcon_h1", "bfloat16"),
    Case("mamba2", "float32"),
    Case("llama4", "float32"),  # ChunkedKVCache (no merge): all four decode in the solo lane
    Case("llama", "float32", kv_bits=4),  # QuantizedKVCache: everyone in the solo lane
]


# the first test to run runs every case's processes (a few minutes on a loaded 2-core box)
@pytest.mark.timeout(WORKER_TIMEOUT_S * 4)
@pytest.mark.parametrize("case", MATRIX, ids=[case.id for case in MATRIX])
def test_cross_process_handoff_matches_mlx_lm_and_one_node(
    case: Case, handoff_of: Callable[[Case], Results]
) -> None:
    results = handoff_of(case)

    failures: list[str] = []
    for n in LENGTHS:
        name = f"len{n}"
        reference = results.reference[name]
        expected_greedy = reference["mlx_lm"]
        greedy = results.decode[f"{name}.greedy"]["tokens"]
        seeded = results.decode[f"{name}.seeded"]["tokens"]
        assert results.prefill[f"{name}.greedy"]["prompt_tokens"] == n
        assert len(expected_greedy) == GREEDY.max_tokens  # the tiny models never emit EOS
        if greedy != expected_greedy:
            failures.append(f"{name}: greedy handoff {greedy}\n  != mlx-lm generate_step {expected_greedy}")
        if seeded != reference["seeded"]:
            failures.append(f"{name}: seeded handoff {seeded}\n  != seeded on one node {reference['seeded']}")
        if is_degenerate(expected_greedy):
            failures.append(f"{name}: degenerate greedy output {expected_greedy}: the tiny model is broken")
    assert not failures, f"{case.id}:\n" + "\n".join(failures)
    # Sampling really sampled (at some length), and the caches really travelled.
    assert any(
        results.reference[f"len{n}"]["seeded"] != results.reference[f"len{n}"]["mlx_lm"] for n in LENGTHS
    )
    assert all(results.prefill[f"len{n}.greedy"]["payload_bytes"] > 0 for n in LENGTHS)


# ---------------------------------------------------------------------------------------------
# Joining a running decoder


@pytest.mark.timeout(WORKER_TIMEOUT_S * 4)
@pytest.mark.parametrize("case", JOIN_CASES, ids=[case.id for case in JOIN_CASES])
def test_cross_process_handoff_joining_three_running_requests_decodes_as_alone(
    case: Case, handoff_of: Callable[[Case], Results]
) -> None:
    results = handoff_of(case)

    failures: list[str] = []
    for n in JOIN_LENGTHS:
        for which in ("greedy", "seeded"):
            got = results.decode[f"len{n}.{which}.joined"]
            alone = results.reference[f"len{n}"]["mlx_lm" if which == "greedy" else which]
            if got["decoding_at_join"] != 1 + len(NEIGHBOURS):
                failures.append(
                    f"len{n}.{which}: joined {got['decoding_at_join'] - 1} running requests, not 3"
                )
            if got["tokens"] != alone:
                failures.append(f"len{n}.{which}: joined {got['tokens']}\n  != alone {alone}")
            if got["neighbours"] != results.reference["neighbours"]:
                failures.append(f"len{n}.{which}: the neighbours changed when it joined")
    assert not failures, f"{case.id}:\n" + "\n".join(failures)
