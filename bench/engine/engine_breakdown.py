"""What each kind of device work costs inside the engine on the realish mix, GPU time included.

The device loop overlaps everything (one `mx.async_eval` per step), so its own profile cannot say
whether a step is slow because of its decode call, its prefills or its copies into slots. Here the
engine runs the same closed-loop realish load as bench/engine/engine_realish.py, but with the device
loop's pieces wrapped so that each one is evaluated on its own, synchronously, and timed: build
(Python, graph only) and eval (device) per call, with the call's size (decode rows and the
attended length; prefill tokens). Serialised this way the engine is slower than it really is; the
point is the split. Then, kernels only, the slot lane's decode step at realish-like ragged
lengths against mlx-lm's KVCache at the same longest length.

    python3 bench/engine/engine_breakdown.py --model /tmp/llama1b --concurrency 32

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/: benchlib, which puts src/ on the path too
sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402

# kind -> one (build seconds, eval seconds, size) per call
_costs: dict[str, list[tuple[float, float, int]]] = collections.defaultdict(list)


def _timed(kind: str, build_started: float, outputs: list[Any], size: int) -> None:
    built = time.perf_counter()
    mx.eval([o for o in outputs if o is not None])
    _costs[kind].append((built - build_started, time.perf_counter() - built, size))


def instrument() -> None:
    """Wrap the device loop's pieces so that each is evaluated and timed alone."""
    import adapters.mlx.prefill_build as prefill_build  # where the step's prefill calls are made
    from adapters.mlx.slot_lane import SlotLane

    original_slot = SlotLane.build
    original_units = prefill_build.run_units
    original_short = prefill_build.run_short_batch
    original_copy = SlotLane.enter

    def build_slot_step(self: Any, rows: list[Any], current: Any) -> list[Any]:
        started = time.perf_counter()
        longest = max(live.offset for live in rows) + 1
        outputs = original_slot(self, rows, current)
        _timed("decode", started, outputs, len(rows))
        _costs["decode_length"].append((0.0, 0.0, longest))
        return outputs

    def run_units(model: Any, task: Any, *rest: Any, **named: Any) -> list[Any]:
        started = time.perf_counter()
        before = task.done_tokens
        pieces = original_units(model, task, *rest, **named)
        _timed("prefill", started, [task.first, *pieces], task.done_tokens - before)
        return pieces

    def run_short_batch(model: Any, tasks: Any, *rest: Any, **named: Any) -> None:
        started = time.perf_counter()
        original_short(model, tasks, *rest, **named)
        outputs = [t.first for t in tasks] + [c.state for t in tasks for c in t.cache]
        _timed("prefill_batch", started, outputs, sum(len(t.tokens) for t in tasks))

    def copy_into_slot(self: Any, live: Any, cache: list[Any], prompt_tokens: int, needed: int) -> None:
        started = time.perf_counter()
        original_copy(self, live, cache, prompt_tokens, needed)
        pool = self.loop.pool
        _timed("copy_into_slot", started, [*pool.keys, *pool.values], prompt_tokens)

    SlotLane.build = build_slot_step  # type: ignore[method-assign]
    prefill_build.run_units = run_units  # type: ignore[assignment]
    prefill_build.run_short_batch = run_short_batch  # type: ignore[assignment]
    SlotLane.enter = copy_into_slot  # type: ignore[method-assign]


def summary(seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, rows in _costs.items():
        if kind == "decode_length":
            sizes = sorted(s for _, _, s in rows)
            out[kind] = {"p50": sizes[len(sizes) // 2], "p90": sizes[int(0.9 * len(sizes))], "max": sizes[-1]}
            continue
        build = sum(b for b, _, _ in rows)
        run = sum(e for _, e, _ in rows)
        size = sum(s for _, _, s in rows)
        out[kind] = {"calls": len(rows), "build_s": round(build, 3), "eval_s": round(run, 3),
                     "share_of_wall": round((build + run) / seconds, 3),
                     "ms_per_call": round(1000 * (build + run) / max(1, len(rows)), 2),
                     "mean_size": round(size / max(1, len(rows)), 1)}
        if kind.startswith("prefill"):
            out[kind]["us_per_token"] = round(1e6 * (build + run) / max(1, size), 1)
    return out


def ragged_step(model_dir: Path, batch: int, steps: int) -> dict[str, Any]:
    """Kernels only: the slot step at realish-like ragged offsets vs KVCache at the longest."""
    import random

    from benchlib import Mix
    from mlx_lm import load
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from adapters.mlx.slots import SlotPool

    model = load(str(model_dir))[0]
    rng = random.Random(5)
    lengths = [p + o // 2 for p, o in Mix("realish").lengths(batch, rng)]
    longest = max(lengths)
    result: dict[str, Any] = {"batch": batch, "lengths_p50": sorted(lengths)[batch // 2], "longest": longest}

    def timed(step: Any) -> float:
        tok = mx.zeros((batch,), dtype=mx.uint32)
        for _ in range(5):
            tok = step(tok)
            mx.eval(tok)
        start = time.perf_counter()
        for _ in range(steps):
            tok = step(tok)
            mx.async_eval(tok)  # type: ignore[no-untyped-call]
        mx.eval(tok)
        return round(1000 * (time.perf_counter() - start) / steps, 3)

    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(3, 500, (batch, longest)), cache=cache))
    result["kvcache_ms"] = timed(lambda t: mx.argmax(model(t[:, None], cache=cache)[:, -1, :], axis=-1))
    one = []
    for layer in cache:
        c = KVCache()  # type: ignore[no-untyped-call]
        c.keys, c.values, c.offset = layer.keys[:1], layer.values[:1], longest
        one.append(c)
    cases = (("slots_ragged_ms", list(lengths), 0), ("slots_ragged_bucket128_ms", list(lengths), 128),
             ("slots_uniform_ms", [longest] * batch, 0))
    for name, offsets, bucket in cases:
        pool = SlotPool(batch, len(cache), 1 << 15)
        pool.reserve(longest + steps + 64, one)
        for slot in range(batch):
            pool.write_prompt(slot, one, offsets[slot])
        mx.eval(pool.keys, pool.values)

        def slot_step(t: Any, pool: Any = pool, offsets: list[int] = offsets, bucket: int = bucket) -> Any:
            layers = pool.step_layers(offsets, bucket=bucket)
            for i in range(batch):
                offsets[i] += 1
            return mx.argmax(model(t[:, None], cache=layers)[:, -1, :], axis=-1)

        result[name] = timed(slot_step)
        result[name.replace("_ms", "_capacity")] = pool.capacity
        if name != "slots_ragged_ms":
            continue
        # Timing only (wrong numbers): the same step without the mask, then without the scatter.
        from adapters.mlx.slots import SlotStepLayer

        real_mask, real_update = SlotStepLayer.make_mask, SlotStepLayer.update_and_fetch
        SlotStepLayer.make_mask = lambda self, n, return_array=False, window_size=None: None  # type: ignore
        result["slots_ragged_nomask_ms"] = timed(slot_step)
        SlotStepLayer.make_mask = real_mask  # type: ignore[method-assign]

        def fetch_only(self: Any, keys: Any, values: Any) -> tuple[Any, Any]:
            k, v = self._pool.keys[self._index], self._pool.values[self._index]
            rows = keys.shape[0]
            return k[:rows, :, : self._length, :], v[:rows, :, : self._length, :]

        SlotStepLayer.update_and_fetch = fetch_only  # type: ignore[method-assign]
        result["slots_ragged_noscatter_ms"] = timed(slot_step)
        SlotStepLayer.update_and_fetch = real_update  # type: ignore[method-assign]
    result["prefill"] = prefill_shapes(model)
    return result


def prefill_shapes(model: Any) -> dict[str, float]:
    """ms of one prefill call on a fresh cache: the first of its shape (cold) and again (warm)."""
    from mlx_lm.models.cache import make_prompt_cache

    out: dict[str, float] = {}
    for rows, length in ((1, 384), (1, 1024), (1, 2048), (8, 384)):
        for label in ("cold", "warm"):
            cache = make_prompt_cache(model)
            tokens = mx.random.randint(3, 500, (rows, length))
            mx.eval(tokens)
            start = time.perf_counter()
            mx.eval(model(tokens, cache=cache))
            out[f"{rows}x{length}_{label}_ms"] = round(1000 * (time.perf_counter() - start), 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--engine-arg", action="append", default=[], help="NAME=INT passed to MlxEngine.load")
    parser.add_argument("--no-ragged", action="store_true", help="skip the kernels-only slot step")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from engine_realish import run

    results: dict[str, Any] = {}
    if not args.no_ragged:
        results["ragged"] = ragged_step(args.model, args.concurrency, 50)
        print(json.dumps(results["ragged"]), flush=True)
    instrument()
    engine_args = {k: int(v) for k, v in (a.split("=", 1) for a in args.engine_arg)}
    results["engine_timed"] = run(args.model, args.concurrency, args.seconds, engine_args,
                                  on_measure=_costs.clear)
    results["breakdown"] = summary(results["engine_timed"]["seconds"])
    timed = {k: v for k, v in results["engine_timed"].items() if k != "device_profile"}
    print(json.dumps({"engine_args": engine_args, "engine_timed": timed, "breakdown": results["breakdown"]}),
          flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
