"""What a handoff costs a request: streamed against pulled KV, and the cluster against one node.

Starts one prefill and one decode node, three routers in front of that same pair (`--kv-handoff
stream`, `stream-via-decode` as the setup `chained`, and `pull`, all `--force-disaggregation`) and a single
node, each engine process pinned to its own cores (`--cpus`: prefill, decode, single; the single
node gets the prefill node's cores, so it has the hardware of one cluster node; the routers and
this process, the clients, go there too, so the decode node's cores are its own). It sends prompts
of each --lengths one at a time (concurrency 1), alternating single / stream / chained / pull with a fresh
prompt per round, streaming the answer (--max-tokens), and reports per setup and length, medians:

- TTFT as the client sees it, and the cluster's over the single node's (target <= 1.10);
- the handoff's overhead: the prefill node's "prefill done" to the decode node's "joined the
  batch" (`GET /internal/handoffs` on both: one host's wall clock), against the prefill's own time
  (target <= 10 % at >= 2,000 tokens);
- the gap between the first and the second token at the client, in the request's own decode
  steps (the median gap of its later tokens; target <= 3);
- for the stream, the share of the KV bytes that reached the decode node before the first token.

With --background-streams N, N streams decode on the decode node throughout (through the stream
router, short prompts, restarted when they end), and each handoff's longest gap of theirs that
overlaps [prefill done, joined the batch + 1 s] is reported in their median quiet step (target:
the longest within one step of the median, i.e. <= 2 steps), and in their median step during the
second after the join ("stall, joined steps"): the batch's usual step once the long request
decodes in it, which is longer than the quiet one (its attention reads the long prompt), so that
the first unit counts a bigger batch as a stall and the second does not.

Where those gaps are made: after the run every node's `GET /internal/token_times` gives the same
streams' tokens at each hop (the decode node's loop applying a step's tokens, its writer taking the
line; the stream router's loop and writer; the client), and `hop_gaps.py` reports, per hop, p99 and
max of their gaps inside the windows and outside them (those outside split by whether a prompt was
waiting for its first token, i.e. prefilling on the clients' core), in the decode engine's step, and
each window's stall in joined steps. `--engine-nice-alternate N` runs odd rounds with the engine
nodes beside the clients at nice N and reports the hops for each value. A pull's overhead is also
given in its parts, from the two nodes' records: the GET to its head (the export in it), the body,
the install, and the rest (the first token's way through the router, the decode node's admission).

    .venv/bin/python bench/handoff/handoff_overhead.py                          # CPU: 23 M llama, 2 cores
    .venv/bin/python bench/handoff/handoff_overhead.py --lengths 8000 --background-streams 16 \\
        --max-tokens 8 --gpus 0 0 0 --model /tmp/llama1b \\
        --decode-arg=--kv-memory-bytes=17179869184             # the GPU stall cell (slots of 8,192)

Bench code: it may import anything (handoff_http's loopback and background streams, the e2e
harness's node launcher), and nothing under src/ may import it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import itertools
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib

from benchlib import node_env, parse_cpus, with_context
from handoff_http import (
    BackgroundStreams,
    machine,
    prompt_pool,
    records,
    stall_steps,
    wait_healthy,
)
from hop_gaps import by_hop, node_hops, within
from hop_gaps import table as hop_table
from tests.e2e.harness import Node

from support.tiny_models import cached_checkpoint

SETUPS = ("single", "stream", "chained", "pull")
# each cluster setup's router: `chained` is the stream the decode node asks for (one hop more
# before the prefill starts), `stream` the one the router starts itself
HANDOFF_MODES = {"stream": "stream", "chained": "stream-via-decode", "pull": "pull"}
OVERHEAD_TARGET = 0.10
GAP_TARGET_STEPS = 3.0
TTFT_TARGET = 1.10


@dataclass(frozen=True, slots=True)
class Sample:
    setup: str
    tokens: int
    request_id: str
    ttft_s: float
    second_gap_s: float  # the client's first -> second token
    step_s: float  # the median gap of the request's later tokens
    prefill_s: float | None = None
    overhead_s: float | None = None  # prefill done -> joined the decode node's batch
    overlap: float | None = None
    stall_steps: float | None = None  # the longest gap in the window, in quiet steps
    stall_joined_steps: float | None = None  # the same gap, in the batch's steps after the join
    node_gap_s: float | None = None  # the decode node's own: first token passed on -> second out
    # the overhead's two parts, streamed only: prefill done -> the first token reached the decode
    # node, and the install (`Engine.install_segments`: queueing on the device thread included)
    reach_s: float | None = None
    install_s: float | None = None
    # a pull's parts: the prefill node's export (device-thread queueing included), the decode
    # node's GET to the response head (the export inside it) and head to the last byte
    encode_s: float | None = None
    first_byte_s: float | None = None
    body_s: float | None = None

    @property
    def gap_steps(self) -> float:
        return self.second_gap_s / self.step_s


def pin(node: Node, cores: str | None) -> None:
    """Every thread of the node's process onto `cores` (threads it starts later inherit it)."""
    if not cores or node.process is None:
        return
    for task in Path(f"/proc/{node.process.pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that just ended
            os.sched_setaffinity(int(task.name), parse_cpus(cores))


def beside_clients(args: argparse.Namespace) -> list[str]:
    """The engine nodes that share a core with the routers and the clients (all of them when
    unpinned): those --engine-nice puts behind them. A node on cores of its own keeps nice 0: on a
    shared box a lower priority would lend its core to other people's processes."""
    if args.cpus is None:
        return ["prefill", "decode", "single"]
    clients = parse_cpus(args.clients_cpus or args.cpus[0])
    return [role for role, cores in zip(("prefill", "decode", "single"), args.cpus, strict=True)
            if parse_cpus(cores) & clients]


def renice(node: Node, nice: int, *, force: bool = False) -> None:
    """Every thread of the node's process at `nice` (Linux keeps a nice value per thread; threads
    it starts later inherit their starter's); 0 leaves it as it is unless `force`."""
    if (not nice and not force) or node.process is None:
        return
    for task in Path(f"/proc/{node.process.pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.setpriority(os.PRIO_PROCESS, int(task.name), nice)


def start_on(node: Node, cores: str | None, gpu: str | None) -> Node:
    """Start the node with its GPU and its BLAS threads (one per core) in its environment
    (`disagg_equal.node_env`), pinned to `cores` from its first moment."""
    extra = node_env({}, cores, gpu)
    saved = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        node.start()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    pin(node, cores)
    return node


def start(model: Path, logs: Path, token: str, args: argparse.Namespace) -> dict[str, Node]:
    cpus = args.cpus or [None, None, None]
    gpus = args.gpus or [None, None, None]
    # no prefix cache: the streamed and the pulled setup send the same prompt to one prefill node,
    # and the second would measure a hit instead of a prefill
    logging = ["--log-level", "INFO", "--log-transitions"] if args.transitions else []
    common = ["--model", str(model), "--internal-token", token, "--prefix-cache-bytes=0",
              *logging, *args.node_arg]
    own = {"decode": args.decode_arg, "prefill": args.prefill_arg}
    engines = {role: start_on(Node(role, [*common, *own.get(role, [])],
                                   logs / f"{role}.log"), cpus[i], gpus[i])
               for i, role in enumerate(("prefill", "decode", "single"))}
    for i, (role, node) in enumerate(engines.items()):
        nice = args.engine_nice if role in beside_clients(args) else 0
        renice(node, nice)
        wait_healthy(node, args.startup_timeout)
        pin(node, cpus[i])  # and the threads it started meanwhile
        renice(node, nice)
    routers: dict[str, Node] = {}
    for setup, mode in HANDOFF_MODES.items():
        routers[setup] = Node("router", ["--model", str(model), "--internal-token", token,
                                         "--force-disaggregation", "--kv-handoff", mode,
                                         "--prefill", engines["prefill"].url,
                                         "--decode", engines["decode"].url, *logging],
                              logs / f"router-{setup}.log")
        routers[setup].start()
    for node in routers.values():
        wait_healthy(node, 300)
        # the routers (and this process, the clients: see main) beside the prefill node, whose
        # core is idle once its prefill is done: the decode node's core is its own in the window
        pin(node, args.clients_cpus or cpus[0])
    return {**engines, **routers}


def streamed(client: httpx.Client, url: str, request_id: str, prompt: list[int],
             max_tokens: int, texts: dict[str, str] | None = None,
             waits: list[tuple[float, float]] | None = None) -> tuple[float, list[float]]:
    """(seconds to the first token, every token's arrival after the request was sent); the
    streamed text into `texts[request_id]`, the wait for its first token (wall clock: its prefill,
    on the routers' and clients' core with the default pinning) into `waits`."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    sent, sent_wall = time.perf_counter(), time.time()
    arrivals: list[float] = []
    pieces: list[str] = []
    with client.stream("POST", f"{url}/v1/completions", json=body,
                       headers={"X-Request-Id": request_id}) as response:
        if response.status_code != 200:
            response.read()
            raise SystemExit(f"{request_id}: HTTP {response.status_code}: {response.text[:400]}")
        for line in response.iter_lines():
            if line.startswith("data:") and '"text"' in line:
                arrivals.append(time.perf_counter() - sent)
                pieces.extend(choice.get("text", "") for choice in json.loads(line[5:])["choices"])
    if texts is not None:
        texts[request_id] = "".join(pieces)
    if waits is not None and arrivals:
        waits.append((sent_wall, sent_wall + arrivals[0]))
    if len(arrivals) < 4:
        raise SystemExit(f"{request_id}: {len(arrivals)} tokens streamed; ask for more (--max-tokens)")
    return arrivals[0], arrivals


def measure(args: argparse.Namespace, servers: dict[str, Node], pool: list[int], token: str,
            background: BackgroundStreams | None, handoff_records: dict[str, Any],
            windows: dict[str, tuple[float, float]], spans: dict[int, list[tuple[float, float]]],
            waits: list[tuple[float, float]]) -> list[Sample]:
    """The samples; both nodes' handoff records (`GET /internal/handoffs`) into `handoff_records`,
    each handoff's window (prefill done -> a second after the join) into `windows`, each round's
    span (wall clock) into `spans` by the engine nodes' nice value in it, each prompt's wait for
    its first token (warm-ups too) into `waits`."""
    samples: list[Sample] = []
    pending: list[tuple[str, int, str, float, list[float]]] = []
    texts: dict[str, str] = {}
    offset = 0
    with httpx.Client(timeout=args.request_timeout) as client:
        # every setup's first request at each length is not counted: compiling its shapes (on a GPU,
        # a first 8,000-token prompt took 4x the next one's time) and growing buffers
        for warm, tokens in itertools.product(SETUPS, args.lengths):
            url = servers["single" if warm == "single" else warm].url
            streamed(client, url, f"warm-{warm}-{tokens}", random.Random(-tokens).choices(pool, k=tokens),
                     args.max_tokens, waits=waits)
        for round_ in range(args.rounds):
            order = SETUPS if round_ % 2 == 0 else tuple(reversed(SETUPS))
            alternate = args.engine_nice_alternate
            nice = alternate if alternate and round_ % 2 else args.engine_nice
            for role in beside_clients(args):
                renice(servers[role], nice, force=bool(args.engine_nice_alternate))
            began = time.time()
            for tokens in args.lengths:
                offset += 1
                # fresh per round, the same for each setup; drawn from the corpus's ids at random, not
                # a window of it: the corpus repeats, so windows would share whole prefix blocks
                prompt = random.Random(offset).choices(pool, k=tokens)
                for setup in order:
                    rid = f"{setup}-{tokens}-{round_}"
                    url = servers["single" if setup == "single" else setup].url
                    ttft, arrivals = streamed(client, url, rid, prompt, args.max_tokens, texts, waits)
                    pending.append((setup, tokens, rid, ttft, arrivals))
            spans.setdefault(nice, []).append((began, time.time()))
        sent = records(client, servers["prefill"], token)
        got = records(client, servers["decode"], token)
    handoff_records.update(prefill=sent, decode=got)
    # greedy: every setup's answer to a prompt is the single node's, byte for byte
    differ = [rid for rid, text in texts.items()
              if not rid.startswith("single-") and text != texts["single-" + rid.split("-", 1)[1]]]
    print(f"# outputs equal to the single node's: {len(texts) - len(differ)} of {len(texts)}"
          + (f"; DIFFER: {differ}" if differ else ""))
    gaps = background.gaps() if background is not None else []
    quiet_step = None
    for setup, tokens, rid, ttft, arrivals in pending:
        later = [b - a for a, b in itertools.pairwise(arrivals[1:])]
        step = statistics.median(later)
        sample = Sample(setup, tokens, rid, ttft, arrivals[1] - arrivals[0], step)
        if setup != "single":
            out, into = sent.get(rid), got.get(rid)
            if out is None or into is None or into.get("installed_at") is None:
                raise SystemExit(f"{rid}: no handoff records (prefill {out}, decode {into})")
            done, joined = float(out["prefill_done_at"]), float(into["installed_at"])
            windows[rid] = (done, joined + 1.0)
            reached = (None if into.get("first_token_s") is None else
                       float(into["opened_at"]) + float(into["first_token_s"]) - done)
            sample = Sample(setup, tokens, rid, ttft, sample.second_gap_s, step,
                            prefill_s=float(out["prefill_s"]), overhead_s=joined - done,
                            overlap=into.get("overlap"), node_gap_s=into.get("first_to_second_s"),
                            reach_s=reached, install_s=into.get("install_s"), encode_s=out.get("encode_s"),
                            first_byte_s=into.get("first_byte_s"), body_s=into.get("body_s"))
        samples.append(sample)
    if background is not None and gaps:
        busy = list(windows.values())
        quiet = [b - a for a, b in gaps if not any(b > s and a < e for s, e in busy)]
        quiet_step = statistics.median(quiet) if quiet else None
        if quiet_step:
            samples = [s if s.request_id not in windows else
                       Sample(**{**asdict(s), "stall_steps": stall_steps(gaps, windows[s.request_id],
                                                                          quiet_step),
                                 "stall_joined_steps": joined_stall(gaps, windows[s.request_id])})
                       for s in samples]
    return samples


def token_times(node: Node, token: str, since: float) -> dict[str, Any]:
    """The node's `GET /internal/token_times?since=` body ({} from a node too old to have it)."""
    response = httpx.get(f"{node.url}/internal/token_times", params={"since": since},
                         headers={"X-Statecore-Token": token}, timeout=60)
    return response.json() if response.status_code == 200 else {}


def hop_times(servers: dict[str, Node], token: str, background: BackgroundStreams,
              since: float) -> dict[str, dict[str, list[float]]]:
    """The background streams' tokens at each hop (`hop_gaps.node_hops`): the decode node's loop
    and writer, the stream router's loop and writer, the client."""
    decode = token_times(servers["decode"], token, since)
    router = token_times(servers["stream"], token, since)
    if not decode or not router:
        print("# a node has no /internal/token_times (an older src/): no per-hop gaps")
        return {}
    client = {rid: list(times) for rid, times in background.by_request.items()}
    oldest = min((t[0] for t in decode.get("applied", {}).values() if t), default=since)
    if oldest > since + 60:
        print(f"# the decode node's ring starts {oldest - since:.0f} s into the run: the earliest gaps are "
              "missing from the per-hop figures")
    return node_hops(decode, router, client, client)


def joined_step(gaps: list[tuple[float, float]], window: tuple[float, float]) -> float | None:
    """The streams' median gap in the second after the join (`window` ends a second after it);
    None when no gap fits in it (steps longer than that second)."""
    joined = window[1] - 1.0
    after = [b - a for a, b in gaps if a >= joined and b <= window[1]]
    return statistics.median(after) if after else None


def joined_stall(gaps: list[tuple[float, float]], window: tuple[float, float]) -> float | None:
    """The longest gap in `window` in the streams' steps after the join (None: none measured)."""
    step = joined_step(gaps, window)
    return None if step is None else stall_steps(gaps, window, step)


def summarize(samples: list[Sample]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tokens in sorted({s.tokens for s in samples}):
        row: dict[str, Any] = {}
        for setup in SETUPS:
            some = [s for s in samples if s.tokens == tokens and s.setup == setup]
            if not some:
                continue
            med = statistics.median
            row[setup] = {
                "n": len(some),
                "ttft_ms": med(s.ttft_s for s in some) * 1e3,
                "second_gap_ms": med(s.second_gap_s for s in some) * 1e3,
                "step_ms": med(s.step_s for s in some) * 1e3,
                "gap_steps": med(s.gap_steps for s in some),
            }
            if setup != "single":
                row[setup].update({
                    "prefill_ms": med(s.prefill_s or 0.0 for s in some) * 1e3,
                    "overhead_ms": med(s.overhead_s or 0.0 for s in some) * 1e3,
                    "overhead_share": med((s.overhead_s or 0.0) / (s.prefill_s or 1.0) for s in some),
                    "overlap": med(s.overlap or 0.0 for s in some),
                    "reach_ms": _median_ms(s.reach_s for s in some),
                    "install_ms": _median_ms(s.install_s for s in some),
                    "encode_ms": _median_ms(s.encode_s for s in some),
                    "first_byte_ms": _median_ms(s.first_byte_s for s in some),
                    "body_ms": _median_ms(s.body_s for s in some),
                    # the overhead less the GET and the install: the first token's way to the
                    # router and the decode node, the decode node's admission, the waits between
                    "relay_ms": _median_ms(None if s.first_byte_s is None or s.body_s is None
                                           or s.install_s is None or s.overhead_s is None
                                           else s.overhead_s - s.first_byte_s - s.body_s - s.install_s
                                           for s in some),
                    "node_gap_ms": med(s.node_gap_s for s in some if s.node_gap_s is not None) * 1e3
                    if any(s.node_gap_s is not None for s in some) else None,
                    "stall_steps_max": max((s.stall_steps for s in some if s.stall_steps is not None),
                                           default=None),
                    "stall_joined_steps_max": max((s.stall_joined_steps for s in some
                                                   if s.stall_joined_steps is not None), default=None),
                    "ttft_over_single": med(s.ttft_s for s in some) / row["single"]["ttft_s_raw"]
                    if "single" in row else None,
                })
            else:
                row[setup]["ttft_s_raw"] = med(s.ttft_s for s in some)
        out[str(tokens)] = row
    return out


def _median_ms(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) * 1e3 if known else None


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row.get(key)
    return "-" if value is None else format(value, fmt)


def print_table(summary: dict[str, Any]) -> None:
    print("\n| tokens | setup | TTFT ms | TTFT / single | prefill ms | overhead ms | overhead / prefill "
          "| of it: 1st token reaches decode ms | install ms "
          "| 1st->2nd ms | in steps | decode node's 1st->2nd ms | step ms | KV before 1st token "
          "| stall steps (max) | stall, joined steps (max) |")
    print("|" + "---|" * 16)
    for tokens, row in summary.items():
        for setup, m in row.items():
            print(f"| {tokens} | {setup} | {m['ttft_ms']:.1f} | {_cell(m, 'ttft_over_single', '.2f')} "
                  f"| {_cell(m, 'prefill_ms', '.1f')} | {_cell(m, 'overhead_ms', '.1f')} "
                  f"| {_cell(m, 'overhead_share', '.3f')} | {_cell(m, 'reach_ms', '.1f')} "
                  f"| {_cell(m, 'install_ms', '.1f')} "
                  f"| {m['second_gap_ms']:.1f} | {m['gap_steps']:.2f} | {_cell(m, 'node_gap_ms', '.1f')} "
                  f"| {m['step_ms']:.1f} "
                  f"| {_cell(m, 'overlap', '.2f')} | {_cell(m, 'stall_steps_max', '.2f')} "
                  f"| {_cell(m, 'stall_joined_steps_max', '.2f')} |")
    for tokens, row in summary.items():
        pull = row.get("pull")
        if pull and pull.get("first_byte_ms") is not None:
            print(f"\npull, {tokens} tokens, medians (ms): overhead {pull['overhead_ms']:.1f} = GET to "
                  f"its head {pull['first_byte_ms']:.1f} (the export {_cell(pull, 'encode_ms', '.1f')} in "
                  f"it) + body "
                  f"{pull['body_ms']:.1f} + install {_cell(pull, 'install_ms', '.1f')} + the rest "
                  f"{_cell(pull, 'relay_ms', '.1f')} (the first token to the router and on to the decode "
                  "node, its admission, the waits between)")
    print(f"\ntargets: overhead / prefill <= {OVERHEAD_TARGET} at >= 2,000 tokens; 1st->2nd <= "
          f"{GAP_TARGET_STEPS:g} steps; TTFT / single <= {TTFT_TARGET} (concurrency 1)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="checkpoint (default: a 23 M llama, built once)")
    parser.add_argument("--hidden-size", type=int, default=512, help="the built llama only")
    parser.add_argument("--num-layers", type=int, default=6, help="the built llama only")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000, 4000])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds, a fresh prompt each")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--cpus", nargs=3, metavar="CORES", default=None,
                        help="taskset cores of the prefill, decode and single node (e.g. 0 1 0)")
    parser.add_argument("--gpus", nargs=3, metavar="GPU", default=None,
                        help="CUDA_VISIBLE_DEVICES of the prefill, decode and single node")
    parser.add_argument("--clients-cpus", default=None, metavar="CORES",
                        help="the routers' and the clients' cores (default: the prefill node's, idle "
                             "once its prefill is done; but a pull's export, or the last pieces' "
                             "copy, runs there in the window)")
    parser.add_argument("--engine-nice", type=int, default=0, metavar="N",
                        help="the threads of the engine nodes on the routers' and the clients' cores "
                             "at this nice value (they stay at 0): whether the streams' delivery on "
                             "a shared core needs the front end ahead of the engines")
    parser.add_argument("--engine-nice-alternate", type=int, default=0, metavar="N",
                        help="odd rounds with the engine nodes at nice N, even ones at --engine-nice: "
                             "the per-hop gaps for each, in one run (give an even --rounds)")
    parser.add_argument("--node-arg", action="append", default=[], help="extra flag for every engine node")
    parser.add_argument("--decode-arg", action="append", default=[],
                        help="extra flag for the decode node only, after --node-arg's (e.g. a KV "
                             "budget whose slots hold the longest prompt: with 8 GiB, 32 slots hold "
                             "4,096 positions, and a longer prompt decodes in the batch lane)")
    parser.add_argument("--prefill-arg", action="append", default=[],
                        help="extra flag for the prefill node only, after --node-arg's (e.g. a step budget "
                             "that slices its chunks, so that a decode node on the same GPU steps between)")
    parser.add_argument("--transitions", action="store_true",
                        help="every node and router logs each request's transitions (INFO, ms stamps): "
                             "bench/phase_times.py LOGS/*.log shows where a request's time went")
    parser.add_argument("--background-streams", type=int, default=0)
    parser.add_argument("--background-max-tokens", type=int, default=2000)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--request-timeout", type=float, default=900.0)
    parser.add_argument("--logs", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the samples and summary as JSON")
    args = parser.parse_args(argv)
    if args.cpus is None and args.gpus is None and (os.cpu_count() or 1) >= 2:
        args.cpus = ["0", "1", "0"]
    if args.cpus is not None:
        # the clients' threads inherit it
        os.sched_setaffinity(0, parse_cpus(args.clients_cpus or args.cpus[0]))
    model: Path = args.model or with_context(
        cached_checkpoint("llama", hidden_size=args.hidden_size, num_layers=args.num_layers),
        max(args.lengths) + args.max_tokens + 64)
    started = dt.datetime.now(dt.UTC)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="handoff_overhead_"))
    logs.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    pool = sorted(set(prompt_pool(model, 4096)))  # the corpus's distinct ids
    print(f"# handoff overhead: model {model}; lengths {args.lengths}; {args.rounds} rounds; "
          f"cpus {args.cpus} (routers, clients {args.clients_cpus or (args.cpus or [None])[0]}) "
          f"gpus {args.gpus}; engine nodes at nice {args.engine_nice}")
    print(f"# {machine()}; {started:%Y-%m-%d %H:%M} UTC; logs {logs}")
    servers: dict[str, Node] = {}
    background: BackgroundStreams | None = None
    handoff_records: dict[str, Any] = {}
    windows: dict[str, tuple[float, float]] = {}
    hops: dict[str, Any] = {}  # by the engine nodes' nice value
    spans: dict[int, list[tuple[float, float]]] = {}
    waits: list[tuple[float, float]] = []  # each prompt's prefill (and handoff): sent -> first token
    hop_moments: dict[str, dict[str, list[float]]] = {}  # the background streams' tokens at each hop
    try:
        servers = start(model, logs, token, args)
        if args.background_streams:
            background = BackgroundStreams(servers["stream"].url, pool[:32], args.background_streams,
                                           args.background_max_tokens)
            background.start()
        # this process's own full collections (its imports: ~120,000 objects, ~80 ms a pass on
        # the CPU box) would stall the clients' threads and read as the streams' gaps (plain gc,
        # not adapters.heap: the nodes may run an older src/ that has none)
        gc.collect()
        gc.freeze()
        since = time.time()
        samples = measure(args, servers, pool, token, background, handoff_records, windows, spans, waits)
        if background is not None:
            times = hop_times(servers, token, background, since)
            hop_moments.update(times)
            # per nice value of the engine nodes when they alternate, else the whole run
            for nice, stretches in spans.items() if len(spans) > 1 else [(args.engine_nice, [])]:
                rows = by_hop(within(times, stretches) if stretches else times, list(windows.values()),
                              waits)
                if rows:
                    hops[str(nice)] = rows
    finally:
        if background is not None:
            background.stop()
        for node in servers.values():
            node.stop()
    summary = summarize(samples)
    print_table(summary)
    for nice, rows in hops.items():
        print(f"\nthe background streams' gaps per hop, engine nodes at nice {nice}, in the decode "
              "engine's step (GET /internal/token_times; in = overlapping a handoff window, prefill done "
              "-> joined + 1 s):")
        print(hop_table(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine(), "date": started.isoformat(), "argv": sys.argv,
                                        "model": str(model), "summary": summary,
                                        "samples": [asdict(s) for s in samples],
                                        "handoff_records": handoff_records,
                                        # the streams' gaps per hop (bench/handoff/hop_gaps.py)
                                        "hops": hops, "windows": windows, "spans": spans, "waits": waits,
                                        "hop_moments": hop_moments,
                                        # each background stream's token arrivals (wall clock; NaN
                                        # between two of its requests): where a stall fell
                                        "background_arrivals": background.arrivals if background else []},
                                       indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
