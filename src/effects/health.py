"""The router's view of its peers: one peer-health machine per node, probed on a timer.

`PeerSet` steps each node's `PeerRecord` through the core's peer table (a circuit breaker:
unknown -> up -> suspect -> down -> probing -> up) on probe results and on request failures,
performs the intents (mark available or not, arm the cooldown, probe now), and picks the
least-loaded available node for a role. A node's health is its own loop's `/health`, never
its peers'. This module may import `statecore` and trio; never httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

import trio

from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.events import Event, PeerFailed, ProbeFailed, ProbeSucceeded, Timer, TimerFired
from statecore.ids import PeerId
from statecore.intents import IntentKind, PeerIntent
from statecore.phases import PeerPhase
from statecore.step import PeerRecord, step_peer

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
    ) -> None:
        self.roles = {role: list(urls) for role, urls in nodes.items()}
        self.records = {
            url: PeerRecord(PeerId(url)) for urls in self.roles.values() for url in urls
        }
        self.available: set[str] = set()
        self.in_flight: dict[str, int] = {}
        self.probe = probe
        self.interval_s = interval_s
        self.cooldown_s = cooldown_s
        self._nursery: trio.Nursery | None = None
        self.on_change: Callable[[str, PeerPhase], None] | None = None

    def phase(self, url: str) -> PeerPhase:
        return self.records[url].phase

    def feed(self, url: str, event: Event) -> None:
        record = self.records.get(url)
        if record is None:
            return
        moved, intents = step_peer(record, event)
        self.records[url] = moved
        if moved.phase is not record.phase:
            log.info("peer %s: %s -> %s on %s", url, record.phase.value, moved.phase.value,
                     event.kind.value)
            if self.on_change:
                self.on_change(url, moved.phase)
        for intent in intents:
            if isinstance(intent, PeerIntent):
                self._perform(url, intent.kind)

    def report_failure(self, url: str, error: ErrorInfo) -> None:
        """A request saw this node fail at the transport level."""
        if error.fault in (Fault.TRANSPORT, Fault.PEER):
            self.feed(url, PeerFailed(error))

    def _perform(self, url: str, kind: IntentKind) -> None:
        if kind is IntentKind.MARK_AVAILABLE:
            self.available.add(url)
        elif kind is IntentKind.MARK_UNAVAILABLE:
            self.available.discard(url)
        elif kind is IntentKind.ARM_COOLDOWN and self._nursery is not None:
            self._nursery.start_soon(self._cooldown, url)
        elif kind is IntentKind.SEND_PROBE and self._nursery is not None:
            self._nursery.start_soon(self._probe_once, url)

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

    def pick(self, role: str, avoid: set[str]) -> str:
        """The least-loaded available node of a role; suspect ones only if nothing else."""
        candidates = [u for u in self.roles.get(role, []) if u in self.available and u not in avoid]
        if not candidates:
            candidates = [u for u in self.roles.get(role, []) if u in self.available]
        if not candidates:
            raise StatecoreError(
                ErrorInfo(Fault.OVERLOADED, Code.NO_HEALTHY_PEER, f"no healthy {role} node")
            )
        return min(candidates, key=lambda u: (self.phase(u) is PeerPhase.SUSPECT, self.in_flight.get(u, 0)))


__all__ = ["PeerSet", "Probe"]
