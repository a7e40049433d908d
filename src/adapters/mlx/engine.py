"""`MlxEngine`: the Engine port over mlx / mlx-lm, driven from trio, computed on one device thread.

Every async method validates its arguments in trio (pure Python), then posts a job to the device
thread (`adapters.mlx.device.DeviceLoop`) and waits without blocking the event loop. `prefill`
queues the prompt for the scheduler and returns when its last chunk has produced the first token;
`decode_held` and `install` put a cache into the decoder; `stream` yields the tokens after the
first. A caller cancelled while its job waits gets it skipped; one cancelled after the job ran gets
its effect undone, so a cancellation never leaks a cache. An exception escaping the device loop
kills the engine: `statistics().device_thread_alive` turns False and every later call raises
`ENGINE_FAILED` (`cancel` and `release_held` stay quiet no-ops). See docs/engine.md.
This is an adapter: nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, assert_never, cast

import mlx.core as mx
import trio
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache, make_prompt_cache

from adapters.grammar import Grammars
from adapters.kv import codec, frames
from adapters.mlx import lockstep
from adapters.mlx.attention import DECODE_ATTENTION_MODES
from adapters.mlx.compiled import COMPILE_MODES
from adapters.mlx.device import DeviceLoop, Settings, SlowStep
from adapters.mlx.distributed import (
    LockstepLoop,
    TensorGroup,
    agree_max,
    every_rank,
    rank_heads,
    refuse_pipelined_handoff,
)
from adapters.mlx.draft_model import DraftModel, check_draft_vocabulary
from adapters.mlx.fusion import FUSION_MODES, fuse_projections
from adapters.mlx.grammar import TokenConstraint
from adapters.mlx.jobs import Crash, Job, Stop, StreamItem, deliver, engine_failed, post
from adapters.mlx.loading import load_model, model_fingerprint
from adapters.mlx.memory import (
    KvCost,
    default_kv_memory_bytes,
    measure_kv_cost,
    out_of_memory_advice,
    parameter_bytes,
    share_the_device,
    state_bytes,
)
from adapters.mlx.prefill import (
    PrefillTask,
    default_shape_bucket,
    enabled_on_cuda,
    on_cuda,
    tune_cuda_backend,
    warm_chunk_shapes,
)
from adapters.mlx.prefix_cache import HOST_PULL_MODES, default_host_bytes
from adapters.mlx.requests import EngineRequest
from adapters.mlx.rows import Live
from adapters.mlx.sampling import PositionSampler, request_seed
from effects.engine_port import (
    EngineStatistics,
    GeneratedToken,
    KvBytes,
    KvPieces,
    KvSegment,
    ModelInfo,
    PrefillOutcome,
    PrefixSummary,
    SamplingParams,
    SegmentSink,
    no_prefix_cache,
)
from statecore.engine_schedule import EnginePhase
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error
from statecore.ids import RequestId
from statecore.prefix import conversation_block_keys
from statecore.routing import summary_key
from statecore.scheduling import DEFAULT_CHUNK_TOKENS, default_step_tokens, prefill_chunks, prefill_units

__all__ = ["PREFILL_MEMORY_CAP_MODES", "MlxEngine"]

logger = logging.getLogger("adapters.engine_mlx")

_KV_BITS = (2, 3, 4, 5, 6, 8)
_KV_GROUP_SIZES = (32, 64, 128)
PREFILL_MEMORY_CAP_MODES = ("auto", "on", "off")  # --prefill-memory-cap
_T = TypeVar("_T")


class MlxEngine:
    """The Engine port over mlx-lm. Build with `await MlxEngine.load(model_dir, ...)`."""

    def __init__(self, model_dir: Path, settings: Settings, trust_remote_code: bool,
                 tensor: TensorGroup | None = None) -> None:
        """Private: use `MlxEngine.load`."""
        self._model_dir = model_dir
        self._tensor = tensor
        self._trust_remote_code = trust_remote_code
        self._settings = settings
        self._draft_dir: Path | None = None  # --draft-model, loaded with the model
        self._adapter_dir: Path | None = None  # --adapter-path, applied to the model at load
        self._queue: queue.SimpleQueue[Job[Any] | Stop | Crash] = queue.SimpleQueue()
        self._state_lock = threading.Lock()
        self._alive = True
        self._closed = False
        self._info: ModelInfo | None = None
        self._stats = EngineStatistics(0, 0, 0, True)
        self._expected_classes: list[str] = []
        self._grammars: Grammars | None = None  # structured output: set at load
        # trio side: streams not yet taken by `stream()`.
        self._streams: dict[RequestId, trio.MemoryReceiveChannel[StreamItem]] = {}
        # trio side: a streamed handoff's pieces received so far, validated and built, by request
        self._arriving: dict[RequestId, list[tuple[int, int, list[Any]]]] = {}  # (first, end layer, caches)
        self._device = (DeviceLoop(settings, self._queue, self._die) if tensor is None
                        else LockstepLoop(settings, self._queue, self._die, tensor, self._replay))
        self._device.publish = self._publish
        self._device.cache_bytes = self._cache_bytes
        self._thread = threading.Thread(target=self._thread_main, name="mlx-device", daemon=True)
        self._thread.start()

    # -- construction --------------------------------------------------------------------------

    @classmethod
    async def load(
        cls,
        model_dir: Path,
        *,
        prefill_chunk_size: int = DEFAULT_CHUNK_TOKENS,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        trust_remote_code: bool = False,
        max_batch: int = 32,
        max_num_batched_tokens: int | None = None,
        step_target_ms: float | None = None,
        prefill_batch: int = 32,
        max_padding: float = 0.25,
        max_slot_tokens: int = 32768,
        kv_memory_bytes: int | None = None,
        device_shared_by: int = 1,
        decodes_locally: bool = True,
        shape_bucket: int | None = None,
        decode_attention: str = "auto",
        compile_decode: str = "auto",
        fuse_projections: str = "auto",
        preallocate_slots: bool | None = None,
        prefix_cache_bytes: int | None = None,
        prefix_host_bytes: int | None = None,
        prefix_host_pull: str = "auto",
        prefill_memory_cap: str = "auto",
        keep_conversations: bool = False,
        speculative: str = "off",
        num_draft_tokens: int = 3,
        speculative_max_rows: int = 1,
        draft_model: Path | None = None,
        adapter_path: Path | None = None,
        warm_request: bool | None = None,
        model_call_hook: Callable[[str, Sequence[str]], None] | None = None,
        tensor: TensorGroup | None = None,
    ) -> MlxEngine:
        """Start the device thread and load `model_dir` on it (mlx_lm.utils.load).

        Each step decodes every live request (at most `max_batch`) and prefills work units of
        waiting prompts (a chunk's layers in slices of at most `max_num_batched_tokens` -
        `max_batch` tokens' worth) until `max_num_batched_tokens` is spent, touching at most
        `prefill_batch` prompts (default budget: `max_batch` + 2,048 tokens or a whole chunk if
        larger, several chunks of a prompt per step; a smaller one, down to `max_batch` + chunk
        size / layers, slices chunks by layers). While streams decode, `step_target_ms` sizes
        each step's prefill from the rates the device loop measures of its own steps, so that a
        step stays near the target (`statecore.scheduling.step_token_budget`: at least the oldest
        prompt's next unit, at most the budget): None (default) = 4 times a step without prefill,
        0 = off. A tensor- or pipeline-parallel instance runs without it (its ranks plan alike).
        A chunk (`prefill_chunk_size`, default 256) is one prefill
        call and the prefix cache's block.
        Short prompts waiting together are prefilled in one padded call when the padding stays
        within `max_padding` of their tokens (plain KVCache models; `prefill_batch` 1 turns it
        off). `max_slot_tokens` caps one decoding row's preallocated KV (longer requests decode in
        the batch lane). `preallocate_slots` (default: on MLX's CUDA backend only)
        allocates the slot pool at its full capacity at load (it is set aside from the budget
        either way); otherwise it grows as rows need it, a copy of every row each time.

        `kv_memory_bytes` (default: `memory.default_kv_memory_bytes`) bounds every KV cache together:
        half of it at most is set aside for the slot layout; each other request reserves its
        cache's worst case (prompt, or prompt + max_tokens once it decodes outside the slots)
        before anything is allocated, and is refused (OVERLOADED, or KV_MEMORY_EXCEEDED when
        it can never fit) otherwise. `decodes_locally` False (a prefill node) reserves only a
        prompt's cache for its prefill, and sets nothing aside for a slot layout (it has none).

        `prefill_memory_cap` ("auto": on when `kv_memory_bytes` is given; "on"; "off") caps each
        step's prefill work so that the KV held and reserved now (the slot pool as allocated,
        every reservation, kept prefixes) plus the step's estimated activations
        (`statecore.scheduling.activation_bytes`: attention scores, a layer's intermediates,
        logits, a batched call's batch cache) stay within `kv_memory_bytes`: batched short
        prompts go in smaller groups, a long prompt's units wait. The oldest waiting prompt
        always advances, alone when even its next unit is over (counted); decode rows always run.

        `shape_bucket` (default: `default_shape_bucket()`, 128 on MLX's CUDA backend and 0 = off
        elsewhere) pads prefill chunks, and rounds the slot lane's attended length, up to a
        multiple of it, on plain KVCache models: the device meets a few shapes, not one per
        prompt length. Like the chunk size it changes the computation's last bits, so it is part
        of the model fingerprint.

        `decode_attention` (slot lane): "auto" runs the rows' attention in statecore's own CUDA
        kernel (`adapters.mlx.attention`: each row read in place up to its length, no mask) on
        MLX's CUDA backend when its load-time self-check passes, else MLX's masked attention;
        "kernel" requires the kernel (the load fails without it); "masked" never uses it;
        "reference" routes through the kernel's contract in plain MLX ops (any backend: tests).

        `compile_decode` (slot lane): "auto" traces the step's model call once per shape and
        replays it (`adapters.mlx.compiled`) on MLX's CUDA backend, where building the graph from
        Python is a large share of a step; "on" everywhere; "off" never.

        `fuse_projections`: "auto" (on MLX's CUDA backend) computes each layer's query, key and
        value projections, and its MLP's gate and up projections, as one matmul each
        (`adapters.mlx.fusion`): fewer kernels to launch per step; "on" everywhere; "off" never.
        Part of the fingerprint when it fuses.

        `prefix_cache_bytes` (default: a quarter of `kv_memory_bytes`; 0 = off) keeps the KV of
        whole prefill chunks (plain KVCache models) for prompts that start with the same tokens
        (`adapters.mlx.prefix_cache`): they start after the cached chunks, with the same numbers.
        The kept blocks give way to any request that needs their memory. `keep_conversations`
        (nodes that decode, with the prefix cache on) keeps a finished request's prompt and
        generated tokens' whole chunks too, computed again as prefill chunks after it ends, and a
        handed-off prompt's as it is installed (`adapters.mlx.device`): a conversation's next
        turn starts after them. `prefix_host_bytes` (default: on MLX's CUDA backend only, see
        `adapters.mlx.prefix_cache.default_host_bytes`; 0 = off; always off on a tensor- or
        pipeline-parallel instance, whose ranks must hold the same blocks) bounds a host-memory
        tier that blocks leaving the device go to; `prefix_host_pull` (auto, always, never) says
        when a prompt takes them back rather than computing them (auto: by measured rates).

        `speculative` ("off", "ngram", "draft"): while at most `speculative_max_rows` requests
        decode, each step drafts up to `num_draft_tokens` tokens per row, by prompt lookup or with
        `draft_model` (a model directory of the same vocabulary; giving one turns "off" into
        "draft"), and checks them in one verify step (`adapters.mlx.speculative`); greedy and
        seeded rows emit exactly the tokens they emit without it. It stays off (logged) where the
        load check finds that a verify step would not compute an ordinary step's numbers.

        `adapter_path`: an mlx-lm adapter directory (adapter_config.json, adapters.safetensors),
        applied at load as mlx-lm applies it; its bytes are part of the fingerprint, so KV moves
        only between nodes with the same adapter.

        `warm_request` (default: where prefill shapes are warmed at load, i.e. with a shape bucket on
        MLX's CUDA backend) sends one request of two chunks and a token through the serving path
        at the end of the load, then forgets it: every kind of work a long prompt brings (its
        chunks, the prefix cache's copies, its row in the slot pool, the traced step at a long
        length) has then run once before the first client's request.

        `model_call_hook` (tests: `Faults.model_call_hook`) runs inside every model call with its
        stage ("prefill" or "decode") and the request ids it computes, and may raise.

        `tensor` (`adapters.mlx.distributed.join_group`): this process is one rank of a
        tensor-parallel instance; each rank loads its shard, and the ranks run in lockstep. On rank
        0 the engine is used as any other; on the others `load` returns at once and the device
        thread replays rank 0's plans (the engine's port methods are not for them):
        `follower_loop` is what `watch_follower` watches.

        A model dir whose config.json names a `model_file` (custom Python) is refused unless
        trust_remote_code is True. A cache class that cannot travel is logged, not refused:
        `info.can_travel` tells the serving roles whether handoffs are possible.
        """
        if prefill_chunk_size < 1:
            raise StatecoreError(client_error("prefill_chunk_size must be >= 1"))
        if kv_bits is not None and kv_bits not in _KV_BITS:
            raise StatecoreError(client_error(f"kv_bits must be one of {_KV_BITS} or None"))
        if kv_group_size not in _KV_GROUP_SIZES:
            raise StatecoreError(client_error(f"kv_group_size must be one of {_KV_GROUP_SIZES}"))
        if max_batch < 1:
            raise StatecoreError(client_error("max_batch must be >= 1"))
        if prefill_batch < 1:
            raise StatecoreError(client_error("prefill_batch must be >= 1"))
        budget = (default_step_tokens(max_batch, prefill_chunk_size) if max_num_batched_tokens is None
                  else max_num_batched_tokens)
        if budget <= max_batch:
            raise StatecoreError(client_error(
                f"max_num_batched_tokens ({budget}) must be more than max_batch ({max_batch}): every "
                "step decodes every row and must leave room for prefill"
            ))
        if not max_padding >= 0.0:
            raise StatecoreError(client_error("max_padding must be >= 0"))
        if max_slot_tokens < 1:
            raise StatecoreError(client_error("max_slot_tokens must be >= 1"))
        bucket = default_shape_bucket() if shape_bucket is None else shape_bucket
        if bucket < 0:
            raise StatecoreError(client_error("shape_bucket must be >= 0"))
        if decode_attention not in DECODE_ATTENTION_MODES:
            raise StatecoreError(client_error(
                f"decode_attention must be one of {', '.join(DECODE_ATTENTION_MODES)}"))
        if compile_decode not in COMPILE_MODES:
            raise StatecoreError(client_error(f"compile_decode must be one of {', '.join(COMPILE_MODES)}"))
        if fuse_projections not in FUSION_MODES:
            raise StatecoreError(client_error(
                f"fuse_projections must be one of {', '.join(FUSION_MODES)}"))
        if device_shared_by < 1:
            raise StatecoreError(client_error("device_shared_by must be >= 1"))
        memory = (default_kv_memory_bytes(model_dir, device_shared_by) if kv_memory_bytes is None
                  else kv_memory_bytes)
        if memory < 1:
            raise StatecoreError(client_error("kv_memory_bytes must be >= 1"))
        prefix_bytes = memory // 4 if prefix_cache_bytes is None else prefix_cache_bytes
        if prefix_bytes < 0:
            raise StatecoreError(client_error("prefix_cache_bytes must be >= 0"))
        host_bytes = default_host_bytes(prefix_bytes) if prefix_host_bytes is None else prefix_host_bytes
        if host_bytes < 0:
            raise StatecoreError(client_error("prefix_host_bytes must be >= 0"))
        if prefix_host_pull not in HOST_PULL_MODES:
            raise StatecoreError(client_error(
                f"prefix_host_pull must be one of {', '.join(HOST_PULL_MODES)}"))
        if prefill_memory_cap not in PREFILL_MEMORY_CAP_MODES:
            raise StatecoreError(client_error(
                f"prefill_memory_cap must be one of {', '.join(PREFILL_MEMORY_CAP_MODES)}"))
        capped = kv_memory_bytes is not None if prefill_memory_cap == "auto" else prefill_memory_cap == "on"
        if draft_model is not None and speculative == "off":
            speculative = "draft"
        if speculative not in ("off", "ngram", "draft"):
            raise StatecoreError(client_error("speculative must be off, ngram or draft"))
        if (speculative == "draft") != (draft_model is not None):
            raise StatecoreError(client_error(
                "speculative 'draft' needs a draft model, and a draft model needs speculative 'draft'"))
        if num_draft_tokens < 1 or speculative_max_rows < 1:
            raise StatecoreError(client_error("num_draft_tokens and speculative_max_rows must be >= 1"))
        if step_target_ms is not None and not step_target_ms >= 0:
            raise StatecoreError(client_error("step_target_ms must be >= 0 (0: off)"))
        settings = Settings(prefill_chunk_size, kv_bits, kv_group_size, max_batch, budget, prefill_batch,
                            max_padding, max_slot_tokens, memory, decodes_locally, bucket, decode_attention,
                            prefix_bytes, compile_decode,
                            on_cuda() if preallocate_slots is None else preallocate_slots, capped,
                            fuse_projections,
                            keep_conversations=keep_conversations and decodes_locally,
                            speculative=speculative if decodes_locally and tensor is None else "off",
                            num_draft_tokens=num_draft_tokens, speculative_max_rows=speculative_max_rows,
                            step_target_ms=0.0 if tensor is not None else step_target_ms,
                            prefix_host_bytes=host_bytes if tensor is None else 0,
                            prefix_host_pull=prefix_host_pull)
        tune_cuda_backend()
        share_the_device(device_shared_by)  # after every check: no refused load leaves it set
        engine = cls(Path(model_dir), settings, trust_remote_code, tensor)
        engine._draft_dir = None if draft_model is None else Path(draft_model)
        engine._adapter_dir = None if adapter_path is None else Path(adapter_path)
        engine._device.model_call_hook = model_call_hook
        if tensor is not None and tensor.rank > 0:
            return engine  # its load comes in rank 0's first plan
        try:
            engine._info = await engine._call(engine._load_on_device,
                                              command=lockstep.Load(dataclasses.asdict(settings)))
            if (engine._device.bucket > 0 and on_cuda()) if warm_request is None else warm_request:
                await engine._warm_serving_path()
        except BaseException:
            await engine.aclose()
            raise
        return engine

    async def _warm_serving_path(self) -> None:
        """One request of two chunks and a token, prefilled and decoded a few tokens as any other,
        then forgotten (the prefix cache starts empty again). On MLX's CUDA backend the first use
        of a kind of work (a kernel compiled at run time, a cuBLASLt plan) costs up to ~0.5 s on
        the host; paid here, it does not stall the streams decoding beside the first long prompt.
        A model or budget too small for such a request is warmed as far as it goes."""
        started = time.perf_counter()
        info = self.info
        length = max(1, min(2 * self._settings.prefill_chunk_size + 1, info.context_length - 8))
        prompt = [1 + i % max(1, min(info.vocab_size - 1, 997)) for i in range(length)]
        sampling = SamplingParams(max_tokens=4, ignore_eos=True)
        rid = RequestId("statecore-warm-up")
        try:
            outcome = await self.prefill(rid, prompt, sampling)
            await self.decode_held(rid, prompt, outcome.first_token, sampling)
            async for _ in self.stream(rid):
                pass
        except StatecoreError as exc:
            logger.info("the load's warm-up request stopped early: %s", exc)
            await self.cancel(rid)
            await self.release_held(rid)
        await self._call(self._forget_prefixes, command=lockstep.ForgetPrefixes())
        logger.info("warmed the serving path with a %d-token request in %.1f s", length,
                    time.perf_counter() - started)

    def _forget_prefixes(self) -> None:
        self._device.forget_prefixes()
        self._device.forget_activation_counts()
        self._publish()

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
        return self._thread

    @property
    def info(self) -> ModelInfo:
        if self._info is None:
            raise engine_failed("the engine has no model loaded")
        return self._info

    # -- the Engine port -----------------------------------------------------------------------

    async def prefill(
        self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams,
        segments: SegmentSink | None = None,
    ) -> PrefillOutcome:
        tokens = self._check_request(prompt, sampling)
        if self._pipelined and not self._settings.decodes_locally:  # a prefill node only hands off
            raise refuse_pipelined_handoff("hand off a prefilled cache")
        matcher = await self._matcher(sampling)
        trio_token = trio.lowlevel.current_trio_token()
        # Pieces by token and layer range need a cache of plain KVCache layers that holds every
        # head (not a tensor-parallel rank's share): otherwise the whole cache goes at the end.
        cuts = self._device.streams_ranges and self.streams_handoffs
        sink = self._segment_sink(segments, trio_token) if cuts and segments is not None else None
        return await self._wait(self._prefill_job(request_id, tokens, sampling, matcher, trio_token, sink))

    def _segment_sink(self, segments: SegmentSink, trio_token: trio.lowlevel.TrioToken
                      ) -> Callable[[tuple[int, int, int, int], list[Any]], None]:
        """On the device thread: a computed piece (its range; keys then values of each of its
        layers) framed as a wire payload over its own host memory, handed to `segments` in trio.
        The checksum is computed on its own thread while the pieces already travel."""
        fingerprint = self.info.fingerprint

        def hand(where: tuple[int, int, int, int], arrays: list[Any]) -> None:
            start, stop, first_layer, end_layer = where
            layers = [_kv_cache(arrays[i], arrays[i + 1], stop - start) for i in range(0, len(arrays), 2)]
            tensors = codec.host_tensors(layers, fingerprint=fingerprint, token_count=stop - start)
            pieces = KvPieces(tuple(frames.unsealed_pieces(tensors)), seal_nbytes=frames.END_FRAME_BYTES,
                              seal=frames.end_frame_in_background(tensors))
            post(trio_token, segments, KvSegment(start, stop, first_layer, end_layer, pieces))

        return hand

    def _prefill_job(self, request_id: str, tokens: list[int], sampling: SamplingParams, matcher: Any,
                     trio_token: trio.lowlevel.TrioToken | None,
                     segment_sink: Callable[[tuple[int, int, int, int], list[Any]], None] | None = None,
                     ) -> Job[PrefillOutcome]:
        """`trio_token` None: a replayed job (a rank > 0 of a tensor-parallel instance)."""
        seed = request_seed(request_id, sampling)
        chunks = prefill_chunks(len(tokens), self._settings.prefill_chunk_size)
        units = prefill_units(chunks, self._device.layers, self._device.unit_tokens)
        job: Job[PrefillOutcome]

        def register() -> PrefillOutcome:
            device = self._device
            self._check_unused(request_id)
            keys = device.touch_prefix(tokens)  # so that its own admission evicts them last
            reserved = device.admit(request_id, *device.prefill_reservation(len(tokens), sampling.max_tokens))
            device.arrivals += 1
            sampler = PositionSampler(sampling, seed, len(tokens), tokens, self._constraint(matcher, ()))
            task = PrefillTask(request_id, tokens, sampler, device.arrivals, chunks, units, job=job,
                               segment_sink=segment_sink)
            # Its record (and so its reservation) first: the blocks its start takes back from the
            # host tier fit what the budget leaves beside every reservation, its own included.
            device.requests.add(EngineRequest(request_id, EnginePhase.WAITING, reserved=reserved, task=task))
            try:
                device.start_from_prefix(task, keys)
            except BaseException:
                device.forget(request_id)
                raise
            return None  # type: ignore[return-value]  # deferred: finished by the device loop

        job = Job(register, trio_token, undo=lambda _: self._device.drop(request_id),
                  done=None if trio_token is None else trio.Event(), deferred=True,
                  command=lockstep.Prefill(request_id, tuple(tokens), sampling),
                  undo_command=lockstep.Drop(request_id))
        return job

    async def export_held(self, request_id: RequestId) -> KvPieces:
        if self._pipelined:
            raise refuse_pipelined_handoff("hand off a prefilled cache")
        tensors = await self._call(partial(self._export, request_id), command=lockstep.Export(request_id))
        # The tensors are not copied: the pieces reference them. The checksum (the end frame)
        # needs no MLX: a thread computes it while the pieces are already being sent.
        return KvPieces(tuple(frames.unsealed_pieces(tensors)),
                        seal=frames.end_frame_in_background(tensors), seal_nbytes=frames.END_FRAME_BYTES)

    def _export(self, request_id: str) -> frames.HostTensors:
        held = self._device.held.get(request_id)
        if held is None:
            raise _not_held(request_id)
        cache = held.cache
        if isinstance(self._device, LockstepLoop):  # every rank's heads, gathered on each
            cache = self._device.gather_heads(cache)
        return codec.host_tensors(cache, fingerprint=self.info.fingerprint, token_count=held.prompt_tokens)

    async def export_prefix(self, tokens: Sequence[int]) -> KvPieces:
        checked = self._check_prefix(tokens)
        if self._tensor is not None:
            raise _refuse_prefix_move("send")
        tensors = await self._call(partial(self._export_prefix, checked))
        return KvPieces(tuple(frames.unsealed_pieces(tensors)),
                        seal=frames.end_frame_in_background(tensors), seal_nbytes=frames.END_FRAME_BYTES)

    def _export_prefix(self, tokens: list[int]) -> frames.HostTensors:
        """On the device thread: a fresh cache of the prefix cache's blocks of `tokens` (their
        concatenation; the blocks themselves are never handed out), as host tensors."""
        prefix = self._device.prefix
        count, cache = (0, None) if prefix is None else prefix.start(
            conversation_block_keys(tokens, prefix.chunk_size), counted=False)
        if cache is None or prefix is None:
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.PREFIX_NOT_CACHED,
                                           "the prefix cache holds no whole block of these tokens"))
        mx.eval([c.state for c in cache])
        return codec.host_tensors(cache, fingerprint=self.info.fingerprint,
                                  token_count=count * prefix.chunk_size)

    async def import_prefix(self, payload: KvBytes, tokens: Sequence[int]) -> int:
        checked = self._check_prefix(tokens)
        if self._tensor is not None:
            raise _refuse_prefix_move("receive")
        if self._device.prefix is None:
            return 0
        # Validated and rebuilt in a worker thread, as `install` does: the fingerprint (the chunk
        # size among it) is what makes the blocks the ones this node's own chunks would compute.
        count, caches = await trio.to_thread.run_sync(self._validate_prefix, payload, len(checked))
        kept = await self._call(partial(self._keep_imported, checked[:count], caches))
        return kept

    def _validate_prefix(self, payload: KvBytes, most_tokens: int) -> tuple[int, list[Any]]:
        validated = codec.validate_payload(
            payload, fingerprint=self.info.fingerprint, expected_classes=self._expected_classes)
        count = validated.header.token_count
        chunk = self._settings.prefill_chunk_size
        if not 0 < count <= most_tokens or count % chunk:
            raise StatecoreError(ErrorInfo(
                Fault.PEER, Code.KV_MALFORMED,
                f"a prefix payload must cover whole blocks of {chunk} of the {most_tokens} tokens "
                f"asked for; it covers {count}"))
        if any(layer.heads is not None for layer in validated.header.layers):
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_MALFORMED,
                                           "a prefix payload carries every head of every layer"))
        built: list[Any] = codec.build_caches(validated).caches
        return count, built

    def _keep_imported(self, tokens: list[int], caches: list[Any]) -> int:
        kept = self._device.keep_imported(tokens, caches)
        self._publish()
        return kept

    def _check_prefix(self, tokens: Sequence[int]) -> list[int]:
        if not self._alive:
            raise engine_failed("the device thread is not running")
        checked = [self._check_token(t, "prefix token") for t in tokens]
        if not checked:
            raise StatecoreError(client_error("the prefix is empty"))
        if len(checked) > self.info.context_length:
            raise StatecoreError(client_error(
                f"the prefix has {len(checked)} tokens; the context length is {self.info.context_length}",
                Code.CONTEXT_LENGTH_EXCEEDED))
        return checked

    async def release_held(self, request_id: RequestId) -> int:
        self._arriving.pop(request_id, None)
        if not self._alive:
            return 0
        with trio.CancelScope(shield=True):  # quick, and must not be skipped
            freed = await self._call(partial(self._release, request_id), command=lockstep.Release(request_id))
        return freed

    def _release(self, request_id: str) -> int:
        device = self._device
        held = device.held.get(request_id)
        if held is not None:
            device.requests.remove(request_id)  # its reservation with it
            device.choice_ended(held.sampling)  # it will not decode here
        self._publish()
        return 0 if held is None else held.nbytes

    async def decode_held(
        self, request_id: RequestId, prompt: Sequence[int], first_token: int, sampling: SamplingParams
    ) -> None:
        tokens = self._check_request(prompt, sampling)
        first_token = self._check_token(first_token, "first_token")
        await self._start(request_id, tokens, first_token, sampling,
                          partial(self._held_cache, request_id, len(tokens)))

    def _held_cache(self, request_id: str, prompt_tokens: int) -> list[Any]:
        held = self._device.held.get(request_id)
        if held is None:
            raise _not_held(request_id)
        if held.prompt_tokens != prompt_tokens:
            raise StatecoreError(client_error(
                f"request {request_id!r}: the held cache covers {held.prompt_tokens} "
                f"tokens, the prompt has {prompt_tokens}"
            ))
        return held.cache

    async def install(
        self,
        request_id: RequestId,
        payload: KvBytes,
        prompt: Sequence[int],
        first_token: int,
        sampling: SamplingParams,
    ) -> None:
        tokens = self._check_request(prompt, sampling)
        first_token = self._check_token(first_token, "first_token")
        if self._pipelined:
            raise refuse_pipelined_handoff("install a handed-off cache")
        # Everything before the copy into the decoder runs in a worker thread, so a big handoff
        # never stalls the decode batch: framing, checksum and header checks, then the arrays
        # themselves (made from host memory, no lazy computation: no device stream is involved).
        caches = await trio.to_thread.run_sync(self._validate_and_build, payload, len(tokens))
        device = self._device
        if not isinstance(device, LockstepLoop) or device.tensor.size == 1:
            await self._start(request_id, tokens, first_token, sampling,
                              partial(self._installed, tokens, caches))
            return
        # A tensor-parallel instance: the other ranks get their own heads from rank 0 as the job
        # runs. Whether the cache splits is asked here, before any rank waits for its slice.
        ranges = device.head_ranges(caches)
        await self._start(request_id, tokens, first_token, sampling,
                          partial(self._hand_out_heads, caches, ranges, tokens), sliced=True)

    async def receive_segment(self, request_id: RequestId, segment: KvSegment, prompt_tokens: int) -> None:
        if not self.streams_handoffs:
            raise StatecoreError(ErrorInfo(
                Fault.PEER, Code.KV_MALFORMED,
                "this node installs whole payloads only (tensor or pipeline parallel)"))
        # Validated and built in a worker thread, as `install` does, while the stream goes on.
        if segment.stop == prompt_tokens and segment.end_layer == len(self._expected_classes):
            # the last piece: the request joins once the pieces are checked and installed
            self._device.handoffs_coming[request_id] = time.monotonic()
        built = await trio.to_thread.run_sync(self._validate_segment, segment, prompt_tokens)
        await trio.lowlevel.checkpoint()  # a request cancelled meanwhile keeps nothing here
        self._arriving.setdefault(request_id, []).append((segment.first_layer, segment.end_layer, built))

    def _validate_segment(self, segment: KvSegment, prompt_tokens: int) -> list[Any]:
        """A streamed piece's caches: a whole payload of its layers' classes, over its tokens."""
        payload = segment.payload.joined() if len(segment.payload.pieces) != 1 else segment.payload.pieces[0]
        classes = self._expected_classes[segment.first_layer : segment.end_layer]
        whole = segment.start == 0 and segment.stop == prompt_tokens
        if not whole and not self._device.streams_ranges:
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_MALFORMED,
                                           "this model's cache travels whole, not in token ranges"))
        validated = codec.validate_payload(payload, fingerprint=self.info.fingerprint,
                                           expected_classes=classes)
        if validated.header.token_count != segment.stop - segment.start:
            raise StatecoreError(ErrorInfo(
                Fault.PEER, Code.KV_MALFORMED,
                f"a KV segment of tokens [{segment.start}, {segment.stop}) holds "
                f"{validated.header.token_count}"))
        if any(layer.heads is not None for layer in validated.header.layers):
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_MALFORMED,
                                           "a KV segment names a head range: a piece carries every head"))
        built: list[Any] = codec.build_caches(validated).caches
        return built

    async def install_segments(
        self, request_id: RequestId, prompt: Sequence[int], first_token: int, sampling: SamplingParams,
    ) -> None:
        pieces = self._arriving.pop(request_id, [])
        try:
            tokens = self._check_request(prompt, sampling)
            first_token = self._check_token(first_token, "first_token")
            await self._start(request_id, tokens, first_token, sampling,
                              partial(self._joined_segments, tokens, pieces))
        finally:
            self._device.handoffs_coming.pop(request_id, None)

    def _joined_segments(self, tokens: Sequence[int], pieces: list[tuple[int, int, list[Any]]]) -> list[Any]:
        """On the device thread: the received pieces as one cache per layer (each layer's token
        ranges in order: the reader checked they follow one another)."""
        layers = len(self._expected_classes)
        if len(pieces) == 1 and pieces[0][:2] == (0, layers):
            caches = pieces[0][2]
        else:
            keys: list[list[Any]] = [[] for _ in range(layers)]
            values: list[list[Any]] = [[] for _ in range(layers)]
            for first_layer, end_layer, built in pieces:
                for index, cache in zip(range(first_layer, end_layer), built, strict=True):
                    keys[index].append(cache.keys)
                    values[index].append(cache.values)
            if any(sum(int(k.shape[2]) for k in layer) != len(tokens) for layer in keys):
                raise StatecoreError(ErrorInfo(
                    Fault.PEER, Code.KV_TRUNCATED,
                    f"the KV segments do not cover the prompt's {len(tokens)} tokens"))
            caches = [_kv_cache(k[0] if len(k) == 1 else mx.concatenate(k, axis=2),
                                v[0] if len(v) == 1 else mx.concatenate(v, axis=2), len(tokens))
                      for k, v in zip(keys, values, strict=True)]
        return self._installed(tokens, caches)

    def _validate_and_build(self, payload: KvBytes, prompt_tokens: int,
                            heads: tuple[int, int] | None = None) -> list[Any]:
        """The caches of a payload for this node: every head (`heads` None), or the KV heads
        (rank, size) of a tensor-parallel rank's slice, each layer's header naming that range."""
        validated = codec.validate_payload(
            payload, fingerprint=self.info.fingerprint, expected_classes=self._expected_classes
        )
        if validated.header.token_count != prompt_tokens:
            raise StatecoreError(ErrorInfo(
                Fault.PEER, Code.KV_MALFORMED,
                f"the KV payload covers {validated.header.token_count} tokens, "
                f"the prompt has {prompt_tokens}",
            ))
        for index, layer in enumerate(validated.header.layers):
            got = layer.heads
            if got is None:
                if heads is None:
                    continue
                held, want = "every head", f"its slice of rank {heads[0]} of {heads[1]}"
            else:
                need = (0, got.total) if heads is None else rank_heads(*heads, got.total)
                if (got.start, got.stop) == need:
                    continue
                held, want = f"heads [{got.start}, {got.stop}) of {got.total}", f"heads {list(need)}"
            raise StatecoreError(ErrorInfo(
                Fault.PEER, Code.KV_MALFORMED,
                f"layer {index} of the KV payload holds {held}, this node needs {want}"))
        built: list[Any] = codec.build_caches(validated).caches
        return built

    def _installed(self, tokens: Sequence[int], caches: list[Any]) -> list[Any]:
        """On the device thread: a handed-off cache as this rank decodes it, its whole chunks kept
        for the conversation's next turn (on every rank of an instance alike). The next step
        decodes only: the request's second token waits for no prefill."""
        self._device.keep_installed(tokens, caches)
        self._device.handoff_joined = True
        return caches

    def _hand_out_heads(self, caches: list[Any], ranges: list[tuple[int, int]],
                        tokens: Sequence[int]) -> list[Any]:
        """Rank 0 of a TP decode instance: each other rank's heads of an installed payload, sent to
        it as a payload of that head range; rank 0 keeps its own."""
        device = self._device
        assert isinstance(device, LockstepLoop)
        slices: list[list[bytes | memoryview]] = []
        try:
            for heads in ranges[1:]:  # views of the cache's own buffers: copied once, into the send
                tensors = codec.host_tensors(caches, fingerprint=self.info.fingerprint,
                                               token_count=len(tokens), heads=heads)
                slices.append([*frames.unsealed_pieces(tensors), frames.end_frame(tensors)])
        except BaseException:
            # The other ranks wait for their slice: a byte that is no payload makes their job
            # fail as this one does, so every rank still holds the same requests.
            device.pass_on_slices([[b"\x00"]] * (len(ranges) - 1))
            raise
        device.pass_on_slices(slices)
        return self._installed(tokens, device.own_heads(caches))

    def _received_heads(self, tokens: Sequence[int]) -> list[Any]:
        """A rank > 0 of a TP decode instance: its heads of an installed payload, from rank 0."""
        device = self._device
        assert isinstance(device, LockstepLoop)
        payload = device.receive_slice()
        return self._installed(tokens, self._validate_and_build(
            payload, len(tokens), heads=(device.tensor.rank, device.tensor.size)))

    async def stream(self, request_id: RequestId) -> AsyncGenerator[GeneratedToken, None]:
        """Tokens after the first one. Leaving early cancels the request."""
        receive = self._streams.pop(request_id, None)
        if receive is None:
            raise StatecoreError(ErrorInfo(
                Fault.BUG, Code.INTERNAL,
                f"no stream for request {request_id!r} (never started, already taken, or cancelled)",
            ))
        finished = False
        try:
            async with receive:
                async for item in receive:
                    if isinstance(item, StatecoreError):
                        finished = True
                        raise StatecoreError(item.info) from item
                    yield item
            finished = True
        finally:
            if not finished:
                self._cancel_nowait(request_id)

    async def cancel(self, request_id: RequestId) -> None:
        self._arriving.pop(request_id, None)
        self._device.handoffs_coming.pop(request_id, None)
        receive = self._streams.pop(request_id, None)
        if receive is not None:
            receive.close()
        if not self._alive:
            return
        with trio.CancelScope(shield=True):  # within one step; must not be skipped
            await self._call(lambda: self._drop(request_id), command=lockstep.Drop(request_id))

    def statistics(self) -> EngineStatistics:
        device = self._device
        stalled = device.stalled_s() if self._alive else 0.0
        return replace(self._stats, device_thread_alive=self._alive, stalled_s=stalled,
                       arriving=len(self._arriving),
                       kv_budget_bytes=self._settings.kv_memory_bytes - device.pool_reserved,
                       device_memory_bytes=mx.get_active_memory(), device_peak_bytes=mx.get_peak_memory(),
                       device_time=tuple((kind, calls, seconds)
                                         for kind, (calls, seconds) in device.profile.items()))

    async def prefix_summary(self, since: int | None = None) -> PrefixSummary | None:
        prefix = self._device.prefix
        if prefix is None:
            return no_prefix_cache(since)
        if since is not None and since == prefix.index.version:  # an int read: no device job
            return None

        def snapshot() -> PrefixSummary:
            index = prefix.index
            keys = tuple(summary_key(key) for key in index.cached_keys())
            return PrefixSummary(prefix.chunk_size, index.version, keys)

        return await self._call(snapshot)

    async def evict_prefixes(self, nbytes: int) -> int:
        """Forget kept prefix-cache blocks until at least `nbytes` are freed or none is left, the
        way admission does when a request needs their memory (least recently used first, a block
        only after every block that extends it), between two steps; returns the bytes freed. A
        running request keeps the cache it made from them, so it goes on unchanged. For whoever
        wants that memory back now. Refused on a tensor-parallel instance: its ranks must keep
        the same blocks, and no lockstep command tells them to forget any."""
        if nbytes < 0:
            raise StatecoreError(client_error("nbytes must be >= 0"))
        if self._tensor is not None:
            raise StatecoreError(ErrorInfo(
                Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
                "a tensor- or pipeline-parallel instance evicts prefix-cache blocks only for its "
                "requests: its ranks must forget the same blocks"))
        return await self._call(partial(self._evict_prefixes, nbytes))

    def _evict_prefixes(self, nbytes: int) -> int:
        prefix = self._device.prefix
        if prefix is None:
            return 0
        before = prefix.nbytes
        prefix.evict(nbytes)
        self._publish()
        return before - prefix.nbytes

    def device_profile(self) -> dict[str, tuple[int, float]]:
        """Device-thread time so far by kind of work: {kind: (calls, seconds)} (for benchmarks)."""
        return dict(self._device.profile)

    def slow_steps(self) -> list[SlowStep]:
        """The latest steps that took `SLOW_STEP_S` or more, oldest first (for benchmarks)."""
        return list(self._device.slow_steps)

    async def aclose(self, join_timeout_s: float | None = None) -> None:
        """Stop the device thread; every held cache and live request is dropped.

        Waits for the thread's current step (joining lets MLX's thread-local state go before
        exit), at most `join_timeout_s` when given: a stalled thread is left behind (it is a
        daemon, so the process can still exit)."""
        for receive in self._streams.values():
            receive.close()
        self._streams.clear()
        self._stop_nowait()
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(partial(self._thread.join, join_timeout_s))
        if self._thread.is_alive():
            logger.error("the device thread did not stop within %.1f s; leaving it behind", join_timeout_s)

    # -- fault injection -----------------------------------------------------------------------

    def crash_device_thread(self) -> None:
        """Make the device loop itself raise (not a job): the engine must report itself dead.
        What the DEVICE_CRASH fault drives; a node wires it only when faults are armed."""
        self._queue.put(Crash())

    def _submit_nowait(self, work: Callable[[], object], command: lockstep.Command | None = None) -> None:
        """Fire and forget; silently nothing if the device thread is gone."""
        with self._state_lock:
            if self._alive:
                self._queue.put(Job(work, None, command=command))

    # -- trio-side helpers ---------------------------------------------------------------------

    def _check_request(self, prompt: Sequence[int], sampling: SamplingParams) -> list[int]:
        if not self._alive:
            raise engine_failed("the device thread is not running")
        tokens = [self._check_token(t, "prompt token") for t in prompt]
        if not tokens:
            raise StatecoreError(client_error("the prompt is empty"))
        if len(tokens) > self.info.context_length:
            raise StatecoreError(client_error(
                f"the prompt has {len(tokens)} tokens; the context length is {self.info.context_length}",
                Code.CONTEXT_LENGTH_EXCEEDED,
            ))
        if sampling.max_tokens < 1:
            raise StatecoreError(client_error("max_tokens must be >= 1"))
        if sampling.temperature < 0.0 or sampling.temperature != sampling.temperature:
            raise StatecoreError(client_error("temperature must be >= 0"))
        if not 0.0 < sampling.top_p <= 1.0:
            raise StatecoreError(client_error("top_p must be in (0, 1]"))
        if sampling.top_k < 0:
            raise StatecoreError(client_error("top_k must be >= 0"))
        if sampling.response_format is not None and sampling.ignore_eos:
            raise StatecoreError(client_error(
                "ignore_eos cannot go with a response_format: the grammar ends the output with EOS",
                param="ignore_eos"))
        return tokens

    async def _matcher(self, sampling: SamplingParams) -> Any:
        """A fresh grammar matcher for a request with a response_format (None without one),
        compiled in a worker thread: a schema never stalls the device loop."""
        if sampling.response_format is None:
            return None
        grammars = self._grammars
        if grammars is None:
            raise engine_failed("the engine has no model loaded")
        return await trio.to_thread.run_sync(grammars.matcher, sampling.response_format)

    def _constraint(self, matcher: Any, generated: Sequence[int]) -> TokenConstraint | None:
        """On the device thread: the request's grammar state after `generated` (None: free text)."""
        if matcher is None:
            return None
        try:
            return TokenConstraint(matcher, self.info.vocab_size, self.info.eos_token_ids, generated)
        except RuntimeError as exc:
            raise StatecoreError(client_error(f"the first token does not fit the response_format: {exc}",
                                              param="response_format")) from exc

    def _check_token(self, token: object, what: str) -> int:
        """A token id as a Python int (numpy integers welcome), inside the vocabulary."""
        try:
            if isinstance(token, bool):
                raise TypeError
            value = operator.index(token)  # type: ignore[arg-type]
        except TypeError:
            raise StatecoreError(client_error(f"{what} {token!r} is not an integer")) from None
        vocab = self.info.vocab_size
        if not 0 <= value < vocab:
            raise StatecoreError(client_error(f"{what} {value} is outside the vocabulary of {vocab}"))
        return value

    async def _start(
        self,
        request_id: RequestId,
        tokens: list[int],
        first_token: int,
        sampling: SamplingParams,
        take_cache: Callable[[], list[Any]],
        *,
        sliced: bool = False,
    ) -> None:
        """Open the request's stream, then put it into the decoder on the device thread."""
        matcher = await self._matcher(sampling)
        if request_id in self._streams:
            raise StatecoreError(client_error(f"request {request_id!r} is already decoding"))
        send, receive = trio.open_memory_channel[StreamItem](sampling.max_tokens)
        work = self._start_work(request_id, tokens, first_token, sampling, take_cache, matcher, send,
                                trio.lowlevel.current_trio_token())
        self._streams[request_id] = receive
        try:
            replayed = lockstep.Decode(request_id, tuple(tokens), first_token, sampling, sliced=sliced)
            await self._call(work, undo=lambda _: self._drop(request_id), command=replayed,
                             undo_command=lockstep.Drop(request_id))
        except BaseException:
            if self._streams.get(request_id) is receive:
                del self._streams[request_id]
            receive.close()
            send.close()
            raise

    def _start_work(self, request_id: str, tokens: list[int], first_token: int, sampling: SamplingParams,
                    take_cache: Callable[[], list[Any]], matcher: Any,
                    send: trio.MemorySendChannel[StreamItem],
                    trio_token: trio.lowlevel.TrioToken | None) -> Callable[[], None]:
        """The device work that puts a request into the decoder (`trio_token` None: replayed,
        its tokens go nowhere)."""
        token = cast(trio.lowlevel.TrioToken, trio_token)  # None: post() delivers nothing
        seed = request_seed(request_id, sampling)

        def work() -> None:
            device = self._device
            if request_id in device.live:
                raise StatecoreError(client_error(f"request {request_id!r} is already decoding"))
            overloaded = device.overloaded()
            if overloaded is not None:
                raise overloaded
            cache = take_cache()  # validates; raises before anything changes
            remaining = sampling.max_tokens - 1
            if remaining == 0 or (first_token in device.eos and not sampling.ignore_eos):
                # The first token already ended the request: an empty stream.
                record = device.requests.get(request_id)
                if record is not None and record.phase is EnginePhase.HELD:
                    device.requests.remove(request_id)
                device.choice_ended(sampling)
                post(token, deliver, [(send, None, True)])
                self._publish()
                return
            # The grammar's state after the first token, which the prefill node drew under it.
            constraint = self._constraint(matcher, (first_token,))
            lane = device.lane_for(cache, len(tokens), remaining, constraint is not None)
            reserved = None
            if lane != "slot":  # its cache grows to the whole request, outside the pool
                total = len(tokens) + sampling.max_tokens
                reserved = device.admit(request_id, device.cost.of(total), total)
            sampler = PositionSampler(sampling, seed, len(tokens) + 1, [*tokens, first_token], constraint)
            live = Live(request_id, send, token, remaining, sampler, first_token, prompt_tokens=len(tokens))
            if device.settings.keep_conversations and device.prefix is not None:
                live.conversation = [*tokens, first_token]
            device.join(live, cache, tokens, lane, reserved)
            self._publish()

        return work

    async def _call(self, work: Callable[[], _T], undo: Callable[[_T], None] | None = None,
                    command: lockstep.Command | None = None,
                    undo_command: lockstep.Command | None = None) -> _T:
        """Run `work` on the device thread; wait for it without blocking trio. `command`: how the
        other ranks of a tensor-parallel instance replay it (None: it changes nothing they hold)."""
        return await self._wait(Job(work, trio.lowlevel.current_trio_token(), undo, trio.Event(),
                                    command=command, undo_command=undo_command))

    async def _wait(self, job: Job[_T]) -> _T:
        with self._state_lock:
            if not self._alive:
                raise engine_failed("the engine is closed" if self._closed else "the device thread has died")
            self._queue.put(job)
        assert job.done is not None
        try:
            await job.done.wait()
        except BaseException:
            with job.lock:
                job.abandoned = True
                result = job.outcome
            undo = job.undo
            if result is not None and result.error is None and undo is not None:
                value = result.value
                self._submit_nowait(lambda: undo(value), job.undo_command)  # type: ignore[arg-type]
            elif result is None and job.deferred and undo is not None:
                # Registered work (a queued prefill) is undone at once, not when its turn comes:
                # what it reserved goes back with it. A no-op if it never registered.
                self._submit_nowait(lambda: undo(None), job.undo_command)  # type: ignore[arg-type]
            raise
        assert job.outcome is not None
        return job.outcome.unwrap()

    def _cancel_nowait(self, request_id: RequestId) -> None:
        self._submit_nowait(lambda: self._drop(request_id), lockstep.Drop(request_id))

    def _stop_nowait(self) -> None:
        with self._state_lock:
            if not self._alive:
                return
            self._closed = True
            self._queue.put(Stop())

    # -- device-thread side --------------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            self._device.run()
        except BaseException as exc:
            logger.exception("the MLX device thread died")
            if (advice := out_of_memory_advice(exc, self._settings.kv_memory_bytes)) is not None:
                logger.error("%s", advice)
            self._die(engine_failed(f"the device thread died: {type(exc).__name__}: {exc}"))
        else:
            self._die(engine_failed("the engine is closed"))

    def abandon(self, reason: str) -> None:
        """Give up on a device thread that stopped making progress (the node's watchdog): every
        waiting caller and live stream fails now with ENGINE_FAILED, as does every later call.
        The thread is left to itself: nothing can interrupt it inside MLX."""
        with self._state_lock:
            if not self._alive:
                return
            self._alive = False
        logger.error("abandoning the device thread: %s", reason)
        self._die(engine_failed(f"the engine was abandoned: {reason}"))

    def _die(self, error: StatecoreError) -> None:
        with self._state_lock:
            self._alive = False
        self._stats = EngineStatistics(0, 0, 0, False, self._device.step_retries, self._device.rows_isolated)
        self._device.die(error)

    def _replay(self, command: lockstep.Command) -> Job[Any]:
        """On a rank > 0: the job rank 0 ran for `command`, rebuilt from its plain values."""
        match command:
            case lockstep.Load(settings):
                def load() -> None:
                    self._settings = self._device.settings = Settings(**settings)
                    self._info = self._load_on_device()
                return Job(load, None)
            case lockstep.Prefill(request_id, tokens, sampling):
                return self._prefill_job(request_id, list(tokens), sampling, self._replayed_matcher(sampling),
                                         None)
            case lockstep.Decode(request_id, tokens, first_token, sampling, sliced):
                take_cache = (partial(self._received_heads, tokens) if sliced
                              else partial(self._held_cache, request_id, len(tokens)))
                send, _ = trio.open_memory_channel[StreamItem](0)
                return Job(self._start_work(request_id, list(tokens), first_token, sampling, take_cache,
                                            self._replayed_matcher(sampling), send, None), None)
            case lockstep.Drop(request_id):
                return Job(partial(self._drop, request_id), None)
            case lockstep.Release(request_id):
                return Job(partial(self._release, request_id), None)
            case lockstep.Export(request_id):
                return Job(partial(self._export, request_id), None)
            case lockstep.ForgetPrefixes():
                return Job(self._forget_prefixes, None)
            case lockstep.Stop():
                raise AssertionError("the lockstep loop handles Stop itself")
            case _:
                assert_never(command)

    def _replayed_matcher(self, sampling: SamplingParams) -> Any:
        if sampling.response_format is None or self._grammars is None:
            return None
        return self._grammars.matcher(sampling.response_format)

    def _drop(self, request_id: str) -> None:
        self._device.drop(request_id)
        self._publish()

    def _check_unused(self, request_id: str) -> None:
        device = self._device
        if request_id in device.requests:
            raise StatecoreError(client_error(f"request {request_id!r} is already in use"))

    def _publish(self) -> None:
        """Refresh the statistics snapshot (device thread only; one atomic assignment)."""
        device = self._device
        speculator = device.speculator
        self._stats = EngineStatistics(
            decoding=len(device.live),
            held_caches=len(device.held),
            held_bytes=sum(h.nbytes for h in device.held.values()),
            device_thread_alive=True,
            step_retries=device.step_retries,
            rows_isolated=device.rows_isolated,
            kv_reserved_bytes=device.reserved_bytes,
            prefix_cache_bytes=0 if device.prefix is None else device.prefix.nbytes,
            prefix_cache_hits=0 if device.prefix is None else device.prefix.hits,
            prefix_tokens_reused=0 if device.prefix is None else device.prefix.tokens_reused,
            prefix_cache_queries=0 if device.prefix is None else device.prefix.queries,
            prefix_cache_evictions=0 if device.prefix is None else device.prefix.evictions,
            prefix_host_bytes=0 if device.prefix is None else device.prefix.host_nbytes,
            prefix_host_capacity_bytes=(0 if device.prefix is None
                                        else device.prefix.index.host_capacity_bytes),
            prefix_host_out=0 if device.prefix is None else device.prefix.host_out,
            prefix_host_back=0 if device.prefix is None else device.prefix.host_back,
            prefix_host_forgotten=0 if device.prefix is None else device.prefix.host_forgotten,
            prefill_capped_steps=device.prefill_capped_steps,
            activation_overruns=device.activation_overruns,
            activation_estimate_peak_bytes=device.activation_peak,
            conversations_kept=device.conversations_kept,
            conversation_tokens_kept=device.conversation_tokens_kept,
            speculative_steps=0 if speculator is None else speculator.verify_steps,
            speculative_drafted=0 if speculator is None else speculator.drafted,
            speculative_accepted=0 if speculator is None else speculator.accepted,
            speculative_emitted=0 if speculator is None else speculator.emitted,
        )

    def _cache_bytes(self, cache: list[Any]) -> int:
        """What a held cache weighs: its live tensors, as the wire would carry them."""
        if self.info.can_travel:
            return codec.raw_tensor_bytes(cache)
        return sum(int(getattr(c, "nbytes", 0)) for c in cache)

    def _load_on_device(self) -> ModelInfo:
        s = self._settings
        tensor = self._tensor
        pipelined = tensor is not None and tensor.pipeline
        group = None if tensor is None else tensor.group
        loaded = load_model(self._model_dir, trust_remote_code=self._trust_remote_code,
                            shard_group=None if pipelined else group,
                            pipeline_group=group if pipelined else None, adapter_path=self._adapter_dir)
        self._device.pipelined = pipelined
        fused = fuse_projections(loaded.model) if enabled_on_cuda(s.fuse_projections) else 0
        device = self._device
        device.model = loaded.model
        # A one-token probe through the real prefill path: the cache classes as they travel
        # (QuantizedKVCache when kv_bits is set) and the true vocabulary size.
        try:
            with mx.stream(generation_stream):
                probe_cache: list[Any] = make_prompt_cache(loaded.model)
                logits = loaded.model(mx.array([[0]]), cache=probe_cache)
                device.quantize(probe_cache)
                mx.eval(logits, [c.state for c in probe_cache])
        except Exception as exc:
            raise StatecoreError(ErrorInfo(
                Fault.UNSUPPORTED, Code.UNSUPPORTED_CACHE,
                f"model {self._model_dir.name!r} cannot prefill with kv_bits={s.kv_bits}: "
                f"{type(exc).__name__}: {exc}",
            )) from exc
        vocab_size = int(logits.shape[-1])
        layers = tuple(codec.travel_report(probe_cache))
        self._expected_classes = [layer.class_name for layer in layers]
        for layer in layers:
            if layer.can_travel:
                logger.debug("layer %d: %s can travel", layer.index, layer.class_name)
            else:
                logger.warning("layer %d: %s cannot travel: %s", layer.index, layer.class_name, layer.reason)
        def probe(tokens: int) -> list[Any]:
            with mx.stream(generation_stream):
                cache: list[Any] = make_prompt_cache(loaded.model)
                loaded.model(mx.array([[0] * tokens]), cache=cache)
                device.quantize(cache)
                mx.eval([c.state for c in cache])
            return cache

        travels = all(layer.can_travel for layer in layers)
        cost = measure_kv_cost(probe, codec.raw_tensor_bytes if travels else state_bytes,
                               probe_cache if device.plain(probe_cache) else None)
        if pipelined:  # each rank holds other layers: admission decides alike on the largest
            assert tensor is not None
            cost = KvCost(*agree_max(tensor.group, [cost.fixed, cost.per_token, cost.slot_per_token]))
        if self._draft_dir is not None and s.speculative == "draft":
            drafting = load_model(self._draft_dir, trust_remote_code=self._trust_remote_code)
            check_draft_vocabulary(loaded.tokenizer, drafting.tokenizer)
            device.draft_model = DraftModel(drafting.model)
        device.configure(loaded.model, loaded.eos, vocab_size, loaded.context_length, probe_cache, cost)
        # what this rank holds of the model (a shard on a tensor-parallel rank), and every rank's
        held = parameter_bytes(loaded.model)
        by_rank = (held,) if tensor is None else tuple(every_rank(tensor.group, held))
        self._grammars = Grammars(loaded.tokenizer, vocab_size, loaded.eos)
        if device.bucket and mx.default_device() == mx.gpu:
            started = time.perf_counter()
            with mx.stream(generation_stream):
                shapes = warm_chunk_shapes(loaded.model, device.bucket, s.prefill_chunk_size)
            logger.info("warmed %d prefill shapes in %.1f s", shapes, time.perf_counter() - started)
        info = ModelInfo(
            name=self._model_dir.name,
            fingerprint=model_fingerprint(loaded, kv_bits=s.kv_bits, kv_group_size=s.kv_group_size,
                                          prefill_chunk_size=s.prefill_chunk_size,
                                          shape_bucket=device.bucket, fused=fused > 0),
            context_length=loaded.context_length,
            vocab_size=vocab_size,
            eos_token_ids=loaded.eos,
            prefill_chunk_size=s.prefill_chunk_size,
            layers=layers,
            parameter_bytes_by_rank=by_rank,
        )
        logger.info(
            "loaded %s (%s, kv_bits=%s, chunk=%d, shape bucket=%d, lane=%s, attention=%s, traced=%s, "
            "fused projection groups=%d): "
            "can_travel=%s; "
            "KV %d bytes + %d per token, "
            "budget %d bytes (%d set aside for %s)",
            info.name, ",".join(loaded.dtypes),
            s.kv_bits, s.prefill_chunk_size, device.bucket, "slots" if device.slot_lane else "batch lane",
            device.attention if device.slot_lane else "-",
            "yes" if device.compiled is not None else "no", fused,
            info.can_travel,
            cost.fixed, cost.per_token, s.kv_memory_bytes, device.pool_reserved,
            f"{s.max_batch} slots of {device.pool.max_capacity} positions" if device.pool else "no slots",
        )
        return info


def _kv_cache(keys: Any, values: Any, tokens: int) -> Any:
    """A plain KVCache over these arrays, holding `tokens` positions."""
    return KVCache.from_state((keys, values, tokens))  # type: ignore[no-untyped-call]


def _refuse_prefix_move(what: str) -> StatecoreError:
    return StatecoreError(ErrorInfo(
        Fault.UNSUPPORTED, Code.UNSUPPORTED_CACHE,
        f"a tensor- or pipeline-parallel instance does not {what} prefix-cache blocks: its ranks hold "
        "shares of each cache (the wire carries whole layers), so they would need a gather first"))


def _not_held(request_id: str) -> StatecoreError:
    return StatecoreError(
        client_error(f"no prefilled cache is held for request {request_id!r}", Code.KV_NOT_FOUND)
    )

