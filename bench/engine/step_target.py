"""The step-time target (`--step-target-ms`) against a fixed step budget, on the engine alone.

What it answers: when a long prompt arrives while streams decode, does sizing each step's prefill
from the measured step rates (the default target: 16 steps without prefill) shrink the streams'
worst gap, and what does it cost on the realish mix? Setups, the same engine but for the target:
*target* (the default, or --target-ms), *fixed* (`step_target_ms` 0: the configured budget, 2,048
prefill tokens a step, every step), and with --floors one more per multiple (`floors4`: the
default target at 4 decode steps, a decode node's). With --layer-units, each target setup once
more with units of whole layers (`-layers`: the model's inner points left unmarked, as before a
unit could stop inside a layer). With --blas-threads N (OpenBLAS preloaded), each target setup once
more with OpenBLAS on N threads (`-tN`: a node's count, `adapters.blas.blas_threads`), the rest on
the process's own. Each repetition runs them all, alternating the order.

- burst: --streams greedy streams (64-token prompts, ignore_eos) decode; once each has streamed
  8 tokens, --long-requests prompts of --long-prompt tokens arrive one after another (each sent as
  the last one's first token came). For the streams' gaps between tokens inside that window it
  reports max and p99, and the long prompts' time to first token.
- realish: `engine_realish.run` (closed-loop workers on `benchlib.Mix("realish")`) at
  --concurrency for --seconds (60 or more: the window opens with every worker's first prompt at
  once, nothing decoding, the same in every setup): output tokens/s, TTFT p50 and the gap p99.
  --step-log DIR writes its steps (`StepLog`: decode rows, prompts waiting and the oldest's wait,
  the budget, the prefill tokens and units planned, the step's seconds, the rates) and prints a
  summary of them.

Then each setup over fixed: the geometric mean over the repetitions of each repetition's ratio
(the setups of one repetition run back to back, so a busy neighbour weighs on all), with the
smallest and largest. `--cpus` pins the process to those cores (the device thread inherits it):
on a shared box one core per run is steadier. Each line gives the box's load as it ended.

    .venv/bin/python bench/engine/step_target.py --cpus 1 --reps 4 --seconds 60 --floors 4 --out /tmp/st

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/: benchlib, which puts src/ on the path too
sys.path.insert(0, str(HERE))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class StepLog:
    """Each step of the engine in this process, as the scheduler planned it and as it took: the
    decode rows, the prompts waiting (and the oldest's wait), the budget, the prefill tokens and
    units planned, the seconds the step took and the rates it was sized by. It wraps the executor's
    `plan` and `measured_step` (bench code: nothing in src/ changes)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.first_seen: dict[str, float] = {}
        self.pending: dict[str, Any] | None = None

    def __enter__(self) -> StepLog:
        from adapters.mlx import executor

        self.module, self.plan = executor, executor.StepExecutor.plan
        self.measured = vars(executor)["measured_step"]
        log = self

        def plan(executor_self: Any) -> Any:
            made, candidates = log.plan(executor_self)
            now = time.perf_counter()
            for c in candidates:
                log.first_seen.setdefault(c.request_id, now)
            oldest = min(candidates, key=lambda c: c.order, default=None)
            rates = executor_self.loop.rates
            log.pending = {
                "t": now, "rows": made.decode_rows, "waiting": len(candidates), "budget": made.budget_tokens,
                "prefill": made.prefill_tokens, "units": sum(w.units for w in made.prefills),
                "prompts": len(made.prefills), "finishing": sum(w.finishes for w in made.prefills),
                "groups": len(made.groups),
                "waiting_tokens": sum(sum(c.units_left) for c in candidates),
                "oldest_wait_s": 0.0 if oldest is None else now - log.first_seen[oldest.request_id],
                "floor_s": rates.floor_s, "token_s": rates.prefill_token_s}
            return made, candidates

        def measured(rates: Any, seconds: float, prefill_tokens: int) -> Any:
            step = log.pending or {"t": time.perf_counter(), "rows": None}
            log.pending = None
            log.steps.append({**step, "seconds": seconds, "measured_prefill": prefill_tokens})
            return log.measured(rates, seconds, prefill_tokens)

        setattr(executor.StepExecutor, "plan", plan)  # noqa: B010 (a bench's patch, typed loosely)
        setattr(executor, "measured_step", measured)  # noqa: B010
        return self

    def __exit__(self, *_: object) -> None:
        setattr(self.module.StepExecutor, "plan", self.plan)  # noqa: B010
        setattr(self.module, "measured_step", self.measured)  # noqa: B010

    def summary(self) -> dict[str, Any]:
        steps = [s for s in self.steps if s.get("rows") is not None]
        with_prefill = [s for s in steps if s["prefill"]]
        total = sum(s["seconds"] for s in steps) or 1.0
        return {"steps": len(steps), "with_prefill": len(with_prefill),
                "prefill_time_share": sum(s["seconds"] for s in with_prefill) / total,
                "prefill_tokens_p50": percentile([s["prefill"] for s in with_prefill], 0.5),
                "step_ms_p50": 1000 * percentile([s["seconds"] for s in steps], 0.5),
                "step_ms_p99": 1000 * percentile([s["seconds"] for s in steps], 0.99),
                "rows_mean": statistics.fmean(s["rows"] for s in steps) if steps else 0.0,
                "waiting_mean": statistics.fmean(s["waiting"] for s in steps) if steps else 0.0,
                "oldest_wait_p50_s": percentile([s["oldest_wait_s"] for s in steps if s["waiting"]], 0.5)}


def burst(model_dir: Path, engine_args: dict[str, Any], streams: int, long_prompt: int,
          long_requests: int, salt: int) -> dict[str, Any]:
    import trio

    from adapters.mlx import MlxEngine
    from effects.engine_port import SamplingParams
    from statecore.events import TokensGenerated
    from statecore.ids import RequestId

    stream_sampling = SamplingParams(max_tokens=1500, ignore_eos=True)
    long_sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    gaps: list[tuple[float, float]] = []  # (when the token came, the gap before it)
    ttfts: list[float] = []

    async def main() -> dict[str, Any]:
        engine = await MlxEngine.load(model_dir, **engine_args)
        streaming = [0] * streams
        ready = trio.Event()
        try:
            # Warm-up: one long prompt and a stream alone, so that both setups start measured.
            warm = [3 + (5 * i + salt) % 500 for i in range(long_prompt)]
            outcome = await engine.prefill(RequestId("warm"), warm, long_sampling)
            await engine.decode_held(RequestId("warm"), warm, outcome.first_token, long_sampling)
            async for _ in engine.stream(RequestId("warm")):
                pass

            async def stream(index: int) -> None:
                prompt = [3 + (7 * i + 11 * index + salt) % 500 for i in range(64)]
                rid = RequestId(f"s{index}")
                outcome = await engine.prefill(rid, prompt, stream_sampling)
                await engine.decode_held(rid, prompt, outcome.first_token, stream_sampling)
                last = time.perf_counter()
                async for step in engine.stream(rid):
                    if not isinstance(step, TokensGenerated):
                        continue  # the end
                    now = time.perf_counter()
                    gaps.append((now, now - last))
                    last = now
                    streaming[index] += len(step.tokens)
                    if min(streaming) >= 8:
                        ready.set()

            async with trio.open_nursery() as nursery:
                for index in range(streams):
                    nursery.start_soon(stream, index)
                await ready.wait()
                window_start = time.perf_counter()
                for n in range(long_requests):
                    prompt = [3 + (13 * i + 17 * n + salt) % 500 for i in range(long_prompt)]
                    rid = RequestId(f"long{n}")
                    sent = time.perf_counter()
                    await engine.prefill(rid, prompt, long_sampling)
                    ttfts.append(time.perf_counter() - sent)
                    await engine.release_held(rid)
                window_end = time.perf_counter()
                nursery.cancel_scope.cancel()
        finally:
            await engine.aclose()
        inside = [gap for at, gap in gaps if window_start < at <= window_end]
        return {"gap_max_ms": 1000 * max(inside, default=0.0), "gap_p99_ms": 1000 * percentile(inside, 0.99),
                "gap_p50_ms": 1000 * percentile(inside, 0.5), "gaps": len(inside),
                "long_ttft_ms": 1000 * statistics.median(ttfts), "window_s": window_end - window_start}

    return trio.run(main)


def openblas_threads() -> int | None:
    """The threads the OpenBLAS in this process computes with (None: none is loaded)."""
    import ctypes

    try:
        getter = ctypes.CDLL(None).openblas_get_num_threads
    except AttributeError:
        return None
    getter.restype = ctypes.c_int
    return int(getter())


def measure(args: argparse.Namespace, model: Path, name: str, setup: dict[str, Any], rep: int,
            barrier: Any) -> dict[str, float]:
    """One setup's burst, then its realish run (under --side-by-side, each phase starts with the
    other setups' at a barrier, so that they share the cores through the same phases)."""
    from engine_realish import run as realish

    from adapters.blas import set_openblas_threads
    from adapters.mlx import loop_setup

    setup, marked = dict(setup), vars(loop_setup)["mark_inner_points"]
    if setup.pop("whole_layers", False):  # the units of whole layers: no inner point marked
        setattr(loop_setup, "mark_inner_points", lambda model, layers: 0)  # noqa: B010 (a bench's patch)
    threads, threads_before = setup.pop("blas_threads", None), openblas_threads()
    if threads is not None:
        if threads_before is None:
            raise SystemExit("--blas-threads: no OpenBLAS in this process (LD_PRELOAD it)")
        set_openblas_threads(threads)
    if barrier is not None:
        barrier.wait()
    measured: dict[str, float] = {}
    try:
        if not args.skip_burst:
            measured = burst(model, setup, args.streams, args.long_prompt, args.long_requests, rep)
        if args.skip_realish:
            return measured
        if barrier is not None:
            barrier.wait()
        with StepLog() as log:
            mix = realish(model, args.concurrency, args.seconds, setup, on_measure=log.steps.clear)
    finally:
        setattr(loop_setup, "mark_inner_points", marked)  # noqa: B010
        if threads is not None and threads_before is not None:
            set_openblas_threads(threads_before)
    if args.step_log is not None:
        args.step_log.mkdir(parents=True, exist_ok=True)
        with (args.step_log / f"realish-{rep}-{name}.jsonl").open("w") as out:
            out.writelines(json.dumps(step) + "\n" for step in log.steps)
        print(f"rep {rep} {name} realish steps: " + json.dumps(log.summary()), flush=True)
    measured.update({"realish_tok_s": mix["tok_s"], "realish_gap_p99_ms": mix["gap_p99_ms"],
                     "realish_ttft_p50_ms": mix["ttft_p50_ms"]})
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="default: benchlib.default_model()")
    parser.add_argument("--target-ms", type=float, default=None, help="the target setup's step_target_ms "
                        "(default: the engine's default)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--long-prompt", type=int, default=2000)
    parser.add_argument("--long-requests", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--cpus", default=None, help="pin to these cores (comma-separated)")
    parser.add_argument("--skip-realish", action="store_true")
    parser.add_argument("--skip-burst", action="store_true")
    parser.add_argument("--floors", default="", help="more setups: the default target at these multiples "
                        "of the measured decode step (step_target_floors; comma-separated), e.g. 4: a "
                        "decode node's")
    parser.add_argument("--side-by-side", action="store_true", help="run a repetition's setups at once, "
                        "each in its own process on the same --cpus: a busy neighbour weighs on all alike "
                        "(each runs slower than alone)")
    parser.add_argument("--only", default="", help="run only these setups (comma-separated names, e.g. "
                        "floors2,floors4-layers); fixed always runs")
    parser.add_argument("--layer-units", action="store_true", help="also each target setup with units "
                        "of whole layers (`-layers`), as before a unit could stop inside a layer")
    parser.add_argument("--blas-threads", type=int, default=None, help="also each target setup with "
                        "OpenBLAS on this many threads (`-tN`; a node's count: adapters.blas.blas_threads), "
                        "the others on the process's own; needs OpenBLAS preloaded")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--step-log", type=Path, default=None, help="write each realish run's steps "
                        "(StepLog) to DIR/realish-<rep>-<setup>.jsonl and print their summary")
    args = parser.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    from benchlib import default_model, machine

    model = args.model or default_model()
    setups: dict[str, dict[str, Any]] = {"target": {"step_target_ms": args.target_ms},
                                         "fixed": {"step_target_ms": 0.0}}
    for floors in filter(None, args.floors.split(",")):
        setups[f"floors{floors}"] = {"step_target_ms": None, "step_target_floors": float(floors)}
    if args.layer_units:
        setups.update({f"{name}-layers": {**setup, "whole_layers": True}
                       for name, setup in list(setups.items()) if name != "fixed"})
    if args.blas_threads is not None:
        setups.update({f"{name}-t{args.blas_threads}": {**setup, "blas_threads": args.blas_threads}
                       for name, setup in list(setups.items()) if name != "fixed"})
    if args.only:
        keep = {"fixed", *args.only.split(",")}
        setups = {name: setup for name, setup in setups.items() if name in keep}
    results: dict[str, dict[str, list[float]]] = {name: {} for name in setups}
    loads: list[float] = []
    for rep in range(args.reps):
        order = list(setups) if rep % 2 == 0 else list(reversed(setups))
        if args.side_by_side:
            import multiprocessing

            context = multiprocessing.get_context("spawn")  # MLX in a forked child is not safe
            barrier = context.Manager().Barrier(len(order))
            with context.Pool(len(order)) as pool:
                pending = {name: pool.apply_async(measure, (args, model, name, setups[name], rep, barrier))
                           for name in order}
                got = {name: result.get() for name, result in pending.items()}
        else:
            got = {name: measure(args, model, name, setups[name], rep, None) for name in order}
        loads.append(os.getloadavg()[0])
        for name, measured in got.items():
            print(f"rep {rep} {name} (load {loads[-1]:.1f}): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in measured.items()), flush=True)
            for key, value in measured.items():
                results[name].setdefault(key, []).append(float(value))
    medians = {name: {k: statistics.median(v) for k, v in got.items()} for name, got in results.items()}
    ratios: dict[str, dict[str, dict[str, float]]] = {}  # setup -> measure -> over fixed
    for name in setups:
        if name == "fixed":
            continue
        for key, values in results[name].items():
            paired = [t / f for t, f in zip(values, results["fixed"][key], strict=True) if t > 0 and f > 0]
            if paired:
                ratios.setdefault(name, {})[key] = {
                    "geomean": math.exp(statistics.fmean(math.log(r) for r in paired)),
                    "min": min(paired), "max": max(paired)}
    print(json.dumps({"medians": medians, "over_fixed": ratios}, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine(),
             "load_avg": os.getloadavg(), "loads": loads, "runs": results, "medians": medians,
             "over_fixed": ratios},
            indent=1))


if __name__ == "__main__":
    main()
