"""How trio and the device thread talk: jobs in, outcomes and stream items out.

A trio task posts a `Job` (a command of `adapters.mlx.commands`, and what only this process holds
beside it: `Local`) on the device thread's queue and waits on a `trio.Event`; the device thread
performs the command and sets the event with `TrioToken.run_sync_soon`, which never blocks the
device. A job whose caller was cancelled is `abandoned`: skipped if it has not run, undone by its
command's undo (`commands.undo_of`) if it has, so a cancellation never leaks a cache. Stream
items (tokens, or one error) go out the same way, in one message per step and event loop. This
module imports trio; it must never import mlx.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import trio

from adapters.mlx.commands import Cancel, Command, Prefill, undo_of
from effects.engine_port import GeneratedToken
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError

__all__ = [
    "Crash", "Job", "Local", "Outcome", "Stop", "StreamItem", "StreamSend", "as_statecore", "deliver",
    "engine_failed", "engine_lost", "post",
]

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
