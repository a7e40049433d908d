"""The engine's one device thread and the trio side's way to it: post a command, await its outcome.

`DeviceThread` owns the job queue and the thread that runs the device loop. `post` puts a command
(`adapters.mlx.commands`) with its `Local` on the queue and waits on a `trio.Event` without
blocking the event loop; a caller cancelled meanwhile marks its job abandoned, and the command's
undo (`commands.undo_of`) is posted when it ran (or, for a registered prefill, at once), so a
cancellation never leaks a cache. Once the thread dies, is abandoned by the watchdog or the
engine closes, every later post raises ENGINE_FAILED. This module imports trio; it must never
import mlx.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import trio

from adapters.mlx import commands
from adapters.mlx.jobs import Crash, Job, Local, Stop, engine_failed, engine_lost
from statecore.errors import StatecoreError

__all__ = ["DeviceThread"]

logger = logging.getLogger("adapters.engine_mlx")

_T = TypeVar("_T")


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

    async def post(self, command: commands.Command, local: Local | None = None) -> Any:
        """Post `command` to the device thread and await its outcome without blocking trio."""
        return await self.wait(Job(command, trio.lowlevel.current_trio_token(), trio.Event(), local))

    async def wait(self, job: Job[_T]) -> _T:
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

    def post_nowait(self, command: commands.Command) -> None:
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
