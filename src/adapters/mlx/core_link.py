"""`CoreLink`: a node's end of the socket to its engine core process, and the core's life as the
node sees it.

What goes to the core leaves through one `FrameWriter` (everything queued in one pass of trio's
event loop in one write, with the `Free`s due then). What the core sends is read by a reader thread
and handed to trio one frame per callback (`_dispatch`): a request's stream items into its kept
stream (`adapters.mlx.callers`), a call's reply, its KV pieces and its first token to the call
waiting for them (`adapters.mlx.core_calls`), the core's statistics (with every reply, and every
tenth of a second). The core is gone when its socket ends (its process exited, however) or the
node gives it up (`die`): every waiting call and kept stream fails then, and every later call.
Used on the node's trio thread, but for the reader thread. This module imports trio; it must
never import mlx, nor anything that does.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
import time
from functools import partial
from typing import Any

import trio

from adapters.kv.shm_region import ShmRef
from adapters.mlx.callers import Callers
from adapters.mlx.core_calls import CoreCalls
from adapters.mlx.core_kv import CoreKv
from adapters.mlx.core_wire import (
    Done,
    Ended,
    FirstToken,
    FrameWriter,
    Free,
    Item,
    Loaded,
    Raised,
    Segment,
    Snapshot,
    read_frame,
)
from adapters.mlx.jobs import engine_failed, engine_lost, post
from effects.engine_port import EngineStatistics, KvSegment
from statecore.errors import StatecoreError

__all__ = ["CoreLink"]

logger = logging.getLogger("adapters.engine_core")


class CoreLink:
    """The socket to the core `process` (see the module's paragraph); `callers` keeps the streams
    its items go to. `calls` and `kv` are the port's ways to the core."""

    def __init__(self, process: subprocess.Popen[bytes], sock: Any, loaded: Loaded, callers: Callers) -> None:
        self.process = process
        self._sock = sock
        self._callers = callers
        self.statistics: EngineStatistics = loaded.statistics  # the latest the core sent
        self.heard_at = time.monotonic()  # when the core's last frame came
        self.alive = True
        self.closed = False  # closed by the node (not lost)
        self._error: StatecoreError | None = None
        self._token = trio.lowlevel.current_trio_token()
        self.calls = CoreCalls(self.send, self._dead)
        self.kv = CoreKv(self._wake_for_frees)
        # a burst of calls leaves in one write, with the frees due then
        self._writer = FrameWriter(sock, partial(post, self._token), self.kv.due_frees)
        self._reader = threading.Thread(target=self._read, name="core-reader", daemon=True)
        self._reader.start()

    def send(self, messages: list[Any]) -> None:
        """Queue `messages` for the core (in trio, in order): everything queued in one pass of the
        event loop (a burst of requests' calls) leaves in one write, read by the core at once."""
        self._writer.queue(messages)

    def die(self, error: StatecoreError) -> None:
        """The core is gone: every waiting call and kept stream fails with `error`."""
        if not self.alive:
            return
        self.alive = False
        self._error = error
        self.calls.fail_all()
        self._callers.fail_feeds(error)

    def close_socket(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        self.kv.close()

    def _dead(self) -> StatecoreError:
        if self.closed:
            return engine_failed("the engine is closed")
        return self._error or engine_lost("the engine core process is gone")

    # -- what the core sends -------------------------------------------------------------------

    def _read(self) -> None:
        """The reader thread: each frame to trio in one callback; the core's end after the last."""
        while True:
            try:
                messages = read_frame(self._sock)
            except (OSError, ValueError, EOFError):
                messages = None
            if messages is None:
                break
            post(self._token, self._dispatch, messages)
        code = self.process.wait()
        post(self._token, self._lost, code)

    def _dispatch(self, messages: list[Any]) -> None:
        self.heard_at = time.monotonic()
        for message in messages:
            match message:
                case Item(request_id=request_id, token=token):
                    self._callers.feed(request_id, token)
                case Ended(request_id=request_id, error=error):
                    self._callers.end_feed(request_id, None if error is None else StatecoreError(error))
                case Done() | Raised():
                    self.statistics = message.statistics
                    self.calls.answer(message)
                case Segment(call_id=call_id):
                    sink = self.calls.sink(call_id)
                    if sink is None:
                        if isinstance(message.payload, ShmRef):
                            self.send([Free(message.payload)])
                        continue
                    sink(KvSegment(message.start, message.stop, message.first_layer, message.end_layer,
                                   self.kv.as_pieces(message.payload), message.last_step_started))
                case FirstToken(call_id=call_id, outcome=outcome):
                    sink = self.calls.sink(call_id)
                    if sink is not None:
                        sink(outcome)
                case Snapshot(statistics=statistics):
                    self.statistics = statistics

    def _lost(self, code: int) -> None:
        if not self.closed:
            logger.error("the engine core process exited (code %s)", code)
        self.die(engine_lost(f"the engine core process exited (code {code})"))

    # -- frees of exported payloads ------------------------------------------------------------

    def _wake_for_frees(self) -> None:
        """Any thread (the last view of a payload may go anywhere): flush the frees soon."""
        if self.alive:
            post(self._token, self._flush_frees)

    def _flush_frees(self) -> None:
        if self.kv.frees_due() and self.alive:
            self._writer.flush()
