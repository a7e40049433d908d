"""Where the time goes between the bare model and the engine: one rung at a time, no HTTP.

Rungs, each at batch B (prompts of --prompt-len random tokens, greedy):
- `bare`: `model(tokens[B, 1], cache)` + argmax, pipelined (bench/engine/bare_decode.py);
- `batchgen_shared` / `batchgen_per_row`: steady-state `BatchGenerator.next()` with one shared
  greedy sampler, or with one sampler object per row (what the engine does: mlx-lm then samples
  row by row);
- `prefill_*`: B prompts prefilled one by one with two synchronous evaluations each (the engine's
  `_prefill_compute`), one by one with one evaluation, and all B in one batched call; the batched
  rows are compared bit for bit with the one-by-one ones (logits of the last token and the cache);
- `engine_prefill_batch_{1,32}`: `MlxEngine` itself (prefill + decode_held + stream, B concurrent
  trio tasks), prefills one by one or batched: tokens/s over the whole run, the median gap between
  one stream's tokens, and the device thread's time by kind of work.

    python3 bench/engine/engine_ladder.py --model /tmp/llama1b --batch 1,8,32 --out ladder.json

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bare_decode import decode_rate


def _prompts(batch: int, length: int, vocab_hi: int, salt: int) -> list[list[int]]:
    ids = mx.random.randint(3, vocab_hi, (batch, length), key=mx.random.key(1000 + salt))
    rows: list[list[int]] = ids.tolist()  # type: ignore[assignment]
    return rows


def batchgen_rate(model: Any, batch: int, prompt_len: int, steps: int, vocab_hi: int,
                  per_row: bool) -> dict[str, Any]:
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import greedy_sampler

    def own_sampler(logprobs: mx.array) -> mx.array:
        return greedy_sampler(logprobs)

    gen = BatchGenerator(model, sampler=greedy_sampler, completion_batch_size=max(batch, 32),
                         prefill_batch_size=min(8, batch))
    prompts = _prompts(batch, prompt_len, vocab_hi, batch)
    samplers = [own_sampler if per_row else greedy_sampler for _ in prompts] if per_row else None
    gen.insert(prompts, max_tokens=[steps + 64] * batch, samplers=samplers)
    while len(gen._generation_batch) < batch:
        gen.next()
    for _ in range(5):
        gen.next()
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        gen.next()
    elapsed = time.perf_counter() - start
    gen.close()
    return {"batch": batch, "ms_per_step": 1000 * elapsed / steps, "tok_s": batch * steps / elapsed}


def prefill_compare(model: Any, batch: int, prompt_len: int, vocab_hi: int) -> dict[str, Any]:
    from mlx_lm.models.cache import make_prompt_cache

    prompts = _prompts(batch, prompt_len, vocab_hi, 77 + batch)

    def one(tokens: list[int], evals: int) -> tuple[mx.array, list[Any]]:
        cache = make_prompt_cache(model)
        arr = mx.array(tokens)
        model(arr[:-1][None], cache=cache)
        if evals == 2:
            mx.eval([c.state for c in cache])
        logits = model(arr[-1:][None], cache=cache)[:, -1, :]
        mx.eval(logits, [c.state for c in cache])
        return logits, cache

    def batched() -> tuple[mx.array, list[Any]]:
        cache = make_prompt_cache(model)
        arr = mx.array(prompts)
        model(arr[:, :-1], cache=cache)
        logits = model(arr[:, -1:], cache=cache)[:, -1, :]
        mx.eval(logits, [c.state for c in cache])
        return logits, cache

    def timed(fn: Any) -> tuple[float, Any]:
        fn()  # warm-up for this shape
        mx.synchronize()
        start = time.perf_counter()
        value = fn()
        mx.synchronize()
        return 1000 * (time.perf_counter() - start), value

    ms_two, singles = timed(lambda: [one(p, 2) for p in prompts])
    ms_one, _ = timed(lambda: [one(p, 1) for p in prompts])
    ms_batched, (logits_b, cache_b) = timed(batched)
    logits_equal = all(
        bool(mx.array_equal(singles[i][0][0], logits_b[i])) for i in range(batch)
    )
    keys_equal = all(
        bool(mx.array_equal(singles[i][1][0].keys[..., :prompt_len, :][0],
                            cache_b[0].keys[i, :, :prompt_len, :]))
        for i in range(batch)
    )
    argmax_equal = all(
        int(mx.argmax(singles[i][0][0]).item()) == int(mx.argmax(logits_b[i]).item()) for i in range(batch)
    )
    return {"batch": batch, "one_by_one_two_evals_ms": ms_two, "one_by_one_one_eval_ms": ms_one,
            "batched_ms": ms_batched, "batched_logits_bit_identical": logits_equal,
            "batched_layer0_keys_bit_identical": keys_equal, "batched_argmax_identical": argmax_equal}


def engine_rate(model_dir: Path, batch: int, prompt_len: int, max_tokens: int, vocab_hi: int,
                prefill_batch: int) -> dict[str, Any]:
    import trio

    from adapters.mlx import MlxEngine
    from effects.engine_port import SamplingParams
    from statecore.events import TokensGenerated
    from statecore.ids import RequestId

    prompts = _prompts(batch, prompt_len, vocab_hi, 500 + batch)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    gaps: list[float] = []
    counts: list[int] = []

    async def one(engine: MlxEngine, index: int, salt: str) -> None:
        rid = RequestId(f"ladder-{salt}-{index}")
        outcome = await engine.prefill(rid, prompts[index], sampling)
        await engine.decode_held(rid, prompts[index], outcome.first_token, sampling)
        n = 1
        last = time.perf_counter()
        async for step in engine.stream(rid):
            if not isinstance(step, TokensGenerated):
                continue  # the end
            now = time.perf_counter()
            if index == 0:
                gaps.append(now - last)
            last = now
            n += 1
        counts.append(n)

    async def run() -> dict[str, Any]:
        engine = await MlxEngine.load(model_dir, max_batch=max(32, batch), prefill_batch=prefill_batch)
        try:
            async with trio.open_nursery() as nursery:  # warm-up wave
                for i in range(batch):
                    nursery.start_soon(one, engine, i, "warm")
            gaps.clear()
            counts.clear()
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(batch):
                    nursery.start_soon(one, engine, i, "timed")
            elapsed = time.perf_counter() - start
            profile = engine.device_profile()
        finally:
            await engine.aclose()
        return {"batch": batch, "tokens": sum(counts), "seconds": elapsed,
                "tok_s": sum(counts) / elapsed,
                "gap_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
                "device_profile_both_waves": {k: [n, round(sec, 4)] for k, (n, sec) in profile.items()}}

    return trio.run(run)


def engine_closed_loop(model_dir: Path, batch: int, prompt_len: int, max_tokens: int, vocab_hi: int,
                       seconds: float) -> dict[str, Any]:
    """B workers, each sending its next request when the last one ends (as the HTTP bench does,
    minus HTTP): rows join and leave the decode batch at staggered times."""
    import trio

    from adapters.mlx import MlxEngine
    from effects.engine_port import SamplingParams
    from statecore.events import TokensGenerated
    from statecore.ids import RequestId

    prompts = _prompts(batch * 64, prompt_len, vocab_hi, 900 + batch)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    gaps: list[float] = []
    produced = [0]

    async def worker(engine: MlxEngine, index: int, deadline: float) -> None:
        n = 0
        while time.perf_counter() < deadline:
            rid = RequestId(f"loop-{index}-{n}")
            prompt = prompts[(index * 64 + n) % len(prompts)]
            n += 1
            outcome = await engine.prefill(rid, prompt, sampling)
            await engine.decode_held(rid, prompt, outcome.first_token, sampling)
            last = time.perf_counter()
            produced[0] += 1
            async for step in engine.stream(rid):
                if not isinstance(step, TokensGenerated):
                    continue  # the end
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
                produced[0] += len(step.tokens)

    async def run() -> dict[str, Any]:
        engine = await MlxEngine.load(model_dir, max_batch=max(32, batch))
        try:
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(batch):
                    nursery.start_soon(worker, engine, i, start + seconds)
            elapsed = time.perf_counter() - start
            profile = engine.device_profile()
        finally:
            await engine.aclose()
        return {"batch": batch, "tok_s": produced[0] / elapsed,
                "gap_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
                "device_profile": {k: [n, round(sec, 4)] for k, (n, sec) in profile.items()}}

    return trio.run(run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--vocab-hi", type=int, default=512)
    parser.add_argument("--rungs", default="bare,batchgen,prefill,engine")
    parser.add_argument("--switch-interval", default="",
                        help="comma-separated sys.setswitchinterval values (s) to run the engine rung with")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from mlx_lm import load

    rungs = set(args.rungs.split(","))
    model = load(str(args.model))[0]
    result: dict[str, Any] = {"model": str(args.model), "device": str(mx.default_device())}
    for b in (int(x) for x in args.batch.split(",") if x):
        row: dict[str, Any] = {}
        if "bare" in rungs:
            row["bare"] = decode_rate(model, b, args.prompt_len, args.steps, args.vocab_hi)
        if "batchgen" in rungs:
            for name, per_row in (("batchgen_shared", False), ("batchgen_per_row", True)):
                row[name] = batchgen_rate(model, b, args.prompt_len, args.steps, args.vocab_hi, per_row)
        if "prefill" in rungs:
            row["prefill"] = prefill_compare(model, b, args.prompt_len, args.vocab_hi)
        if "closed_loop" in rungs:
            row["engine_closed_loop"] = engine_closed_loop(
                args.model, b, args.prompt_len, args.max_tokens, args.vocab_hi, 8.0)
        if "engine" in rungs:
            default_interval = sys.getswitchinterval()
            for prefill_batch in (1, 32):
                row[f"engine_prefill_batch_{prefill_batch}"] = engine_rate(
                    args.model, b, args.prompt_len, args.max_tokens, args.vocab_hi, prefill_batch)
            for interval in (float(x) for x in args.switch_interval.split(",") if x):
                sys.setswitchinterval(interval)
                row[f"engine_prefill_batch_32_switch_{interval:g}"] = engine_rate(
                    args.model, b, args.prompt_len, args.max_tokens, args.vocab_hi, 32)
                sys.setswitchinterval(default_interval)
        result[f"batch_{b}"] = row
        print(json.dumps({f"batch_{b}": row}), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
