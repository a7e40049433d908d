"""Which BLAS does MLX's CPU backend use here, and how fast is a model with it?

Prints the BLAS libraries mapped into this process (from /proc/self/maps), a float32 matmul's
GFLOP/s, a model's prefill and decode tokens/s (mlx-lm calls, no server) and a digest of its
greedy tokens and last logits, as one JSON line. Run it twice, once with the system OpenBLAS
preloaded, to compare: `bench/blas_compare.py` does that, alternating. Bench code: may import
anything; nothing in src/ imports it.

    .venv/bin/python bench/blas_check.py --model DIR
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 .venv/bin/python bench/blas_check.py --model DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

SRC = Path(__file__).resolve().parent.parent / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))


def mapped_blas() -> list[str]:
    """Shared objects with blas/lapack in their name mapped into this process."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    names = {line.split()[-1] for line in lines if len(line.split()) >= 6}
    return sorted(n for n in names if "blas" in n.lower() or "lapack" in n.lower())


def matmul_gflops(n: int = 1024, reps: int = 5) -> float:
    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a, b, a @ b)
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(a @ b)
    elapsed = time.perf_counter() - start
    return 2 * n**3 * reps / elapsed / 1e9


def model_speed(model_dir: Path, prompt_len: int, decode_tokens: int) -> dict[str, Any]:
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model = load(str(model_dir))[0]
    vocab = int(model.args.vocab_size)
    prompt = mx.array([[3 + (i * 7919) % (vocab - 3) for i in range(prompt_len)]])
    # warm up (first call compiles kernels and allocates)
    warm = make_prompt_cache(model)
    mx.eval(model(prompt[:, :32], cache=warm))
    cache = make_prompt_cache(model)
    start = time.perf_counter()
    logits = model(prompt, cache=cache)
    mx.eval(logits)
    prefill_s = time.perf_counter() - start
    token = mx.argmax(logits[:, -1, :], axis=-1)
    tokens = [int(cast(int, token.item()))]
    start = time.perf_counter()
    for _ in range(decode_tokens - 1):
        logits = model(token[:, None], cache=cache)
        token = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(token)
        tokens.append(int(cast(int, token.item())))
    decode_s = time.perf_counter() - start
    last = logits[:, -1, :].astype(mx.float32)
    mx.eval(last)
    digest = hashlib.sha256(bytes(memoryview(last))).hexdigest()[:16]
    return {
        "prompt_tokens": prompt_len,
        "prefill_tok_s": prompt_len / prefill_s,
        "decode_tok_s": (decode_tokens - 1) / decode_s,
        "tokens_sha": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
        "last_logits_sha": digest,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    mx.set_default_device(mx.cpu)
    result: dict[str, Any] = {
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "blas_mapped": mapped_blas(),
        "matmul_1024_gflops": matmul_gflops(),
    }
    result.update(model_speed(args.model, args.prompt_len, args.decode_tokens))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
