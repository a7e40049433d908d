"""Load generator for any OpenAI-compatible completions endpoint (statecore, mlx_lm.server, vLLM, ...).

Sends streaming `POST /v1/completions` requests (`benchlib.run_load`) and measures, per run (one
mix of prompt/output lengths at one concurrency, optionally at a Poisson request rate):
TTFT, inter-token latency (gaps between streamed chunks), TPOT ((e2e - TTFT) / (tokens - 1)),
end-to-end latency, output tokens/s, requests/s and failures. Prompts are text built with a local
tokenizer (a model directory; never the hub) so that `tokenizer.encode(prompt)` has exactly the
requested number of tokens, special tokens included: both mlx_lm.server and statecore encode the
prompt string that way, and each result records the prompt_tokens the server reported.

Every request uses `temperature: 0` and asks for `max_tokens`; it also sends `ignore_eos: true`
(honoured by vLLM, ignored by the others). Random-weight models rarely emit EOS, but a server may
still stop early, so output tokens are counted from the stream's `usage` (`stream_options:
include_usage`), falling back to the number of content chunks.

    .venv/bin/python bench/clients/serve_bench.py --url http://127.0.0.1:8000 --tokenizer MODEL_DIR \\
        --mix 128x128 --mix 2000x16 --mix realish --concurrency 1,4,8,32 --out bench/results/x

writes results.json and results.png under --out. Mixes: `PxO` (P prompt tokens, O output tokens)
or `realish` (seeded log-normal lengths). Bench code, not part of the package: it may import
anything, and nothing under src/ may import it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib

from benchlib import (
    Mix,
    PromptMaker,
    RunResult,
    build_prompts,
    load_tokenizer,
    parse_mix,
    plot_runs,
    run_load,
    summarize,
)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--tokenizer", type=Path, required=True, help="local model/tokenizer directory")
    parser.add_argument("--mix", type=parse_mix, action="append", default=None,
                        help="PxO or 'realish' (repeatable; default 128x128, 2000x16, realish)")
    parser.add_argument("--concurrency", type=_int_list, default=[1, 4, 8, 32])
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests per run (default: max(8, 2 x concurrency))")
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    parser.add_argument("--model", default=None, help="the request's model field (default: omitted)")
    parser.add_argument("--label", default="server", help="name of the server in results")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured requests first")
    parser.add_argument("--out", type=Path, default=Path("bench/results/serve_bench"))
    args = parser.parse_args(argv)
    mixes: list[Mix] = args.mix or [parse_mix("128x128"), parse_mix("2000x16"), parse_mix("realish")]
    maker = PromptMaker(load_tokenizer(args.tokenizer))
    runs: list[RunResult] = []
    warm = build_prompts(maker, Mix("warm", 16, 8), args.warmup, args.seed + 999)
    if warm:
        asyncio.run(run_load(args.url, warm, concurrency=len(warm), model=args.model))
    for mix in mixes:
        for conc in args.concurrency:
            n = args.num_requests or max(8, 2 * conc)
            prompts = build_prompts(maker, mix, n, args.seed + conc)
            results, wall = asyncio.run(run_load(
                args.url, prompts, concurrency=conc, rate=args.rate, model=args.model,
                progress=f"{args.label} {mix.name} c={conc}", seed=args.seed,
            ))
            run = RunResult(args.label, mix.name, conc, args.rate, n, wall, summarize(results, wall),
                            sorted({r.error for r in results if r.error})[:5])
            runs.append(run)
            m = run.metrics
            print(f"{args.label:10s} {mix.name:9s} c={conc:<3d} out {m['output_tok_s'] or 0:8.1f} tok/s  "
                  f"TTFT p50 {m['ttft_p50_ms'] or 0:8.1f} ms  ITL p50 {m['itl_p50_ms'] or 0:7.1f} ms  "
                  f"failed {m['failed']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps([asdict(r) for r in runs], indent=1))
    plot_runs(runs, args.out / "results.png", f"{args.label} {args.url}")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'results.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
