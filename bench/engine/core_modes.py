"""Which engine core should a node run by default: on a thread of the node (`--engine-core thread`)
or in a process of its own (`--engine-core process`)? Same run, same model, same prompts.

Starts one single node of each kind on `--model` (default: the tiny benchmark checkpoint), warms
both, then sends each the same streamed completions (`benchlib.run_load`, `--mix`, temperature 0)
at each `--concurrency`, `--repeats` times, alternating which goes first, and prints per cell the
median over repeats of output tokens/s, TTFT p50 and chunk-gap (ITL) p50 / p99, with the ratio
process / thread. The decision rule (issue 32): the process wins where its tokens/s ratio is
above 1 and its TTFT is not worse; keep the thread where the process costs more than the GIL.

    .venv/bin/python bench/engine/core_modes.py --concurrency 8,32 --repeats 3 --out bench/results/core_modes

On the GPU: `bash bench/gpu_engine.sh core-modes`. Bench code: may import anything; nothing under
src/ imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib

from benchlib import (
    PromptMaker,
    Server,
    build_prompts,
    default_model,
    free_port,
    load_tokenizer,
    machine,
    parse_mix,
    run_load,
    server_env,
    summarize,
)

MODES = ("thread", "process")
KEYS = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms")


def node(model: Path, mode: str, out: Path, extra: list[str]) -> Server:
    """One of the two nodes. They run side by side on one device (and one host's memory), so each
    takes half of the default KV budget and MLX's allocator limit (`--device-shared-by 2`; on the
    CPU too, where the halves still far exceed what the bench's prompts hold). A `--node-arg` of
    the same flag comes later and wins."""
    port = free_port()
    argv = [sys.executable, "-m", "adapters.cli", "run", "--role", "single", "--model", str(model),
            "--port", str(port), "--log-level", "WARNING", "--engine-core", mode, "--device-shared-by",
            str(len(MODES)), *extra]
    return Server(mode, argv, port, out / f"{mode}.log")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--mix", default="realish")
    parser.add_argument("--concurrency", default="8")
    parser.add_argument("--num-requests", type=int, default=None, help="per run (default 3 x concurrency)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--blas", default="auto")
    parser.add_argument("--node-arg", action="append", default=[], help="one more flag for both nodes")
    parser.add_argument("--out", type=Path, default=Path("bench/results/core_modes"))
    args = parser.parse_args()
    model = args.model or default_model()
    args.out.mkdir(parents=True, exist_ok=True)
    servers = {mode: node(model, mode, args.out, args.node_arg) for mode in MODES}
    env = server_env(args.blas, "single")[0]
    prompts_of = PromptMaker(load_tokenizer(model))
    mix = parse_mix(args.mix)
    levels = [int(c) for c in args.concurrency.split(",")]
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        for server in servers.values():
            server.start(env)
        for server in servers.values():
            server.wait_ready(300)
        warm = build_prompts(prompts_of, parse_mix("64x16"), 16, 999)
        for server in servers.values():
            asyncio.run(run_load(server.url, warm, concurrency=8))
        for rep in range(args.repeats):
            order = MODES if rep % 2 == 0 else MODES[::-1]
            for conc in levels:
                prompts = build_prompts(prompts_of, mix, args.num_requests or 3 * conc, conc)
                for mode in order:
                    results, wall = asyncio.run(run_load(servers[mode].url, prompts, concurrency=conc))
                    metrics = summarize(results, wall)
                    cells.setdefault((mode, conc), []).append(metrics)
                    shown = "  ".join(f"{k} {metrics[k] or 0:.1f}" for k in KEYS)
                    print(f"rep {rep} {mode:7s} c={conc:<3d} {shown}  failed {metrics['failed']}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    summary: dict[str, Any] = {"machine": machine(), "model": str(model), "mix": args.mix,
                               "repeats": args.repeats, "at": time.strftime("%Y-%m-%dT%H:%M:%S"), "cells": {}}
    for conc in levels:
        medians = {mode: {k: statistics.median(m[k] or 0 for m in cells[(mode, conc)]) for k in KEYS}
                   for mode in MODES}
        ratio = {k: medians["process"][k] / medians["thread"][k] if medians["thread"][k] else None
                 for k in KEYS}
        summary["cells"][f"c{conc}"] = {"thread": medians["thread"], "process": medians["process"],
                                        "process_over_thread": ratio}
        ratios = "  ".join(f"{k} {ratio[k]:.2f}" for k in KEYS if ratio[k] is not None)
        thread = "  ".join(f"{k} {medians['thread'][k]:.1f}" for k in KEYS)
        print(f"c={conc}: process/thread {ratios}  (thread: {thread})")
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
