"""Mixed load: long prompts arriving while decode streams run, on one colocated node vs a 2-GPU cluster.

What it answers: does moving prefill to its own GPU keep the decode streams smooth when long
prompts arrive? Setup *colocated* is one `statecore run --role single` node on the first GPU of
--gpus; setup *cluster* is a `--role prefill` node on the first GPU, a `--role decode` node on the
second and a `--role router` in front that sends every prompt through the prefill node
(`--force-disaggregation`, unless --local-prefill-below says otherwise). Each process gets its own
environment with CUDA_VISIBLE_DEVICES set, which is harmless where there is no GPU. Both setups
stay up for the whole run and are measured alternately (A/B, then B/A, ... per --reps), with fresh
prompts per repetition that are the same for both setups within it.

One run: --decode-streams streaming requests (--decode-prompt tokens in, --decode-tokens out,
greedy, `ignore_eos`) start first; once every one has streamed --lead-chunks chunks,
--long-requests prompts of --long-prompt tokens (--long-tokens out) arrive one every
--long-interval seconds while the streams go on. The *window* runs from the first long prompt
sent to the last one finished. For the decode streams it reports the gaps between streamed chunks
(ITL) ending inside the window, before it and overall (p50, p99, max), their time per output
token, and the long prompts' time to first token; then cluster / colocated ratios, with ITL p99
in the window as the headline. Writes results.json and results.png under --out.

The defaults are sized for GPUs: 16 decode streams of 128 tokens in and 2,048 out, long enough to
outlive the window of 8 long prompts of 4,000 tokens; a CPU run asks for shorter streams.

    .venv/bin/python bench/serving/mixed_load.py --long-prompt 1000 --decode-streams 4 \\
        --decode-tokens 768 --long-requests 2 --reps 1        # CPU smoke, ~2 minutes on 2 cores
    python3 bench/serving/mixed_load.py --model /tmp/llama1b --blas bundled --gpus 0,1  # 2 GPUs

Bench code: it may import anything (its servers, prompts and streaming reader are benchlib's),
and nothing under src/ may import it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib

from benchlib import (
    ROOT,
    CompletionStreamError,
    Mix,
    PromptMaker,
    Server,
    build_prompts,
    completion_stream,
    context_length,
    default_model,
    free_port,
    gpu_placement,
    load_tokenizer,
    node_env,
    percentile,
    server_env,
)

SETUPS = ("colocated", "cluster")
# The decoding node's prompt-token counter by where the KV came from: it shows whether the long
# prompts really were prefilled on the other node (transferred) or where they are served.
PROMPT_SOURCE_METRIC = "statecore:prompt_tokens_by_source_total"


@dataclass
class Setup:
    """The processes of one setup; `front` takes the requests, `decoder` decodes them."""

    name: str
    servers: list[tuple[Server, dict[str, str]]]
    front: Server
    decoder: Server


def make_setups(model: Path, out: Path, env: dict[str, str], gpus: tuple[str, str],
                extra: list[str], local_prefill_below: int,
                kv_memory_bytes: int | None = None) -> list[Setup]:
    base = [sys.executable, "-m", "adapters.cli", "run", "--model", str(model), "--log-level", "WARNING",
            *extra]
    budget = [] if kv_memory_bytes is None else ["--kv-memory-bytes", str(kv_memory_bytes)]

    def server(name: str, role: str, *more: str) -> Server:
        port = free_port()
        return Server(name, [*base, "--role", role, "--port", str(port), *more], port,
                      out / f"{name}.log")

    single = server("colocated", "single", *budget)
    prefill = server("prefill", "prefill", *budget)
    decode = server("decode", "decode", *budget)
    routing = (["--force-disaggregation"] if local_prefill_below <= 0
               else ["--local-prefill-below", str(local_prefill_below)])
    # The router holds no model on a device (it tokenizes); it shares the prefill node's GPU.
    router = server("router", "router", "--prefill", prefill.url, "--decode", decode.url, *routing)
    first, second = (node_env(env, None, g) for g in gpus)
    return [
        Setup("colocated", [(single, first)], front=single, decoder=single),
        Setup("cluster", [(prefill, first), (decode, second), (router, first)], front=router, decoder=decode),
    ]


def prompt_sources(url: str) -> dict[str, float]:
    """The node's prompt tokens by KV source so far (Prometheus text; counters only grow)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    sources: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(PROMPT_SOURCE_METRIC + "{"):
            labels, value = line[len(PROMPT_SOURCE_METRIC) + 1:].rsplit("} ", 1)
            source = dict(part.split("=", 1) for part in labels.split(","))["source"].strip('"')
            sources[source] = float(value)
    return sources


# -- one run -------------------------------------------------------------------------------------


@dataclass(slots=True)
class StreamTrace:
    """One streamed request; times are time.perf_counter() seconds."""

    kind: str  # "decode" or "long"
    prompt_tokens: int
    max_tokens: int
    sent: float = 0.0
    ended: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens_reported: int | None = None
    error: str | None = None


async def stream_completion(client: httpx.AsyncClient, url: str, prompt: str, trace: StreamTrace,
                            streaming: asyncio.Event | None = None, after_chunks: int = 1) -> None:
    """POST one streaming completion and stamp every content chunk's arrival; `streaming` is set
    once `after_chunks` chunks arrived, or when the request ends (so a failure never hangs the run)."""
    body = {"prompt": prompt, "max_tokens": trace.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    trace.sent = time.perf_counter()
    try:
        async for texts, usage in completion_stream(client, url, body):
            if usage:
                trace.output_tokens = int(usage.get("completion_tokens", 0))
                trace.prompt_tokens_reported = usage.get("prompt_tokens")
            if texts:
                trace.chunk_times.append(time.perf_counter())
                if streaming is not None and len(trace.chunk_times) == after_chunks:
                    streaming.set()
        if not trace.chunk_times:
            trace.error = "no output"
        elif trace.output_tokens == 0:
            trace.output_tokens = len(trace.chunk_times)
    except CompletionStreamError as exc:
        trace.error = str(exc)
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        trace.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        trace.ended = time.perf_counter()
        if streaming is not None:
            streaming.set()


@dataclass(slots=True)
class RunTrace:
    setup: str
    rep: int
    started: float
    window_start: float
    window_end: float
    decode: list[StreamTrace]
    long: list[StreamTrace]


async def mixed_run(setup: str, rep: int, url: str, decode_prompts: Sequence[tuple[str, int, int]],
                    long_prompts: Sequence[tuple[str, int, int]], *, lead_chunks: int,
                    long_interval_s: float, timeout_s: float) -> RunTrace:
    connections = len(decode_prompts) + len(long_prompts) + 4
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    decode = [StreamTrace("decode", p, o) for _, p, o in decode_prompts]
    long = [StreamTrace("long", p, o) for _, p, o in long_prompts]
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        started = time.perf_counter()
        streaming = [asyncio.Event() for _ in decode]
        decode_tasks = [
            asyncio.create_task(stream_completion(client, url, prompt, trace, ready, lead_chunks))
            for (prompt, _, _), trace, ready in zip(decode_prompts, decode, streaming, strict=True)
        ]
        await asyncio.gather(*(ready.wait() for ready in streaming))
        # A fixed schedule, not a closed loop: the long prompts keep arriving whether or not
        # the previous ones are done, as independent users' requests would.
        window_start = time.perf_counter()
        long_tasks = []
        for i, ((prompt, _, _), trace) in enumerate(zip(long_prompts, long, strict=True)):
            await asyncio.sleep(max(0.0, window_start + i * long_interval_s - time.perf_counter()))
            long_tasks.append(asyncio.create_task(stream_completion(client, url, prompt, trace)))
        await asyncio.gather(*long_tasks)
        window_end = max((t.ended for t in long), default=window_start)
        await asyncio.gather(*decode_tasks)
    return RunTrace(setup, rep, started, window_start, window_end, decode, long)


# -- figures -------------------------------------------------------------------------------------


def decode_gaps(run: RunTrace) -> list[tuple[float, float]]:
    """(arrival time, gap) of every chunk after a decode stream's first, all streams."""
    return [(later, later - earlier) for t in run.decode if t.error is None
            for earlier, later in zip(t.chunk_times, t.chunk_times[1:], strict=False)]


def run_metrics(run: RunTrace) -> dict[str, float | int | None]:
    ms = 1000.0
    gaps = decode_gaps(run)
    # A gap belongs to the window when the chunk that ends it arrives inside: a stall that began
    # just before the first long prompt still shows up where the prefill lands.
    by_part = {
        "window": [g for t, g in gaps if run.window_start <= t <= run.window_end],
        "before": [g for t, g in gaps if t < run.window_start],
        "overall": [g for _, g in gaps],
    }
    metrics: dict[str, float | int | None] = {}
    for part, values in by_part.items():
        for name, q in (("p50", 50), ("p99", 99)):
            v = percentile(values, q)
            metrics[f"itl_{part}_{name}_ms"] = None if v is None else v * ms
        metrics[f"itl_{part}_max_ms"] = max(values) * ms if values else None
        metrics[f"itl_{part}_mean_ms"] = statistics.fmean(values) * ms if values else None
        metrics[f"itl_{part}_gaps"] = len(values)
    ok_decode = [t for t in run.decode if t.error is None and t.chunk_times]
    tpot = [(t.ended - t.chunk_times[0]) / (t.output_tokens - 1) for t in ok_decode if t.output_tokens > 1]
    tpot_p50 = percentile(tpot, 50)
    metrics["tpot_decode_p50_ms"] = None if tpot_p50 is None else tpot_p50 * ms
    ok_long = [t for t in run.long if t.error is None and t.chunk_times]
    ttft = [t.chunk_times[0] - t.sent for t in ok_long]
    for name, q in (("p50", 50), ("p99", 99)):
        v = percentile(ttft, q)
        metrics[f"ttft_long_{name}_ms"] = None if v is None else v * ms
    metrics["ttft_long_max_ms"] = max(ttft) * ms if ttft else None
    metrics["window_s"] = run.window_end - run.window_start
    # Streams still producing when the window closed: fewer than all means the window's ITL
    # covers fewer streams than asked for (raise --decode-tokens).
    metrics["decode_streams_covering_window"] = sum(
        1 for t in ok_decode if t.chunk_times[-1] >= run.window_end)
    metrics["failed_decode"] = len(run.decode) - len(ok_decode)
    metrics["failed_long"] = len(run.long) - len(ok_long)
    metrics["decode_output_tokens"] = sum(t.output_tokens for t in ok_decode)
    return metrics


def trace_json(run: RunTrace) -> dict[str, Any]:
    """Raw timings, seconds from the run's start, for plotting or re-analysis later."""

    def rel(t: float) -> float:
        return round(t - run.started, 5)

    def one(t: StreamTrace) -> dict[str, Any]:
        return {"kind": t.kind, "prompt_tokens": t.prompt_tokens, "max_tokens": t.max_tokens,
                "prompt_tokens_reported": t.prompt_tokens_reported, "output_tokens": t.output_tokens,
                "error": t.error, "sent": rel(t.sent), "ended": rel(t.ended),
                "chunks": [rel(c) for c in t.chunk_times]}

    return {"window": [rel(run.window_start), rel(run.window_end)],
            "decode": [one(t) for t in run.decode], "long": [one(t) for t in run.long]}


# -- report --------------------------------------------------------------------------------------


def run_line(metrics: dict[str, float | int | None], sources: dict[str, float], streams: int) -> str:
    def num(key: str, digits: int = 1) -> str:
        v = metrics[key]
        return "-" if v is None else f"{v:.{digits}f}"

    return (f"ITL in window p50/p99/max {num('itl_window_p50_ms')}/{num('itl_window_p99_ms')}/"
            f"{num('itl_window_max_ms')} ms ({metrics['itl_window_gaps']} gaps), before p99 "
            f"{num('itl_before_p99_ms')} ms; TPOT p50 {num('tpot_decode_p50_ms', 2)} ms; long TTFT p50 "
            f"{num('ttft_long_p50_ms', 0)} ms; window {num('window_s', 2)} s, streams covering it "
            f"{metrics['decode_streams_covering_window']}/{streams}; failed {metrics['failed_decode']}"
            f"+{metrics['failed_long']}; decoder's prompt tokens "
            + ", ".join(f"{k} {v:.0f}" for k, v in sorted(sources.items())))

ROWS = (
    ("itl_window_p99_ms", "ITL p99 in window (ms)"),
    ("itl_window_p50_ms", "ITL p50 in window (ms)"),
    ("itl_window_max_ms", "ITL max in window (ms)"),
    ("itl_window_mean_ms", "ITL mean in window (ms)"),
    ("itl_before_p50_ms", "ITL p50 before window (ms)"),
    ("itl_before_p99_ms", "ITL p99 before window (ms)"),
    ("itl_overall_p50_ms", "ITL p50 overall (ms)"),
    ("itl_overall_p99_ms", "ITL p99 overall (ms)"),
    ("itl_overall_max_ms", "ITL max overall (ms)"),
    ("tpot_decode_p50_ms", "TPOT p50 decode streams (ms)"),
    ("ttft_long_p50_ms", "TTFT p50 long prompts (ms)"),
    ("ttft_long_p99_ms", "TTFT p99 long prompts (ms)"),
    ("window_s", "window (s)"),
)


def median_over_reps(runs: list[dict[str, Any]], setup: str, key: str) -> float | None:
    values = [float(v) for r in runs if r["setup"] == setup and (v := r["metrics"].get(key)) is not None]
    return statistics.median(values) if values else None


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for key, _ in ROWS:
        colocated = median_over_reps(runs, "colocated", key)
        cluster = median_over_reps(runs, "cluster", key)
        out[key] = {"colocated": colocated, "cluster": cluster,
                    "cluster_over_colocated": cluster / colocated if cluster is not None and colocated
                    else None}
    return out


def table(medians: dict[str, dict[str, float | None]]) -> str:
    def cell(v: float | None, digits: int) -> str:
        return f"{v:12.{digits}f}" if v is not None else f"{'-':>12s}"

    lines = [f"{'median over reps':32s} {'colocated':>12s} {'cluster':>12s} {'cluster/coloc':>14s}"]
    for key, label in ROWS:
        row = medians[key]
        mark = "  <- headline" if key == "itl_window_p99_ms" else ""
        lines.append(f"{label:32s} {cell(row['colocated'], 2)} {cell(row['cluster'], 2)} "
                     f"{cell(row['cluster_over_colocated'], 3)}  {mark}".rstrip())
    return "\n".join(lines)


def plot(traces: dict[str, RunTrace], medians: dict[str, dict[str, float | None]], path: Path,
         title: str) -> None:
    """Per setup, one run's decode gaps against time (window shaded, long arrivals marked);
    then the window's ITL p50/p99/max and the long prompts' TTFT p50, medians over reps."""
    try:
        import matplotlib
    except ImportError:  # e.g. a bare GPU image: results.json has every timing to plot later
        print(f"matplotlib is not installed: no {path}", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    timelines = [traces[name] for name in SETUPS if name in traces]
    for ax, run in zip(axes[:2], timelines, strict=False):
        gaps = decode_gaps(run)
        ax.scatter([t - run.window_start for t, _ in gaps], [g * 1000 for _, g in gaps], s=3, alpha=0.5)
        ax.axvspan(0, run.window_end - run.window_start, color="orange", alpha=0.15, label="window")
        for long in run.long:
            ax.axvline(long.sent - run.window_start, color="red", lw=0.6, alpha=0.6)
        ax.set_yscale("log")
        ax.set_xlabel("s since the first long prompt (red: arrivals)")
        ax.set_ylabel("decode chunk gap (ms)")
        ax.set_title(f"{run.setup}, rep {run.rep}", fontsize=9)
        ax.grid(True, alpha=0.3)
    keys = [("itl_window_p50_ms", "ITL p50\nwindow"), ("itl_window_p99_ms", "ITL p99\nwindow"),
            ("itl_window_max_ms", "ITL max\nwindow"), ("tpot_decode_p50_ms", "TPOT p50"),
            ("ttft_long_p50_ms", "TTFT p50\nlong")]
    width = 0.4
    for i, name in enumerate(SETUPS):
        xs = [k + (i - 0.5) * width for k in range(len(keys))]
        ys = [medians[key][name] or 0.0 for key, _ in keys]
        axes[2].bar(xs, ys, width, label=name)
    axes[2].set_xticks(range(len(keys)), [label for _, label in keys], fontsize=8)
    axes[2].set_yscale("log")
    axes[2].set_ylabel("ms (median over reps)")
    axes[2].legend(fontsize=8)
    axes[2].grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# -- main ----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None,
                        help="model dir (default: benchlib's 2.4M random llama, context 4096)")
    parser.add_argument("--decode-streams", type=int, default=16)
    parser.add_argument("--decode-prompt", type=int, default=128, help="prompt tokens of a decode stream")
    parser.add_argument("--decode-tokens", type=int, default=2048,
                        help="output tokens of a decode stream (enough to outlive the long-prompt window "
                             "on a GPU; a CPU run wants fewer)")
    parser.add_argument("--long-prompt", type=int, default=4000, help="prompt tokens of a long request")
    parser.add_argument("--long-tokens", type=int, default=16, help="output tokens of a long request")
    parser.add_argument("--long-requests", type=int, default=8, help="long prompts per run")
    parser.add_argument("--long-interval", type=float, default=0.25,
                        help="seconds between long-prompt arrivals (0: all at once)")
    parser.add_argument("--lead-chunks", type=int, default=16,
                        help="chunks every decode stream streams before the first long prompt")
    parser.add_argument("--reps", type=int, default=2, help="alternating repetitions (A/B, B/A, ...)")
    parser.add_argument("--gpus", default="0,1", help="GPU ids: prefill node (and colocated), decode node")
    parser.add_argument("--local-prefill-below", type=int, default=0,
                        help="router: prompts shorter than this prefill on the decode node "
                             "(default 0: --force-disaggregation, every prompt through the prefill node)")
    parser.add_argument("--blas", choices=["auto", "openblas", "bundled"],
                        default=os.environ.get("STATECORE_BLAS", "auto"))
    parser.add_argument("--statecore-arg", action="append", default=[],
                        help="extra flag for every statecore process (repeatable), e.g. --max-batch=64")
    parser.add_argument("--kv-memory-bytes", type=int, default=None,
                        help="each engine node's KV budget (default: the node's own, a share of its "
                        "device; with both --gpus the same, 16 GiB each, since three nodes share one)")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "mixed_load")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # run `finally`

    gpus = tuple(g.strip() for g in args.gpus.split(","))
    if len(gpus) != 2 or not all(gpus):
        raise SystemExit(f"--gpus takes two ids (prefill, decode), not {args.gpus!r}")
    if args.local_prefill_below > args.long_prompt:
        raise SystemExit("--local-prefill-below above --long-prompt would prefill the long prompts on the "
                         "decode node: nothing disaggregated to compare")
    model: Path = args.model or default_model()
    needed = max(args.long_prompt + args.long_tokens, args.decode_prompt + args.decode_tokens)
    if (context := context_length(model)) is not None and needed > context:
        raise SystemExit(f"{model} has a context of {context} tokens; this load needs {needed}")
    args.out.mkdir(parents=True, exist_ok=True)
    env, blas = server_env(args.blas)
    # `statecore run` resolves its own --blas default from STATECORE_BLAS (else "auto", which
    # preloads OpenBLAS when installed): pin it to this bench's choice so --blas bundled holds.
    env["STATECORE_BLAS"] = blas
    budget = args.kv_memory_bytes
    if budget is None and gpus[0] == gpus[1]:
        budget = 16 << 30  # with 24 GiB each the decode node once ran out of device memory
    setups = make_setups(model, args.out, env, (gpus[0], gpus[1]), args.statecore_arg,
                         args.local_prefill_below, budget)
    meta: dict[str, Any] = {
        "model": str(model), "blas": blas, "argv": sys.argv, "gpus": list(gpus),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    print(f"model {model}  BLAS {blas}  GPUs prefill/colocated {gpus[0]}, decode {gpus[1]}\n"
          f"{args.decode_streams} decode streams {args.decode_prompt}x{args.decode_tokens}; "
          f"{args.long_requests} long prompts {args.long_prompt}x{args.long_tokens} every "
          f"{args.long_interval} s; reps {args.reps}; out {args.out}", flush=True)

    runs: list[dict[str, Any]] = []
    first_traces: dict[str, RunTrace] = {}
    t0 = time.monotonic()

    def write_json(medians: dict[str, Any] | None = None) -> None:
        doc = {"meta": meta, "summary": medians, "runs": runs}
        (args.out / "results.json").write_text(json.dumps(doc, indent=1))

    try:
        for setup in setups:
            for s, s_env in setup.servers:
                s.start(s_env)
        # Build the prompts while the servers load: exact-length 4,000-token prompts take ~1 s each.
        maker = PromptMaker(load_tokenizer(model))
        decode_mix = Mix(f"{args.decode_prompt}x{args.decode_tokens}", args.decode_prompt, args.decode_tokens)
        long_mix = Mix(f"{args.long_prompt}x{args.long_tokens}", args.long_prompt, args.long_tokens)
        warm_decode = build_prompts(maker, Mix("warm", args.decode_prompt, max(args.lead_chunks + 8, 32)),
                                    args.decode_streams, seed=999)
        warm_long = build_prompts(maker, long_mix, min(2, args.long_requests), seed=999)
        loads = [(build_prompts(maker, decode_mix, args.decode_streams, seed=rep),
                  build_prompts(maker, long_mix, args.long_requests, seed=rep)) for rep in range(args.reps)]
        for setup in setups:
            for s, _ in setup.servers:
                s.wait_ready(args.startup_timeout)
        meta["startup_s"] = time.monotonic() - t0
        print(f"servers ready in {meta['startup_s']:.0f} s: "
              + ", ".join(f"{s.name} {s.url} pid {s.proc.pid if s.proc else '-'}"
                          for setup in setups for s, _ in setup.servers), flush=True)
        # One unmeasured short run per setup: a GPU backend compiles kernels on the first use of a
        # shape (the batch sizes, the long prompt's prefill, the KV install), which a cold server
        # would otherwise pay inside the first measured window.
        for setup in setups:
            asyncio.run(mixed_run(setup.name, -1, setup.front.url, warm_decode, warm_long,
                                  lead_chunks=args.lead_chunks, long_interval_s=args.long_interval,
                                  timeout_s=args.request_timeout))
        if (placement := gpu_placement()) is not None:
            meta["nvidia_smi"] = placement
            print(f"nvidia-smi (GPU index, bus id, memory; then pid, bus id, memory):\n{placement}",
                  flush=True)
        for rep, (decode_prompts, long_prompts) in enumerate(loads):
            for setup in setups if rep % 2 == 0 else setups[::-1]:
                before = prompt_sources(setup.decoder.url)
                run = asyncio.run(mixed_run(setup.name, rep, setup.front.url, decode_prompts, long_prompts,
                                            lead_chunks=args.lead_chunks, long_interval_s=args.long_interval,
                                            timeout_s=args.request_timeout))
                after = prompt_sources(setup.decoder.url)
                metrics = run_metrics(run)
                sources = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                runs.append({"setup": setup.name, "rep": rep, "metrics": metrics,
                             "decoder_prompt_tokens_by_source": sources, "trace": trace_json(run)})
                first_traces.setdefault(setup.name, run)
                print(f"  {setup.name:9s} rep {rep}: {run_line(metrics, sources, args.decode_streams)}",
                      flush=True)
                write_json()
    finally:
        for setup in setups:
            for s, _ in reversed(setup.servers):  # the router first, so it never sees its nodes vanish
                s.stop()
    meta["wall_s"] = time.monotonic() - t0
    medians = summary(runs)
    write_json(medians)
    text = table(medians)
    (args.out / "table.txt").write_text(text + "\n")
    plot(first_traces, medians, args.out / "results.png",
         f"{model.name}: {args.decode_streams} streams {decode_mix.name} + {args.long_requests} x "
         f"{long_mix.name} every {args.long_interval} s; BLAS={blas}")
    print("\n" + text)
    short = [r for r in runs if r["metrics"]["decode_streams_covering_window"] < args.decode_streams]
    if short:
        print(f"\nwarning: in {len(short)} run(s) some decode streams ended before the last long prompt; "
              "the window's ITL covers fewer streams (raise --decode-tokens)")
    failed = sum(int(r["metrics"]["failed_decode"]) + int(r["metrics"]["failed_long"]) for r in runs)
    if failed:
        print(f"\nwarning: {failed} request(s) failed; see results.json and the server logs in {args.out}")
    print(f"\nTotal {meta['wall_s']:.0f} s. Wrote {args.out}/results.json, table.txt, results.png")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
