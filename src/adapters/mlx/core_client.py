"""`ProcessEngine`: the Engine port in a node whose engine core runs in its own process.

`--engine-core process` starts `adapters.mlx.core_process` as a child of the node and talks to it
over a Unix socket pair (`adapters.mlx.core_wire`): each port call is a call to the core
(`adapters.mlx.core_calls`: awaited, abandoned by a caller that leaves, undone when the core did it
anyway, so a cancellation never leaks a cache). Tokens arrive one write per step; the node's end of
the socket (`adapters.mlx.core_link`) hands each write to trio in one callback, which feeds the
requests' streams (kept in `adapters.mlx.callers` until `stream()` takes them, as `MlxEngine` keeps
its own). `statistics()` is the latest snapshot the core sent (with every outcome, and every tenth
of a second). KV crosses in shared memory (`adapters.mlx.core_kv`: read in place, handed over by
reference, else copied once); a streamed piece that arrived in another node's region
(`KvPieces.shared`) goes to the core as that reference, read there in place. The core's death (its
process exits, however) is the node's loss, typed as a dead device thread is: every waiting call and
live stream fails with `ENGINE_FAILED` as a transport fault, as does every later call, and
`statistics().device_thread_alive` turns False so `watch_engine` ends the node's loop. The
watchdog's `abandon` kills the process (which a thread never could be). Tensor- and
pipeline-parallel instances are not served this way (refused at load). This module imports trio; it
must never import mlx (nothing here touches the device), nor import anything that does: a node whose
core is a process never loads mlx (the package's `__init__` loads its names on first use).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Final

import trio

from adapters.kv.shm_landing import ShmLanding
from adapters.kv.shm_outbox import DEFAULT_MAX_BYTES
from adapters.kv.shm_region import ShmRef
from adapters.mlx.callers import Callers
from adapters.mlx.core_link import CoreLink
from adapters.mlx.core_wire import (
    NO_REPLY,
    Call,
    Crash,
    Load,
    Loaded,
    Raised,
    Segment,
    Stop,
    encode,
    read_frame,
)
from adapters.mlx.jobs import engine_failed, engine_lost
from effects.engine_port import (
    Decoded,
    EngineLiveness,
    EngineStatistics,
    KvBytes,
    KvPieces,
    KvSegment,
    ModelInfo,
    PrefillOutcome,
    PrefixSummary,
    SamplingParams,
    SegmentSink,
)
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.ids import RequestId

__all__ = ["ProcessEngine"]

logger = logging.getLogger("adapters.engine_core")

LOAD_DEADLINE_S: Final = 600.0
# The core sends its statistics every 0.1 s: silent for longer than this with work waiting, it is
# stuck itself (not only its device thread), and the silence counts as its stall for the watchdog.
SILENT_S: Final = 1.0


class ProcessEngine:
    """The Engine port over an engine core process. Build with `await ProcessEngine.load(...)`."""

    def __init__(self, process: subprocess.Popen[bytes], sock: Any, loaded: Loaded) -> None:
        """Private: use `ProcessEngine.load`."""
        self.info: ModelInfo = loaded.info
        self.blas = loaded.blas  # what the core's MLX computes with
        self._callers = Callers()
        self._link = CoreLink(process, sock, loaded, self._callers)
        self._calls = self._link.calls
        self._kv = self._link.kv

    @classmethod
    async def load(cls, model_dir: Path, *, fault_specs: tuple[tuple[str, ...], str, str] | None = None,
                   switch_interval: float = 0.0005, shm_bytes: int = DEFAULT_MAX_BYTES,
                   **options: Any) -> ProcessEngine:
        """Start the core process and load `model_dir` there with `MlxEngine.load`'s `options`;
        `fault_specs` (specs, marker, role) arms the node's fault rules in the core (tests);
        `shm_bytes` bounds the shared memory the core's exports take (a prefill node's
        `--kv-shm-bytes`: its streamed pieces wait there for the decode node)."""
        if options.get("tensor") is not None:
            raise StatecoreError(ErrorInfo(
                Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
                "--engine-core process does not serve a tensor- or pipeline-parallel instance: its "
                "ranks run in lockstep on their device threads (use --engine-core thread)"))
        options.pop("tensor", None)
        if options.pop("model_call_hook", None) is not None:
            raise StatecoreError(ErrorInfo(Fault.BUG, Code.INTERNAL,
                                           "a model_call_hook cannot cross to the core: pass fault_specs"))
        import socket

        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        process = subprocess.Popen([sys.executable, "-m", "adapters.mlx.core_process", str(theirs.fileno())],
                                   pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        logger.info("started the engine core process (pid %d)", process.pid)
        try:
            mine.sendall(encode([Load(str(model_dir), options, fault_specs, logging.getLogger().level,
                                      switch_interval, shm_bytes)]))
            with trio.fail_after(LOAD_DEADLINE_S):
                first = await trio.to_thread.run_sync(read_frame, mine, abandon_on_cancel=True)
        except BaseException:
            process.kill()
            mine.close()
            raise
        loaded = first[0] if first else None
        if not isinstance(loaded, Loaded):
            code = await trio.to_thread.run_sync(process.wait)
            mine.close()
            if isinstance(loaded, Raised):
                raise StatecoreError(loaded.error)
            raise engine_lost(f"the engine core process exited while loading (exit code {code})")
        return cls(process, mine, loaded)

    @property
    def streams_handoffs(self) -> bool:
        return True

    def copies_into_shared_memory(self) -> int:
        """How many payloads this node copied into its own shared memory for the core (those it
        could not hand over by reference)."""
        return self._kv.copies

    def kv_landing(self, fallback: Callable[[int], memoryview]) -> ShmLanding:
        """Where KV received for this engine should land (the node's peers' `landing`): a region
        of this node's shared memory, which `install`, `receive_segment` and `import_prefix` hand
        to the core by reference; `fallback` (process memory) when no region is free."""
        return self._kv.landing(fallback)

    @property
    def core_pid(self) -> int:
        """The core process's id (tests kill it)."""
        return self._link.process.pid

    # -- the Engine port -----------------------------------------------------------------------

    async def prefill(self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams,
                      segments: SegmentSink | None = None, device_pieces: bool = False) -> PrefillOutcome:
        streamed = {"segments": True, "device_pieces": device_pieces}
        outcome: PrefillOutcome = await self._calls.call(
            "prefill", request_id, tuple(prompt), sampling, sink=segments,
            kwargs=streamed if segments is not None else {})
        return outcome

    async def send_pieces_on_device(self, request_id: RequestId) -> bool:
        on_device: bool = await self._calls.call("send_pieces_on_device", request_id)
        return on_device

    async def export_held(self, request_id: RequestId) -> KvPieces:
        return self._kv.as_pieces(await self._calls.call("export_held", request_id))

    async def export_prefix(self, tokens: Sequence[int]) -> KvPieces:
        return self._kv.as_pieces(await self._calls.call("export_prefix", tuple(tokens)))

    async def import_prefix(self, payload: KvBytes, tokens: Sequence[int]) -> int:
        shared = await self._kv.share("prefix", (payload,))
        try:
            kept: int = await self._calls.call("import_prefix", shared, tuple(tokens))
        finally:
            self._kv.unshare(shared)
        return kept

    async def release_held(self, request_id: RequestId) -> int:
        if not self._link.alive:
            return 0
        with trio.CancelScope(shield=True):  # quick, and must not be skipped
            freed: int = await self._calls.call("release_held", request_id)
        return freed

    async def decode_held(self, request_id: RequestId, prompt: Sequence[int], first_token: int,
                          sampling: SamplingParams) -> None:
        await self._start("decode_held", request_id, sampling, tuple(prompt), first_token)

    async def install(self, request_id: RequestId, payload: KvBytes, prompt: Sequence[int], first_token: int,
                      sampling: SamplingParams) -> None:
        shared = await self._kv.share(request_id, (payload,))
        try:
            await self._start("install", request_id, sampling, shared, tuple(prompt), first_token)
        finally:
            self._kv.unshare(shared)

    async def receive_segment(self, request_id: RequestId, segment: KvSegment, prompt_tokens: int, *,
                              max_tokens: int, index: int | None = None) -> None:
        pieces = segment.payload
        handed_on = pieces.shared if isinstance(pieces.shared, ShmRef) else None
        shared = handed_on or await self._kv.share(request_id, pieces.pieces, pieces.seal)
        piece = Segment(NO_REPLY, segment.start, segment.stop, segment.first_layer, segment.end_layer, shared,
                        segment.last_step_started)
        try:
            await self._calls.call("receive_segment", request_id, piece, prompt_tokens,
                             kwargs={"max_tokens": max_tokens, "index": index})
        finally:
            if handed_on is None:
                self._kv.unshare(shared)

    async def install_segments(self, request_id: RequestId, prompt: Sequence[int], first_token: int,
                               sampling: SamplingParams, pieces: int | None = None) -> None:
        await self._start("install_segments", request_id, sampling, tuple(prompt), first_token,
                          kwargs={"pieces": pieces})

    async def stream(self, request_id: RequestId) -> AsyncGenerator[Decoded, None]:
        """Tokens after the first one, a step's as one value. Leaving early cancels the request."""
        steps = self._callers.stream(request_id, partial(self._cancel_nowait, request_id))
        async with aclosing(steps):  # a reader that leaves closes it now: the request is cancelled
            async for step in steps:
                yield step

    async def cancel(self, request_id: RequestId) -> None:
        self._callers.drop(request_id)
        if not self._link.alive:
            return
        with trio.CancelScope(shield=True):  # within one step; must not be skipped
            await self._calls.call("cancel", request_id)

    def liveness(self) -> EngineLiveness:
        if not self._link.alive:
            return EngineLiveness(False)
        stalled = self._link.statistics.stalled_s
        silent = time.monotonic() - self._link.heard_at
        if silent > SILENT_S and (self._calls.pending() or self._callers.feeding):
            stalled = max(stalled, silent)
        return EngineLiveness(True, stalled)

    def statistics(self) -> EngineStatistics:
        stats = self._link.statistics
        if not self._link.alive:
            return EngineStatistics(0, 0, 0, False, stats.step_retries, stats.rows_isolated)
        silent = time.monotonic() - self._link.heard_at
        if silent > SILENT_S and (self._calls.pending() or self._callers.feeding):
            return replace(stats, stalled_s=max(stats.stalled_s, silent))
        return stats

    async def prefix_summary(self, since: int | None = None) -> PrefixSummary | None:
        summary: PrefixSummary | None = await self._calls.call("prefix_summary", since)
        return summary

    async def evict_prefixes(self, nbytes: int) -> int:
        freed: int = await self._calls.call("evict_prefixes", nbytes)
        return freed

    async def aclose(self, join_timeout_s: float | None = None) -> None:
        """Stop the core (it closes its engine) and wait for it to exit, at most `join_timeout_s`
        when given (then it is killed)."""
        link = self._link
        was_alive = link.alive
        link.closed = True
        link.die(engine_failed("the engine is closed"))
        self._callers.close()
        if was_alive:
            link.send([Stop()])
        with trio.CancelScope(shield=True):
            try:
                await trio.to_thread.run_sync(link.process.wait, join_timeout_s)
            except subprocess.TimeoutExpired:
                logger.error("the engine core did not stop within %.1f s; killing it", join_timeout_s)
                link.process.kill()
                await trio.to_thread.run_sync(link.process.wait)
        link.close_socket()

    def crash_device_thread(self) -> None:
        """The DEVICE_CRASH fault: the core's device loop raises."""
        self._link.send([Crash()])

    def abandon(self, reason: str) -> None:
        """Give up on a core that stopped making progress (the node's watchdog): every waiting
        caller and live stream fails now, and the process is killed."""
        if not self._link.alive:
            return
        logger.error("abandoning the engine core: %s", reason)
        self._link.die(engine_lost(f"the engine was abandoned: {reason}"))
        with contextlib.suppress(OSError):
            self._link.process.kill()

    # -- calls ---------------------------------------------------------------------------------

    async def _start(self, method: str, request_id: RequestId, sampling: SamplingParams, *args: Any,
                     kwargs: dict[str, Any] | None = None) -> None:
        """Open the request's stream here (fed by the core's items), then put it into the core's decoder."""
        with self._callers.opening_stream(request_id, sampling.max_tokens, fed_here=True):
            await self._calls.call(method, request_id, *args, sampling, kwargs=kwargs or {})

    def _cancel_nowait(self, request_id: RequestId) -> None:
        if self._link.alive:
            self._link.send([Call(NO_REPLY, "cancel", (request_id,))])
