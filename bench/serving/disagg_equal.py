"""Disaggregation at equal hardware: one mixed load on DP2 and on 1P1D, each engine node on its own cores.

What it answers (issue 30, item 4): with the same hardware, does a prefill node plus a decode node
(1P1D) serve a mixed load better than two colocated replicas (DP2)? Both setups run side by side
for the whole bench, each behind its own `--role router` (unpinned):

- **DP2**: two `--role single` replicas, the first pinned to the first of --cpus (and GPU of
  --gpus), the second to the second; their router gets `--prefill A --decode A --decode B` and a
  `--local-prefill-below` above every prompt, so each request prefills and decodes on one
  replica, the least loaded (the router's own policy), and nothing is handed off;
- **1P1D**: a `--role prefill` node on the first core set, a `--role decode` node on the second;
  prompts of --local-prefill-below tokens or more (the long ones) prefill on the prefill node
  and hand their KV to the decode node, shorter ones (the decode streams) prefill there locally.

One run: --decode-streams streams (--decode-prompt tokens in, up to --decode-tokens out, greedy,
`ignore_eos`) start; once each has streamed --lead-chunks chunks, --long-requests prompts of
--long-prompt tokens (--long-tokens out) arrive one every --long-interval seconds on a fixed
schedule. The *window* runs from the first long prompt sent to the last one finished; the bench
closes the decode streams --tail seconds after it (so they always outlive the window, however
slow the box). Times are the client's, per streamed chunk; the default model never generates a
token whose text the server holds back (a bare space, a partial UTF-8 byte), so every token is
a chunk of its own (`tokens_without_own_chunk` counts the exceptions). Rounds
alternate the setups (DP2 then 1P1D, then 1P1D then DP2, ...) with fresh prompts per round, the
same for both setups within it. Per run it reports, and then as medians over rounds per setup
and as 1P1D / DP2 ratios:

- the decode streams' gap between chunks inside the window: p50, p99, max;
- the decode step: the median gap of the decode streams outside the window;
- the long prompts' TTFT p50 / p99, and each handed-off prompt's gap between its first and its
  second token, in seconds, in decode steps (the streams' step outside the window) and in its own
  steps (the median gap of its later tokens: the batch's step once it decodes in it, longer
  than the streams' own, since its attention reads the whole long prompt);
- output tokens/s (all requests' tokens over first sent -> last finished);
- goodput as AIPerf and DistServe define it: requests/s (and the share of requests) meeting both
  a TTFT SLO and an ITL SLO, the ITL of a request being its mean gap ((last token - first) /
  (tokens - 1), AIPerf's inter_token_latency; a cut stream counts with what it streamed); a
  strict variant takes each request's worst gap instead; and which SLO the misses broke. The
  SLOs are --ttft-slo-ms / --itl-slo-ms, else --slo-factor times the latency with nothing else
  running, measured before the rounds (DistServe's way), the larger of the two setups' (a long
  prompt's TTFT alone; the decode streams' step alone: all on 1P1D's decode node, half on each
  DP2 replica);
- from `GET /internal/handoffs` on the 1P1D nodes, each handoff's encode (prefill node), first
  byte, transfer, body and install times (decode node), and a timeline per handed-off prompt:
  sent, first token, how much of its TTFT is more than a long prompt's TTFT alone and how long
  it arrived while an earlier long prompt was still prefilling (queueing on, or sharing, the one
  prefill node: the nodes expose no prefill start), the decode node's pull start and end, the
  install's end and the second token (a streamed handoff: the decode node's own times).

It checks, per run, that the long prompts really reached the decode node in 1P1D, handed off or,
where the router's overflow sent one there while the prefill node was busy, computed there (the
decode node's `statecore:prompt_tokens_by_source_total` grew by their prompt tokens)
and that nothing was in DP2 (no replica's grew); a failed check marks the run and the bench
exits 1. Every process it starts runs in its own session and is stopped on exit, on an error,
on Ctrl-C and on SIGTERM / SIGHUP. Writes results.json (command line, machine, date, load
average around each run, every raw timing) and table.txt under --out.

    .venv/bin/python bench/serving/disagg_equal.py                      # CPU: cores 0 and 1, ~6-10 min
    .venv/bin/python bench/serving/disagg_equal.py --rounds 1 --long-requests 2 --long-prompt 1000  # smoke
    .venv/bin/python bench/serving/disagg_equal.py --reanalyze bench/results/disagg_equal/results.json \
        --ttft-slo-ms 30000 --itl-slo-ms 250            # the same traces, other SLOs
    python3 bench/serving/disagg_equal.py --model /tmp/llama1b --blas bundled --gpus 0 1 --cpus 0-7 8-15 \\
        --decode-streams 16 --decode-tokens 2048 --long-requests 8 --long-interval 0.25  # 2 GPUs

The default model is a random-weight llama of 23 M parameters (hidden 512, 6 layers, 8 heads of
64 and 2 KV heads, MLP 2,048, vocab 512, tied embeddings, context 4,096, float32; make_llama1b's
layout) built once under /tmp/statecore-bench-models. Bench code: it may import anything, and
nothing under src/ may import it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
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
    free_port,
    gpu_placement,
    load_tokenizer,
    machine,
    node_env,
    parse_cpus,
    percentile,
    server_env,
)

SETUPS = ("DP2", "1P1D")
TOKEN_HEADER = "X-Statecore-Token"
PROMPT_SOURCE_METRIC = "statecore:prompt_tokens_by_source_total"
KV_BYTES_METRIC = "statecore:kv_transfer_bytes_total"
MODEL_CACHE = Path("/tmp/statecore-bench-models")
MS = 1000.0


# -- processes -----------------------------------------------------------------------------------


@dataclass
class Node:
    """One started process: the server, its environment, its core set (None: unpinned)."""

    server: Server
    env: dict[str, str]
    cpus: str | None


@dataclass
class Setup:
    """One setup's processes; `front` takes the requests, `engines` are the engine nodes (the
    first on the first core set), `decoders` the nodes where the decode streams run."""

    name: str
    nodes: list[Node]
    front: Server
    engines: list[Server]
    decoders: list[Server]
    prefill: Server | None = None  # 1P1D: the prefill node


def make_setups(model: Path, out: Path, env: dict[str, str], cpus: tuple[str | None, str | None],
                gpus: tuple[str | None, str | None], *, token: str, node_args: list[str],
                router_args: list[str], local_prefill_below: int, every_prompt_below: int,
                kv_memory_bytes: int | None) -> list[Setup]:
    common = ["--model", str(model), "--log-level", "WARNING", "--internal-token", token]
    budget = [] if kv_memory_bytes is None else ["--kv-memory-bytes", str(kv_memory_bytes)]

    def server(name: str, role: str, core_set: str | None, *more: str) -> Server:
        port = free_port()
        argv = [sys.executable, "-m", "adapters.cli", "run", "--role", role, "--port", str(port),
                *common, *more]
        pinned = ["taskset", "-c", core_set] if core_set is not None else []
        return Server(name, [*pinned, *argv], port, out / f"{name}.log")

    def engine(name: str, role: str, i: int) -> Node:
        return Node(server(name, role, cpus[i], *budget, *node_args), node_env(env, cpus[i], gpus[i]),
                    cpus[i])

    def router(name: str, *more: str) -> Node:
        # Unpinned; it holds no model on a device (it tokenizes), so any GPU id will do.
        return Node(server(name, "router", None, *more, *router_args), node_env(env, None, gpus[0]), None)

    a, b = engine("dp2-a", "single", 0), engine("dp2-b", "single", 1)
    # A router needs a --prefill URL; with every prompt below the threshold it never uses it.
    dp2_router = router("dp2-router", "--prefill", a.server.url, "--decode", a.server.url,
                        "--decode", b.server.url, "--local-prefill-below", str(every_prompt_below))
    p, d = engine("1p1d-prefill", "prefill", 0), engine("1p1d-decode", "decode", 1)
    pd_router = router("1p1d-router", "--prefill", p.server.url, "--decode", d.server.url,
                       "--local-prefill-below", str(local_prefill_below))
    return [
        Setup("DP2", [a, b, dp2_router], front=dp2_router.server, engines=[a.server, b.server],
              decoders=[a.server, b.server]),
        Setup("1P1D", [p, d, pd_router], front=pd_router.server, engines=[p.server, d.server],
              decoders=[d.server], prefill=p.server),
    ]


def counters(url: str, metric: str, label: str) -> dict[str, float]:
    """A node's counter `metric` by the value of `label` (Prometheus text; counters only grow)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            labels, value = line[len(metric) + 1:].rsplit("} ", 1)
            parts = dict(part.split("=", 1) for part in labels.split(","))
            key = parts.get(label, "").strip('"')
            out[key] = out.get(key, 0.0) + float(value)
    return out


def node_counters(servers: Sequence[Server]) -> dict[str, dict[str, float]]:
    """Per engine node: prompt tokens by KV source and KV bytes by direction."""
    snapshot: dict[str, dict[str, float]] = {}
    for s in servers:
        sources = counters(s.url, PROMPT_SOURCE_METRIC, "source")
        moved = counters(s.url, KV_BYTES_METRIC, "direction")
        snapshot[s.name] = {**{f"prompt_tokens_{k}": v for k, v in sources.items()},
                            **{f"kv_bytes_{k}": v for k, v in moved.items()}}
    return snapshot


Counters = dict[str, dict[str, float]]


def delta(after: Counters, before: Counters) -> Counters:
    return {node: {k: v - before.get(node, {}).get(k, 0.0) for k, v in values.items()}
            for node, values in after.items()}


def handoff_records(server: Server, token: str) -> dict[str, dict[str, Any]]:
    response = httpx.get(f"{server.url}/internal/handoffs", headers={TOKEN_HEADER: token}, timeout=10)
    response.raise_for_status()
    return {r["request_id"]: r for r in response.json()["records"]}


# -- one run -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Trace:
    """One streamed request; times are time.perf_counter() seconds."""

    request_id: str
    kind: str  # "decode" or "long"
    prompt_tokens: int
    max_tokens: int
    sent: float = 0.0
    ended: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None
    cut: bool = False  # a decode stream the bench ended (closed) after the window
    # a decode stream's tokens on its engine node (its loop applying each step's tokens, from
    # `GET /internal/token_times`), on the same clock: where the client's gaps were made
    engine_times: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    def mean_itl(self) -> float | None:
        """AIPerf's inter_token_latency: (last token - first token) / (tokens - 1)."""
        if self.output_tokens < 2 or len(self.chunk_times) < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)


async def stream_completion(client: httpx.AsyncClient, url: str, prompt: str, trace: Trace,
                            streaming: asyncio.Event | None = None, after_chunks: int = 1) -> None:
    """POST one streaming completion and stamp every content chunk's arrival; `streaming` is set
    once `after_chunks` chunks arrived, or when the request ends (a failure never hangs the run)."""
    body = {"prompt": prompt, "max_tokens": trace.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    trace.sent = time.perf_counter()
    try:
        async for texts, usage in completion_stream(client, url, body, {"X-Request-Id": trace.request_id}):
            if usage:
                trace.output_tokens = int(usage.get("completion_tokens", 0))
            if texts:
                trace.chunk_times.append(time.perf_counter())
                if streaming is not None and len(trace.chunk_times) == after_chunks:
                    streaming.set()
        if not trace.chunk_times:
            trace.error = "no output"
    except CompletionStreamError as exc:
        trace.error = str(exc)
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        trace.error = f"{type(exc).__name__}: {exc}"[:200]
    except asyncio.CancelledError:  # the bench cut the stream (closing it cancels the request)
        trace.cut = True
        raise
    finally:
        trace.ended = time.perf_counter()
        if trace.output_tokens == 0:
            trace.output_tokens = len(trace.chunk_times)
        if streaming is not None:
            streaming.set()


@dataclass(slots=True)
class RunTrace:
    setup: str
    rep: int
    started: float  # perf_counter
    wall_minus_perf: float  # time.time() - time.perf_counter(): the nodes' records are wall clock
    window_start: float
    window_end: float
    decode: list[Trace]
    long: list[Trace]


async def mixed_run(setup: str, rep: int, url: str, tag: str, decode_prompts: Sequence[tuple[str, int, int]],
                    long_prompts: Sequence[tuple[str, int, int]], *, lead_chunks: int,
                    long_interval_s: float, timeout_s: float, tail_s: float | None = None) -> RunTrace:
    """The decode streams, then the long prompts on their schedule; the decode streams still
    running `tail_s` seconds after the window closed are cut (None: each runs to its end)."""
    connections = len(decode_prompts) + len(long_prompts) + 4
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    ids = f"{tag}-{setup}-{rep}"
    decode = [Trace(f"{ids}-d{i}", "decode", p, o) for i, (_, p, o) in enumerate(decode_prompts)]
    long = [Trace(f"{ids}-l{i}", "long", p, o) for i, (_, p, o) in enumerate(long_prompts)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        started = time.perf_counter()
        wall_minus_perf = time.time() - time.perf_counter()
        streaming = [asyncio.Event() for _ in decode]
        decode_tasks = [
            asyncio.create_task(stream_completion(client, url, prompt, trace, ready, lead_chunks))
            for (prompt, _, _), trace, ready in zip(decode_prompts, decode, streaming, strict=True)
        ]
        await asyncio.gather(*(ready.wait() for ready in streaming))
        # A fixed schedule, not a closed loop: the long prompts arrive whether or not the earlier
        # ones are done, as independent users' requests would.
        window_start = time.perf_counter()
        long_tasks = []
        for i, ((prompt, _, _), trace) in enumerate(zip(long_prompts, long, strict=True)):
            await asyncio.sleep(max(0.0, window_start + i * long_interval_s - time.perf_counter()))
            long_tasks.append(asyncio.create_task(stream_completion(client, url, prompt, trace)))
        await asyncio.gather(*long_tasks)
        window_end = max((t.ended for t in long), default=window_start)
        if tail_s is not None:
            await asyncio.wait(decode_tasks, timeout=max(0.0, window_end + tail_s - time.perf_counter()))
            for task in decode_tasks:
                task.cancel()
        await asyncio.gather(*decode_tasks, return_exceptions=True)
    return RunTrace(setup, rep, started, wall_minus_perf, window_start, window_end, decode, long)


# -- figures -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    itl_s: float


def decode_gaps(run: RunTrace) -> list[tuple[float, float]]:
    """(arrival, gap) of every chunk after a decode stream's first, all streams."""
    return [(b, b - a) for t in run.decode if t.ok
            for a, b in zip(t.chunk_times, t.chunk_times[1:], strict=False)]


def engine_gaps(run: RunTrace) -> list[tuple[float, float]]:
    """(moment, gap) of every decode step's tokens after a decode stream's second on its engine node
    (the first is its prefill's), all streams; none where the nodes had no `/internal/token_times`."""
    return [(b, b - a) for t in run.decode for a, b in zip(t.engine_times, t.engine_times[1:], strict=False)]


def read_engine_times(run: RunTrace, decoders: Sequence[Server], token: str) -> None:
    """Each decode stream's `engine_times` from the engine nodes it may have decoded on."""
    applied: dict[str, list[float]] = {}
    for server in decoders:
        response = httpx.get(f"{server.url}/internal/token_times", headers={TOKEN_HEADER: token},
                             params={"since": run.started + run.wall_minus_perf}, timeout=30)
        if response.status_code != 200:
            continue  # an older src/ without it
        for rid, moments in response.json().get("applied", {}).items():
            applied.setdefault(rid, []).extend(moments)
    for t in run.decode:
        t.engine_times = sorted(moment - run.wall_minus_perf for moment in applied.get(t.request_id, []))


def step_s(run: RunTrace) -> float | None:
    """The decode step: the median gap of the decode streams whose ending chunk falls outside
    the window (before the first long prompt, after the last one finished)."""
    outside = [gap for end, gap in decode_gaps(run) if not run.window_start <= end <= run.window_end]
    return statistics.median(outside) if outside else None


def goodput(run: RunTrace, slo: Slo) -> dict[str, float | int]:
    """Requests meeting both SLOs (AIPerf's goodput, DistServe's attainment): with the request's
    mean ITL (`mean`), and with its worst gap (`strict`)."""
    every = [*run.decode, *run.long]
    begin = min(t.sent for t in every)
    end = max(t.ended for t in every)
    good: dict[str, list[bool]] = {"mean": [], "strict": [], "ttft": [], "itl": []}
    for t in every:
        ttft_ok = t.ok and t.ttft <= slo.ttft_s
        itl = t.mean_itl() if t.ok else None
        itl_ok = t.ok and (itl is None or itl <= slo.itl_s)
        good["ttft"].append(ttft_ok)
        good["itl"].append(itl_ok)
        good["mean"].append(ttft_ok and itl_ok)
        good["strict"].append(ttft_ok and t.ok and max(t.gaps(), default=0.0) <= slo.itl_s)
    span = end - begin
    n_decode = len(run.decode)

    def share(flags: list[bool]) -> float:
        return sum(flags) / len(flags) if flags else 0.0

    return {"requests": len(every), "good": sum(good["mean"]), "good_strict": sum(good["strict"]),
            "goodput_rps": sum(good["mean"]) / span, "goodput_strict_rps": sum(good["strict"]) / span,
            "attainment": share(good["mean"]), "attainment_strict": share(good["strict"]),
            # which SLO the misses broke: the streams' ITL, the long prompts' TTFT
            "decode_meeting_itl": share(good["itl"][:n_decode]),
            "long_meeting_ttft": share(good["ttft"][n_decode:])}


def second_token_gaps(run: RunTrace) -> list[float]:
    return [t.chunk_times[1] - t.chunk_times[0] for t in run.long if t.ok and len(t.chunk_times) > 1]


def second_token_own_steps(run: RunTrace) -> list[float]:
    """Each long prompt's first -> second token gap over the median gap of its later tokens."""
    out = []
    for t in run.long:
        later = [b - a for a, b in itertools.pairwise(t.chunk_times[1:])] if t.ok else []
        step = statistics.median(later) if later else 0.0
        if step > 0:
            out.append((t.chunk_times[1] - t.chunk_times[0]) / step)
    return out


def run_metrics(run: RunTrace, slo: Slo, alone: Slo | None = None,
                factors: Sequence[float] = ()) -> dict[str, float | int | None]:
    """One run's figures; goodput at `slo`, and the SLO attainment at each of `factors` times
    the latencies `alone` (DistServe's attainment against the SLO scale)."""
    metrics: dict[str, float | int | None] = {}
    # A gap belongs to the window when the chunk that ends it arrives inside it.
    window = [gap for end, gap in decode_gaps(run) if run.window_start <= end <= run.window_end]
    for name, q in (("p50", 50), ("p99", 99)):
        v = percentile(window, q)
        metrics[f"gap_window_{name}_ms"] = None if v is None else v * MS
    metrics["gap_window_max_ms"] = max(window) * MS if window else None
    metrics["gap_window_count"] = len(window)
    # the same streams' gaps where the engine made them (the decode node's loop applying a step)
    engine = engine_gaps(run)
    inside = [gap for end, gap in engine if run.window_start <= end <= run.window_end]
    outside = [gap for end, gap in engine if not run.window_start <= end <= run.window_end]
    engine_p99 = percentile(inside, 99)
    metrics["engine_gap_window_p99_ms"] = None if engine_p99 is None else engine_p99 * MS
    metrics["engine_gap_window_max_ms"] = max(inside) * MS if inside else None
    metrics["engine_step_ms"] = statistics.median(outside) * MS if outside else None
    step = step_s(run)
    metrics["step_ms"] = None if step is None else step * MS
    ok_long = [t for t in run.long if t.ok]
    ttft = [t.ttft for t in ok_long]
    for name, q in (("p50", 50), ("p99", 99)):
        v = percentile(ttft, q)
        metrics[f"ttft_long_{name}_ms"] = None if v is None else v * MS
    second = second_token_gaps(run)
    metrics["second_token_gap_median_ms"] = statistics.median(second) * MS if second else None
    metrics["second_token_gap_max_ms"] = max(second) * MS if second else None
    metrics["second_token_gap_median_steps"] = (statistics.median(second) / step
                                                if second and step else None)
    metrics["second_token_gap_max_steps"] = max(second) / step if second and step else None
    own = second_token_own_steps(run)
    metrics["second_token_gap_median_own_steps"] = statistics.median(own) if own else None
    metrics["second_token_gap_max_own_steps"] = max(own) if own else None
    every = [t for t in [*run.decode, *run.long] if t.ok]
    span = max(t.ended for t in every) - min(t.sent for t in every) if every else 0.0
    metrics["output_tok_s"] = sum(t.output_tokens for t in every) / span if span > 0 else None
    metrics.update(goodput(run, slo))
    for factor in factors if alone is not None else ():
        assert alone is not None
        scaled = goodput(run, Slo(alone.ttft_s * factor, alone.itl_s * factor))
        metrics[f"attainment_at_{factor:g}x"] = scaled["attainment"]
    metrics["window_s"] = run.window_end - run.window_start
    # Streams still producing when the window closed: fewer than all means the window's gaps
    # cover fewer streams than asked for (raise --decode-tokens).
    metrics["decode_streams_covering_window"] = sum(1 for t in run.decode if t.ok
                                                    and t.chunk_times[-1] >= run.window_end)
    # Tokens that came without a chunk of their own (the server held their text back and sent it
    # with a later token's): their arrival is hidden, and a gap looks longer than a step.
    metrics["tokens_without_own_chunk"] = sum(t.output_tokens - len(t.chunk_times)
                                              for t in [*run.decode, *run.long] if t.ok and not t.cut)
    metrics["failed_decode"] = sum(1 for t in run.decode if not t.ok)
    metrics["failed_long"] = len(run.long) - len(ok_long)
    return metrics


def handoff_timeline(run: RunTrace, prefill: dict[str, dict[str, Any]],
                     decode: dict[str, dict[str, Any]], ttft_alone_s: float) -> list[dict[str, Any]]:
    """Per long prompt, seconds from its `sent`: the first token and how much of it is more than
    a long prompt's TTFT alone (`over_alone`: queueing on, or sharing, the one prefill node), how
    long it arrived while an earlier long prompt was still waiting for its first token,
    the decode node's pull (start, end), the install's end, the second token; and the nodes'
    own durations."""
    rows = []
    for i, t in enumerate(run.long):
        row: dict[str, Any] = {"request_id": t.request_id, "error": t.error}
        if not t.ok:
            rows.append(row)
            continue
        earlier = [u.chunk_times[0] for u in run.long[:i] if u.ok]
        row["ttft_s"] = t.ttft
        row["over_alone_s"] = t.ttft - ttft_alone_s
        row["behind_earlier_s"] = max(0.0, max(earlier, default=t.sent) - t.sent)
        if len(t.chunk_times) > 1:
            row["second_token_s"] = t.chunk_times[1] - t.sent
        out, into = prefill.get(t.request_id), decode.get(t.request_id)
        row["records"] = {"prefill": out, "decode": into}  # whatever the nodes' version records
        if out is not None:
            row["encode_s"] = out.get("encode_s")
            row["wire_bytes"] = out.get("wire_bytes")
        if into is not None and into.get("streamed"):
            # A streamed handoff (the KV sent while the prompt is computed): the node's own times.
            for key in ("stream_s", "first_token_s", "overlap", "first_to_second_s", "install_s"):
                row[key] = into.get(key)
            row["transport"] = into.get("transport")
        elif into is not None and into.get("transfer_s") is not None:
            # A pull after the first token: the decode node opens its record as the last byte lands.
            landed = float(into["opened_at"]) - run.wall_minus_perf - t.sent
            row["pull_start_s"] = landed - float(into["transfer_s"])
            row["pull_end_s"] = landed
            for key in ("first_byte_s", "transfer_s", "body_s", "install_s"):
                row[key] = into.get(key)
            if into.get("install_s") is not None:
                row["install_end_s"] = landed + float(into["install_s"])
        rows.append(row)
    return rows


def handoff_medians(timeline: list[dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in ("encode_s", "first_byte_s", "transfer_s", "body_s", "install_s", "behind_earlier_s",
                "over_alone_s"):
        values = [float(r[key]) for r in timeline if r.get(key) is not None]
        out[key.removesuffix("_s") + "_ms"] = statistics.median(values) * MS if values else None
    # and every other duration the nodes record (a later version may record more)
    for role in ("prefill", "decode"):
        records = [rec for r in timeline if (rec := (r.get("records") or {}).get(role)) is not None]
        for key in sorted({k for rec in records for k in rec if k.endswith("_s") or k == "overlap"}):
            values = [float(v) for rec in records if isinstance(v := rec.get(key), int | float)
                      and not isinstance(v, bool)]
            if values and key == "overlap":
                out[f"{role}.overlap"] = statistics.median(values)
            elif values:
                out[f"{role}.{key.removesuffix('_s')}_ms"] = statistics.median(values) * MS
    # Where the first-to-second token gap goes: first token -> pull start (the router's POST to
    # the decode node and its queue), the pull, the install, install end -> second token.
    parts = {"first_token_to_pull_ms": ("ttft_s", "pull_start_s"),
             "pull_ms": ("pull_start_s", "pull_end_s"),
             "pull_end_to_install_end_ms": ("pull_end_s", "install_end_s"),
             "install_end_to_second_token_ms": ("install_end_s", "second_token_s")}
    for name, (a, b) in parts.items():
        values = [float(r[b]) - float(r[a]) for r in timeline
                  if r.get(a) is not None and r.get(b) is not None]
        out[name] = statistics.median(values) * MS if values else None
    return out


def trace_json(run: RunTrace) -> dict[str, Any]:
    """Raw timings, seconds from the run's start, for re-analysis later."""

    def rel(t: float) -> float:
        return round(t - run.started, 5)

    def one(t: Trace) -> dict[str, Any]:
        return {"request_id": t.request_id, "kind": t.kind, "prompt_tokens": t.prompt_tokens,
                "max_tokens": t.max_tokens, "output_tokens": t.output_tokens, "error": t.error,
                "sent": rel(t.sent), "ended": rel(t.ended), "cut": t.cut,
                "chunks": [rel(c) for c in t.chunk_times], "engine": [rel(c) for c in t.engine_times]}

    return {"window": [rel(run.window_start), rel(run.window_end)],
            "started_wall": run.started + run.wall_minus_perf,
            "decode": [one(t) for t in run.decode], "long": [one(t) for t in run.long]}


def trace_from_json(setup: str, rep: int, doc: dict[str, Any]) -> RunTrace:
    """`trace_json` back (times from the run's start), for --reanalyze."""

    def one(t: dict[str, Any]) -> Trace:
        return Trace(t["request_id"], t["kind"], t["prompt_tokens"], t["max_tokens"], t["sent"], t["ended"],
                     list(t["chunks"]), t["output_tokens"], t["error"], t.get("cut", t["kind"] == "decode"),
                     list(t.get("engine", [])))

    start, end = doc["window"]
    return RunTrace(setup, rep, 0.0, float(doc["started_wall"]), start, end,
                    [one(t) for t in doc["decode"]], [one(t) for t in doc["long"]])


def check_routing(setup: Setup, moved: dict[str, dict[str, float]], long_tokens: int) -> str | None:
    """None when the long prompts went where the setup says; else what went wrong."""
    if setup.name == "1P1D":
        # each long prompt was handed off, or (the router's overflow: the prefill node busy) computed
        # on the decode node itself: together they account for every long prompt's tokens
        decoder = moved[setup.decoders[0].name]
        got = sum(decoder.get(f"prompt_tokens_{source}", 0.0)
                  for source in ("transferred", "computed_locally"))
        if got < long_tokens:
            return (f"1P1D: the decode node received or computed {got:.0f} prompt tokens, fewer than the "
                    f"long prompts' {long_tokens}")
        return None
    transferred = {n: v.get("prompt_tokens_transferred", 0.0) for n, v in moved.items()}
    if any(transferred.values()):
        return f"DP2: a replica received handed-off KV {transferred}"
    return None


# -- report --------------------------------------------------------------------------------------


ROWS = (
    ("gap_window_p99_ms", "stream gap p99 in window (ms)", 1),
    ("gap_window_max_ms", "stream gap max in window (ms)", 1),
    ("gap_window_p50_ms", "stream gap p50 in window (ms)", 1),
    ("engine_gap_window_p99_ms", "engine's stream gap p99 in window (ms)", 1),
    ("engine_gap_window_max_ms", "engine's stream gap max in window (ms)", 1),
    ("engine_step_ms", "engine's step: gap p50 outside (ms)", 1),
    ("step_ms", "step: stream gap p50 outside (ms)", 1),
    ("ttft_long_p50_ms", "long TTFT p50 (ms)", 0),
    ("ttft_long_p99_ms", "long TTFT p99 (ms)", 0),
    ("second_token_gap_median_ms", "long 1st->2nd token, median (ms)", 0),
    ("second_token_gap_max_ms", "long 1st->2nd token, max (ms)", 0),
    ("second_token_gap_median_steps", "long 1st->2nd token, median (steps)", 1),
    ("second_token_gap_max_steps", "long 1st->2nd token, max (steps)", 1),
    ("second_token_gap_median_own_steps", "long 1st->2nd, median (own steps)", 1),
    ("second_token_gap_max_own_steps", "long 1st->2nd, max (own steps)", 1),
    ("output_tok_s", "output tokens/s", 1),
    ("goodput_rps", "goodput (req/s, mean ITL)", 3),
    ("attainment", "SLO attainment (mean ITL)", 2),
    ("goodput_strict_rps", "goodput strict (req/s, worst gap)", 3),
    ("attainment_strict", "SLO attainment strict", 2),
    ("decode_meeting_itl", "share of streams meeting the ITL SLO", 2),
    ("long_meeting_ttft", "share of long meeting the TTFT SLO", 2),
    ("window_s", "window (s)", 2),
)
HANDOFF_ROWS = ("encode_ms", "first_byte_ms", "transfer_ms", "body_ms", "install_ms", "behind_earlier_ms",
                "over_alone_ms",
                "first_token_to_pull_ms", "pull_ms", "pull_end_to_install_end_ms",
                "install_end_to_second_token_ms")


def median_of(runs: list[dict[str, Any]], setup: str, section: str, key: str) -> float | None:
    values = [float(v) for r in runs if r["setup"] == setup and r["valid"]
              and (v := (r.get(section) or {}).get(key)) is not None]
    return statistics.median(values) if values else None


def rows(runs: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """ROWS, then the SLO attainment at each scale the runs have."""
    scales = sorted({k for r in runs for k in r["metrics"] if k.startswith("attainment_at_")},
                    key=lambda k: float(k.removeprefix("attainment_at_").removesuffix("x")))
    return [*ROWS, *((k, f"SLO attainment, SLOs {k.removeprefix('attainment_at_')} alone", 2)
                     for k in scales)]


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, _, _ in rows(runs):
        dp2, pd = (median_of(runs, s, "metrics", key) for s in SETUPS)
        # and the ratio within each round (the two runs back to back), median over rounds
        by_round: dict[int, dict[str, float]] = {}
        for r in runs:
            if r["valid"] and (v := r["metrics"].get(key)) is not None:
                by_round.setdefault(r["rep"], {})[r["setup"]] = float(v)
        ratios = [v["1P1D"] / v["DP2"] for v in by_round.values() if len(v) == 2 and v["DP2"]]
        out[key] = {"DP2": dp2, "1P1D": pd, "1P1D_over_DP2": pd / dp2 if pd is not None and dp2 else None,
                    "per_round_ratio_median": statistics.median(ratios) if ratios else None}
    extra = sorted({k for r in runs for k in (r.get("handoff") or {})
                    if k not in HANDOFF_ROWS and k.split(".", 1)[-1] not in HANDOFF_ROWS})
    out["handoff_1P1D"] = {key: median_of(runs, "1P1D", "handoff", key) for key in (*HANDOFF_ROWS, *extra)}
    out["rounds_valid"] = {s: sum(1 for r in runs if r["setup"] == s and r["valid"]) for s in SETUPS}
    return out


def table(medians: dict[str, Any], slo: Slo, runs: list[dict[str, Any]]) -> str:
    def cell(v: float | None, digits: int, width: int = 11) -> str:
        return f"{v:{width},.{digits}f}" if v is not None else f"{'-':>{width}s}"

    lines = [f"{'median over rounds':38s} {'DP2':>11s} {'1P1D':>11s} {'1P1D/DP2':>9s} {'per round':>9s}"]
    for key, label, digits in rows(runs):
        row = medians[key]
        lines.append(f"{label:38s} {cell(row['DP2'], digits)} {cell(row['1P1D'], digits)} "
                     f"{cell(row['1P1D_over_DP2'], 2, 9)} {cell(row['per_round_ratio_median'], 2, 9)}")
    lines.append(f"SLOs: TTFT <= {slo.ttft_s * MS:,.0f} ms, ITL <= {slo.itl_s * MS:,.1f} ms")
    lines.append("1P1D handoff, medians over rounds of per-run medians (ms):")
    lines.append("  " + ", ".join(f"{key.removesuffix('_ms')} {cell(v, 1, 1).strip()}"
                                  for key, v in medians["handoff_1P1D"].items()))
    return "\n".join(lines)


def run_line(m: dict[str, Any], moved: dict[str, dict[str, float]]) -> str:
    def num(key: str, digits: int = 0) -> str:
        v = m.get(key)
        return "-" if v is None else f"{v:,.{digits}f}"

    nodes = "; ".join(f"{n}: " + ", ".join(f"{k.removeprefix('prompt_tokens_')} {v:.0f}"
                                            for k, v in sorted(c.items()) if k.startswith("prompt_tokens_"))
                      for n, c in moved.items())
    return (f"gap in window p99/max {num('gap_window_p99_ms')}/{num('gap_window_max_ms')} ms (engine's "
            f"{num('engine_gap_window_p99_ms')}/{num('engine_gap_window_max_ms')}), step "
            f"{num('step_ms', 1)} ms (engine's {num('engine_step_ms', 1)}); long TTFT p50 "
            f"{num('ttft_long_p50_ms')} ms; 1st->2nd "
            f"{num('second_token_gap_median_ms')} ms ({num('second_token_gap_median_steps', 1)} steps); "
            f"{num('output_tok_s', 1)} tok/s; good {m['good']}/{m['requests']} (strict {m['good_strict']}); "
            f"window {num('window_s', 1)} s, streams covering it {m['decode_streams_covering_window']}; "
            f"failed {m['failed_decode']}+{m['failed_long']}; prompt tokens by KV source: {nodes}")


# -- main ----------------------------------------------------------------------------------------


def held_back_ids(model_dir: Path) -> list[int]:
    """Token ids whose text mlx-lm's streaming detokenizer holds back when they come alone (a bare
    space, an incomplete UTF-8 byte) or that are special: a server sends no chunk for them until
    a later token, which would hide a token's arrival from the client's timings."""
    from mlx_lm.tokenizer_utils import load as load_detokenizing

    tokenizer = load_detokenizing(model_dir)
    held = []
    for token in range(len(tokenizer.vocab)):
        detokenizer = tokenizer.detokenizer
        detokenizer.reset()
        detokenizer.add_token(token)
        if not detokenizer.last_segment or token in tokenizer.all_special_ids:
            held.append(token)
    return held


def default_model(hidden_size: int, layers: int) -> Path:
    """A random llama of make_llama1b's layout (head dim 64, a quarter as many KV heads, MLP 4x,
    tied embeddings, statecore's 512-token tokenizer) in float32 with a context of 4,096, built
    once under MODEL_CACHE. Head dim 64, not tiny_models' 16: MLX's CPU attention over 32 heads
    of 16 makes a 2,000-token prefill ~4x slower than this shape's 8 heads of 64. The embedding
    rows of `held_back_ids` are zero, so (tied) their logits are 0 against real tokens' spread of
    ~45 and greedy decoding never picks one: every token streams as its own chunk."""
    import mlx.core as mx
    from make_llama1b import llama_1b_config, random_weights

    from support.tiny_models import build_tokenizer

    final = MODEL_CACHE / f"llama-h{hidden_size}-l{layers}-v512-f32-nohold"
    if (final / "config.json").exists():
        return final
    config = llama_1b_config(hidden_size, layers, 512)
    config.pop("rope_scaling")
    config.update(max_position_embeddings=4096, torch_dtype="float32")
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=MODEL_CACHE))
    try:
        build_tokenizer(scratch, "bpe")
        (scratch / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        held = mx.array(held_back_ids(scratch))
        every_id = list(range(512))  # the held-back rows are zeroed below
        weights = {k: v.astype(mx.float32) for k, v in random_weights(config, 0, every_id).items()}
        embed = weights["model.embed_tokens.weight"]
        keep = (mx.arange(embed.shape[0])[:, None] != held[None, :]).all(axis=1, keepdims=True)
        weights["model.embed_tokens.weight"] = mx.where(keep, embed, mx.zeros_like(embed))
        mx.save_safetensors(str(scratch / "model.safetensors"), weights, metadata={"format": "mlx"})
        try:
            os.rename(scratch, final)
        except OSError:  # another run built it first
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    params = sum(w.size for w in weights.values())
    print(f"built {final}: {params / 1e6:.1f} M parameters, {held.size} held-back token ids never "
          "generated", flush=True)
    return final


def stop(server: Server) -> None:
    """Stop one server (SIGTERM, then SIGKILL to its session after 40 s); a second Ctrl-C or an
    error while waiting kills its session at once, so nothing started here outlives the bench."""
    try:
        server.stop()
    except BaseException:
        if server.proc is not None and server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
        raise


def calibrate(setup: Setup, maker: PromptMaker, args: argparse.Namespace,
              tag: str) -> dict[str, float | None]:
    """With nothing else running: the decode streams alone (their step), then one long prompt
    alone (its TTFT, and its first-to-second token gap)."""
    streams = build_prompts(maker, Mix("cal", args.decode_prompt, 48), args.decode_streams, seed=777)
    alone = asyncio.run(mixed_run(setup.name, -2, setup.front.url, tag + "c", streams, [],
                                  lead_chunks=1, long_interval_s=0.0, timeout_s=args.request_timeout))
    gaps = [g for t in alone.decode if t.ok for g in t.gaps()[4:]]
    long = build_prompts(maker, Mix("cal-long", args.long_prompt, args.long_tokens), 1, seed=778)
    one = asyncio.run(mixed_run(setup.name, -3, setup.front.url, tag + "c", [], long, lead_chunks=1,
                                long_interval_s=0.0, timeout_s=args.request_timeout))
    t = one.long[0]
    if not t.ok or not gaps:
        raise SystemExit(f"{setup.name}: the calibration requests failed ({t.error}); logs in {args.out}")
    second = (t.chunk_times[1] - t.chunk_times[0]) * MS if len(t.chunk_times) > 1 else None
    return {"step_ms": statistics.median(gaps) * MS, "ttft_long_ms": t.ttft * MS,
            "second_token_gap_ms": second}


def alone_slo(calibration: dict[str, dict[str, Any]]) -> Slo:
    """The latencies with nothing else running, the larger of the two setups' (1P1D decodes every
    stream on one node, DP2 half on each): the SLOs' unit, DistServe's way."""
    return Slo(ttft_s=max(c["ttft_long_ms"] for c in calibration.values()) / MS,
               itl_s=max(c["step_ms"] for c in calibration.values()) / MS)


def chosen_slo(args: argparse.Namespace, alone: Slo) -> Slo:
    return Slo(ttft_s=args.ttft_slo_ms / MS if args.ttft_slo_ms else args.slo_factor * alone.ttft_s,
               itl_s=args.itl_slo_ms / MS if args.itl_slo_ms else args.slo_factor * alone.itl_s)


def reanalyze(args: argparse.Namespace) -> int:
    """--reanalyze: the figures of an earlier run's traces, with this command line's SLOs."""
    doc = json.loads(args.reanalyze.read_text())
    alone = alone_slo(doc["meta"]["calibration"])
    slo = chosen_slo(args, alone)
    runs = doc["runs"]
    for r in runs:
        r["metrics"] = run_metrics(trace_from_json(r["setup"], r["rep"], r["trace"]), slo, alone,
                                   args.slo_scales)
    print(f"{args.reanalyze}: started {doc['meta']['started_utc']}, argv {' '.join(doc['meta']['argv'])}")
    print(table(summary(runs), slo, runs))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="model dir (default: a 23 M random llama built under MODEL_CACHE, /tmp)")
    parser.add_argument("--hidden-size", type=int, default=512, help="the built llama only")
    parser.add_argument("--layers", type=int, default=6, help="the built llama only")
    parser.add_argument("--cpus", nargs=2, default=["0", "1"], metavar="CORES",
                        help="the core sets (taskset -c lists) of the first and the second engine node of "
                        "each setup (DP2's replicas; 1P1D's prefill and decode nodes), e.g. 0-7 8-15; "
                        "'none none' leaves them unpinned (default: 0 1)")
    parser.add_argument("--gpus", nargs=2, default=None, metavar="GPU",
                        help="CUDA_VISIBLE_DEVICES of the first and the second engine node (default: unset)")
    parser.add_argument("--decode-streams", type=int, default=4)
    parser.add_argument("--decode-prompt", type=int, default=64, help="prompt tokens of a decode stream")
    parser.add_argument("--decode-tokens", type=int, default=3000,
                        help="output tokens a decode stream asks for (enough to outlive the window; the "
                        "bench cuts the streams --tail seconds after it)")
    parser.add_argument("--tail", type=float, default=3.0,
                        help="seconds the decode streams go on after the window before the bench closes "
                        "them (their gaps there count as outside the window); negative: never cut")
    parser.add_argument("--long-prompt", type=int, default=2000, help="prompt tokens of a long request")
    parser.add_argument("--long-tokens", type=int, default=16, help="output tokens of a long request")
    parser.add_argument("--long-requests", type=int, default=3, help="long prompts per run")
    parser.add_argument("--long-interval", type=float, default=1.5,
                        help="seconds between long-prompt arrivals")
    parser.add_argument("--lead-chunks", type=int, default=16,
                        help="chunks every decode stream streams before the first long prompt")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (A/B, B/A, ...)")
    parser.add_argument("--local-prefill-below", type=int, default=None,
                        help="1P1D's router: prompts shorter than this prefill on the decode node "
                        "(default: halfway between --decode-prompt and --long-prompt)")
    parser.add_argument("--ttft-slo-ms", type=float, default=None,
                        help="goodput's TTFT SLO (default: --slo-factor x a long prompt's TTFT alone on DP2)")
    parser.add_argument("--itl-slo-ms", type=float, default=None,
                        help="goodput's ITL SLO (default: --slo-factor x the decode streams' step alone "
                        "on DP2)")
    parser.add_argument("--slo-factor", type=float, default=3.0,
                        help="the goodput's SLOs, in multiples of the latencies alone (default 3)")
    parser.add_argument("--slo-scales", type=float, nargs="*", default=[2.0, 3.0, 5.0, 8.0, 13.0],
                        help="also report the SLO attainment at these multiples (DistServe's SLO scale)")
    parser.add_argument("--reanalyze", type=Path, default=None, metavar="RESULTS_JSON",
                        help="start nothing: recompute the figures and the table of an earlier "
                        "results.json (e.g. with other SLOs) and print them")
    parser.add_argument("--blas", choices=["auto", "openblas", "bundled"],
                        default=os.environ.get("STATECORE_BLAS", "auto"))
    parser.add_argument("--node-arg", action="append", default=[],
                        help="extra flag for every engine node (repeatable), e.g. --node-arg=--max-batch=64")
    parser.add_argument("--router-arg", action="append", default=[], help="extra flag for both routers")
    parser.add_argument("--kv-memory-bytes", type=int, default=None,
                        help="each engine node's KV budget (default: 1 GiB on the CPU, 16 GiB with --gpus: "
                        "two engine nodes share each device)")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "disagg_equal")
    args = parser.parse_args(argv)
    if args.reanalyze is not None:
        return reanalyze(args)
    for signum in (signal.SIGTERM, signal.SIGHUP):  # run the `finally` that stops the servers
        signal.signal(signum, lambda signum, frame: sys.exit(128 + signum))
    # Ctrl-C too, even where the shell started us with SIGINT ignored (a background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    cpus: tuple[str | None, str | None] = tuple(  # type: ignore[assignment]
        None if c.lower() == "none" else c for c in args.cpus)
    allowed = os.sched_getaffinity(0)
    for c in cpus:
        if c is not None and not parse_cpus(c) <= allowed:
            raise SystemExit(f"--cpus {c}: not among this process's cores {sorted(allowed)}")
    if cpus[0] is not None and cpus[1] is not None and parse_cpus(cpus[0]) & parse_cpus(cpus[1]):
        print(f"warning: the core sets {cpus[0]} and {cpus[1]} overlap: the nodes share cores", flush=True)
    gpus: tuple[str | None, str | None] = (args.gpus[0], args.gpus[1]) if args.gpus else (None, None)
    threshold = args.local_prefill_below or (args.decode_prompt + args.long_prompt) // 2
    if not args.decode_prompt < threshold <= args.long_prompt:
        raise SystemExit(f"--local-prefill-below {threshold} must lie in ({args.decode_prompt}, "
                         f"{args.long_prompt}]: the streams prefill locally, the long prompts are handed off")
    model: Path = args.model or default_model(args.hidden_size, args.layers)
    needed = max(args.long_prompt + args.long_tokens, args.decode_prompt + args.decode_tokens)
    if (context := context_length(model)) is not None and needed > context:
        raise SystemExit(f"{model} has a context of {context} tokens; this load needs {needed}")
    args.out.mkdir(parents=True, exist_ok=True)
    env, blas = server_env(args.blas)
    budget = args.kv_memory_bytes or ((16 << 30) if args.gpus else (1 << 30))
    tail = args.tail if args.tail >= 0 else None
    token = secrets.token_hex(16)
    tag = secrets.token_hex(3)  # request ids unique to this bench run
    setups = make_setups(model, args.out, env, cpus, gpus, token=token, node_args=args.node_arg,
                         router_args=args.router_arg, local_prefill_below=threshold,
                         every_prompt_below=max(args.long_prompt, args.decode_prompt) + 1,
                         kv_memory_bytes=budget)
    meta: dict[str, Any] = {
        "argv": sys.argv, "model": str(model), "blas": blas, "cpus": list(args.cpus), "gpus": args.gpus,
        "local_prefill_below_1p1d": threshold, "kv_memory_bytes": budget,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine(), "started_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "load_average_at_start": os.getloadavg(),
    }
    print(f"model {model}  BLAS {blas}  cores {cpus[0]} | {cpus[1]}  GPUs {gpus[0]} | {gpus[1]}  "
          f"(load average {os.getloadavg()[0]:.2f})\n{args.decode_streams} decode streams "
          f"{args.decode_prompt}x{args.decode_tokens}; {args.long_requests} long prompts "
          f"{args.long_prompt}x{args.long_tokens} every {args.long_interval} s; rounds {args.rounds}; "
          f"1P1D hands off prompts of {threshold}+ tokens; out {args.out}", flush=True)

    runs: list[dict[str, Any]] = []
    problems: list[str] = []
    slo: Slo | None = None
    t0 = time.monotonic()

    def write_json(medians: dict[str, Any] | None = None) -> None:
        slos = None if slo is None else {"ttft_ms": slo.ttft_s * MS, "itl_ms": slo.itl_s * MS}
        doc = {"meta": meta, "slo": slos, "summary": medians, "problems": problems, "runs": runs}
        (args.out / "results.json").write_text(json.dumps(doc, indent=1))

    try:
        for setup in setups:
            for node in setup.nodes:
                if node.server.name.endswith("router"):
                    continue
                node.server.start(node.env)
        # Build the prompts while the engines load: exact-length 2,000-token prompts take ~1 s each.
        maker = PromptMaker(load_tokenizer(model))
        decode_mix = Mix(f"{args.decode_prompt}x{args.decode_tokens}", args.decode_prompt, args.decode_tokens)
        long_mix = Mix(f"{args.long_prompt}x{args.long_tokens}", args.long_prompt, args.long_tokens)
        warm_decode = build_prompts(maker, Mix("warm", args.decode_prompt, args.lead_chunks + 24),
                                    args.decode_streams, seed=999)
        warm_long = build_prompts(maker, long_mix, min(2, args.long_requests), seed=999)
        loads = [(build_prompts(maker, decode_mix, args.decode_streams, seed=rep),
                  build_prompts(maker, long_mix, args.long_requests, seed=rep)) for rep in range(args.rounds)]
        for setup in setups:
            for node in setup.nodes:
                if not node.server.name.endswith("router"):
                    node.server.wait_ready(args.startup_timeout)
        for setup in setups:  # the routers once their nodes answer
            router = setup.nodes[-1]
            router.server.start(router.env)
            router.server.wait_ready(args.startup_timeout)
        meta["startup_s"] = time.monotonic() - t0
        print(f"servers ready in {meta['startup_s']:.0f} s: " + ", ".join(
            f"{n.server.name} {n.server.url} pid {n.server.proc.pid if n.server.proc else '-'}"
            f"{'' if n.cpus is None else ' cores ' + n.cpus}" for s in setups for n in s.nodes), flush=True)
        # One unmeasured run per setup: first uses of shapes (batch sizes, the long prefill, the
        # KV install) cost extra once, on a GPU most (kernels compile).
        for setup in setups:
            asyncio.run(mixed_run(setup.name, -1, setup.front.url, tag + "w", warm_decode, warm_long,
                                  lead_chunks=args.lead_chunks, long_interval_s=args.long_interval,
                                  timeout_s=args.request_timeout, tail_s=0.0))
        meta["calibration"] = {s.name: calibrate(s, maker, args, tag) for s in setups}
        # DistServe's way: SLOs a multiple of the latency with nothing else running, each the
        # larger of the two setups' (1P1D decodes every stream on one node, DP2 half on each).
        alone = alone_slo(meta["calibration"])
        slo = chosen_slo(args, alone)
        print("alone (nothing else running): " + "; ".join(
            f"{name} step {c['step_ms']:.1f} ms, long TTFT {c['ttft_long_ms']:,.0f} ms, 1st->2nd "
            f"{c['second_token_gap_ms'] or 0:,.0f} ms" for name, c in meta["calibration"].items())
            + f"\nSLOs: TTFT <= {slo.ttft_s * MS:,.0f} ms, ITL <= {slo.itl_s * MS:.1f} ms", flush=True)
        if (placement := gpu_placement()) is not None:
            meta["nvidia_smi"] = placement
        for rep, (decode_prompts, long_prompts) in enumerate(loads):
            for setup in setups if rep % 2 == 0 else setups[::-1]:
                before = node_counters(setup.engines)
                load_before = os.getloadavg()
                run = asyncio.run(mixed_run(setup.name, rep, setup.front.url, tag, decode_prompts,
                                            long_prompts, lead_chunks=args.lead_chunks,
                                            long_interval_s=args.long_interval,
                                            timeout_s=args.request_timeout, tail_s=tail))
                moved = delta(node_counters(setup.engines), before)
                read_engine_times(run, setup.decoders, token)
                metrics = run_metrics(run, slo, alone, args.slo_scales)
                long_tokens = sum(t.prompt_tokens for t in run.long if t.ok)
                problem = check_routing(setup, moved, long_tokens)
                if metrics["failed_decode"] or metrics["failed_long"]:
                    problem = (problem + "; " if problem else "") + "requests failed"
                timeline: list[dict[str, Any]] = []
                if setup.prefill is not None:
                    timeline = handoff_timeline(run, handoff_records(setup.prefill, token),
                                                handoff_records(setup.decoders[0], token),
                                                meta["calibration"][setup.name]["ttft_long_ms"] / MS)
                runs.append({"setup": setup.name, "rep": rep, "valid": problem is None, "problem": problem,
                             "load_average": {"before": load_before, "after": os.getloadavg()},
                             "metrics": metrics, "handoff": handoff_medians(timeline) if timeline else None,
                             "handoff_timeline": timeline, "node_counters": moved, "trace": trace_json(run)})
                print(f"  {setup.name:4s} round {rep}: {run_line(metrics, moved)} "
                      f"(load {load_before[0]:.1f})", flush=True)
                for row in timeline:
                    print("       " + ", ".join(f"{k.removesuffix('_s')} {v:.3f}" if isinstance(v, float)
                                                else f"{k} {v}" for k, v in row.items()
                                                if v is not None and k != "records"), flush=True)
                if problem is not None:
                    problems.append(f"{setup.name} round {rep}: {problem}")
                    print(f"  PROBLEM: {problem}", flush=True)
                write_json()
    finally:
        for setup in setups:
            for node in reversed(setup.nodes):  # the router first, so it never sees its nodes vanish
                stop(node.server)
    meta["wall_s"] = time.monotonic() - t0
    meta["load_average_at_end"] = os.getloadavg()
    assert slo is not None
    medians = summary(runs)
    write_json(medians)
    text = table(medians, slo, runs)
    (args.out / "table.txt").write_text(text + "\n")
    print("\n" + text)
    short = [r for r in runs if r["metrics"]["decode_streams_covering_window"] < args.decode_streams]
    if short:
        print(f"\nwarning: in {len(short)} run(s) some decode streams ended before the last long prompt "
              "finished; the window's gaps cover fewer streams (raise --decode-tokens)")
    for problem in problems:
        print(f"PROBLEM: {problem} (the run is left out of the medians)")
    print(f"\nTotal {meta['wall_s']:.0f} s. Wrote {args.out}/results.json and table.txt")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
