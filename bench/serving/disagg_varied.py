"""Disaggregation at equal hardware on varied traffic: DP2 against 1P1D with the router's defaults.

`disagg_equal.py` asks its question with one fixed shape of load (decode streams, then long
prompts of one length on a schedule). This bench asks it of traffic nobody tuned on: requests
arriving as a Poisson process, prompt lengths drawn from the realish mix (log-normal, median
~256) with a share of long documents (log-uniform over --long-range), output lengths from the
realish mix, on a model shape of its own (default hidden 384, 8 layers: not the shape the
other benches use). Both setups are `disagg_equal.make_setups`' (DP2: two single replicas behind
a router that never hands off; 1P1D: a prefill and a decode node), each engine node pinned to
its own --cpus, and 1P1D's router runs with its **default** `--local-prefill-below` and
`--prefill-overflow` (the product as shipped decides what to hand off). Rounds alternate the
setups, with fresh prompts per round, the same for both within one.

Per run it reports TTFT p50 / p99 for short and long prompts apart, the streams' inter-token
gap p50 / p99 / max, output tokens/s and goodput (requests meeting a TTFT SLO and an ITL SLO,
the larger setup's alone-latency times --slo-factor, as `disagg_equal` does), then the medians
over rounds and the 1P1D / DP2 ratios.

    .venv/bin/python bench/serving/disagg_varied.py --rounds 2            # ~6 min on 2 cores

Bench code: it may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/: benchlib, which puts src/ on the path too
sys.path.insert(0, str(HERE))

from benchlib import (  # noqa: E402
    ROOT,
    PromptMaker,
    RequestResult,
    load_tokenizer,
    machine,
    percentile,
    run_load,
    server_env,
)
from disagg_equal import default_model, delta, make_setups, node_counters, stop  # noqa: E402

MS = 1000.0


def varied_lengths(n: int, rng: random.Random, long_share: float, long_range: tuple[int, int],
                   context: int) -> list[tuple[int, int]]:
    """(prompt, output) tokens: realish for most requests, a long document for `long_share`."""
    pairs = []
    for _ in range(n):
        out = int(min(384, max(8, rng.lognormvariate(math.log(96), 0.7))))
        if rng.random() < long_share:
            low, high = long_range
            prompt = int(math.exp(rng.uniform(math.log(low), math.log(high))))
        else:
            prompt = int(min(1536, max(16, rng.lognormvariate(math.log(256), 0.9))))
        pairs.append((min(prompt, context - out - 1), out))
    return pairs


def figures(results: list[RequestResult], wall_s: float, long_from: int, slo_ttft_s: float,
            slo_itl_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    long = [r.ttft_s for r in ok if r.prompt_tokens_sent >= long_from and r.ttft_s is not None]
    short = [r.ttft_s for r in ok if r.prompt_tokens_sent < long_from and r.ttft_s is not None]
    gaps = [g for r in ok for g in r.chunk_gaps_s]

    def itl(r: RequestResult) -> float:
        return statistics.fmean(r.chunk_gaps_s) if r.chunk_gaps_s else 0.0

    good = [r for r in ok if r.ttft_s is not None and r.ttft_s <= slo_ttft_s and itl(r) <= slo_itl_s]
    scaled = {k: (None if v is None else v * MS) for k, v in {
        "ttft_short_p50_ms": percentile(short, 50), "ttft_short_p99_ms": percentile(short, 99),
        "ttft_long_p50_ms": percentile(long, 50), "ttft_long_p99_ms": percentile(long, 99),
        "gap_p50_ms": percentile(gaps, 50), "gap_p99_ms": percentile(gaps, 99),
        "gap_max_ms": max(gaps, default=None)}.items()}
    return {**scaled, "tok_s": sum(r.output_tokens for r in ok) / wall_s,
            "goodput_share": len(good) / len(results) if results else None,
            "failed": len(results) - len(ok), "long_requests": len(long), "requests": len(results)}


def alone(url: str, maker: PromptMaker, long_prompt: int) -> tuple[float, float]:
    """One long prompt's TTFT and one short stream's mean gap with nothing else running."""
    rng = random.Random("alone")
    prompts = [(maker.make(long_prompt, rng), long_prompt, 8), (maker.make(64, rng), 64, 64)]
    (first, _), (second, _) = (asyncio.run(run_load(url, [p], concurrency=1)) for p in prompts)
    assert first[0].ok and second[0].ok, (first[0].error, second[0].error)
    return first[0].ttft_s or 0.0, statistics.fmean(second[0].chunk_gaps_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="default: a random llama of --hidden-size and --layers")
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cpus", nargs=2, default=["0", "1"], metavar="CORES")
    parser.add_argument("--rate", type=float, default=0.8, help="requests per second (Poisson)")
    parser.add_argument("--concurrency", type=int, default=16, help="most requests in flight")
    parser.add_argument("--requests", type=int, default=40, help="requests per run")
    parser.add_argument("--long-share", type=float, default=0.2)
    parser.add_argument("--long-range", type=int, nargs=2, default=[1500, 3500], metavar=("LOW", "HIGH"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slo-factor", type=float, default=3.0)
    parser.add_argument("--blas", choices=["auto", "openblas", "bundled"], default="auto")
    parser.add_argument("--node-arg", action="append", default=[])
    parser.add_argument("--router-arg", action="append", default=[], help="extra flag for both routers")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "disagg_varied")
    args = parser.parse_args()

    model: Path = args.model or default_model(args.hidden_size, args.layers)
    context = json.loads((model / "config.json").read_text()).get("max_position_embeddings", 4096)
    args.out.mkdir(parents=True, exist_ok=True)
    env, blas = server_env(args.blas)
    token = secrets.token_hex(16)
    cpus = (args.cpus[0], args.cpus[1])
    # DP2's router must never hand off (every prompt below its threshold); 1P1D's threshold is
    # taken back out of its command line below, so that its router decides as shipped.
    setups = make_setups(model, args.out, env, cpus, (None, None), token=token, node_args=args.node_arg,
                         router_args=args.router_arg, local_prefill_below=0, every_prompt_below=context + 1,
                         kv_memory_bytes=1 << 30)
    for setup in setups:
        if setup.name == "1P1D":
            argv = setup.front.argv
            at = argv.index("--local-prefill-below")
            del argv[at : at + 2]  # the router's default decides what is handed off
    meta: dict[str, Any] = {"argv": sys.argv, "model": str(model), "blas": blas, "cpus": list(cpus),
                            "machine": machine(), "settings": {k: str(v) for k, v in vars(args).items()},
                            "started_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                            "load_average_at_start": os.getloadavg()}
    runs: list[dict[str, Any]] = []
    try:
        for setup in setups:
            for node in setup.nodes[:-1]:
                node.server.start(node.env)
        maker = PromptMaker(load_tokenizer(model))
        loads = []
        for rep in range(args.rounds):
            rng = random.Random(f"varied:{rep}")
            lengths = varied_lengths(args.requests, rng, args.long_share, tuple(args.long_range), context)
            loads.append([(maker.make(p, rng), p, o) for p, o in lengths])
        for setup in setups:
            for node in setup.nodes[:-1]:
                node.server.wait_ready(args.startup_timeout)
            setup.nodes[-1].server.start(setup.nodes[-1].env)
            setup.nodes[-1].server.wait_ready(args.startup_timeout)
        calibration = {s.name: alone(s.front.url, maker, args.long_range[0]) for s in setups}
        slo_ttft = args.slo_factor * max(t for t, _ in calibration.values())
        slo_itl = args.slo_factor * max(g for _, g in calibration.values())
        meta["slo"] = {"ttft_ms": slo_ttft * MS, "itl_ms": slo_itl * MS}
        print(f"model {model} cores {cpus}; SLOs TTFT {slo_ttft * MS:,.0f} ms, ITL {slo_itl * MS:.1f} ms; "
              f"{args.requests} requests at {args.rate}/s per run", flush=True)
        for rep, prompts in enumerate(loads):
            for setup in setups if rep % 2 == 0 else setups[::-1]:
                before = node_counters(setup.engines)
                load = os.getloadavg()[0]
                results, wall = asyncio.run(run_load(setup.front.url, prompts, concurrency=args.concurrency,
                                                     rate=args.rate, seed=rep))
                got = figures(results, wall, args.long_range[0], slo_ttft, slo_itl)
                runs.append({"setup": setup.name, "rep": rep, "load_average": load, "metrics": got,
                             "node_counters": delta(node_counters(setup.engines), before)})
                print(f"  {setup.name:4s} round {rep}: " + ", ".join(
                    f"{k} {v:,.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in got.items())
                      + f" (load {load:.1f})", flush=True)
                (args.out / "results.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    finally:
        for setup in setups:
            for node in reversed(setup.nodes):
                stop(node.server)
    keys = [k for k, v in runs[0]["metrics"].items() if isinstance(v, float)]
    print(f"\n{'median over rounds':22s} {'DP2':>10s} {'1P1D':>10s} {'1P1D/DP2':>9s}")
    for key in keys:
        values = {s: [r["metrics"][key] for r in runs if r["setup"] == s and r["metrics"][key] is not None]
                  for s in ("DP2", "1P1D")}
        dp2, pd = (statistics.median(v) if v else None for v in values.values())
        ratio = f"{pd / dp2:9.2f}" if dp2 and pd is not None else f"{'-':>9s}"
        print(f"{key:22s} {dp2 or 0:10,.2f} {pd or 0:10,.2f} {ratio}")
    failed = sum(r["metrics"]["failed"] for r in runs)
    print(f"failed requests: {failed}. Wrote {args.out}/results.json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
