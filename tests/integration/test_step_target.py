"""The default step-time target (`step_target_floors` times the measured floor, as a single node
on the CPU runs it) while prompts arrive beside a decoding stream: each prompt's units go a few a
step beside the stream, and no token changes. Greedy tokens are mlx-lm's, seeded ones those of
an engine without a target."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from adapters.mlx import executor as executor_module
from adapters.mlx.engine import MlxEngine
from effects.engine_port import SamplingParams
from statecore.engine_schedule import Budget, StepPlan
from statecore.engine_schedule import schedule as scheduled
from statecore.ids import RequestId
from support.tiny_models import cached_checkpoint
from tests.integration.engines import close_engine, load_engine
from tests.integration.test_engine_mlx import SEEDED, prompt_of, reference, single

STREAM = SamplingParams(max_tokens=120, ignore_eos=True)


async def beside_a_stream(engine: MlxEngine, prompts: dict[RequestId, list[int]],
                          sampling: SamplingParams) -> dict[RequestId, list[int]]:
    """One greedy stream decoding, then `prompts` all at once beside it; every request's tokens."""
    got: dict[RequestId, list[int]] = {}

    async def run(rid: RequestId, prompt: list[int], params: SamplingParams) -> None:
        got[rid] = await single(engine, rid, prompt, params)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, RequestId("stream"), prompt_of(20, salt=4), STREAM)
        with trio.fail_after(60):
            while engine.statistics().decoding < 1:
                await trio.sleep(0.01)
        for rid, prompt in prompts.items():
            nursery.start_soon(run, rid, prompt, sampling)
    return got


async def test_prompts_waiting_beside_a_stream_keep_their_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    path = cached_checkpoint("llama")
    seen: list[tuple[int, int]] = []  # (decode rows, prompts waiting) of each step under the default target

    def recorded(decode_rows: int, candidates: Any, budget: Budget, **options: Any) -> StepPlan:
        if decode_rows and budget.target_s is None and not budget.decode_only:
            seen.append((decode_rows, sum(1 for c in candidates if not c.keeps_only)))
        return scheduled(decode_rows, candidates, budget, **options)

    monkeypatch.setattr(executor_module, "schedule", recorded)
    common: dict[str, Any] = {"prefill_chunk_size": 16, "max_batch": 4}
    timed = await load_engine(path, step_target_ms=None, step_target_floors=2.0, **common)
    fixed = await load_engine(path, step_target_ms=0.0, **common)
    try:
        prompts = {RequestId(f"p{n}"): prompt_of(n, salt=n) for n in (45, 70, 90)}
        greedy = await beside_a_stream(timed, prompts, SamplingParams(max_tokens=24))
        assert greedy[RequestId("stream")] == reference(path, prompt_of(20, salt=4), STREAM.max_tokens)
        expected = {rid: reference(path, prompt, 24) for rid, prompt in prompts.items()}
        assert {rid: greedy[rid] for rid in prompts} == expected
        assert any(waiting >= 2 for _, waiting in seen)  # several prompts waited beside the rows
        seeded = await beside_a_stream(timed, prompts, SEEDED)
        assert seeded == await beside_a_stream(fixed, prompts, SEEDED)
    finally:
        await close_engine(timed)
        await close_engine(fixed)
