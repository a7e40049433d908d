"""The engine core's own process (`--engine-core process`): an `MlxEngine` served to its node.

`python -m adapters.mlx.core_process FD` is started by `adapters.mlx.core_client.ProcessEngine`
with one end of a Unix socket pair as FD. It loads the engine as the node would in its own
process (`Load`), then performs each port call the node sends (`Call`) in a trio task of its own,
so a call the node gave up on (`Abandon`) is cancelled here and `MlxEngine`'s own undo runs. Its
device thread thus shares this process's GIL with nothing but this thin loop, never with the
node's HTTP work. Each step's stream items leave in one write: the device thread's delivery
(`jobs.deliver`) hands them to `_ToNode`, and a flush scheduled behind it sends what gathered.
KV leaves through shared memory (`adapters.kv.shm_outbox`: one copy into a region, the bytes' only copy
between the device and the decode node: a prefill node hands the region on as it lies; the node
frees it when the last view of it is gone) and arrives the same way (read in place from the
node's region, or from the prefill node's that the decode node was handed). The process ignores
SIGINT and SIGTERM (its node drains and then stops it) and ends when its node does (end of
stream on the socket). This is an adapter: nothing in `statecore` or `effects` may import it, and
the node's modules start it, never import it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Final

import trio

from adapters.blas import blas_in_use
from adapters.heap import freeze_startup_heap
from adapters.kv.blocking import run_blocking
from adapters.kv.shm_inbox import ShmInbox
from adapters.kv.shm_outbox import DEFAULT_MAX_BYTES, ShmOutbox
from adapters.kv.shm_region import ShmRef
from adapters.mlx.core_wire import (
    NO_REPLY,
    Abandon,
    Call,
    Crash,
    Done,
    Ended,
    FirstToken,
    FrameWriter,
    Free,
    Item,
    Load,
    Loaded,
    Raised,
    Segment,
    Snapshot,
    Stop,
    encode,
    read_frame,
)
from adapters.mlx.engine import MlxEngine
from adapters.mlx.jobs import StreamItem, as_statecore, post
from effects.engine_port import EngineStatistics, KvPieces, KvSegment, PrefillOutcome
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError

__all__ = ["main", "streamed_sink"]

logger = logging.getLogger("adapters.engine_core")

# The port calls a node may send, and which of them take or give KV bytes.
METHODS: Final = frozenset({
    "prefill", "export_held", "export_prefix", "import_prefix", "release_held", "decode_held", "install",
    "receive_segment", "install_segments", "cancel", "prefix_summary", "evict_prefixes",
    "send_pieces_on_device",
})
SNAPSHOT_EVERY_S: Final = 0.1


class _ToNode:
    """A request's stream in this process: each item goes to the node in the step's one write."""

    def __init__(self, server: CoreServer, request_id: str) -> None:
        self._server = server
        self._request_id = request_id
        self._ended = False

    def send_nowait(self, value: StreamItem, /) -> None:
        if self._ended:
            return
        if isinstance(value, StatecoreError):
            self._ended = True
            self._server.push(Ended(self._request_id, value.info))
        else:
            self._server.push(Item(self._request_id, value))

    def close(self) -> None:
        if not self._ended:
            self._ended = True
            self._server.push(Ended(self._request_id))


def streamed_sink(call_id: int, push: Callable[[Any], None], pieces: trio.MemorySendChannel[KvSegment]
                  ) -> Callable[[KvSegment | PrefillOutcome], None]:
    """A streamed prefill's sink in the core (called in trio, posted by the device thread): the
    first token to the node at once (`push`), each piece to `pieces` (put into shared memory in
    order). A piece handed out after the prefill ended (it was cancelled) is dropped: nobody waits
    for it, and raising in trio's callback would end the core."""

    def sink(item: KvSegment | PrefillOutcome) -> None:
        if isinstance(item, PrefillOutcome):
            push(FirstToken(call_id, item))
        else:
            with contextlib.suppress(trio.ClosedResourceError):
                pieces.send_nowait(item)

    return sink


class CoreServer:
    """One engine served over one socket (see the module's paragraph)."""

    def __init__(self, sock: socket.socket, engine: MlxEngine, shm_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._sock = sock
        self.engine = engine
        self._token = trio.lowlevel.current_trio_token()
        self._writer = FrameWriter(sock, partial(post, self._token))
        self._scopes: dict[int, trio.CancelScope] = {}
        self._outbox = ShmOutbox(max_bytes=shm_bytes, checksum=False)  # payloads carry their own checksums
        self._inbox = ShmInbox()
        engine.stream_sends = partial(_ToNode, self)

    def push(self, message: Any) -> None:
        """Queue a message for the node; everything queued before the flush goes in one write."""
        self._writer.queue([message])

    def write_now(self, messages: list[Any]) -> None:
        """Write `messages` to the node at once, from any thread (the load's answer)."""
        self._writer.write(messages)

    async def run(self) -> None:
        stopped = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._snapshots)

            def handle(messages: list[Any] | None) -> None:
                if stopped.is_set():
                    return
                try:
                    going_on = messages is not None and self._handle(messages, nursery)
                except Exception:  # a bug here must not take trio's run down with it
                    logger.exception("the engine core failed to act on a frame")
                    going_on = False
                if not going_on:
                    stopped.set()

            reader = threading.Thread(target=self._read, args=(handle,), name="core-reader", daemon=True)
            reader.start()
            await stopped.wait()
            nursery.cancel_scope.cancel()

    def _read(self, handle: Callable[[list[Any] | None], None]) -> None:
        """Each frame to trio as it is read, without waiting for trio to take it: a burst of calls
        is read at once, not one trio round trip after another (in a burst of 32 prefills that
        cost p50 15 ms from a call's send to its start, 3 ms without). Unbounded, as the node's
        calls are (its admission bounds them)."""
        while True:
            try:
                messages = read_frame(self._sock)
            except (OSError, ValueError):
                messages = None
            try:
                self._token.run_sync_soon(handle, messages)
            except trio.RunFinishedError:
                return
            if messages is None:
                return

    def _handle(self, messages: list[Any], nursery: trio.Nursery) -> bool:
        """Act on one frame; False once told to stop."""
        for message in messages:
            match message:
                case Call():
                    nursery.start_soon(self._call, message)
                case Abandon(call_id=call_id):
                    scope = self._scopes.get(call_id)
                    if scope is not None:
                        scope.cancel()
                case Free(ref=ref):
                    self._outbox.free(ref)
                case Crash():
                    self.engine.crash_device_thread()
                case Stop():
                    return False
                case _:
                    logger.error("the engine core ignores an unknown message %r", type(message).__name__)
        return True

    async def _snapshots(self) -> None:
        while True:
            await trio.sleep(SNAPSHOT_EVERY_S)
            self.push(Snapshot(self.engine.statistics()))

    async def _call(self, call: Call) -> None:
        reply: Done | Raised | None = None
        with trio.CancelScope() as scope:
            if call.call_id != NO_REPLY:
                self._scopes[call.call_id] = scope
            try:
                if call.method not in METHODS:
                    raise StatecoreError(ErrorInfo(Fault.BUG, Code.INTERNAL,
                                                   f"no engine call {call.method!r}"))
                value = await self._perform(call)
                reply = Done(call.call_id, await self._outgoing(value, call), self.engine.statistics())
            except StatecoreError as exc:
                reply = Raised(call.call_id, exc.info, self.engine.statistics())
            except Exception as exc:  # a bug in a call fails that call only, as on the device thread
                logger.exception("engine core call %s failed", call.method)
                reply = Raised(call.call_id, as_statecore(exc).info, self.engine.statistics())
            finally:
                self._scopes.pop(call.call_id, None)
        if reply is None:  # cancelled: the node no longer waits, but it drops its record on this
            left = ErrorInfo(Fault.CANCELLED, Code.CANCELLED, "abandoned by its caller")
            reply = Raised(call.call_id, left, self.engine.statistics())
        if call.call_id != NO_REPLY:
            self.push(reply)

    async def _perform(self, call: Call) -> Any:
        engine = self.engine
        args = list(call.args)
        match call.method:
            case "install" | "import_prefix":
                at = 1 if call.method == "install" else 0
                args[at] = await self._incoming(args[at])
            case "receive_segment":
                piece: Segment = args[1]
                args[1] = KvSegment(piece.start, piece.stop, piece.first_layer, piece.end_layer,
                                    KvPieces((await self._incoming(piece.payload),)), piece.last_step_started)
            case "prefill" if call.kwargs.get("segments"):
                device_pieces = bool(call.kwargs.get("device_pieces"))
                return await self._streamed_prefill(call.call_id, args, device_pieces)
        return await getattr(engine, call.method)(*args, **call.kwargs)

    async def _streamed_prefill(self, call_id: int, args: list[Any], device_pieces: bool) -> Any:
        """A prefill whose pieces stream to a sink: each goes to the node as it comes, in order,
        its first token at once (ahead of pieces still being put into shared memory), and the
        outcome after the last piece. Unbounded, and never blocking the sink: a prompt's pieces
        are bounded by its chunks and layer slices."""
        send, receive = trio.open_memory_channel[KvSegment](math.inf)
        sink = streamed_sink(call_id, self.push, send)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._forward_segments, call_id, str(args[0]), receive)
            try:
                request_id, prompt, sampling = args
                return await self.engine.prefill(request_id, prompt, sampling, segments=sink,
                                                 device_pieces=device_pieces)
            finally:
                send.close()

    async def _forward_segments(self, call_id: int, request_id: str,
                                segments: trio.MemoryReceiveChannel[KvSegment]) -> None:
        async with segments:
            async for segment in segments:
                # a device piece's document is put on this thread (no seal: the bytes are all there)
                small = segment.payload.nbytes if segment.payload.seal is None else None
                payload = await run_blocking(partial(self._put, request_id, segment.payload), small)
                self.push(Segment(call_id, segment.start, segment.stop, segment.first_layer,
                                  segment.end_layer, payload, segment.last_step_started))

    async def _incoming(self, payload: ShmRef | bytes) -> memoryview | bytes:
        if isinstance(payload, bytes):
            return payload
        return await run_blocking(partial(self._inbox.read, payload), payload.nbytes)

    async def _outgoing(self, value: Any, call: Call) -> Any:
        if not isinstance(value, KvPieces):
            return value
        holder = str(call.args[0]) if call.method == "export_held" else "prefix"
        return await trio.to_thread.run_sync(self._put, holder, value)

    def _put(self, holder: str, payload: KvPieces) -> ShmRef | bytes:
        """The payload's one copy, into shared memory (its end frame waited for); its bytes
        inline when the regions are all held (the node frees them as it sends)."""
        pieces = [memoryview(piece) for piece in payload.pieces]
        if payload.seal is not None:
            pieces.append(memoryview(payload.seal()))
        try:
            return self._outbox.put(holder, pieces)
        except StatecoreError as exc:
            if exc.info.code is not Code.OVERLOADED:
                raise
            return b"".join(pieces)

    def close(self) -> None:
        self._outbox.close()
        self._inbox.close()


async def serve(sock: socket.socket) -> int:
    """Load the engine the first message names, then serve it until the node stops it."""
    first = await trio.to_thread.run_sync(read_frame, sock)
    if not first or not isinstance(first[0], Load):
        return 2
    load: Load = first[0]
    logging.basicConfig(level=load.log_level, stream=sys.stderr,
                        format="%(asctime)s engine-core %(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(load.switch_interval)
    hook = None
    if load.fault_specs is not None:
        from effects.faults import Faults

        specs, marker, role = load.fault_specs
        hook = Faults.parse(specs, marker, role).model_call_hook()
    try:
        engine = await MlxEngine.load(Path(load.model_dir), model_call_hook=hook, **load.options)
    except StatecoreError as exc:
        sock.sendall(encode([Raised(NO_REPLY, exc.info, EngineStatistics(0, 0, 0, False))]))
        return 1
    server = CoreServer(sock, engine, load.shm_bytes)
    freeze_startup_heap()  # before its first step: a full collection stalls the device thread
    try:
        server.write_now([Loaded(engine.info, engine.statistics(), blas_in_use())])
        await server.run()
    finally:
        with trio.CancelScope(shield=True):
            await engine.aclose(join_timeout_s=5.0)
        server.close()
    return 0


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the node drains, then stops its core
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[1]))
    return trio.run(serve, sock)


if __name__ == "__main__":
    code = main(sys.argv)
    # Everything is closed; skip MLX's C++ static teardown, which was seen to abort in short-lived
    # MLX processes (as `statecore run` does: adapters.serve.command._exit_now).
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)
