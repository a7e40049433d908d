"""The engine alone (no HTTP) on the realish mix, beside the bare model: where the serving path's
time goes. C closed-loop workers (each sends its next request when the last ends) with realish
prompt and output lengths (`benchlib.Mix("realish")`), greedy, ignore_eos, for --seconds; prints
output tokens/s, the time to the first token (prefill call), the gaps between a stream's tokens,
and the device thread's time by kind of work; then the bare model's pipelined batch-C decode.

    python3 bench/engine/engine_realish.py --model /tmp/llama1b --concurrency 8,32

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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/: benchlib, which puts src/ on the path too
sys.path.insert(0, str(HERE))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(model_dir: Path, concurrency: int, seconds: float, engine_args: dict[str, Any],
        on_measure: Any = None, warmup_s: float = 2.0, mix: str = "realish") -> dict[str, Any]:
    """`on_measure` (if given) is called when the warm-up is over and the measured window starts."""
    import trio
    from benchlib import parse_mix

    from adapters.mlx import MlxEngine
    from effects.engine_port import SamplingParams
    from statecore.events import TokensGenerated
    from statecore.ids import RequestId

    rng = random.Random(f"engine-realish:{concurrency}")
    work = parse_mix(mix).lengths(4096, rng)
    gaps: list[float] = []
    ttfts: list[float] = []
    produced = [0]

    async def worker(engine: MlxEngine, index: int, deadline: float) -> None:
        n = 0
        while time.perf_counter() < deadline:
            p, o = work[(index * 131 + n) % len(work)]
            rid = RequestId(f"w{index}-{n}")
            n += 1
            prompt = [3 + (7 * i + 11 * index + 13 * n) % 500 for i in range(p)]
            sampling = SamplingParams(max_tokens=o, ignore_eos=True)
            start = time.perf_counter()
            outcome = await engine.prefill(rid, prompt, sampling)
            ttfts.append(time.perf_counter() - start)
            await engine.decode_held(rid, prompt, outcome.first_token, sampling)
            produced[0] += 1
            last = time.perf_counter()
            async for step in engine.stream(rid):
                if not isinstance(step, TokensGenerated):
                    continue  # the end
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
                produced[0] += len(step.tokens)

    async def main() -> dict[str, Any]:
        engine = await MlxEngine.load(model_dir, **engine_args)
        try:
            async with trio.open_nursery() as nursery:  # warm-up
                for i in range(concurrency):
                    nursery.start_soon(worker, engine, 1000 + i, time.perf_counter() + warmup_s)
            gaps.clear()
            ttfts.clear()
            produced[0] = 0
            before = engine.device_profile()
            if on_measure is not None:
                on_measure()
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(concurrency):
                    nursery.start_soon(worker, engine, i, start + seconds)
            elapsed = time.perf_counter() - start
            after = engine.device_profile()
        finally:
            await engine.aclose()
        profile = {k: [after[k][0] - before[k][0], round(after[k][1] - before[k][1], 3)] for k in after}
        return {"concurrency": concurrency, "tok_s": produced[0] / elapsed, "seconds": elapsed,
                "ttft_p50_ms": 1000 * (statistics.median(ttfts) if ttfts else 0),
                "gap_p50_ms": 1000 * (percentile(gaps, 0.5) or 0),
                "gap_p99_ms": 1000 * (percentile(gaps, 0.99) or 0),
                "device_profile": profile}

    return trio.run(main)


def start_memory_trace(period_s: float) -> None:
    """A thread printing, every `period_s`, what MLX's allocator holds (active, cached, peak) and,
    on an NVIDIA GPU, what the device has in use: does memory grow step after step?"""
    import shutil
    import subprocess
    import threading

    import mlx.core as mx

    def used_on_device() -> str:
        if shutil.which("nvidia-smi") is None:
            return "-"
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=False).stdout.split()
        return f"{int(out[0]) / 1024:.1f}" if out else "-"

    def trace() -> None:
        start = time.perf_counter()
        while True:
            gib = 1 << 30
            print(f"memory t={time.perf_counter() - start:6.1f}s active {mx.get_active_memory() / gib:6.2f} "
                  f"cache {mx.get_cache_memory() / gib:6.2f} peak {mx.get_peak_memory() / gib:6.2f} "
                  f"device used {used_on_device()} GiB", flush=True)
            time.sleep(period_s)

    threading.Thread(target=trace, daemon=True, name="memory-trace").start()


def start_gil_neighbour(busy_s: float, idle_s: float) -> None:
    """A daemon thread holding the GIL busy_s at a time (Python bytecode), then sleeping idle_s."""
    import threading

    def spin() -> None:
        while True:
            until = time.perf_counter() + busy_s
            count = 0
            while time.perf_counter() < until:
                count += 1
            time.sleep(idle_s)

    threading.Thread(target=spin, daemon=True, name="gil-neighbour").start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--mix", default="realish", help="'realish' or PxO (benchlib.parse_mix)")
    parser.add_argument("--engine-arg", action="append", default=[],
                        help="NAME=VALUE passed to MlxEngine.load (an int when it is one)")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for the run "
                             "(a node sets its own; Python's default is 5 ms)")
    parser.add_argument("--gil-neighbour", default=None, metavar="BUSY_MS/IDLE_MS",
                        help="a thread that runs pure Python for BUSY_MS then sleeps IDLE_MS, over and "
                             "over: a stand-in for an HTTP front end sharing the GIL")
    parser.add_argument("--warmup-seconds", type=float, default=2.0,
                        help="unmeasured load first (the GPU meets most of its kernel shapes in it)")
    parser.add_argument("--memory-trace", type=float, default=None, metavar="SECONDS",
                        help="print the allocator's and the device's memory every SECONDS")
    parser.add_argument("--cache-limit-bytes", type=int, default=None,
                        help="mx.set_cache_limit before loading (MLX's default: its memory limit)")
    parser.add_argument("--no-bare", action="store_true", help="skip the bare model's decode")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.gil_neighbour:
        busy_ms, idle_ms = (float(x) for x in args.gil_neighbour.split("/"))
        start_gil_neighbour(busy_ms / 1000, idle_ms / 1000)
    if args.memory_trace:
        start_memory_trace(args.memory_trace)
    if args.cache_limit_bytes is not None:
        import mlx.core as mx
        mx.set_cache_limit(args.cache_limit_bytes)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    engine_args = {k: int(v) if v.lstrip("-").isdigit() else v
                   for k, v in (a.split("=", 1) for a in args.engine_arg)}
    from bare_decode import decode_rate
    from mlx_lm import load

    results: dict[str, Any] = {"engine_args": engine_args}
    for c in (int(x) for x in args.concurrency.split(",")):
        results[f"engine_c{c}"] = run(args.model, c, args.seconds, engine_args, warmup_s=args.warmup_seconds,
                                      mix=args.mix)
        print(json.dumps(results[f"engine_c{c}"]), flush=True)
    if not args.no_bare:
        model = load(str(args.model))[0]
        for c in (int(x) for x in args.concurrency.split(",")):
            results[f"bare_b{c}"] = decode_rate(model, c, 256, 64, 500)
            print(json.dumps({f"bare_b{c}": results[f"bare_b{c}"]}), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
