"""How often greedy tokens differ between a two-rank tensor-parallel model and one rank.

The models: the tiny llama and qwen3 test checkpoints (float32, random weights) and the demo model
(float16, trained).

Starts itself as rank 1 over the ring backend on 127.0.0.1 (`start_local_ranks`); both ranks load
their shard (`load_model(shard_group=...)`) and decode the same prompts greedily, token by token
with mlx-lm's KV cache; rank 0 also decodes them with the whole model and counts: prompts whose
continuation diverges anywhere, generated tokens equal before the first divergence, and the
largest difference of the first step's logits. Run: `python bench/engine/tp_parity.py [--prompts 50]`.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from adapters.mlx.distributed import RANK_ENV, start_local_ranks
from adapters.mlx.loading import load_model
from adapters.serve.flags import demo_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # support/: the tiny checkpoints
from support.tiny_models import cached_checkpoint


def greedy(model: Any, prompt: list[int], steps: int) -> tuple[list[int], Any]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1, :]
    first = logits
    out: list[int] = []
    for _ in range(steps):
        token = int(mx.argmax(logits, axis=-1).item())  # type: ignore[arg-type]
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
    return out, first


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    children = start_local_ranks(2, [__file__, *sys.argv[1:]]) if RANK_ENV not in os.environ else []
    group = mx.distributed.init(strict=True, backend="ring")
    rank = group.rank()
    checkpoints = {"llama": cached_checkpoint("llama"), "qwen3": cached_checkpoint("qwen3"),
                   "demo (float16)": demo_model_dir()}
    for family, path in checkpoints.items():
        sharded = load_model(path, trust_remote_code=False, shard_group=group).model
        whole = load_model(path, trust_remote_code=False).model if rank == 0 else None
        rng = random.Random(0)
        diverged = equal_tokens = 0
        worst = 0.0
        for _ in range(args.prompts):
            prompt = [rng.randrange(6, 500) for _ in range(rng.randrange(8, 64))]
            two, first_two = greedy(sharded, prompt, args.tokens)
            if whole is None:
                continue
            one, first_one = greedy(whole, prompt, args.tokens)
            worst = max(worst, float(mx.max(mx.abs(first_two - first_one)).item()))  # type: ignore[arg-type]
            same = next((i for i, (a, b) in enumerate(zip(one, two, strict=True)) if a != b), len(one))
            equal_tokens += same
            diverged += same < len(one)
        if rank == 0:
            print(f"{family}: {diverged} of {args.prompts} greedy continuations diverge; "
                  f"{equal_tokens} of {args.prompts * args.tokens} tokens equal before the first "
                  f"divergence; first-step logits differ by at most {worst:.2e}", flush=True)
    for child in children:
        child.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
