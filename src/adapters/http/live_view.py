"""The live view at `GET /ui`: a page that draws this node's state machines and keeps them
current through server-sent events.

Every node (single, prefill, decode, router) serves the same three static files (HTML, JS,
CSS, shipped as package data under `adapters/ui`; no build step, nothing fetched from
elsewhere), the machines it runs as data (`GET /ui/graph.json`, from `statecore.diagram`, the
same edges the docs' diagrams draw) and one event stream (`GET /ui/events`). The stream is fed
only from what the node already knows: the runner's transition hook (chained, like the
metrics' and the logger's), the live records the runner holds, the router's peer-health
machines, and the node's Prometheus registry, read once a second into rates (tokens/s, KV
bytes/s) and the mean time to first token of the requests that got one in that second.

Nothing here may slow or break serving: a transition costs one append to a bounded ring and
one `trio.Event.set()`; each viewer's message is built at most ten times a second from those
rings; the stream ends by itself when the loop stops, so an open tab never holds a draining
node past its drain. This is an adapter: it may import anything, and nothing in `statecore`
or `effects` imports it.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import asdict, dataclass
from importlib.resources import files
from typing import Any

import trio
from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from adapters.http.streaming import WatchedStream
from adapters.metrics import PREFIX
from effects.health import PeerSet
from effects.runner import Instrument, NodeRunner
from statecore.diagram import graph_data
from statecore.errors import ErrorInfo
from statecore.ids import RequestId
from statecore.phases import PeerPhase
from statecore.table import PEER_HEALTH, SERVING_LOOP

log = logging.getLogger("statecore.live_view")

TRANSITIONS_KEPT = 200  # what a newly opened page can scroll back through
SAMPLES_KEPT = 120  # two minutes of sparkline at one sample a second
SAMPLE_INTERVAL_S = 1.0
# A burst of transitions (a batch of requests finishing) goes out as one message rather than
# one message each: the stream waits this long after a change before it builds the next one.
COALESCE_S = 0.1

_STATIC = {
    "/ui": ("index.html", "text/html; charset=utf-8"),
    "/ui/live.js": ("live.js", "text/javascript; charset=utf-8"),
    "/ui/live.css": ("live.css", "text/css; charset=utf-8"),
}


@dataclass(frozen=True, slots=True)
class Transition:
    """One phase change as the page shows it: a request's, or (router) a peer's health."""

    seq: int
    at: float  # wall clock, seconds
    machine: str
    subject: str  # the request id, or the peer's URL
    source: str
    target: str
    event: str
    reason: str | None


@dataclass(frozen=True, slots=True)
class Sample:
    """One second of this node's traffic, from its metrics' totals."""

    seq: int
    at: float  # wall clock, seconds
    tokens_per_s: float
    ttft_s: float | None  # mean over the requests whose first token came in this interval
    kv_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class _Totals:
    tokens: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    kv_bytes: float = 0.0


def read_totals(registry: CollectorRegistry, role: str) -> _Totals:
    """The counters the sparklines are rates of, in one pass over the registry."""
    wanted = {
        PREFIX + "generation_tokens_total": "tokens",
        PREFIX + "time_to_first_token_seconds_sum": "ttft_sum",
        PREFIX + "time_to_first_token_seconds_count": "ttft_count",
        PREFIX + "kv_transfer_bytes_total": "kv_bytes",  # received and served alike
    }
    totals = dict.fromkeys(wanted.values(), 0.0)
    # only the collectors of these series: the whole registry (every histogram's buckets, the
    # engine's gauges) is what a scrape reads, and this runs every second, watched or not
    for family in registry.restricted_registry(list(wanted)).collect():
        for sample in family.samples:
            field = wanted.get(sample.name)
            if field is not None and sample.labels.get("role") == role:
                totals[field] += sample.value
    return _Totals(**totals)


def sample_between(seq: int, at: float, before: _Totals, after: _Totals, seconds: float) -> Sample:
    """The rates over one interval; a counter that went backwards (never, in one process) counts 0."""
    firsts = after.ttft_count - before.ttft_count
    return Sample(
        seq=seq,
        at=at,
        tokens_per_s=max(0.0, after.tokens - before.tokens) / seconds,
        ttft_s=(after.ttft_sum - before.ttft_sum) / firsts if firsts > 0 else None,
        kv_bytes_per_s=max(0.0, after.kv_bytes - before.kv_bytes) / seconds,
    )


def _static(name: str) -> bytes:
    return (files("adapters") / "ui" / name).read_bytes()


class _Transitions(Instrument):
    """A request's transitions as the page is sent them."""

    def __init__(self, view: LiveView, machine: str) -> None:
        self.view = view
        self.machine = machine

    def transition(self, request_id: RequestId, old: str, new: str, event: str,
                   error: ErrorInfo | None, outcome: str | None, context: object) -> None:
        # `outcome`: the terminal reason in every node's words
        reason = outcome or (error.code.value if error else None)
        self.view._record(self.machine, request_id, old, new, event, reason)


class LiveView:
    """What one node's page shows, and the routes that serve it.

    `run` (started in the node's nursery) samples the metrics and ends every stream once the
    loop stops; the constructor adds its request transitions' observer to the runner's
    instruments and chains the peers' change hook."""

    def __init__(self, role: str, runner: NodeRunner[Any], registry: CollectorRegistry, *,
                 peers: PeerSet | None = None, sample_interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.role = role
        self.runner = runner
        self.registry = registry
        self.peers = peers
        self.sample_interval_s = sample_interval_s
        self.transitions: deque[Transition] = deque(maxlen=TRANSITIONS_KEPT)
        self.samples: deque[Sample] = deque(maxlen=SAMPLES_KEPT)
        self._seq = 0
        # names this process in the stream's event ids, so a page that reconnects to a restarted
        # node starts over instead of skipping the new process's first transitions
        self.boot = secrets.token_hex(4)
        self._changed = trio.Event()
        self._closed = False
        self._files = {path: (_static(name), media) for path, (name, media) in _STATIC.items()}
        machines = [runner.machine, SERVING_LOOP] + ([PEER_HEALTH] if peers is not None else [])
        self._graph = {"role": role, "request_machine": runner.machine.name,
                       "machines": [graph_data(m) for m in machines]}
        self._chain_hooks()

    # -- feeding -----------------------------------------------------------------------------

    def _chain_hooks(self) -> None:
        self.runner.instruments.add(_Transitions(self, self.runner.machine.name))
        peers = self.peers
        if peers is None:
            return
        known = {url: record.phase for url, record in peers.records.items()}
        previous_peer = peers.on_change

        def on_change(url: str, phase: PeerPhase) -> None:
            if previous_peer is not None:
                previous_peer(url, phase)
            old = known.get(url, PEER_HEALTH.initial)
            known[url] = phase
            self._record(PEER_HEALTH.name, url, old.value, phase.value, "", None)

        peers.on_change = on_change

    def _record(self, machine: str, subject: str, old: str, new: str, event: str,
                reason: str | None) -> None:
        self._seq += 1
        self.transitions.append(Transition(self._seq, time.time(), machine, subject, old, new, event,
                                           reason))
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Sample the metrics every interval until cancelled; end the streams when the loop stops."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._close_when_stopped)
            task_status.started()
            before, then = read_totals(self.registry, self.role), trio.current_time()
            seq = 0
            while True:
                await trio.sleep(self.sample_interval_s)
                try:
                    after, now = read_totals(self.registry, self.role), trio.current_time()
                except Exception:  # a broken collector costs the sparklines a point, never the node
                    log.exception("live view: reading the metrics failed")
                    continue
                seq += 1
                self.samples.append(sample_between(seq, time.time(), before, after, now - then))
                before, then = after, now
                self._notify()

    async def _close_when_stopped(self) -> None:
        await self.runner.wait_stopped()
        self._closed = True
        self._notify()

    # -- reading -----------------------------------------------------------------------------

    def message(self, *, after_transition: int, after_sample: int) -> dict[str, Any]:
        """What a viewer has not seen yet (transitions and samples past the given sequence
        numbers), with the counts as they are now."""
        stats = self.runner.statistics()
        live = dict(stats.live_phases)
        doc: dict[str, Any] = {
            "role": self.role,
            "boot": self.boot,
            "loop": stats.phase.value,
            "live": live,
            "ended": stats.outcomes,  # requests that reached each terminal phase, ever
            "transitions": [asdict(t) for t in self.transitions if t.seq > after_transition],
            "samples": [asdict(s) for s in self.samples if s.seq > after_sample],
            "closing": self._closed,
        }
        if self.peers is not None:
            doc["peers"] = [
                {"url": url, "role": role, "phase": self.peers.phase(url).value,
                 "in_flight": self.peers.in_flight.get(url, 0)}
                for role, urls in self.peers.roles.items() for url in urls
            ]
        return doc

    def resume_point(self, last_event_id: str | None) -> tuple[int, int]:
        """The (transition, sample) sequence numbers a reconnecting page has already seen, from
        the `Last-Event-ID` its browser sends; (0, 0) for a new page or another process's id."""
        boot, _, rest = (last_event_id or "").partition(".")
        seen_transition, _, seen_sample = rest.partition(".")
        if boot != self.boot or not seen_transition.isdigit() or not seen_sample.isdigit():
            return 0, 0
        return int(seen_transition), int(seen_sample)

    async def _stream(self, seen_transition: int, seen_sample: int) -> AsyncGenerator[bytes, None]:
        yield b"retry: 2000\n\n"
        while True:
            changed = self._changed  # taken before the message, so no change slips between
            doc = self.message(after_transition=seen_transition, after_sample=seen_sample)
            if doc["transitions"]:
                seen_transition = doc["transitions"][-1]["seq"]
            if doc["samples"]:
                seen_sample = doc["samples"][-1]["seq"]
            data = json.dumps(doc, separators=(",", ":"))
            yield f"id: {self.boot}.{seen_transition}.{seen_sample}\ndata: {data}\n\n".encode()
            if self._closed:
                return
            # at least one message per sample interval, so the page can tell it is still live
            with trio.move_on_after(self.sample_interval_s):
                await changed.wait()
            await trio.sleep(COALESCE_S)

    # -- serving -----------------------------------------------------------------------------

    def routes(self) -> list[BaseRoute]:
        """`/ui` and its files, `/ui/graph.json` and `/ui/events`; unauthenticated, like
        `/metrics` (nothing here controls the node)."""

        async def static(request: Request) -> Response:
            body, media = self._files[request.url.path]
            return Response(body, media_type=media, headers={"Cache-Control": "no-cache"})

        async def graph(request: Request) -> Response:
            return JSONResponse(self._graph)

        async def events(request: Request) -> Response:
            seen = self.resume_point(request.headers.get("last-event-id"))
            return WatchedStream(self._stream(*seen), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

        return [
            *(Route(path, static, methods=["GET"]) for path in self._files),
            Route("/ui/graph.json", graph, methods=["GET"]),
            Route("/ui/events", events, methods=["GET"]),
        ]


__all__ = ["COALESCE_S", "LiveView", "Sample", "Transition", "read_totals", "sample_between"]
