"""How trio and the device thread talk: jobs in, outcomes and stream items out.

A trio task posts a `Job` on the device thread's queue and waits on a `trio.Event`; the device
thread sets it with `TrioToken.run_sync_soon`, which never blocks the device. A job whose caller
was cancelled is `abandoned`: skipped if it has not run, undone if it has (so a cancellation never
leaks a cache). Stream items (tokens, or one error) go out the same way, in one message per step
and event loop. This module imports trio; it must never import mlx.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import trio

from adapters.mlx.lockstep import Command
from effects.engine_port import GeneratedToken
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError

__all__ = [
    "Crash", "Job", "Outcome", "Stop", "StreamItem", "as_statecore", "deliver", "engine_failed", "post",
]

T = TypeVar("T")
StreamItem = GeneratedToken | StatecoreError


@dataclass(eq=False)
class Outcome(Generic[T]):
    value: T | None = None
    error: StatecoreError | None = None

    def unwrap(self) -> T:
        if self.error is not None:
            raise StatecoreError(self.error.info) from self.error
        return self.value  # type: ignore[return-value]


@dataclass(eq=False)
class Job(Generic[T]):
    """One unit of device work. `token` None: fire and forget (nobody waits), or a replayed job.

    A `deferred` job's `work` only registers what it asks for (a prefill task); the device loop
    finishes the job later, when that work is computed.
    """

    work: Callable[[], T]
    token: trio.lowlevel.TrioToken | None
    undo: Callable[[T], None] | None = None
    done: trio.Event | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False
    outcome: Outcome[T] | None = None
    deferred: bool = False
    # A tensor-parallel instance replays the job on its other ranks from these plain records
    # (adapters.lockstep); None: the job changes nothing they hold (a read of rank 0's state).
    command: Command | None = None
    undo_command: Command | None = None

    def is_abandoned(self) -> bool:
        with self.lock:
            return self.abandoned


class Stop:
    """Sentinel job: leave the device loop."""


class Crash:
    """Sentinel job: raise outside the per-job wrapper (tests of a dead device thread)."""


def engine_failed(message: str) -> StatecoreError:
    return StatecoreError(ErrorInfo(Fault.BUG, Code.ENGINE_FAILED, message))


def as_statecore(exc: Exception) -> StatecoreError:
    if isinstance(exc, StatecoreError):
        return exc
    message = f"device job failed: {type(exc).__name__}: {exc}"
    return StatecoreError(ErrorInfo(Fault.BUG, Code.INTERNAL, message))


def deliver(items: list[tuple[trio.MemorySendChannel[StreamItem], StreamItem | None, bool]]) -> None:
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
