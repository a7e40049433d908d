"""KV memory admission under load: long prompts at high concurrency against a single node whose
`--kv-memory-bytes` is far below what they would take together. Clients wait and retry on 429
(as told by Retry-After); the node's device memory is sampled throughout and must stay within its
idle footprint plus the budget (plus, where one prompt's prefill alone is estimated over it, that
lone prefill's activations: `--prefill-memory-cap`); nothing may fail.

    .venv/bin/python bench/serving/kv_memory.py [--model DIR] [--budget-mib 64] [--concurrency 32]
        [--node-arg=--prefill-memory-cap=off] [--node-arg=--prefill-chunk-size=256]

Prints requests by status, the device memory (idle, peak, peak - idle) against the budget, the
node's activation-cap counters, and writes a JSON summary with --out. The default model is the
mid-size tiny llama (hidden 512, 6 layers: 12 KiB of KV per position). Bench code: nothing under
src/ may import it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.e2e.harness (the e2e tests' node launcher), support/
sys.path.insert(0, str(ROOT / "src"))
from tests.e2e.harness import Node, assert_no_leaks, start_nodes  # noqa: E402

from support.tiny_models import cached_checkpoint  # noqa: E402

MIB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--budget-mib", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prompt-words", type=int, default=600, help="words per prompt (~ tokens)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--node-arg", action="append", default=[],
                        help="one more flag for the node (repeat; e.g. --node-arg=--prefill-memory-cap=off)")
    args = parser.parse_args()
    model = args.model or cached_checkpoint("llama", hidden_size=512, num_layers=6)
    logs = Path(tempfile.mkdtemp(prefix="statecore-kv-memory-"))
    node = Node("single", ["--model", str(model), "--kv-memory-bytes", str(args.budget_mib * MIB),
                           *args.node_arg], logs / "single.log")
    start_nodes([node])
    statuses: Counter[str] = Counter()
    samples: list[int] = []
    done = threading.Event()
    try:
        idle = node.stats()["device_memory_bytes"]

        def sample() -> None:
            while not done.is_set():
                samples.append(node.stats()["device_memory_bytes"])
                time.sleep(0.05)

        queue = list(range(args.requests))
        lock = threading.Lock()

        def client(index: int) -> None:
            rng = random.Random(index)
            with httpx.Client(timeout=300) as http:
                while True:
                    with lock:
                        if not queue:
                            return
                        queue.pop()
                    words = " ".join(rng.choice(["sea", "ship", "salt", "wind", "harbour"])
                                     for _ in range(args.prompt_words))
                    body = {"prompt": words, "max_tokens": args.max_tokens, "ignore_eos": True}
                    while True:  # as a well-behaved client does: wait as told, then try again
                        r = http.post(f"{node.url}/v1/completions", json=body)
                        if r.status_code != 429:
                            break
                        statuses["429 (then retried)"] += 1
                        time.sleep(float(r.headers["retry-after"]) * rng.uniform(0.5, 1.0))
                    statuses[str(r.status_code) + ("" if r.status_code == 200 else
                                                   f" {r.json()['error']['code']}")] += 1

        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.monotonic()
        clients = [threading.Thread(target=client, args=(i,)) for i in range(args.concurrency)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
        wall = time.monotonic() - started
        done.set()
        sampler.join()
        assert_no_leaks([node])
        peak = max(samples)
        stats = node.stats()
        summary: dict[str, Any] = {
            "model": str(model), "budget_bytes": args.budget_mib * MIB, "concurrency": args.concurrency,
            "requests": dict(statuses), "wall_s": round(wall, 1), "idle_device_bytes": idle,
            "peak_device_bytes": peak, "peak_minus_idle_bytes": peak - idle,
            "allocator_peak_bytes": stats["device_peak_bytes"], "bugs": stats["bugs"],
            "node_args": args.node_arg,
            # The prefill memory cap's counters (absent from nodes older than it).
            **{key: stats.get(key) for key in ("prefill_capped_steps", "activation_overruns",
                                               "activation_estimate_peak_bytes")},
        }
        print(json.dumps(summary, indent=1))
        print(f"device memory: idle {idle / MIB:.1f} MiB, peak {peak / MIB:.1f} MiB, peak - idle "
              f"{(peak - idle) / MIB:.1f} MiB against a KV budget of {args.budget_mib} MiB")
        if args.out is not None:
            args.out.write_text(json.dumps(summary, indent=1))
        failed = {k: v for k, v in statuses.items() if not k.startswith(("200", "429 (then"))}
        return 1 if failed or stats["bugs"] else 0
    finally:
        done.set()
        node.stop()


if __name__ == "__main__":
    raise SystemExit(main())
