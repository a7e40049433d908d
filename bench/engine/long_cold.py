"""A long cold prompt's prefill time, this checkout's engine against another's, in one run.

Each round prefills one prompt of --tokens tokens that no engine has seen (its own salt) on an
`MlxEngine` loaded with its defaults, once from this checkout's `src/` and once from --base-src
(e.g. main's code unpacked with `git archive`), each in a process of its own, the order reversed
from round to round (--chunks adds this checkout at other chunk sizes). The model is the bench's
tiny llama (hidden 256, 4 layers) with its context raised to fit the prompt (a copy under
--work), unless --model. Prints each round's seconds and the median ratio to the base.

    git archive main src | tar -x -C /tmp/base
    .venv/bin/python bench/engine/long_cold.py --base-src /tmp/base/src --tokens 8000 --rounds 3

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

_CHILD = """
import json, sys, time
sys.path.insert(0, {src!r})
from adapters.blas import apply_blas_choice, parse_blas_choice
blas = apply_blas_choice(parse_blas_choice({blas!r}))
import trio
from adapters.mlx.engine import MlxEngine
from effects.engine_port import SamplingParams
from statecore.ids import RequestId

async def main():
    engine = await MlxEngine.load({model!r}, prefix_cache_bytes=0, warm_request=False, **{settings!r})
    try:
        for salt in {warm_salts!r}:  # the same length first, other tokens: the GPU's shapes met
            await engine.prefill(RequestId("warm"), [(7 * i + 3 + 11 * salt) % 500 + 2
                                                     for i in range({tokens})], SamplingParams(max_tokens=1))
            await engine.release_held(RequestId("warm"))
        prompt = [(7 * i + 3 + 11 * {salt}) % 500 + 2 for i in range({tokens})]
        if {every}:  # a chat's message ends: an end-of-turn token every so many tokens
            end = min(engine.info.eos_token_ids)
            prompt = [end if (i + 1) % {every} == 0 else token for i, token in enumerate(prompt)]
        started = time.perf_counter()
        outcome = await engine.prefill(RequestId("long"), prompt, SamplingParams(max_tokens=1))
        seconds = time.perf_counter() - started
        await engine.release_held(RequestId("long"))
        chunk = engine.info.prefill_chunk_size
        print(json.dumps({{"seconds": seconds, "first": outcome.first_token, "chunk": chunk,
                          "blas": blas}}))
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


def prefill_once(src: Path, chunk: int | None, model: Path, tokens: int, salt: int, blas: str,
                 warm_first: bool, every: int = 0) -> dict[str, object]:
    settings = {} if chunk is None else {"prefill_chunk_size": chunk}
    code = _CHILD.format(src=str(src), model=str(model), tokens=tokens, salt=salt, blas=blas, every=every,
                         settings=settings, warm_salts=[salt + 1000] if warm_first else [])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the prefill from {src} exited {done.returncode}: {done.stderr[-2000:]}")
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-src", type=Path, required=True, help="the other checkout's src/")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blas", choices=["auto", "openblas", "bundled"], default="auto")
    parser.add_argument("--chunks", default="",
                        help="also this checkout at these chunk sizes (a comma list), e.g. 512,2048")
    parser.add_argument("--warm-first", action="store_true",
                        help="prefill one prompt of the same length (other tokens) before the timed one: "
                             "on a GPU, what a serving node has met already (its attention shapes)")
    parser.add_argument("--message-every", type=int, default=0,
                        help="an end-of-turn token every N prompt tokens (a chat's messages; this "
                             "checkout ends a prefill block after each): what those cuts cost")
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "results" / "long_cold")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.model or long_context_model(args.work, args.tokens)
    sides: dict[str, tuple[Path, int | None]] = {"this": (ROOT / "src", None),
                                                  "base": (args.base_src.resolve(), None)}
    for chunk in (int(c) for c in args.chunks.split(",") if c):
        sides[f"this@{chunk}"] = (ROOT / "src", chunk)
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        for side in order:
            got = prefill_once(*sides[side], model, args.tokens, 100 + round_, args.blas, args.warm_first,
                               args.message_every)
            seconds[side].append(float(got["seconds"]))  # type: ignore[arg-type]
            print(f"round {round_} {side}: {json.dumps(got)}", flush=True)
    ratios = {side: [round(a / b, 3) for a, b in zip(seconds[side], seconds["base"], strict=True)]
              for side in sides if side != "base"}
    summary = {"tokens": args.tokens, "seconds": seconds, "ratios_over_base_by_round": ratios,
               "median_ratio_over_base": {side: statistics.median(r) for side, r in ratios.items()}}
    print(json.dumps(summary))
    (args.work / "results.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
