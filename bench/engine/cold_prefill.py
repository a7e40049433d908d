"""Long prompts arriving while 16 streams decode, on the engine alone: which of them stall the streams.

The mixed load (bench/serving/mixed_load.py) shows one gap of about a second in the streams when the first
long prompt arrives. This sends long prompts one after another into a running batch (the first of
4,000 tokens, a second of 4,000 with other tokens, one of 6,000, one more of 4,000) and prints,
for each, its time to first token, the longest gap any stream saw while it was in flight, when
that gap began (seconds after the prompt was sent; its first token came at `ttft`) and the slot
pool's capacity before and after. A gap only on the first of a length points at a cold shape (a
new cuDNN attention graph, or the slot pool growing); one on every prompt at the schedule.

    python3 bench/engine/cold_prefill.py --model /tmp/llama1b

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))

LONG_PROMPTS = ((4000, 1), (4000, 2), (6000, 3), (4000, 4))  # (tokens, salt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds between long prompts")
    parser.add_argument("--warm-request", choices=["default", "on", "off"], default="default",
                        help="MlxEngine.load's warm-up request (default: on with MLX's CUDA backend)")
    parser.add_argument("--prefix-cache-bytes", type=int, default=None, help="0: no prefix cache")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import trio

    from adapters.mlx import MlxEngine
    from effects.engine_port import SamplingParams
    from statecore.events import TokensGenerated
    from statecore.ids import RequestId

    arrivals: list[float] = []  # every stream token's arrival time

    async def stream(engine: MlxEngine, index: int, stop: trio.Event) -> None:
        n = 0
        while not stop.is_set():
            rid = RequestId(f"s{index}-{n}")
            n += 1
            prompt = [3 + (7 * i + 11 * index + 13 * n) % 500 for i in range(100)]
            sampling = SamplingParams(max_tokens=400, ignore_eos=True)
            outcome = await engine.prefill(rid, prompt, sampling)
            await engine.decode_held(rid, prompt, outcome.first_token, sampling)
            async for step in engine.stream(rid):
                if isinstance(step, TokensGenerated):  # (not the end)
                    arrivals.append(time.perf_counter())

    async def long_prompt(engine: MlxEngine, tokens: int, salt: int) -> dict[str, Any]:
        pool = engine._device.pool
        capacity = pool.capacity if pool is not None else None
        tokens = min(tokens, engine.info.context_length - 16)
        prompt = [3 + (5 * i + 17 * salt) % 500 for i in range(tokens)]
        sampling = SamplingParams(max_tokens=8, ignore_eos=True)
        rid = RequestId(f"long{salt}")
        sent = time.perf_counter()
        sent_wall = time.time()
        mark = len(arrivals)
        outcome = await engine.prefill(rid, prompt, sampling)
        ttft = time.perf_counter() - sent
        await engine.decode_held(rid, prompt, outcome.first_token, sampling)
        async for _ in engine.stream(rid):
            pass
        ended = time.perf_counter()
        window = [sent, *[t for t in arrivals[mark:] if t <= ended + 0.5]]
        gaps = [(b - a, a) for a, b in itertools.pairwise(window)]
        worst, began = max(gaps) if gaps else (0.0, sent)
        slow = sorted((s for s in engine.slow_steps() if s.at >= sent_wall), key=lambda s: -s.seconds)
        slowest = [{"ms": round(s.seconds * 1000, 1), "decode_rows": s.decode_rows,
                    "prefill_units": s.prefill_units, "new_traces": s.new_traces,
                    "parts_ms": {kind: round(seconds * 1000, 1) for kind, seconds in s.parts}}
                   for s in slow[:3]]
        return {"slowest_steps": slowest,
                "tokens": tokens, "salt": salt, "ttft_s": round(ttft, 3), "max_gap_s": round(worst, 3),
                "gap_began_s": round(began - sent, 3), "capacity_before": capacity,
                "capacity_after": pool.capacity if pool is not None else None}

    async def run() -> list[dict[str, Any]]:
        started = time.perf_counter()
        warm = None if args.warm_request == "default" else args.warm_request == "on"
        engine = await MlxEngine.load(args.model, warm_request=warm,
                                      prefix_cache_bytes=args.prefix_cache_bytes)
        print(f"loaded in {time.perf_counter() - started:.1f} s", flush=True)
        results = []
        try:
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                for index in range(args.streams):
                    nursery.start_soon(stream, engine, index, stop)
                await trio.sleep(args.settle + 1)
                for tokens, salt in LONG_PROMPTS:
                    result = await long_prompt(engine, tokens, salt)
                    print(json.dumps(result), flush=True)
                    results.append(result)
                    await trio.sleep(args.settle)
                stop.set()
        finally:
            await engine.aclose()
        return results

    results = trio.run(run)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
