"""What the prefix cache saves: time to the first token of prompts that share a long prefix.

A shared "document" of --shared tokens, then --turns questions of --question tokens each (a
system prompt or a document asked about again and again), each a prefill of its own on one
engine (`MlxEngine`, no HTTP), with the prefix cache on and off, at the given chunk sizes, in
alternating order. Prints the first request's and the follow-ups' median prefill time per setting,
and checks that the first tokens agree with the cache on and off.

    .venv/bin/python bench/engine/prefix_reuse.py [--model DIR] [--shared 3000] [--chunks 2048,256]

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

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # support/: the tiny checkpoints


async def one_setting(model: Path, chunk: int, cache_bytes: int,
                      prompts: list[list[int]]) -> dict[str, Any]:
    from adapters.mlx.engine import MlxEngine
    from effects.engine_port import SamplingParams
    from statecore.ids import RequestId

    engine = await MlxEngine.load(model, prefill_chunk_size=chunk, prefix_cache_bytes=cache_bytes)
    try:
        times, firsts = [], []
        for index, prompt in enumerate(prompts):
            rid = RequestId(f"p{index}")
            started = time.perf_counter()
            outcome = await engine.prefill(rid, prompt, SamplingParams(max_tokens=1))
            times.append(time.perf_counter() - started)
            firsts.append(outcome.first_token)
            await engine.release_held(rid)
        stats = engine.statistics()
        return {"chunk": chunk, "prefix_cache": cache_bytes > 0, "first_s": round(times[0], 3),
                "follow_up_p50_s": round(statistics.median(times[1:]), 3), "first_tokens": firsts,
                "hits": stats.prefix_cache_hits, "tokens_reused": stats.prefix_tokens_reused}
    finally:
        await engine.aclose()


async def main() -> None:
    from support.tiny_models import cached_checkpoint

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--shared", type=int, default=3000)
    parser.add_argument("--question", type=int, default=100)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--chunks", default="2048,256")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or cached_checkpoint("llama", hidden_size=512, num_layers=6)
    shared = [(7 * i + 3) % 500 + 2 for i in range(args.shared)]
    prompts = [shared + [(11 * i + 5 * turn) % 500 + 2 for i in range(args.question)]
               for turn in range(args.turns)]
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        for cache_bytes in (1 << 30, 0) if chunk % 2 else (0, 1 << 30):  # alternate the order
            rows.append(await one_setting(model, chunk, cache_bytes, prompts))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "first_tokens"}), flush=True)
    for chunk in {row["chunk"] for row in rows}:
        on, off = (next(r for r in rows if r["chunk"] == chunk and r["prefix_cache"] is flag)
                   for flag in (True, False))
        same = on["first_tokens"] == off["first_tokens"]
        ratio = on["follow_up_p50_s"] / off["follow_up_p50_s"]
        print(f"chunk {chunk}: follow-up prefill {off['follow_up_p50_s']:.3f} s -> "
              f"{on['follow_up_p50_s']:.3f} s ({ratio:.2f}x) with the cache; first tokens equal: {same}")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    trio.run(main)
