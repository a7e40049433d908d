"""The router's view of its peers: one peer-health machine per node, probed on a timer.

`PeerSet` steps each node's `PeerRecord` through the core's peer table (a circuit breaker:
unknown -> up -> suspect -> down -> probing -> up) on probe results and on request failures,
performs the intents (mark available or not, arm the cooldown, probe now), and picks an
available node for a role: by the core's `statecore.routing.choose_node` (new prefill work plus
load) when it knows the nodes' prefix summaries (`effects.routing`), else the least loaded; and
chooses a turn's route (`route`: the core's `choose_route`, counted by route in `routes`). A
node's health is its own loop's `/health`, never its peers'. This module may import `statecore`
and trio; never httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import assert_never

import trio

from effects.routing import PrefixSummaries
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.events import Event, PeerFailed, ProbeFailed, ProbeSucceeded, Timer, TimerFired
from statecore.ids import PeerId
from statecore.intents import IntentKind, PeerIntent, PeerIntentKind
from statecore.phases import PeerPhase
from statecore.policy import blames_peer
from statecore.routing import (
    DEFAULT_LOAD_TOKENS,
    Overflow,
    Route,
    RouteCandidate,
    RouteChoice,
    avoiding,
    choose_node,
    choose_route,
)
from statecore.step import PeerRecord, event_error, step_peer

log = logging.getLogger("statecore.health")

Probe = Callable[[str], Awaitable[bool]]


class PeerSet:
    def __init__(
        self,
        nodes: Mapping[str, list[str]],  # role -> urls
        probe: Probe,
        *,
        interval_s: float = 1.0,
        cooldown_s: float = 3.0,
        summaries: PrefixSummaries | None = None,
        load_tokens: int = DEFAULT_LOAD_TOKENS,
        overflow: Overflow = Overflow.IDLE,
    ) -> None:
        self.roles = {role: list(urls) for role, urls in nodes.items()}
        self.records = {
            url: PeerRecord(PeerId(url)) for urls in self.roles.values() for url in urls
        }
        self.available: set[str] = set()
        self.in_flight: dict[str, int] = {}
        # prompt tokens sent to each node to prefill whose first token is not back (the router's
        # performer keeps it); a busy prefill tier sends prompts to decode nodes as `overflow` allows
        self.prefilling: dict[str, int] = {}
        self.overflow = overflow
        self.probe = probe
        self.interval_s = interval_s
        self.cooldown_s = cooldown_s
        self._nursery: trio.Nursery | None = None
        self.on_change: Callable[[str, PeerPhase], None] | None = None
        self.summaries = summaries
        self.load_tokens = load_tokens
        # Choices made: (role, node, basis) -> count; basis "prefix" when the chosen node was
        # expected to hold some of the prompt, else "load". And the prompt tokens so expected.
        self.routed: Counter[tuple[str, str, str]] = Counter()
        self.expected_cached_tokens: Counter[str] = Counter()
        self.routes: Counter[str] = Counter()  # turns by route (statecore.routing.Route values)

    def phase(self, url: str) -> PeerPhase:
        return self.records[url].phase

    def feed(self, url: str, event: Event) -> None:
        record = self.records.get(url)
        if record is None:
            return
        moved, intents = step_peer(record, event)
        self.records[url] = moved
        if moved.phase is not record.phase:
            log.info("peer %s: %s -> %s on %s%s", url, record.phase.value, moved.phase.value,
                     event.kind.value, _cause(event))
            if self.on_change:
                self.on_change(url, moved.phase)
        for intent in intents:
            if isinstance(intent, PeerIntent):
                self._perform(url, intent.kind)

    def report_failure(self, url: str, error: ErrorInfo) -> None:
        """A request saw this node fail in a way the policy blames on the node."""
        if blames_peer(error):
            self.feed(url, PeerFailed(error))

    def _perform(self, url: str, kind: PeerIntentKind) -> None:
        match kind:
            case IntentKind.MARK_AVAILABLE:
                self.available.add(url)
            case IntentKind.MARK_UNAVAILABLE:
                self.available.discard(url)
            case IntentKind.ARM_COOLDOWN:
                if self._nursery is not None:
                    self._nursery.start_soon(self._cooldown, url)
            case IntentKind.SEND_PROBE:
                if self._nursery is not None:
                    self._nursery.start_soon(self._probe_once, url)
            case _:
                assert_never(kind)

    async def _cooldown(self, url: str) -> None:
        await trio.sleep(self.cooldown_s)
        self.feed(url, TimerFired(Timer.PEER_COOLDOWN))

    async def _probe_once(self, url: str) -> None:
        ok = await self.probe(url)
        self.feed(url, ProbeSucceeded() if ok else ProbeFailed("health check failed"))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            async with trio.open_nursery() as first:
                for url in self.records:
                    first.start_soon(self._probe_once, url)
            task_status.started()
            while True:
                await trio.sleep(self.interval_s)
                for url, record in self.records.items():
                    # down peers wait for their cooldown (half-open), probing ones are in flight
                    if record.phase not in (PeerPhase.DOWN, PeerPhase.PROBING):
                        nursery.start_soon(self._probe_once, url)

    def _available(self, role: str, avoid: set[str]) -> list[str]:
        """The available nodes of a role, those a retry avoids left out unless nothing else is
        left (`statecore.routing.avoiding`)."""
        urls = avoiding([u for u in self.roles.get(role, []) if u in self.available], avoid)
        if not urls:
            raise StatecoreError(
                ErrorInfo(Fault.OVERLOADED, Code.NO_HEALTHY_PEER, f"no healthy {role} node")
            )
        return urls

    def _candidates(self, urls: list[str], prompt: Sequence[int] | None) -> list[RouteCandidate]:
        cached = self.summaries.cached_tokens(urls, prompt) if self.summaries is not None and prompt else {}
        return [RouteCandidate(u, self.in_flight.get(u, 0), self.phase(u) is PeerPhase.SUSPECT,
                               cached.get(u, 0), self.prefilling.get(u, 0))
                for u in urls]

    def prefill_backlog(self, avoid: set[str]) -> int | None:
        """The least prefill queued at a prefill node this attempt may use, as `pick` would choose
        among them (those it avoids left out unless nothing else is left: `avoiding`) (tokens;
        None: no prefill node is up). Whether a backlog sends a prompt elsewhere is
        `statecore.routing.overflows`'s to say, under `self.overflow`."""
        urls = avoiding([u for u in self.roles.get("prefill", []) if u in self.available], avoid)
        if not urls:
            return None
        return min(self.prefilling.get(u, 0) for u in urls)

    def route(self, avoid: set[str], prompt: Sequence[int], request_id: str, local_below: int) -> RouteChoice:
        """A turn's route and decode node (`choose_route` over the available decode nodes), counted
        and logged: prefilled on the decode node that holds its start, on a decode node because
        it is short, or on a prefill node (told where the start is when a decode node holds it)."""
        candidates = self._candidates(self._available("decode", avoid), prompt)
        choice = choose_route(len(prompt), candidates, local_below, self.load_tokens,
                              self.prefill_backlog(avoid), self.overflow)
        self.routes[choice.route.value] += 1
        node = choice.decode
        # chosen for what it holds: it prefills the rest, or a prefill node may pull its blocks
        basis = "prefix" if node.cached_tokens > 0 and choice.route is not Route.PREFILL_NODE else "load"
        self.routed[("decode", node.node, basis)] += 1
        if choice.local:
            self.expected_cached_tokens[node.node] += node.cached_tokens
        if self.summaries is not None and (choice.local or basis == "prefix"):
            # it keeps the prompt's blocks: computed there, or installed from the handoff
            self.summaries.expect(node.node, prompt)
        log.debug("request %s: route %s, decode on %s by %s (%d of %d prompt tokens held by the "
                 "cheapest decode node, local prefill below %d uncached tokens, %d in flight there)",
                 request_id, choice.route.value, node.node, basis, choice.held_tokens, len(prompt),
                 local_below, node.in_flight)
        return choice

    def pick(self, role: str, avoid: set[str], prompt: Sequence[int] | None = None,
             request_id: str | None = None) -> str:
        """An available node of a role, avoiding `avoid` unless nothing else is left; suspect ones
        only if nothing else. With a prompt to prefill and fresh prefix summaries, the node with the
        least new prefill work plus load (`choose_node`); else the least loaded."""
        candidates = self._candidates(self._available(role, avoid), prompt)
        chosen = choose_node(len(prompt or ()), candidates, self.load_tokens)
        basis = "prefix" if chosen.cached_tokens > 0 else "load"
        self.routed[(role, chosen.node, basis)] += 1
        self.expected_cached_tokens[chosen.node] += chosen.cached_tokens
        if prompt is not None and self.summaries is not None:
            self.summaries.expect(chosen.node, prompt)
        if prompt is not None:
            log.debug("request %s: %s on %s by %s (%d of %d prompt tokens expected cached, %d in "
                     "flight there)", request_id or "-", role, chosen.node, basis, chosen.cached_tokens,
                     len(prompt), chosen.in_flight)
        return chosen.node


def _cause(event: Event) -> str:
    """Why a peer's health changed, for its log line: the failure a request saw, or the probe's."""
    error = event_error(event)
    if error is not None:
        return f" ({error.code.value}: {error.message})"
    detail = getattr(event, "detail", "")
    return f" ({detail})" if detail else ""


__all__ = ["PeerSet", "Probe"]
