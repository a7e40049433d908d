"""The local channel between a node's front end and its engine core process: messages and frames.

With `--engine-core process` the engine (`MlxEngine` and its device thread) runs in a child
process of the node (`adapters.mlx.core_process`) and the node talks to it through
`adapters.mlx.core_client.ProcessEngine` over a Unix socket pair. Everything that crosses is a
message here, and nothing else crosses: port calls as values (`Call`), their outcomes with a
statistics snapshot taken as they ended (`Done`, `Raised`), each step's stream items in one write
(`Item`, `Ended`), a streamed prefill's pieces (`Segment`), the statistics every tenth of a second
(`Snapshot`). KV bytes never ride in a message: they are written once into shared memory
(`adapters.kv.shm_outbox`) and a `ShmRef` crosses; the reader sends `Free` back when it is done. Errors
cross as `ErrorInfo` (a `StatecoreError` does not pickle). A frame is a 4-byte length and a
pickle of a list of messages: both ends are this node's own processes, started together, so the
channel is as trusted as a thread's queue (pickle is never used on a socket a peer can reach).
This module must never import mlx or trio.
"""

from __future__ import annotations

import pickle
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from adapters.kv.shm_outbox import DEFAULT_MAX_BYTES
from adapters.kv.shm_region import ShmRef
from effects.engine_port import EngineStatistics, GeneratedToken, ModelInfo, PrefillOutcome
from statecore.errors import ErrorInfo

__all__ = [
    "Abandon", "Call", "Crash", "Done", "Ended", "FirstToken", "Free", "Item", "Load", "Loaded", "Raised",
    "Segment", "FrameWriter", "Snapshot", "Stop", "encode", "read_frame",
]

_LENGTH: Final = struct.Struct("<I")
MAX_FRAME: Final = 1 << 30
NO_REPLY: Final = 0  # a `Call` nobody waits for (a stream's caller left: its cancel)


# -- front end -> core -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Load:
    """The first message: what `MlxEngine.load` takes, and the node's fault rules (tests)."""

    model_dir: str
    options: dict[str, Any]
    fault_specs: tuple[tuple[str, ...], str, str] | None = None  # (specs, marker, role)
    log_level: int = 20
    switch_interval: float = 0.0005
    shm_bytes: int = DEFAULT_MAX_BYTES  # the core's shared memory for the KV it exports


@dataclass(frozen=True, slots=True)
class Call:
    """One port call as a value: `MlxEngine.<method>(*args)`. A KV payload argument is a
    `ShmRef` (the front end's shared memory), freed by the front end once the call ends."""

    call_id: int
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Abandon:
    """The caller of `call_id` was cancelled: cancel the call in the core (its own undo runs)."""

    call_id: int


@dataclass(frozen=True, slots=True)
class Free:
    """The reader of a region is done with it (either way)."""

    ref: ShmRef


@dataclass(frozen=True, slots=True)
class Crash:
    """Make the core's device loop raise (the DEVICE_CRASH fault)."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Close the engine and exit."""


# -- core -> front end -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Loaded:
    info: ModelInfo
    statistics: EngineStatistics
    blas: str  # what the core's MLX computes with (`adapters.blas.blas_in_use`): the node never loads mlx


@dataclass(frozen=True, slots=True)
class Done:
    """`call_id` returned `value` (a KV payload as a `ShmRef` of the core's shared memory)."""

    call_id: int
    value: Any
    statistics: EngineStatistics


@dataclass(frozen=True, slots=True)
class Raised:
    call_id: int
    error: ErrorInfo
    statistics: EngineStatistics


@dataclass(frozen=True, slots=True)
class Item:
    request_id: str
    token: GeneratedToken


@dataclass(frozen=True, slots=True)
class Ended:
    """The request's stream ended (with `error`, or after its last token)."""

    request_id: str
    error: ErrorInfo | None = None


@dataclass(frozen=True, slots=True)
class Segment:
    """One piece of prefill `call_id`'s streamed cache (`effects.engine_port.KvSegment`)."""

    call_id: int
    start: int
    stop: int
    first_layer: int
    end_layer: int
    payload: ShmRef | bytes
    last_step_started: bool


@dataclass(frozen=True, slots=True)
class FirstToken:
    """Prefill `call_id`'s outcome as soon as its first token is known, ahead of the pieces of its
    last step (`effects.engine_port.SegmentSink`); its `Done` follows them."""

    call_id: int
    outcome: PrefillOutcome


@dataclass(frozen=True, slots=True)
class Snapshot:
    statistics: EngineStatistics


# -- frames ------------------------------------------------------------------------------------

def encode(messages: list[Any]) -> bytes:
    body = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


def decode(body: bytes | bytearray | memoryview) -> list[Any]:
    messages = pickle.loads(body)
    assert isinstance(messages, list)
    return messages


def _read_exact(sock: socket.socket, nbytes: int) -> bytearray | None:
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    got = 0
    while got < nbytes:
        count = sock.recv_into(view[got:])
        if count == 0:
            return None
        got += count
    return buffer


def read_frame(sock: socket.socket) -> list[Any] | None:
    """The next frame's messages from a blocking socket; None at the end of the stream."""
    head = _read_exact(sock, _LENGTH.size)
    if head is None:
        return None
    (nbytes,) = _LENGTH.unpack(head)
    if nbytes > MAX_FRAME:
        raise ValueError(f"an engine core frame of {nbytes} bytes")
    body = _read_exact(sock, nbytes)
    return None if body is None else decode(body)


class FrameWriter:
    """One end's writes to the other: messages queued in one pass of its event loop (a burst of
    calls, a step's stream items) leave in one frame, read there at once. `soon` runs a callable
    on the event loop after the current pass; `more` adds what else is due at each write (the
    node's `Free`s). A write to a peer that is gone is dropped: the reader sees the end."""

    def __init__(self, sock: socket.socket, soon: Callable[[Callable[[], None]], None],
                 more: Callable[[], list[Any]] = list) -> None:
        self._sock = sock
        self._soon = soon
        self._more = more
        self._lock = threading.Lock()
        self._queued: list[Any] = []
        self._flush_posted = False

    def queue(self, messages: list[Any]) -> None:
        """Queue `messages` (on the event loop, in order) for the pass's one write."""
        self._queued.extend(messages)
        if not self._flush_posted:
            self._flush_posted = True
            self._soon(self.flush)

    def flush(self) -> None:
        """Write what is queued (and `more`'s) now, if anything."""
        self._flush_posted = False
        messages, self._queued = self._queued, []
        messages.extend(self._more())
        if messages:
            self.write(messages)

    def write(self, messages: list[Any]) -> None:
        """Write `messages` as one frame now, from any thread."""
        try:
            with self._lock:
                self._sock.sendall(encode(messages))
        except OSError:
            pass  # the other end is gone: its reader's end of stream says so
