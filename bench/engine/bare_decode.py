"""The hardware reference: bare mlx-lm model calls, no server, no sampling beyond argmax.

For each batch size B: prefill B random prompts of --prompt-len tokens together (one KVCache per
layer, batch dimension B), then time --steps decode steps of `model(tokens[B, 1], cache)` + argmax,
pipelined the way mlx-lm's `generate_step` does (the next step's graph is built and queued with
`mx.async_eval` before the current token is read). Reports ms/step and tokens/s (B / step time),
plus batch-1 prefill tokens/s at --prefill-len tokens (the TTFT floor). One JSON document.

    python3 bench/engine/bare_decode.py --model /tmp/llama1b --batch 1,8,32 --out bare.json

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx


def decode_rate(model: Any, batch: int, prompt_len: int, steps: int, vocab_hi: int) -> dict[str, float]:
    from mlx_lm.models.cache import make_prompt_cache

    prompts = mx.random.randint(3, vocab_hi, (batch, prompt_len), key=mx.random.key(batch))
    cache = make_prompt_cache(model)
    logits = model(prompts, cache=cache)
    token = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(token)

    def step(tok: mx.array) -> mx.array:
        out = model(tok[:, None], cache=cache)
        return mx.argmax(out[:, -1, :], axis=-1)

    for _ in range(5):  # warm-up: kernels compiled, buffers allocated
        token = step(token)
        mx.eval(token)
    mx.synchronize()
    start = time.perf_counter()
    nxt = step(token)
    mx.async_eval(nxt)  # type: ignore[no-untyped-call]
    for _ in range(steps - 1):
        token = nxt
        nxt = step(token)
        mx.async_eval(nxt)  # type: ignore[no-untyped-call]
        token.tolist()  # read the current step while the next one runs
    nxt.tolist()
    elapsed = time.perf_counter() - start
    return {"batch": batch, "ms_per_step": 1000 * elapsed / steps, "tok_s": batch * steps / elapsed}


def prefill_rate(model: Any, length: int, vocab_hi: int, reps: int = 3) -> dict[str, float]:
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.random.randint(3, vocab_hi, (1, length), key=mx.random.key(7))
    best = float("inf")
    for _ in range(reps + 1):  # the first is a warm-up
        cache = make_prompt_cache(model)
        start = time.perf_counter()
        mx.eval(model(prompt, cache=cache))
        best = min(best, time.perf_counter() - start)
    return {"prompt_tokens": length, "ms": 1000 * best, "tok_s": length / best}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--vocab-hi", type=int, default=512, help="prompt ids are drawn below this")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from mlx_lm import load

    model = load(str(args.model))[0]
    result: dict[str, Any] = {"model": str(args.model), "device": str(mx.default_device()),
                              "decode": [], "prefill": None}
    for b in (int(x) for x in args.batch.split(",") if x):
        row = decode_rate(model, b, args.prompt_len, args.steps, args.vocab_hi)
        result["decode"].append(row)
        print(f"bare decode batch {b:3d}: {row['ms_per_step']:7.2f} ms/step  {row['tok_s']:9.1f} tok/s",
              flush=True)
    result["prefill"] = prefill_rate(model, args.prefill_len, args.vocab_hi)
    print(f"bare prefill {args.prefill_len} tokens: {result['prefill']['ms']:.1f} ms "
          f"({result['prefill']['tok_s']:.0f} tok/s)", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
