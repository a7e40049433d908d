"""What the benchmarks share: the servers they start, the prompts they send and the client that
times the answers.

- Servers: `Server` (one process on a free port, its log, its stop), `server_env` (the BLAS
  choice every server of a comparison gets), `make_servers` / `start_all` (mlx_lm.server, a
  statecore single node, a local cluster), `node_env` / `parse_cpus` (one engine node pinned to
  cores or a GPU), `default_model` (the tiny llama), `context_length`, `with_context` (a longer
  context for a tiny checkpoint), `gpu_placement`, `machine`.
- Prompts: `PromptMaker` (text whose encoding has an exact number of tokens), `Mix` / `parse_mix`
  (`PxO` or `realish` lengths), `build_prompts`, `load_tokenizer` (a local directory, never the
  hub).
- Clients: `completion_stream` (one streaming `/v1/completions`: status, `data:` lines, `[DONE]`,
  error documents), `stream_request` (one timed request into a `RequestResult`), `run_load` (many,
  at a concurrency and an optional Poisson rate), `summarize` / `percentile` (TTFT, ITL, TPOT,
  tok/s), `RunResult` / `plot_runs`.

Importing it puts `src/` and the repository root (`support/`, `tests.e2e.harness`) on `sys.path`,
so a script under bench/ needs only `bench/` on its path. Bench code: it may import anything, and
nothing under src/ or tests/ may import it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import httpx

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (ROOT, ROOT / "src"):  # src/ first: the packages; the root: support/, tests.e2e.harness
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from adapters.blas import blas_of_process_tree  # noqa: E402
from adapters.serve.cluster import wait_healthy  # noqa: E402
from adapters.serve.listeners import free_port  # noqa: E402

# -- servers -----------------------------------------------------------------------------------

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
SERVERS = ("mlx_lm", "single", "cluster")


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    _log_file: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, env: dict[str, str]) -> None:
        self._log_file = self.log.open("wb")
        self.proc = subprocess.Popen(self.argv, env=env, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=ROOT)

    def wait_ready(self, timeout_s: float) -> None:
        assert self.proc is not None
        problem = wait_healthy(self.url, self.proc, timeout_s)
        if problem is not None:
            raise SystemExit(f"{self.name}: {problem}; see {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # SIGTERM the server's own process (the cluster parent stops its children itself).
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log_file is not None:
            self._log_file.close()


def server_env(blas: str, server: str | None = None) -> tuple[dict[str, str], str]:
    """A server's environment and the BLAS it is given. `defaults` runs each server as its users
    do: mlx_lm.server on MLX's bundled BLAS, statecore choosing its own (`--blas auto`)."""
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # An inherited preload would decide for us; the choice below sets it again where wanted.
    kept = [e for e in env.pop("LD_PRELOAD", "").replace(":", " ").split() if "openblas" not in e]
    if kept:
        env["LD_PRELOAD"] = " ".join(kept)
    if blas == "defaults":
        if server != "mlx_lm":
            env.pop("STATECORE_BLAS", None)
            return env, "defaults (mlx_lm bundled, statecore auto)"
        blas = "bundled"
    if blas == "auto":
        blas = "openblas" if Path(OPENBLAS).exists() else "bundled"
    if blas == "openblas":
        if not Path(OPENBLAS).exists():
            raise SystemExit(f"--blas openblas: {OPENBLAS} is missing (apt-get install libopenblas0)")
        env["LD_PRELOAD"] = OPENBLAS + (" " + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    env["STATECORE_BLAS"] = blas  # else statecore's servers would pick their own (`--blas auto`)
    return env, blas


def make_servers(model: Path, out: Path, which: Sequence[str], extra_sc: list[str],
                 extra_mlx_lm: Sequence[str] = ()) -> list[Server]:
    py = sys.executable
    servers = []
    for name in which:
        port = free_port()
        if name == "mlx_lm":
            argv = [py, "-m", "mlx_lm", "server", "--model", str(model), "--host", "127.0.0.1",
                    "--port", str(port), "--log-level", "WARNING", *extra_mlx_lm]
        elif name == "single":
            argv = [py, "-m", "adapters.cli", "run", "--role", "single", "--model", str(model),
                    "--port", str(port), "--log-level", "WARNING", *extra_sc]
        else:
            argv = [py, "-m", "adapters.cli", "run", "--model", str(model), "--port", str(port),
                    "--log-level", "WARNING", *extra_sc]
        servers.append(Server(name, argv, port, out / f"{name}.log"))
    return servers


def start_all(servers: Sequence[Server], blas: str, timeout_s: float, meta: dict[str, Any],
              statecore_env: Sequence[str] = ()) -> None:
    """Start every server in the same environment (plus `statecore_env`'s NAME=VALUE settings for
    statecore's servers only), wait for each, and note the BLAS each uses."""
    for s in servers:
        env = server_env(blas, s.name)[0]
        for setting in statecore_env if s.name != "mlx_lm" else ():
            name, value = setting.split("=", 1)
            env[name] = value
        s.start(env)
    for s in servers:
        s.wait_ready(timeout_s)
    meta["blas_used"] = {s.name: blas_of_process_tree(s.proc.pid) for s in servers if s.proc}


def default_model() -> Path:
    from support.tiny_models import cached_checkpoint

    return cached_checkpoint("llama", hidden_size=256, num_layers=4)




def node_env(base: dict[str, str], cpus: str | None, gpu: str | None) -> dict[str, str]:
    """`base` for an engine node pinned to the GPU `gpu` and (by the caller's taskset) the cores
    `cpus`, with one BLAS / OpenMP thread per core it may use: more would only fight over them."""
    env = dict(base)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if cpus is not None:
        threads = str(len(parse_cpus(cpus)))
        env["OPENBLAS_NUM_THREADS"] = threads
        env["OMP_NUM_THREADS"] = threads
    return env


def parse_cpus(text: str) -> set[int]:
    """taskset's list form: `0`, `0,2`, `0-3`, `0-3,8`."""
    cores: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


def context_length(model: Path) -> int | None:
    config = json.loads((model / "config.json").read_text())
    text_config = config.get("text_config") or {}
    value = config.get("max_position_embeddings") or text_config.get("max_position_embeddings")
    return int(value) if value else None


def with_context(model: Path, tokens: int) -> Path:
    """`model`, or when its context is shorter than `tokens` a sibling whose config says `tokens`
    (the other files linked, not copied): the tiny checkpoints say 4,096, and a RoPE model runs
    past it unchanged, which an 8,000-token handoff on the CPU needs."""
    known = context_length(model)
    if known is None or known >= tokens:
        return model
    longer = model.with_name(f"{model.name}-context{tokens}")
    if not (longer / "config.json").exists():
        staging = Path(tempfile.mkdtemp(prefix=longer.name, dir=model.parent))
        for item in model.iterdir():
            if item.name != "config.json":
                (staging / item.name).symlink_to(item.resolve())
        config = json.loads((model / "config.json").read_text())
        config["max_position_embeddings"] = tokens
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        try:
            staging.rename(longer)
        except OSError:  # another process made it first
            shutil.rmtree(staging, ignore_errors=True)
    return longer


def gpu_placement() -> str | None:
    """nvidia-smi's view of which process holds memory on which GPU, to check the pinning."""
    if shutil.which("nvidia-smi") is None:
        return None
    queries = (["--query-gpu=index,pci.bus_id,memory.used"],
               ["--query-compute-apps=pid,gpu_bus_id,used_memory"])
    parts = []
    for query in queries:
        done = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30, check=False)
        parts.append(done.stdout.strip() or done.stderr.strip())
    return "\n".join(parts)


def machine() -> dict[str, Any]:
    """The host a result came from: platform, Python, cores, CPU model, this process's affinity,
    load average and the checkout's commit."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "cpu_model": model, "affinity": sorted(os.sched_getaffinity(0)),
            "load_average": round(os.getloadavg()[0], 1), "git_commit": commit}


# -- clients: one streaming completion ---------------------------------------------------------


class CompletionStreamError(Exception):
    """The server refused a streaming completion (a non-200 status) or sent an `error` document."""


async def _sse_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: Mapping[str, str] | None,
    text_of: Callable[[dict[str, Any]], str],
) -> AsyncIterator[tuple[list[str], dict[str, Any] | None]]:
    """POST a streaming request to `url` and yield, per `data:` document up to `[DONE]`, its
    choices' non-empty texts (`text_of` a choice) and its `usage` (None when absent)."""
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:200]
            raise CompletionStreamError(f"HTTP {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            doc = json.loads(data)
            if "error" in doc:
                raise CompletionStreamError(f"stream error: {json.dumps(doc['error'])[:200]}")
            texts = [text for choice in doc.get("choices") or [] if (text := text_of(choice))]
            yield texts, doc.get("usage") or None


def completion_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: Mapping[str, str] | None = None
) -> AsyncIterator[tuple[list[str], dict[str, Any] | None]]:
    """POST a streaming `/v1/completions` and yield, per `data:` document up to `[DONE]`, its
    non-empty choice texts and its `usage` (None when absent). Raises CompletionStreamError with
    a short message for a non-200 status or an error document; transport errors and bad JSON
    propagate as httpx / json exceptions. `headers`: extra request headers (e.g. X-Request-Id, so
    that the nodes' records can be joined with the client's timings)."""
    return _sse_stream(client, f"{url}/v1/completions", body, headers,
                       lambda choice: choice.get("text") or "")


def chat_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: Mapping[str, str] | None = None
) -> AsyncIterator[tuple[list[str], dict[str, Any] | None]]:
    """`completion_stream` for a streaming `/v1/chat/completions`: per `data:` document, its
    choices' non-empty delta contents and its `usage`."""
    return _sse_stream(client, f"{url}/v1/chat/completions", body, headers,
                       lambda choice: (choice.get("delta") or {}).get("content") or "")


# -- prompts and the load client -------------------------------------------------------------

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


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), interpolated between the closest ranks; None for no values."""
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
        "ttft_p50_ms": scaled(percentile(ttft, 50)),
        "ttft_p99_ms": scaled(percentile(ttft, 99)),
        "itl_p50_ms": scaled(percentile(gaps, 50)),
        "itl_p99_ms": scaled(percentile(gaps, 99)),
        "tpot_p50_ms": scaled(percentile(tpot, 50)),
        "e2e_p50_ms": scaled(percentile(e2e, 50)),
        "e2e_p99_ms": scaled(percentile(e2e, 99)),
        "mean_output_tokens": out_tokens / len(ok) if ok else None,
        "mean_prompt_tokens_reported": statistics.fmean(reported) if reported else None,
        "mean_prompt_tokens_sent": (
            statistics.fmean(r.prompt_tokens_sent for r in results) if results else None
        ),
    }


async def stream_request(
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
                await stream_request(client, url, prompts[i][0], results[i], model)
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
    except ImportError:  # e.g. the GPU image: results.json still has every number
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


