"""Prefill units finer than a layer (`adapters.mlx.prefill.mark_inner_points`): the same numbers.

A chunk evaluated a point at a time (a layer's attention output, its MLP's first projection, its
keys and values), one `mx.eval` per unit as the device loop's steps do, must leave every layer's
keys and values and the first token exactly as the chunk evaluated in whole-layer units does, in
every family whose layers have the points; and an engine under a step-time target, whose units
stop at them, keeps greedy, seeded and prefix-cache tokens exact.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load as mlx_lm_load

from adapters.mlx.prefill import PrefillTask, mark_inner_points, run_units
from adapters.mlx.sampling import PositionSampler
from effects.engine_port import SamplingParams
from statecore.ids import RequestId
from statecore.scheduling import prefill_chunks, prefill_units
from support.tiny_models import FAMILIES, cached_checkpoint
from tests.integration.engines import close_engine, load_engine
from tests.integration.test_engine_mlx import all_at_once, prompt_of, reference, single

CHUNK = 16
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, top_k=40, seed=11)


def _prefilled(model: Any, prompt: list[int], inner: int,
               sampling: SamplingParams) -> tuple[PrefillTask, int]:
    """The prompt prefilled a unit per `mx.eval` (single-layer units, cut at `inner` points a
    layer); the task and how many arrays its units evaluated beyond their layers' states."""
    layers = len(make_prompt_cache(model))
    chunks = prefill_chunks(len(prompt), CHUNK)
    units = prefill_units(chunks, layers, -(-CHUNK // layers), inner)
    task = PrefillTask("r", prompt, PositionSampler(sampling, 5, len(prompt), prompt), 0, chunks, units)
    extra = 0
    while not task.finished:
        unit = task.units[task.done_units]
        arrays = run_units(model, task, 1, lambda cache: None)
        extra += len(arrays) - (unit.end_layer - unit.first_layer)
        mx.eval(arrays)
    mx.eval(task.first)
    return task, extra


@pytest.mark.parametrize("family", FAMILIES)
def test_a_chunk_evaluated_at_inner_points_keeps_every_bit(family: str) -> None:
    model = mlx_lm_load(str(cached_checkpoint(family)))[0]
    layers = len(make_prompt_cache(model))
    inner = mark_inner_points(model, layers)
    # attention output and the MLP's gate projection, where every layer has them
    assert inner == {"llama": 2, "qwen3": 2, "gemma3_text": 2, "llama4": 1}.get(family, inner)
    prompt = prompt_of(45, salt=3)  # chunks of 16, 16, 12, then the last token
    for sampling in (SamplingParams(max_tokens=1), SEEDED):
        layered, none = _prefilled(model, prompt, 0, sampling)
        pointed, evaluated = _prefilled(model, prompt, inner, sampling)
        assert none == 0
        # every point of every chunk but the one-token last: (layers - 1) x inner each, a unit
        # each (layer 0's keys and values with its first)
        assert evaluated == 3 * (layers - 1) * inner
        assert len(pointed.units) == len(layered.units) + 3 * ((layers - 1) * inner - (1 if inner else 0))
        assert layered.cache is not None and pointed.cache is not None
        for mine, theirs in zip(pointed.cache, layered.cache, strict=True):
            ours: list[tuple[str, Any]] = tree_flatten(mine.state)  # type: ignore[assignment]
            others: list[tuple[str, Any]] = tree_flatten(theirs.state)  # type: ignore[assignment]
            assert [name for name, _ in ours] == [name for name, _ in others]
            for (_, a), (_, b) in zip(ours, others, strict=True):
                same = mx.array_equal(a, b).item() if isinstance(a, mx.array) else a == b
                assert same, family
        assert pointed.first.item() == layered.first.item()


def test_unmarked_calls_hand_out_nothing() -> None:
    """A marked model called outside a recording prefill (a decode step) computes as before and
    records nothing; marking twice marks once."""
    model = mlx_lm_load(str(cached_checkpoint("llama")))[0]
    layers = len(make_prompt_cache(model))
    tokens = mx.array([prompt_of(9)])
    before = model(tokens, cache=make_prompt_cache(model))
    assert mark_inner_points(model, layers) == 2
    assert mark_inner_points(model, layers) == 2
    classes = {type(layer.self_attn) for layer in model.layers}
    assert len(classes) == 1 and type(classes.pop()).__name__ == "type"
    after = model(tokens, cache=make_prompt_cache(model))
    assert mx.array_equal(before, after).item()
    assert mark_inner_points(model, layers + 1) == 0  # the cache's layers are not the model's


async def test_an_engine_under_a_step_target_keeps_tokens_exact_at_inner_points(tmp_path: Path) -> None:
    """With a target under any step, a prompt beside streams takes a unit a step, cut at the
    model's inner points: greedy tokens are mlx-lm's, seeded ones the target-off engine's, and a
    prompt that starts like an earlier one reuses its kept blocks and gets the cache-less tokens."""
    path = cached_checkpoint("llama")
    common: dict[str, Any] = {"prefill_chunk_size": CHUNK, "max_batch": 4, "prefix_cache_bytes": 1 << 24}
    pointed = await load_engine(path, step_target_ms=0.001, **common)
    whole = await load_engine(path, step_target_ms=0.0, **common)
    try:
        assert pointed._device.inner_points == 2 and whole._device.inner_points == 0
        prompts = {RequestId(f"p{n}"): prompt_of(n, salt=n) for n in (9, 40, 70)}
        got = await all_at_once(partial(single, pointed), prompts)
        assert got == {rid: reference(path, prompt) for rid, prompt in prompts.items()}
        seeded = prompt_of(50, salt=6)
        assert await single(pointed, RequestId("s"), seeded, SEEDED) == await single(
            whole, RequestId("s"), seeded, SEEDED)
        longer = prompts[RequestId("p70")] + prompt_of(20, salt=9)  # its first 4 blocks are kept
        hits = pointed.statistics().prefix_cache_hits
        assert await single(pointed, RequestId("again"), longer) == reference(path, longer)
        assert pointed.statistics().prefix_cache_hits == hits + 1
    finally:
        await close_engine(pointed)
        await close_engine(whole)
