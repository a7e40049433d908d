"""How long a tensor-parallel decode instance takes to install a handed-off KV payload.

Starts itself as ranks 1..N-1 (`--ranks`, default 2) over the ring backend on 127.0.0.1
(`start_local_ranks`); every rank loads
the engine (`MlxEngine.load(tensor=...)`, the model given); rank 0 then installs a payload of
`--tokens` tokens as a one-rank prefill node sends it (every head; random keys and values of the
model's KV shape and dtype: an install does not read them) `--repeat` times. Each `install` is
timed from the call until the request is in every rank's decoder (validation, the job that hands
each rank its heads, the copy into a slot); the request then finishes its two tokens. Run:
`python bench/engine/tp_install.py MODEL_DIR [--tokens 2000] [--repeat 7] [--ranks 2]`. Bench code: may import
anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import trio
from mlx_lm.models.cache import KVCache

from adapters.kv import codec
from adapters.mlx import MlxEngine
from adapters.mlx.distributed import RANK_ENV, join_group, start_local_ranks, watch_follower
from effects.engine_port import SamplingParams
from statecore.ids import RequestId


def payload(model_dir: Path, fingerprint: str, tokens: int) -> bytes:
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dtype = {"bfloat16": mx.bfloat16, "float16": mx.float16}.get(config.get("torch_dtype"), mx.float32)
    caches = []
    for _ in range(config["num_hidden_layers"]):
        layer = KVCache()  # type: ignore[no-untyped-call]
        shape = (1, heads, tokens, head_dim)
        layer.update_and_fetch(mx.random.normal(shape).astype(dtype),  # type: ignore[no-untyped-call]
                               mx.random.normal(shape).astype(dtype))
        caches.append(layer)
    return b"".join(codec.encode_cache(caches, fingerprint=fingerprint, token_count=tokens))


async def lead(model_dir: Path, tokens: int, repeat: int, ranks: int) -> None:
    tensor = join_group("ring", ranks, 1.0)
    engine = await MlxEngine.load(model_dir, tensor=tensor)
    body = payload(model_dir, engine.info.fingerprint, tokens)
    prompt = [5 + i % 400 for i in range(tokens)]
    times = []
    for index in range(repeat):
        request = RequestId(f"install-{index}")
        started = time.perf_counter()
        await engine.install(request, body, prompt, 7, SamplingParams(max_tokens=2, ignore_eos=True))
        times.append(time.perf_counter() - started)
        async for _ in engine.stream(request):
            pass
    print(f"{ranks} ranks, {tokens} tokens, payload {len(body) / 2**20:.1f} MiB: install median "
          f"{statistics.median(times) * 1000:.0f} ms, min {min(times) * 1000:.0f} ms, max "
          f"{max(times) * 1000:.0f} ms over {repeat}", flush=True)
    await engine.aclose()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    if RANK_ENV in os.environ and os.environ[RANK_ENV] != "0":
        tensor = join_group("ring", args.ranks, 1.0)
        engine = trio.run(partial(MlxEngine.load, args.model, tensor=tensor))
        return watch_follower(engine.follower_loop, engine.device_thread, 0, None)
    children = start_local_ranks(args.ranks, [__file__, *sys.argv[1:]])
    trio.run(lead, args.model, args.tokens, args.repeat, args.ranks)
    for child in children:
        child.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
