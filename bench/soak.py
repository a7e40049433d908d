"""Soak: N minutes at saturation with random injected faults; prints memory growth and
terminal-state counts per node. Not part of CI.

    .venv/bin/python bench/soak.py --minutes 5 [--model DIR] [--concurrency 16]

Starts its own 1 prefill + 2 decode cluster (fault injection armed, on 127.0.0.1 only), keeps
`--concurrency` clients busy with a mix of good requests, marked faulty ones, streaming ones
that disconnect early and bad bodies; every 30 s it prints each node's RSS and outcome counts.
At the end it checks that live counts returned to zero and prints RSS growth per node.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.harness import Cluster, Node, assert_no_leaks, start_cluster

from adapters.tiny_models import cached_checkpoint
from effects.faults import ENABLE_ENV, Phase

FAULTS = [p.value for p in Phase if p is not Phase.DEVICE_CRASH]


def rss_mib(node: Node) -> float:
    assert node.process is not None
    with open(f"/proc/{node.process.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def one_request(client: httpx.Client, router: Node, rng: random.Random, seen: Counter[str]) -> None:
    kind = rng.choice(["good", "good", "good", "fault", "disconnect", "bad"])
    body = {"prompt": f"Soak {rng.random()}", "max_tokens": rng.randint(1, 64), "temperature": 0.7,
            "seed": rng.randint(0, 1000)}
    headers = {}
    if kind == "fault":
        headers["x-request-id"] = f"inject-fault-{rng.choice(FAULTS)}-{rng.getrandbits(32)}"
    try:
        if kind == "bad":
            r = client.post(f"{router.url}/v1/completions", content=b'{"prompt": 5')
        elif kind == "disconnect":
            with client.stream("POST", f"{router.url}/v1/completions", json={**body, "stream": True,
                               "max_tokens": 500}) as stream:
                for i, _ in enumerate(stream.iter_lines()):
                    if i > 6:
                        break
            seen["disconnect"] += 1
            return
        else:
            r = client.post(f"{router.url}/v1/completions", json=body, headers=headers)
        seen[f"{kind}:{r.status_code}"] += 1
    except httpx.HTTPError as exc:
        seen[f"{kind}:{type(exc).__name__}"] += 1


def report(cluster: Cluster, label: str) -> dict[str, float]:
    sizes = {}
    for node in cluster.nodes[1:]:
        sizes[node.url] = rss_mib(node)
        print(f"  [{label}] {node.role:8s} {node.url}  rss {sizes[node.url]:7.1f} MiB  "
              f"outcomes {node.stats()['outcomes']}", flush=True)
    return sizes


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ[ENABLE_ENV] = "1"
    faults = [arg for phase in FAULTS for arg in ("--inject-fault", phase)]
    model = args.model or cached_checkpoint("llama")
    logs = Path(tempfile.mkdtemp(prefix="statecore-soak-"))
    print(f"soak: {args.minutes} min, concurrency {args.concurrency}, model {model}, logs {logs}")
    cluster = start_cluster(model, logs, prefills=1, decodes=2, node_args=tuple(faults),
                            router_args=("--force-disaggregation", *faults))
    seen: Counter[str] = Counter()
    try:
        start = report(cluster, "start")
        stop_at = time.monotonic() + args.minutes * 60

        def worker(index: int) -> None:
            rng = random.Random(args.seed * 1000 + index)
            with httpx.Client(timeout=120) as client:
                while time.monotonic() < stop_at:
                    one_request(client, cluster.router, rng, seen)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.concurrency)]
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            time.sleep(30)
            report(cluster, f"{(args.minutes * 60 - max(0, stop_at - time.monotonic())) / 60:.1f} min")
        end = report(cluster, "end")
        assert_no_leaks(cluster.nodes[1:], timeout_s=30)
        print("\nclient-side results:", dict(sorted(seen.items())))
        print("memory growth (RSS end - start):")
        for url, before in start.items():
            print(f"  {url}: {end[url] - before:+.1f} MiB ({before:.1f} -> {end[url]:.1f})")
        print("live counts back to zero on every node: yes")
        return 0
    finally:
        cluster.stop()


if __name__ == "__main__":
    raise SystemExit(main())
