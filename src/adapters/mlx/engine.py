"""`MlxEngine`: the Engine port over mlx / mlx-lm, driven from trio, computed on one device thread.

Every async method checks its arguments in trio (`checked_prompt`, `checked_token`: what
`statecore.policy.engine_request` and `token_ids` take, token ids inside the vocabulary and sampling
values in range; what a request may ask of the model, to fit its context say, the front end asks
`statecore.policy` once, and peers only send what a front end accepted), builds what needs no device in
worker threads (a payload's caches, a grammar), then posts the call as a command
(`adapters.mlx.commands`) to the device thread, which performs it (`adapters.mlx.performer`) on its loop
(`adapters.mlx.device.DeviceLoop`), and awaits the outcome without blocking the event loop; a tensor- or
pipeline-parallel instance's other ranks perform the same commands. `prefill` queues the prompt for the
scheduler and returns when its last chunk has produced the first token; `decode_held` and `install` put
a cache into the decoder; `stream` yields the tokens after the first. What trio keeps for a request
between its calls (its stream until `stream` reads it, a streamed prefill's handout while it runs, a
streamed handoff's pieces until the install) is its one record in `adapters.mlx.callers`. Two ideas of
the port live beside this facade, which hands their calls on: KV arriving from another node is built and
checked in `adapters.mlx.arriving`, and the prefix cache's calls (its summary, its blocks leaving and
arriving, eviction) are `adapters.mlx.prefix_port`'s. A caller cancelled while its command waits gets it
skipped; one cancelled after it ran gets its effect undone (`commands.undo_of`), so a cancellation never
leaks a cache. An exception escaping the device loop kills the engine:
`statistics().device_thread_alive` turns False and every later call raises `ENGINE_FAILED` (`cancel` and
`release_held` stay quiet no-ops). See docs/engine.md.
This is an adapter: nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, Unpack

import trio

from adapters.kv import frames
from adapters.mlx import commands
from adapters.mlx.arriving import ArrivingKv
from adapters.mlx.callers import Callers
from adapters.mlx.device import DeviceLoop
from adapters.mlx.device_pieces import release_held_pieces
from adapters.mlx.distributed import (
    LockstepLoop,
    refuse_pipelined_handoff,
)
from adapters.mlx.jobs import DeviceThread, Local, StreamSend, engine_failed, engine_lost
from adapters.mlx.kv_out import pieces_of, segment_sink
from adapters.mlx.limits import EngineOptions, engine_settings
from adapters.mlx.load_on_device import ModelSource
from adapters.mlx.memory import (
    out_of_memory_advice,
    share_the_device,
)
from adapters.mlx.performer import Performer
from adapters.mlx.prefill import (
    on_cuda,
    tune_cuda_backend,
)
from adapters.mlx.prefix_port import PrefixPort
from adapters.mlx.profile import SlowStep
from adapters.mlx.settings import Settings
from adapters.mlx.warm_up import warm_serving_path
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
from statecore.errors import StatecoreError, client_error
from statecore.ids import RequestId
from statecore.policy import engine_request, token_ids

__all__ = ["MlxEngine", "checked_prompt", "checked_token"]

logger = logging.getLogger("adapters.engine_mlx")

_T = TypeVar("_T")


def checked_prompt(prompt: Sequence[int], sampling: SamplingParams, info: ModelInfo) -> list[int]:
    """A request's prompt as token ids, taken with its sampling values by
    `statecore.policy.engine_request`; its refusal raised as a client error."""
    return _taken(engine_request(prompt, info.vocab_size, max_tokens=sampling.max_tokens,
                                 temperature=sampling.temperature, top_p=sampling.top_p,
                                 top_k=sampling.top_k))


def checked_token(token: int, what: str, info: ModelInfo) -> int:
    """A token id as a Python int inside the vocabulary (`statecore.policy.token_ids`)."""
    return _taken(token_ids((token,), info.vocab_size, what))[0]


def _taken(checked: list[int] | str) -> list[int]:
    if isinstance(checked, str):
        raise StatecoreError(client_error(checked))
    return checked


class MlxEngine:
    """The Engine port over mlx-lm. Build with `await MlxEngine.load(model_dir, ...)`."""

    def __init__(self, source: ModelSource, settings: Settings) -> None:
        """Private: use `MlxEngine.load`."""
        tensor = source.tensor
        self._tensor = tensor
        self._settings = settings
        self._thread = DeviceThread(self._die, partial(out_of_memory_advice,
                                                       kv_memory_bytes=settings.kv_memory_bytes))
        # trio side: each request's streams and pieces between its calls (`adapters.mlx.callers`)
        self._callers = Callers()
        self.stream_sends: Callable[[RequestId], StreamSend] | None = None  # set by a core process
        self._device = (DeviceLoop(settings, self._thread.queue) if tensor is None
                        else LockstepLoop(settings, self._thread.queue, tensor))
        self._performer = Performer(self._device, settings, source)
        self._device.publish = self._performer.publish
        self._device.cache_bytes = self._performer.cache_bytes
        self._device.inbox.perform = self._performer.perform
        self._arriving = ArrivingKv(self._callers, self._device, self._post,
                                    lambda: (self._performer.classes, self.info.fingerprint))
        self._prefixes = PrefixPort(self._thread, self._device, self._performer, settings,
                                    lambda: self._running_info, parallel=tensor is not None)
        self._thread.start(self._device.run)

    # -- construction --------------------------------------------------------------------------

    @classmethod
    async def load(
        cls,
        model_dir: Path,
        *,
        trust_remote_code: bool = False,
        adapter_path: Path | None = None,
        adapters: Sequence[tuple[str, Path]] = (),
        warm_request: bool | None = None,
        model_call_hook: Callable[[str, Sequence[str]], None] | None = None,
        **options: Unpack[EngineOptions],
    ) -> MlxEngine:
        """Start the device thread and load `model_dir` on it (mlx_lm.utils.load).

        `options` are the device loop's settings (`adapters.mlx.limits.EngineOptions`): they go to
        `adapters.mlx.limits.engine_settings`, where they are documented, defaulted and checked.
        `trust_remote_code`, `adapter_path`, `adapters` and `draft_model` say what the load reads
        (`adapters.mlx.load_on_device.ModelSource`, where each is described).

        `warm_request` (default: where prefill shapes are warmed at load, i.e. with a shape bucket on
        MLX's CUDA backend) runs `adapters.mlx.warm_up`'s request at the end of the load.

        `model_call_hook` (tests: `Faults.model_call_hook`) runs inside every model call with its
        stage ("prefill" or "decode") and the request ids it computes, and may raise.

        `tensor` (`adapters.mlx.distributed.join_group`): this process is one rank of a
        tensor-parallel instance; each rank loads its shard, and the ranks run in lockstep. On rank
        0 the engine is used as any other; on the others `load` returns at once and the device
        thread performs the commands of rank 0's plans (the engine's port methods are not for them):
        `follower_loop` is what `watch_follower` watches.
        """
        if adapters and options.get("prefix_cache_bytes") is None:
            options["prefix_cache_bytes"] = 0  # served without the prefix cache (adapters.mlx.loop_setup)
        settings = engine_settings(model_dir, **options)
        device_shared_by = options.get("device_shared_by", 1)
        draft_model, tensor = options.get("draft_model"), options.get("tensor")
        tune_cuda_backend()
        share_the_device(device_shared_by)  # after every check: no refused load leaves it set
        engine = cls(ModelSource(Path(model_dir), trust_remote_code,
                                 None if draft_model is None else Path(draft_model),
                                 None if adapter_path is None else Path(adapter_path), tensor,
                                 tuple((name, Path(path)) for name, path in adapters)), settings)
        engine._device.model_call_hook = model_call_hook
        if tensor is not None and tensor.rank > 0:
            return engine  # its load comes in rank 0's first plan
        try:
            await engine._post(commands.Load(dataclasses.asdict(settings)))
            if (engine._device.bucket > 0 and on_cuda()) if warm_request is None else warm_request:
                await warm_serving_path(engine, settings.prefill_chunk_size,
                                        partial(engine._post, commands.ForgetPrefixes()))
        except BaseException:
            await engine.aclose()
            raise
        return engine

    @property
    def _pipelined(self) -> bool:
        return self._tensor is not None and self._tensor.pipeline

    @property
    def streams_handoffs(self) -> bool:
        """Whether this engine takes part in streamed handoffs: not a tensor- or pipeline-parallel
        instance (those move whole payloads, sliced by rank)."""
        return self._tensor is None

    @property
    def follower_loop(self) -> LockstepLoop:
        """A rank > 0's device loop (for `adapters.mlx.distributed.watch_follower`)."""
        assert isinstance(self._device, LockstepLoop)
        return self._device

    @property
    def device_thread(self) -> threading.Thread:
        assert self._thread.thread is not None
        return self._thread.thread

    @property
    def _running_info(self) -> ModelInfo:
        """The model's info, for a call's checks: the device thread must be running."""
        if not self._thread.alive:
            raise engine_lost("the device thread is not running")
        return self.info

    @property
    def info(self) -> ModelInfo:
        info = self._performer.info
        if info is None:
            raise engine_failed("the engine has no model loaded")
        return info

    # -- the Engine port -----------------------------------------------------------------------

    async def prefill(
        self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams,
        segments: SegmentSink | None = None, device_pieces: bool = False,
    ) -> PrefillOutcome:
        tokens = checked_prompt(prompt, sampling, self._running_info)
        if self._pipelined and not self._settings.decodes_locally:  # a prefill node only hands off
            raise refuse_pipelined_handoff("hand off a prefilled cache")
        matcher = await self._matcher(sampling)
        trio_token = trio.lowlevel.current_trio_token()
        # Pieces by token and layer range need a cache of plain KVCache layers that holds every
        # head (not a tensor-parallel rank's share): otherwise the whole cache goes at the end.
        cuts = self._device.streams_ranges and self.streams_handoffs
        sink = (segment_sink(segments, trio_token, self.info.fingerprint, request_id,
                             device=device_pieces and self.info.device_pieces)
                if cuts and segments is not None else None)
        with self._callers.handing_out(request_id, sink):
            outcome: PrefillOutcome = await self._post(commands.Prefill(request_id, tuple(tokens), sampling),
                                                       Local(matcher=matcher, segment_sink=sink))
        return outcome

    async def send_pieces_on_device(self, request_id: RequestId) -> bool:
        return self.info.device_pieces and self._callers.pieces_on_device(request_id)

    async def export_held(self, request_id: RequestId) -> KvPieces:
        if self._pipelined:
            raise refuse_pipelined_handoff("hand off a prefilled cache")
        tensors: frames.HostTensors = await self._post(commands.Export(request_id))
        return pieces_of(tensors)  # not copied: the pieces reference the tensors

    async def export_prefix(self, tokens: Sequence[int]) -> KvPieces:
        return await self._prefixes.export_prefix(tokens)

    async def import_prefix(self, payload: KvBytes, tokens: Sequence[int]) -> int:
        return await self._prefixes.import_prefix(payload, tokens)

    async def release_held(self, request_id: RequestId) -> int:
        self._end_handoff(request_id)  # its receiver took the KV (or never will), or it never joins
        if not self._thread.alive:
            return 0
        with trio.CancelScope(shield=True):  # quick, and must not be skipped
            freed: int = await self._post(commands.Release(request_id))
        return freed

    async def decode_held(
        self, request_id: RequestId, prompt: Sequence[int], first_token: int, sampling: SamplingParams
    ) -> None:
        tokens = checked_prompt(prompt, sampling, self._running_info)
        first_token = checked_token(first_token, "first_token", self.info)
        await self._start(commands.DecodeHeld(request_id, tuple(tokens), first_token, sampling))

    async def install(self, request_id: RequestId, payload: KvBytes, prompt: Sequence[int], first_token: int,
                      sampling: SamplingParams) -> None:
        tokens = checked_prompt(prompt, sampling, self._running_info)
        first_token = checked_token(first_token, "first_token", self.info)
        if self._pipelined:
            raise refuse_pipelined_handoff("install a handed-off cache")
        built = await self._arriving.built_payload(payload, len(tokens))
        await self._start(commands.Install(request_id, tuple(tokens), first_token, sampling,
                                           sliced=built.ranges is not None), built)

    async def receive_segment(self, request_id: RequestId, segment: KvSegment, prompt_tokens: int, *,
                              max_tokens: int, index: int | None = None) -> None:
        await self._arriving.receive(request_id, segment, prompt_tokens, max_tokens=max_tokens, index=index)

    async def install_segments(self, request_id: RequestId, prompt: Sequence[int], first_token: int,
                               sampling: SamplingParams, pieces: int | None = None) -> None:
        try:
            await self._arriving.all_kept(request_id, pieces)
            kept = self._callers.take_pieces(request_id)
            tokens = checked_prompt(prompt, sampling, self._running_info)
            first_token = checked_token(first_token, "first_token", self.info)
            await self._start(commands.Install(request_id, tuple(tokens), first_token, sampling),
                              Local(pieces=kept))
        finally:
            self._end_handoff(request_id)

    async def stream(self, request_id: RequestId) -> AsyncGenerator[Decoded, None]:
        """Tokens after the first one, a step's as one value. Leaving early cancels the request."""
        steps = self._callers.stream(request_id, partial(self._cancel_nowait, request_id))
        async with aclosing(steps):  # a reader that leaves closes it now: the request is cancelled
            async for step in steps:
                yield step

    async def cancel(self, request_id: RequestId) -> None:
        self._callers.close_stream(request_id)
        self._end_handoff(request_id)
        if not self._thread.alive:
            return
        with trio.CancelScope(shield=True):  # within one step; must not be skipped
            await self._post(commands.Cancel(request_id))

    def _end_handoff(self, request_id: RequestId) -> None:
        """What a handoff of the request left here goes: its pieces' regions in GPU memory (only a
        sender of such pieces holds any), the pieces kept for an install, prefill held back for it."""
        if (info := self._performer.info) is not None and info.device_pieces:
            release_held_pieces(request_id)
        self._callers.forget_pieces(request_id)
        self._device.handoffs_coming.pop(request_id, None)
        self._device.handoffs_expected.pop(request_id, None)

    def liveness(self) -> EngineLiveness:
        alive = self._thread.alive
        return EngineLiveness(alive, self._device.inbox.stalled_s() if alive else 0.0)

    def statistics(self) -> EngineStatistics:
        live = self.liveness()
        return self._performer.statistics(live.alive, live.stalled_s, self._callers.arriving)

    async def prefix_summary(self, since: int | None = None) -> PrefixSummary | None:
        return await self._prefixes.prefix_summary(since)

    async def evict_prefixes(self, nbytes: int) -> int:
        """Forget kept prefix-cache blocks until `nbytes` are freed (`PrefixPort.evict_prefixes`)."""
        return await self._prefixes.evict_prefixes(nbytes)

    def device_profile(self) -> dict[str, tuple[int, float]]:
        """Device-thread time so far by kind of work: {kind: (calls, seconds)} (for benchmarks)."""
        return dict(self._device.profile.spent)

    def slow_steps(self) -> list[SlowStep]:
        """The latest steps that took `SLOW_STEP_S` or more, oldest first (for benchmarks)."""
        return list(self._device.profile.slow_steps)

    async def aclose(self, join_timeout_s: float | None = None) -> None:
        """Stop the device thread; every held cache and live request is dropped.

        Waits for the thread's current step (joining lets MLX's thread-local state go before
        exit), at most `join_timeout_s` when given: a stalled thread is left behind (it is a
        daemon, so the process can still exit)."""
        self._callers.close()
        self._thread.stop_nowait()
        if not await self._thread.join(join_timeout_s):
            logger.error("the device thread did not stop within %.1f s; leaving it behind", join_timeout_s)

    # -- fault injection -----------------------------------------------------------------------

    def crash_device_thread(self) -> None:
        """Make the device loop itself raise (not a job): the engine must report itself dead.
        What the DEVICE_CRASH fault drives; a node wires it only when faults are armed."""
        self._thread.crash_nowait()

    # -- trio-side helpers ---------------------------------------------------------------------

    async def _matcher(self, sampling: SamplingParams) -> Any:
        """A fresh grammar matcher for a request with a response_format (None without one),
        compiled in a worker thread: a schema never stalls the device loop."""
        if sampling.response_format is None:
            return None
        grammars = self._performer.grammars
        if grammars is None:
            raise engine_failed("the engine has no model loaded")
        return await trio.to_thread.run_sync(grammars.matcher, sampling.response_format)

    async def _start(self, command: commands.DecodeHeld | commands.Install,
                     local: Local | None = None) -> None:
        """Open the request's stream, then put it into the decoder on the device thread."""
        request_id, sampling = RequestId(command.request_id), command.sampling
        local = local or Local()
        local.matcher = await self._matcher(sampling)
        if self.stream_sends is not None:  # an engine core process: the items go to its node
            local.send = self.stream_sends(request_id)
            await self._post(command, local)
            return
        with self._callers.opening_stream(request_id, sampling.max_tokens) as local.send:
            await self._post(command, local)

    async def _post(self, command: commands.Command, local: Local | None = None) -> Any:
        return await self._thread.post(command, local)

    def _cancel_nowait(self, request_id: RequestId) -> None:
        self._thread.post_nowait(commands.Cancel(request_id))

    def abandon(self, reason: str) -> None:
        """Give up on a device thread that stopped making progress (the node's watchdog): every
        waiting caller and live stream fails now with ENGINE_FAILED, as does every later call."""
        self._thread.abandon(reason)

    def _die(self, error: StatecoreError) -> None:
        """The device loop is gone: the statistics say so, and every caller and stream fails."""
        self._performer.dead()
        self._device.die(error)

