"""The slot lane's attention kernel (`adapters.mlx.attention`) on the GPU: does it agree with the
masked reference, and what does it save?

1. `check_kernel` on several head layouts and dtypes (exit 1 when any disagrees).
2. One attention call, kernels only, at realish-like ragged lengths: the kernel (a few chunk /
   warp settings), MLX's masked attention over the rows (what the slot lane did before), and MLX's
   unmasked attention over the longest length (a floor that ignores the ragged lengths).
3. The whole slot step on a model at batch 32 and 8 (ragged) and 16 rows of ~4,000 tokens: masked
   vs kernel, and how many greedy tokens of 64 steps agree from the same start.

    python3 bench/engine/decode_attention.py --model /tmp/llama1b --out bench/results/gpu/attention.json

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib (src/ too)


def timed_ms(call: Any, repeats: int) -> float:
    for _ in range(3):
        mx.eval(call())
    start = time.perf_counter()
    out = None
    for _ in range(repeats):
        out = call()
        mx.async_eval(out)  # type: ignore[no-untyped-call]
    mx.eval(out)
    return round(1000 * (time.perf_counter() - start) / repeats, 4)


def checks() -> dict[str, str]:
    from adapters.mlx.attention import check_kernel

    found = {}
    # Each layout and dtype compiles its kernels (NVRTC, seconds each): a few representative ones.
    layouts = ((32, 8, 64, mx.bfloat16), (16, 8, 128, mx.float16), (14, 2, 64, mx.float32))
    for heads, kv_heads, dim, dtype in layouts:
        why = check_kernel(heads, kv_heads, dim, dtype)
        found[f"{heads}/{kv_heads}x{dim} {dtype}"] = why or "ok"
    return found


def ragged_lengths(batch: int, seed: int = 5) -> list[int]:
    from benchlib import Mix

    rng = random.Random(seed)
    return [p + o // 2 for p, o in Mix("realish").lengths(batch, rng)]


def one_call(batch: int, lengths: list[int], repeats: int) -> dict[str, Any]:
    from adapters.mlx import attention

    heads, kv_heads, dim = 32, 8, 64
    capacity = 1 << max(8, (max(lengths) - 1).bit_length())
    key = mx.random.key(1)
    qk, kk, vk = mx.random.split(key, 3)
    queries = mx.random.normal((batch, heads, 1, dim), key=qk).astype(mx.bfloat16)
    keys = mx.random.normal((batch, kv_heads, capacity, dim), key=kk).astype(mx.bfloat16)
    values = mx.random.normal((batch, kv_heads, capacity, dim), key=vk).astype(mx.bfloat16)
    slots = mx.arange(batch, dtype=mx.int32)
    lens = mx.array(lengths, dtype=mx.int32)
    longest = max(lengths)
    mask = (mx.arange(longest)[None, :] < lens[:, None])[:, None, None, :]
    mx.eval(queries, keys, values, mask)
    out: dict[str, Any] = {"batch": batch, "longest": longest, "p50": sorted(lengths)[batch // 2]}
    out["masked_ms"] = timed_ms(lambda: mx.fast.scaled_dot_product_attention(
        queries, keys[:, :, :longest], values[:, :, :longest], scale=0.125, mask=mask), repeats)
    out["unmasked_longest_ms"] = timed_ms(lambda: mx.fast.scaled_dot_product_attention(
        queries, keys[:, :, :longest], values[:, :, :longest], scale=0.125), repeats)
    want = attention.reference_attention(queries, keys, values, slots, lens, 0.125, longest)
    default = (attention._CHUNK, attention._WARPS)
    for chunk, warps in ((512, 16), (256, 8), (2048, 32)):
        attention._CHUNK, attention._WARPS = chunk, warps
        got = attention.kernel_attention(queries, keys, values, slots, lens, 0.125, longest)
        error = float(mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item())
        out[f"kernel_{chunk}x{warps}_ms"] = timed_ms(
            lambda: attention.kernel_attention(queries, keys, values, slots, lens, 0.125, longest), repeats)
        out[f"kernel_{chunk}x{warps}_max_error"] = round(error, 5)
    attention._CHUNK, attention._WARPS = default
    return out


def slot_steps(model_dir: Path, batch: int, lengths: list[int], steps: int) -> dict[str, Any]:
    from mlx_lm import load
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from adapters.mlx import attention
    from adapters.mlx.slots import SlotPool

    model = load(str(model_dir))[0]
    attention.route_attention()
    longest = max(lengths)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(3, 500, (1, longest)), cache=cache))
    one = []
    for layer in cache:
        c = KVCache()  # type: ignore[no-untyped-call]
        c.keys, c.values, c.offset = layer.keys, layer.values, longest
        one.append(c)
    result: dict[str, Any] = {"batch": batch, "longest": longest, "p50": sorted(lengths)[batch // 2]}
    # The bare model over mlx-lm's KVCache at the longest length: the step without slots.
    wide = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(3, 500, (batch, longest)), cache=wide))
    bare = {"tok": mx.zeros((batch,), dtype=mx.uint32)}

    def bare_step(state: dict[str, Any] = bare) -> Any:
        state["tok"] = mx.argmax(model(state["tok"][:, None], cache=wide)[:, -1, :], axis=-1)
        return state["tok"]

    result["kvcache_longest_ms"] = timed_ms(bare_step, steps)
    tokens: dict[str, list[list[int]]] = {}
    default = (attention._CHUNK, attention._WARPS)
    variants = (("masked", None, default), ("kernel", attention.kernel_attention, default),
                ("kernel_256x8", attention.kernel_attention, (256, 8)))
    for name, fused, (chunk, warps) in variants:
        attention._CHUNK, attention._WARPS = chunk, warps
        pool = SlotPool(batch, len(cache), 1 << 15)
        pool.reserve(longest + 2 * steps + 64, one)
        for slot in range(batch):
            pool.write_prompt(slot, one, lengths[slot])
        mx.eval(pool.keys, pool.values)
        pool.attention = fused
        offsets = list(lengths)

        def step(t: Any, pool: Any = pool, offsets: list[int] = offsets) -> Any:
            layers = pool.step_layers(offsets, bucket=128)
            for i in range(batch):
                offsets[i] += 1
            return mx.argmax(model(t[:, None], cache=layers)[:, -1, :], axis=-1).astype(mx.uint32)

        # The same start for every variant: greedy tokens of `steps` steps, then the timing.
        tok = mx.array([(7 * i + 3) % 500 for i in range(batch)], dtype=mx.uint32)
        seen = []
        building = []
        for _ in range(steps):
            started = time.perf_counter()
            tok = step(tok)
            building.append(time.perf_counter() - started)  # host: graph building only
            seen.append(tok.tolist())
        tokens[name] = seen
        state = {"tok": tok}

        def timed_step(state: dict[str, Any] = state, step: Any = step) -> Any:
            state["tok"] = step(state["tok"])
            return state["tok"]

        result[f"{name}_ms"] = timed_ms(timed_step, steps)
        result[f"{name}_build_ms"] = round(1000 * sorted(building)[len(building) // 2], 3)
    attention._CHUNK, attention._WARPS = default
    same = sum(a == b for ra, rb in zip(tokens["masked"], tokens["kernel"], strict=True)
               for a, b in zip(ra, rb, strict=True))
    result["greedy_tokens_equal"] = f"{same}/{batch * steps}"
    first_diff = next((i for i, (ra, rb) in enumerate(zip(tokens["masked"], tokens["kernel"], strict=True))
                       if ra != rb), None)
    result["first_step_that_differs"] = first_diff
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report: dict[str, Any] = {"device": str(mx.default_device()), "checks": checks()}
    print(json.dumps(report["checks"], indent=1), flush=True)
    bad = [k for k, v in report["checks"].items() if v != "ok"]
    report["one_call"] = [one_call(32, ragged_lengths(32), 200)]
    for row in report["one_call"]:
        print(json.dumps(row), flush=True)
    if args.model is not None and not bad:
        report["slot_step"] = [slot_steps(args.model, 32, ragged_lengths(32), args.steps),
                               slot_steps(args.model, 8, ragged_lengths(8, 9), args.steps),
                               slot_steps(args.model, 16, [4000] * 4 + ragged_lengths(12, 3), args.steps)]
        for row in report["slot_step"]:
            print(json.dumps(row), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
