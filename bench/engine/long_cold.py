"""A long cold prompt's prefill time, this checkout's engine against another's, in one run.

Each round prefills one prompt of --tokens tokens that no engine has seen (its own salt) on an
`MlxEngine` loaded with its defaults, from this checkout's `src/` and from --base-src (e.g. main's
code unpacked with `git archive`; this checkout's own `src/` is no second side: the ratios are
then over this checkout at its default chunk size), and at the other chunk sizes of --chunks.
--message-every takes a comma list: each engine prefills a prompt for each (an end-of-turn token
every so many tokens; 0: none).

One process per source tree runs all of its sides and rounds, an engine loaded for each side (for
each side and round with --reload, the sides then taking turns, their order reversed from round
to round): a process's start (imports, the device's context, kernels compiled on first use: tens
of seconds on a GPU) is paid once per tree, not once per prefill. With --alternate-trees a process
per tree and round instead, the trees taking turns: on a shared box whose load moves over minutes
the trees' prefills of one round are then minutes apart at most. With --warm-first each engine
first prefills a prompt of the same length and message ends (other tokens), so the timed one
meets no attention shape for the first time in its process. The model is the bench's tiny llama
(hidden 256, 4 layers) with its context raised to fit the prompt (a copy under --work), unless
--model. Prints a line per prefill as it ends and, last, the median ratio over the base per side
and message spacing.

    git archive main src | tar -x -C /tmp/base
    .venv/bin/python bench/engine/long_cold.py --base-src /tmp/base/src --tokens 8000 --rounds 3 --reload

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # support/: the tiny checkpoints

# One source tree's process: for each (side, its engine's settings, rounds), an engine loaded, then
# each round's prefill at each message spacing; a JSON line per timed prefill.
_CHILD = """
import json, sys, time
sys.path.insert(0, {src!r})
from adapters.blas import apply_blas_choice, parse_blas_choice
blas = apply_blas_choice(parse_blas_choice({blas!r}))
import trio
from adapters.mlx.engine import MlxEngine
from effects.engine_port import SamplingParams
from statecore.ids import RequestId

def prompt_of(salt, every, end):
    prompt = [(7 * i + 3 + 11 * salt) % 500 + 2 for i in range({tokens})]
    if every:  # a chat's message ends: an end-of-turn token every so many tokens
        prompt = [end if (i + 1) % every == 0 else token for i, token in enumerate(prompt)]
    return prompt

async def main():
    warmed = set()
    for side, settings, rounds in {plan!r}:
        engine = await MlxEngine.load({model!r}, prefix_cache_bytes=0, warm_request=False, **settings)
        try:
            end = min(engine.info.eos_token_ids)
            for round_ in rounds:
                for every in {everies!r}:
                    if {warm_first!r} and (side, every) not in warmed:  # the shapes the timed one meets
                        warmed.add((side, every))
                        await engine.prefill(RequestId("warm"), prompt_of(1000 + round_, every, end),
                                             SamplingParams(max_tokens=1))
                        await engine.release_held(RequestId("warm"))
                    started = time.perf_counter()
                    outcome = await engine.prefill(RequestId("long"), prompt_of(100 + round_, every, end),
                                                   SamplingParams(max_tokens=1))
                    seconds = time.perf_counter() - started
                    await engine.release_held(RequestId("long"))
                    print(json.dumps({{"round": round_, "side": side, "every": every, "seconds": seconds,
                                      "first": outcome.first_token,
                                      "chunk": engine.info.prefill_chunk_size, "blas": blas}}), flush=True)
        finally:
            await engine.aclose()

trio.run(main)
sys.stdout.flush()
import os
os._exit(0)  # MLX's C++ teardown aborts a few percent of exits (src/adapters/serve/command.py)
"""


def long_context_model(work: Path, tokens: int) -> Path:
    from support.tiny_models import cached_checkpoint

    source = cached_checkpoint("llama", hidden_size=256, num_layers=4)
    target = work / f"llama-256x4-ctx{tokens + 64}"
    if not target.exists():
        shutil.copytree(source, target)
        config = json.loads((target / "config.json").read_text())
        config["max_position_embeddings"] = tokens + 64
        (target / "config.json").write_text(json.dumps(config))
    return target


def run_tree(src: Path, plan: list[tuple[str, dict[str, int], list[int]]], model: Path, tokens: int,
             blas: str, warm_first: bool, everies: list[int]) -> list[dict[str, object]]:
    """One source tree's process: its prefills' results, each printed as it ends."""
    code = _CHILD.format(src=str(src), plan=plan, model=str(model), tokens=tokens, blas=blas,
                         warm_first=warm_first, everies=everies)
    results: list[dict[str, object]] = []
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as child:
        assert child.stdout is not None and child.stderr is not None
        for line in child.stdout:
            if line.startswith("{"):
                result = json.loads(line)
                results.append(result)
                print(json.dumps(result), flush=True)
        errors = child.stderr.read()
    if child.returncode:
        raise SystemExit(f"the prefills from {src} exited {child.returncode}: {errors[-2000:]}")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-src", type=Path, required=True,
                        help="the other checkout's src/ (this checkout's own: ratios over its default chunk)")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blas", choices=["auto", "openblas", "bundled"], default="auto")
    parser.add_argument("--chunks", default="",
                        help="also this checkout at these chunk sizes (a comma list), e.g. 512,2048")
    parser.add_argument("--warm-first", action="store_true",
                        help="prefill one prompt of the same length (other tokens) before the first timed "
                             "one of each engine and spacing: on a GPU, what a serving node has met already "
                             "(its attention shapes)")
    parser.add_argument("--message-every", default="0",
                        help="a comma list: an end-of-turn token every N prompt tokens (a chat's messages; "
                             "this checkout ends a prefill block after each; 0: none): what those cuts cost")
    parser.add_argument("--alternate-trees", action="store_true",
                        help="a process per source tree and round, the trees taking turns (this, base; then "
                             "base, this): on a shared box whose load moves over minutes, each round's ratio "
                             "compares prefills minutes apart at most, not a whole tree's rounds apart")
    parser.add_argument("--reload", action="store_true",
                        help="load each side's engine again every round, the sides taking turns, "
                             "their order reversed from round to round (on a busy CPU: a drift in its "
                             "load weighs on every side alike); default: one engine per side for all its "
                             "rounds (a GPU's load takes seconds)")
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "results" / "long_cold")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.model or long_context_model(args.work, args.tokens)
    everies = [int(every) for every in args.message_every.split(",") if every]
    this_src, base_src = (ROOT / "src").resolve(), args.base_src.resolve()
    sides: dict[str, tuple[Path, dict[str, int]]] = {"this": (this_src, {})}
    if base_src != this_src:
        sides["base"] = (base_src, {})
    for chunk in (int(c) for c in args.chunks.split(",") if c):
        sides[f"this@{chunk}"] = (this_src, {"prefill_chunk_size": chunk})
    base = "base" if "base" in sides else "this"
    results: list[dict[str, object]] = []
    trees = list(dict.fromkeys(src for src, _ in sides.values()))
    if args.alternate_trees:  # a process per tree and round, the trees taking turns
        for round_ in range(args.rounds):
            for src in trees if round_ % 2 == 0 else trees[::-1]:
                plan = [(side, sides[side][1], [round_]) for side, (tree, _) in sides.items() if tree == src]
                results += run_tree(src, plan, model, args.tokens, args.blas, args.warm_first, everies)
    for src in [] if args.alternate_trees else trees:
        mine = [side for side, (tree, _) in sides.items() if tree == src]
        if args.reload:  # an engine per round and side, the sides taking turns
            plan = [(side, sides[side][1], [round_]) for round_ in range(args.rounds)
                    for side in (mine if round_ % 2 == 0 else mine[::-1])]
        else:
            plan = [(side, sides[side][1], list(range(args.rounds))) for side in mine]
        results += run_tree(src, plan, model, args.tokens, args.blas, args.warm_first, everies)
    seconds = {(str(r["side"]), int(r["every"]), int(r["round"])): float(r["seconds"])  # type: ignore[call-overload]
               for r in results}
    ratios = {f"{side} every {every}": [round(seconds[side, every, round_] / seconds[base, every, round_], 3)
                                        for round_ in range(args.rounds)]
              for side in sides if side != base for every in everies}
    summary = {"tokens": args.tokens, "base": base, "everies": everies,
               "seconds": {f"{side} every {every}": [seconds[side, every, r] for r in range(args.rounds)]
                           for side in sides for every in everies},
               "ratios_over_base_by_round": ratios,
               "median_ratio_over_base": {name: statistics.median(r) for name, r in ratios.items()}}
    (args.work / "results.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({"base": base, "median_ratio_over_base": summary["median_ratio_over_base"],
                      "median_seconds": {name: round(statistics.median(s), 3)
                                         for name, s in summary["seconds"].items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
