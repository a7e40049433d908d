"""What changes the last bits of a prefill's KV: the call's shape, its key length, a matmul's rows?

The prefix cache reuses a prompt's leading blocks only when the KV they hold is what a cache-less
prefill of the new prompt computes, to the bit. This prefills one prompt of --tokens tokens with
the model (the bench's tiny llama unless --model) split into calls several ways and compares each
split's KV with one whole call's, then the two operations a call is made of, alone: the rows of
`x @ W` at several row counts, and fused attention's rows for a query range against a key range.
Run it once per BLAS (`--blas openblas` re-executes itself with the system OpenBLAS preloaded, as
`statecore run --blas auto` does where it is installed). docs/engine.md ("Prefix cache") quotes it.

    .venv/bin/python bench/engine/prefix_bits.py --blas openblas
    .venv/bin/python bench/engine/prefix_bits.py --blas bundled

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # support/: the tiny checkpoints


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="default: the tiny llama, hidden 256, 4 layers")
    parser.add_argument("--blas", choices=["auto", "openblas", "bundled"], default="auto")
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    from adapters.blas import apply_blas_choice, parse_blas_choice

    blas = apply_blas_choice(parse_blas_choice(args.blas))  # (re-executes for a preload)

    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from support.tiny_models import cached_checkpoint

    model_dir = args.model or cached_checkpoint("llama", hidden_size=256, num_layers=4)
    model = load(str(model_dir))[0]
    n = args.tokens
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 200, n).tolist()

    def prefill(calls: list[int], tokens: list[int]) -> list[Any]:
        cache = make_prompt_cache(model)
        start = 0
        for size in calls:
            model(mx.array([tokens[start : start + size]]), cache=cache)
            mx.eval([layer.state for layer in cache])
            start += size
        return cache

    def kv(cache: list[Any], lo: int, hi: int) -> list[Any]:
        return [np.array(buffer[..., lo:hi, :]) for layer in cache for buffer in (layer.keys, layer.values)]

    def differs(a: list[Any], b: list[Any]) -> float:
        return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))

    quarter = n // 4
    whole = prefill([n], prompt)
    report: dict[str, Any] = {"blas": blas, "model": str(model_dir), "tokens": n, "splits": {}, "ops": {}}
    for calls in ([quarter, n - quarter], [quarter] * 4, [n // 2, n - n // 2], [n - quarter, quarter],
                  [n - 24, 24]):
        split = prefill(calls, prompt)
        report["splits"][str(calls)] = {
            f"kv[0:{quarter}] max diff": differs(kv(whole, 0, quarter), kv(split, 0, quarter)),
            f"kv[{quarter}:{n}] max diff": differs(kv(whole, quarter, n), kv(split, quarter, n))}
    other = prompt[: n // 3] + rng.integers(3, 200, n - n // 3).tolist()
    report["splits"]["one call, other tokens after the first third"] = {
        f"kv[0:{n // 3}] max diff": differs(kv(whole, 0, n // 3), kv(prefill([n], other), 0, n // 3))}

    # A block's rows [p, block) computed in a call of their own, after rows [0, p) taken from the
    # whole block's call (the same end): would a hit inside a block give the same bits?
    from mlx_lm.models.cache import KVCache

    block = quarter
    within: dict[str, bool] = {}
    whole_blocks = prefill([block] * 3, prompt)
    for p in (1, 24, block // 2, block - 56, block - 24, block - 1):
        first = prefill([block], prompt)
        cache = []
        for mine, theirs in zip(first, whole_blocks, strict=True):
            own = KVCache()  # type: ignore[no-untyped-call]
            own.keys, own.values = (
                mx.concatenate([mine_part[..., :block, :], their_part[..., block : block + p, :]], axis=2)
                for mine_part, their_part in ((mine.keys, theirs.keys), (mine.values, theirs.values)))
            own.offset = block + p
            cache.append(own)
        for lo, hi in ((block + p, 2 * block), (2 * block, 3 * block)):
            model(mx.array([prompt[lo:hi]]), cache=cache)
            mx.eval([layer.state for layer in cache])
        within[f"rows [{p},{block}) of block 1 alone ({block - p} rows)"] = differs(
            kv(whole_blocks, block, 3 * block), kv(cache, block, 3 * block)) == 0.0
    report["splits"]["inside a block: the KV of blocks 1-2 equal to whole blocks'"] = within

    hidden = model.args.hidden_size
    weights = mx.random.normal((hidden, 4 * hidden), key=mx.random.key(1))
    rows = mx.random.normal((2048, hidden), key=mx.random.key(2))
    all_rows = np.array(rows @ weights)
    report["ops"]["x @ W: rows equal to the 2,048-row product's, by row count"] = {
        m: bool(np.array_equal(np.array(rows[:m] @ weights), all_rows[:m]))
        for m in (1, 7, 64, 255, 256, 1000)}
    heads, dim = 4, 64
    q, k, v = (mx.random.normal((1, heads, n, dim), key=mx.random.key(seed)) for seed in (3, 4, 5))

    def attention(lo: int, hi: int, keys: int) -> Any:
        return np.array(mx.fast.scaled_dot_product_attention(
            q[:, :, lo:hi], k[:, :, :keys], v[:, :, :keys], scale=dim**-0.5, mask="causal"))

    full = attention(0, n, n)
    attended = {}
    for start in (quarter, n // 2, n - 24):
        attended[f"queries [{start},{n}) x keys [0,{n})"] = differs([attention(start, n, n)],
                                                                     [full[:, :, start:]])
        attended[f"queries [0,{start}) x keys [0,{start})"] = differs([attention(0, start, start)],
                                                                       [full[:, :, :start]])
    report["ops"]["attention: max diff from the rows of one causal call over all keys"] = attended
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
