"""`CoreCalls`: the calls a node has in flight to its engine core process, each awaiting its reply.

A call goes as a `Call` (`adapters.mlx.core_wire`) and its caller awaits the `Done` or `Raised`
with its id. A caller cancelled meanwhile sends `Abandon` (the core cancels the call, and its
engine undoes what it did); a call that completed anyway, here or after its `Abandon`, is undone
from here: a payload it exported is freed, and a request it started is cancelled, so a
cancellation never leaks a cache. When the core is gone (`fail_all`) every waiting caller, and
every later one, gets the node's error. Pieces a call streams back before its reply (KV segments,
the first token) go to the call's `sink`. Used on the node's trio thread only. This module
imports trio; it must never import mlx, nor anything that does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import trio

from adapters.kv.shm_region import ShmRef
from adapters.mlx.core_wire import NO_REPLY, Abandon, Call, Done, Free, Raised
from effects.engine_port import SegmentSink
from statecore.errors import StatecoreError

__all__ = ["UNDONE_BY_CANCEL", "CoreCalls"]

# Calls whose caller left after the core performed them are undone by cancelling the request.
UNDONE_BY_CANCEL: Final = frozenset({
    "prefill", "decode_held", "install", "install_segments", "receive_segment",
})


@dataclass(eq=False)
class _Waiting:
    call: Call
    done: trio.Event
    reply: Done | Raised | None = None
    sink: SegmentSink | None = None


class CoreCalls:
    """Calls in flight: `send` queues messages for the core; `dead` is the error a caller gets
    once the core is gone."""

    def __init__(self, send: Callable[[list[Any]], None], dead: Callable[[], StatecoreError]) -> None:
        self._send = send
        self._dead = dead
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Waiting] = {}
        self._abandoned: dict[int, Call] = {}
        self._open = True

    def pending(self) -> bool:
        """Whether a caller waits for a reply."""
        return bool(self._waiting)

    async def call(self, method: str, *args: Any, sink: SegmentSink | None = None,
                   kwargs: dict[str, Any] | None = None) -> Any:
        """Perform `method` in the core: its value, or its error raised here."""
        if not self._open:
            raise self._dead()
        call = Call(next(self._ids), method, args, kwargs or {})
        waiting = _Waiting(call, trio.Event(), sink=sink)
        self._waiting[call.call_id] = waiting
        self._send([call])
        try:
            await waiting.done.wait()
        except BaseException:
            if self._waiting.pop(call.call_id, None) is not None and self._open:
                self._abandoned[call.call_id] = call
                self._send([Abandon(call.call_id)])
            elif isinstance(waiting.reply, Done):
                self._undo(call, waiting.reply.value)
            raise
        reply = waiting.reply
        if isinstance(reply, Done):
            return reply.value
        if reply is None:
            raise self._dead()
        raise StatecoreError(reply.error)

    def sink(self, call_id: int) -> SegmentSink | None:
        """Where the pieces call `call_id` streams back go (None: nobody waits for them)."""
        waiting = self._waiting.get(call_id)
        return None if waiting is None else waiting.sink

    def answer(self, reply: Done | Raised) -> None:
        """The core's reply: to its caller, or undone when the caller left."""
        waiting = self._waiting.pop(reply.call_id, None)
        if waiting is not None:
            waiting.reply = reply
            waiting.done.set()
            return
        call = self._abandoned.pop(reply.call_id, None)
        if call is not None and isinstance(reply, Done):
            self._undo(call, reply.value)

    def fail_all(self) -> None:
        """The core is gone: every waiting caller wakes to `dead()`, as every later one will."""
        self._open = False
        for waiting in self._waiting.values():
            waiting.done.set()  # no reply: `call` raises `dead()`
        self._waiting.clear()
        self._abandoned.clear()

    def _undo(self, call: Call, value: Any) -> None:
        """A call done in the core after its caller left: give back what it took."""
        if isinstance(value, ShmRef):
            self._send([Free(value)])
        if call.method in UNDONE_BY_CANCEL and self._open:
            self._send([Call(NO_REPLY, "cancel", (call.args[0],))])
