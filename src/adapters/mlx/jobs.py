"""How trio and the device thread talk: the engine's one device thread, jobs in, outcomes and
stream items out.

`DeviceThread` owns the job queue and the thread that runs the device loop. A trio task posts a
`Job` (a command of `adapters.mlx.commands`, and what only this process holds beside it: `Local`)
on the queue and waits on a `trio.Event` without blocking the event loop; the device thread
performs the command and sets the event with `TrioToken.run_sync_soon`, which never blocks the
device. A job whose caller was cancelled is `abandoned`: skipped if it has not run, undone by its
command's undo (`commands.undo_of`) if it has (a registered prefill at once), so a cancellation
never leaks a cache. Stream items (tokens, or one error) go out the same way, in one message per
step and event loop. Once the thread dies, is abandoned by the watchdog or the engine closes,
every later post raises ENGINE_FAILED. `Inbox` is the device thread's end of the queue: jobs
taken, performed, finished or undone, failed when the loop dies, and the watchdog's one reading of
the loop's progress. This module imports trio; it must never import mlx.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

import trio

from adapters.mlx.commands import Cancel, Command, Prefill, undo_of
from effects.engine_port import GeneratedToken
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError

__all__ = [
    "Crash", "DeviceThread", "Inbox", "Job", "Local", "Outcome", "Stop", "StreamItem", "StreamSend",
    "as_statecore", "deliver", "engine_failed", "engine_lost", "post",
]

logger = logging.getLogger("adapters.engine_mlx")

T = TypeVar("T")
StreamItem = GeneratedToken | StatecoreError


class StreamSend(Protocol):
    """Where a request's stream items go, in trio: a `trio.MemorySendChannel` in a node, or, in
    an engine core process, the channel to the node (`adapters.mlx.core_process`)."""

    def send_nowait(self, value: StreamItem, /) -> None: ...

    def close(self) -> None: ...


@dataclass(eq=False)
class Outcome(Generic[T]):
    value: T | None = None
    error: StatecoreError | None = None

    def unwrap(self) -> T:
        if self.error is not None:
            raise StatecoreError(self.error.info) from self.error
        return self.value  # type: ignore[return-value]


@dataclass(eq=False)
class Local:
    """What a command's caller holds beside its values, on this process only (a replayed command
    on another rank of an instance has none): where the request's tokens go, its grammar matcher,
    a streamed handoff's sink, the caches a handed-off payload (or its streamed pieces, by layer
    range) was built into in a worker thread, and a sliced install's head range of each rank."""

    send: StreamSend | None = None
    matcher: Any = None
    segment_sink: Any = None
    caches: list[Any] | None = None
    pieces: list[tuple[int, int, int, list[Any]]] | None = None  # (first, end layer, first token, caches)
    ranges: list[tuple[int, int]] | None = None


@dataclass(eq=False)
class Job(Generic[T]):
    """One command for the device thread. `token` None: fire and forget (nobody waits), or a
    replayed command. A prefill is *deferred*: performing it only registers the prompt, and the
    device loop finishes the job when its first token is read back."""

    command: Command
    token: trio.lowlevel.TrioToken | None
    done: trio.Event | None = None
    local: Local | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False
    outcome: Outcome[T] | None = None

    @property
    def deferred(self) -> bool:
        return isinstance(self.command, Prefill)

    @property
    def undo(self) -> Cancel | None:
        return undo_of(self.command)

    def is_abandoned(self) -> bool:
        with self.lock:
            return self.abandoned


class Stop:
    """Sentinel job: leave the device loop."""


class Crash:
    """Sentinel job: raise outside the per-job wrapper (tests of a dead device thread)."""


def engine_failed(message: str) -> StatecoreError:
    return StatecoreError(ErrorInfo(Fault.BUG, Code.ENGINE_FAILED, message))


def engine_lost(message: str) -> StatecoreError:
    """The node's engine is gone (its device thread died or was abandoned): the node's transport,
    not the request, failed, so a router retries the request elsewhere before its first token
    (as it does when the node's connection drops, which follows a moment later)."""
    return StatecoreError(ErrorInfo(Fault.TRANSPORT, Code.ENGINE_FAILED, message))


def as_statecore(exc: Exception) -> StatecoreError:
    if isinstance(exc, StatecoreError):
        return exc
    message = f"device job failed: {type(exc).__name__}: {exc}"
    return StatecoreError(ErrorInfo(Fault.BUG, Code.INTERNAL, message))


def deliver(items: list[tuple[StreamSend, StreamItem | None, bool]]) -> None:
    """Runs in trio: push stream items and close finished streams. Never blocks."""
    for send, item, close in items:
        if item is not None:
            # WouldBlock cannot happen (the bound is max_tokens); the others mean the consumer
            # is gone, and its stream's exit already asked for a cancel.
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                send.send_nowait(item)
        if close:
            send.close()


def post(token: trio.lowlevel.TrioToken | None, fn: Callable[..., object], *args: Any) -> None:
    if token is None:
        return
    with contextlib.suppress(trio.RunFinishedError):  # that trio run is over: nobody waits
        token.run_sync_soon(fn, *args)


class DeviceThread:
    """The queue and the thread (see the module's paragraph). `on_death` runs once the loop is
    gone (it failed, stopped or was abandoned) with the error every waiter and later call gets;
    `advice` turns an exception that killed the loop into a hint for the log (or None)."""

    def __init__(self, on_death: Callable[[StatecoreError], None],
                 advice: Callable[[BaseException], str | None]) -> None:
        self.queue: queue.SimpleQueue[Job[Any] | Stop | Crash] = queue.SimpleQueue()
        self._on_death = on_death
        self._advice = advice
        self._lock = threading.Lock()
        self.alive = True
        self._closed = False
        self.thread: threading.Thread | None = None

    def start(self, run: Callable[[], None]) -> None:
        """Run the device loop (`run`) on its own thread."""
        self.thread = threading.Thread(target=partial(self._thread_main, run), name="mlx-device", daemon=True)
        self.thread.start()

    def _thread_main(self, run: Callable[[], None]) -> None:
        try:
            run()
        except BaseException as exc:
            logger.exception("the MLX device thread died")
            if (advice := self._advice(exc)) is not None:
                logger.error("%s", advice)
            self.die(engine_lost(f"the device thread died: {type(exc).__name__}: {exc}"))
        else:
            self.die(engine_failed("the engine is closed"))

    def die(self, error: StatecoreError) -> None:
        with self._lock:
            self.alive = False
        self._on_death(error)

    def abandon(self, reason: str) -> None:
        """Give up on a device thread that stopped making progress (the node's watchdog): every
        waiting caller and live stream fails now with ENGINE_FAILED, as does every later call.
        The thread is left to itself: nothing can interrupt it inside MLX."""
        with self._lock:
            if not self.alive:
                return
            self.alive = False
        logger.error("abandoning the device thread: %s", reason)
        self.die(engine_lost(f"the engine was abandoned: {reason}"))

    async def post(self, command: Command, local: Local | None = None) -> Any:
        """Post `command` to the device thread and await its outcome without blocking trio."""
        return await self.wait(Job(command, trio.lowlevel.current_trio_token(), trio.Event(), local))

    async def wait(self, job: Job[T]) -> T:
        with self._lock:
            if not self.alive:
                raise (engine_failed("the engine is closed") if self._closed
                       else engine_lost("the device thread has died"))
            self.queue.put(job)
        assert job.done is not None
        try:
            await job.done.wait()
        except BaseException:
            with job.lock:
                job.abandoned = True
                result = job.outcome
            undo = job.undo
            if undo is not None and ((result is not None and result.error is None)
                                     or (result is None and job.deferred)):
                # A registered prefill is undone at once, not when its turn comes: what it
                # reserved goes back with it (a no-op if it never registered).
                self.post_nowait(undo)
            raise
        assert job.outcome is not None
        return job.outcome.unwrap()

    def post_nowait(self, command: Command) -> None:
        """Fire and forget; silently nothing if the device thread is gone."""
        with self._lock:
            if self.alive:
                self.queue.put(Job(command, None))

    def stop_nowait(self) -> None:
        with self._lock:
            if not self.alive:
                return
            self._closed = True
            self.queue.put(Stop())

    def crash_nowait(self) -> None:
        """Make the device loop itself raise (not a job): tests of a dead device thread."""
        self.queue.put(Crash())

    async def join(self, timeout_s: float | None) -> bool:
        """Wait for the thread to end, at most `timeout_s` (None: as long as it takes); whether
        it did."""
        thread = self.thread
        if thread is None:
            return True
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(partial(thread.join, timeout_s))
        return not thread.is_alive()


class Inbox:
    """The device thread's end of the job queue. Only the device thread calls it, but for
    `stalled_s` (any thread) and `fail_all` (also trio's, when the watchdog abandons the thread)."""

    def __init__(self, queue_: queue.SimpleQueue[Job[Any] | Stop | Crash]) -> None:
        self.queue = queue_
        # Performs a job's command (`adapters.mlx.performer.Performer.perform`, set by the engine)
        self.perform: Callable[[Job[Any]], Any] = lambda job: None
        # A lockstep instance's ranks undo a job whose caller left in a later plan, all of them:
        # its undo is queued then, not performed at once.
        self.undo_in_order = False
        self.running: Job[Any] | None = None  # the job being computed now
        # What the last `take` took off the queue: a job not yet computed when the loop dies
        # (a Stop before it, a tensor-parallel broadcast that failed or hangs) fails with it.
        self.taken: list[Job[Any] | Stop | Crash] = []
        self.idle = False  # waiting for a job with nothing live (the watchdog's "not stalled")
        self.progress_at = time.monotonic()  # the last finished job or step

    def take(self, *, wait: bool, timeout: float | None) -> list[Job[Any] | Stop | Crash]:
        """Every job queued now; with `wait` (nothing to compute), first the next one to come, or
        none after `timeout` seconds (None: as long as it takes)."""
        jobs: list[Job[Any] | Stop | Crash] = []
        self.taken = jobs  # (the last take's jobs, done now, are not held while this one waits)
        if wait:
            self.idle = True
            with contextlib.suppress(queue.Empty):
                jobs.append(self.queue.get(timeout=timeout))
            # progress_at before idle: a reader that sees busy also sees a fresh start time.
            self.progress_at = time.monotonic()
            self.idle = False
        while True:
            try:
                jobs.append(self.queue.get_nowait())
            except queue.Empty:
                return jobs

    def stalled_s(self) -> float:
        """Seconds the loop has been busy without finishing a job or a step (0 while it waits
        for work). Read from any thread: the watchdog's one input."""
        if self.idle:
            return 0.0
        return max(0.0, time.monotonic() - self.progress_at)

    def compute(self, job: Job[Any]) -> None:
        """Perform the job's command; its outcome to its caller (a prefill's comes with its first
        token: the steps finish it)."""
        self.running = job
        try:
            value = self.perform(job)
        except Exception as exc:
            if not isinstance(exc, StatecoreError):
                logger.exception("device job failed")
            self.finish(job, Outcome(error=as_statecore(exc)))
        else:
            if not job.deferred:
                self.finish(job, Outcome(value=value))
        finally:
            self.running = None

    def finish(self, job: Job[Any], result: Outcome[Any]) -> None:
        """Hand a computed job its outcome, or undo it when its caller is gone."""
        with job.lock:
            job.outcome = result
            abandoned = job.abandoned
        if abandoned:
            if result.error is None and job.undo is not None:
                self._undo(job)
            return
        if job.done is not None:
            post(job.token, job.done.set)

    def _undo(self, job: Job[Any]) -> None:
        """Perform the undo of a job whose caller left after it ran (a cancel, now)."""
        assert job.undo is not None
        if self.undo_in_order:
            self.queue.put(Job(job.undo, None))
            return
        try:
            self.perform(Job(job.undo, None))
        except Exception:
            logger.exception("undoing an abandoned job failed")

    def fail_all(self, error: StatecoreError) -> None:
        """The loop is dead: the running job, those taken and those still queued fail with `error`."""
        running = self.running
        if running is not None and running.done is not None:
            running.outcome = Outcome(error=error)
            post(running.token, running.done.set)
        for taken in self.taken:
            if isinstance(taken, Job) and taken.done is not None and taken.outcome is None:
                taken.outcome = Outcome(error=error)
                post(taken.token, taken.done.set)
        self.taken = []
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, Job) and job.done is not None:
                job.outcome = Outcome(error=error)
                post(job.token, job.done.set)
