"""Two well-kept load clients, AIPerf and GuideLLM, against mlx_lm.server and statecore on one model.

What it is for: an independent check of bench/serving/side_by_side.py's numbers and of the API's
compatibility, with clients nobody here wrote. It starts the same servers as side_by_side.py (benchlib's
`make_servers`, `server_env` and `default_model`: mlx_lm.server, a statecore single node and a
statecore local cluster, router + prefill + decode, each on a free port with the same BLAS), then
drives each with AIPerf 0.13 (streaming chat, synthetic prompts of mixed lengths, a fixed output
length with vLLM's `ignore_eos`, closed loop at each --concurrency) and, with --guidellm, the
router with GuideLLM 0.8 too. It reads the clients' exported JSON (AIPerf's
profile_export_aiperf.json, GuideLLM's benchmarks.json) into one table: output tok/s, TTFT p50,
ITL p50/p99, requests and errors, with statecore / mlx_lm ratios from the same run. Exit status 1
when any statecore run had an error (or its client failed), with the clients' error summaries
printed and kept in results.json.

    .venv/bin/python bench/clients/load_clients.py                    # AIPerf x 3 servers, ~5 min on 2 cores
    .venv/bin/python bench/clients/load_clients.py --guidellm         # + GuideLLM against the router

Which load generator for what: side_by_side.py's own client (serve_bench.py) stays the one the
performance tables are made with: it sends the very same token-exact prompts to every server
within a repetition, alternates the order, checks greedy byte parity between single node and
cluster, and prints the per-cell ratios the targets are stated in. AIPerf and GuideLLM are the
independent check: their own prompt synthesis, SSE parsing, TTFT/ITL definitions and error
accounting, on the same servers. Neither can check parity, and each adds seconds of startup per
run, so neither replaces it.

The clients are heavy (GuideLLM needs torch) and are not project dependencies: they live in their
own venv, bench/clients/.clients-venv, made by bench/clients/setup_clients.sh (run on first use), and run as
subprocesses; this script itself runs under .venv. Their environment drops HF_HUB_OFFLINE (AIPerf
loads the tokenizer from the local --model directory). Bench code: it may import anything, and
nothing under src/ may import it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib

from benchlib import ROOT, SERVERS, Server, default_model, make_servers, server_env, start_all

HERE = Path(__file__).resolve().parent
CLIENTS_VENV = HERE / ".clients-venv"
SETUP = HERE / "setup_clients.sh"
STATECORE = ("single", "cluster")


@dataclass
class ClientRun:
    client: str  # aiperf | guidellm
    server: str
    concurrency: int
    requests: int  # completed without error
    errors: int  # errored requests; -1 when the client failed before reporting any
    output_tok_s: float | None
    ttft_p50_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    wall_s: float
    rc: int
    artifacts: str
    error_summary: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def ensure_clients(venv: Path, guidellm: bool) -> None:
    need = [venv / "bin" / "aiperf"] + ([venv / "bin" / "guidellm"] if guidellm else [])
    if all(p.exists() for p in need):
        return
    print(f"installing the load clients into {venv} (bench/clients/setup_clients.sh)", flush=True)
    env = dict(os.environ, CLIENTS_VENV=str(venv))
    subprocess.run(["bash", str(SETUP), *(["--guidellm"] if guidellm else [])], check=True, env=env)


def client_env() -> dict[str, str]:
    """The clients' environment: ours, less what is meant for the servers."""
    env = dict(os.environ)
    for key in ("HF_HUB_OFFLINE", "PYTHONPATH", "LD_PRELOAD", "STATECORE_BLAS"):
        env.pop(key, None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def served_model(server: Server, model: Path) -> str:
    """The `model` field each server accepts: mlx_lm.server loads any other name from the Hub, so it
    gets its --model path; statecore serves one id, the one /v1/models lists."""
    if server.name == "mlx_lm":
        return str(model)
    r = httpx.get(f"{server.url}/v1/models", timeout=30)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def _metric(data: dict[str, Any], key: str, stat: str) -> float | None:
    v = data.get(key)
    if isinstance(v, dict) and isinstance(v.get(stat), int | float):
        return float(v[stat])
    return None


def parse_aiperf(out: Path) -> dict[str, Any]:
    """AIPerf's summary export: each metric a {unit, avg, p50, p99, ...} object; errored requests
    are counted in `error_request_count` (present only when some failed), described in
    `error_summary` ([{error_details: {code, type, message}, count}])."""
    data: dict[str, Any] = json.loads((out / "profile_export_aiperf.json").read_text())
    errors = _metric(data, "error_request_count", "avg")
    listed = data.get("error_summary") or []
    summary = [f"{e.get('count')} x {json.dumps(e.get('error_details'))}" for e in listed]
    if errors is None:
        errors = float(sum(int(e.get("count") or 0) for e in listed))
    server_metrics = out / "server_metrics_export.json"
    families = (sorted(json.loads(server_metrics.read_text()).get("metrics", {}))
                if server_metrics.exists() else [])
    return {
        "requests": int(_metric(data, "request_count", "avg") or 0),
        "errors": int(errors),
        "output_tok_s": _metric(data, "output_token_throughput", "avg"),
        "ttft_p50_ms": _metric(data, "time_to_first_token", "p50"),
        "itl_p50_ms": _metric(data, "inter_token_latency", "p50"),
        "itl_p99_ms": _metric(data, "inter_token_latency", "p99"),
        "error_summary": summary,
        "extra": {"server_metric_families": len(families),
                  "server_metric_prefixes": sorted({f.split(":")[0] for f in families if ":" in f}),
                  "osl_p50": _metric(data, "output_sequence_length", "p50"),
                  "isl_p50": _metric(data, "input_sequence_length", "p50"),
                  "isl_min": _metric(data, "input_sequence_length", "min"),
                  "isl_max": _metric(data, "input_sequence_length", "max")},
    }


def aiperf_records(out: Path, limit: int = 5) -> tuple[int, int, list[str]]:
    """From the per-request export (written even when every request failed, when the summary is
    not): profiling-phase requests that succeeded, that failed, and the first few failures' error
    objects verbatim (AIPerf keeps the HTTP status and the server's response body)."""
    path = out / "profile_export.jsonl"
    ok, errors = 0, 0
    found: list[str] = []
    if not path.exists():
        return ok, errors, found
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("metadata", {}).get("benchmark_phase") != "profiling":
            continue
        if rec.get("error"):
            errors += 1
            if len(found) < limit:
                found.append(json.dumps(rec["error"])[:1000])
        else:
            ok += 1
    return ok, errors, found


def run_client(argv: list[str], log: Path, timeout_s: float) -> tuple[int, float]:
    t0 = time.monotonic()
    with log.open("wb") as f:
        try:
            rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=client_env(), cwd=log.parent,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - t0


def run_aiperf(args: argparse.Namespace, server: Server, name: str, c: int, n: int) -> ClientRun:
    out = args.out / "aiperf" / f"{server.name}-c{c}"
    out.mkdir(parents=True, exist_ok=True)
    argv = [str(args.clients_venv / "bin" / "aiperf"), "profile",
            "--model", name, "--url", server.url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", str(args.model),
            "--synthetic-input-tokens-mean", str(args.isl),
            "--synthetic-input-tokens-stddev", str(args.isl_stddev),
            "--output-tokens-mean", str(args.osl), "--extra-inputs", "ignore_eos:true",
            # The server's usage counts: re-tokenizing a random model's output text does not give
            # back the tokens it generated (AIPerf warns of a >10% gap on every request otherwise).
            "--use-server-token-count",
            "--concurrency", str(c), "--request-count", str(n), "--warmup-request-count", str(c),
            "--random-seed", str(args.seed), "--request-timeout-seconds", str(args.request_timeout),
            "--ui-type", "none", "--no-gpu-telemetry", "--artifact-dir", str(out)]
    rc, wall = run_client(argv, out / "aiperf.log", args.client_timeout)
    run = ClientRun("aiperf", server.name, c, 0, -1, None, None, None, None, wall, rc, str(out))
    ok, errors, first_errors = aiperf_records(out)
    try:
        parsed = parse_aiperf(out)
    except (OSError, ValueError) as e:
        run.requests, run.errors = ok, (errors if ok + errors else -1)
        run.error_summary = [f"no AIPerf summary ({e}); rc {rc}; see {out / 'aiperf.log'}", *first_errors]
        return run
    for k, v in parsed.items():
        setattr(run, k, v)
    run.error_summary += first_errors
    if rc != 0:
        run.error_summary.append(f"aiperf exited {rc}; see {out / 'aiperf.log'}")
    return run


def guidellm_scenario(args: argparse.Namespace, server: Server, name: str, c: int, n: int,
                      out: Path) -> dict[str, Any]:
    """GuideLLM 0.8 takes its whole configuration as one scenario (`kind=` objects)."""
    lo = max(1, args.isl - 3 * args.isl_stddev)
    return {"spec": {
        "backend": {"kind": "openai_http", "target": server.url, "model": name,
                    "request_format": "/v1/chat/completions", "stream": True,
                    "timeout": args.request_timeout},
        "profile": {"kind": "concurrent", "streams": [c]},
        "constraints": [{"kind": "max_requests", "count": n}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(args.model)},
        # A fixed output length: GuideLLM then sends max_completion_tokens with ignore_eos and stop null.
        "data": [{"kind": "synthetic_text", "prompt_tokens": args.isl, "prompt_tokens_stdev": args.isl_stddev,
                  "prompt_tokens_min": lo, "prompt_tokens_max": args.isl + 3 * args.isl_stddev,
                  "output_tokens": args.osl}],
        "seed": {"kind": "static", "value": args.seed},
        "outputs": [{"kind": "json", "path": str(out / "benchmarks.json")}],
    }}


def _dist(metrics: dict[str, Any], key: str, stat: str) -> float | None:
    d = (metrics.get(key) or {}).get("successful") or {}
    v = d.get("percentiles", {}).get(stat) if stat.startswith("p") else d.get(stat)
    return float(v) if isinstance(v, int | float) else None


def parse_guidellm(path: Path) -> dict[str, Any]:
    """GuideLLM's benchmarks.json: per benchmark, metrics.request_totals {successful, errored,
    incomplete}, distributions split by status, and sampled requests per status."""
    bench = json.loads(path.read_text())["benchmarks"][0]
    m = bench["metrics"]
    totals = m["request_totals"]
    errored = bench.get("requests", {}).get("errored") or []
    summary = [json.dumps({"error": r.get("info", {}).get("error") or r.get("error"),
                           "request_args": r.get("request_args")})[:1500] for r in errored[:5]]
    return {
        "requests": int(totals["successful"]),
        "errors": int(totals["errored"]),
        "output_tok_s": _dist(m, "output_tokens_per_second", "mean"),
        "ttft_p50_ms": _dist(m, "time_to_first_token_ms", "p50"),
        "itl_p50_ms": _dist(m, "inter_token_latency_ms", "p50"),
        "itl_p99_ms": _dist(m, "inter_token_latency_ms", "p99"),
        "error_summary": summary,
        "extra": {"incomplete": int(totals["incomplete"]),
                  "osl_p50": _dist(m, "output_token_count", "p50"),
                  "isl_p50": _dist(m, "prompt_token_count", "p50")},
    }


def run_guidellm(args: argparse.Namespace, server: Server, name: str, c: int, n: int) -> ClientRun:
    out = args.out / "guidellm" / f"{server.name}-c{c}"
    out.mkdir(parents=True, exist_ok=True)
    scenario = out / "scenario.json"
    scenario.write_text(json.dumps(guidellm_scenario(args, server, name, c, n, out), indent=1))
    argv = [str(args.clients_venv / "bin" / "guidellm"), "run", "--scenario", str(scenario),
            "--disable-console-interactive"]
    rc, wall = run_client(argv, out / "guidellm.log", args.client_timeout)
    run = ClientRun("guidellm", server.name, c, 0, -1, None, None, None, None, wall, rc, str(out))
    try:
        parsed = parse_guidellm(out / "benchmarks.json")
    except (OSError, ValueError, KeyError, IndexError) as e:
        run.error_summary = [f"no GuideLLM export ({e!r}); rc {rc}; see {out / 'guidellm.log'}"]
        return run
    for k, v in parsed.items():
        setattr(run, k, v)
    if parsed["extra"]["incomplete"]:
        run.error_summary.append(f"{parsed['extra']['incomplete']} incomplete requests")
    if rc != 0:
        run.error_summary.append(f"guidellm exited {rc}; see {out / 'guidellm.log'}")
    return run


def failed(run: ClientRun) -> bool:
    return run.rc != 0 or run.errors != 0 or bool(run.extra.get("incomplete"))


def _f(v: float | None, width: int, digits: int = 1) -> str:
    return f"{v:{width}.{digits}f}" if v is not None else " " * (width - 1) + "-"


def table(runs: list[ClientRun]) -> str:
    head = (f"{'client':8s} {'server':7s} {'conc':>4s} | {'req':>4s} {'err':>4s} | {'out tok/s':>9s} "
            f"{'TTFT p50':>9s} {'ITL p50':>8s} {'ITL p99':>8s} | "
            f"{'tok/s x':>7s} {'TTFT x':>7s} {'ITL50 x':>7s}")
    lines = [head, "-" * len(head)]
    order = {name: i for i, name in enumerate(SERVERS)}
    for r in sorted(runs, key=lambda r: (r.client != "aiperf", r.concurrency, order[r.server])):
        base = next((b for b in runs if b.client == r.client and b.concurrency == r.concurrency
                     and b.server == "mlx_lm"), None)
        ratios = ""
        if base is not None and r.server != "mlx_lm":
            def ratio(a: float | None, b: float | None) -> float | None:
                return a / b if a is not None and b else None
            ratios = (f" | {_f(ratio(r.output_tok_s, base.output_tok_s), 7, 2)} "
                      f"{_f(ratio(r.ttft_p50_ms, base.ttft_p50_ms), 7, 2)} "
                      f"{_f(ratio(r.itl_p50_ms, base.itl_p50_ms), 7, 2)}")
        err = f"{r.errors:4d}" if r.errors >= 0 else "   ?"
        lines.append(f"{r.client:8s} {r.server:7s} {r.concurrency:4d} | {r.requests:4d} {err} | "
                     f"{_f(r.output_tok_s, 9)} {_f(r.ttft_p50_ms, 9)} {_f(r.itl_p50_ms, 8)} "
                     f"{_f(r.itl_p99_ms, 8)}{ratios}")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="model dir (default: benchlib's 2.4M llama)")
    parser.add_argument("--servers", default="mlx_lm,single,cluster", help="subset of mlx_lm,single,cluster")
    parser.add_argument("--concurrency", type=_int_list, default=[1, 8], help="comma list (default 1,8)")
    parser.add_argument("--isl", type=int, default=256, help="prompt tokens, mean (default 256)")
    parser.add_argument("--isl-stddev", type=int, default=96,
                        help="prompt tokens, stddev (> 0: mixed lengths)")
    parser.add_argument("--osl", type=int, default=64, help="output tokens per request (ignore_eos)")
    parser.add_argument("--requests-per-slot", type=int, default=6,
                        help="requests per run = max(--min-requests, this x concurrency)")
    parser.add_argument("--min-requests", type=int, default=24)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--guidellm", action="store_true", help="also drive --guidellm-servers with GuideLLM")
    parser.add_argument("--guidellm-servers", default="cluster", help="default: the router only")
    parser.add_argument("--blas", choices=["auto", "openblas", "bundled", "defaults"],
                        default=os.environ.get("STATECORE_BLAS", "auto"), help="as side_by_side.py's --blas")
    parser.add_argument("--statecore-arg", action="append", default=[],
                        help="extra flag for the statecore servers (repeatable)")
    parser.add_argument("--clients-venv", type=Path, default=CLIENTS_VENV)
    parser.add_argument("--request-timeout", type=float, default=300.0, help="per request, seconds")
    parser.add_argument("--client-timeout", type=float, default=900.0, help="per client run, seconds")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "load_clients")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # run `finally`

    names = [n for n in args.servers.split(",") if n]
    g_names = [n for n in args.guidellm_servers.split(",") if n] if args.guidellm else []
    if unknown := (set(names) | set(g_names)) - set(SERVERS):
        raise SystemExit(f"unknown servers {sorted(unknown)}")
    if missing := set(g_names) - set(names):
        raise SystemExit(f"--guidellm-servers {sorted(missing)} not in --servers")
    if args.isl_stddev <= 0:
        print("note: --isl-stddev 0 sends prompts of one length", flush=True)
    ensure_clients(args.clients_venv, args.guidellm)
    args.model = (args.model or default_model()).resolve()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    blas = server_env(args.blas)[1]
    meta: dict[str, Any] = {"model": str(args.model), "blas": blas, "argv": sys.argv,
                            "started_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                            "clients": subprocess.run(
                                [str(args.clients_venv / "bin" / "python"), "-m", "pip", "list"],
                                capture_output=True, text=True).stdout.splitlines()}
    git = ["git", "-C", str(ROOT)]
    meta["git_head"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True,
                                      text=True).stdout.strip()
    # The servers run this work tree's src/: say when it differs from the commit.
    meta["src_changed"] = subprocess.run([*git, "status", "--porcelain", "src"], capture_output=True,
                                         text=True).stdout.splitlines()[:20]
    meta["clients"] = [x for x in meta["clients"]
                       if x.split(" ")[0].lower() in ("aiperf", "guidellm", "torch")]
    print(f"model {args.model}\nBLAS {blas}  servers {names}  concurrency {args.concurrency}  "
          f"prompts {args.isl}±{args.isl_stddev} tokens, {args.osl} out  clients {meta['clients']}",
          flush=True)

    servers = make_servers(args.model, args.out, names, args.statecore_arg)
    runs: list[ClientRun] = []
    t0 = time.monotonic()

    def record(run: ClientRun) -> None:
        runs.append(run)
        print(f"  {run.client:8s} {run.server:7s} c={run.concurrency:<3d} {run.wall_s:5.0f} s: "
              f"{run.requests} ok, {run.errors} errors, {_f(run.output_tok_s, 1)} tok/s, "
              f"TTFT p50 {_f(run.ttft_p50_ms, 1)} ms" + (f"  {run.error_summary[:2]}" if failed(run) else ""),
              flush=True)
        (args.out / "results.json").write_text(json.dumps({"meta": meta, "runs": [asdict(r) for r in runs]},
                                                          indent=1))

    try:
        start_all(servers, args.blas, args.startup_timeout, meta)
        meta["startup_s"] = time.monotonic() - t0
        print(f"servers ready in {meta['startup_s']:.0f} s: "
              + ", ".join(f"{s.name} {s.url}" for s in servers), flush=True)
        model_names = {s.name: served_model(s, args.model) for s in servers}
        for i, c in enumerate(args.concurrency):
            n = max(args.min_requests, args.requests_per_slot * c)
            for s in (servers if i % 2 == 0 else servers[::-1]):
                record(run_aiperf(args, s, model_names[s.name], c, n))
        for c in args.concurrency:
            n = max(args.min_requests, args.requests_per_slot * c)
            for s in servers:
                if s.name in g_names:
                    record(run_guidellm(args, s, model_names[s.name], c, n))
    finally:
        for s in servers:
            s.stop()
    meta["wall_s"] = time.monotonic() - t0
    text = table(runs)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "runs": [asdict(r) for r in runs]},
                                                      indent=1))
    (args.out / "table.txt").write_text(text + "\n")
    print("\n" + text)
    print(f"\nms for TTFT and ITL; x = statecore / mlx_lm.server, same client and concurrency. "
          f"Total {meta['wall_s']:.0f} s. Wrote {args.out}/results.json, table.txt")
    bad = [r for r in runs if r.server in STATECORE and failed(r)]
    for r in bad:
        print(f"FAILED {r.client} {r.server} c={r.concurrency}: {r.errors} errors, rc {r.rc}",
              file=sys.stderr)
        for e in r.error_summary:
            print(f"    {e}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
