"""A node process: one trio run of the engine (for single, prefill and decode) or the router's
peer set, one `NodeRunner`, and the HTTP app on hypercorn's trio worker, with two watchers:
SIGTERM/SIGINT ask the loop to drain (health goes non-200, in-flight requests finish, exit 0), and
a dead MLX device thread (or engine core process) is the node's `TransportLost` (health non-200 at
once, exit 3). The router also runs its peer-health machines. With `--tls-certfile`/`--tls-keyfile`
a node serves HTTPS, and with `--tls-ca-file` it verifies its https:// peers against that CA (`adapters.tls`).
This module may import anything.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from adapters.blas import blas_in_use
from adapters.frontend.app import build_app
from adapters.frontend.frontend import Frontend
from adapters.frontend.prompts import TemplateArgsRefused
from adapters.heap import freeze_startup_heap
from adapters.http.internal_wire import info_from_json, info_json
from adapters.http.live_view import LiveView
from adapters.http.node_api import CORE_PROCESS, DEVICE_THREAD, MAX_INTERNAL_BODY, NodeApi, guarded
from adapters.http.peers_httpx import HttpxPeers
from adapters.kv.plane import serve_plane
from adapters.kv.shm_outbox import DEFAULT_MAX_BYTES as KV_SHM_BYTES
from adapters.kv.shm_outbox import ShmOutbox
from adapters.metrics import Metrics
from adapters.serve.flags import (
    INTERNAL_TOKEN_ENV,
    demo_model_dir,
    handoff_rule,
    local_prefill_below,
    mlx_cuda_installed,
)
from adapters.serve.handoff_modes import HandoffModes
from adapters.serve.listeners import listener_url
from adapters.serve.logs import RequestLines, RetryLines, log_transitions, quiet_peer_changes
from adapters.tls import TlsFiles, certificate_refused, client_context
from adapters.token_times import TokenTimes
from effects.engine_port import EngineLiveness
from effects.faults import Faults
from effects.handoffs import HandoffLog
from effects.health import PeerSet
from effects.interpret import EnginePerformer, RouterPerformer, local_backend, router_backend
from effects.ports import Backend, ModelInfo
from effects.prefix_pull import PrefixPuller
from effects.routing import PrefixSummaries
from effects.runner import NodeRunner, Timeouts
from statecore.errors import StatecoreError
from statecore.events import DrainRequested, TransportLost
from statecore.routing import Overflow, RouteChoice
from statecore.scheduling import DECODE_NODE_FLOOR_MULTIPLE, SINGLE_NODE_CPU_FLOOR_MULTIPLE
from statecore.table import DECODE_REQUEST, PREFILL_REQUEST, ROUTER_REQUEST

if TYPE_CHECKING:
    from adapters.mlx.engine import MlxEngine

log = logging.getLogger("statecore")


EXIT_TRANSPORT_LOST = 3


ENGINE_SWITCH_INTERVAL = 0.0005
"""sys.setswitchinterval for engine nodes (seconds; env STATECORE_SWITCH_INTERVAL overrides)."""


def switch_interval(raw: str | None) -> float:
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
            quiet_peer_changes()
            await runner.post_loop(DrainRequested())
        async for signum in signals:
            log.log(_stop_log_level(), "received %s: draining", signal.Signals(signum).name)
            quiet_peer_changes()  # its peers are stopping too (a local cluster's are)
            await runner.post_loop(DrainRequested())


async def _watch_parent(runner: NodeRunner[Any], parent: int) -> None:
    """A local cluster's child drains when its parent is gone (killed without a chance to stop
    its children): the children live in their own process group, so nothing else would stop them."""
    while os.getppid() == parent:
        await trio.sleep(0.5)
    log.warning("the local cluster's parent process is gone: draining")
    await runner.post_loop(DrainRequested())


async def watch_engine(runner: NodeRunner[Any], liveness: Callable[[], EngineLiveness],
                       stall_timeout_s: float, lost: Callable[[str], None],
                       rank_lost: Callable[[], str | None] = lambda: None, *,
                       what: str = DEVICE_THREAD) -> None:
    """The engine is the node's transport: it is lost when `what` runs it (its device thread, or
    its core process) dies, or when it has been busy for `stall_timeout_s` (> 0) without
    finishing a step or a job (a hang: MLX cannot be interrupted, so only a restart gets the
    node back), or when `rank_lost` names a lost rank of its tensor-parallel instance. Either
    way every live request fails (`transport_lost`), `/health` turns 503 with the reason, and
    the node exits 3."""
    while True:
        now = liveness()  # ten times a second: not a whole `statistics()` snapshot
        gone = rank_lost()
        if gone is not None:
            reason = gone
            break
        if not now.alive:
            reason = f"{what} died"
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
    log.debug("startup heap frozen: %d objects", freeze_startup_heap())
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


def blas_words(blas: str) -> str:
    """What MLX computes with, for the start-up lines."""
    return {"openblas": "the system OpenBLAS", "openblas-1thread": "the system OpenBLAS on one thread",
            "bundled": "MLX's bundled reference BLAS (slow; "
            "apt-get install libopenblas0 for ~10x faster prefill)", "accelerate": "Accelerate",
            "gpu": "the GPU", "n/a": "the GPU"}.get(blas, blas)


def warn_if_exposed(listener: socket.socket, token: str | None, role: str) -> list[str]:
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


def step_target(args: argparse.Namespace, role: str) -> dict[str, Any]:
    """The engine's `step_target_ms` and `step_target_floors` from the command line: the target as
    given (ms), or as a multiple of the measured decode step (`--step-target-floors`), or by role:
    a decode node's streams are shielded at 4 of their steps, a single node's on the CPU at 2
    (there a fixed budget's step beside streams lasts seconds); a single node on MLX's CUDA
    backend (its steps of the fixed budget take milliseconds; the target is not measured there)
    and a prefill node (no streams) run the fixed budget."""
    if args.step_target_ms is not None:
        return {"step_target_ms": float(args.step_target_ms)}
    if args.step_target_floors is not None:
        return {"step_target_ms": None, "step_target_floors": float(args.step_target_floors)}
    if role == "decode":
        return {"step_target_ms": None, "step_target_floors": DECODE_NODE_FLOOR_MULTIPLE}
    if role == "single" and not mlx_cuda_installed():
        return {"step_target_ms": None, "step_target_floors": SINGLE_NODE_CPU_FLOOR_MULTIPLE}
    return {"step_target_ms": 0.0}


def engine_options(args: argparse.Namespace, role: str) -> dict[str, Any]:
    """`MlxEngine.load`'s keywords from the command line (every rank of an instance passes the same)."""
    options = dict(
        prefill_chunk_size=args.prefill_chunk_size, kv_bits=args.kv_bits,
        trust_remote_code=args.trust_remote_code, max_batch=args.max_batch,
        prefill_batch=args.prefill_batch, max_num_batched_tokens=args.max_num_batched_tokens,
        **step_target(args, role),
        kv_memory_bytes=args.kv_memory_bytes,
        device_shared_by=args.device_shared_by,
        preallocate_slots={"auto": None, "on": True, "off": False}[args.preallocate_slots],
        decodes_locally=role != "prefill",
        shape_bucket=args.shape_bucket, decode_attention=args.decode_attention,
        compile_decode=args.compile_decode, fuse_projections=args.fuse_projections,
        prefix_cache_bytes=args.prefix_cache_bytes, prefix_host_bytes=args.prefix_host_bytes,
        prefix_host_pull=args.prefix_host_pull, prefill_memory_cap=args.prefill_memory_cap,
        keep_conversations=role != "prefill" and args.keep_conversations == "on",
        message_blocks=args.message_blocks, prefill_stacking=args.prefill_stacking,
        speculative=args.speculative if role != "prefill" else "off",
        num_draft_tokens=args.num_draft_tokens, speculative_max_rows=args.speculative_max_rows,
        draft_model=args.draft_model if role != "prefill" else None, adapter_path=args.adapter_path,
    )
    return {**options, **adapter_options(args, role)}


def adapter_options(args: argparse.Namespace, role: str) -> dict[str, Any]:
    """`--adapters` as `MlxEngine.load`'s `adapters`, and what they turn off: the prefix cache
    (its blocks are keyed by tokens alone, not by the adapter that computed them) and keeping
    conversations; refused with one line beside what they cannot serve with yet."""
    if not args.adapters:
        return {}
    named = [(name, Path(path)) for name, _, path in (entry.partition("=") for entry in args.adapters)]
    names = [name for name, _ in named]
    doubled = sorted({name for name in names if names.count(name) > 1})
    if doubled:
        raise SystemExit(f"statecore: --adapters names {', '.join(doubled)} more than once")
    if args.adapter_path is not None:
        raise SystemExit("statecore: --adapters and --adapter-path together are not served: name the "
                         "adapter for every request in --adapters instead, or apply one with --adapter-path")
    if args.prefix_cache_bytes:
        log.warning("%s: --adapters turns the prefix cache off (its blocks are not keyed by adapter); "
                    "--prefix-cache-bytes is ignored", role)
    return {"adapters": tuple(named), "prefix_cache_bytes": 0, "keep_conversations": False}


async def run_engine_node(args: argparse.Namespace, role: str, listener: socket.socket,
                          tensor: Any = None) -> int:
    """`tensor`: this node is rank 0 of a tensor-parallel instance (adapters.serve.tensor_parallel).
    A node whose core is a process never imports mlx itself (the core reports what it computes with)."""
    from adapters.mlx.core_client import ProcessEngine

    faults = Faults.parse(args.inject_fault, args.fault_marker, role)  # refused before the model loads
    model = args.model or demo_model_dir()
    log.info("loading %s for role %s", model, role)
    # The device thread needs the GIL back as soon as each step's GPU work is done, but the HTTP
    # thread streaming tokens holds it for up to the switch interval (5 ms by default, longer
    # than a decode step): hand it over sooner.
    interval = switch_interval(os.environ.get("STATECORE_SWITCH_INTERVAL"))
    sys.setswitchinterval(interval)
    engine: MlxEngine | ProcessEngine
    try:
        if getattr(args, "engine_core", "thread") == "process" and tensor is None:
            fault_specs = (tuple(args.inject_fault), args.fault_marker, role) if faults.armed else None
            engine = await ProcessEngine.load(model, **engine_options(args, role), fault_specs=fault_specs,
                                              switch_interval=interval,
                                              shm_bytes=getattr(args, "kv_shm_bytes", None) or KV_SHM_BYTES)
        else:
            from adapters.mlx.engine import MlxEngine

            engine = await MlxEngine.load(model, **engine_options(args, role),
                                          model_call_hook=faults.model_call_hook(), tensor=tensor)
    except StatecoreError as exc:  # the model or a setting cannot be used: say so, no traceback
        raise SystemExit(f"statecore: cannot load {model}: {exc.info.message}") from None
    if isinstance(engine, ProcessEngine):
        runs_it, computes_with = CORE_PROCESS, engine.blas
    else:
        runs_it, computes_with = DEVICE_THREAD, blas_in_use()
    for layer in engine.info.layers:
        if not layer.can_travel:
            log.warning("layer %d: cache class %s cannot travel (%s)", layer.index, layer.class_name,
                        layer.reason)
    handoffs = HandoffLog(role)
    peers = None
    if role in ("decode", "prefill"):  # a decode node pulls handed-off KV, a prefill node prefixes
        peers = HttpxPeers(token=args.internal_token, max_kv_bytes=args.max_kv_bytes,
                           handoffs=handoffs if role == "decode" else None,
                           kv_buffer_bytes=args.kv_buffer_bytes,
                           ssl_context=client_context(args.tls.ca_file), kv_transport=args.kv_transport)
        if isinstance(engine, ProcessEngine):  # received KV lands where the core reads it
            peers.landing = engine.kv_landing(peers.receive_buffers.take)
        peers.takes_device_pieces = engine.info.device_pieces
    shm = _kv_outbox(args) if role == "prefill" and tensor is None else None
    # a tensor- or pipeline-parallel prefill node does not take other nodes' blocks (its ranks
    # would each need their share): the router's hints are then ignored
    prefix_pull = (PrefixPuller(engine, peers, args.prefix_pull)
                   if role == "prefill" and peers is not None and tensor is None else None)
    crash_device = engine.crash_device_thread if faults.armed else None  # the DEVICE_CRASH fault
    performer = EnginePerformer(engine, peers, faults, crash_device, handoffs=handoffs,
                                prefix_pull=prefix_pull)
    machine = PREFILL_REQUEST if role == "prefill" else DECODE_REQUEST
    metrics = Metrics(role)
    runner: NodeRunner[Any] = NodeRunner(machine, performer, timeouts=_timeouts(args),
                                         name=role)
    log_transitions(runner, role, every=args.log_transitions, in_local_cluster=_cluster_parent() is not None)
    kv_buffer_bytes = (lambda: peers.receive_buffers.kept_bytes) if peers is not None else None
    metrics.watch(runner, engine=engine, handoffs=handoffs, kv_buffer_bytes=kv_buffer_bytes,
                  prefix_pulls=None if prefix_pull is None else prefix_pull.statistics)
    token_times = TokenTimes()
    runner.instruments.add(token_times)
    live = LiveView(role, runner, metrics.registry)
    warnings = warn_if_exposed(listener, args.internal_token, role)
    api = NodeApi(role, engine, runner, performer, token=args.internal_token, max_live=args.max_in_flight,
                  kv_buffer_bytes=kv_buffer_bytes or (lambda: 0), warnings=warnings,
                  kv_stream=engine.streams_handoffs, shm=shm, kv_served=metrics.kv_served,
                  runs_engine=runs_it)
    api.blas = computes_with
    lines = RequestLines()
    if role == "single":
        lines.watch(runner)
        frontend = load_frontend(model, local_backend(runner, performer, max_live=args.max_in_flight), args)
        frontend.faults = faults
        frontend.warnings = warnings
        app = _public_app(frontend, args, [*api.routes(), metrics.route(), *live.routes(),
                                           token_times.route(args.internal_token)], api.health)
        lines.instrument(app)
    else:
        app = Starlette(routes=[Route("/health", api.health, methods=["GET"]), *api.routes(),
                                metrics.route(), *live.routes(), token_times.route(args.internal_token)])
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            await nursery.start(live.run)
            def lose_engine(reason: str) -> None:
                api.lose(reason)
                engine.abandon(reason)  # nothing may wait on a hung thread, the drain included

            rank_lost = [] if tensor is None else [tensor.rank_lost]
            watch = partial(watch_engine, runner, engine.liveness, args.stall_timeout, lose_engine,
                            *rank_lost, what=runs_it)
            nursery.start_soon(watch)
            if role == "prefill" and args.kv_port is not None and not args.tls.serves_https:
                api.kv_port = await _start_kv_plane(nursery, api, listener, args.kv_port)
            log.info("%s node serving on %s (MLX computes with: %s)", role,
                     listener_url(listener, https=args.tls.serves_https), blas_words(computes_with))
            await _serve(app, listener, runner, nursery, args.tls)
            nursery.cancel_scope.cancel()
        if api.lost_reason is None and not engine.statistics().device_thread_alive:
            # Died while draining (a tensor-parallel rank's launcher stops every rank when one
            # fails): still a loss, not a clean stop.
            api.lose(f"{runs_it} died")
        lost = api.lost_reason is not None
    finally:
        # A stalled device thread never finishes its step: do not wait for it.
        await engine.aclose(join_timeout_s=1.0 if api.lost_reason is not None else None)
        if peers:
            await peers.aclose()
        if shm is not None:
            shm.close()
    if lost:
        log.error("exiting with %d: the loop's transport was lost (%s)", EXIT_TRANSPORT_LOST, api.lost_reason)
        return EXIT_TRANSPORT_LOST
    log.log(_stop_log_level(), "drained; exiting 0")
    return 0


async def _start_kv_plane(nursery: trio.Nursery, api: NodeApi, listener: socket.socket, port: int) -> int:
    """The KV plane (`adapters.kv.plane`) on the HTTP listener's address; its port."""
    host = str(listener.getsockname()[0])
    plane = (await trio.open_tcp_listeners(port, host=host))[0]
    await nursery.start(serve_plane, plane, api.plane, MAX_INTERNAL_BODY)
    bound = int(plane.socket.getsockname()[1])
    log.info("KV plane on %s:%d", host, bound)
    return bound


def _kv_outbox(args: argparse.Namespace) -> ShmOutbox | None:
    """A prefill node's shared memory for the pieces of streamed handoffs to decode nodes on this
    host (unless `--kv-transport http`); None, with a warning, where none can be made."""
    if args.kv_transport == "http":
        return None
    try:
        # no checksum of its own: every piece carries its CRC-32 in its end frame
        return ShmOutbox(max_bytes=args.kv_shm_bytes or KV_SHM_BYTES, checksum=False)
    except StatecoreError as exc:
        log.warning("no shared memory for KV handoffs (%s): streamed pieces go over HTTP",
                    exc.info.message)
        return None


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


async def _node_document(peers: HttpxPeers, node: str) -> dict[str, object] | None:
    """A node's /internal/info document; None when it does not answer."""
    try:
        return await peers.info_document(node)
    except (StatecoreError, ValueError):
        return None


async def run_router(args: argparse.Namespace, listener: socket.socket) -> int:
    if not args.prefill or not args.decode:
        raise SystemExit("statecore: --role router needs at least one --prefill URL and one --decode URL")
    faults = Faults.parse(args.inject_fault, args.fault_marker, "router")  # refused before any waiting
    model = args.model or demo_model_dir()
    peers = HttpxPeers(token=args.internal_token, ssl_context=client_context(args.tls.ca_file),
                       prompt_tokens_details=args.enable_prompt_tokens_details)
    prefill = [u.rstrip("/") for u in args.prefill]
    decode = [u.rstrip("/") for u in args.decode]
    first, first_doc, info = await _fetch_info(peers, prefill + decode)
    docs = {node: first_doc if node == first else await _node_document(peers, node)
            for node in prefill + decode}
    builds = {node: None if doc is None else _build_of(doc) for node, doc in docs.items()}
    answered = [b for b in builds.values() if b is not None]
    if len({fp for fp, _ in answered}) > 1 or len({blas for _, blas in answered if blas}) > 1:
        log.warning("nodes differ in model fingerprint or BLAS, so KV handoffs between them will be refused "
                    "(start every node with the same model, flags and --blas): %s",
                    {node: f"fingerprint {b[0]}, BLAS {b[1] or 'unreported'}" if b else "no answer"
                     for node, b in builds.items()})
    routes_by_prefix = args.prefix_routing == "on"
    summaries = PrefixSummaries(prefill + decode, peers.prefix_summary) if routes_by_prefix else None
    peer_set = PeerSet({"prefill": prefill, "decode": decode}, peers.health, summaries=summaries,
                       load_tokens=args.route_load_tokens, overflow=Overflow(args.prefill_overflow))
    threshold = 0 if args.force_disaggregation else local_prefill_below(args.local_prefill_below,
                                                                       info.context_length)

    lines = RequestLines()

    def route(avoid: set[str], prompt: Sequence[int], request_id: str) -> RouteChoice:
        choice = peer_set.route(avoid, prompt, request_id, threshold)
        lines.routed(request_id, choice.route.value)
        return choice

    modes = HandoffModes(docs, partial(_node_document, peers), stream=args.kv_handoff != "pull",
                         attach=args.kv_handoff == "stream")
    performer = RouterPerformer(peers, peer_set.pick, route, in_flight=peer_set.in_flight,
                                prefilling=peer_set.prefilling, on_peer_failure=peer_set.report_failure,
                                streams=modes.streams, attaches=modes.attaches)
    runner: NodeRunner[Any] = NodeRunner(ROUTER_REQUEST, performer, timeouts=_timeouts(args), name="router")
    log_transitions(runner, "router", every=args.log_transitions)
    runner.instruments.add(RetryLines())
    metrics = Metrics("router")
    metrics.watch(runner, peers=peer_set)
    token_times = TokenTimes()
    runner.instruments.add(token_times)
    live = LiveView("router", runner, metrics.registry, peers=peer_set)
    backend = router_backend(runner, performer, lambda: info, local_prefill_below=threshold,
                             max_live=args.max_in_flight, faults=faults)
    lines.watch(runner)
    frontend = load_frontend(model, backend, args)
    frontend.faults = faults
    frontend.warnings = warn_if_exposed(listener, args.internal_token, "router")

    def stats() -> dict[str, object]:
        s = runner.statistics()
        return {"role": "router", "loop_phase": s.phase.value, "live_requests": s.live_requests,
                "live_tasks": s.live_tasks, "contexts": s.entries, "outcomes": s.outcomes,
                "bugs": s.bugs, "peers": {u: r.phase.value for u, r in peer_set.records.items()},
                # blocks each node's fresh prefix summary lists (what prefix routing sees)
                "prefix_blocks": {u: summaries.blocks(u) for u in summaries.nodes} if summaries else {},
                # and the version of each node's summary it last pulled (how far behind it is)
                "prefix_versions": {u: summaries.version(u) for u in summaries.nodes} if summaries else {},
                "model": info_json(info)["name"], "local_prefill_below": threshold}

    app = _public_app(frontend, args, [_stats_route(args.internal_token, stats), metrics.route(),
                                       *live.routes(), token_times.route(args.internal_token)])
    lines.instrument(app)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(peer_set.run)
            await nursery.start(modes.run)
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


def load_frontend(model: Path, backend: Backend, args: argparse.Namespace) -> Frontend:
    """A single node's or the router's front end (the same flags make the same prompts on both);
    `--chat-template-args` the template refuses end the start in one line."""
    template_args = None if args.chat_template_args is None else json.loads(args.chat_template_args)
    try:
        return Frontend.load(model, backend, model_name=getattr(args, "served_model_name", None),
                             prompt_tokens_details=args.enable_prompt_tokens_details,
                             template_args=template_args)
    except TemplateArgsRefused as exc:
        raise SystemExit(f"statecore: {exc}") from None


def _public_app(frontend: Frontend, args: argparse.Namespace, extra_routes: list[BaseRoute],
                health: Callable[[Request], Awaitable[Response]] | None = None) -> Starlette:
    """A single node's or the router's app: the public API behind the API keys and CORS asked for
    (`resolve_api_keys`, `--allowed-origins`), and the node's own routes."""
    origins = args.allowed_origins.split(",") if args.allowed_origins else []
    return build_app(frontend, extra_routes=extra_routes, health=health, api_keys=args.api_keys,
                     allowed_origins=origins)
