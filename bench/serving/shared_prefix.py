"""Shared prefixes side by side: a system prompt many conversations start with, a document resent
with a new question. mlx_lm.server (its prompt cache on), statecore single with its prefix cache,
statecore single without it, and statecore single with 2,048-token chunks (the reuse granularity
before chunks became 256-token blocks), and a local 1P1D cluster (`cluster`), one server at a time,
the same client and BLAS for all.

- **System prompt**: --conversations first turns at once, each the same --system-tokens system
  prompt, then a user message of --user-tokens of its own; --answer-tokens greedy tokens each.
  Prints the first turns' TTFT p50 and p99. With --rounds N, N rounds, each a new system prompt
  (no server has seen it), the servers taking turns within a round, first in turn order in even
  rounds and in reverse in odd ones: a busy box's load then weighs on each server alike, and the
  per-round ratios show how much it moved.
- **Document**: --documents rounds, each a new document of --document-tokens tokens asked one
  question (cold), then asked another (warm), one request at a time.
- `--api chat` (the default): the shared part is a system message and each request's own a user
  message; `--api completions`: one text, the shared part then the request's own. Prints cold and warm TTFT
  p50 and the prompt tokens each warm request reports as cached (statecore reports them with
  `--enable-prompt-tokens-details`; mlx_lm.server reports none).

Every ratio is against mlx_lm.server, against statecore without its cache and against statecore
single with its default flags, from this run.

    .venv/bin/python bench/serving/shared_prefix.py --conversations 32 --documents 3

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib

from benchlib import (
    ROOT,
    CompletionStreamError,
    PromptMaker,
    chat_stream,
    completion_stream,
    default_model,
    load_tokenizer,
    make_servers,
    percentile,
    server_env,
    start_all,
)

# cluster: `statecore run`'s local 1P1D cluster (a router, a prefill node, a decode node); cluster_gpu:
# the same at MLX's CUDA defaults
# single_long*: --message-blocks long; single_gpu*: the same at MLX's CUDA defaults (on a GPU, where
# they are the defaults anyway, the same as single*)
# single_batchN: at most N prompts advance per step (`--prefill-batch`, 32 by default): first turns
# that start from a cached system prompt then finish over several steps instead of all in one
# *_stack / *_nostack: --prefill-stacking on / off (off is the default; auto is on with MLX's CUDA
# backend only): first turns whose tails have one shape compute them as rows of stacked calls
SERVERS = ("mlx_lm", "single", "single_nocache", "single_nokeep", "single_chunk2048", "single_chunk128",
           "single_chunk256", "single_batch4", "single_batch8", "single_long", "single_long_nocache",
           "single_stack", "single_nostack", "single_nocache_stack", "single_nocache_nostack",
           "single_gpu", "single_gpu_nocache", "single_gpu_long", "single_gpu_long_nocache",
           "single_gpu_stack", "single_gpu_nocache_stack", "cluster", "cluster_gpu")
_FLAGS = {"single": [], "single_nocache": ["--prefix-cache-bytes=0"],
          "single_nokeep": ["--keep-conversations=off"],
          "single_chunk2048": ["--prefill-chunk-size=2048"], "single_chunk128": ["--prefill-chunk-size=128"],
          "single_chunk256": ["--prefill-chunk-size=256"], "single_batch4": ["--prefill-batch=4"],
          "single_batch8": ["--prefill-batch=8"],
          # the rule before: a block ends at a message's end only in prompts longer than a chunk
          # (a shorter one is one call, may share a padded call, and is never reused)
          "single_long": ["--message-blocks=long"],
          "single_long_nocache": ["--message-blocks=long", "--prefix-cache-bytes=0"],
          "single_stack": ["--prefill-stacking=on"], "single_nostack": ["--prefill-stacking=off"],
          "single_nocache_stack": ["--prefix-cache-bytes=0", "--prefill-stacking=on"],
          "single_nocache_nostack": ["--prefix-cache-bytes=0", "--prefill-stacking=off"]}
# MLX's CUDA defaults on any device: whole 2,048-token chunks, padded to 128-token shapes, no
# step-time target (a single node's is off on a GPU; on the CPU it would spread the cache-less
# prompts' prefill over many more steps than a GPU's node makes)
_GPU = ["--prefill-chunk-size=2048", "--shape-bucket=128", "--step-target-ms=0"]
BASE = "base_"  # base_NAME: server NAME on --base-src's tree (a same-run A/B against another checkout)
_FLAGS.update({f"single_gpu{rest}": [*_GPU, *_FLAGS[f"single{rest}"]]
               for rest in ("", "_nocache", "_long", "_long_nocache", "_stack", "_nocache_stack")},
              cluster_gpu=_GPU)


async def one(client: httpx.AsyncClient, url: str, shared: str, own: str, max_tokens: int,
              api: str) -> dict[str, Any]:
    """One streamed request, a shared part then its own (chat: a system message, then a user
    message; completions: one text): its TTFT and the cached prompt tokens its usage reports (a
    transport error or a refusal: no TTFT, and the error)."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if api == "chat":
        body["messages"] = [{"role": "system", "content": shared}, {"role": "user", "content": own}]
    else:
        body["prompt"] = shared + own
    stream = chat_stream if api == "chat" else completion_stream
    started = time.perf_counter()
    sent_unix, sent_mono = time.time(), time.monotonic()
    ttft = None
    cached = None
    try:
        async for texts, usage in stream(client, url, body):
            if texts and ttft is None:
                ttft = time.perf_counter() - started
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (httpx.HTTPError, CompletionStreamError) as exc:
        return {"ttft_s": None, "cached_tokens": None, "error": f"{type(exc).__name__}: {exc}"[:200]}
    # wall-clock moments, to line a request up with a node's logs and traces (--timeline)
    # (and on the monotonic clock, a step trace's: bench/step_trace/first_turns.py)
    return {"ttft_s": ttft, "cached_tokens": cached, "sent_unix": sent_unix, "sent_mono": sent_mono,
            "first_unix": None if ttft is None else sent_unix + ttft}


async def system_prompt_run(url: str, maker: PromptMaker, args: argparse.Namespace, name: str,
                            round_: int = 0) -> dict[str, Any]:
    salt = "" if round_ == 0 else f":{round_}"  # round 0's system prompt is the one earlier runs used
    system = maker.make(args.system_tokens, random.Random(f"shared-prefix:system{salt}"))
    owns = [maker.make(args.user_tokens, random.Random(f"{name}{salt}:{i}"))
            for i in range(args.conversations)]
    if args.api == "completions":
        owns = ["\nUser: " + own + "\nAssistant:" for own in owns]
    async with httpx.AsyncClient(timeout=1200) as client:
        before = await prefix_counts(client, url, name)
        done = await asyncio.gather(*(one(client, url, system, own, args.answer_tokens, args.api)
                                      for own in owns))
        after = await prefix_counts(client, url, name)
    ttfts = [d["ttft_s"] for d in done if d["ttft_s"] is not None]
    cached = [d["cached_tokens"] for d in done if d["cached_tokens"] is not None]
    record = {"ok": len(ttfts), "failed": len(done) - len(ttfts),
              "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
              "ttft_p99_ms": round(1000 * (percentile(ttfts, 99) or 0), 1),
              "cached_tokens_p50": statistics.median(cached) if cached else None,
              # how many first turns computed the system prompt themselves (cached 0) and how many
              # took it from the cache: what the TTFT is made of
              "cached_tokens_counts": {str(k): v for k, v in sorted(Counter(cached).items())}}
    if before is not None and after is not None:  # the engine's own counts over the round
        record["prefix_counts"] = {key: after[key] - before[key] for key in after}
    if args.timeline:
        record["requests"] = [{key: d.get(key) for key in ("sent_unix", "sent_mono", "ttft_s", "first_unix",
                                                          "cached_tokens")} for d in done]
    return record


async def prefix_counts(client: httpx.AsyncClient, url: str, name: str) -> dict[str, int] | None:
    """A statecore node's prefix-cache counters (`/internal/stats`); None for mlx_lm.server."""
    if name.split(":")[-1].startswith("mlx_lm"):
        return None
    try:
        stats = (await client.get(f"{url}/internal/stats", timeout=10)).json()
    except (httpx.HTTPError, ValueError):
        return None
    keys = ("prefix_cache_queries", "prefix_cache_hits", "prefix_tokens_reused")
    counts = {key.removeprefix("prefix_"): int(stats[key]) for key in keys if key in stats}
    # the device loop's steps, and the prompts' rows computed in stacked calls (--prefill-stacking)
    for kind, name in (("step", "steps"), ("prefill_stacked", "stacked_rows")):
        counts[name] = int(stats.get("device_time", {}).get(kind, {}).get("calls", 0))
    return counts


async def document_run(url: str, maker: PromptMaker, args: argparse.Namespace, name: str
                       ) -> dict[str, Any]:
    cold: list[float] = []
    warm: list[float] = []
    cached: list[int | None] = []
    async with httpx.AsyncClient(timeout=1200) as client:
        for round_ in range(args.documents):
            document = maker.make(args.document_tokens, random.Random(f"{name}:document:{round_}"))
            for index, times in enumerate((cold, warm)):
                question = maker.make(args.user_tokens, random.Random(f"{name}:q:{round_}:{index}"))
                own = question if args.api == "chat" else "\nQuestion: " + question + "\nAnswer:"
                result = await one(client, url, document, own, args.answer_tokens, args.api)
                if result["ttft_s"] is None:
                    raise SystemExit(f"{name}: a document request failed: {result}")
                times.append(result["ttft_s"])
                if index:
                    cached.append(result["cached_tokens"])
    return {"cold_ttft_p50_ms": round(1000 * statistics.median(cold), 1),
            "warm_ttft_p50_ms": round(1000 * statistics.median(warm), 1), "warm_cached_tokens": cached,
            "document_prompt_tokens": maker.count(document)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="default: the bench's tiny llama")
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"subset of {','.join(SERVERS)}")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--documents", type=int, default=3)
    parser.add_argument("--document-tokens", type=int, default=3700)
    parser.add_argument("--scenarios", default="system,document")
    parser.add_argument("--rounds", type=int, default=1, help="system prompt: rounds, each a new prompt")
    parser.add_argument("--api", choices=["chat", "completions"], default="chat",
                        help="chat: the shared part is a system message, each request's own a user "
                             "message (the chat template ends each with an end-of-turn token); "
                             "completions: one text, shared part then own")
    parser.add_argument("--blas", choices=["auto", "openblas", "bundled", "defaults"], default="auto")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--device-shared-by", type=int, default=1,
                        help="statecore's engine processes sharing one GPU (each node sizes its memory "
                             "to its share: four single nodes on one H100 ran out of memory without it)")
    parser.add_argument("--base-src", type=Path, default=None,
                        help=f"another checkout's src/ (e.g. main's): {BASE}NAME servers run NAME from it")
    parser.add_argument("--timeline", action="store_true",
                        help="system prompt: keep each request's wall-clock send and first-token moments")
    parser.add_argument("--statecore-arg", action="append", default=[],
                        help="an extra flag for every statecore server (repeatable), e.g. --log-transitions")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "shared_prefix")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    names = [n for n in args.servers.split(",") if n]
    if any(n.startswith(BASE) for n in names) and args.base_src is None:
        raise SystemExit(f"{BASE}NAME servers need --base-src")
    if unknown := {n.removeprefix(BASE) for n in names} - set(SERVERS):
        raise SystemExit(f"unknown servers {sorted(unknown)}")
    model = args.model or default_model()
    args.out.mkdir(parents=True, exist_ok=True)
    maker = PromptMaker(load_tokenizer(model))
    servers = []
    for name in names:
        flags = ["--enable-prompt-tokens-details", *_FLAGS.get(name.removeprefix(BASE), []),
                 *(args.statecore_arg if name != "mlx_lm" else [])]
        if name != "mlx_lm" and args.device_shared_by > 1:
            flags.append(f"--device-shared-by={args.device_shared_by}")
        kind = name if name == "mlx_lm" else "cluster" if "cluster" in name else "single"
        (server,) = make_servers(model, args.out, [kind], flags)
        server.name, server.log = name, args.out / f"{name}.log"
        servers.append(server)
    results: dict[str, Any] = {"model": str(model), "argv": sys.argv,
                               "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    scenarios = {"system": system_prompt_run, "document": document_run}
    try:
        for server in servers:  # base_NAME: the same server on --base-src's tree
            if server.name.startswith(BASE):
                env = server_env(args.blas, "single")[0]
                env["PYTHONPATH"] = os.pathsep.join([str(args.base_src.resolve()),
                                                     *env["PYTHONPATH"].split(os.pathsep)[1:]])
                server.start(env)
        start_all([s for s in servers if not s.name.startswith(BASE)], args.blas, args.startup_timeout,
                  results)
        for server in servers:
            if server.name.startswith(BASE):
                server.wait_ready(args.startup_timeout)
        results["base_src"] = None if args.base_src is None else str(args.base_src)
        results["ports"] = {server.name: server.port for server in servers}  # a trace's processes by port
        for scenario in args.scenarios.split(","):
            rounds = args.rounds if scenario == "system" else 1
            for round_ in range(rounds):
                order = servers if round_ % 2 == 0 else servers[::-1]
                for server in order:  # one at a time, so they do not share the CPU
                    name = f"{scenario}:{server.name}"
                    record = (asyncio.run(system_prompt_run(server.url, maker, args, name, round_))
                              if scenario == "system" else asyncio.run(scenarios[scenario](server.url, maker,
                                                                                           args, name)))
                    record["at"] = time.strftime("%H:%M:%S")
                    results.setdefault(scenario, {}).setdefault(server.name, []).append(record)
                    print(f"{scenario} round {round_} {server.name}: {json.dumps(record)}", flush=True)
                    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        for server in servers:
            server.stop()
    for scenario, key in (("system", "ttft_p50_ms"), ("document", "warm_ttft_p50_ms")):
        got = results.get(scenario, {})
        for base in ("mlx_lm", "single_nocache", "single", f"{BASE}single", f"{BASE}single_gpu",
                     "single_long_nocache", "single_gpu_nocache",
                     "single_gpu", "single_gpu_long_nocache", "single_nostack", "single_nocache_nostack"):
            for name, records in got.items():
                if name == base or base not in got:
                    continue
                pairs = zip(records, got[base], strict=True)
                ratios = [round(mine[key] / theirs[key], 2) for mine, theirs in pairs if theirs[key]]
                print(f"{scenario}: {name} / {base} {key} by round: {ratios}, median "
                      f"{statistics.median(ratios) if ratios else None}x")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
