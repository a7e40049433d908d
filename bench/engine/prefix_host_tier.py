"""The prefix cache's host tier on one engine: a resent document's first token when its blocks are
on the device, in the host pool (taken back, `--prefix-host-pull auto`), or not cached at all.

Each round asks one new document (--tokens tokens, then a 64-token question) three times on an
engine with the prefix cache and its host tier (`prefix_host_bytes` default: on with MLX's CUDA
backend; --host-bytes to set it, e.g. on the CPU), evicting every device block to the host pool
before the third, and once on an engine without a prefix cache. Prints each prefill's seconds,
its cached tokens, whether the host blocks came back, and checks that the third request's first
token and held KV equal the cache-less engine's to the bit (exit 1 if not). At the end: the
rates `prefix_pull_pays` weighed (host-to-device bytes/s, prefill tokens/s, KV bytes per token)
and the host pool's counters. Round 0 meets the shapes (reported, not in the medians).

    python3 bench/engine/prefix_host_tier.py --model /tmp/llama1b --tokens 8000 --rounds 4

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # support/: the tiny checkpoints

from adapters.mlx.engine import MlxEngine  # noqa: E402
from effects.engine_port import SamplingParams  # noqa: E402
from statecore.ids import RequestId  # noqa: E402

ONE_TOKEN = SamplingParams(max_tokens=1)


def tokens_of(n: int, salt: int, vocab: int) -> list[int]:
    return [(7 * i + 3 + 11 * salt) % (vocab - 3) + 2 for i in range(n)]


async def prefill(engine: MlxEngine, rid: str, prompt: list[int]) -> tuple[float, int, int, bytes]:
    """(seconds, first token, cached tokens, held KV bytes) of one prefill; the held cache released."""
    started = time.perf_counter()
    outcome = await engine.prefill(RequestId(rid), prompt, ONE_TOKEN)
    seconds = time.perf_counter() - started
    held = (await engine.export_held(RequestId(rid))).joined()
    await engine.release_held(RequestId(rid))
    return seconds, outcome.first_token, outcome.cached_tokens, held


async def main(args: argparse.Namespace) -> int:
    options: dict[str, Any] = {"kv_memory_bytes": args.kv_memory_bytes}
    tiered = await MlxEngine.load(args.model, prefix_host_bytes=args.host_bytes, **options)
    plain = await MlxEngine.load(args.model, prefix_cache_bytes=0, **options)
    vocab = min(tiered.info.vocab_size, args.vocab)
    rows: list[dict[str, Any]] = []
    same = True
    try:
        for round_ in range(args.rounds):
            document = tokens_of(args.tokens, 100 + round_, vocab)
            asks = [[*document, *tokens_of(64, 1000 * round_ + q, vocab)] for q in range(3)]
            cold = await prefill(tiered, "cold", asks[0])
            device = await prefill(tiered, "device", asks[1])
            before = tiered.statistics()
            evicting = time.perf_counter()
            await tiered.evict_prefixes(before.prefix_cache_bytes)
            evict_s = time.perf_counter() - evicting
            moved = tiered.statistics()
            host = await prefill(tiered, "host", asks[2])
            after = tiered.statistics()
            alone = await prefill(plain, "host", asks[2])
            equal = host[1:2] + host[3:] == alone[1:2] + alone[3:]
            same = same and equal
            row = {"round": round_, "cold_s": round(cold[0], 4), "device_s": round(device[0], 4),
                   "host_s": round(host[0], 4), "no_cache_s": round(alone[0], 4),
                   "evict_to_host_s": round(evict_s, 4), "cached": [cold[2], device[2], host[2]],
                   "host_bytes_after_evict": moved.prefix_host_bytes,
                   "blocks_back": after.prefix_host_back - before.prefix_host_back,
                   "host_equals_no_cache_bits": equal}
            rows.append(row)
            print(json.dumps(row), flush=True)
        prefix = tiered._device.prefix
        stats = tiered.statistics()
        summary: dict[str, Any] = {
            "model": str(args.model), "tokens": args.tokens,
            "rates": None if prefix is None else repr(prefix.rates),
            "prefill_token_s": tiered._device.rates.prefill_token_s,  # the device loop's, what auto weighs
            "host_capacity_bytes": stats.prefix_host_capacity_bytes, "host_bytes": stats.prefix_host_bytes,
            "blocks_out": stats.prefix_host_out, "blocks_back": stats.prefix_host_back,
            "blocks_forgotten": stats.prefix_host_forgotten, "all_bits_equal": same,
        }
        measured = rows[1:] or rows
        for key in ("cold_s", "device_s", "host_s", "no_cache_s", "evict_to_host_s"):
            summary[f"median_{key}"] = round(statistics.median(r[key] for r in measured), 4)
        summary["host_over_no_cache"] = round(summary["median_host_s"] / summary["median_no_cache_s"], 3)
        summary["host_over_device"] = round(summary["median_host_s"] / summary["median_device_s"], 3)
        print(json.dumps(summary), flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps({"rounds": rows, "summary": summary}, indent=1))
    finally:
        await tiered.aclose()
        await plain.aclose()
    return 0 if same else 1


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="default: the tests' tiny llama (CPU)")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--host-bytes", type=int, default=None,
                        help="the host tier's capacity (default: the engine's, off on the CPU backend)")
    parser.add_argument("--kv-memory-bytes", type=int, default=8 << 30)
    parser.add_argument("--vocab", type=int, default=500, help="prompt token ids stay below this")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.model is None:
        from support.tiny_models import cached_checkpoint

        args.model = cached_checkpoint("llama")
    return trio.run(main, args)


if __name__ == "__main__":
    code = cli()
    sys.stdout.flush()
    os._exit(code)  # MLX's C++ teardown aborts a few percent of exits (src/adapters/serve/command.py)
