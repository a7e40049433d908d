"""The processes of the cross-process handoff tests: one mode, every case, per invocation.

`python -m tests.integration.handoff_worker MODE WORK_DIR...`, where each WORK_DIR holds
`spec.json` (a `Spec`: the model directory, kv_bits, chunk size, named prompts, greedy and seeded
sampling and, for the batch test, neighbour prompts and the prompts that also join them): one
case, one model. The cases run one after the other in the one process (a process start costs
more than a tiny model's case), each with its own engines. Each mode writes `<MODE>.json` into
each WORK_DIR, or `<MODE>.error` (the traceback) when that case failed, and goes on with the next:

- `prefill`: one `MlxEngine`; every prompt is prefilled twice (greedy, seeded), exported and
  released. Payloads go to `<prompt>.<sampling>.kv`, first tokens and sizes to the JSON.
- `decode`: the other side of the handoff, a process that never saw the prompts. Each payload
  is installed into a fresh `MlxEngine` and decoded alone. Each payload of a prompt named in
  `join` is then installed again, into another fresh engine that first starts the neighbours
  (prefilled locally) and waits until each has streamed a few tokens: it joins the decoder
  while they run (results under `<prompt>.<sampling>.joined`).
- `reference`: what the handoff must equal, in one process: mlx-lm's `generate_step` greedy
  tokens (same `prefill_step_size`, kv_bits from the first model call), and one `MlxEngine`
  doing everything itself (`prefill` + `decode_held`) for seeded sampling and the neighbours.

The worker records; the test asserts. Only the engine's public port is used. A test helper: it
imports mlx, mlx_lm and trio, and nothing in `src` may import it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import trio
from mlx_lm.generate import generate_step
from mlx_lm.utils import load as mlx_lm_load

from adapters.mlx import MlxEngine
from effects.engine_port import SamplingParams
from statecore.events import TokensGenerated
from statecore.ids import RequestId

__all__ = ["MODES", "SAMPLINGS", "Spec", "main", "read_result"]

SAMPLINGS = ("greedy", "seeded")
MODES = ("prefill", "decode", "reference")
NEIGHBOUR_WARMUP = 4
"""Tokens each neighbour has streamed before the handed-off request joins."""
KV_GROUP_SIZE = 64  # the engine's default


@dataclass(frozen=True, slots=True)
class Spec:
    """What one worker invocation runs: one model, several prompts, two samplings."""

    model: str
    chunk: int
    prompts: dict[str, list[int]]
    greedy: SamplingParams
    seeded: SamplingParams
    kv_bits: int | None = None
    neighbours: list[tuple[list[int], SamplingParams]] = field(default_factory=list)
    join: list[str] = field(default_factory=list)  # prompts that also join the running neighbours

    def write(self, work: Path) -> None:
        (work / "spec.json").write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, work: Path) -> Spec:
        raw = json.loads((work / "spec.json").read_text())
        return cls(
            model=raw["model"],
            chunk=raw["chunk"],
            prompts=raw["prompts"],
            greedy=SamplingParams(**raw["greedy"]),
            seeded=SamplingParams(**raw["seeded"]),
            kv_bits=raw["kv_bits"],
            neighbours=[(prompt, SamplingParams(**s)) for prompt, s in raw["neighbours"]],
            join=raw["join"],
        )

    def sampling(self, which: str) -> SamplingParams:
        return self.greedy if which == "greedy" else self.seeded


def read_result(work: Path, mode: str) -> dict[str, Any]:
    """One case's result in one mode; its failure (or a worker that died before it) as an
    AssertionError that says which."""
    error = work / f"{mode}.error"
    if error.exists():
        raise AssertionError(f"the {mode} worker failed on {work.name}:\n{error.read_text()}")
    found = work / f"{mode}.json"
    if not found.exists():
        raise AssertionError(f"the {mode} worker left no result for {work.name} (see its log)")
    result: dict[str, Any] = json.loads(found.read_text())
    return result


def _payload_file(work: Path, prompt: str, sampling: str) -> Path:
    return work / f"{prompt}.{sampling}.kv"


async def _open(spec: Spec) -> MlxEngine:
    return await MlxEngine.load(Path(spec.model), prefill_chunk_size=spec.chunk, kv_bits=spec.kv_bits)


async def _collect(engine: MlxEngine, rid: RequestId, first_token: int) -> list[int]:
    return [first_token] + [token async for step in engine.stream(rid)
                            if isinstance(step, TokensGenerated) for token in step.tokens]


async def _assert_idle(engine: MlxEngine) -> None:
    await engine.release_held(RequestId("-flush-"))  # FIFO device queue: everything before has run
    stats = engine.statistics()
    if stats.decoding or stats.held_caches or stats.held_bytes:
        raise AssertionError(f"the engine still holds something: {stats}")


# ---------------------------------------------------------------------------------------------
# prefill


async def run_prefill(spec: Spec, work: Path) -> dict[str, Any]:
    engine = await _open(spec)
    out: dict[str, Any] = {"fingerprint": engine.info.fingerprint}
    try:
        for name, prompt in spec.prompts.items():
            for which in SAMPLINGS:
                rid = RequestId(f"{name}.{which}")
                outcome = await engine.prefill(rid, prompt, spec.sampling(which))
                payload = (await engine.export_held(rid)).joined()
                if await engine.release_held(rid) != outcome.held_bytes:
                    raise AssertionError(f"{rid}: release_held freed another byte count than held")
                _payload_file(work, name, which).write_bytes(payload)
                out[rid] = {
                    "first_token": outcome.first_token,
                    "prompt_tokens": outcome.prompt_tokens,
                    "held_bytes": outcome.held_bytes,
                    "payload_bytes": len(payload),
                }
        await _assert_idle(engine)
    finally:
        await engine.aclose()
    return out


# ---------------------------------------------------------------------------------------------
# decode


async def run_decode(spec: Spec, work: Path) -> dict[str, Any]:
    prefilled = read_result(work, "prefill")
    out: dict[str, Any] = {}
    for name, prompt in spec.prompts.items():
        for which in SAMPLINGS:
            rid = RequestId(f"{name}.{which}")
            payload = _payload_file(work, name, which).read_bytes()
            first_token = int(prefilled[rid]["first_token"])
            sampling = spec.sampling(which)
            for joins in (False, True) if name in spec.join else (False,):
                engine = await _open(spec)  # fresh: it has seen nothing of this prompt
                try:
                    if engine.info.fingerprint != prefilled["fingerprint"]:
                        raise AssertionError("prefill and decode loaded models with different fingerprints")
                    if joins:
                        out[f"{rid}.joined"] = await _join_running(engine, spec, rid, payload, prompt,
                                                                   first_token, sampling)
                    else:
                        await engine.install(rid, payload, prompt, first_token, sampling)
                        out[rid] = {"tokens": await _collect(engine, rid, first_token)}
                    await _assert_idle(engine)
                finally:
                    await engine.aclose()
    return out


async def _join_running(
    engine: MlxEngine,
    spec: Spec,
    rid: RequestId,
    payload: bytes,
    prompt: list[int],
    first_token: int,
    sampling: SamplingParams,
) -> dict[str, Any]:
    """The neighbours decode; the handed-off request joins them; everyone runs to its end. A
    neighbour decodes on until the request has joined, however long its payload's check takes (a
    loaded box's can outlast a hundred steps), as long as the joining request's own length allows
    (so that it needs no more room than the joining request: the lane it decodes in stays the
    one it takes alone wherever the joining request's is a slot), and leaves once it has its own
    `max_tokens`: those are what it makes alone (no later token changes them)."""
    neighbours: dict[str, list[int]] = {}
    warmed = [trio.Event() for _ in spec.neighbours]
    joined = trio.Event()

    async def run_neighbour(i: int) -> None:
        nid = RequestId(f"neighbour{i}")
        n_prompt, n_sampling = spec.neighbours[i]
        most = max(n_sampling.max_tokens, len(prompt) + sampling.max_tokens - len(n_prompt))
        waiting = replace(n_sampling, max_tokens=most)
        outcome = await engine.prefill(nid, n_prompt, waiting)
        await engine.decode_held(nid, n_prompt, outcome.first_token, waiting)
        tokens = [outcome.first_token]
        async with contextlib.aclosing(engine.stream(nid)) as stream:  # left early: cancelled
            async for item in stream:
                if isinstance(item, TokensGenerated):
                    tokens += item.tokens
                if len(tokens) >= NEIGHBOUR_WARMUP:
                    warmed[i].set()
                if len(tokens) >= n_sampling.max_tokens and joined.is_set():
                    break
        warmed[i].set()  # (a neighbour shorter than the warm-up would hang the test otherwise)
        neighbours[nid] = tokens[:n_sampling.max_tokens]

    async with trio.open_nursery() as nursery:
        for i in range(len(spec.neighbours)):
            nursery.start_soon(run_neighbour, i)
        for event in warmed:
            await event.wait()
        await engine.install(rid, payload, prompt, first_token, sampling)
        decoding_at_join = engine.statistics().decoding
        joined.set()
        tokens = await _collect(engine, rid, first_token)
    return {"tokens": tokens, "decoding_at_join": decoding_at_join, "neighbours": neighbours}


# ---------------------------------------------------------------------------------------------
# reference


async def run_reference(spec: Spec, work: Path) -> dict[str, Any]:
    model = mlx_lm_load(spec.model)[0]

    def mlx_lm_greedy(prompt: Sequence[int], max_tokens: int) -> list[int]:
        steps = generate_step(
            mx.array(list(prompt)),
            model,
            max_tokens=max_tokens,
            prefill_step_size=spec.chunk,
            kv_bits=spec.kv_bits,
            kv_group_size=KV_GROUP_SIZE,
            quantized_kv_start=0,
        )
        return [int(token) for token, _ in steps]

    engine = await _open(spec)

    async def one_node(rid: RequestId, prompt: list[int], sampling: SamplingParams) -> list[int]:
        outcome = await engine.prefill(rid, prompt, sampling)
        await engine.decode_held(rid, prompt, outcome.first_token, sampling)
        return await _collect(engine, rid, outcome.first_token)

    out: dict[str, Any] = {"neighbours": {}}
    try:
        for name, prompt in spec.prompts.items():
            out[name] = {"mlx_lm": mlx_lm_greedy(prompt, spec.greedy.max_tokens)}
            out[name]["seeded"] = await one_node(RequestId(f"{name}.seeded"), prompt, spec.seeded)
        for i, (prompt, sampling) in enumerate(spec.neighbours):
            nid = f"neighbour{i}"
            out["neighbours"][nid] = await one_node(RequestId(nid), prompt, sampling)
        await _assert_idle(engine)
    finally:
        await engine.aclose()
    return out


_RUNNERS = {"prefill": run_prefill, "decode": run_decode, "reference": run_reference}


def main(argv: Sequence[str]) -> int:
    if len(argv) < 2 or argv[0] not in _RUNNERS:
        print(f"usage: python -m tests.integration.handoff_worker {'|'.join(MODES)} WORK_DIR...",
              file=sys.stderr)
        return 2
    mode = argv[0]
    for work in map(Path, argv[1:]):
        try:
            result = trio.run(_RUNNERS[mode], Spec.read(work), work)
        except Exception:  # that case's failure; the next case still runs
            (work / f"{mode}.error").write_text(traceback.format_exc())
            continue
        (work / f"{mode}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # The results are written and closed. Skip the interpreter's teardown: about one run in
    # twenty on a loaded 2-core machine aborted there, after a clean exit from main, with
    # "terminate called without an active exception" (MLX's C++ teardown, not this code).
    os._exit(code)
