"""Where should a conversation's next turn prefill its new part: on the decode node that holds the
conversation (route prefix_hit_local), on a prefill node that computes the whole prompt (route
prefill_node, its own cache not holding the conversation), or on a prefill node that pulls the
conversation's blocks from the decode node and computes only the new part (route
prefill_node_prefix)? Measured for a few sizes of the new part on two prefill nodes and one
decode node.

Three routers share the decode node: "local" sends every prompt to it (`--local-prefill-below`
huge: a prompt whose start the decode node holds prefills only the rest there); "prefill_node"
sends every prompt through a prefill node with no prefix cache (`--prefix-cache-bytes 0
--prefix-pull never`: it computes every prompt from token 0); "prefill_pull" through a prefill
node with `--prefix-pull always` (`--force-disaggregation` for both). Each repeat first sends a
fresh shared prefix of --prefix-tokens token ids through "local", so that only the decode node
holds its blocks (the pulling prefill node's cache holds the prefix only after its own pull, so
a prefix is never reused across repeats), waits until the other routers' summaries list them,
then sends that prefix plus a new part of --suffixes fresh ids through each router in turn
(streamed, ignore_eos, 4 tokens; each once the decode node has finished keeping the turn
before). Prints per size and route the median time to the first token and to the second
(which, through a prefill node, includes the KV handoff), the routes and pulls counted, and
writes results.json.

    .venv/bin/python bench/serving/conversation_route.py --suffixes 64,256,1024,2048

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib

from benchlib import ROOT, Server, default_model, free_port, start_all

ROUTES = ("local", "prefill_node", "prefill_pull")


def servers(model: Path, out: Path, extra: list[str]) -> dict[str, Server]:
    py = sys.executable
    made: dict[str, Server] = {}
    nodes = (("prefill", "prefill", ["--prefix-cache-bytes", "0", "--prefix-pull", "never"]),
             ("prefill_pulling", "prefill", ["--prefix-pull", "always"]),
             ("decode", "decode", []))
    for name, role, flags in nodes:
        port = free_port()
        argv = [py, "-m", "adapters.cli", "run", "--role", role, "--model", str(model), "--port", str(port),
                "--log-level", "WARNING", *extra, *flags]
        made[name] = Server(name, argv, port, out / f"{name}.log")
    routers = (("local", "prefill", ["--local-prefill-below", "1000000"]),
               ("prefill_node", "prefill", ["--force-disaggregation"]),
               ("prefill_pull", "prefill_pulling", ["--force-disaggregation"]))
    for name, prefill, flags in routers:
        port = free_port()
        argv = [py, "-m", "adapters.cli", "run", "--role", "router", "--model", str(model),
                "--port", str(port), "--prefill", made[prefill].url, "--decode", made["decode"].url,
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


def counts(server: Server, family: str, label: str) -> dict[str, int]:
    """A server's counter family by one label's values."""
    found = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(family + "{"):
            value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            found[value] = int(float(line.rsplit(" ", 1)[1]))
    return found


def held_since(router: Server, decode: Server, version: int) -> bool:
    """Whether the router holds the decode node's summary of `version` or later (none yet: no)."""
    held = httpx.get(f"{router.url}/internal/stats", timeout=10).json()["prefix_versions"].get(decode.url)
    return held is not None and held >= version


def wait_for_summaries(routers: list[Server], decode: Server) -> None:
    """Until every router holds the decode node's current prefix summary (its version: a count of
    blocks stops growing once the node's cache is full and evicts as it keeps)."""
    version = httpx.get(f"{decode.url}/internal/prefix", timeout=10).json()["version"]
    deadline = time.monotonic() + 30
    for router in routers:
        while not held_since(router, decode, version):
            if time.monotonic() > deadline:
                raise SystemExit(f"{router.name}: never pulled the decode node's summary {version}")
            time.sleep(0.1)


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
        decode = made["decode"]
        for size in (int(s) for s in args.suffixes.split(",") if s):
            cell: dict[str, Any] = {"suffix_tokens": size}
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in ROUTES}
            for _ in range(args.repeats):
                # a fresh prefix, held by the decode node alone (prefilled there)
                prefix = fresh(args.prefix_tokens)
                timed_turn(made["local"].url, [*prefix, *fresh(8)])
                settle(decode)
                wait_for_summaries([made["prefill_node"], made["prefill_pull"]], decode)
                for name in ROUTES:  # alternate, so drift on a shared box hits each alike
                    runs[name].append(timed_turn(made[name].url, [*prefix, *fresh(size)]))
                    settle(decode)
            for name, marks in runs.items():
                cell[f"{name}_ttft_ms"] = round(1000 * statistics.median(m[0] for m in marks), 1)
                cell[f"{name}_second_token_ms"] = round(1000 * statistics.median(m[1] for m in marks), 1)
            results["cells"].append(cell)
            print(json.dumps(cell), flush=True)
        results["routes"] = {name: counts(made[name], "statecore:router_routes_total", "route")
                             for name in ROUTES}
        results["prefix_pulls"] = {name: counts(made[name], "statecore:prefix_pulls_total", "outcome")
                                   for name in ("prefill", "prefill_pulling")}
        print("routes:", json.dumps(results["routes"]))
        print("prefix pulls:", json.dumps(results["prefix_pulls"]))
    finally:
        for server in made.values():
            server.stop()
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
