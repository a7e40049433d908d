"""mlx_lm.server vs statecore single node vs statecore 3-node cluster: same model, prompts, machine.

Starts the three servers (each on a free port, all with the same environment, so the same BLAS),
checks that statecore's single node and cluster give identical greedy text, then runs every
(mix, concurrency) cell against each server in turn, alternating the order between repetitions,
with fresh prompts per repetition (so mlx_lm.server's prompt cache never hits) that are the same
for every server within a repetition. Prints a table and the ratios that the targets are stated
in, and writes results.json and results.png under --out. With `--base-src DIR` a fourth server,
`base`, is a single node running DIR (another checkout's src/, or this one's with `--base-arg`
flags): a before and after, or a flag's A/B, in one run. After each run the script waits for the
server to go quiet (`wait_quiet`): work a node leaves for idle capacity (keep tasks) then counts in
that run's CPU and does not slow the next server's run.

    .venv/bin/python bench/serving/side_by_side.py                  # CPU default, ~5-10 min on 2 cores

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
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib

from benchlib import (
    ROOT,
    SERVERS,
    Mix,
    PromptMaker,
    RunResult,
    Server,
    build_prompts,
    default_model,
    load_tokenizer,
    make_servers,
    parse_mix,
    plot_runs,
    run_load,
    server_env,
    start_all,
    summarize,
)

from adapters.blas import blas_of_process_tree, child_pids


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


def cpu_seconds(server: Server) -> float:
    """User + system CPU seconds a server's process tree has used so far (/proc): a run's share is
    the work it cost, whatever else the box was doing meanwhile."""
    assert server.proc is not None
    tick = os.sysconf("SC_CLK_TCK")
    total, pending = 0.0, [server.proc.pid]
    while pending:
        pid = pending.pop()
        pending += child_pids(pid)
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def wait_quiet(server: Server, most_s: float = 180.0, busy_share: float = 0.05) -> float:
    """Seconds until the server's processes used less than `busy_share` of a core over a second
    (at most `most_s`): work a server leaves for after a run (a node's keep tasks run on idle
    capacity) is then done before the next server's run starts, and counted in this run's CPU."""
    started = time.monotonic()
    before = cpu_seconds(server)
    while time.monotonic() - started < most_s:
        time.sleep(1.0)
        now = cpu_seconds(server)
        if now - before < busy_share:
            break
        before = now
    return time.monotonic() - started


def median_metric(runs: list[RunResult], key: str) -> float | None:
    vals = [float(v) for r in runs if (v := r.metrics.get(key)) is not None]
    return statistics.median(vals) if vals else None


def _fmt(v: float | None, width: int = 8, digits: int = 1) -> str:
    return f"{v:{width}.{digits}f}" if v is not None else " " * (width - 1) + "-"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


_RATIOS = (("output_tok_s", "tok/s"), ("ttft_p50_ms", "TTFT50"), ("itl_p99_ms", "ITL99"),
           ("cpu_ms_per_token", "CPU/tok"))


def _ratios(cell: dict[str, list[RunResult]], a: str, b: str) -> str:
    """`a` / `b` per metric the targets name, from the medians of the reps."""
    return " ".join(_fmt(_ratio(median_metric(cell[a], key), median_metric(cell[b], key)), 7, 2)
                    for key, _ in _RATIOS)


def table(runs: list[RunResult], cells: list[tuple[Mix, int]], names: list[str],
          variants: Sequence[Variant] = ()) -> str:
    pairs = [(a, b) for a, b in (("single", "mlx_lm"), ("cluster", "single"), ("base", "mlx_lm"),
                                 ("single", "base")) if a in names and b in names]
    pairs += [(v.label, b) for v in variants for b in ("mlx_lm", v.kind) if b in names]
    lines = []
    head = f"{'mix':9s} {'conc':>4s} | " + " | ".join(
        f"{n:>7s} tok/s  TTFT50 ms  ITL50 ms  ITL99 ms TPOT50 ms CPU ms/tok fail" for n in names)
    for a, b in pairs:
        head += f" | {a}/{b}: " + " ".join(f"{label:>7s}" for _, label in _RATIOS)
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
                         f"{_fmt(median_metric(sel, 'itl_p99_ms'), 9)} "
                         f"{_fmt(median_metric(sel, 'tpot_p50_ms'), 9)} "
                         f"{_fmt(median_metric(sel, 'cpu_ms_per_token'), 10)} {fails:4d}")
        line = f"{mix.name:9s} {c:4d} | " + " | ".join(parts)
        for a, b in pairs:
            line += f" | {' ' * 5}{_ratios(cell, a, b)}"
        lines.append(line)
    return "\n".join(lines)


@dataclass(frozen=True)
class Variant:
    """One more statecore server of this tree (`kind`: single or cluster), named `label`, with
    `env` on top of the others' environment: an environment setting's A/B in one run."""

    label: str
    kind: str
    env: dict[str, str]


def parse_variant(text: str) -> Variant:
    """LABEL=KIND:NAME=VALUE[,NAME=VALUE...], e.g. t2=single:OPENBLAS_NUM_THREADS=2."""
    label, _, rest = text.partition("=")
    kind, _, settings = rest.partition(":")
    pairs = [setting.partition("=") for setting in settings.split(",") if setting]
    if (not label.isidentifier() or label in SERVERS or label == "base" or kind not in ("single", "cluster")
            or not pairs or any(not name or not sep for name, sep, _ in pairs)):
        raise argparse.ArgumentTypeError(
            f"--variant takes LABEL=single:NAME=VALUE[,NAME=VALUE...] (or cluster:...), not {text!r}")
    return Variant(label, kind, {name: value for name, _, value in pairs})


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
    parser.add_argument("--mlx-lm-arg", action="append", default=[],
                        help="extra flag for mlx_lm.server (repeatable), e.g. --mlx-lm-arg=--draft-model=DIR")
    parser.add_argument("--statecore-env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment setting for the statecore servers only (repeatable), e.g. "
                        "MLX_USE_CUDA_GRAPHS=1; mlx_lm.server keeps the environment as it is")
    parser.add_argument("--base-src", type=Path, default=None,
                        help="also a single node running this src/ tree (e.g. main's at a commit, for a "
                        "before in the same run): the server 'base'")
    parser.add_argument("--base-arg", action="append", default=[],
                        help="extra flag for 'base' only (repeatable; with --base-src src, a flag's A/B in "
                        "one run), e.g. --base-arg=--keep-conversations=off")
    parser.add_argument("--variant", type=parse_variant, action="append", default=[],
                        metavar="LABEL=KIND:NAME=VALUE,...",
                        help="one more single node or cluster of this tree named LABEL, with these "
                        "environment settings on top (repeatable), e.g. t2=single:OPENBLAS_NUM_THREADS=2: "
                        "reported against mlx_lm.server and against its KIND")
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

    servers = make_servers(model, args.out, names, args.statecore_arg, args.mlx_lm_arg)
    base = None
    if args.base_src is not None:  # a single node as `single` is, on another src/ tree
        (base,) = make_servers(model, args.out, ["single"], [*args.statecore_arg, *args.base_arg])
        base.name, base.log = "base", args.out / "base.log"
        servers.append(base)
        names.append("base")
    variants: list[Variant] = args.variant
    for variant in variants:
        (server,) = make_servers(model, args.out, [variant.kind], args.statecore_arg)
        server.name, server.log = variant.label, args.out / f"{variant.label}.log"
        servers.append(server)
        names.append(variant.label)
    if len(set(names)) < len(names):
        raise SystemExit(f"two servers share a name: {names}")
    runs: list[RunResult] = []
    if bad := [setting for setting in args.statecore_env if "=" not in setting]:
        raise SystemExit(f"--statecore-env takes NAME=VALUE, not {bad}")
    meta: dict[str, Any] = {"model": str(model), "blas": blas, "argv": sys.argv,
                            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    t0 = time.monotonic()
    try:
        if base is not None:
            env = server_env(args.blas, "single")[0]
            env["PYTHONPATH"] = os.pathsep.join([str(args.base_src.resolve()),
                                                 *env["PYTHONPATH"].split(os.pathsep)[1:]])
            for setting in args.statecore_env:
                name, value = setting.split("=", 1)
                env[name] = value
            base.start(env)
            meta["base_src"], meta["base_args"] = str(args.base_src), args.base_arg
        by_label = {v.label: v for v in variants}
        for s in servers:
            if s.name in by_label:
                env = server_env(args.blas, by_label[s.name].kind)[0]
                env.update(setting.split("=", 1) for setting in args.statecore_env)
                env.update(by_label[s.name].env)
                s.start(env)
        start_all([s for s in servers if s is not base and s.name not in by_label], args.blas,
                  args.startup_timeout, meta, args.statecore_env)
        for s in servers:
            if s is base or s.name in by_label:
                s.wait_ready(args.startup_timeout)
        meta["blas_used"] = {s.name: blas_of_process_tree(s.proc.pid) for s in servers if s.proc}
        meta["variants"] = [asdict(v) for v in variants]
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
                    cpu_before, load_before = cpu_seconds(s), os.getloadavg()[0]
                    results, wall = asyncio.run(run_load(
                        s.url, prompts, concurrency=c, progress=f"{s.name} {mix.name} c={c} rep {rep}"))
                    metrics = summarize(results, wall)
                    metrics["quiet_after_s"] = wait_quiet(s)
                    tokens = sum(r.output_tokens for r in results if r.ok)
                    metrics["cpu_ms_per_token"] = 1000 * (cpu_seconds(s) - cpu_before) / max(tokens, 1)
                    run = RunResult(s.name, mix.name, c, None, n, wall, metrics,
                                    sorted({r.error for r in results if r.error})[:5],
                                    {"rep": rep, "load": [load_before, os.getloadavg()[0]]})
                    runs.append(run)
                    m = run.metrics
                    print(f"  {s.name:8s} {mix.name:9s} c={c:<3d} rep {rep}: "
                          f"{_fmt(m['output_tok_s'] and float(m['output_tok_s']))} tok/s  TTFT p50 "
                          f"{_fmt(m['ttft_p50_ms'] and float(m['ttft_p50_ms']))} ms  ITL p99 "
                          f"{_fmt(m['itl_p99_ms'] and float(m['itl_p99_ms']))} ms  CPU "
                          f"{float(m['cpu_ms_per_token'] or 0):.1f} ms/token  failed {m['failed']}  load "
                          f"{run.extra['load'][0]:.1f} -> {run.extra['load'][1]:.1f}; quiet after "
                          f"{float(m['quiet_after_s'] or 0):.0f} s",
                          flush=True)
                    (args.out / "results.json").write_text(json.dumps(
                        {"meta": meta, "runs": [asdict(r) for r in runs]}, indent=1))
    finally:
        for s in servers:
            s.stop()
    meta["wall_s"] = time.monotonic() - t0
    text = table(runs, cells, names, variants)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "runs": [asdict(r) for r in runs]},
                                                      indent=1))
    (args.out / "table.txt").write_text(text + "\n")
    plot_runs(runs, args.out / "results.png", f"{Path(model).name} BLAS={blas} (median of reps)")
    print("\n" + text)
    print(f"\nratios: single/mlx_lm = statecore single / mlx_lm.server, and so on (medians of the reps). "
          f"Total {meta['wall_s']:.0f} s. Wrote {args.out}/results.json, table.txt, results.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
