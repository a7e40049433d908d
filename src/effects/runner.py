"""The runner: one nursery per serving loop; receive -> step -> perform -> feed back.

`NodeRunner` owns a `LoopState` from the pure core and a bounded channel of envelopes. For
each envelope it calls `loop_step` and performs the intents: timers and responses itself,
the role's work (prefill, decode, KV moves) through a `Performer`. Work runs in child tasks
inside the request's own cancel scope; a child that raises posts a failure event for *its*
request (`statecore.policy.failure_event` names it) and never reaches the nursery, so one
request cannot end the loop (trio's strict exception groups would otherwise cancel
everything). Cleanup intents run shielded, with a deadline, after a request's scope is
cancelled. Each live request has one `RequestEntry` here (its reply channel, work scopes,
timer and the role's context; its phase is the core's record) in the runner's `RequestEntries`,
made by `open` and forgotten in one place once its cleanup ran; the performer keeps nothing of
its own. Only
`TransportLost` or a finished drain stops the loop. Whoever watches a runner (metrics, logs,
the live view) is an `Instrument` in its `instruments`, told of each transition, event, piece
of work and reply read, never a wrapper around the performer or the backend. Requests come in
through one door, `open_generation` (the loop's admission, then `open`), for the front end's
backend (`RunnerBackend`) and the node API alike, and are read as a `RunnerGeneration`. A front end's
request of one choice joins the decoder (`InstallKv`) only once its reader comes back for more after the
first token (`RequestEntry.first_read`): the token's write then never shares the interpreter with the
join and the first decode step's build on the engine's thread. This module may import `statecore` and
trio; never httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, assert_never

import trio

from effects.faults import FaultPort, Phase
from effects.ports import GenerationRequest, ModelInfo
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error
from statecore.events import ClientCancelled, Event, LoopReady, StopMatched, Timer, TimerFired
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
    LoopIntentKind,
    PeerIntent,
    RefuseKv,
    Reject,
    ReleaseKv,
    RespondTokens,
    SendKv,
    StartDecode,
    StartPrefill,
    StopDecoding,
)
from statecore.loop import Envelope, ForLoop, ForRequest, LoopState, OpenRequest, loop_step, new_loop
from statecore.phases import LoopPhase
from statecore.policy import admission, failure_event
from statecore.table import Machine

P = TypeVar("P", bound=enum.Enum)
log = logging.getLogger("statecore.runner")

Post = Callable[[Event], Awaitable[None]]
WorkIntent = StartPrefill | StartDecode | FetchKv | InstallKv | SendKv
CleanupIntent = ReleaseKv | StopDecoding | CancelRemote
Reply = RespondTokens | Complete | Reject
Answer = RefuseKv  # a peer's question answered at once, whether or not the request is held

# Envelopes waiting for the loop. Every producer is a request's own task or an HTTP handler,
# so a full channel slows producers, never the loop itself.
ENVELOPE_CHANNEL_SIZE = 1024


class Performer(Protocol):
    """A role's way of doing work. Raise StatecoreError to fail the request cleanly.

    `context` is what the role keeps for the request (given to `NodeRunner.open`, held in the
    runner's entry for it; None for a request opened without one)."""

    async def work(self, intent: WorkIntent, context: object, post: Post) -> None: ...

    async def cleanup(self, intent: CleanupIntent, context: object) -> None: ...

    def answer(self, intent: Answer) -> None:
        """Answer a peer's question as the core decided (a refused KV pull), at once, on the
        loop: it must not block, and the request may be one the runner does not hold."""
        ...

    def forget(self, request_id: RequestId, context: object) -> None:
        """The request is over and its cleanup ran: let go of what the context still holds."""
        ...


class Instrument:
    """One observer of a runner (trio's `abc.Instrument` idea): every hook does nothing here, an
    observer overrides those it needs. Hooks run on the loop, some per token: they must be cheap,
    and one that raises is logged and passed over (`Instruments`), never raised into serving.

    The runner calls `transition`, `applied` and the work hooks; the front end's generations
    (`RunnerBackend`, `RunnerGeneration`) call the `generation_*` and `reply_read` hooks, so
    that what a client sees is timed as it reads it."""

    def transition(self, request_id: RequestId, old: str, new: str, event: str,
                   error: ErrorInfo | None, outcome: str | None, context: object) -> None:
        """A request changed phase; `outcome` is set when `new` is terminal, in the same words on
        every node (`statecore.loop.LoopState.outcome`); `context` is the role's (None for a
        request opened without one), still held when the request ends."""

    def applied(self, request_id: RequestId, event: Event, context: object) -> None:
        """An event is about to be applied to a request (`context`: the role's, None once the
        runner dropped it)."""

    def work_started(self, intent: WorkIntent, context: object) -> None:
        """The performer starts a piece of work."""

    def work_ended(self, intent: WorkIntent, context: object, failure: Exception | None) -> None:
        """The performer's work returned (`failure` None) or raised; not called when cancelled."""

    def generation_started(self, request_id: RequestId, prompt_tokens: int) -> None:
        """The front end's backend admitted a generation."""

    def generation_refused(self, error: ErrorInfo) -> None:
        """The front end's backend refused a generation at intake."""

    def reply_read(self, request_id: RequestId, reply: Reply, generated: int) -> None:
        """The front end took a reply of its generation (a token, the completion, the rejection);
        `generated` is what it adds to the generation's tokens as usage counts them: a step's
        tokens, 1 for a completion whose ending token counts (EOS: the core's
        `Complete.ending_tokens`), else 0."""

    def generation_stopped(self, request_id: RequestId) -> None:
        """The front end matched a stop string: its generation ends normally."""

    def generation_cancelled(self, request_id: RequestId) -> None:
        """The front end gave its generation up (the client left, or it failed)."""


class Instruments(Instrument):
    """A runner's instruments, each told in the order added; a failing hook is logged, and the
    others and serving go on."""

    def __init__(self) -> None:
        self._each: list[Instrument] = []

    def add(self, instrument: Instrument) -> None:
        self._each.append(instrument)

    def __iter__(self) -> Iterator[Instrument]:
        return iter(self._each)

    def _tell(self, hook: str, call: Callable[[Instrument], None]) -> None:
        for each in self._each:
            try:
                call(each)
            except Exception:
                log.exception("instrument %s: %s failed", type(each).__name__, hook)

    def transition(self, request_id: RequestId, old: str, new: str, event: str,
                   error: ErrorInfo | None, outcome: str | None, context: object) -> None:
        self._tell("transition",
                   lambda each: each.transition(request_id, old, new, event, error, outcome, context))

    def applied(self, request_id: RequestId, event: Event, context: object) -> None:
        self._tell("applied", lambda each: each.applied(request_id, event, context))

    def work_started(self, intent: WorkIntent, context: object) -> None:
        self._tell("work_started", lambda each: each.work_started(intent, context))

    def work_ended(self, intent: WorkIntent, context: object, failure: Exception | None) -> None:
        self._tell("work_ended", lambda each: each.work_ended(intent, context, failure))

    def generation_started(self, request_id: RequestId, prompt_tokens: int) -> None:
        self._tell("generation_started", lambda each: each.generation_started(request_id, prompt_tokens))

    def generation_refused(self, error: ErrorInfo) -> None:
        self._tell("generation_refused", lambda each: each.generation_refused(error))

    def reply_read(self, request_id: RequestId, reply: Reply, generated: int) -> None:
        self._tell("reply_read", lambda each: each.reply_read(request_id, reply, generated))

    def generation_stopped(self, request_id: RequestId) -> None:
        self._tell("generation_stopped", lambda each: each.generation_stopped(request_id))

    def generation_cancelled(self, request_id: RequestId) -> None:
        self._tell("generation_cancelled", lambda each: each.generation_cancelled(request_id))


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
    entries: int = 0  # requests the runner still keeps an entry for (live, or cleaning up)
    live_phases: tuple[tuple[str, int], ...] = ()  # (phase, live requests in it), non-zero only


class RequestEntry:
    """Everything the shell keeps for one request, in one place: its reply sink, its work tasks'
    scopes, its timer, and the role's context (prompt, sampling, chosen nodes, a stream's pieces)."""

    def __init__(self, sink: trio.MemorySendChannel[Reply], context: object) -> None:
        self.sink = sink
        self.context = context
        self.work: set[trio.CancelScope] = set()
        self.timer: trio.CancelScope | None = None
        # set once its reader, having taken the first token, waits for more: its `InstallKv`
        # (the join) waits for it; None: it joins at once (the node API's and grouped choices)
        self.first_read: trio.Event | None = None


class RequestEntries:
    """A runner's entries, one per request from `open` until its cleanup ran: `finish` takes an
    ended request's entry out (its tasks and timer cancelled, its replies closed: the id is free
    again) and `forgotten` counts it gone once its cleanup has run. Only the loop's task changes it."""

    def __init__(self) -> None:
        self._entries: dict[RequestId, RequestEntry] = {}
        self._forgetting = 0  # entries of ended requests whose cleanup has not run yet

    def __contains__(self, request_id: RequestId) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        """Entries kept: live requests' and those of ended ones still cleaning up."""
        return len(self._entries) + self._forgetting

    def get(self, request_id: RequestId) -> RequestEntry | None:
        return self._entries.get(request_id)

    def open(self, request_id: RequestId, capacity: int, context: object) -> trio.MemoryReceiveChannel[Reply]:
        """A new request's entry and the channel its replies arrive on; an id still kept is refused."""
        if request_id in self._entries:
            raise StatecoreError(client_error(f"duplicate request id {request_id!r}"))
        send, receive = trio.open_memory_channel[Reply](capacity)
        self._entries[request_id] = RequestEntry(send, context)
        return receive

    def finish(self, request_id: RequestId) -> RequestEntry | None:
        """The request left the loop: cancel its tasks and timer, close its replies, and take its
        entry out (the id is free again); it is forgotten once its cleanup has run."""
        held = self._entries.pop(request_id, None)
        if held is None:
            return None
        self._forgetting += 1
        for scope in held.work:
            scope.cancel()
        if held.timer is not None:
            held.timer.cancel()
        held.sink.close()
        return held

    def forgotten(self) -> None:
        """A finished request's cleanup has run."""
        self._forgetting -= 1

    def reply(self, request_id: RequestId, intent: Reply) -> None:
        held = self._entries.get(request_id)
        if held is None:
            return
        # the reader may be gone or hopelessly behind; the request then ends through
        # ClientCancelled, and the loop never waits on it
        with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            held.sink.send_nowait(intent)

    def cancel_timer(self, request_id: RequestId) -> None:
        held = self._entries.get(request_id)
        if held and held.timer:
            held.timer.cancel()
            held.timer = None


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
        self._entries = RequestEntries()
        self._nursery: trio.Nursery | None = None
        self._stopped = trio.Event()
        self._outcomes: Counter[str] = Counter()
        self._live_tasks = 0
        self._bugs = 0
        self.instruments = Instruments()

    # -- the public face -------------------------------------------------------------------

    def ready(self) -> bool:
        return self.state.accepting and not self._stopped.is_set()

    def statistics(self) -> RunnerStatistics:
        phases = Counter(record.phase.value for record in self.state.live.values())
        return RunnerStatistics(
            phase=self.state.loop.phase,
            live_requests=len(self.state.live),
            live_tasks=self._live_tasks,
            outcomes=dict(self._outcomes),
            bugs=self._bugs,
            entries=len(self._entries),
            live_phases=tuple(sorted(phases.items())),
        )

    def phase_of(self, request_id: RequestId) -> P | None:
        record = self.state.live.get(request_id)
        return record.phase if record else None

    def context(self, request_id: RequestId) -> object:
        """The role's context for a request the runner still keeps, else None."""
        entry = self._entries.get(request_id)
        return None if entry is None else entry.context

    def admission_error(self, max_live: int | None = None) -> ErrorInfo | None:
        """Why a new request would be refused now (`statecore.policy.admission`), else None."""
        phase = LoopPhase.STOPPED if self._stopped.is_set() else self.state.loop.phase
        return admission(phase, len(self.state.live), max_live)

    async def open(
        self, request_id: RequestId, capacity: int, context: object = None
    ) -> trio.MemoryReceiveChannel[Reply]:
        """Register a request (with the role's `context` for it) and ask the loop to admit it;
        its replies (tokens, completion, rejection) arrive on the channel.

        `capacity` must bound every reply the request can produce (max_tokens + 2), so the
        loop never blocks on a slow client. An id the runner still keeps is refused here."""
        receive = self._entries.open(request_id, capacity, context)
        await self._send.send(OpenRequest(request_id))
        return receive

    def join_after_first_read(self, request_id: RequestId) -> None:
        """The request's `InstallKv` waits until its reader, having taken the first token, comes
        back for more (`first_token_read`): on one host the first token's write then goes out
        before the join and the next step's build take the interpreter. Asked before its first
        event is posted."""
        held = self._entries.get(request_id)
        if held is not None:
            held.first_read = trio.Event()

    def first_token_read(self, request_id: RequestId) -> None:
        """The request's reader took its first token and waits for more: its join may go."""
        held = self._entries.get(request_id)
        if held is not None and held.first_read is not None:
            held.first_read.set()

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
        if isinstance(envelope, ForRequest):
            held = self._entries.get(envelope.request_id)
            self.instruments.applied(envelope.request_id, envelope.event,
                                     None if held is None else held.context)
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
        ended = [rid for rid in self.state.settled if rid in self._entries]
        if isinstance(envelope, OpenRequest) and envelope.request_id not in self.state.live:
            ended.append(envelope.request_id)
        finished = {rid: self._entries.finish(rid) for rid in ended}  # terminal, or rejected at the door
        for rid in {*cleanups, *finished}:
            self._spawn_cleanups(rid, cleanups.get(rid, []), forget=rid in finished,
                                 entry=finished.get(rid))

    def _phases_touched_by(self, envelope: Envelope) -> dict[RequestId, Any]:
        """The phases an envelope may move: one request's, or every live one for a loop event.

        Per token this is one lookup, not a copy of every live request's phase."""
        match envelope:
            case ForRequest(request_id=rid):
                record = self.state.live.get(rid)
                return {} if record is None else {rid: record.phase}
            case ForLoop():
                return {rid: rec.phase for rid, rec in self.state.live.items()}
            case OpenRequest():
                return {}
            case _:
                assert_never(envelope)

    def _log_moves(self, envelope: Envelope, before: dict[RequestId, Any]) -> None:
        if not isinstance(envelope, ForRequest | ForLoop):
            return
        event = envelope.event
        for rid, old in before.items():
            record = self.state.live.get(rid) or self.state.settled.get(rid)
            if record is None or record.phase is old:
                continue
            new = record.phase
            outcome = self.state.outcome(rid)  # set when the request ended in this step
            self.instruments.transition(rid, old.value, new.value, event.kind.value, record.error, outcome,
                                        self.context(rid))
            log.debug("%s %s: %s -> %s on %s", self.name, rid, old.value, new.value, event.kind.value)
            if outcome is not None:
                self._outcomes[new.value] += 1

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
            case RespondTokens(request_id=rid) | Complete(request_id=rid) | Reject(request_id=rid):
                self._entries.reply(rid, intent)
            case ArmTimer(request_id=rid, timer=timer):
                self._arm(rid, timer)
            case CancelTimer(request_id=rid):
                self._entries.cancel_timer(rid)
            case StartPrefill() | StartDecode() | FetchKv() | InstallKv() | SendKv():
                self._spawn_work(intent)
            case ReleaseKv() | StopDecoding() | CancelRemote():
                self._spawn_cleanups(intent.request_id, [intent], forget=False)
            case RefuseKv():
                self.performer.answer(intent)
            case LoopIntent(kind=kind, detail=detail):
                self._loop_intent(kind, detail)
            case PeerIntent():
                self._bug(f"peer intent {intent.kind.value} reached a node runner")
            case _:
                assert_never(intent)

    def _arm(self, rid: RequestId, timer: Timer) -> None:
        held = self._entries.get(rid)
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
        held = self._entries.get(rid)
        if held is None:
            return

        async def post(event: Event) -> None:
            await self.post(rid, event)

        scope = trio.CancelScope()
        held.work.add(scope)

        async def work() -> None:
            with scope:
                if isinstance(intent, InstallKv) and held.first_read is not None:
                    await held.first_read.wait()
                self.instruments.work_started(intent, held.context)
                try:
                    await self.performer.work(intent, held.context, post)
                except StatecoreError as exc:
                    self.instruments.work_ended(intent, held.context, exc)
                    await self._post_failure(rid, exc.info)
                except Exception as exc:
                    self.instruments.work_ended(intent, held.context, exc)
                    log.exception("%s: %s failed in %s", self.name, rid, intent.kind.value)
                    await self._post_failure(
                        rid, ErrorInfo(Fault.BUG, Code.INTERNAL, f"internal error: {exc!r}")
                    )
                else:
                    self.instruments.work_ended(intent, held.context, None)
                finally:
                    held.work.discard(scope)

        self._spawn(work)

    async def _post_failure(self, rid: RequestId, error: ErrorInfo) -> None:
        await self.post(rid, failure_event(error))

    def _spawn_cleanups(self, rid: RequestId, intents: list[CleanupIntent], *, forget: bool,
                        entry: RequestEntry | None = None) -> None:
        """Run cleanup intents in order, shielded, each under a deadline; then, for a finished
        request (`entry`: what `RequestEntries.finish` took out), forget it."""
        if entry is None:
            entry = self._entries.get(rid)
        context = None if entry is None else entry.context

        async def run() -> None:
            with trio.CancelScope(shield=True):
                for intent in intents:
                    with trio.move_on_after(self.timeouts.cleanup_s):
                        try:
                            await self.performer.cleanup(intent, context)
                        except Exception:
                            log.warning(
                                "%s: cleanup %s failed", self.name, intent.kind.value, exc_info=True
                            )
                if forget:
                    self._forget(rid, entry, counted=entry is not None)

        self._spawn(run)

    def _forget(self, rid: RequestId, entry: RequestEntry | None, *, counted: bool) -> None:
        """The one place a request is forgotten: its cleanup ran; the role lets go of what its
        context still holds."""
        if counted:
            self._entries.forgotten()
        self.performer.forget(rid, None if entry is None else entry.context)

    def _loop_intent(self, kind: LoopIntentKind, detail: str) -> None:
        match kind:
            case IntentKind.REPORT_BUG:
                self._bug(detail)
            case IntentKind.ARM_DRAIN:

                async def drain_deadline() -> None:
                    await trio.sleep(self.timeouts.drain_s)
                    await self.post_loop(TimerFired(Timer.DRAIN))

                self._spawn(drain_deadline)
            case (
                IntentKind.STOP_LOOP | IntentKind.START_ACCEPTING | IntentKind.STOP_ACCEPTING
                | IntentKind.ADMIT_REQUEST | IntentKind.REFUSE_REQUEST
            ):
                # STOP_LOOP: the core has already ended every live request, and `run` leaves its
                # receive loop once the loop phase is `stopped`; accepting is the loop phase itself,
                # read by `admission_error` and `loop_step`, which also answer a request's admission
                pass
            case _:
                assert_never(kind)

    def _bug(self, detail: str) -> None:
        self._bugs += 1
        log.error("%s: bug: %s", self.name, detail)


class RequestContext(Protocol):
    """What a request's generation reads of the role's context for it (a node's `NodeRequest`, the
    router's `RoutedRequest`)."""

    @property
    def cached_tokens(self) -> int:
        """The prompt tokens its prefill took from a prefix cache."""
        ...


class _FirstToken(enum.Enum):
    """Where a generation stands with its first token: not given yet; given (the reader's next wait
    for more tells the runner so, once: `NodeRunner.first_token_read`); told."""

    AHEAD = enum.auto()
    GIVEN = enum.auto()
    TOLD = enum.auto()


class RunnerGeneration:
    """One request's replies as the front end (the `Generation` port) and the node API read them,
    each told to the runner's instruments; `stop` and `cancel` post the core's events."""

    def __init__(
        self,
        runner: NodeRunner[Any],
        request_id: RequestId,
        replies: trio.MemoryReceiveChannel[Reply],
        context: RequestContext | None = None,
    ) -> None:
        self.runner = runner
        self.request_id = request_id
        self.replies = replies
        # the role's context for the request (its prefill's cached tokens): held here too, since
        # the runner drops its entry when the request ends, maybe before this is read
        self.context = context
        self._ended = False  # the last output (an end or an error) was given
        self._first = _FirstToken.AHEAD

    @property
    def cached_tokens(self) -> int:
        return 0 if self.context is None else self.context.cached_tokens

    async def __aiter__(self) -> AsyncIterator[Reply]:
        async with self.replies:
            while not self._ended:
                if self._first is _FirstToken.GIVEN:
                    # the reader is done with the first token (its write returned): the join may go
                    self._first = _FirstToken.TOLD
                    self.runner.first_token_read(self.request_id)
                try:
                    reply = await self.replies.receive()
                except trio.EndOfChannel:
                    yield self._unfinished()
                    return
                yield self._output(reply)

    def receive_nowait(self) -> Reply | None:
        if self._ended:
            return None
        try:
            reply = self.replies.receive_nowait()
        except trio.WouldBlock:
            return None
        except trio.EndOfChannel:
            return self._unfinished()
        return self._output(reply)

    def _output(self, reply: Reply) -> Reply:
        match reply:
            case RespondTokens(tokens=tokens):
                generated = len(tokens)
                if self._first is _FirstToken.AHEAD:
                    self._first = _FirstToken.GIVEN
            case Complete(ending_tokens=ending):
                generated = ending
            case Reject():
                generated = 0
            case _:
                assert_never(reply)
        self.runner.instruments.reply_read(self.request_id, reply, generated)
        if not isinstance(reply, RespondTokens):
            self._end()
        return reply

    def _unfinished(self) -> Reply:
        return self._output(Reject(self.request_id, ErrorInfo(
            Fault.BUG, Code.INTERNAL, "the request ended without a completion")))

    def _end(self) -> None:
        self._ended = True
        self.replies.close()  # nothing more is read; also when the iterator is never resumed

    async def stop(self) -> None:
        self.runner.instruments.generation_stopped(self.request_id)
        await self.runner.post(self.request_id, StopMatched())

    async def cancel(self) -> None:
        self.runner.instruments.generation_cancelled(self.request_id)
        await self.runner.post(self.request_id, ClientCancelled())


async def open_generation(
    runner: NodeRunner[Any],
    request_id: RequestId,
    capacity: int,
    context: RequestContext,
    *,
    max_live: int | None,
    faults: FaultPort,
    refusal: ErrorInfo | None = None,
) -> RunnerGeneration:
    """The one door into a runner, for the front end's backend and the node API alike: the
    loop's admission (`statecore.policy.admission`, `max_live` requests in flight at most), then
    the caller's own `refusal` if it has one (a node whose engine is lost), then the request is
    opened with room for `capacity` replies. A refusal raises StatecoreError."""
    refused = runner.admission_error(max_live) or refusal
    if refused is not None:
        raise StatecoreError(refused)
    if faults.armed:
        await faults.at(Phase.INTAKE, request_id)
    replies = await runner.open(request_id, capacity, context)
    return RunnerGeneration(runner, request_id, replies, context)


# replies a request can produce beyond its tokens: a completion or a rejection, plus slack
_REPLY_SLACK = 4


class RunnerBackend:
    """The front end's `Backend` over a runner: `admit` gives a generation's first event and the
    role's context for it (a single node prefills locally, the router routes it; a refusal raises
    StatecoreError), then it comes in through the one door, `open_generation`, and is read as a
    `RunnerGeneration`. `effects.interpret`'s `local_backend` and `router_backend` make one per
    role."""

    def __init__(
        self,
        runner: NodeRunner[Any],
        model_info: Callable[[], ModelInfo],
        admit: Callable[[GenerationRequest], tuple[Event, RequestContext]],
        *,
        max_live: int = 256,
        faults: FaultPort,
    ) -> None:
        self.runner = runner
        self._model_info = model_info
        self._admit = admit
        self.max_live = max_live
        self.faults = faults

    @property
    def model_info(self) -> ModelInfo:
        return self._model_info()

    def ready(self) -> bool:
        return self.runner.ready()

    async def start(self, request: GenerationRequest) -> RunnerGeneration:
        try:
            first_event, context = self._admit(request)
            generation = await open_generation(self.runner, request.request_id,
                                               request.sampling.max_tokens + _REPLY_SLACK, context,
                                               max_live=self.max_live, faults=self.faults)
        except StatecoreError as exc:
            self.runner.instruments.generation_refused(exc.info)
            raise
        if request.sampling.choices == 1:  # a grouped choice's join waits for its siblings' instead
            self.runner.join_after_first_read(request.request_id)
        self.runner.instruments.generation_started(request.request_id, len(request.prompt))
        await self.runner.post(request.request_id, first_event)
        return generation


__all__ = [
    "Answer",
    "CleanupIntent",
    "Instrument",
    "Instruments",
    "NodeRunner",
    "Performer",
    "Post",
    "Reply",
    "RequestContext",
    "RequestEntry",
    "RunnerBackend",
    "RunnerGeneration",
    "RunnerStatistics",
    "Timeouts",
    "WorkIntent",
    "open_generation",
]
