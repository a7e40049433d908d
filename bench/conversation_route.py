"""Where should a conversation's next turn prefill its new part: on the decode node that holds the
conversation (route prefix_hit_local), or on a prefill node whose KV is then handed off
(route prefill_node)? Measured for a few sizes of the new part on one prefill and one decode node.

Two routers share the nodes: one sends every prompt to the decode node (`--local-prefill-below`
huge: a prompt whose start the decode node holds prefills only the rest there), the other every
prompt through the prefill node (`--force-disaggregation`). A shared prefix of --prefix-tokens
token ids is first sent through both, so both nodes hold its blocks; then, for each --suffixes
size, --repeats turns of that prefix plus a new part of that many fresh ids go through each
router in turn (streamed, ignore_eos, 4 tokens; each once the decode node has finished keeping
the turn before). Prints per size and route the median time to
the first token and to the second (which, through the prefill node, includes the KV handoff),
and writes results.json.

    .venv/bin/python bench/conversation_route.py --suffixes 64,256,1024,2048

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from side_by_side import ROOT, Server, default_model, start_all  # noqa: E402

from adapters.serve.listeners import free_port  # noqa: E402


def servers(model: Path, out: Path, extra: list[str]) -> dict[str, Server]:
    py = sys.executable
    made: dict[str, Server] = {}
    for role in ("prefill", "decode"):
        port = free_port()
        argv = [py, "-m", "adapters.cli", "run", "--role", role, "--model", str(model), "--port", str(port),
                "--log-level", "WARNING", *extra]
        made[role] = Server(role, argv, port, out / f"{role}.log")
    routers = (("local", ["--local-prefill-below", "1000000"]), ("prefill_node", ["--force-disaggregation"]))
    for name, flags in routers:
        port = free_port()
        argv = [py, "-m", "adapters.cli", "run", "--role", "router", "--model", str(model),
                "--port", str(port), "--prefill", made["prefill"].url, "--decode", made["decode"].url,
                "--log-level", "WARNING", *flags, *extra]
        made[name] = Server(name, argv, port, out / f"router-{name}.log")
    return made


def timed_turn(url: str, prompt: list[int]) -> tuple[float, float]:
    """(seconds to the first streamed token, to the second) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    marks: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            raise SystemExit(f"{url}: {response.status_code} {response.read().decode()}")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                marks.append(time.perf_counter() - started)
    if len(marks) < 2:
        raise SystemExit(f"{url}: fewer than two tokens streamed")
    return marks[0], marks[1]


def settle(decode: Server) -> None:
    """Until the decode node reserves nothing: a turn's keep task (its conversation's chunks, kept
    after it ends) is done, so the next turn does not pay for it."""
    deadline = time.monotonic() + 60
    while httpx.get(f"{decode.url}/internal/stats", timeout=10).json()["kv_reserved_bytes"]:
        if time.monotonic() > deadline:
            raise SystemExit("the decode node still reserves KV a minute after a turn")
        time.sleep(0.05)


def route_counts(router: Server) -> dict[str, int]:
    counts = {}
    for line in httpx.get(f"{router.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("statecore:router_routes_total{"):
            route = line.split('route="', 1)[1].split('"', 1)[0]
            counts[route] = int(float(line.rsplit(" ", 1)[1]))
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="model dir (default: the bench's tiny llama)")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--suffixes", default="64,256,1024,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--blas", choices=["auto", "openblas", "bundled", "defaults"], default="auto")
    parser.add_argument("--statecore-arg", action="append", default=[])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "conversation_route")
    args = parser.parse_args(argv)
    extra = list(args.statecore_arg)
    if not any(a.startswith("--prefill-chunk-size") for a in extra):
        extra.append("--prefill-chunk-size=256")
    model = args.model or default_model()
    args.out.mkdir(parents=True, exist_ok=True)
    made = servers(model, args.out, extra)
    results: dict[str, Any] = {"model": str(model), "argv": sys.argv, "statecore_args": extra,
                               "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cells": []}
    rng = random.Random("conversation-route")

    def fresh(n: int) -> list[int]:
        return [rng.randrange(10, 500) for _ in range(n)]  # within the tiny model's 512

    try:
        start_all(list(made.values()), args.blas, 600.0, results)
        prefix = fresh(args.prefix_tokens)
        for name in ("local", "prefill_node"):  # both nodes hold the prefix's blocks from now on
            timed_turn(made[name].url, [*prefix, *fresh(8)])
        time.sleep(2.5)  # the routers pull the nodes' summaries every second
        for size in (int(s) for s in args.suffixes.split(",") if s):
            cell: dict[str, Any] = {"suffix_tokens": size}
            runs: dict[str, list[tuple[float, float]]] = {"local": [], "prefill_node": []}
            for _ in range(args.repeats):
                for name in runs:  # alternate, so drift on a shared box hits both
                    runs[name].append(timed_turn(made[name].url, [*prefix, *fresh(size)]))
                    settle(made["decode"])
            for name, marks in runs.items():
                cell[f"{name}_ttft_ms"] = round(1000 * statistics.median(m[0] for m in marks), 1)
                cell[f"{name}_second_token_ms"] = round(1000 * statistics.median(m[1] for m in marks), 1)
            results["cells"].append(cell)
            print(json.dumps(cell), flush=True)
        results["routes"] = {name: route_counts(made[name]) for name in ("local", "prefill_node")}
        print("routes:", json.dumps(results["routes"]))
    finally:
        for server in made.values():
            server.stop()
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
