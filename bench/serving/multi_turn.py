"""Multi-turn conversations side by side: mlx_lm.server (its prompt cache on), statecore single with
its prefix cache, statecore single without it, and a statecore 1P2D cluster (one prefill node, two
decode nodes and a router, each its own process: `cluster_1p2d`).

Each of --conversations clients holds one conversation of --turns turns, all at once (a list,
e.g. `--conversations 8,32`, runs each count on every server, one run after another; each run's
conversations are its own, so no run finds an earlier one's turns cached, only the shared system
prompt). Every
conversation starts with the same system prompt (--system-tokens); turn k sends the system prompt,
every earlier user message and answer, then a new user message (--user-tokens), and asks for
--answer-tokens greedy tokens (ignore_eos); the answer's text joins the history. Prints TTFT
p50/p99 of the first turns and of the later ones (where a prefix cache can help), and output
tokens/s over the run, per server; writes results.json.

    .venv/bin/python bench/serving/multi_turn.py --conversations 8,32 --turns 6

statecore caches whole prefill chunks, so the chunk size is the reuse granularity: the servers
get `--prefill-chunk-size` (default 256 here) through --statecore-arg unless one is given.

The cluster against one node (issue 14's target: later turns' TTFT within 1.2x of one node's),
16 conversations at once:

    .venv/bin/python bench/serving/multi_turn.py --servers single,cluster_1p2d --conversations 16

Its router's turns by route (statecore:router_routes_total) and its decode nodes' kept
conversations go into results.json and the printed line.

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib

from benchlib import (
    ROOT,
    PromptMaker,
    RequestResult,
    Server,
    default_model,
    free_port,
    load_tokenizer,
    make_servers,
    percentile,
    start_all,
    stream_request,
)

SERVERS = ("mlx_lm", "single", "single_nocache", "cluster_1p2d")
CLUSTER = "cluster_1p2d"


def cluster_servers(model: Path, out: Path, extra: list[str]) -> list[Server]:
    """One prefill node, two decode nodes and their router (last), each its own process."""
    py = sys.executable
    nodes = []
    for role, name in (("prefill", "prefill"), ("decode", "decode0"), ("decode", "decode1")):
        port = free_port()
        argv = [py, "-m", "adapters.cli", "run", "--role", role, "--model", str(model), "--port", str(port),
                "--log-level", "WARNING", *extra]
        nodes.append(Server(f"{CLUSTER}.{name}", argv, port, out / f"{CLUSTER}.{name}.log"))
    port = free_port()
    argv = [py, "-m", "adapters.cli", "run", "--role", "router", "--model", str(model), "--port", str(port),
            "--prefill", nodes[0].url, "--decode", nodes[1].url, "--decode", nodes[2].url,
            "--log-level", "WARNING", *extra]
    return [*nodes, Server(CLUSTER, argv, port, out / f"{CLUSTER}.log")]


def cluster_counts(servers: list[Server]) -> dict[str, Any]:
    """The router's turns by route and each decode node's kept conversations, from /metrics."""
    counts: dict[str, Any] = {}
    for server in servers:
        if server.name != CLUSTER and ".decode" not in server.name:
            continue
        for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
            if line.startswith("statecore:router_routes_total{"):
                route = line.split('route="', 1)[1].split('"', 1)[0]
                counts.setdefault("routes", {})[route] = int(float(line.rsplit(" ", 1)[1]))
            elif line.startswith("statecore:conversations_kept_total{"):
                counts.setdefault("conversations_kept", {})[server.name] = int(float(line.rsplit(" ", 1)[1]))
    return counts


async def conversation(url: str, maker: PromptMaker, system: str, seed: str, turns: int, user_tokens: int,
                       answer_tokens: int) -> list[RequestResult]:
    """One conversation's turns in order; each turn's result."""
    rng = random.Random(seed)
    history = system
    results = []
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(turns):
            history += "\nUser: " + maker.make(user_tokens, rng) + "\nAssistant:"
            result = RequestResult(prompt_tokens_sent=maker.count(history), max_tokens=answer_tokens)
            await stream_request(client, url, history, result, None)
            results.append(result)
            if not result.ok:
                break
            history += result.text
    return results


async def run(url: str, maker: PromptMaker, args: argparse.Namespace,
              count: int) -> tuple[list[list[RequestResult]], float]:
    system = maker.make(args.system_tokens, random.Random("multi-turn:system"))
    seeds = [f"multi-turn:{count}:{i}" for i in range(count)]  # each run's conversations its own
    started = time.perf_counter()
    done = await asyncio.gather(*(conversation(url, maker, system, seed, args.turns, args.user_tokens,
                                               args.answer_tokens) for seed in seeds))
    return list(done), time.perf_counter() - started


def summary(conversations: list[list[RequestResult]], wall_s: float) -> dict[str, Any]:
    first = [c[0].ttft_s for c in conversations if c and c[0].ttft_s is not None]
    later = [r.ttft_s for c in conversations for r in c[1:] if r.ttft_s is not None]
    every = [r for c in conversations for r in c]
    failed = sum(1 for r in every if not r.ok)
    tokens = sum(r.output_tokens for r in every if r.ok)

    def ms(value: float | None) -> float | None:
        return None if value is None else round(1000 * value, 1)

    return {"turns": len(every), "failed": failed, "output_tok_s": round(tokens / wall_s, 1),
            "ttft_first_p50_ms": ms(statistics.median(first) if first else None),
            "ttft_later_p50_ms": ms(statistics.median(later) if later else None),
            "ttft_later_p99_ms": ms(percentile(later, 99)),
            "longest_prompt_tokens": max((r.prompt_tokens_sent for r in every), default=0)}


def print_ratios(count: str, names: list[str], results: dict[str, Any]) -> None:
    """One run's ratios: each server against mlx_lm.server, the cluster against the single node."""
    base = results.get("mlx_lm")
    if base:
        for name in names:
            if name != "mlx_lm" and name in results and base.get("ttft_later_p50_ms") \
                    and results[name].get("ttft_later_p50_ms"):
                print(f"{count} conversations: {name} / mlx_lm: later-turn TTFT p50 "
                      f"{results[name]['ttft_later_p50_ms'] / base['ttft_later_p50_ms']:.2f}x, tok/s "
                      f"{results[name]['output_tok_s'] / base['output_tok_s']:.2f}x")
    alone, cluster = results.get("single"), results.get(CLUSTER)
    if alone and cluster:
        for key in ("ttft_first_p50_ms", "ttft_later_p50_ms", "ttft_later_p99_ms"):
            if alone.get(key) and cluster.get(key):
                print(f"{count} conversations: {CLUSTER} / single: {key} {cluster[key] / alone[key]:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="model dir (default: the bench's tiny llama)")
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"subset of {','.join(SERVERS)}")
    parser.add_argument("--conversations", default="8",
                        help="conversations at once; a comma list runs each count in turn")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--blas", choices=["auto", "openblas", "bundled", "defaults"], default="auto")
    parser.add_argument("--statecore-arg", action="append", default=[])
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "multi_turn")
    args = parser.parse_args(argv)
    args.counts = [int(c) for c in args.conversations.split(",") if c]
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    names = [n for n in args.servers.split(",") if n]
    if unknown := set(names) - set(SERVERS):
        raise SystemExit(f"unknown servers {sorted(unknown)}")
    extra = list(args.statecore_arg)
    if not any(a.startswith("--prefill-chunk-size") for a in extra):
        extra.append("--prefill-chunk-size=256")
    model = args.model or default_model()
    args.out.mkdir(parents=True, exist_ok=True)
    maker = PromptMaker(load_tokenizer(model))
    servers = []
    for name in names:
        if name == CLUSTER:
            servers += cluster_servers(model, args.out, extra)
            continue
        flags = [*extra, "--prefix-cache-bytes=0"] if name == "single_nocache" else extra
        (server,) = make_servers(model, args.out, ["mlx_lm" if name == "mlx_lm" else "single"], flags)
        server.name, server.log = name, args.out / f"{name}.log"
        servers.append(server)
    results: dict[str, Any] = {"model": str(model), "argv": sys.argv, "statecore_args": extra,
                               "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        start_all(servers, args.blas, args.startup_timeout, results)
        for count in args.counts:
            for server in servers:  # one at a time, so they do not share the device
                if server.name not in names:
                    continue  # a cluster's node: its router is the one asked
                conversations, wall = asyncio.run(run(server.url, maker, args, count))
                record = summary(conversations, wall)
                if server.name == CLUSTER:
                    record.update(cluster_counts(servers))  # counted since the cluster started
                results.setdefault("runs", {}).setdefault(str(count), {})[server.name] = record
                print(f"{count} conversations: {server.name}", json.dumps(record), flush=True)
                # after every run, so a run cut short by a time limit keeps what it measured
                (args.out / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        for server in servers:
            server.stop()
    for count, run_results in results.get("runs", {}).items():
        print_ratios(count, names, run_results)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
