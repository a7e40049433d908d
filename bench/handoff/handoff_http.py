"""KV handoff per request over the real HTTP pull, against a raw loopback socket in the same run.

(The whole-payload pull, `--kv-handoff pull`; `bench/handoff/handoff_overhead.py` measures the streamed
handoff against it and against one node.)

Starts a prefill node, a decode node and a router as separate `statecore run` processes on
127.0.0.1 (the router with --force-disaggregation, so every request hands its KV off), sends
completions of several prompt lengths through the router's /v1/completions, then reads each
node's `GET /internal/handoffs` records and joins them by request id. For every request it then
pushes the same number of bytes through a raw TCP socket on 127.0.0.1 (a sender thread's
`sendall`, the receiver `recv_into` a preallocated buffer: no HTTP, no framing, no checksum) and
prints one row per request: wire bytes, raw tensor bytes and their ratio, encode ms (prefill
node: `export_held`), first-byte / transfer / body ms (decode node: GET sent -> response head /
last byte; response head -> last byte), install ms, the transfer's and the body's MB/s, the
loopback's MB/s and the ratios; then medians and whether the targets hold (body throughput at
least 50% of loopback; wire bytes at most 1.01x the raw tensor bytes).

With `--background-streams N`, N streaming completions decode on the decode node the whole
time (short prompts, restarted when they end); each token's arrival is timed, and for every
handoff the longest gap between two tokens of any stream that overlaps the decode node's part
of it (the body in flight and the install: [last byte - body, last byte + install], from the
decode node's record) is reported in steps, a step being the median gap while no measured
request is in flight. The engine issue's target: an 8,000-token handoff stalls no running row
longer than one step (a gap of at most 2 steps).

    .venv/bin/python bench/handoff/handoff_http.py --lengths 128 2000 8000 --background-streams 8

    .venv/bin/python bench/handoff/handoff_http.py                         # CPU: tiny llama, ~1 min
    .venv/bin/python bench/handoff/handoff_http.py --model /tmp/llama1b    # a real checkpoint (GPU)
    .venv/bin/python bench/handoff/handoff_http.py --out handoff.json --lengths 128 512 2000 --per-length 3

The default model is a random-weight llama (hidden 256, 4 layers, head dim 16, 8 KV heads,
context 4,096: 4 KiB of float32 KV per token) built once by `support.tiny_models.cached_checkpoint`.
Bench code: it may import anything, and nothing under src/ may import it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import os
import platform
import secrets
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.e2e.harness (the e2e tests' node launcher), support/
sys.path.insert(0, str(ROOT / "src"))
from tests.e2e.harness import Node  # noqa: E402

from support.tiny_models import CORPUS, cached_checkpoint  # noqa: E402

TOKEN_HEADER = "X-Statecore-Token"
BODY_TARGET = 0.5  # body throughput / loopback throughput
WIRE_TARGET = 1.01  # wire bytes / raw tensor bytes


STALL_TARGET_STEPS = 2.0  # the longest gap overlapping a handoff, in median steps


@dataclass(frozen=True, slots=True)
class Row:
    request_id: str
    prompt_tokens: int
    wire_bytes: int
    raw_bytes: int | None
    encode_ms: float
    first_byte_ms: float
    transfer_ms: float  # GET sent -> last byte, on the decode node
    body_ms: float  # response head -> last byte
    install_ms: float
    request_ms: float  # the client's whole completion, through the router
    loopback_ms: float  # median over --loopback-reps of the same byte count on raw TCP
    stall_steps: float | None = None  # with background streams: the longest overlapping gap / a step

    @property
    def wire_ratio(self) -> float | None:
        return self.wire_bytes / self.raw_bytes if self.raw_bytes else None

    def mb_s(self, ms: float) -> float:
        return self.wire_bytes / 1e6 / (ms / 1e3) if ms > 0 else float("inf")

    @property
    def transfer_mb_s(self) -> float:
        return self.mb_s(self.transfer_ms)

    @property
    def body_mb_s(self) -> float:
        return self.mb_s(self.body_ms)

    @property
    def loopback_mb_s(self) -> float:
        return self.mb_s(self.loopback_ms)


# --------------------------------------------------------------------------- the raw baseline


class Loopback:
    """A TCP listener on 127.0.0.1; `median_ms(n)` times n bytes from the sender's first
    `sendall` to the receiver's last `recv_into`, on a fresh connection each time (connecting is
    not timed), the same way for every request."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]

    def close(self) -> None:
        self.listener.close()

    def once_s(self, payload: bytes, sink: memoryview) -> float:
        sender = socket.create_connection(("127.0.0.1", self.port))
        receiver, _ = self.listener.accept()
        go = threading.Event()

        def send() -> None:
            go.wait()
            sender.sendall(payload)

        thread = threading.Thread(target=send)
        thread.start()
        with sender, receiver:
            size = len(payload)
            start = time.perf_counter()
            go.set()
            got = 0
            while got < size:
                n = receiver.recv_into(sink[got:], size - got)
                if n == 0:
                    raise ConnectionError("loopback closed early")
                got += n
            elapsed = time.perf_counter() - start
            thread.join()
        return elapsed

    def median_ms(self, nbytes: int, reps: int) -> float:
        payload = os.urandom(nbytes)
        sink = memoryview(bytearray(nbytes))
        self.once_s(payload, sink)  # warm up
        return statistics.median(self.once_s(payload, sink) for _ in range(reps)) * 1e3


# --------------------------------------------------------------------------- the cluster


def wait_healthy(node: Node, timeout_s: float) -> None:
    """The harness's check, ending the bench with the node's log tail rather than a traceback."""
    try:
        node.wait_healthy(timeout_s)
    except AssertionError as exc:
        raise SystemExit(str(exc)) from None


def start_cluster(model: Path, logs: Path, token: str, extra: list[str]) -> dict[str, Node]:
    common = ["--model", str(model), "--internal-token", token, *extra]
    nodes = {role: Node(role, common, logs / f"{role}.log") for role in ("prefill", "decode")}
    for node in nodes.values():
        node.start()
    for node in nodes.values():
        wait_healthy(node, 900)
    router_args = ["--model", str(model), "--internal-token", token, "--force-disaggregation",
                   "--kv-handoff", "pull", "--prefill", nodes["prefill"].url, "--decode", nodes["decode"].url]
    router = Node("router", router_args, logs / "router.log")
    router.start()
    wait_healthy(router, 300)
    return {**nodes, "router": router}


# --------------------------------------------------------------------------- background streams


class BackgroundStreams:
    """`count` streaming completions through the router, each restarted when it ends, every
    token's arrival time (wall clock, as the nodes' records) kept per stream; `stop` ends them."""

    def __init__(self, router: str, prompt: list[int], count: int, max_tokens: int) -> None:
        self.router, self.prompt, self.max_tokens = router, prompt, max_tokens
        self.arrivals: list[list[float]] = [[] for _ in range(count)]
        # the same arrivals by request id (the nodes' `/internal/token_times` name them so)
        self.by_request: dict[str, list[float]] = {}
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]

    def start(self, warm_tokens: int = 8) -> None:
        for thread in self.threads:
            thread.start()
        deadline = time.monotonic() + 600
        while any(len(a) < warm_tokens for a in self.arrivals):  # every stream is decoding
            if time.monotonic() > deadline:
                raise SystemExit("the background streams did not start decoding within 600 s")
            time.sleep(0.05)

    def stop(self) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(timeout=60)

    def _run(self, index: int) -> None:
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=900) as client:
            while not self.done.is_set():
                rid = f"bg{index}-{time.monotonic_ns()}"
                mine = self.by_request.setdefault(rid, [])
                with client.stream("POST", f"{self.router}/v1/completions", json=body,
                                   headers={"X-Request-Id": rid}) as response:
                    if response.status_code != 200:
                        raise SystemExit(f"background stream {index}: HTTP {response.status_code}")
                    for line in response.iter_lines():
                        if self.done.is_set():
                            return
                        if line.startswith("data:") and '"text"' in line:
                            now = time.time()
                            self.arrivals[index].append(now)
                            mine.append(now)
                # a new request: its first token waits for a prefill, not a step of the batch
                self.arrivals[index].append(float("nan"))

    def gaps(self) -> list[tuple[float, float]]:
        """Every (start, end) between two tokens of one stream (not across a restart)."""
        out = []
        for times in self.arrivals:
            out.extend((a, b) for a, b in itertools.pairwise(times) if not (math.isnan(a) or math.isnan(b)))
        return out


def stall_steps(gaps: list[tuple[float, float]], window: tuple[float, float], step_s: float) -> float:
    """The longest gap overlapping `window`, in steps (0 when none overlaps)."""
    start, end = window
    overlapping = [b - a for a, b in gaps if b > start and a < end]
    return max(overlapping, default=0.0) / step_s


def quiet_step_s(gaps: list[tuple[float, float]], busy: list[tuple[float, float]]) -> float:
    """The median gap outside every measured request's time (the batch's plain step)."""
    quiet = [b - a for a, b in gaps if not any(b > s and a < e for s, e in busy)]
    if not quiet:
        raise SystemExit("no token gap fell outside the measured requests: run longer streams")
    return statistics.median(quiet)


# --------------------------------------------------------------------------- requests


def prompt_pool(model: Path, need: int) -> list[int]:
    """Token ids of the tiny corpus in this model's tokenizer, repeated until there are `need`."""
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    ids: list[int] = tokenizer.encode(CORPUS).ids
    if not ids:
        raise SystemExit(f"{model}: the tokenizer gives no ids for the corpus")
    return (ids * (need // len(ids) + 1))[:need]


def complete(client: httpx.Client, router: str, request_id: str, prompt: list[int], max_tokens: int,
             busy: list[tuple[float, float]] | None = None) -> float:
    """One completion through the router; its wall-clock span goes into `busy` when given."""
    wall = time.time()
    start = time.perf_counter()
    response = client.post(
        f"{router}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0},
        headers={"X-Request-Id": request_id},
    )
    elapsed = time.perf_counter() - start
    if busy is not None:
        busy.append((wall, wall + elapsed))
    if response.status_code != 200:
        raise SystemExit(f"request {request_id}: HTTP {response.status_code}: {response.text[:500]}")
    return elapsed


def records(client: httpx.Client, node: Node, token: str) -> dict[str, dict[str, Any]]:
    response = client.get(f"{node.url}/internal/handoffs", headers={TOKEN_HEADER: token})
    response.raise_for_status()
    return {r["request_id"]: r for r in response.json()["records"]}


def _ms(value: object, what: str, rid: str) -> float:
    if not isinstance(value, int | float):
        raise SystemExit(f"request {rid}: no {what} in the handoff records (got {value!r})")
    return float(value) * 1e3


# --------------------------------------------------------------------------- report


def machine() -> str:
    return (f"{platform.platform()}, {os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), "
            f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}")


def table(rows: list[Row]) -> str:
    head = ("| request | tokens | wire bytes | raw bytes | wire/raw | encode ms | first byte ms "
            "| transfer ms | body ms | install ms | transfer MB/s | body MB/s | loopback MB/s "
            "| transfer/loop | body/loop | stall steps |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        ratio = f"{r.wire_ratio:.4f}" if r.wire_ratio is not None else "-"
        raw = f"{r.raw_bytes:,}" if r.raw_bytes is not None else "-"
        lines.append(
            f"| {r.request_id} | {r.prompt_tokens} | {r.wire_bytes:,} | {raw} | {ratio} | {r.encode_ms:.2f} "
            f"| {r.first_byte_ms:.2f} | {r.transfer_ms:.2f} | {r.body_ms:.2f} | {r.install_ms:.2f} "
            f"| {r.transfer_mb_s:,.0f} | {r.body_mb_s:,.0f} | {r.loopback_mb_s:,.0f} "
            f"| {r.transfer_mb_s / r.loopback_mb_s:.2f} | {r.body_mb_s / r.loopback_mb_s:.2f} "
            f"| {'-' if r.stall_steps is None else f'{r.stall_steps:.2f}'} |"
        )
    return "\n".join(lines)


def summary(rows: list[Row]) -> dict[str, Any]:
    by_length: dict[str, Any] = {}
    for tokens in sorted({r.prompt_tokens for r in rows}):
        some = [r for r in rows if r.prompt_tokens == tokens]

        def med(values: list[float]) -> float:
            return statistics.median(values)

        by_length[str(tokens)] = {
            "requests": len(some),
            "wire_bytes": med([r.wire_bytes for r in some]),
            "encode_ms": med([r.encode_ms for r in some]),
            "transfer_ms": med([r.transfer_ms for r in some]),
            "body_ms": med([r.body_ms for r in some]),
            "install_ms": med([r.install_ms for r in some]),
            "transfer_mb_s": med([r.transfer_mb_s for r in some]),
            "body_mb_s": med([r.body_mb_s for r in some]),
            "loopback_mb_s": med([r.loopback_mb_s for r in some]),
            "transfer_over_loopback": med([r.transfer_mb_s / r.loopback_mb_s for r in some]),
            "body_over_loopback": med([r.body_mb_s / r.loopback_mb_s for r in some]),
            "stall_steps_max": max((r.stall_steps for r in some if r.stall_steps is not None), default=None),
        }
    ratios = [r.wire_ratio for r in rows if r.wire_ratio is not None]
    body = statistics.median(r.body_mb_s / r.loopback_mb_s for r in rows)
    return {
        "by_length": by_length,
        "body_over_loopback_median": body,
        "transfer_over_loopback_median": statistics.median(r.transfer_mb_s / r.loopback_mb_s for r in rows),
        "wire_over_raw_max": max(ratios) if ratios else None,
        "body_target_met": body >= BODY_TARGET,
        "wire_target_met": bool(ratios) and max(ratios) <= WIRE_TARGET,
    }


def print_summary(s: dict[str, Any]) -> None:
    print("\n| tokens | n | wire bytes | encode ms | transfer ms | body ms | install ms | transfer MB/s "
          "| body MB/s | loopback MB/s | transfer/loop | body/loop |")
    print("|" + "---|" * 12)
    for tokens, m in s["by_length"].items():
        print(f"| {tokens} | {m['requests']} | {m['wire_bytes']:,.0f} | {m['encode_ms']:.2f} "
              f"| {m['transfer_ms']:.2f} | {m['body_ms']:.2f} | {m['install_ms']:.2f} "
              f"| {m['transfer_mb_s']:,.0f} | {m['body_mb_s']:,.0f} | {m['loopback_mb_s']:,.0f} "
              f"| {m['transfer_over_loopback']:.2f} | {m['body_over_loopback']:.2f} |")
    wire = s["wire_over_raw_max"]
    print(f"\nbody throughput / loopback (median over requests): {s['body_over_loopback_median']:.2f} "
          f"-> target >= {BODY_TARGET:.0%}: {'met' if s['body_target_met'] else 'NOT met'}")
    print(f"transfer (GET sent -> last byte) / loopback (median): {s['transfer_over_loopback_median']:.2f}")
    if wire is not None:
        print(f"wire / raw tensor bytes (max): {wire:.4f} -> target <= {WIRE_TARGET}: "
              f"{'met' if s['wire_target_met'] else 'NOT met'}")
    if s.get("step_ms") is not None:
        print(f"background streams: a step (median quiet gap) {s['step_ms']:.2f} ms")
        for tokens, m in s["by_length"].items():
            steps = m["stall_steps_max"]
            print(f"  {tokens}-token handoffs: longest overlapping gap {steps:.2f} steps -> target <= "
                  f"{STALL_TARGET_STEPS:g}: {'met' if steps <= STALL_TARGET_STEPS else 'NOT met'}")


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the tiny llama)")
    parser.add_argument("--hidden-size", type=int, default=256, help="tiny llama only")
    parser.add_argument("--num-layers", type=int, default=4, help="tiny llama only")
    parser.add_argument("--dtype", default="float32", help="tiny llama only")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2000])
    parser.add_argument("--per-length", type=int, default=3, help="requests per prompt length")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens per completion (>= 2: install)")
    parser.add_argument("--loopback-reps", type=int, default=5)
    parser.add_argument("--node-arg", action="append", default=[],
                        help="extra argument for the prefill and decode nodes (repeatable)")
    parser.add_argument("--background-streams", type=int, default=0,
                        help="streams decoding on the decode node throughout (the stall measure)")
    parser.add_argument("--background-max-tokens", type=int, default=1000,
                        help="each background stream's max_tokens (it restarts when done)")
    parser.add_argument("--logs", type=Path, help="keep the nodes' logs here (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="also write the rows and the summary here as JSON")
    args = parser.parse_args(argv)
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2, or the decode node never installs the KV")

    model: Path = args.model or cached_checkpoint(
        "llama", dtype=args.dtype, hidden_size=args.hidden_size, num_layers=args.num_layers)
    started = dt.datetime.now(dt.UTC)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="handoff_http_"))
    logs.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    plan = [(n, i) for n in args.lengths for i in range(args.per_length)]
    pool = prompt_pool(model, max(args.lengths) + len(plan) + 1)
    print(f"# KV handoff over HTTP: model {model}; lengths {args.lengths} x {args.per_length}, "
          f"max_tokens {args.max_tokens}; loopback medians of {args.loopback_reps}")
    print(f"# {machine()}; {started:%Y-%m-%d %H:%M} UTC; logs {logs}")

    servers: dict[str, Node] = {}
    loopback = Loopback()
    background: BackgroundStreams | None = None
    busy: list[tuple[float, float]] = []
    step_s: float | None = None
    try:
        print("starting prefill, decode and router ...", file=sys.stderr, flush=True)
        servers = start_cluster(model, logs, token, args.node_arg)
        router = servers["router"].url
        timings: dict[str, tuple[int, float]] = {}
        with httpx.Client(timeout=900) as client:
            complete(client, router, "warmup", pool[: min(args.lengths)], args.max_tokens)  # not counted
            if args.background_streams > 0:
                background = BackgroundStreams(router, pool[:32], args.background_streams,
                                               args.background_max_tokens)
                background.start()
                time.sleep(2.0)  # quiet gaps before the first measured request: the step's baseline
            for k, (tokens, i) in enumerate(tqdm(plan, desc="requests", unit="req")):
                rid = f"h{tokens}-{i}"
                prompt = pool[k + 1 : k + 1 + tokens]  # each request its own window of the corpus
                timings[rid] = (tokens, complete(client, router, rid, prompt, args.max_tokens, busy))
            if background is not None:
                background.stop()
                step_s = quiet_step_s(background.gaps(), busy)
            sent = records(client, servers["prefill"], token)
            got = records(client, servers["decode"], token)

        rows: list[Row] = []
        for rid, (tokens, request_s) in tqdm(timings.items(), desc="loopback", unit="req"):
            out, into = sent.get(rid), got.get(rid)
            if out is None or into is None:
                raise SystemExit(f"request {rid}: no handoff record (prefill {out}, decode {into})")
            if out["wire_bytes"] != into["wire_bytes"]:
                raise SystemExit(
                    f"request {rid}: served {out['wire_bytes']} bytes, received {into['wire_bytes']}")
            wire = int(into["wire_bytes"])
            stall = None
            if background is not None and step_s is not None:
                # the decode node's record opens as the pull's last byte lands
                landed = float(into["opened_at"])
                window = (landed - float(into["body_s"]), landed + float(into["install_s"]))
                stall = stall_steps(background.gaps(), window, step_s)
            rows.append(Row(
                request_id=rid, prompt_tokens=tokens, wire_bytes=wire, raw_bytes=out["raw_bytes"],
                encode_ms=_ms(out["encode_s"], "encode_s", rid),
                first_byte_ms=_ms(into["first_byte_s"], "first_byte_s", rid),
                transfer_ms=_ms(into["transfer_s"], "transfer_s", rid),
                body_ms=_ms(into["body_s"], "body_s", rid),
                install_ms=_ms(into["install_s"], "install_s", rid),
                request_ms=request_s * 1e3,
                loopback_ms=loopback.median_ms(wire, args.loopback_reps),
                stall_steps=stall,
            ))
    finally:
        if background is not None:
            background.stop()
        loopback.close()
        codes = {role: server.stop() for role, server in servers.items()}
        if any(code not in (0, None) for code in codes.values()):
            print(f"servers exited uncleanly: {codes} (logs in {logs})", file=sys.stderr)

    print(table(rows))
    result = summary(rows)
    result["step_ms"] = None if step_s is None else step_s * 1e3
    print_summary(result)
    if args.out is not None:
        report = {
            "machine": machine(), "date": started.isoformat(), "model": str(model), "argv": sys.argv,
            "rows": [{**asdict(r), "wire_ratio": r.wire_ratio, "transfer_mb_s": r.transfer_mb_s,
                      "body_mb_s": r.body_mb_s, "loopback_mb_s": r.loopback_mb_s} for r in rows],
            "summary": result,
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
