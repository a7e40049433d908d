"""The slot lane's decode step against the bare model, kernel for kernel, no engine around it.

`bare`: `model(tokens[B, 1], KVCache)` + argmax, one evaluation per step. `slots`: the same model
call over `adapters.mlx.slots.SlotPool` (per-row offsets, a boolean mask, a scatter per buffer).
Prints ms per step for each, at batch 32 and a 256-token history.

    python3 bench/slot_step.py --model /tmp/llama1b

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def main() -> None:
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from adapters.mlx.slots import SlotPool, SlotStepLayer

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--history", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    model = load(args.model)[0]
    b, n = args.batch, args.history
    prompt = mx.random.randint(3, 500, (b, n))
    cache = make_prompt_cache(model)
    mx.eval(model(prompt, cache=cache))

    def timed(step, label: str) -> None:
        tok = mx.zeros((b,), dtype=mx.uint32)
        for _ in range(5):
            tok = step(tok)
            mx.eval(tok)
        start = time.perf_counter()
        for _ in range(args.steps):
            tok = step(tok)
            mx.async_eval(tok)
        mx.eval(tok)
        print(f"{label}: {(time.perf_counter() - start) / args.steps * 1e3:.2f} ms/step", flush=True)

    timed(lambda t: mx.argmax(model(t[:, None], cache=cache)[:, -1, :], axis=-1), "bare (KVCache)")
    pool = SlotPool(b, len(cache), 8192)
    one = []
    for layer in cache:
        from mlx_lm.models.cache import KVCache
        c = KVCache()
        c.keys, c.values, c.offset = layer.keys[:1], layer.values[:1], n
        one.append(c)
    pool.reserve(n + 2 * args.steps + 64, one)
    for slot in range(b):
        pool.write_prompt(slot, one, n)
    offsets = [n] * b

    def slot_step(t):
        layers = pool.step_layers(offsets)
        for i in range(b):
            offsets[i] += 1
        return mx.argmax(model(t[:, None], cache=layers)[:, -1, :], axis=-1)

    timed(slot_step, "slots (mask, scatter)")

    # The same step with the mask dropped (wrong numbers, timing only): what the mask costs.
    def unmasked_step(t):
        layers = pool.step_layers(offsets)
        for layer in layers:
            layer._mask = None
        for i in range(b):
            offsets[i] += 1
        return mx.argmax(model(t[:, None], cache=layers)[:, -1, :], axis=-1)

    SlotStepLayer.make_mask = lambda self, n, return_array=False, window_size=None: self._mask
    timed(unmasked_step, "slots without the mask (timing only)")


if __name__ == "__main__":
    main()
