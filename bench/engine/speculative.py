"""What prompt lookup (`--speculative ngram`) gives one stream: decode tokens/s with and without it.

One engine (`MlxEngine`, no HTTP) without speculation and one per --draft-tokens value, loaded in
this process on a model that mostly continues a fixed chain of tokens (`support.chain_model`,
--hidden-size / --layers). Two workloads, one request at a time, engines in turn within each
round: `edit`, a prompt that holds the answer (the chain from its last token on, as a code edit's
prompt holds most of the new file), `chat`, a prompt that does not (the answer is new
tokens), and `mislead`, a prompt that holds the chain with every third token changed (drafts are
found at almost every step, and the first of them is wrong: what speculation costs when it
fails). Reports each engine's decode tokens/s (first token to last, greedy) per workload, its
ratio to the engine without speculation in the same round (median over rounds), the acceptance
rate and tokens per verify step, and checks that every engine wrote the same tokens. The BLAS is
this process's: run it once as is (MLX's bundled BLAS) and once with
`LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0` to see what the load check allows there.
On a GPU give the model `--head-dim 64` (or 128): MLX's CUDA attention kernels take those widths,
not the tiny checkpoints' default 16.

    .venv/bin/python bench/engine/speculative.py [--tokens 200] [--rounds 5] [--draft-tokens 3,5]

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # support/: the tiny checkpoints

WORKLOADS = ("edit", "chat", "mislead")


def prompt_for(workload: str, tokens: int, salt: int) -> list[int]:
    from support.chain_model import FIRST_ORDINARY, chain

    filler = [FIRST_ORDINARY + (37 * i + 11 * salt) % 400 for i in range(64)]
    start = FIRST_ORDINARY + (97 * salt + 5) % 400
    if workload == "edit":  # the answer is in the prompt (all of the chain), after some other text
        return [*filler, *chain(start, 520), *filler[:32], start]
    if workload == "mislead":  # the chain with every third token changed: every draft is wrong
        wrong = [token if i % 3 else FIRST_ORDINARY + (token * 7) % 400
                 for i, token in enumerate(chain(start, 520))]
        return [*filler, *wrong, *filler[:32], start]
    return [*filler, *filler[::-1], start]


async def decode_one(engine: Any, rid: str, prompt: list[int], tokens: int
                     ) -> tuple[float, float, list[int]]:
    """(wall seconds, this process's CPU seconds, tokens) of one request's decode."""
    from effects.engine_port import SamplingParams
    from statecore.events import TokensGenerated
    from statecore.ids import RequestId

    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    outcome = await engine.prefill(RequestId(rid), prompt, sampling)
    started, cpu = time.perf_counter(), time.process_time()
    await engine.decode_held(RequestId(rid), prompt, outcome.first_token, sampling)
    out = [token async for step in engine.stream(RequestId(rid)) if isinstance(step, TokensGenerated)
           for token in step.tokens]
    return time.perf_counter() - started, time.process_time() - cpu, [outcome.first_token, *out]


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    from adapters.blas import blas_in_use
    from adapters.mlx.engine import MlxEngine
    from support.chain_model import build_chain_checkpoint

    model = build_chain_checkpoint(Path(tempfile.mkdtemp(prefix="chain-")), hidden_size=args.hidden_size,
                                   num_layers=args.layers, strength=args.strength, layer_gain=args.layer_gain,
                                   dtype=args.dtype, head_dim=args.head_dim)
    names = ["off", *(f"ngram-k{k}" for k in args.draft_tokens)]
    common = {"prefill_chunk_size": 256, "compile_decode": args.compile_decode}
    engines = {"off": await MlxEngine.load(model, **common)}
    checks: dict[str, Any] = {}
    for k in args.draft_tokens:
        engine = await MlxEngine.load(model, speculative="ngram", num_draft_tokens=k, **common)
        engines[f"ngram-k{k}"] = engine
        speculator = engine._device.speculator
        checks[f"ngram-k{k}"] = {"off_reason": speculator.off_reason, "row_classes": speculator.classes}
    rates: dict[tuple[str, str], list[float]] = {(n, w): [] for n in names for w in WORKLOADS}
    ratios: dict[tuple[str, str], list[float]] = {(n, w): [] for n in names[1:] for w in WORKLOADS}
    # tokens per CPU second of this process: what a busy shared machine's wall clock hides
    cpu_rates: dict[tuple[str, str], list[float]] = {(n, w): [] for n in names for w in WORKLOADS}
    cpu_ratios: dict[tuple[str, str], list[float]] = {(n, w): [] for n in names[1:] for w in WORKLOADS}
    counters: dict[tuple[str, str], list[int]] = {(n, w): [0] * 5 for n in names[1:] for w in WORKLOADS}
    mismatches = 0
    for round_ in range(args.rounds):
        for workload in WORKLOADS:
            prompt = prompt_for(workload, args.tokens, round_)
            outputs: dict[str, list[int]] = {}
            for name in names:
                engine = engines[name]
                speculator = engine._device.speculator
                before = engine.statistics()
                reads = 0 if speculator is None else speculator.early_reads
                seconds, cpu, outputs[name] = await decode_one(engine, f"{workload}{round_}", prompt,
                                                               args.tokens)
                after = engine.statistics()
                rates[name, workload].append((args.tokens - 1) / seconds)
                cpu_rates[name, workload].append((args.tokens - 1) / cpu)
                if speculator is not None:
                    deltas = (after.speculative_steps - before.speculative_steps,
                              after.speculative_drafted - before.speculative_drafted,
                              after.speculative_accepted - before.speculative_accepted,
                              after.speculative_emitted - before.speculative_emitted,
                              speculator.early_reads - reads)
                    counters[name, workload] = [a + b for a, b in zip(counters[name, workload], deltas,
                                                                      strict=True)]
                    ratios[name, workload].append(rates[name, workload][-1] / rates["off", workload][-1])
                    cpu_ratios[name, workload].append(
                        cpu_rates[name, workload][-1] / cpu_rates["off", workload][-1])
            mismatches += sum(outputs[name] != outputs["off"] for name in names)
    for engine in engines.values():
        await engine.aclose()
    rows = []
    for workload in WORKLOADS:
        for name in names:
            row: dict[str, Any] = {"workload": workload, "engine": name,
                                   "tok_s_p50": round(statistics.median(rates[name, workload]), 1),
                                   "tok_per_cpu_s_p50": round(statistics.median(cpu_rates[name, workload]),
                                                              1)}
            if name != "off":
                steps, drafted, accepted, emitted, reads = counters[name, workload]
                row |= {"ratio_p50": round(statistics.median(ratios[name, workload]), 2),
                        "cpu_ratio_p50": round(statistics.median(cpu_ratios[name, workload]), 2),
                        "cpu_ratios": [round(r, 2) for r in cpu_ratios[name, workload]],
                        "ratios": [round(r, 2) for r in ratios[name, workload]],
                        "acceptance": round(accepted / drafted, 2) if drafted else None,
                        "tokens_per_verify_step": round(emitted / steps, 2) if steps else None,
                        "verify_steps_share": round(steps / (args.rounds * (args.tokens - 1)), 3),
                        "early_reads_per_token": round(reads / (args.rounds * (args.tokens - 1)), 3)}
            rows.append(row)
    return {"blas": blas_in_use(), "load_average": os.getloadavg(), "device": str(mx.default_device()),
            "load_checks": checks,
            "model": {"hidden_size": args.hidden_size, "layers": args.layers, "head_dim": args.head_dim,
                      "strength": args.strength,
                      "layer_gain": args.layer_gain, "dtype": args.dtype},
            "tokens": args.tokens, "rounds": args.rounds, "mismatched_outputs": mismatches, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200, help="tokens per answer")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--draft-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[3, 5])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=16,
                        help="attention heads' width (a GPU's: 64 or 128; hidden a multiple of twice it)")
    parser.add_argument("--strength", type=float, default=2.5, help="the chain's pull (support.chain_model)")
    parser.add_argument("--layer-gain", type=float, default=0.5, help="the layers' weight against the chain")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", choices=("default", "cpu"), default="default",
                        help="cpu: MLX's CPU backend even where a GPU is there")
    parser.add_argument("--compile-decode", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/speculative.json"))
    args = parser.parse_args()
    if args.device == "cpu":
        import mlx.core as mx

        mx.set_default_device(mx.cpu)  # before mlx_lm makes its generation stream
    result = trio.run(main_async, args)
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if result["mismatched_outputs"]:
        sys.exit("speculation changed some answers")


if __name__ == "__main__":
    main()
