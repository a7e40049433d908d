"""mlx_lm.server vs statecore single node vs statecore 3-node cluster: same model, prompts, machine.

Starts the three servers (each on a free port, all with the same environment, so the same BLAS),
checks that statecore's single node and cluster give identical greedy text, then runs every
(mix, concurrency) cell against each server in turn, alternating the order between repetitions,
with fresh prompts per repetition (so mlx_lm.server's prompt cache never hits) that are the same
for every server within a repetition. Prints a table and the ratios that the targets are stated
in, and writes results.json and results.png under --out.

    .venv/bin/python bench/side_by_side.py                  # CPU default, ~5-10 min on 2 cores

The default model is a random-weight llama (hidden 256, 4 layers, head dim 16, vocab 512: 2.4M
parameters, float32) built once by `support.tiny_models.cached_checkpoint` (~/.cache/statecore/tiny). `--blas
auto` (the default; env STATECORE_BLAS) preloads the system OpenBLAS
(/usr/lib/x86_64-linux-gnu/libopenblas.so.0, Debian's `libopenblas0`) into every server when it is
installed: MLX's CPU wheel bundles the reference (netlib) BLAS, about 10x slower at matmul. Bench
code: it may import anything, and nothing under src/ may import it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # support/: the tiny checkpoints

from serve_bench import (  # noqa: E402
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

from adapters.blas import blas_of_process_tree  # noqa: E402
from adapters.serve.cluster import wait_healthy  # noqa: E402
from adapters.serve.listeners import free_port  # noqa: E402

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


def make_servers(model: Path, out: Path, which: Sequence[str], extra_sc: list[str]) -> list[Server]:
    py = sys.executable
    servers = []
    for name in which:
        port = free_port()
        if name == "mlx_lm":
            argv = [py, "-m", "mlx_lm", "server", "--model", str(model), "--host", "127.0.0.1",
                    "--port", str(port), "--log-level", "WARNING"]
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


async def _greedy_texts(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    async with httpx.AsyncClient(timeout=600) as client:
        texts = []
        for prompt in prompts:
            r = await client.post(f"{url}/v1/completions", json={
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
            r.raise_for_status()
            texts.append(r.json()["choices"][0]["text"])
        return texts


def parity(servers: list[Server], maker: PromptMaker) -> dict[str, Any]:
    """Greedy text of a few prompts (short: local prefill; 1,200 tokens: through the prefill node)."""
    import random

    rng = random.Random("parity")
    prompts = [maker.make(n, rng) for n in (24, 200, 1200)]
    texts = {s.name: asyncio.run(_greedy_texts(s.url, prompts, 24)) for s in servers}
    report: dict[str, Any] = {"prompts_tokens": [24, 200, 1200]}
    names = list(texts)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            report[f"{a}=={b}"] = [x == y for x, y in zip(texts[a], texts[b], strict=True)]
    return report


def median_metric(runs: list[RunResult], key: str) -> float | None:
    vals = [float(v) for r in runs if (v := r.metrics.get(key)) is not None]
    return statistics.median(vals) if vals else None


def _fmt(v: float | None, width: int = 8, digits: int = 1) -> str:
    return f"{v:{width}.{digits}f}" if v is not None else " " * (width - 1) + "-"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(runs: list[RunResult], cells: list[tuple[Mix, int]], names: list[str]) -> str:
    lines = []
    head = f"{'mix':9s} {'conc':>4s} | " + " | ".join(
        f"{n:>7s} tok/s  TTFT50 ms  ITL50 ms TPOT50 ms fail" for n in names)
    if "mlx_lm" in names and "single" in names:
        head += " | tok/s s/m  TTFT s/m"
    if "cluster" in names and "single" in names:
        head += "  TTFT c/s"
    lines.append(head)
    for mix, c in cells:
        cell = {n: [r for r in runs if r.server == n and r.mix == mix.name and r.concurrency == c]
                for n in names}
        parts = []
        for n in names:
            sel = cell[n]
            fails = sum(int(r.metrics.get("failed") or 0) for r in sel)
            parts.append(f"{_fmt(median_metric(sel, 'output_tok_s'), 13)} "
                         f"{_fmt(median_metric(sel, 'ttft_p50_ms'), 9)} "
                         f"{_fmt(median_metric(sel, 'itl_p50_ms'), 9)} "
                         f"{_fmt(median_metric(sel, 'tpot_p50_ms'), 9)} {fails:4d}")
        line = f"{mix.name:9s} {c:4d} | " + " | ".join(parts)
        if "mlx_lm" in names and "single" in names:
            tok = _ratio(median_metric(cell["single"], "output_tok_s"),
                         median_metric(cell["mlx_lm"], "output_tok_s"))
            ttft = _ratio(median_metric(cell["single"], "ttft_p50_ms"),
                          median_metric(cell["mlx_lm"], "ttft_p50_ms"))
            line += f" | {_fmt(tok, 9, 2)} {_fmt(ttft, 9, 2)}"
        if "cluster" in names and "single" in names:
            ct = _ratio(median_metric(cell["cluster"], "ttft_p50_ms"),
                        median_metric(cell["single"], "ttft_p50_ms"))
            line += f"  {_fmt(ct, 9, 2)}"
        lines.append(line)
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="model dir (default: a built 2.4M llama)")
    parser.add_argument("--mix", type=parse_mix, action="append", default=None,
                        help="PxO or realish, repeatable (default: 128x128 and 2000x16)")
    parser.add_argument("--concurrency", type=_int_list, default=None,
                        help="comma list for the first mix (default 1,8,32)")
    parser.add_argument("--long-concurrency", type=_int_list, default=[1],
                        help="comma list for mixes after the first (default 1: TTFT at long prompts)")
    parser.add_argument("--requests-per-slot", type=int, default=2,
                        help="first mix: requests per run = max(min, min(this x concurrency, max))")
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--max-requests", type=int, default=32)
    parser.add_argument("--long-requests", type=int, default=3, help="requests per run of later mixes")
    parser.add_argument("--reps", type=int, default=2, help="alternating repetitions per cell")
    parser.add_argument("--servers", default="mlx_lm,single,cluster",
                        help="subset of mlx_lm,single,cluster")
    parser.add_argument("--blas", choices=["auto", "openblas", "bundled", "defaults"],
                        default=os.environ.get("STATECORE_BLAS", "auto"),
                        help="the same BLAS for every server (auto: OpenBLAS if installed), or "
                        "defaults: each server as its users run it (mlx_lm bundled, statecore auto)")
    parser.add_argument("--statecore-arg", action="append", default=[],
                        help="extra flag for the statecore servers (repeatable), e.g. --max-batch=64")
    parser.add_argument("--statecore-env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment setting for the statecore servers only (repeatable), e.g. "
                        "MLX_USE_CUDA_GRAPHS=1; mlx_lm.server keeps the environment as it is")
    parser.add_argument("--no-parity", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "side_by_side")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # run `finally`

    mixes: list[Mix] = args.mix or [parse_mix("128x128"), parse_mix("2000x16")]
    first_concs: list[int] = args.concurrency or [1, 8, 32]
    names = [n for n in args.servers.split(",") if n]
    if unknown := set(names) - set(SERVERS):
        raise SystemExit(f"unknown servers {sorted(unknown)}")
    model = args.model or default_model()
    args.out.mkdir(parents=True, exist_ok=True)
    blas = server_env(args.blas)[1]  # exits here when OpenBLAS is asked for but missing
    maker = PromptMaker(load_tokenizer(model))
    print(f"model {model}\nBLAS {blas}  servers {names}  mixes {[m.name for m in mixes]}  "
          f"reps {args.reps}  out {args.out}", flush=True)

    servers = make_servers(model, args.out, names, args.statecore_arg)
    runs: list[RunResult] = []
    if bad := [setting for setting in args.statecore_env if "=" not in setting]:
        raise SystemExit(f"--statecore-env takes NAME=VALUE, not {bad}")
    meta: dict[str, Any] = {"model": str(model), "blas": blas, "argv": sys.argv,
                            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    t0 = time.monotonic()
    try:
        start_all(servers, args.blas, args.startup_timeout, meta, args.statecore_env)
        print(f"BLAS in use (/proc/<pid>/maps): {meta['blas_used']}", flush=True)
        meta["startup_s"] = time.monotonic() - t0
        print(f"servers ready in {meta['startup_s']:.0f} s: "
              + ", ".join(f"{s.name} {s.url}" for s in servers), flush=True)
        # Warm every server at every concurrency the cells use (a GPU backend compiles kernels on
        # first use of a shape; a cold server would pay that inside the first measured cell).
        warm_concs = sorted({c for i, _ in enumerate(mixes) for c in (first_concs if i == 0 else
                                                                       args.long_concurrency)})
        for s in servers:
            for c in warm_concs:
                warm = build_prompts(maker, Mix("warm", 64, 8), c, 12345 + c)
                asyncio.run(run_load(s.url, warm, concurrency=c))
            # realish has no fixed length (prompt_tokens None): warm up with its longest, 1536.
            longest = max(m.prompt_tokens or 1536 for m in mixes)
            long = build_prompts(maker, Mix("warm-long", min(2000, longest), 4), 1, 777)
            if long[0][1] > 64:
                asyncio.run(run_load(s.url, long, concurrency=1))
        if not args.no_parity:
            meta["parity"] = parity(servers, maker)
            print(f"parity (greedy text equal per prompt): {meta['parity']}", flush=True)
        cells = [(mix, c) for i, mix in enumerate(mixes)
                 for c in (first_concs if i == 0 else args.long_concurrency)]
        for mix, c in cells:
            n = (max(args.min_requests, min(args.requests_per_slot * c, args.max_requests))
                 if mix is mixes[0] else args.long_requests)
            for rep in range(args.reps):
                prompts = build_prompts(maker, mix, n, seed=1000 * rep + c)
                order = servers if rep % 2 == 0 else servers[::-1]
                for s in order:
                    results, wall = asyncio.run(run_load(
                        s.url, prompts, concurrency=c, progress=f"{s.name} {mix.name} c={c} rep {rep}"))
                    run = RunResult(s.name, mix.name, c, None, n, wall, summarize(results, wall),
                                    sorted({r.error for r in results if r.error})[:5], {"rep": rep})
                    runs.append(run)
                    m = run.metrics
                    print(f"  {s.name:8s} {mix.name:9s} c={c:<3d} rep {rep}: "
                          f"{_fmt(m['output_tok_s'] and float(m['output_tok_s']))} tok/s  TTFT p50 "
                          f"{_fmt(m['ttft_p50_ms'] and float(m['ttft_p50_ms']))} ms  failed {m['failed']}",
                          flush=True)
                    (args.out / "results.json").write_text(json.dumps(
                        {"meta": meta, "runs": [asdict(r) for r in runs]}, indent=1))
    finally:
        for s in servers:
            s.stop()
    meta["wall_s"] = time.monotonic() - t0
    text = table(runs, cells, names)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "runs": [asdict(r) for r in runs]},
                                                      indent=1))
    (args.out / "table.txt").write_text(text + "\n")
    plot_runs(runs, args.out / "results.png", f"{Path(model).name} BLAS={blas} (median of reps)")
    print("\n" + text)
    print(f"\nratios: s/m = statecore single / mlx_lm.server; c/s = cluster / single. "
          f"Total {meta['wall_s']:.0f} s. Wrote {args.out}/results.json, table.txt, results.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
