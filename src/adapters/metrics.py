"""Prometheus metrics for one node: definitions, the one observer that feeds them, and `/metrics`.

Every node (single, prefill, decode, router) is its own process with its own
`CollectorRegistry`, served at `GET /metrics` in Prometheus' text format; no multiprocess
directory is needed because no two processes ever share a registry. Names follow vLLM's and
SGLang's style with the `statecore:` prefix, and every family carries a `role` label.

What feeds them, all from the outside of the serving code (nothing here may ever raise into
it: the runner logs and drops a failing observation):
- `Metrics` is one instrument of the node's runner (`effects.runner.Instrument`, added by
  `Metrics.watch`). On a front end (single node, router) it reads the generations as the client
  gets them: time to first token, inter-token latency and end-to-end latency, prompt and
  generation tokens equal to the `usage` the client gets, and requests refused at intake. On an
  engine node it reads the events and work: the KV pull (bytes, seconds, failures), prompt
  tokens by source (`transferred` or `computed_locally`), and on prefill and decode nodes the
  node's own token timings and counts. Everywhere, requests by terminal state and reason and KV
  lease expiries, from the transitions.
- `Metrics.watch` also adds scrape-time collectors for live counts (requests running and
  waiting, KV held, peer up/down as the router sees it) from the runner's, the engine's and the
  peers' statistics.
- The node API tells `Metrics.kv_served` the KV bytes a node sends: a prefill node's streamed
  pieces and pulled payloads (by either port), a decode node's prefix blocks that a prefill node
  pulls (`/internal/prefix_kv`). Nothing here wraps a request's path: no middleware.

This is an adapter: it may import anything, and nothing in `statecore` or `effects` imports it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from effects.engine_port import Engine
from effects.handoffs import HandoffLog
from effects.health import PeerSet
from effects.interpret import NodeRequest
from effects.prefix_pull import PULL_OUTCOMES, PrefixPullStatistics
from effects.runner import Instrument, NodeRunner, Reply, WorkIntent
from statecore.errors import Code, ErrorInfo, StatecoreError
from statecore.events import Event, KvReceived, PrefillDone, TokensGenerated
from statecore.ids import RequestId
from statecore.intents import Complete, FetchKv, InstallKv, Reject, RespondTokens, StartDecode, StartPrefill
from statecore.routing import Route as TurnRoute

log = logging.getLogger("statecore.metrics")

PREFIX = "statecore:"
FRONT_END_ROLES = frozenset({"single", "router"})

_EVERY_ROLE = frozenset({"single", "prefill", "decode", "router"})
_ENGINE_ROLES = frozenset({"single", "prefill", "decode"})
_TOKEN_STREAM_ROLES = frozenset({"single", "decode", "router"})  # a prefill node makes one token
_HANDOFF_ROLES = frozenset({"prefill", "decode"})
_DECODE_ROLES = frozenset({"decode"})
_PREFILL_ROLES = frozenset({"prefill"})
# a decode node also serves KV: the prefix blocks a prefill node pulls (`/internal/prefix_kv`)
_KV_DIRECTIONS = {"prefill": ("served",), "decode": ("received", "served")}

# No `<name>_created` series beside each counter and histogram: they double a scrape, and
# dashboards (vLLM's, AIPerf's) never read them.
disable_created_metrics()  # type: ignore[no-untyped-call]

# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
KV_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                      30.0, 60.0)


def metrics_route(registry: CollectorRegistry) -> BaseRoute:
    """`GET /metrics`: the registry in Prometheus' text format (unauthenticated, as vLLM's)."""

    async def handler(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Route("/metrics", handler, methods=["GET"])


def _safely(what: str, fn: Callable[[], None]) -> None:
    """Run an observation made outside the runner (the KV bytes served); metrics never break
    serving. The runner's own hooks are guarded by the runner (`effects.runner.Instruments`)."""
    try:
        fn()
    except Exception:
        log.exception("metrics: %s failed", what)


@dataclass(slots=True)
class _Timing:
    """One request's token clock, from its admission on this node."""

    start: float
    last_token: float | None = None


class Metrics(Instrument):
    """Every metric family of one node, in its own registry, and the one observer that feeds
    them (an instrument of the node's runner: `watch`)."""

    def __init__(self, role: str, *, registry: CollectorRegistry | None = None,
                 model_name: str | None = None) -> None:
        self.role = role
        self.front_end = role in FRONT_END_ROLES
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry

        def exported(roles: frozenset[str]) -> CollectorRegistry | None:
            """A family is exported only by the roles that can move it (elsewhere it would stay 0);
            on the others it still counts, unseen."""
            return r if role in roles else None

        def histogram(name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = (),
                      roles: frozenset[str] = _EVERY_ROLE) -> Histogram:
            return Histogram(PREFIX + name, doc, ["role", *labels], buckets=buckets, registry=exported(roles))

        def counter(name: str, doc: str, labels: tuple[str, ...] = (),
                    roles: frozenset[str] = _EVERY_ROLE) -> Counter:
            return Counter(PREFIX + name, doc, ["role", *labels], registry=exported(roles))

        self.ttft = histogram("time_to_first_token_seconds",
                              "Time from admission on this node to its first output token.",
                              TTFT_BUCKETS).labels(role)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between two consecutive output tokens of a request.",
                             ITL_BUCKETS, roles=_TOKEN_STREAM_ROLES).labels(role)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Time from admission on this node to a request's last output "
                             "(requests that ran to an end; client cancellations excluded).",
                             E2E_BUCKETS).labels(role)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.").labels(role)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(role)
        self._by_source = counter("prompt_tokens_by_source",
                                  "Prompt tokens whose KV cache this node holds, by where it came "
                                  "from: transferred from a prefill node or computed locally.",
                                  ("source",), _ENGINE_ROLES)
        self.requests = counter("requests", "Requests that ended on this node, by terminal state "
                                "and reason (an error code, or the event that ended it).",
                                ("state", "reason"))
        self.kv_bytes = counter("kv_transfer_bytes", "KV cache bytes moved between nodes: received "
                                "(decode node) or served (prefill node: handoffs; decode node: prefix "
                                "blocks pulled from it); a stream's pieces by their payload bytes, "
                                "over HTTP or shared memory alike.", ("direction",), _HANDOFF_ROLES)
        self.kv_seconds = histogram("kv_transfer_seconds",
                                    "Time a decode node took to pull one request's KV cache.",
                                    KV_SECONDS_BUCKETS, roles=_DECODE_ROLES).labels(role)
        self.kv_failures = counter("kv_transfer_failures", "KV handoffs that failed (the pull, or "
                                   "installing the pulled cache), by error code.",
                                   ("reason",), _DECODE_ROLES)
        # a streamed handoff as the decode node saw it, by how its pieces moved (http, shm)
        self.stream_bytes = counter("kv_stream_bytes", "KV payload bytes a decode node received "
                                    "in streamed handoffs, by transport.", ("transport",), _DECODE_ROLES)
        self.stream_seconds = histogram("kv_stream_seconds", "A streamed handoff from its stream "
                                        "opened to its end (the prefill included), by transport.",
                                        KV_SECONDS_BUCKETS, ("transport",), _DECODE_ROLES)
        self.stream_overlap = histogram("kv_stream_overlap_ratio", "Share of a streamed handoff's "
                                        "KV bytes that arrived before its first token, by transport.",
                                        (0.0, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0), ("transport",), _DECODE_ROLES)
        self.install_seconds = histogram("kv_install_seconds", "Installing a handed-off cache into "
                                         "the decode node's batch, by transport (pull: the whole "
                                         "payload's checks too).", KV_SECONDS_BUCKETS, ("transport",),
                                         _DECODE_ROLES)
        self.first_to_second = histogram("kv_first_to_second_token_seconds", "A handed-off request's "
                                         "first token passed on to its second token out of the "
                                         "decode node, by transport.", KV_SECONDS_BUCKETS, ("transport",),
                                         _DECODE_ROLES)
        self.lease_expired = counter("kv_lease_expired", "Held KV caches never taken before their "
                                     "lease expired.", roles=_PREFILL_ROLES).labels(role)
        # create the usual children, so a scrape shows zeros before the first request
        for source in ("transferred", "computed_locally"):
            self._by_source.labels(role, source)
        for direction in _KV_DIRECTIONS.get(role, ()):
            self.kv_bytes.labels(role, direction)
        self._reads: dict[RequestId, _Timing] = {}  # a front end's generations, from their start
        # a decode node's KV pulls under way, until their KvReceived is applied (it is posted before
        # the pull's work ends, and applied after) or the request ends
        self._pull_started: dict[RequestId, float] = {}
        self._pulled_installs: set[RequestId] = set()  # installs of a pulled payload under way
        self._engine: Engine | None = None  # an engine node's (what its events are read against)
        self._handoffs: HandoffLog | None = None
        self._terminal: frozenset[str] = frozenset()
        self.model_name = model_name

    # -- serving -----------------------------------------------------------------------------

    def route(self) -> BaseRoute:
        return metrics_route(self.registry)

    def kv_served(self, nbytes: int) -> None:
        """KV sent: a streamed piece's, a pulled payload's or pulled prefix blocks' bytes, however
        it travelled (the node API tells it)."""
        _safely("kv served", lambda: self.kv_bytes.labels(self.role, "served").inc(nbytes))

    def watch(self, runner: NodeRunner[Any], *, engine: Engine | None = None,
              handoffs: HandoffLog | None = None, peers: PeerSet | None = None,
              kv_buffer_bytes: Callable[[], int] | None = None,
              prefix_pulls: Callable[[], PrefixPullStatistics] | None = None) -> None:
        """Observe the runner (an instrument of it) and collect live counts from the runner, the
        engine and the peers at scrape time. `engine` makes this an engine node's metrics (its
        events and work are read; `handoffs` is its performer's record of each handoff)."""
        self._terminal = frozenset(phase.value for phase in runner.machine.terminal)
        self._engine = engine
        self._handoffs = handoffs
        runner.instruments.add(self)
        live = _LiveCollector(self.role, runner, engine, peers, kv_buffer_bytes, prefix_pulls)
        self.registry.register(live)
        if self.front_end or engine is not None:
            self.registry.register(_VllmNames(self, live))

    # -- the runner's transitions ----------------------------------------------------------------

    def transition(self, request_id: RequestId, old: str, new: str, event: str,
                   error: ErrorInfo | None, outcome: str | None, context: object) -> None:
        if new not in self._terminal:
            return
        self._pull_started.pop(request_id, None)
        self._pulled_installs.discard(request_id)
        self.requests.labels(self.role, new, outcome or "unknown").inc()
        if new == "failed" and error is not None and error.code is Code.LEASE_EXPIRED:
            self.lease_expired.inc()
        # an engine node's requests' clocks are their runner's records (`NodeRequest.opened_at`)
        if not self.front_end and isinstance(context, NodeRequest) and new != "cancelled":
            self.e2e.observe(time.monotonic() - context.opened_at)

    # -- an engine node's events and work ------------------------------------------------------

    def applied(self, request_id: RequestId, event: Event, context: object) -> None:
        if self._engine is None:
            return
        ctx = context if isinstance(context, NodeRequest) else None
        if isinstance(event, KvReceived):
            started = self._pull_started.pop(request_id, None)
            self.kv_bytes.labels(self.role, "received").inc(event.nbytes)
            if started is not None:
                self.kv_seconds.observe(time.monotonic() - started)
            self.prompt_source("transferred", len(ctx.prompt) if ctx is not None else 0)
            return
        if self.front_end or not isinstance(event, TokensGenerated | PrefillDone):
            return
        if isinstance(event, PrefillDone):
            if ctx is not None and ctx.ends_at_first_token:  # EOS: not an output token
                return
            # a decode node's streamed handoff: its first token was computed (and counted) on the prefill node
            if ctx is not None and ctx.streamed:
                return
        if ctx is not None:
            self.engine_token(ctx, len(event.tokens) if isinstance(event, TokensGenerated) else 1)

    def work_started(self, intent: WorkIntent, context: object) -> None:
        if self._engine is None:
            return
        if isinstance(intent, FetchKv):
            self._pull_started[intent.request_id] = time.monotonic()
        # a pulled cache that fails to install (checksum, version, fingerprint) is a failed handoff
        elif (isinstance(intent, InstallKv) and isinstance(context, NodeRequest)
              and context.payload is not None):
            self._pulled_installs.add(intent.request_id)

    def work_ended(self, intent: WorkIntent, context: object, failure: Exception | None) -> None:
        if self._engine is None:
            return
        rid = intent.request_id
        pulled_install = rid in self._pulled_installs and isinstance(intent, InstallKv)
        if pulled_install:
            self._pulled_installs.discard(rid)
        if failure is not None:
            if isinstance(intent, FetchKv) or pulled_install:
                code = failure.info.code.value if isinstance(failure, StatecoreError) else "internal"
                self.kv_failures.labels(self.role, code).inc()
            return
        ctx = context if isinstance(context, NodeRequest) else None
        if ctx is not None and (ctx.streamed or ctx.prefill_url is not None):
            self._observe_handoff(intent, rid, ctx.streamed)
        if isinstance(intent, StartPrefill):
            self.prompt_source("computed_locally", len(ctx.prompt) if ctx is not None else 0)

    def _observe_handoff(self, intent: WorkIntent, rid: RequestId, streamed: bool) -> None:
        """A decode node's handoff, from its record, as each part of it ends: a stream's by the
        transport its pieces took (http, shm), a pulled one's as "pull"."""
        record = None if self._handoffs is None else self._handoffs.get(rid)
        if record is None:  # none, or the ring no longer holds it: nothing to observe
            return
        transport = (record.transport or "http") if streamed else "pull"
        role = self.role
        if isinstance(intent, FetchKv) and record.stream_s is not None:
            self.stream_bytes.labels(role, transport).inc(record.wire_bytes or 0)
            self.stream_seconds.labels(role, transport).observe(record.stream_s)
            if record.overlap is not None:
                self.stream_overlap.labels(role, transport).observe(record.overlap)
        elif isinstance(intent, InstallKv) and record.install_s is not None:
            self.install_seconds.labels(role, transport).observe(record.install_s)
        elif isinstance(intent, StartDecode) and record.first_to_second_s is not None:
            self.first_to_second.labels(role, transport).observe(record.first_to_second_s)

    # -- a front end's generations, as the client reads them --------------------------------------

    def generation_started(self, request_id: RequestId, prompt_tokens: int) -> None:
        if self.front_end:
            self._reads[request_id] = _Timing(time.monotonic())
            self.prompt_tokens.inc(prompt_tokens)

    def generation_refused(self, error: ErrorInfo) -> None:
        """A request refused at intake, before the runner saw it (overloaded, draining, ...)."""
        if self.front_end:
            self.requests.labels(self.role, "rejected", error.code.value).inc()

    def reply_read(self, request_id: RequestId, reply: Reply, generated: int) -> None:
        timing = self._reads.get(request_id)
        if timing is None:
            return
        match reply:
            case RespondTokens():
                self.token(timing, generated)
            case Complete():
                self.generation_tokens.inc(generated)  # the EOS token, as usage.completion_tokens counts it
                self._read_all(request_id, observe=True)
            case Reject():
                self._read_all(request_id, observe=True)

    def generation_stopped(self, request_id: RequestId) -> None:
        self._read_all(request_id, observe=True)  # a stop string ended it: the client got its last output

    def generation_cancelled(self, request_id: RequestId) -> None:
        self._read_all(request_id, observe=False)

    def _read_all(self, request_id: RequestId, *, observe: bool) -> None:
        timing = self._reads.pop(request_id, None)
        if timing is not None and observe:
            self.e2e.observe(time.monotonic() - timing.start)

    # -- observations ------------------------------------------------------------------------

    def token(self, timing: _Timing, tokens: int = 1) -> None:
        timing.last_token = self._tokens_at(timing.start, timing.last_token, tokens)

    def _tokens_at(self, start: float, last_token: float | None, tokens: int) -> float:
        """`tokens` out now together (a step's), for a request started at `start` whose last token
        came at `last_token`: the first's TTFT or inter-token latency observed, the others' as 0
        (they came with it); returns now."""
        now = time.monotonic()
        if last_token is None:
            self.ttft.observe(now - start)
        else:
            self.itl.observe(now - last_token)
        for _ in range(tokens - 1):
            self.itl.observe(0.0)
        self.generation_tokens.inc(tokens)
        return now

    def engine_token(self, ctx: NodeRequest, tokens: int = 1) -> None:
        """Tokens this (prefill or decode) node generated together for a live request (its
        runner's record)."""
        ctx.last_token_at = self._tokens_at(ctx.opened_at, ctx.last_token_at, tokens)

    def prompt_source(self, source: str, tokens: int) -> None:
        self._by_source.labels(self.role, source).inc(tokens)
        if not self.front_end:
            self.prompt_tokens.inc(tokens)


# ---------------------------------------------------------------------------------------------
# Scrape-time collection


def _per_role(family: type[CounterMetricFamily] | type[GaugeMetricFamily], role: str,
              rows: Iterable[tuple[str, str, float]]) -> Iterable[Metric]:
    """One metric family per (name, doc, value), each with the node's role as its one label."""
    for name, doc, value in rows:
        metric = family(PREFIX + name, doc, labels=["role"])
        metric.add_metric([role], value)
        yield metric


class _LiveCollector:
    """Live counts read when Prometheus scrapes, never pushed from the hot path."""

    def __init__(self, role: str, runner: NodeRunner[Any], engine: Engine | None,
                 peers: PeerSet | None, kv_buffer_bytes: Callable[[], int] | None,
                 prefix_pulls: Callable[[], PrefixPullStatistics] | None = None) -> None:
        self.prefix_pulls = prefix_pulls
        self.role = role
        self.runner = runner
        self.engine = engine
        self.peers = peers
        self.kv_buffer_bytes = kv_buffer_bytes

    def collect(self) -> Iterable[Metric]:
        role = self.role
        initial = self.runner.machine.initial
        loop_stats = self.runner.statistics()
        in_phase = dict(loop_stats.live_phases)
        waiting = in_phase.get(initial.value, 0)
        for name, doc, value in (
            ("num_requests_running", "Live requests past intake.", loop_stats.live_requests - waiting),
            ("num_requests_waiting", "Live requests still at intake.", waiting),
            ("loop_ready", "1 while this node's serving loop accepts requests.", int(self.runner.ready())),
        ):
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["role"])
            gauge.add_metric([role], value)
            yield gauge
        by_phase = GaugeMetricFamily(PREFIX + "requests_in_phase", "Live requests by phase.",
                                     labels=["role", "phase"])
        for phase in self.runner.machine.all_phases:
            if not self.runner.machine.is_terminal(phase):
                by_phase.add_metric([role, phase.value], in_phase.get(phase.value, 0))
        yield by_phase
        bugs = CounterMetricFamily(PREFIX + "loop_bugs", "Bugs the loop caught and survived.",
                                   labels=["role"])
        bugs.add_metric([role], loop_stats.bugs)
        yield bugs
        if self.engine is not None:
            stats = self.engine.statistics()
            yield from _per_role(CounterMetricFamily, role, (
                ("engine_step_retries", "Model calls the engine computed again after one raised "
                 "(a transient error that failed no request).", stats.step_retries),
                ("engine_rows_isolated", "Requests failed alone because their row's model call kept "
                 "raising; the rest of their batch step went on.", stats.rows_isolated),
                ("prefix_cache_hits", "Prompts that started from blocks the prefix cache kept.",
                 stats.prefix_cache_hits),
                ("prefix_cache_tokens_reused", "Prompt tokens not computed because the prefix cache kept "
                 "them.", stats.prefix_tokens_reused),
                ("prefix_cache_queries", "Prompts looked up in the prefix cache (those with at least one "
                 "whole block).", stats.prefix_cache_queries),
                ("conversations_kept", "Finished requests whose prompt and generated tokens' whole "
                 "chunks were computed again and kept for their next turn (--keep-conversations).",
                 stats.conversations_kept),
                ("conversation_tokens_kept", "Tokens of whole chunks computed again to keep finished "
                 "conversations.", stats.conversation_tokens_kept),
                ("speculative_steps", "Verify steps of speculative decoding (--speculative).",
                 stats.speculative_steps),
                ("speculative_draft_tokens", "Draft tokens verify steps checked.", stats.speculative_drafted),
                ("speculative_accepted_tokens", "Draft tokens that stood (acceptance rate = accepted / "
                 "draft tokens).", stats.speculative_accepted),
                ("speculative_emitted_tokens", "Tokens verify steps emitted (tokens per step = emitted / "
                 "steps).", stats.speculative_emitted),
                ("prefix_cache_evictions", "Prompt blocks that left the device's prefix cache, for its "
                 "capacity or for a request that needed the memory (into the host tier when it is on, "
                 "else forgotten).", stats.prefix_cache_evictions),
                ("prefix_host_blocks_out", "Prompt blocks copied into the prefix cache's host tier as they "
                 "left the device.", stats.prefix_host_out),
                ("prefix_host_blocks_back", "Host-tier blocks a prompt took back to the device instead of "
                 "computing them.", stats.prefix_host_back),
                ("prefix_host_blocks_forgotten", "Host-tier blocks forgotten to stay within "
                 "--prefix-host-bytes.", stats.prefix_host_forgotten),
                ("engine_prefill_capped_steps", "Steps whose planned prefill work was cut to fit "
                 "--kv-memory-bytes beside the KV held (--prefill-memory-cap).", stats.prefill_capped_steps),
                ("engine_activation_overruns", "Steps whose estimated activations went over the memory "
                 "budget anyway: the oldest prompt's next prefill unit, run alone.",
                 stats.activation_overruns),
            ))
            seconds = CounterMetricFamily(PREFIX + "engine_device_seconds", "Device-thread time by kind "
                                          "of work (step, decode_build, launch, readback, prefill_chunks, "
                                          "prefill_batched, prefill_stacked, other_job).",
                                          labels=["role", "kind"])
            calls = CounterMetricFamily(PREFIX + "engine_device_calls", "Device-thread calls by kind of "
                                        "work; decode_rows counts decoded rows (rows per step = "
                                        "decode_rows / step).", labels=["role", "kind"])
            for kind, count, spent in stats.device_time:
                calls.add_metric([role, kind], count)
                if kind != "decode_rows":
                    seconds.add_metric([role, kind], spent)
            yield seconds
            yield calls
            yield from _per_role(GaugeMetricFamily, role, (
                ("kv_held_bytes", "Bytes of prefilled KV caches held for a handoff.", stats.held_bytes),
                ("kv_held_caches", "Prefilled KV caches held for a handoff.", stats.held_caches),
                ("num_requests_decoding", "Requests in the engine's decoder.", stats.decoding),
                ("kv_reserved_bytes", "KV bytes live requests reserved for their own caches.",
                 stats.kv_reserved_bytes),
                ("kv_budget_bytes", "KV bytes requests may reserve in all (--kv-memory-bytes less the "
                 "slot layout's share).", stats.kv_budget_bytes),
                ("device_memory_bytes", "Bytes the device allocator holds now (weights, caches, "
                 "activations).", stats.device_memory_bytes),
                ("prefix_cache_bytes", "Bytes of prompt blocks the prefix cache keeps (they give way to "
                 "requests).", stats.prefix_cache_bytes),
                ("prefix_host_bytes", "Bytes of prompt blocks the prefix cache's host tier holds "
                 "(host memory, within --prefix-host-bytes).", stats.prefix_host_bytes),
                ("prefix_host_capacity_bytes", "The prefix cache's host tier's capacity "
                 "(--prefix-host-bytes; 0: off).", stats.prefix_host_capacity_bytes),
                ("engine_activation_estimate_peak_bytes", "The largest estimate of one step's transient "
                 "activations so far (steps under --prefill-memory-cap).",
                 stats.activation_estimate_peak_bytes),
            ))
        if self.prefix_pulls is not None:
            pulls = self.prefix_pulls()
            by_outcome = CounterMetricFamily(PREFIX + "prefix_pulls", "Prompts the router said a decode "
                                             "node holds the start of, by what this prefill node did: "
                                             "pulled its blocks, skipped (--prefix-pull, its own cache, "
                                             "or it would not pay), or failed (then computed).",
                                             labels=["role", "outcome"])
            for outcome in PULL_OUTCOMES:
                by_outcome.add_metric([role, outcome], getattr(pulls, outcome))
            yield by_outcome
            yield from _per_role(CounterMetricFamily, role, (
                ("prefix_pull_tokens", "Prompt tokens pulled from decode nodes' prefix caches instead "
                 "of computed.", pulls.tokens),
                ("prefix_pull_bytes", "KV bytes of those pulls.", pulls.nbytes),
                ("prefix_pull_seconds", "Time those pulls took, their import included.", pulls.seconds),
            ))
        if self.kv_buffer_bytes is not None:
            kept = GaugeMetricFamily(PREFIX + "kv_receive_buffer_bytes", "Bytes of receive buffers kept "
                                     "for reuse by KV pulls (bounded by --kv-buffer-bytes; not a leak).",
                                     labels=["role"])
            kept.add_metric([role], self.kv_buffer_bytes())
            yield kept
        if self.peers is not None:
            up = GaugeMetricFamily(PREFIX + "peer_up", "1 while the router sends work to the node "
                                   "(its health machine is up or suspect), else 0.",
                                   labels=["role", "node", "node_role"])
            for node_role, urls in self.peers.roles.items():
                for url in urls:
                    up.add_metric([role, url, node_role], int(url in self.peers.available))
            yield up
            routed = CounterMetricFamily(PREFIX + "router_routed", "Requests the router sent to a node, "
                                         "by the node's role and the basis of the choice (prefix: the node "
                                         "was expected to hold some of the prompt; load: least new work "
                                         "and load without that).",
                                         labels=["role", "node", "node_role", "basis"])
            for (node_role, url, basis), count in sorted(self.peers.routed.items()):
                routed.add_metric([role, url, node_role, basis], count)
            yield routed
            expected = CounterMetricFamily(PREFIX + "router_expected_cached_tokens", "Prompt tokens the "
                                           "router expected the chosen node's prefix cache to hold.",
                                           labels=["role", "node"])
            for url, tokens in sorted(self.peers.expected_cached_tokens.items()):
                expected.add_metric([role, url], tokens)
            yield expected
            routes = CounterMetricFamily(PREFIX + "router_routes", "Turns by where their prompt was "
                                         "prefilled: prefix_hit_local (on the decode node holding its "
                                         "start, only the rest), local (a short prompt, on a decode "
                                         "node), prefill_node (on a prefill node, KV handed off), "
                                         "prefill_node_prefix (likewise, the prefill node told which "
                                         "decode node holds the start, for it to pull).",
                                         labels=["role", "route"])
            for route in TurnRoute:
                routes.add_metric([role, route.value], self.peers.routes.get(route.value, 0))
            yield routes


# Our families that mean what vLLM's of these names mean (vLLM v1, docs/operations.md), served
# beside ours so that dashboards and AIPerf's server metrics built for vLLM work unchanged.
VLLM_NAMES = {
    "time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    # vLLM 0.10 renamed time_per_output_token to inter_token_latency; dashboards use either
    "inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
}


class _VllmNames:
    """vLLM's names for the families of ours that mean the same, labelled as vLLM labels them
    (`model_name`), read from ours at scrape time: on the nodes that answer clients (single,
    router), where the meaning is the client's view as on a vLLM server, and on engine nodes for
    the KV cache's use. Also `vllm:request_success_total{finished_reason}` (requests that ended
    with stop or length; a client's cancellation is vLLM's `abort`) and
    `vllm:kv_cache_usage_perc` (KV reserved / KV budget, 0 to 1)."""

    def __init__(self, metrics: Metrics, live: _LiveCollector) -> None:
        self.metrics = metrics
        self.live = live

    def collect(self) -> Iterable[Metric]:
        model = self.metrics.model_name or ""
        if self.metrics.front_end:
            sources: list[Iterable[Metric]] = [self.live.collect()]
            for family in (self.metrics.ttft, self.metrics.itl, self.metrics.e2e,
                           self.metrics.prompt_tokens, self.metrics.generation_tokens):
                sources.append(family.collect())
            for metric in (m for source in sources for m in source):
                for name in VLLM_NAMES.get(metric.name.removeprefix(PREFIX), ()):
                    yield _renamed(metric, name, model)
            yield self._success(model)
        stats = self.live.engine.statistics() if self.live.engine is not None else None
        if stats is not None and stats.kv_budget_bytes > 0:
            usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV cache usage: 1 means full.",
                                      labels=["model_name"])
            usage.add_metric([model], min(1.0, stats.kv_reserved_bytes / stats.kv_budget_bytes))
            yield usage

    def _success(self, model: str) -> Metric:
        success = CounterMetricFamily("vllm:request_success", "Requests that finished, by finish reason.",
                                      labels=["model_name", "finished_reason"])
        counts: dict[str, float] = {"stop": 0.0, "length": 0.0, "abort": 0.0}
        for metric in self.metrics.requests.collect():
            for sample in metric.samples:
                if not sample.name.endswith("_total"):
                    continue
                state, reason = sample.labels["state"], sample.labels["reason"]
                if state == "done" and reason in counts:
                    counts[reason] += sample.value
                elif state == "cancelled":
                    counts["abort"] += sample.value
        for reason, count in counts.items():
            success.add_metric([model, reason], count)
        return success


def _renamed(metric: Metric, name: str, model: str) -> Metric:
    """`metric` under vLLM's name, its `role` label replaced by vLLM's `model_name`."""
    copy = Metric(name, metric.documentation, metric.type)
    for sample in metric.samples:
        labels = {k: v for k, v in sample.labels.items() if k != "role"}
        copy.add_sample(name + sample.name.removeprefix(metric.name), {"model_name": model, **labels},
                        sample.value, sample.timestamp, sample.exemplar)
    return copy


__all__ = ["FRONT_END_ROLES", "PREFIX", "Metrics", "metrics_route"]
