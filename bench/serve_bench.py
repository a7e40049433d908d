"""Load generator for any OpenAI-compatible completions endpoint (statecore, mlx_lm.server, vLLM, ...).

Sends streaming `POST /v1/completions` requests with httpx (asyncio) and measures, per run (one
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

    .venv/bin/python bench/serve_bench.py --url http://127.0.0.1:8000 --tokenizer MODEL_DIR \\
        --mix 128x128 --mix 2000x16 --mix realish --concurrency 1,4,8,32 --out bench/results/x

writes results.json and results.png under --out. Mixes: `PxO` (P prompt tokens, O output tokens)
or `realish` (seeded log-normal lengths). Bench code, not part of the package: it may import
anything, and nothing under src/ may import it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
from sse_client import CompletionStreamError, completion_stream

__all__ = [
    "Mix",
    "PromptMaker",
    "RequestResult",
    "RunResult",
    "parse_mix",
    "plot_runs",
    "run_load",
    "summarize",
]

_WORDS_TEXT = (
    "the quick brown fox jumps over lazy dog while farmer watches from gate a small model can still "
    "be useful when test only needs shapes caches and tokens every request starts in queue moves to "
    "prefill hands its cache decode node ends network fails too but keeps serving others she opened "
    "window looked at rain decided that walk could wait until noon they built bridge three years it "
    "carried trains trucks bicycles people on foot morning market sells bread cheese apples pears "
)
_WORDS = tuple(_WORDS_TEXT.split())

_FILLERS = (" the", " a", ".", ",", " and", " of", " to", " x", "!", " is", "a", "e", "s", " ")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


def load_tokenizer(path: Path) -> Tokenizer:
    """A Hugging Face tokenizer from a local directory (no hub access)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok: Tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return tok


class PromptMaker:
    """Seeded prompts whose encoding has an exact number of tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def make(self, n_tokens: int, rng: random.Random) -> str:
        if n_tokens < 1:
            raise ValueError("a prompt needs at least one token")
        words: list[str] = []
        # Grow by words while under the target (estimate, then check), then top up or trim.
        while True:
            text = " ".join(words)
            have = self.count(text)
            missing = n_tokens - have
            if missing <= 0:
                break
            words.extend(rng.choice(_WORDS) for _ in range(max(1, missing // 2)))
        while words and self.count(" ".join(words)) > n_tokens:
            words.pop()
        text = " ".join(words)
        have = self.count(text)
        while have < n_tokens:
            for filler in _FILLERS:
                if self.count(text + filler) == have + 1:
                    text += filler
                    have += 1
                    break
            else:  # no single filler adds exactly one token: add a word and retry
                text += " " + rng.choice(_WORDS)
                have = self.count(text)
                while have > n_tokens:
                    text = text[:-1]
                    have = self.count(text)
        if have != n_tokens:
            raise RuntimeError(f"could not build a prompt of {n_tokens} tokens (got {have})")
        return text


@dataclass(frozen=True, slots=True)
class Mix:
    """A distribution of (prompt tokens, output tokens) pairs."""

    name: str
    prompt_tokens: int | None = None  # fixed lengths when both are set
    output_tokens: int | None = None

    def lengths(self, n: int, rng: random.Random) -> list[tuple[int, int]]:
        if self.prompt_tokens is not None and self.output_tokens is not None:
            return [(self.prompt_tokens, self.output_tokens)] * n
        # "real-ish": log-normal prompts (median ~256, clipped 16..1536) and outputs (median ~96,
        # clipped 8..384), roughly the shape of chat traces.
        pairs = []
        for _ in range(n):
            p = int(min(1536, max(16, rng.lognormvariate(math.log(256), 0.9))))
            o = int(min(384, max(8, rng.lognormvariate(math.log(96), 0.7))))
            pairs.append((p, o))
        return pairs


def parse_mix(spec: str) -> Mix:
    if spec == "realish":
        return Mix("realish")
    try:
        p, o = spec.lower().split("x")
        return Mix(spec, int(p), int(o))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a mix is PxO (e.g. 128x128) or 'realish', not {spec!r}") from None


@dataclass(slots=True)
class RequestResult:
    prompt_tokens_sent: int
    max_tokens: int
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens_reported: int | None = None
    text: str = ""
    skipped: bool = False  # never sent: the run was stopped first


@dataclass(slots=True)
class RunResult:
    server: str
    mix: str
    concurrency: int
    rate: float | None
    num_requests: int
    wall_s: float
    metrics: dict[str, float | int | None]
    errors: list[str]
    extra: dict[str, Any] = field(default_factory=dict)


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict[str, float | int | None]:
    results = [r for r in results if not r.skipped]
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    gaps = [g for r in ok for g in r.chunk_gaps_s]
    tpot = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in ok
        if r.e2e_s is not None and r.ttft_s is not None and r.output_tokens > 1
    ]
    out_tokens = sum(r.output_tokens for r in ok)
    reported = [r.prompt_tokens_reported for r in ok if r.prompt_tokens_reported is not None]
    ms = 1000.0

    def scaled(v: float | None) -> float | None:
        return None if v is None else v * ms

    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall_s if wall_s > 0 else None,
        "req_s": len(ok) / wall_s if wall_s > 0 else None,
        "ttft_p50_ms": scaled(_pct(ttft, 50)),
        "ttft_p99_ms": scaled(_pct(ttft, 99)),
        "itl_p50_ms": scaled(_pct(gaps, 50)),
        "itl_p99_ms": scaled(_pct(gaps, 99)),
        "tpot_p50_ms": scaled(_pct(tpot, 50)),
        "e2e_p50_ms": scaled(_pct(e2e, 50)),
        "e2e_p99_ms": scaled(_pct(e2e, 99)),
        "mean_output_tokens": out_tokens / len(ok) if ok else None,
        "mean_prompt_tokens_reported": statistics.fmean(reported) if reported else None,
        "mean_prompt_tokens_sent": (
            statistics.fmean(r.prompt_tokens_sent for r in results) if results else None
        ),
    }


async def _one(
    client: httpx.AsyncClient, url: str, prompt: str, result: RequestResult, model: str | None
) -> None:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": result.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if model is not None:
        body["model"] = model
    start = time.perf_counter()
    last: float | None = None
    chunks = 0
    parts: list[str] = []
    try:
        async for texts, usage in completion_stream(client, url, body):
            if usage:
                result.output_tokens = int(usage.get("completion_tokens", 0))
                result.prompt_tokens_reported = usage.get("prompt_tokens")
            for text in texts:
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.chunk_gaps_s.append(now - last)
                last = now
                chunks += 1
                parts.append(text)
        result.e2e_s = time.perf_counter() - start
        if result.output_tokens == 0:
            result.output_tokens = chunks
        result.text = "".join(parts)
        result.ok = result.ttft_s is not None
        if not result.ok:
            result.error = "no output"
    except CompletionStreamError as exc:
        result.error = str(exc)
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]


async def run_load(
    url: str,
    prompts: Sequence[tuple[str, int, int]],
    *,
    concurrency: int,
    rate: float | None = None,
    model: str | None = None,
    progress: str | None = None,
    seed: int = 0,
    timeout_s: float = 600.0,
    stop: Callable[[], bool] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every (prompt, prompt_tokens, max_tokens) with at most `concurrency` in flight.

    With `rate`, requests are released as a Poisson process of that many per second (still capped
    by `concurrency`). Once `stop()` is true, requests not yet sent are skipped (in-flight ones
    finish). Returns the per-request results and the wall time of the whole run.
    """
    from tqdm import tqdm

    url = url.rstrip("/")
    results = [RequestResult(prompt_tokens_sent=p, max_tokens=o) for _, p, o in prompts]
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    bar = tqdm(total=len(prompts), desc=progress, unit="req", leave=False, disable=progress is None,
               dynamic_ncols=True)
    tokens = 0

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:

        async def worker(i: int, delay: float) -> None:
            nonlocal tokens
            if delay:
                await asyncio.sleep(delay)
            async with gate:
                if stop is not None and stop():
                    results[i].skipped = True
                    bar.update(1)
                    return
                await _one(client, url, prompts[i][0], results[i], model)
            tokens += results[i].output_tokens
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens / max(1e-9, time.perf_counter() - start):.1f}",
                            fail=sum(1 for r in results if r.error))

        delays = [0.0] * len(prompts)
        if rate:
            t = 0.0
            for i in range(len(prompts)):
                delays[i] = t
                t += rng.expovariate(rate)
        start = time.perf_counter()
        await asyncio.gather(*(worker(i, d) for i, d in enumerate(delays)))
        wall = time.perf_counter() - start
    bar.close()
    return results, wall


def build_prompts(
    maker: PromptMaker, mix: Mix, n: int, seed: int
) -> list[tuple[str, int, int]]:
    rng = random.Random(f"{seed}:{mix.name}")
    return [(maker.make(p, rng), p, o) for p, o in mix.lengths(n, rng)]


def plot_runs(runs: Sequence[RunResult], path: Path, title: str) -> None:
    """Output tokens/s, TTFT p50 and TPOT p50 against concurrency; one line per (server, mix).

    TPOT rather than chunk gaps: a server may coalesce several tokens into one SSE chunk.
    """
    try:
        import matplotlib
    except ImportError:  # e.g. the GPU image: plot the JSON later with bench/plot_results.py
        print(f"matplotlib is not installed: no {path}", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("output_tok_s", "output tokens/s"), ("ttft_p50_ms", "TTFT p50 (ms)"),
              ("tpot_p50_ms", "time per output token p50 (ms)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    keys = sorted({(r.server, r.mix) for r in runs})
    for ax, (metric, label) in zip(axes, panels, strict=True):
        for server, mix in keys:
            by_conc: dict[int, list[float]] = {}
            for r in runs:
                v = r.metrics.get(metric)
                if r.server == server and r.mix == mix and r.rate is None and v is not None:
                    by_conc.setdefault(r.concurrency, []).append(float(v))
            xs = sorted(by_conc)
            ys = [statistics.median(by_conc[x]) for x in xs]  # median over repetitions
            if xs:
                ax.plot(xs, ys, marker="o", label=f"{server} {mix}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    for ax in axes[1:]:
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


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
