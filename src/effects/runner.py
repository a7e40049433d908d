"""The runner: one nursery per serving loop; receive -> step -> perform -> feed back.

`NodeRunner` owns a `LoopState` from the pure core and a bounded channel of envelopes. For
each envelope it calls `loop_step` and performs the intents: timers and responses itself,
the role's work (prefill, decode, KV moves) through a `Performer`. Work runs in child tasks
inside the request's own cancel scope; a child that raises posts a failure event for *its*
request and never reaches the nursery, so one request cannot end the loop (trio's strict
exception groups would otherwise cancel everything). Cleanup intents run shielded, with a
deadline, after a request's scope is cancelled. Only `TransportLost` or a finished drain
stops the loop. This module may import `statecore` and trio; never httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import trio

from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.events import EngineFailed, Event, LoopReady, PeerFailed, Timer, TimerFired, TransportLost
from statecore.ids import RequestId
from statecore.intents import (
    ArmTimer,
    CancelRemote,
    CancelTimer,
    Complete,
    FetchKv,
    InstallKv,
    Intent,
    IntentKind,
    LoopIntent,
    PeerIntent,
    Reject,
    ReleaseKv,
    RespondToken,
    SendKv,
    StartDecode,
    StartPrefill,
    StopDecoding,
)
from statecore.loop import Envelope, ForLoop, ForRequest, LoopState, OpenRequest, loop_step, new_loop
from statecore.phases import LoopPhase
from statecore.step import outcome_reason
from statecore.table import Machine

P = TypeVar("P", bound=enum.Enum)
log = logging.getLogger("statecore.runner")

Post = Callable[[Event], Awaitable[None]]
TransitionHook = Callable[[RequestId, str, str, str, ErrorInfo | None, str | None], None]
WorkIntent = StartPrefill | StartDecode | FetchKv | InstallKv | SendKv
CleanupIntent = ReleaseKv | StopDecoding | CancelRemote
Reply = RespondToken | Complete | Reject

# Envelopes waiting for the loop. Every producer is a request's own task or an HTTP handler,
# so a full channel slows producers, never the loop itself.
ENVELOPE_CHANNEL_SIZE = 1024


class Performer(Protocol):
    """A role's way of doing work. Raise StatecoreError to fail the request cleanly."""

    async def work(self, intent: WorkIntent, post: Post) -> None: ...

    async def cleanup(self, intent: CleanupIntent) -> None: ...

    def forget(self, request_id: RequestId) -> None:
        """The request is over and its cleanup ran: drop whatever the role kept for it."""
        ...


@dataclass(frozen=True, slots=True)
class Timeouts:
    deadline_s: float = 600.0  # a request's whole life
    kv_lease_s: float = 60.0  # a held cache nobody takes
    drain_s: float = 30.0  # SIGTERM to exit
    cleanup_s: float = 10.0  # each cleanup intent


@dataclass(frozen=True, slots=True)
class RunnerStatistics:
    phase: LoopPhase
    live_requests: int
    live_tasks: int
    outcomes: dict[str, int]
    bugs: int


class _RequestScope:
    """What the runner holds for one live request: its work tasks' scopes, timer, reply sink."""

    def __init__(self, sink: trio.MemorySendChannel[Reply] | None) -> None:
        self.work: set[trio.CancelScope] = set()
        self.timer: trio.CancelScope | None = None
        self.sink = sink


class NodeRunner(Generic[P]):
    def __init__(
        self,
        machine: Machine[P],
        performer: Performer,
        *,
        timeouts: Timeouts | None = None,
        name: str = "node",
    ) -> None:
        self.machine = machine
        self.performer = performer
        self.timeouts = timeouts or Timeouts()
        self.name = name
        self.state: LoopState[P] = new_loop(machine)
        self._send, self._receive = trio.open_memory_channel[Envelope](ENVELOPE_CHANNEL_SIZE)
        self._scopes: dict[RequestId, _RequestScope] = {}
        self._pending: dict[RequestId, trio.MemorySendChannel[Reply]] = {}
        self._nursery: trio.Nursery | None = None
        self._stopped = trio.Event()
        self._outcomes: Counter[str] = Counter()
        self._live_tasks = 0
        self._bugs = 0
        # (request, from, to, event, error, outcome): `outcome` is set when `to` is terminal, in
        # the same words on every node (statecore.step.outcome_reason)
        self.on_transition: TransitionHook | None = None

    # -- the public face -------------------------------------------------------------------

    def ready(self) -> bool:
        return self.state.accepting and not self._stopped.is_set()

    def statistics(self) -> RunnerStatistics:
        return RunnerStatistics(
            phase=self.state.loop.phase,
            live_requests=len(self.state.live),
            live_tasks=self._live_tasks,
            outcomes=dict(self._outcomes),
            bugs=self._bugs,
        )

    def phase_of(self, request_id: RequestId) -> P | None:
        record = self.state.live.get(request_id)
        return record.phase if record else None

    async def open(self, request_id: RequestId, capacity: int) -> trio.MemoryReceiveChannel[Reply]:
        """Admit a request; its replies (tokens, completion, rejection) arrive on the channel.

        `capacity` must bound every reply the request can produce (max_tokens + 2), so the
        loop never blocks on a slow client."""
        send, receive = trio.open_memory_channel[Reply](capacity)
        self._pending[request_id] = send
        await self._send.send(OpenRequest(request_id))
        return receive

    async def post(self, request_id: RequestId, event: Event) -> None:
        envelope = ForRequest(request_id, event)
        try:
            # With room in the channel, no reschedule: a token costs one task switch less.
            self._send.send_nowait(envelope)
        except trio.WouldBlock:
            await self._send.send(envelope)

    async def post_loop(self, event: Event) -> None:
        await self._send.send(ForLoop(event))

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until the loop machine stops. Never raises for a request's failure."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self._apply(ForLoop(LoopReady()))
            task_status.started()
            async for envelope in self._receive:
                await self._apply(envelope)
                # Take whatever else is already queued (a decode step's tokens for every
                # stream) in this one wake-up rather than one scheduler pass each.
                while not self.state.stopped:
                    try:
                        queued = self._receive.receive_nowait()
                    except trio.WouldBlock:
                        break
                    await self._apply(queued)
                if self.state.stopped:
                    break
            self._stopped.set()
            nursery.cancel_scope.cancel()
        self._stopped.set()

    # -- the loop body ---------------------------------------------------------------------

    async def _apply(self, envelope: Envelope) -> None:
        if isinstance(envelope, OpenRequest) and envelope.request_id not in self._scopes:
            self._scopes[envelope.request_id] = _RequestScope(
                self._pending.pop(envelope.request_id, None)
            )
        before = self._phases_touched_by(envelope)
        self.state, intents = loop_step(self.state, envelope)
        self._log_moves(envelope, before)
        cleanups: dict[RequestId, list[CleanupIntent]] = {}
        for intent in intents:
            if isinstance(intent, ReleaseKv | StopDecoding | CancelRemote):
                cleanups.setdefault(intent.request_id, []).append(intent)
            else:
                self._perform(intent)
        # A scope ends when its request settles, or when it is rejected at the door; the loop
        # names both, so no scan over every open request per token.
        ended = [rid for rid in self.state.settled if rid in self._scopes]
        if isinstance(envelope, OpenRequest) and envelope.request_id not in self.state.live:
            ended.append(envelope.request_id)
        for rid in ended:
            self._finish(rid)  # terminal, or rejected at the door
        for rid in {*cleanups, *ended}:
            self._spawn_cleanups(rid, cleanups.get(rid, []), forget=rid in ended)

    def _phases_touched_by(self, envelope: Envelope) -> dict[RequestId, Any]:
        """The phases an envelope may move: one request's, or every live one for a loop event.

        Per token this is one lookup, not a copy of every live request's phase."""
        if isinstance(envelope, ForRequest):
            record = self.state.live.get(envelope.request_id)
            return {} if record is None else {envelope.request_id: record.phase}
        if isinstance(envelope, ForLoop):
            return {rid: rec.phase for rid, rec in self.state.live.items()}
        return {}

    def _log_moves(self, envelope: Envelope, before: dict[RequestId, Any]) -> None:
        if not isinstance(envelope, ForRequest | ForLoop):
            return
        event = envelope.event
        for rid, old in before.items():
            record = self.state.live.get(rid) or self.state.settled.get(rid)
            if record is None or record.phase is old:
                continue
            new = record.phase
            outcome = outcome_reason(self.machine, record) if self.machine.is_terminal(new) else None
            if self.on_transition:
                self.on_transition(rid, old.value, new.value, event.kind.value, record.error, outcome)
            log.debug("%s %s: %s -> %s on %s", self.name, rid, old.value, new.value, event.kind.value)
            if self.machine.is_terminal(new):
                self._outcomes[new.value] += 1

    def _finish(self, rid: RequestId) -> None:
        held = self._scopes.pop(rid, None)
        if held is None:
            return
        for scope in held.work:
            scope.cancel()
        if held.timer is not None:
            held.timer.cancel()
        if held.sink is not None:
            held.sink.close()

    def _spawn(self, fn: Callable[[], Awaitable[None]]) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._counted, fn)

    async def _counted(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run a child task, counted in `live_tasks` (the leak checks read it)."""
        self._live_tasks += 1
        try:
            await fn()
        finally:
            self._live_tasks -= 1

    def _perform(self, intent: Intent) -> None:
        match intent:
            case RespondToken(request_id=rid) | Complete(request_id=rid) | Reject(request_id=rid):
                self._reply(rid, intent)
            case ArmTimer(request_id=rid, timer=timer):
                self._arm(rid, timer)
            case CancelTimer(request_id=rid):
                held = self._scopes.get(rid)
                if held and held.timer:
                    held.timer.cancel()
                    held.timer = None
            case StartPrefill() | StartDecode() | FetchKv() | InstallKv() | SendKv():
                self._spawn_work(intent)
            case ReleaseKv() | StopDecoding() | CancelRemote():
                self._spawn_cleanups(intent.request_id, [intent], forget=False)
            case LoopIntent(kind=kind, detail=detail):
                self._loop_intent(kind, detail)
            case PeerIntent():
                self._bug(f"peer intent {intent.kind.value} reached a node runner")

    def _reply(self, rid: RequestId, intent: Reply) -> None:
        held = self._scopes.get(rid)
        if held is None or held.sink is None:
            return
        # the reader may be gone or hopelessly behind; the request then ends through
        # ClientCancelled, and the loop never waits on it
        with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            held.sink.send_nowait(intent)

    def _arm(self, rid: RequestId, timer: Timer) -> None:
        held = self._scopes.get(rid)
        if held is None:
            return
        if held.timer is not None:
            held.timer.cancel()
        seconds = self.timeouts.kv_lease_s if timer is Timer.KV_LEASE else self.timeouts.deadline_s
        scope = trio.CancelScope()
        held.timer = scope

        async def fire() -> None:
            with scope:
                await trio.sleep(seconds)
                await self.post(rid, TimerFired(timer))

        self._spawn(fire)

    def _spawn_work(self, intent: WorkIntent) -> None:
        rid = intent.request_id
        held = self._scopes.get(rid)
        if held is None:
            return

        async def post(event: Event) -> None:
            await self.post(rid, event)

        scope = trio.CancelScope()
        held.work.add(scope)

        async def work() -> None:
            with scope:
                try:
                    await self.performer.work(intent, post)
                except StatecoreError as exc:
                    await self._post_failure(rid, exc.info)
                except Exception as exc:
                    log.exception("%s: %s failed in %s", self.name, rid, intent.kind.value)
                    await self._post_failure(
                        rid, ErrorInfo(Fault.BUG, Code.INTERNAL, f"internal error: {exc!r}")
                    )
                finally:
                    held.work.discard(scope)

        self._spawn(work)

    async def _post_failure(self, rid: RequestId, error: ErrorInfo) -> None:
        if error.code is Code.TRANSPORT_LOST:
            await self.post(rid, TransportLost(error.message))
        elif error.fault in (Fault.PEER, Fault.TRANSPORT):
            await self.post(rid, PeerFailed(error))
        else:
            await self.post(rid, EngineFailed(error))

    def _spawn_cleanups(self, rid: RequestId, intents: list[CleanupIntent], *, forget: bool) -> None:
        """Run cleanup intents in order, shielded, each under a deadline; then, for a finished
        request, let the performer forget it."""

        async def run() -> None:
            with trio.CancelScope(shield=True):
                for intent in intents:
                    with trio.move_on_after(self.timeouts.cleanup_s):
                        try:
                            await self.performer.cleanup(intent)
                        except Exception:
                            log.warning(
                                "%s: cleanup %s failed", self.name, intent.kind.value, exc_info=True
                            )
                if forget:
                    self.performer.forget(rid)

        self._spawn(run)

    def _loop_intent(self, kind: IntentKind, detail: str) -> None:
        if kind is IntentKind.REPORT_BUG:
            self._bug(detail)
        elif kind is IntentKind.ARM_DRAIN:

            async def drain_deadline() -> None:
                await trio.sleep(self.timeouts.drain_s)
                await self.post_loop(TimerFired(Timer.DRAIN))

            self._spawn(drain_deadline)
        # STOP_LOOP needs nothing here: the core has already ended every live request, and
        # `run` leaves its receive loop once the loop phase is `stopped`

    def _bug(self, detail: str) -> None:
        self._bugs += 1
        log.error("%s: bug: %s", self.name, detail)


__all__ = [
    "CleanupIntent",
    "NodeRunner",
    "Performer",
    "Post",
    "Reply",
    "RunnerStatistics",
    "Timeouts",
    "WorkIntent",
]
