"""`statecore run`: start a node of the chosen role, or a local cluster of child processes.

A node process is one trio run: the engine (for single, prefill and decode), one
`NodeRunner`, the HTTP app on hypercorn's trio worker, and two watchers: SIGTERM/SIGINT ask
the loop to drain (health goes non-200, in-flight requests finish, exit 0), and a dead MLX
device thread is the node's `TransportLost` (health non-200 at once, exit 1). The router also
runs its peer-health machines. `statecore run` with no role starts router + prefill + decode
as children and stops them cleanly on Ctrl-C or SIGTERM. Every node binds its port before it
loads anything (a port in use fails at once, with one line); a parent that starts nodes binds
their sockets itself and hands them down (`--listen-fd`), so no other process can take a port
between the choice and the child's bind. With `--tls-certfile`/`--tls-keyfile` a node serves
HTTPS, and with `--tls-ca-file` it verifies its https:// peers against that CA (`adapters.tls`);
a local cluster hands the TLS flags to its children and waits on their health over https. This
module may import anything.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import math
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from adapters.api_keys import API_KEY_ENV, PROTECTABLE, ApiKeys, keys_from, parse_key, parse_protects
from adapters.blas import apply_blas_choice, blas_in_use
from adapters.internal_wire import TOKEN_HEADER, info_from_json, info_json
from adapters.live_view import LiveView
from adapters.metrics import Metrics
from adapters.model_source import ModelNotFound, resolve_model
from adapters.node_api import NodeApi, guarded
from adapters.openai_api import Frontend, build_app
from adapters.peers_httpx import DEFAULT_KV_BUFFER_BYTES, HttpxPeers
from adapters.tls import TlsConfigError, TlsFiles, certificate_refused, client_context, tls_files
from effects.backend import local_backend, router_backend
from effects.engine_port import EngineStatistics
from effects.faults import DEFAULT_MARKER, Faults
from effects.handoffs import HandoffLog
from effects.health import PeerSet
from effects.interpret import EnginePerformer, RouterPerformer
from effects.ports import ModelInfo
from effects.routing import PrefixSummaries
from effects.runner import NodeRunner, Timeouts
from statecore.errors import ErrorInfo, StatecoreError
from statecore.events import DrainRequested, TransportLost
from statecore.ids import RequestId
from statecore.routing import DEFAULT_LOAD_TOKENS, RouteChoice
from statecore.table import DECODE_REQUEST, PREFILL_REQUEST, ROUTER_REQUEST

log = logging.getLogger("statecore")

EXIT_TRANSPORT_LOST = 3
INTERNAL_TOKEN_ENV = "STATECORE_INTERNAL_TOKEN"


def demo_model_dir() -> Path:
    return Path(__file__).resolve().parent / "demo_model"


ENGINE_SWITCH_INTERVAL = 0.0005
"""sys.setswitchinterval for engine nodes (seconds; env STATECORE_SWITCH_INTERVAL overrides)."""


def _switch_interval(raw: str | None) -> float:
    """STATECORE_SWITCH_INTERVAL as seconds; a value that is not a positive number is ignored,
    with one warning, rather than stopping the node."""
    if raw is None:
        return ENGINE_SWITCH_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        log.warning("STATECORE_SWITCH_INTERVAL=%r is not in (0, 1] seconds; using %g", raw,
                    ENGINE_SWITCH_INTERVAL)
        return ENGINE_SWITCH_INTERVAL
    return value


def _whole(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= minimum (checked before anything loads)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below the least allowed, {minimum}")
        return value

    return parse


def _seconds(*, zero_allowed: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, > 0 (or >= 0 where zero means "at once")."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_allowed):
            raise argparse.ArgumentTypeError(
                f"{text} is not a usable number of seconds (must be {'>=' if zero_allowed else '>'} 0)")
        return value

    return parse


LOCAL_PREFILL_BELOW_MAX = 1000


def local_prefill_below(chosen: int | None, context_length: int) -> int:
    """The router's threshold: prompts shorter than this prefill on the decode node itself.

    By default an eighth of the model's context, at most 1000 tokens: a fixed 1000 meant a model
    with a short context (the demo model's is 512) never used its prefill node at all."""
    if chosen is not None:
        return chosen
    return min(LOCAL_PREFILL_BELOW_MAX, context_length // 8)


def handoff_rule(threshold: int) -> str:
    """Which prompts go through a prefill node, in words (start-up lines)."""
    if threshold <= 0:
        return "every prompt prefills on a prefill node and hands its KV cache to a decode node"
    return (f"prompts of {threshold} tokens or more prefill on a prefill node and hand their KV "
            f"cache to a decode node; shorter ones prefill on the decode node")


def _api_key(text: str) -> str:
    """An argparse type: one usable API key (the error never repeats it)."""
    try:
        return parse_key(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _protects(text: str) -> str:
    """An argparse type: a comma-separated list of PROTECTABLE names, kept as normalized text (so
    that a local cluster hands it on as given)."""
    try:
        return ",".join(sorted(parse_protects(text)))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s,]+")


def _origins(text: str) -> str:
    """An argparse type: `*` or comma-separated origins (`https://app.example.com:8443`: scheme,
    host, port; no path, as browsers send them), kept as normalized text."""
    origins = [o.strip() for o in text.split(",") if o.strip()]
    bad = [o for o in origins if o != "*" and not _ORIGIN.fullmatch(o)]
    if not origins or bad:
        raise argparse.ArgumentTypeError(
            f"{bad[0] if bad else text!r} is not an origin: give `*` or scheme://host[:port] "
            "without a path, comma-separated")
    return ",".join(origins)


def add_serving_flags(run: argparse.ArgumentParser) -> None:
    """Flags beyond the public contract in cli.py; all optional with sane defaults."""
    run.add_argument("--local-prefill-below", type=_whole(0), default=None, metavar="TOKENS",
                     help="router: prompts shorter than this prefill on the decode node, longer ones "
                          "on a prefill node with a KV handoff (default: the model's context / 8, "
                          f"at most {LOCAL_PREFILL_BELOW_MAX})")
    run.add_argument("--force-disaggregation", action="store_true",
                     help="router: send every request through a prefill node")
    run.add_argument("--prefix-routing", choices=["on", "off"], default="on",
                     help="router: send a prompt to the node whose prefix cache holds the most of it, "
                          "weighed against load (on, the default), or to the least loaded node (off)")
    run.add_argument("--route-load-tokens", type=_whole(0), default=DEFAULT_LOAD_TOKENS, metavar="TOKENS",
                     help="router: what one request in flight on a node weighs against prompt tokens "
                          f"the node would not recompute (default {DEFAULT_LOAD_TOKENS})")
    run.add_argument("--prefill-chunk-size", type=_whole(1), default=2048,
                     help="tokens per prefill chunk; must be equal on every node (default 2048)")
    run.add_argument("--shape-bucket", type=_whole(0), default=None, metavar="TOKENS",
                     help="pad prefill chunks (and round decode's attended length) up to a multiple "
                          "of this, so the GPU meets few distinct shapes; must be equal on every node "
                          "(default: 128 on MLX's CUDA backend, 0 = off elsewhere)")
    run.add_argument("--decode-attention", default="auto", metavar="MODE",
                     help="the decode batch's attention (plain-KV models): auto (statecore's CUDA "
                          "kernel on MLX's CUDA backend when its load-time self-check passes, else "
                          "MLX's masked attention), kernel (required), masked, reference (MLX ops; "
                          "tests) (default auto)")
    run.add_argument("--compile-decode", default="auto", choices=("auto", "on", "off"),
                     help="trace the decode batch's model call once per shape and replay it "
                          "(mx.compile; plain-KV models): auto (on MLX's CUDA backend), on, off "
                          "(default auto)")
    run.add_argument("--fuse-projections", default="auto", choices=("auto", "on", "off"),
                     help="compute each layer's query/key/value projections, and its MLP's gate/up "
                          "projections, as one matmul each (fewer kernels per step): auto (on MLX's "
                          "CUDA backend), on, off (default auto)")
    run.add_argument("--kv-bits", type=int, default=None, help="quantize the KV cache (4 or 8)")
    run.add_argument("--max-batch", type=_whole(1), default=32, help="decode batch size (default 32)")
    run.add_argument("--prefill-batch", type=_whole(1), default=32,
                     help="most prompts advanced in one step; short prompts waiting together share one "
                          "padded model call; 1 = one at a time (default 32)")
    run.add_argument("--max-num-batched-tokens", type=_whole(1), default=None,
                     help="tokens one engine step may compute: every decoding row plus prefill work, "
                          "a chunk's layers in slices when the chunk does not fit (default: --max-batch "
                          "+ --prefill-chunk-size; minimum: --max-batch + chunk size / layers)")
    run.add_argument("--internal-token", default=os.environ.get(INTERNAL_TOKEN_ENV),
                     help="shared secret for internal endpoints (env STATECORE_INTERNAL_TOKEN)")
    run.add_argument("--api-key", type=_api_key, action="append", default=[], metavar="KEY",
                     help="single, router: the public API (/v1/*, /tokenize, /detokenize) requires "
                          "'Authorization: Bearer KEY' or 'x-api-key: KEY' (401 otherwise); repeat for "
                          f"several; env {API_KEY_ENV} adds more, comma-separated")
    run.add_argument("--api-key-protects", type=_protects, default="", metavar="LIST",
                     help=f"with --api-key: also require it on these paths, open by default "
                          f"(comma-separated of {', '.join(PROTECTABLE)})")
    run.add_argument("--allowed-origins", type=_origins, default=None, metavar="ORIGINS",
                     help="single, router: answer CORS for these browser origins (comma-separated, "
                          "* for any); default: no CORS headers")
    run.add_argument("--tls-certfile", default=None, metavar="PATH",
                     help="serve HTTPS with this PEM certificate (chain); needs --tls-keyfile")
    run.add_argument("--tls-keyfile", default=None, metavar="PATH",
                     help="the unencrypted PEM private key of --tls-certfile")
    run.add_argument("--tls-ca-file", default=None, metavar="PATH",
                     help="PEM CA bundle that https:// peers' certificates must chain to (the router's "
                          "calls, a decode node's KV pulls, a local cluster's health checks); default: "
                          "the system's store")
    run.add_argument("--kv-memory-bytes", type=_whole(1), default=None, metavar="BYTES",
                     help="engine nodes: what every KV cache together may take; each request reserves "
                          "its worst case before anything is allocated, and waits (429 with Retry-After) "
                          "or is refused (400 kv_memory_exceeded) otherwise (default: 40%% of the "
                          "device's memory)")
    run.add_argument("--prefill-memory-cap", default="auto", choices=("auto", "on", "off"),
                     help="engine nodes: cap each step's prefill work so that the KV held and reserved "
                          "plus the step's estimated activations stay within --kv-memory-bytes (the "
                          "oldest prompt still advances, alone if it must): auto (on when "
                          "--kv-memory-bytes is given), on, off (default auto)")
    run.add_argument("--prefix-cache-bytes", type=_whole(0), default=None, metavar="BYTES",
                     help="engine nodes: keep the KV of whole prefill chunks (plain-KV models) for "
                          "prompts that start with the same tokens, within this many bytes of the KV "
                          "budget; kept blocks give way to any request that needs the memory (default: "
                          "a quarter of --kv-memory-bytes; 0 = off)")
    run.add_argument("--keep-conversations", choices=["on", "off"], default="on",
                     help="decode and single nodes: when a request ends normally, compute its prompt and "
                          "generated tokens' whole prefill chunks again and keep them in the prefix "
                          "cache, so the conversation's next turn prefills only its new part (on, the "
                          "default, when the prefix cache is on)")
    run.add_argument("--max-kv-bytes", type=_whole(1), default=1 << 34,
                     help="decode: refuse a KV payload larger than this (default 16 GiB)")
    run.add_argument("--kv-buffer-bytes", type=_whole(0), default=DEFAULT_KV_BUFFER_BYTES,
                     help="decode: receive buffers kept for reuse by KV pulls, in bytes "
                          "(default 1 GiB; 0 = a fresh buffer per pull)")
    run.add_argument("--kv-lease", type=_seconds(zero_allowed=False), default=60.0,
                     help="seconds a held KV waits (default 60)")
    run.add_argument("--request-deadline", type=_seconds(zero_allowed=False), default=600.0,
                     help="seconds a request may live (default 600)")
    run.add_argument("--stall-timeout", type=_seconds(zero_allowed=True), default=180.0,
                     help="engine nodes: seconds the engine may be busy without finishing a step "
                          "before the node counts as hung: its requests fail, /health turns 503 and "
                          "it exits 3 for its supervisor to restart (default 180; 0 = never)")
    run.add_argument("--tensor-parallel", type=_whole(1), default=1, metavar="N",
                     help="prefill, decode, single: run the instance as N processes (ranks), each with "
                          "its tensor-parallel shard of the model (mlx-lm's model.shard: llama, qwen2, "
                          "qwen3, ...), over MLX's distributed runtime; rank 0 serves HTTP. Without "
                          "--hostfile or MLX's launch environment the ranks start on this machine "
                          "(ring backend over 127.0.0.1) (default 1)")
    run.add_argument("--pipeline-parallel", type=_whole(1), default=1, metavar="N",
                     help="prefill, decode, single: run the instance as N ranks as --tensor-parallel does, "
                          "each holding a share of the model's layers (mlx-lm's pipeline: qwen2, qwen3_moe, "
                          "qwen3_next, qwen3_5, deepseek_v3, glm4_moe, ...; see docs/operations.md); not "
                          "with --tensor-parallel; its caches do not hand off (default 1)")
    run.add_argument("--distributed-backend", default="ring", choices=("ring", "nccl", "jaccl", "mpi", "any"),
                     help="with --tensor-parallel: MLX's distributed backend (mlx.launch --backend; nccl "
                          "on CUDA, jaccl for RDMA over Thunderbolt) (default ring)")
    run.add_argument("--hostfile", default=None, metavar="PATH",
                     help="with --tensor-parallel: start the ranks on these hosts through mlx.launch "
                          "--hostfile (its JSON host list; statecore at the same path on each)")
    run.add_argument("--drain-timeout", type=_seconds(zero_allowed=True), default=30.0,
                     help="seconds to finish in-flight requests on SIGTERM (default 30)")
    run.add_argument("--max-in-flight", type=_whole(1), default=256,
                     help="admission limit: requests beyond it get 429 with Retry-After (default 256)")
    run.add_argument("--enable-prompt-tokens-details", action="store_true",
                     help="single, router: report in usage the prompt tokens each request's prefill "
                          "took from a prefix cache (prompt_tokens_details.cached_tokens, as vLLM's "
                          "flag; the Responses API's input_tokens_details, Messages' "
                          "cache_read_input_tokens). Off by default: through a cluster that number "
                          "may differ from a single node's")
    # tests only (refused unless ENABLE_ENV=1; docs/operations.md): kept out of --help
    run.add_argument("--inject-fault", action="append", default=[], help=argparse.SUPPRESS)
    run.add_argument("--fault-marker", default=DEFAULT_MARKER, help=argparse.SUPPRESS)
    run.add_argument("--listen-fd", type=int, default=None, metavar="FD",
                     help="serve on this inherited, already listening socket instead of binding "
                          "--host:--port (how `statecore run` and test harnesses start children)")
    run.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    run.add_argument("--log-level", default="INFO",
                     help="Python logging level: DEBUG, INFO, WARNING, ERROR (default INFO)")


class _JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role  # several nodes may share one log stream (a local cluster does)

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {"ts": record.created, "level": record.levelname, "role": self.role,
                               "logger": record.name, "msg": record.getMessage()}
        doc.update(getattr(record, "fields", {}))
        return json.dumps(doc)


def setup_logging(args: argparse.Namespace, role: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if args.log_json:
        handler.setFormatter(_JsonFormatter(role))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {role:7s} %(levelname)s %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler], force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per peer call is noise


def log_transitions(runner: NodeRunner[Any], role: str) -> None:
    def on_transition(rid: RequestId, old: str, new: str, event: str, error: ErrorInfo | None,
                      outcome: str | None) -> None:
        # a failure names its code and message; any other end its reason (stop, length, ...)
        failed = error is not None and outcome == error.code.value
        said = (f" reason={outcome}: {error.message}" if failed and error else
                f" reason={outcome}" if outcome else "")
        fields = {"request_id": rid, "role": role, "from": old, "to": new, "event": event,
                  "reason": outcome}
        log.info("request %s %s -> %s on %s%s", rid, old, new, event, said, extra={"fields": fields})

    runner.on_transition = on_transition


def _timeouts(args: argparse.Namespace) -> Timeouts:
    return Timeouts(deadline_s=args.request_deadline, kv_lease_s=args.kv_lease, drain_s=args.drain_timeout)


LOCAL_CLUSTER_PARENT_ENV = "STATECORE_LOCAL_CLUSTER_PARENT"
"""Set by a local cluster for its children: the parent's pid. A child drains when its parent is
gone, and leaves the stop's story to the parent's one line (its own drain lines are DEBUG)."""

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_signals_seen: list[int] = []


def _note_stop_signal(signum: int, frame: object) -> None:
    _signals_seen.append(signum)


def hold_stop_signals() -> None:
    """From the start of a node's process to its end, SIGTERM and SIGINT are noted instead of
    ending it: trio's receiver only listens while the node serves, and outside that window the
    default actions would end a node that is still loading, or one that has drained already,
    with -15 or a KeyboardInterrupt traceback (a terminal's Ctrl-C and a launcher's SIGTERM
    can both arrive). A signal noted while loading drains the node as soon as it serves."""
    for signum in _STOP_SIGNALS:
        signal.signal(signum, _note_stop_signal)


def _cluster_parent() -> int | None:
    raw = os.environ.get(LOCAL_CLUSTER_PARENT_ENV, "")
    return int(raw) if raw.isdigit() else None


def _stop_log_level() -> int:
    """A local cluster's parent reports the stop in one line; its children keep theirs quiet."""
    return logging.DEBUG if _cluster_parent() is not None else logging.INFO


async def _watch_signals(runner: NodeRunner[Any]) -> None:
    with trio.open_signal_receiver(*_STOP_SIGNALS) as signals:
        if _signals_seen:  # arrived while the node was loading
            log.log(_stop_log_level(), "received %s while starting: draining",
                    signal.Signals(_signals_seen[0]).name)
            await runner.post_loop(DrainRequested())
        async for signum in signals:
            log.log(_stop_log_level(), "received %s: draining", signal.Signals(signum).name)
            await runner.post_loop(DrainRequested())


async def _watch_parent(runner: NodeRunner[Any], parent: int) -> None:
    """A local cluster's child drains when its parent is gone (killed without a chance to stop
    its children): the children live in their own process group, so nothing else would stop them."""
    while os.getppid() == parent:
        await trio.sleep(0.5)
    log.warning("the local cluster's parent process is gone: draining")
    await runner.post_loop(DrainRequested())


async def _watch_engine(runner: NodeRunner[Any], stats: Callable[[], EngineStatistics],
                        stall_timeout_s: float, lost: Callable[[str], None],
                        rank_lost: Callable[[], str | None] = lambda: None) -> None:
    """The engine is the node's transport: it is lost when its device thread dies, or when it
    has been busy for `stall_timeout_s` (> 0) without finishing a step or a job (a hang: MLX
    cannot be interrupted, so only a restart gets the node back), or when `rank_lost` names a
    lost rank of its tensor-parallel instance. Either way every live request fails
    (`transport_lost`), `/health` turns 503 with the reason, and the node exits 3."""
    while True:
        now = stats()
        gone = rank_lost()
        if gone is not None:
            reason = gone
            break
        if not now.device_thread_alive:
            reason = "the MLX device thread died"
            break
        if stall_timeout_s > 0 and now.stalled_s > stall_timeout_s:
            reason = (f"the engine made no progress for {now.stalled_s:.1f} s with work live "
                      f"(--stall-timeout {stall_timeout_s:g})")
            break
        await trio.sleep(0.1)
    log.error("%s: the loop's transport is lost", reason)
    lost(reason)
    await runner.post_loop(TransportLost(reason))


def hypercorn_config(listener: socket.socket, tls: TlsFiles | None = None) -> Config:
    """hypercorn's settings for serving on `listener` (which it owns from here on), over TLS when
    `tls` names a certificate and key."""
    config = Config()
    config.bind = [f"fd://{listener.detach()}"]
    if tls is not None and tls.serves_https:
        config.certfile, config.keyfile = tls.certfile, tls.keyfile
    config.accesslog = None
    # A logger object, not hypercorn's default "-": that one gets a stderr handler of its own
    # and also propagates to ours, so every line ("Running on ...") came out twice.
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = 5.0
    return config


async def _serve(app: Starlette, listener: socket.socket, runner: NodeRunner[Any],
                 nursery: trio.Nursery, tls: TlsFiles) -> None:
    config = hypercorn_config(listener, tls)
    nursery.start_soon(_watch_signals, runner)
    parent = _cluster_parent()
    if parent is not None:
        nursery.start_soon(_watch_parent, runner, parent)
    await serve(app, config, shutdown_trigger=runner.wait_stopped)  # type: ignore[arg-type]


def exposure_warning(listener: socket.socket, token: str | None, role: str) -> str | None:
    """Why this node's internal endpoints are open to more than this host, or None: they are
    bound beyond loopback and no --internal-token guards them."""
    if token:
        return None
    host = str(listener.getsockname()[0])
    try:
        if ipaddress.ip_address(host.split("%")[0]).is_loopback:
            return None
    except ValueError:
        pass
    what = ("live request counts (/internal/stats)" if role == "router" else
            "held KV caches and can start work past the router's admission (/internal/...)")
    return (f"internal endpoints are open on {host} without a token: anyone who reaches this port "
            f"can read {what}; set the same --internal-token (or {INTERNAL_TOKEN_ENV}) on every "
            "node and the router, or bind to 127.0.0.1")


def _blas_words(blas: str) -> str:
    """What MLX computes with, for the start-up lines."""
    return {"openblas": "the system OpenBLAS", "bundled": "MLX's bundled reference BLAS (slow; "
            "apt-get install libopenblas0 for ~10x faster prefill)", "accelerate": "Accelerate",
            "gpu": "the GPU", "n/a": "the GPU"}.get(blas, blas)


def _warn_if_exposed(listener: socket.socket, token: str | None, role: str) -> list[str]:
    """The start-up warnings that /health repeats in its details."""
    warning = exposure_warning(listener, token, role)
    if warning is None:
        return []
    log.warning("%s", warning)
    return [warning]


def _stats_route(token: str | None, stats: Any) -> BaseRoute:
    async def handler(request: Request) -> Response:
        return JSONResponse(stats())

    return Route("/internal/stats", guarded(token, handler), methods=["GET"])


def engine_options(args: argparse.Namespace, role: str) -> dict[str, Any]:
    """`MlxEngine.load`'s keywords from the command line (every rank of an instance passes the same)."""
    return dict(
        prefill_chunk_size=args.prefill_chunk_size, kv_bits=args.kv_bits,
        trust_remote_code=args.trust_remote_code, max_batch=args.max_batch,
        prefill_batch=args.prefill_batch, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_memory_bytes=args.kv_memory_bytes, decodes_locally=role != "prefill",
        shape_bucket=args.shape_bucket, decode_attention=args.decode_attention,
        compile_decode=args.compile_decode, fuse_projections=args.fuse_projections,
        prefix_cache_bytes=args.prefix_cache_bytes, prefill_memory_cap=args.prefill_memory_cap,
        keep_conversations=role != "prefill" and args.keep_conversations == "on",
    )


async def run_engine_node(args: argparse.Namespace, role: str, listener: socket.socket,
                          tensor: Any = None) -> int:
    """`tensor`: this node is rank 0 of a tensor-parallel instance (adapters.tensor_parallel)."""
    from adapters.mlx import MlxEngine

    faults = Faults.parse(args.inject_fault, args.fault_marker)  # refused before the model loads
    model = args.model or demo_model_dir()
    log.info("loading %s for role %s", model, role)
    # The device thread needs the GIL back as soon as each step's GPU work is done, but the HTTP
    # thread streaming tokens holds it for up to the switch interval (5 ms by default, longer
    # than a decode step): hand it over sooner.
    sys.setswitchinterval(_switch_interval(os.environ.get("STATECORE_SWITCH_INTERVAL")))
    engine = await MlxEngine.load(model, **engine_options(args, role),
                                  model_call_hook=faults.model_call_hook(), tensor=tensor)
    for layer in engine.info.layers:
        if not layer.can_travel:
            log.warning("layer %d: cache class %s cannot travel (%s)", layer.index, layer.class_name,
                        layer.reason)
    handoffs = HandoffLog(role)
    peers = None
    if role == "decode":
        peers = HttpxPeers(token=args.internal_token, max_kv_bytes=args.max_kv_bytes, handoffs=handoffs,
                           kv_buffer_bytes=args.kv_buffer_bytes,
                           ssl_context=client_context(args.tls.ca_file))
    crash_device = engine.crash_device_thread if faults.armed else None  # the DEVICE_CRASH fault
    performer = EnginePerformer(engine, peers, faults, crash_device, handoffs=handoffs)
    machine = PREFILL_REQUEST if role == "prefill" else DECODE_REQUEST
    metrics = Metrics(role)
    runner: NodeRunner[Any] = NodeRunner(machine, metrics.performer(performer), timeouts=_timeouts(args),
                                         name=role)
    log_transitions(runner, role)
    kv_buffer_bytes = (lambda: peers.receive_buffers.kept_bytes) if peers is not None else None
    metrics.watch(runner, engine=engine, kv_buffer_bytes=kv_buffer_bytes)
    live = LiveView(role, runner, metrics.registry)
    warnings = _warn_if_exposed(listener, args.internal_token, role)
    api = NodeApi(role, engine, runner, performer, token=args.internal_token, max_live=args.max_in_flight,
                  kv_buffer_bytes=kv_buffer_bytes or (lambda: 0), warnings=warnings)
    if role == "single":
        frontend = Frontend.load(model, metrics.backend(local_backend(runner, performer,
                                                                      max_live=args.max_in_flight)),
                                 model_name=getattr(args, "served_model_name", None),
                                 prompt_tokens_details=args.enable_prompt_tokens_details)
        frontend.faults = faults
        frontend.warnings = warnings
        app = _public_app(frontend, args, [*api.routes(), metrics.route(), *live.routes()], api.health)
    else:
        app = Starlette(routes=[Route("/health", api.health, methods=["GET"]), *api.routes(),
                                metrics.route(), *live.routes()])
    metrics.instrument(app)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            await nursery.start(live.run)
            def lose_engine(reason: str) -> None:
                api.lose(reason)
                engine.abandon(reason)  # nothing may wait on a hung thread, the drain included

            nursery.start_soon(_watch_engine, runner, engine.statistics, args.stall_timeout, lose_engine,
                               *([] if tensor is None else [tensor.rank_lost]))
            log.info("%s node serving on %s (MLX computes with: %s)", role,
                     listener_url(listener, https=args.tls.serves_https), _blas_words(blas_in_use()))
            await _serve(app, listener, runner, nursery, args.tls)
            nursery.cancel_scope.cancel()
        if api.lost_reason is None and not engine.statistics().device_thread_alive:
            # Died while draining (a tensor-parallel rank's launcher stops every rank when one
            # fails): still a loss, not a clean stop.
            api.lose("the MLX device thread died")
        lost = api.lost_reason is not None
    finally:
        # A stalled device thread never finishes its step: do not wait for it.
        await engine.aclose(join_timeout_s=1.0 if api.lost_reason is not None else None)
        if peers:
            await peers.aclose()
    if lost:
        log.error("exiting with %d: the loop's transport was lost (%s)", EXIT_TRANSPORT_LOST, api.lost_reason)
        return EXIT_TRANSPORT_LOST
    log.log(_stop_log_level(), "drained; exiting 0")
    return 0


async def _fetch_info(peers: HttpxPeers, nodes: list[str],
                      deadline_s: float = 600.0) -> tuple[str, dict[str, object], ModelInfo]:
    """The first node that answers /internal/info, its whole document and the model's info;
    waits while nodes load. A node whose TLS certificate does not verify is logged once."""
    refused: set[str] = set()
    with trio.move_on_after(deadline_s):
        while True:
            for node in nodes:
                try:
                    doc = await peers.info_document(node)
                    return node, doc, info_from_json(doc)
                except StatecoreError as exc:
                    why = certificate_refused(exc)
                    if why is not None and node not in refused:
                        refused.add(node)
                        log.error("%s: its TLS certificate does not verify (%s); is --tls-ca-file the CA "
                                  "that signed it?", node, why)
                    continue
            await trio.sleep(0.5)
    raise SystemExit(f"statecore: no node answered /internal/info within {deadline_s:.0f} s: {nodes}"
                     + (f" (TLS certificates refused: {sorted(refused)})" if refused else ""))


def _build_of(doc: dict[str, object]) -> tuple[str, str | None] | None:
    """A node's model fingerprint and BLAS from its /internal/info document."""
    fingerprint, blas = doc.get("fingerprint"), doc.get("blas")
    if fingerprint is None:
        return None
    return str(fingerprint), str(blas) if blas else None


async def _node_build(peers: HttpxPeers, node: str) -> tuple[str, str | None] | None:
    """`_build_of` a node's /internal/info; None when it does not answer."""
    try:
        return _build_of(await peers.info_document(node))
    except (StatecoreError, ValueError):
        return None


async def run_router(args: argparse.Namespace, listener: socket.socket) -> int:
    if not args.prefill or not args.decode:
        raise SystemExit("statecore: --role router needs at least one --prefill URL and one --decode URL")
    faults = Faults.parse(args.inject_fault, args.fault_marker)  # refused before any waiting
    model = args.model or demo_model_dir()
    peers = HttpxPeers(token=args.internal_token, ssl_context=client_context(args.tls.ca_file),
                       prompt_tokens_details=args.enable_prompt_tokens_details)
    prefill = [u.rstrip("/") for u in args.prefill]
    decode = [u.rstrip("/") for u in args.decode]
    first, first_doc, info = await _fetch_info(peers, prefill + decode)
    builds = {node: _build_of(first_doc) if node == first else await _node_build(peers, node)
              for node in prefill + decode}
    answered = [b for b in builds.values() if b is not None]
    if len({fp for fp, _ in answered}) > 1 or len({blas for _, blas in answered if blas}) > 1:
        log.warning("nodes differ in model fingerprint or BLAS, so KV handoffs between them will be refused "
                    "(start every node with the same model, flags and --blas): %s",
                    {node: f"fingerprint {b[0]}, BLAS {b[1] or 'unreported'}" if b else "no answer"
                     for node, b in builds.items()})
    routes_by_prefix = args.prefix_routing == "on"
    summaries = PrefixSummaries(prefill + decode, peers.prefix_summary) if routes_by_prefix else None
    peer_set = PeerSet({"prefill": prefill, "decode": decode}, peers.health, summaries=summaries,
                       load_tokens=args.route_load_tokens)
    threshold = 0 if args.force_disaggregation else local_prefill_below(args.local_prefill_below,
                                                                       info.context_length)

    def route(avoid: set[str], prompt: Sequence[int], request_id: str) -> RouteChoice:
        return peer_set.route(avoid, prompt, request_id, threshold)

    performer = RouterPerformer(peers, peer_set.pick, in_flight=peer_set.in_flight,
                                on_peer_failure=peer_set.report_failure, route=route)
    runner: NodeRunner[Any] = NodeRunner(ROUTER_REQUEST, performer, timeouts=_timeouts(args), name="router")
    log_transitions(runner, "router")
    metrics = Metrics("router")
    metrics.watch(runner, peers=peer_set)
    live = LiveView("router", runner, metrics.registry, peers=peer_set)
    backend = router_backend(runner, performer, lambda: info, local_prefill_below=threshold,
                             max_live=args.max_in_flight, faults=faults)
    frontend = Frontend.load(model, metrics.backend(backend),
                             model_name=getattr(args, "served_model_name", None),
                             prompt_tokens_details=args.enable_prompt_tokens_details)
    frontend.faults = faults
    frontend.warnings = _warn_if_exposed(listener, args.internal_token, "router")

    def stats() -> dict[str, object]:
        s = runner.statistics()
        return {"role": "router", "loop_phase": s.phase.value, "live_requests": s.live_requests,
                "live_tasks": s.live_tasks, "contexts": s.entries, "outcomes": s.outcomes,
                "bugs": s.bugs, "peers": {u: r.phase.value for u, r in peer_set.records.items()},
                # blocks each node's fresh prefix summary lists (what prefix routing sees)
                "prefix_blocks": {u: summaries.blocks(u) for u in summaries.nodes} if summaries else {},
                "model": info_json(info)["name"], "local_prefill_below": threshold}

    app = _public_app(frontend, args, [_stats_route(args.internal_token, stats), metrics.route(),
                                       *live.routes()])
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(peer_set.run)
            if summaries is not None:
                await nursery.start(summaries.run)
            await nursery.start(runner.run)
            await nursery.start(live.run)
            log.info("router serving on %s (prefill %s, decode %s): %s",
                     listener_url(listener, https=args.tls.serves_https), prefill, decode,
                     handoff_rule(threshold))
            await _serve(app, listener, runner, nursery, args.tls)
            nursery.cancel_scope.cancel()
    finally:
        await peers.aclose()
    return 0


LISTEN_BACKLOG = 1024


def open_listener(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket on host:port (0: any free port). A child started with
    `pass_fds=(sock.fileno(),)` inherits it (and only it) and can serve on it (`--listen-fd`).
    Raises OSError (port in use)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may find TIME_WAIT
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def listener_url(sock: socket.socket, *, https: bool = False) -> str:
    host, port = sock.getsockname()[:2]
    scheme = "https" if https else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _listener_for(args: argparse.Namespace) -> socket.socket:
    """The socket this node serves on: the inherited one, or --host:--port bound now, before
    anything slow, so that a port in use is one clear line instead of a traceback after loading."""
    if args.listen_fd is not None:
        try:
            sock = socket.socket(fileno=args.listen_fd)
            sock.getsockname()
        except OSError as exc:
            raise SystemExit(f"statecore: --listen-fd {args.listen_fd} is not an open socket: "
                             f"{exc.strerror}") from exc
        if sock.type != socket.SOCK_STREAM:
            raise SystemExit(f"statecore: --listen-fd {args.listen_fd} is not a TCP socket")
        return sock
    try:
        return open_listener(args.host, args.port)
    except OSError as exc:
        raise SystemExit(f"statecore: cannot listen on {args.host}:{args.port}: {exc.strerror}") from exc


def free_port() -> int:
    """A port that was free a moment ago, for servers that cannot take an inherited socket
    (mlx_lm.server in the benchmarks); another process may take it before they bind."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_healthy(url: str, child: subprocess.Popen[bytes], timeout_s: float,
                 headers: Mapping[str, str] | None = None, *, verify: ssl.SSLContext | None = None,
                 stop: Callable[[], bool] | None = None) -> str | None:
    """Poll a starting node's /health until it answers 200. None when it does; otherwise why
    not (the process exited, the time ran out, its TLS certificate was refused: waiting cannot
    mend that, or `stop()` turned true), for the caller to raise as it sees fit.
    `headers`: an API key, where `--api-key-protects health` closes /health. `verify`: what an
    https:// node's certificate must chain to (default: the system store)."""
    deadline = time.monotonic() + timeout_s
    context = verify if verify is not None else client_context(None)
    with httpx.Client(verify=context, timeout=1.0, headers=headers) as client:
        while time.monotonic() < deadline:
            if stop is not None and stop():
                return f"stopped waiting for {url}"
            if child.poll() is not None:
                return f"{url} exited with code {child.returncode} while starting"
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return None
            except httpx.HTTPError as exc:
                refused = certificate_refused(exc)
                if refused is not None:
                    return (f"{url}: its TLS certificate does not verify ({refused}); give the CA that "
                            "signed it with --tls-ca-file, and a certificate for that host name or IP")
            time.sleep(0.1)
    return f"{url} was not healthy within {timeout_s:.0f} s"


# Per child (its own socket) or passed another way (the secrets: through the environment).
_NOT_FORWARDED = frozenset({"listen_fd", "internal_token", "api_key"})


def _forwarded_serving_flags(args: argparse.Namespace) -> list[str]:
    """Every serving flag (`add_serving_flags`) set to other than its default, as arguments
    for a local cluster's children: what the user asked of the cluster reaches its nodes (a
    flag a role does not use is accepted and ignored there)."""
    probe = argparse.ArgumentParser(add_help=False)
    add_serving_flags(probe)
    flags: list[str] = []
    for action in probe._actions:
        value = getattr(args, action.dest, action.default)
        if action.dest in _NOT_FORWARDED or value == action.default:
            continue
        option = action.option_strings[0]
        if isinstance(value, bool):
            flags.append(option)
        elif isinstance(value, list):
            flags += [item for entry in value for item in (option, str(entry))]
        else:
            flags += [option, str(value)]
    return flags


HANDOFF_PROMPT = ("Once upon a time, in a small village at the edge of a great forest, there lived an "
                  "old king with three daughters. One winter the king fell ill, and a wise woman "
                  "told him that only water from the well at the end of the world could heal him. "
                  "Tell me what happened to each daughter on the road.")
"""The prompt the start-up banner (and the README) suggests: long enough for the demo model's
router to send it through the prefill node."""


def _router_threshold(router: str, token: str | None, verify: ssl.SSLContext) -> int | None:
    """The running router's local-prefill threshold (its /internal/stats), for the banner."""
    headers = {TOKEN_HEADER: token} if token else {}
    try:
        value = httpx.get(f"{router}/internal/stats", headers=headers, timeout=5.0, verify=verify).json()
        threshold = value.get("local_prefill_below")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return threshold if isinstance(threshold, int) else None


def _banner(router: str, urls: dict[str, str], model: str, threshold: int | None, blas: str,
            keyed: bool = False, cacert: str | None = None) -> str:
    body = json.dumps({"model": model, "max_tokens": 64,
                       "messages": [{"role": "user", "content": HANDOFF_PROMPT}]})
    key = "-H 'Authorization: Bearer <your API key>' " if keyed else ""
    key += f"--cacert {cacert} " if cacert and router.startswith("https://") else ""
    rule = "" if threshold is None else f"Routing: {handoff_rule(threshold)}.\n"
    rule += f"MLX computes with {_blas_words(blas)}.\n"
    return (f"\nstatecore cluster ready: router {router}  (prefill {urls['prefill']}, "
            f"decode {urls['decode']})\n{rule}\nTry (a prompt long enough to go through the "
            f"prefill node):\n  curl -s {router}/v1/chat/completions "
            f"-H 'Content-Type: application/json' {key}\\\n    -d '{body}'\n\nCtrl-C stops every node.")


def run_cluster(args: argparse.Namespace) -> int:
    """router + prefill + decode as children on free ports; Ctrl-C or SIGTERM stops them all.

    The children run in their own process group, so a terminal's Ctrl-C (SIGINT to the whole
    foreground group) reaches only this parent, which then stops each child with exactly one
    SIGTERM: a child that got both signals used to be killed by the second one mid-drain. A child
    whose parent disappears drains by itself (LOCAL_CLUSTER_PARENT_ENV)."""
    model = str(getattr(args, "model_given", None) or args.model or demo_model_dir())
    # The parent resolves --blas once and hands the result to both engine nodes, so they cannot
    # end up on different BLAS (it also fails here, once, when OpenBLAS is asked for but missing).
    blas = apply_blas_choice(args.blas, may_reexec=False)
    forwarded = _forwarded_serving_flags(args)
    common = ["--model", model, *forwarded]
    if blas in ("openblas", "bundled"):
        common += ["--blas", blas]
    if args.trust_remote_code:
        common.append("--trust-remote-code")
    # the shared secret reaches the children through their environment, not their command lines
    child_env = {**os.environ, LOCAL_CLUSTER_PARENT_ENV: str(os.getpid())}
    if args.internal_token:
        child_env[INTERNAL_TOKEN_ENV] = args.internal_token
    keys: ApiKeys | None = args.api_keys
    if keys is not None:
        child_env[API_KEY_ENV] = ",".join(keys.keys)  # the router's (the engine nodes ignore it)
    router_health = ({"Authorization": f"Bearer {keys.keys[0]}"}
                     if keys is not None and "health" in keys.protects else None)
    sockets = {"prefill": open_listener("127.0.0.1", 0), "decode": open_listener("127.0.0.1", 0),
               "router": _listener_for(args)}
    tls: TlsFiles = args.tls  # the children get the TLS flags with the others (`forwarded`)
    urls = {role: listener_url(sock, https=tls.serves_https) for role, sock in sockets.items()}
    # this process's own calls reach a router bound to every address on loopback
    local = {role: url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")
             for role, url in urls.items()}
    verify = client_context(tls.ca_file)
    base = [sys.executable, "-m", "adapters.cli", "run"]
    children: dict[str, subprocess.Popen[bytes]] = {}
    received: list[int] = []

    def stop(signum: int, frame: object) -> None:
        received.append(signum)

    def start(role: str, flags: list[str]) -> None:
        sock = sockets[role]
        children[role] = subprocess.Popen([*base, "--role", role, "--listen-fd", str(sock.fileno()), *flags],
                                          pass_fds=(sock.fileno(),), env=child_env, process_group=0)
        sock.close()  # the child holds it now

    def wait_healthy_or_stop(role: str, timeout_s: float) -> bool:
        """True once the child is healthy; False when a stop signal came first."""
        problem = wait_healthy(local[role], children[role], timeout_s,
                               router_health if role == "router" else None, verify=verify,
                               stop=lambda: bool(received))
        if received:
            return False
        if problem is not None:
            raise SystemExit(f"statecore: {problem}")
        return True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    exited: str | None = None
    try:
        for role in ("prefill", "decode"):
            start(role, common)
        print("statecore: starting prefill and decode nodes ...", flush=True)
        if all(wait_healthy_or_stop(role, 600) for role in ("prefill", "decode")):
            start("router", ["--model", model, "--prefill", urls["prefill"], "--decode", urls["decode"],
                             *forwarded])
            if wait_healthy_or_stop("router", 120):
                threshold = _router_threshold(local["router"], args.internal_token, verify)
                served = getattr(args, "served_model_name", None) or Path(model).name
                print(_banner(urls["router"], urls, served, threshold, blas, keys is not None, tls.ca_file),
                      flush=True)
        while not received and exited is None:
            for role, child in children.items():
                if child.poll() is not None:
                    exited = f"the {role} node exited with {child.returncode}"
            time.sleep(0.2)
    finally:
        for sock in sockets.values():
            sock.close()  # those not handed to a child yet (no-op for the others)
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children.values():
            try:
                child.wait(timeout=args.drain_timeout + 5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    why = exited or f"stopped on {signal.Signals(received[0]).name}"
    failed = {role: child.returncode for role, child in children.items() if child.returncode != 0}
    if failed or exited:
        print(f"statecore: {why}; nodes exited uncleanly: {failed}" if failed else
              f"statecore: {why}; the others stopped cleanly", flush=True)
        return 1
    print(f"statecore: {why}: every node drained and stopped cleanly", flush=True)
    return 0


def _resolve_model(args: argparse.Namespace) -> None:
    """`--model` as a directory (a Hugging Face repo id is fetched from the cache or the hub);
    `args.model_given` keeps what the user typed (a local cluster passes it on to its children,
    which find it in the cache), `args.served_model_name` the name clients use for it."""
    args.model_given = args.model
    args.served_model_name = None
    if args.model is None:
        return
    try:
        source = resolve_model(args.model)
    except ModelNotFound as exc:
        raise SystemExit(f"statecore: {exc}") from None
    args.model = source.directory
    args.served_model_name = source.served_name


def _resolve_api_keys(args: argparse.Namespace) -> None:
    """`args.api_keys`: every --api-key and STATECORE_API_KEY key with what they protect, or None
    (no key: the public API is open); refused before anything loads when it makes no sense."""
    try:
        keys = keys_from(args.api_key, os.environ.get(API_KEY_ENV))
    except ValueError as exc:
        raise SystemExit(f"statecore: {API_KEY_ENV}: {exc}") from None
    protects = parse_protects(args.api_key_protects)
    if protects and not keys:
        raise SystemExit(f"statecore: --api-key-protects needs --api-key (or {API_KEY_ENV})")
    args.api_keys = ApiKeys(keys, protects) if keys else None


def _public_app(frontend: Frontend, args: argparse.Namespace, extra_routes: list[BaseRoute],
                health: Callable[[Request], Awaitable[Response]] | None = None) -> Starlette:
    """A single node's or the router's app: the public API behind the API keys and CORS asked for
    (`_resolve_api_keys`, `--allowed-origins`), and the node's own routes."""
    origins = args.allowed_origins.split(",") if args.allowed_origins else []
    return build_app(frontend, extra_routes=extra_routes, health=health, api_keys=args.api_keys,
                     allowed_origins=origins)


def _resolve_tls(args: argparse.Namespace) -> None:
    """`args.tls`: the checked TLS files (`adapters.tls.tls_files`); refused with one line, before
    anything loads, when they cannot work."""
    try:
        args.tls = tls_files(args.tls_certfile, args.tls_keyfile, args.tls_ca_file)
    except TlsConfigError as exc:
        raise SystemExit(f"statecore: {exc}") from None


def run_command(args: argparse.Namespace) -> int:
    role = args.role
    setup_logging(args, role)
    _resolve_tls(args)
    _resolve_model(args)
    _resolve_api_keys(args)
    if role == "cluster":
        return run_cluster(args)
    if role == "router":
        hold_stop_signals()
        return trio.run(run_router, args, _listener_for(args))
    apply_blas_choice(args.blas)  # may re-execute this process with the system OpenBLAS preloaded
    if args.tensor_parallel > 1 or args.pipeline_parallel > 1:
        from adapters.tensor_parallel import run_tensor_parallel

        return _exit_now(run_tensor_parallel(args, role))
    hold_stop_signals()
    return _exit_now(trio.run(run_engine_node, args, role, _listener_for(args)))


def _exit_now(code: int) -> int:
    """End an engine node without interpreter teardown. Everything is already closed (the loop
    drained or stopped, the device thread joined); what is left is MLX's C++ static teardown,
    which was seen to abort ("terminate called without an active exception") in a few percent
    of short-lived MLX processes under load, turning a clean exit 0 into -6."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
