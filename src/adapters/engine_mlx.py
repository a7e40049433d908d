"""`MlxEngine`: the Engine port over mlx / mlx-lm, with all device work on one dedicated thread.

Threading. One daemon thread (the *device thread*) owns the model, every cache and the batched
decoder; nothing else ever touches an MLX array (a lazy array built in one thread and evaluated in
another fails). Trio tasks post jobs on a thread-safe queue and wait on a `trio.Event`; the device
thread sends results back with `TrioToken.run_sync_soon`, which never blocks it. A job that fails
fails only its caller (as `StatecoreError`); an exception escaping the device loop itself kills
the thread: `statistics().device_thread_alive` turns False at once and every pending and future
call raises `StatecoreError(Fault.BUG, Code.ENGINE_FAILED)` (`cancel` and `release_held` stay
quiet no-ops, since nothing is held any more). A caller cancelled while its job is queued gets it
skipped; one cancelled while it runs gets its effect undone (a prefilled cache is released, an
installed request is cancelled), so a trio cancellation never leaks a cache.

Computation order (identical to mlx-lm's `generate_step`, on every node): prompt[:-1] in chunks of
`prefill_chunk_size` into a fresh `make_prompt_cache(model)`, then the last prompt token alone,
whose logits give the first token (sampled on the prefill node). Decoding continues from
`first_token` with the cache covering exactly the prompt, so one node and prefill + handoff +
decode compute the same thing. Prefills queued together with prompts of one length (plain KV
caches only) run in one batched call, row by row the same operations (`prefill_batch`).

Sampling. Greedy (temperature 0) is argmax. Otherwise the token at absolute position p (the first
token sits at p = len(prompt)) is drawn with the key `mx.random.key(blake2b("statecore-sample-v1",
seed, p))`, after temperature, top-k and top-p filtering of the log-probabilities; MLX's global RNG
is never used, so the draw does not depend on the node, the batch or its neighbours. An unseeded
request gets its seed from a hash of its request id: both nodes of a handoff derive the same one.

Decoding. Requests whose caches all have `merge` join one running mlx-lm `BatchGenerator`
(`insert` with the restored cache; nothing already decoding pauses). Caches without `merge`
(`QuantizedKVCache` when `kv_bits` is set, llama4's `ChunkedKVCache`) decode in a *solo lane* on
the same thread: one `generate_step`-style single-sequence step per request, interleaved with each
batch step. With `kv_bits`, caches are quantized after every model call from the first one on
(generate_step's `maybe_quantize_kv_cache` with `quantized_kv_start=0`): the rule is the same on
every node. Each request's tokens go to a trio memory channel bounded by its `max_tokens` (the
most it can ever carry), so delivery never blocks the device thread and memory stays bounded by
what the request asked for. EOS ends a request with `finish_reason="stop"`, reaching
`max_tokens` (the first token counts) with `"length"`.

This is an adapter: it imports mlx, mlx_lm and trio; nothing in `statecore` or `effects` may
import it. See docs/engine.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import operator
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

import mlx.core as mx
import trio
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, generation_stream, maybe_quantize_kv_cache
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.utils import load as mlx_lm_load

from adapters import kv_wire
from adapters.blas import blas_in_use
from effects.engine_port import (
    EngineStatistics,
    GeneratedToken,
    KvBytes,
    KvPieces,
    ModelInfo,
    PrefillOutcome,
    SamplingParams,
)
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error
from statecore.ids import RequestId

__all__ = ["FORMAT_VERSION", "MlxEngine", "position_key_seed", "request_seed"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Bumped whenever the computation order or the sampling rule changes: part of the fingerprint."""

DEFAULT_CONTEXT_LENGTH = 4096
"""Used when config.json names no context length (e.g. pure state-space models)."""

_CONTEXT_KEYS = (
    "max_position_embeddings",
    "max_sequence_length",
    "max_seq_len",
    "seq_length",
    "n_positions",
    "n_ctx",
)
_KV_BITS = (2, 3, 4, 5, 6, 8)
_KV_GROUP_SIZES = (32, 64, 128)
_SAMPLE_KEY_DOMAIN = b"statecore-sample-v1"

_T = TypeVar("_T")
_StreamItem = GeneratedToken | StatecoreError


# ---------------------------------------------------------------------------------------------
# Sampling: pure functions of (logprobs, params, seed, position)


def request_seed(request_id: str, sampling: SamplingParams) -> int:
    """The seed a request samples with: its own, else one derived from its request id."""
    if sampling.seed is not None:
        return sampling.seed
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, person=b"statecore-seed").digest()
    return int.from_bytes(digest, "little")


def position_key_seed(seed: int, position: int) -> int:
    """The 64-bit seed of the MLX key for the token at absolute `position`."""
    h = hashlib.blake2b(_SAMPLE_KEY_DOMAIN, digest_size=8)
    h.update((seed % 2**64).to_bytes(8, "little"))
    h.update(position.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


def _sample(logprobs: Any, sampling: SamplingParams, seed: int, position: int) -> Any:
    """One token from a (1, vocab) row of log-probabilities; returns a (1,) array.

    temperature scales the logits first; top_k keeps the k most likely tokens; top_p keeps the
    smallest set of the most likely tokens whose probability reaches top_p (the most likely one
    always stays); then a categorical draw with the position's own key.
    """
    if sampling.greedy:
        return greedy_sampler(logprobs)
    x = logprobs.astype(mx.float32) * (1.0 / sampling.temperature)
    x = x - mx.logsumexp(x, axis=-1, keepdims=True)
    vocab = x.shape[-1]
    neg_inf = mx.array(-float("inf"), dtype=x.dtype)
    if 0 < sampling.top_k < vocab:
        dropped = mx.argpartition(-x, kth=sampling.top_k - 1, axis=-1)[..., sampling.top_k :]
        x = mx.put_along_axis(x, dropped, neg_inf, axis=-1)
    if 0.0 < sampling.top_p < 1.0:
        order = mx.argsort(-x, axis=-1)
        ranked = mx.take_along_axis(x, order, axis=-1)
        probs = mx.softmax(ranked, axis=-1)
        mass_before = mx.cumsum(probs, axis=-1) - probs
        ranked = mx.where(mass_before < sampling.top_p, ranked, neg_inf)
        x = mx.put_along_axis(x, order, ranked, axis=-1)
    key = mx.random.key(position_key_seed(seed, position))
    return mx.random.categorical(x, axis=-1, key=key)


class _PositionSampler:
    """A per-request sampler for mlx-lm: each call draws the token at the next position."""

    def __init__(self, sampling: SamplingParams, seed: int, position: int) -> None:
        self.sampling = sampling
        self.seed = seed
        self.position = position

    def __call__(self, logprobs: Any) -> Any:
        position = self.position
        self.position += 1
        return _sample(logprobs, self.sampling, self.seed, position)


# ---------------------------------------------------------------------------------------------
# Jobs: how trio and the device thread talk


@dataclass(eq=False)
class _Outcome(Generic[_T]):
    value: _T | None = None
    error: StatecoreError | None = None

    def unwrap(self) -> _T:
        if self.error is not None:
            raise StatecoreError(self.error.info) from self.error
        return self.value  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class _PrefillSpec:
    """What a prefill job computes, so the device loop can batch it with its neighbours."""

    request_id: RequestId
    tokens: list[int]
    sampling: SamplingParams
    seed: int

    def sampler(self) -> _PositionSampler:
        """A fresh sampler for the first token (a failed batch retried alone draws again)."""
        return _PositionSampler(self.sampling, self.seed, len(self.tokens))


@dataclass(eq=False)
class _Job(Generic[_T]):
    """One unit of device work. `token` None: fire and forget (nobody waits).

    `work` always computes the job on its own; a prefill job also carries its `prefill` spec,
    which lets the device loop compute several of them in one batched model call instead.
    """

    work: Callable[[], _T]
    token: trio.lowlevel.TrioToken | None
    undo: Callable[[_T], None] | None = None
    done: trio.Event | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False
    outcome: _Outcome[_T] | None = None
    prefill: _PrefillSpec | None = None


class _Stop:
    """Sentinel job: leave the device loop."""


class _InjectedCrash(Exception):
    """Raised outside any job by `MlxEngine._crash_device_thread_for_tests`."""


class _Crash:
    """Sentinel job: raise outside the per-job wrapper (tests of a dead device thread)."""


def _engine_failed(message: str) -> StatecoreError:
    return StatecoreError(ErrorInfo(Fault.BUG, Code.ENGINE_FAILED, message))


def _as_statecore(exc: Exception) -> StatecoreError:
    if isinstance(exc, StatecoreError):
        return exc
    return StatecoreError(
        ErrorInfo(Fault.BUG, Code.INTERNAL, f"device job failed: {type(exc).__name__}: {exc}")
    )


# ---------------------------------------------------------------------------------------------
# Device-thread state


@dataclass(eq=False)
class _Held:
    cache: list[Any]
    prompt_tokens: int
    nbytes: int


@dataclass(eq=False)
class _Solo:
    cache: list[Any]
    last_token: int
    sampler: _PositionSampler


@dataclass(eq=False)
class _Live:
    """A request in the decoder: in the batch (uid set) or in the solo lane (solo set)."""

    request_id: RequestId
    send: trio.MemorySendChannel[_StreamItem]
    token: trio.lowlevel.TrioToken
    remaining: int  # tokens still to produce
    uid: int | None = None
    solo: _Solo | None = None


@dataclass(frozen=True, slots=True)
class _Settings:
    model_dir: Path
    prefill_chunk_size: int
    kv_bits: int | None
    kv_group_size: int
    trust_remote_code: bool
    max_batch: int
    prefill_batch: int
    prefill_batch_tokens: int


def _deliver(
    items: list[tuple[trio.MemorySendChannel[_StreamItem], _StreamItem | None, bool]],
) -> None:
    """Runs in trio: push stream items and close finished streams. Never blocks."""
    for send, item, close in items:
        if item is not None:
            # WouldBlock cannot happen (the bound is max_tokens); the others mean the consumer
            # is gone, and its stream's exit already asked for a cancel.
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                send.send_nowait(item)
        if close:
            send.close()


def _post(token: trio.lowlevel.TrioToken | None, fn: Callable[..., object], *args: Any) -> None:
    if token is None:
        return
    with contextlib.suppress(trio.RunFinishedError):  # that trio run is over: nobody waits
        token.run_sync_soon(fn, *args)


class MlxEngine:
    """The Engine port over mlx-lm. Build with `await MlxEngine.load(model_dir, ...)`."""

    def __init__(self, settings: _Settings) -> None:
        """Private: use `MlxEngine.load`."""
        self._settings = settings
        self._queue: queue.SimpleQueue[_Job[Any] | _Stop | _Crash] = queue.SimpleQueue()
        self._state_lock = threading.Lock()
        self._alive = True
        self._closed = False
        self._info: ModelInfo | None = None
        self._stats = EngineStatistics(0, 0, 0, True)
        # trio side: streams not yet taken by `stream()`.
        self._streams: dict[RequestId, trio.MemoryReceiveChannel[_StreamItem]] = {}
        # device side only:
        self._model: Any = None
        self._batch: Any = None
        self._eos: frozenset[int] = frozenset()
        self._expected_classes: list[str] = []
        self._held: dict[RequestId, _Held] = {}
        self._live: dict[RequestId, _Live] = {}
        self._by_uid: dict[int, _Live] = {}
        self._prefill_batching = False  # set at load: plain KVCache models only
        self._profile: dict[str, tuple[int, float]] = {
            kind: (0, 0.0) for kind in ("prefill", "prefill_batched", "other_job", "decode_step")
        }
        self._thread = threading.Thread(target=self._thread_main, name="mlx-device", daemon=True)
        self._thread.start()

    # -- construction --------------------------------------------------------------------------

    @classmethod
    async def load(
        cls,
        model_dir: Path,
        *,
        prefill_chunk_size: int = 2048,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        trust_remote_code: bool = False,
        max_batch: int = 32,
        prefill_batch: int = 32,
        prefill_batch_tokens: int = 16384,
    ) -> MlxEngine:
        """Start the device thread and load `model_dir` on it (mlx_lm.utils.load).

        Prefills waiting together on the device thread with prompts of the same length are
        computed in one batched model call, up to `prefill_batch` prompts and
        `prefill_batch_tokens` prompt tokens per call (1 turns batching off): the same operations
        in the same order, row by row, but a batched matmul may round differently in the last bit
        than a single-row one (on the GPU; see docs/engine.md), as decoding in a batch already may.

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
        if prefill_batch < 1 or prefill_batch_tokens < 1:
            raise StatecoreError(client_error("prefill_batch and prefill_batch_tokens must be >= 1"))
        settings = _Settings(
            Path(model_dir),
            prefill_chunk_size,
            kv_bits,
            kv_group_size,
            trust_remote_code,
            max_batch,
            prefill_batch,
            prefill_batch_tokens,
        )
        engine = cls(settings)
        try:
            engine._info = await engine._call(engine._load_on_device)
        except BaseException:
            await engine.aclose()
            raise
        return engine

    @property
    def info(self) -> ModelInfo:
        if self._info is None:
            raise _engine_failed("the engine has no model loaded")
        return self._info

    # -- the Engine port -----------------------------------------------------------------------

    async def prefill(
        self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams
    ) -> PrefillOutcome:
        tokens = self._check_request(prompt, sampling)
        seed = request_seed(request_id, sampling)

        spec = _PrefillSpec(request_id, tokens, sampling, seed)

        def work() -> PrefillOutcome:
            self._check_unused(request_id)
            (cache,), (first,), _ = self._prefill_compute([tokens], [spec.sampler()])
            return self._hold(spec, cache, first)

        return await self._call(work, undo=lambda _: self._drop(request_id), prefill=spec)

    async def export_held(self, request_id: RequestId) -> KvPieces:
        def work() -> kv_wire.HostTensors:
            held = self._held.get(request_id)
            if held is None:
                raise _not_held(request_id)
            return kv_wire.host_tensors(
                held.cache, fingerprint=self.info.fingerprint, token_count=held.prompt_tokens
            )

        tensors = await self._call(work)
        # The tensors are not copied: the pieces reference them. The checksum (the end frame)
        # needs no MLX: a thread computes it while the pieces are already being sent.
        return KvPieces(tuple(kv_wire.unsealed_pieces(tensors)),
                        seal=kv_wire.end_frame_in_background(tensors), seal_nbytes=kv_wire.END_FRAME_BYTES)

    async def release_held(self, request_id: RequestId) -> int:
        def work() -> int:
            held = self._held.pop(request_id, None)
            self._publish()
            return 0 if held is None else held.nbytes

        if not self._alive:
            return 0
        with trio.CancelScope(shield=True):  # quick, and must not be skipped
            freed = await self._call(work)
        return freed

    async def decode_held(
        self,
        request_id: RequestId,
        prompt: Sequence[int],
        first_token: int,
        sampling: SamplingParams,
    ) -> None:
        tokens = self._check_request(prompt, sampling)
        first_token = self._check_token(first_token, "first_token")

        def take_cache() -> list[Any]:
            held = self._held.get(request_id)
            if held is None:
                raise _not_held(request_id)
            if held.prompt_tokens != len(tokens):
                raise StatecoreError(
                    client_error(
                        f"request {request_id!r}: the held cache covers {held.prompt_tokens} "
                        f"tokens, the prompt has {len(tokens)}"
                    )
                )
            return held.cache

        await self._start(request_id, tokens, first_token, sampling, take_cache)

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

        # Every check that needs no MLX (framing, checksum, header: most of the time for a large
        # payload) runs in a worker thread, so a big handoff never stalls the decode batch.
        validated = await trio.to_thread.run_sync(
            lambda: kv_wire.validate_payload(
                payload, fingerprint=self.info.fingerprint, expected_classes=self._expected_classes
            )
        )
        if validated.header.token_count != len(tokens):
            raise StatecoreError(
                ErrorInfo(
                    Fault.PEER,
                    Code.KV_MALFORMED,
                    f"the KV payload covers {validated.header.token_count} tokens, "
                    f"the prompt has {len(tokens)}",
                )
            )

        def take_cache() -> list[Any]:
            caches: list[Any] = kv_wire.build_caches(validated).caches
            return caches

        await self._start(request_id, tokens, first_token, sampling, take_cache)

    async def stream(self, request_id: RequestId) -> AsyncGenerator[GeneratedToken, None]:
        """Tokens after the first one. Leaving early cancels the request."""
        receive = self._streams.pop(request_id, None)
        if receive is None:
            raise StatecoreError(
                ErrorInfo(
                    Fault.BUG,
                    Code.INTERNAL,
                    f"no stream for request {request_id!r} (never started, already taken, or cancelled)",
                )
            )
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
        receive = self._streams.pop(request_id, None)
        if receive is not None:
            receive.close()
        if not self._alive:
            return
        with trio.CancelScope(shield=True):  # within one decode step; must not be skipped
            await self._call(lambda: self._drop(request_id))

    def statistics(self) -> EngineStatistics:
        return replace(self._stats, device_thread_alive=self._alive)

    async def aclose(self) -> None:
        """Stop the device thread; every held cache and live request is dropped."""
        for receive in self._streams.values():
            receive.close()
        self._streams.clear()
        self._stop_nowait()
        with trio.CancelScope(shield=True):
            # Within one decode step; joining lets MLX's thread-local state go before exit.
            await trio.to_thread.run_sync(self._thread.join)

    # -- test hooks ----------------------------------------------------------------------------

    def _crash_device_thread_for_tests(self) -> None:
        """Make the device loop itself raise (not a job): the engine must report itself dead."""
        self._queue.put(_Crash())

    # -- trio-side helpers ---------------------------------------------------------------------

    def _check_request(self, prompt: Sequence[int], sampling: SamplingParams) -> list[int]:
        if not self._alive:
            raise _engine_failed("the device thread is not running")
        tokens = [self._check_token(t, "prompt token") for t in prompt]
        if not tokens:
            raise StatecoreError(client_error("the prompt is empty"))
        if len(tokens) > self.info.context_length:
            raise StatecoreError(
                client_error(
                    f"the prompt has {len(tokens)} tokens; the context length is {self.info.context_length}",
                    Code.CONTEXT_LENGTH_EXCEEDED,
                )
            )
        if sampling.max_tokens < 1:
            raise StatecoreError(client_error("max_tokens must be >= 1"))
        if sampling.temperature < 0.0 or sampling.temperature != sampling.temperature:
            raise StatecoreError(client_error("temperature must be >= 0"))
        if not 0.0 < sampling.top_p <= 1.0:
            raise StatecoreError(client_error("top_p must be in (0, 1]"))
        if sampling.top_k < 0:
            raise StatecoreError(client_error("top_k must be >= 0"))
        return tokens

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
    ) -> None:
        """Open the request's stream, then insert it into the decoder on the device thread."""
        if request_id in self._streams:
            raise StatecoreError(client_error(f"request {request_id!r} is already decoding"))
        send, receive = trio.open_memory_channel[_StreamItem](sampling.max_tokens)
        token = trio.lowlevel.current_trio_token()
        seed = request_seed(request_id, sampling)

        def work() -> None:
            if request_id in self._live:
                raise StatecoreError(client_error(f"request {request_id!r} is already decoding"))
            if len(self._live) >= self._settings.max_batch:
                raise StatecoreError(
                    ErrorInfo(
                        Fault.OVERLOADED,
                        Code.OVERLOADED,
                        f"{len(self._live)} requests are decoding (max_batch {self._settings.max_batch})",
                    )
                )
            cache = take_cache()  # validates; raises before anything changes
            remaining = sampling.max_tokens - 1
            if remaining == 0 or first_token in self._eos:
                # The first token already ended the request: an empty stream.
                self._held.pop(request_id, None)
                _post(token, _deliver, [(send, None, True)])
                self._publish()
                return
            live = _Live(request_id, send, token, remaining)
            sampler = _PositionSampler(sampling, seed, len(tokens) + 1)
            if all(hasattr(c, "merge") for c in cache):
                # Greedy rows share mlx-lm's own greedy sampler: a batch whose rows all share one
                # sampler object is sampled in one call instead of row by row.
                (uid,) = self._batch.insert(
                    prompts=[[first_token]],
                    max_tokens=[remaining],
                    caches=[cache],
                    all_tokens=[tokens],
                    samplers=[greedy_sampler if sampling.greedy else sampler],
                )
                live.uid = uid
                self._by_uid[uid] = live
            else:
                live.solo = _Solo(cache, first_token, sampler)
            self._held.pop(request_id, None)
            self._live[request_id] = live
            self._publish()

        self._streams[request_id] = receive
        try:
            await self._call(work, undo=lambda _: self._drop(request_id))
        except BaseException:
            if self._streams.get(request_id) is receive:
                del self._streams[request_id]
            receive.close()
            send.close()
            raise

    async def _call(
        self,
        work: Callable[[], _T],
        undo: Callable[[_T], None] | None = None,
        prefill: _PrefillSpec | None = None,
    ) -> _T:
        """Run `work` on the device thread; wait for it without blocking trio."""
        job: _Job[_T] = _Job(work, trio.lowlevel.current_trio_token(), undo, trio.Event(), prefill=prefill)
        self._submit(job)
        assert job.done is not None
        try:
            await job.done.wait()
        except BaseException:
            with job.lock:
                job.abandoned = True
                result = job.outcome
            if result is not None and result.error is None and undo is not None:
                value = result.value
                self._submit_nowait(lambda: undo(value))  # type: ignore[arg-type]
            raise
        assert job.outcome is not None
        return job.outcome.unwrap()

    def _submit(self, job: _Job[Any]) -> None:
        with self._state_lock:
            if not self._alive:
                raise _engine_failed("the engine is closed" if self._closed else "the device thread has died")
            self._queue.put(job)

    def _submit_nowait(self, work: Callable[[], object]) -> None:
        """Fire and forget; silently nothing if the device thread is gone."""
        with self._state_lock:
            if self._alive:
                self._queue.put(_Job(work, None))

    def _cancel_nowait(self, request_id: RequestId) -> None:
        self._submit_nowait(lambda: self._drop(request_id))

    def _stop_nowait(self) -> None:
        with self._state_lock:
            if not self._alive:
                return
            self._closed = True
            self._queue.put(_Stop())

    # -- the device thread ---------------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            logger.exception("the MLX device thread died")
            self._die(_engine_failed(f"the device thread died: {type(exc).__name__}: {exc}"))

    def _loop(self) -> None:
        while True:
            jobs: list[_Job[Any] | _Stop | _Crash] = []
            if not self._live:
                jobs.append(self._queue.get())
            while True:
                try:
                    jobs.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            index = 0
            while index < len(jobs):
                job = jobs[index]
                if isinstance(job, _Stop):
                    self._die(_engine_failed("the engine is closed"))
                    return
                if isinstance(job, _Crash):
                    raise _InjectedCrash("device loop crash injected by a test")
                if job.prefill is not None and self._prefill_batching:
                    run: list[_Job[Any]] = []
                    while index < len(jobs):
                        following = jobs[index]
                        if not isinstance(following, _Job) or following.prefill is None:
                            break
                        run.append(following)
                        index += 1
                    self._run_prefills(run)
                    continue
                self._run_job(job)
                index += 1
            if self._live:
                started = time.perf_counter()
                self._step()
                self._account("decode_step", started)

    def _run_job(self, job: _Job[Any]) -> None:
        if _abandoned(job):
            return
        started = time.perf_counter()
        result: _Outcome[Any]
        try:
            result = _Outcome(value=job.work())
        except Exception as exc:
            if not isinstance(exc, StatecoreError):
                logger.exception("device job failed")
            result = _Outcome(error=_as_statecore(exc))
        self._account("prefill" if job.prefill is not None else "other_job", started)
        self._finish(job, result)

    def _run_prefills(self, jobs: list[_Job[Any]]) -> None:
        """Consecutive prefill jobs: same-length prompts in batches, the others one by one."""
        groups: dict[int, list[list[_Job[Any]]]] = {}
        for job in jobs:
            if _abandoned(job):
                continue
            assert job.prefill is not None
            length = len(job.prefill.tokens)
            rows = max(1, min(self._settings.prefill_batch, self._settings.prefill_batch_tokens // length))
            batches = groups.setdefault(length, [[]])
            if len(batches[-1]) >= rows:
                batches.append([])
            batches[-1].append(job)
        for batches in groups.values():
            for batch in batches:
                self._run_prefill_batch(batch)

    def _run_prefill_batch(self, jobs: list[_Job[Any]]) -> None:
        ready: list[_Job[Any]] = []
        later: list[_Job[Any]] = []  # request ids already taken, or taken by an earlier row
        seen: set[RequestId] = set()
        for job in jobs:
            assert job.prefill is not None
            rid = job.prefill.request_id
            if rid in seen or self._in_use(rid):
                later.append(job)
            else:
                seen.add(rid)
                ready.append(job)
        if len(ready) < 2:
            later = ready + later
        else:
            self._compute_prefill_batch(ready)
        for job in later:  # after the batch, as queued: each fails (or runs) on its own
            self._run_job(job)

    def _compute_prefill_batch(self, jobs: list[_Job[Any]]) -> None:
        specs = [job.prefill for job in jobs if job.prefill is not None]
        started = time.perf_counter()
        try:
            caches, firsts, _ = self._prefill_compute(
                [spec.tokens for spec in specs], [spec.sampler() for spec in specs]
            )
        except Exception:
            # One prompt must not fail its neighbours: retry each alone, where errors are its own.
            logger.exception("a batched prefill of %d prompts failed; computing them one by one", len(jobs))
            for job in jobs:
                self._run_job(job)
            return
        self._account("prefill_batched", started, len(jobs))
        for job, spec, cache, first in zip(jobs, specs, caches, firsts, strict=True):
            self._finish(job, _Outcome(value=self._hold(spec, cache, first)))

    def _finish(self, job: _Job[Any], result: _Outcome[Any]) -> None:
        """Hand a computed job its outcome, or undo it when its caller is gone."""
        with job.lock:
            job.outcome = result
            abandoned = job.abandoned
        if abandoned:
            if result.error is None and job.undo is not None:
                try:
                    job.undo(result.value)
                except Exception:
                    logger.exception("undoing an abandoned job failed")
            return
        if job.done is not None:
            _post(job.token, job.done.set)

    def _die(self, error: StatecoreError) -> None:
        """Leave the engine dead: fail queued jobs and live streams, drop every cache."""
        with self._state_lock:
            self._alive = False
        self._stats = EngineStatistics(0, 0, 0, False)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, _Job) and job.done is not None:
                job.outcome = _Outcome(error=error)
                _post(job.token, job.done.set)
        for live in self._live.values():
            _post(live.token, _deliver, [(live.send, error, True)])
        self._live.clear()
        self._by_uid.clear()
        self._held.clear()
        self._batch = None
        self._model = None

    def _account(self, what: str, started: float, calls: int = 1) -> None:
        calls_before, seconds = self._profile[what]
        self._profile[what] = (calls_before + calls, seconds + time.perf_counter() - started)

    def device_profile(self) -> dict[str, tuple[int, float]]:
        """Device-thread time so far by kind of work: {kind: (calls, seconds)} (for benchmarks)."""
        return dict(self._profile)

    def _in_use(self, request_id: RequestId) -> bool:
        return request_id in self._held or request_id in self._live

    def _check_unused(self, request_id: RequestId) -> None:
        if self._in_use(request_id):
            raise StatecoreError(client_error(f"request {request_id!r} is already in use"))

    def _hold(self, spec: _PrefillSpec, cache: list[Any], first_token: int) -> PrefillOutcome:
        """Keep a prefilled cache for the handoff (or for decoding here)."""
        nbytes = self._cache_bytes(cache)
        self._held[spec.request_id] = _Held(cache, len(spec.tokens), nbytes)
        self._publish()
        return PrefillOutcome(first_token=first_token, prompt_tokens=len(spec.tokens), held_bytes=nbytes)

    def _publish(self) -> None:
        """Refresh the statistics snapshot (device thread only; one atomic assignment)."""
        self._stats = EngineStatistics(
            decoding=len(self._live),
            held_caches=len(self._held),
            held_bytes=sum(h.nbytes for h in self._held.values()),
            device_thread_alive=True,
        )

    def _drop(self, request_id: RequestId) -> None:
        """Cancel: leave the decoder and free everything held for the request. Idempotent."""
        self._held.pop(request_id, None)
        live = self._live.pop(request_id, None)
        if live is not None:
            if live.uid is not None:
                self._by_uid.pop(live.uid, None)
                self._batch.remove([live.uid])
            _post(live.token, _deliver, [(live.send, None, True)])
        self._publish()

    def _load_on_device(self) -> ModelInfo:
        s = self._settings
        config_path = s.model_dir / "config.json"
        try:
            config_bytes = config_path.read_bytes()
            config = json.loads(config_bytes)
        except FileNotFoundError:
            raise StatecoreError(
                client_error(f"no model at {s.model_dir} (no config.json)", Code.MODEL_NOT_FOUND)
            ) from None
        except (OSError, ValueError) as exc:
            raise StatecoreError(
                client_error(f"cannot read {config_path}: {exc}", Code.MODEL_NOT_FOUND)
            ) from exc
        if not isinstance(config, dict):
            raise StatecoreError(client_error(f"{config_path} is not a JSON object"))
        model_file = config.get("model_file")
        if model_file is not None and not s.trust_remote_code:
            raise StatecoreError(
                ErrorInfo(
                    Fault.UNSUPPORTED,
                    Code.UNSUPPORTED_PARAMETER,
                    f"model {s.model_dir.name!r} needs custom Python code (config.json "
                    f"model_file={model_file!r}); refusing to run it without trust_remote_code",
                )
            )
        try:
            loaded: tuple[Any, ...] = mlx_lm_load(str(s.model_dir), trust_remote_code=s.trust_remote_code)
        except Exception as exc:
            raise StatecoreError(
                ErrorInfo(
                    Fault.UNSUPPORTED,
                    Code.MODEL_NOT_FOUND,
                    f"mlx-lm cannot load {s.model_dir}: {type(exc).__name__}: {exc}",
                )
            ) from exc
        model, tokenizer = loaded[0], loaded[1]
        self._model = model
        eos = {int(t) for t in tokenizer.eos_token_ids}
        raw_eos = config.get("eos_token_id")
        if isinstance(raw_eos, int):
            eos.add(raw_eos)
        elif isinstance(raw_eos, list):
            eos.update(int(t) for t in raw_eos)
        self._eos = frozenset(eos)
        params: Any = tree_flatten(model.parameters())
        dtypes = sorted({str(v.dtype) for _, v in params})

        # A one-token probe through the real prefill path: the cache classes as they travel
        # (QuantizedKVCache when kv_bits is set) and the true vocabulary size.
        try:
            (probe_cache,), _, vocab_size = self._prefill_compute([[0]], [greedy_sampler])
        except Exception as exc:
            raise StatecoreError(
                ErrorInfo(
                    Fault.UNSUPPORTED,
                    Code.UNSUPPORTED_CACHE,
                    f"model {s.model_dir.name!r} cannot prefill with kv_bits={s.kv_bits}: "
                    f"{type(exc).__name__}: {exc}",
                )
            ) from exc
        layers = tuple(kv_wire.travel_report(probe_cache))
        self._expected_classes = [layer.class_name for layer in layers]
        for layer in layers:
            if layer.can_travel:
                logger.info("layer %d: %s can travel", layer.index, layer.class_name)
            else:
                logger.warning("layer %d: %s cannot travel: %s", layer.index, layer.class_name, layer.reason)
        self._batch = self._new_batch()
        # Batched prefill builds one cache for many prompts and splits it by row: plain KVCache
        # layers only (no quantization, no rotation, no recurrent state).
        self._prefill_batching = (
            s.prefill_batch > 1 and s.kv_bits is None and all(type(c) is KVCache for c in probe_cache)
        )

        fingerprint_fields = {
            "format_version": FORMAT_VERSION,
            "config_sha256": hashlib.sha256(config_bytes).hexdigest(),
            "dtype": ",".join(dtypes),
            "kv_bits": s.kv_bits,
            "kv_group_size": s.kv_group_size if s.kv_bits is not None else None,
            "prefill_chunk_size": s.prefill_chunk_size,
            # Two BLAS libraries round float32 matmuls differently: nodes on different ones
            # must refuse each other's KV.
            "blas": blas_in_use(),
        }
        fingerprint = hashlib.sha256(json.dumps(fingerprint_fields, sort_keys=True).encode()).hexdigest()[:32]
        info = ModelInfo(
            name=s.model_dir.name,
            fingerprint=fingerprint,
            context_length=_context_length(config),
            vocab_size=vocab_size,
            eos_token_ids=self._eos,
            prefill_chunk_size=s.prefill_chunk_size,
            layers=layers,
        )
        logger.info(
            "loaded %s (%s, kv_bits=%s, chunk=%d): can_travel=%s",
            info.name,
            ",".join(dtypes),
            s.kv_bits,
            s.prefill_chunk_size,
            info.can_travel,
        )
        return info

    def _new_batch(self) -> Any:
        return BatchGenerator(
            self._model,
            stop_tokens=[[t] for t in sorted(self._eos)],
            sampler=greedy_sampler,
            completion_batch_size=self._settings.max_batch,
            # Inserted rows bring their caches and a one-token "prompt": let a whole wave of them
            # join the running batch in one step rather than eight at a time.
            prefill_batch_size=self._settings.max_batch,
            prefill_step_size=self._settings.prefill_chunk_size,
        )

    def _cache_bytes(self, cache: list[Any]) -> int:
        """What a held cache weighs: its live tensors, as the wire would carry them."""
        if self.info.can_travel:
            return kv_wire.raw_tensor_bytes(cache)
        return sum(int(getattr(c, "nbytes", 0)) for c in cache)

    def _quantize(self, cache: list[Any]) -> None:
        maybe_quantize_kv_cache(  # type: ignore[no-untyped-call]
            cache,
            quantized_kv_start=0,
            kv_group_size=self._settings.kv_group_size,
            kv_bits=self._settings.kv_bits,
        )

    def _prefill_compute(
        self, rows: list[list[int]], samplers: Sequence[Callable[[Any], Any]]
    ) -> tuple[list[list[Any]], list[int], int]:
        """generate_step's order for prompts of one length, row i being prompt i: prompt[:-1] in
        fixed chunks, then the last token alone, whose logits give the first token.

        One row is exactly generate_step. Several rows (plain KVCache models only) run the same
        chunks in the same order with a batch dimension, and each row's cache is then cut out of
        the batch cache as its own KVCache, as if it had been prefilled alone. Returns each
        row's cache (covering its whole prompt), each row's sampled token and the vocab width.
        """
        model = self._model
        cache: list[Any] = make_prompt_cache(model)
        chunk = self._settings.prefill_chunk_size
        length = len(rows[0])
        prompt = mx.array(rows)
        with mx.stream(generation_stream):
            done = 0
            while length - done > 1:
                n = min(chunk, length - done - 1)
                model(prompt[:, done : done + n], cache=cache)
                self._quantize(cache)
                mx.eval([c.state for c in cache])
                done += n
                mx.clear_cache()
            logits = model(prompt[:, done:], cache=cache)[:, -1, :]
            self._quantize(cache)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            sampled = mx.concatenate(
                [sampler(logprobs[row : row + 1]) for row, sampler in enumerate(samplers)], axis=0
            )
            caches = [cache] if len(rows) == 1 else [
                [_cache_row(layer, row) for layer in cache] for row in range(len(rows))
            ]
            mx.eval(sampled, [[c.state for c in row_cache] for row_cache in caches])
        firsts: list[int] = sampled.tolist()  # type: ignore[assignment]
        return caches, firsts, int(logits.shape[-1])

    def _step(self) -> None:
        """One decode step: the batch once, then every solo request once."""
        out: list[tuple[_Live, _StreamItem, bool]] = []
        if self._by_uid:
            try:
                _, responses = self._batch.next()
            except Exception as exc:
                logger.exception("a batch decode step failed; failing every batched request")
                error = _engine_failed(f"batch decode step failed: {type(exc).__name__}: {exc}")
                out.extend((failed, error, True) for failed in self._by_uid.values())
                self._by_uid.clear()
                self._batch = self._new_batch()
            else:
                for r in responses:
                    batched = self._by_uid.get(r.uid)
                    if batched is not None:
                        out.append((batched, self._token(batched, int(r.token)), False))
        for live in [lv for lv in self._live.values() if lv.solo is not None]:
            assert live.solo is not None
            try:
                token = self._solo_step(live.solo)
            except Exception as exc:
                logger.exception("a solo decode step failed for %s", live.request_id)
                error = _engine_failed(f"decode step failed: {type(exc).__name__}: {exc}")
                out.append((live, error, True))
            else:
                out.append((live, self._token(live, token), False))
        deliveries: dict[trio.lowlevel.TrioToken, list[Any]] = {}
        for live, item, failed in out:
            done = failed or (isinstance(item, GeneratedToken) and item.finish_reason is not None)
            if done:
                self._live.pop(live.request_id, None)
                if live.uid is not None:
                    self._by_uid.pop(live.uid, None)
            deliveries.setdefault(live.token, []).append((live.send, item, done))
        self._publish()
        for trio_token, items in deliveries.items():
            _post(trio_token, _deliver, items)

    def _token(self, live: _Live, token: int) -> GeneratedToken:
        """Count one token; EOS ends with "stop", the last allowed token with "length".

        The BatchGenerator applies the same two rules (its stop tokens are our EOS ids, its
        max_tokens our remaining count) and drops the row itself.
        """
        live.remaining -= 1
        if token in self._eos:
            return GeneratedToken(token, is_eos=True, finish_reason="stop")
        if live.remaining <= 0:
            return GeneratedToken(token, finish_reason="length")
        return GeneratedToken(token)

    def _solo_step(self, solo: _Solo) -> int:
        """One generate_step-style step for a single sequence."""
        with mx.stream(generation_stream):
            logits = self._model(mx.array([[solo.last_token]]), cache=solo.cache)[:, -1, :]
            self._quantize(solo.cache)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            sampled = solo.sampler(logprobs)
            mx.eval(sampled, [c.state for c in solo.cache])
        token = int(sampled.item())
        solo.last_token = token
        return token


def _abandoned(job: _Job[Any]) -> bool:
    with job.lock:
        return job.abandoned


def _cache_row(batch_layer: Any, row: int) -> Any:
    """One row of a batched KVCache layer as a KVCache of its own."""
    layer = KVCache()  # type: ignore[no-untyped-call]
    layer.keys = batch_layer.keys[row : row + 1]
    layer.values = batch_layer.values[row : row + 1]
    layer.offset = batch_layer.offset
    return layer


def _not_held(request_id: RequestId) -> StatecoreError:
    return StatecoreError(
        client_error(f"no prefilled cache is held for request {request_id!r}", Code.KV_NOT_FOUND)
    )


def _context_length(config: dict[str, Any]) -> int:
    for source in (config, config.get("text_config") or {}):
        if not isinstance(source, dict):
            continue
        for key in _CONTEXT_KEYS:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return DEFAULT_CONTEXT_LENGTH
