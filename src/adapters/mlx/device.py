"""The device loop: one thread that owns the model and every cache, and runs steps.

Each step: drain the job queue (cancels, exports, joins take effect at once; new prompts queue as
prefill tasks), ask the pure scheduler (`statecore.engine_schedule.schedule`) for the step's plan
(what fits its token budget and the KV memory), build that step's graph (every decoding row, then
the planned prefill chunks), start it on the device with `mx.async_eval`, and only then read back
the previous step's tokens and hand them out. Building step N+1 and delivering step N's tokens
overlap the device computing step N; a row that ended in step N computes one throwaway token in
step N+1.

Lanes. Models whose every layer is a plain `KVCache` (without kv_bits) decode in the *slot lane*
(`adapters.mlx.slots`): preallocated per-row KV, joining and leaving move no other row. Other
batchable families decode in the *batch lane* (`adapters.mlx.batch_lane`: rotating, arrays/SSM,
`CacheList`, over the cache classes' public merge/extend/filter/extract), and
caches that cannot batch at all (quantized KV, llama4's chunked cache, custom classes) decode in
the *solo lane*, one generate_step-style call per request and step; so do requests under a
grammar (`response_format`) in families outside the slot lane. A row's numbers in a batched lane
depend on the rows beside it (the batch lane pads them to each other; a call's row count picks
its kernels): the choices of one request (n > 1) wait for each other and enter their lane in one
step, in choice order (`joining_choices`), which makes their bytes the same on every run and on
every node. Prefill is scheduled the same
way for every family. A failing step fails the requests of that step only; an exception escaping
the loop itself kills the thread (the engine reports itself dead).

Conversations (`Settings.keep_conversations`, decode and single nodes with a prefix cache): a
request that ends normally leaves a *keep task* behind, a prefill task without a first token
over its prompt and generated tokens' whole chunks, started from the cached ones
(`statecore.prefix.conversation_blocks`): it computes the chunks after the prompt's kept blocks
as any prompt would and keeps them, so the next turn finds the whole conversation cached with
the numbers a cache-less prefill of it gives. It gives way to requests: scheduled after every
waiting prompt, and, though it reserves its KV like one, dropped when admission needs the
memory. A handed-off prompt's whole chunks are kept as they are installed (the prefill node
computed the same calls: same fingerprint, chunk size and bucket). This module imports mlx,
mlx_lm and trio (only for trio tokens); statecore and effects never import it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import mlx.core as mx
import trio
from mlx_lm.generate import generation_stream, maybe_quantize_kv_cache
from mlx_lm.models.cache import KVCache

from adapters.mlx.batch_lane import BatchLane, batchable
from adapters.mlx.choices import ChoiceGathering
from adapters.mlx.compiled import CompiledSlotStep
from adapters.mlx.draft_model import DraftModel
from adapters.mlx.jobs import (
    Crash,
    Job,
    Outcome,
    Stop,
    StreamItem,
    as_statecore,
    deliver,
    engine_failed,
    post,
)
from adapters.mlx.memory import ALLOCATION_STEP, KvCost
from adapters.mlx.prefill import PrefillTask, run_short_batch, run_units
from adapters.mlx.prefix_cache import PrefixCache
from adapters.mlx.requests import EngineRequest, Held, RequestTable
from adapters.mlx.rows import Live
from adapters.mlx.sampling import PositionSampler, read_logprobs
from adapters.mlx.slot_lane import SlotLane
from adapters.mlx.slots import SlotPool
from adapters.mlx.solo_lane import SoloLane
from adapters.mlx.speculative import Speculator
from effects.engine_port import GeneratedToken, PrefillOutcome, SamplingParams
from statecore.engine_schedule import (
    Budget,
    Candidate,
    EnginePhase,
    Memory,
    StepPlan,
    choose_lane,
    schedule,
)
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.events import TokenLogprobs
from statecore.policy import STOP, token_finish
from statecore.prefix import block_bounds, conversation_block_bounds, conversation_block_range
from statecore.scheduling import (
    STREAMED_PIECE_BYTES,
    KvAdmission,
    ModelShape,
    StepRates,
    kv_admission,
    measured_step,
    prefill_units,
    streamed_pieces,
    work_unit_tokens,
)

__all__ = ["SLOW_STEP_S", "DeviceLoop", "Settings", "SlowStep"]

logger = logging.getLogger("adapters.engine_mlx")


_T = TypeVar("_T")
SLOW_STEP_S = 0.1  # a step this long is kept in `slow_steps` with where its time went
# How long steps hold prefill back for a handed-off request whose last piece arrived (it joins as
# soon as it is validated; a request that never does stops holding it back after this)
HANDOFF_COMING_S = 2.0
_SLOW_STEPS_KEPT = 32
_KEEP_AFTER = 1 << 40  # keep tasks queue after every prompt (the scheduler takes the oldest first)



class InjectedCrash(Exception):
    """Raised outside any job by a Crash sentinel."""


@dataclass(frozen=True, slots=True)
class SlowStep:
    """One step that took `SLOW_STEP_S` or more: what it computed and where its time went."""

    at: float  # time.time() when it ended
    seconds: float
    decode_rows: int
    prefill_units: int
    new_traces: int  # slot-step shapes traced in this step (each a graph build, then MLX's compile)
    parts: tuple[tuple[str, float], ...]  # (profile kind, seconds in this step), largest first


@dataclass(frozen=True, slots=True)
class Settings:
    prefill_chunk_size: int
    kv_bits: int | None
    kv_group_size: int
    max_batch: int
    max_num_batched_tokens: int
    prefill_batch: int
    max_padding: float
    max_slot_tokens: int
    kv_memory_bytes: int  # what KV caches may take in all: the slot pool and every request's own
    decodes_locally: bool  # False on a prefill node: a prefilled cache never grows here
    shape_bucket: int  # prefill chunks and the slot lane's attended length round up to it (0: off)
    decode_attention: str  # the slot lane's attention: auto | kernel | masked | reference
    prefix_cache_bytes: int  # the prefix cache's capacity (plain KVCache models; 0: off)
    compile_decode: str = "off"  # the slot lane's model call traced per shape: auto | on | off
    preallocate_slots: bool = False  # the slot pool at its full capacity from the load on
    # Each step's prefill work capped so that the KV held and reserved plus the step's estimated
    # activations stay within kv_memory_bytes (on when --kv-memory-bytes is given).
    prefill_memory_cap: bool = False
    fuse_projections: str = "off"  # sibling projections as one matmul (adapters.mlx.fusion): auto | on | off
    keep_conversations: bool = False  # a finished request's whole chunks go into the prefix cache
    # Speculative decoding (adapters.mlx.speculative) while at most speculative_max_rows decode
    speculative: str = "off"  # off | ngram | draft
    num_draft_tokens: int = 3
    speculative_max_rows: int = 1
    # While streams decode, each step's prefill is sized to keep the step near this many ms
    # (`statecore.scheduling.step_token_budget`): None = a multiple of the measured decode step,
    # 0 = off (max_num_batched_tokens every step). Off on a lockstep instance: its ranks must
    # plan alike, and each would measure its own times.
    step_target_ms: float | None = None
    # The prefix cache's host tier (adapters.mlx.prefix_cache): its capacity (0: off), and when a
    # host block comes back to the device rather than being computed
    prefix_host_bytes: int = 0
    prefix_host_pull: str = "auto"


class _StepOutputs:
    """The arrays a step's prefill calls evaluate. On a pipeline rank each call's are launched as
    soon as it is built: its send/recv and all_gather then run in call order on every rank, which
    one evaluation of several calls' graphs does not promise (MLX may order independent graphs
    differently on each rank, and the ranks' graphs differ)."""

    def __init__(self, pipelined: bool) -> None:
        self.pipelined = pipelined
        self.arrays: list[Any] = []

    def extend(self, arrays: Sequence[Any]) -> None:
        arrays = list(arrays)
        if self.pipelined and arrays:
            mx.async_eval(arrays)  # type: ignore[no-untyped-call]
        self.arrays.extend(arrays)


@dataclass(eq=False)
class InFlight:
    """A step handed to the device; read back after the next one is built."""

    tokens: Any = None  # slot lane: (rows,) sampled tokens
    owners: list[Live | None] = field(default_factory=list)
    logprobs: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # slot -> its token's, lazily
    finished_prefills: list[PrefillTask] = field(default_factory=list)
    prefill_tokens: int = 0  # the prefill work it planned (what the step-time target measures)
    failed_prefills: list[tuple[PrefillTask, StatecoreError]] = field(default_factory=list)
    # streamed handoffs: (task, (start, stop, first layer, end layer), keys then values per layer)
    segments: list[tuple[PrefillTask, tuple[int, int, int, int], list[Any]]] = field(default_factory=list)


class DeviceLoop:
    """All device-thread state. Only the device thread calls its methods (after `load`)."""

    def __init__(self, settings: Settings, queue_: queue.SimpleQueue[Job[Any] | Stop | Crash],
                 on_death: Callable[[StatecoreError], None]) -> None:
        self.settings = settings
        self.queue = queue_
        self.on_death = on_death
        self.model: Any = None
        self.eos: frozenset[int] = frozenset()
        # after these tokens a prefill block ends early (statecore.prefix.block_bounds): the eos ids
        self.block_ends: frozenset[int] = frozenset()
        self.vocab_size = 0
        self.context_length = 0
        self.slot_lane = False
        self.streams_ranges = False  # plain KVCache layers: a handoff streams by token and layer range
        self.short_batching = False
        self.bucket = 0  # the shape bucket in use (Settings.shape_bucket on plain KVCache models)
        self.layers = 1  # cache layers of the model: what a prefill work unit slices
        self.pipelined = False  # a pipeline rank: its model holds a share of the layers
        self.pool: SlotPool | None = None
        self.compiled: CompiledSlotStep | None = None  # the slot lane's traced model call, when on
        self.attention = "masked (MLX)"  # the slot lane's attention, for the load log
        self.prefix: PrefixCache | None = None  # whole prefill chunks kept for prompts that repeat them
        self.slots = SlotLane(self)  # rows of plain KVCache models, in `pool`
        self.batch = BatchLane(self)  # rows of the other batchable families
        self.solo = SoloLane(self)  # rows that step alone
        # Every request's one record; the maps below are read-only views of it.
        self.requests = RequestTable()
        self.held = self.requests.held  # prefilled caches waiting for their export or decode
        self.live = self.requests.live  # requests in the decoder (gathering choices included)
        self.waiting = self.requests.waiting  # prompts and keep tasks with prefill work left
        self.gathering = self.requests.gathering  # choices of n > 1 waiting for their siblings
        self.choices = ChoiceGathering(self)  # the choices of n > 1 waiting for each other
        self.arrivals = 0
        self.inflight: InFlight | None = None
        self.publish: Callable[[], None] = lambda: None
        # Performs a job's command (`adapters.mlx.performer.Performer.perform`, set by the engine)
        self.perform: Callable[[Job[Any]], Any] = lambda job: None
        self.cache_bytes: Callable[[list[Any]], int] = lambda cache: 0
        self.running: Job[Any] | None = None  # the job being computed now
        self.cost = KvCost(0, 0, 0)
        self.pool_reserved = 0  # bytes the slot pool may grow to, set aside from the KV budget
        self.idle = False  # waiting for a job with nothing live (the watchdog's "not stalled")
        self.progress_at = time.monotonic()  # the last finished job or step
        self.step_retries = 0  # model calls computed again after one raised
        self.rows_isolated = 0  # requests failed alone because their row's model call kept raising
        self.shape: ModelShape | None = None  # what a step's activations grow with (set at load)
        self.prefill_capped_steps = 0  # steps whose planned prefill was cut to fit the memory budget
        self.activation_overruns = 0  # steps estimated over the budget (the oldest prompt's unit alone)
        self.activation_peak = 0  # the largest estimate of one step's activations so far (capped steps)
        # Tests only (--inject-fault model_call_*): runs before each model call with the request
        # ids it computes, inside the model's call, and may raise.
        self.model_call_hook: Callable[[str, Sequence[str]], None] | None = None
        self.computing: tuple[str, Sequence[str]] = ("", ())  # (stage, request ids) of the next call
        self.profile: dict[str, tuple[int, float]] = {
            kind: (0, 0.0) for kind in ("step", "decode_build", "decode_rows", "prefill_chunks",
                                        "prefill_batched", "launch", "readback", "other_job")
        }
        self.slow_steps: deque[SlowStep] = deque(maxlen=_SLOW_STEPS_KEPT)  # the latest slow steps
        # A handed-off request joined since the last step, or one whose last piece has arrived
        # (by request id: when, time.monotonic(); set and cleared by the engine in trio): steps
        # decode only meanwhile, so that its second token waits for no prefill work (on a decode
        # node that prefills some prompts itself, one step of that can be many decode steps
        # long, and a step launched before the join still runs when the request joins)
        self.handoff_joined = False
        self.handoffs_coming: dict[str, float] = {}
        self.rates = StepRates()  # what this node's steps took: what the step-time target sizes by
        self.conversations_kept = 0  # finished requests whose conversation's chunks were kept
        self.conversation_tokens_kept = 0  # tokens of whole chunks those keep tasks computed
        self.speculator: Speculator | None = None  # speculative decoding, when on (set at load)
        self.draft_model: DraftModel | None = None  # --draft-model (set at load, before configure)

    # -- configuration (after the model is loaded) ---------------------------------------------

    @property
    def step_room(self) -> int:
        """What a step's budget leaves beside a full batch: the most one step's prefill may be."""
        return self.settings.max_num_batched_tokens - self.settings.max_batch

    @property
    def unit_tokens(self) -> int:
        """The most one prefill work unit may be worth (finer under a step-time target, on a node
        whose streams it protects)."""
        s = self.settings
        return work_unit_tokens(s.max_num_batched_tokens, s.max_batch, s.prefill_chunk_size, self.layers,
                                timed=s.step_target_ms != 0 and s.decodes_locally and not self.pipelined)

    def plain(self, cache: list[Any]) -> bool:
        """A model whose every layer is a plain KVCache (without kv_bits): the slot layout's. Never
        on a pipeline rank: its layers' classes are not the whole model's, and every rank must
        choose the same lanes (it decodes in the batch lane, without a prefix cache)."""
        return (self.settings.kv_bits is None and not self.pipelined
                and all(type(c) is KVCache for c in cache))

    def call_hook(self) -> None:
        """The test hook of a model call, for the traced step (whose model code does not run)."""
        if self.model_call_hook is not None:
            self.model_call_hook(*self.computing)

    # -- KV memory -----------------------------------------------------------------------------

    def admit(self, request_id: str, need: int, tokens: int) -> int:
        """Make room for `need` bytes of the request's own KV cache (replacing what its record
        reserves) and return it for the caller to put on the record, or raise: OVERLOADED when it
        fits once others leave, KV_MEMORY_EXCEEDED when it never fits. Kept prefixes, then keep
        tasks, give way to it, as far as it needs, and only when that makes it fit: a request
        refused anyway takes nothing from them."""
        budget = self.settings.kv_memory_bytes
        others = self.reserved_bytes - self.requests.reserved_by(request_id)
        verdict = kv_admission(need, others, self.pool_reserved, budget)  # every kept block gone
        if verdict is KvAdmission.LATER:
            keeping = sum(record.reserved for record in self.requests.in_phase(EnginePhase.KEEPING))
            if kv_admission(need, others - keeping, self.pool_reserved, budget) is KvAdmission.FITS:
                self.drop_keep_tasks()
                others = self.reserved_bytes - self.requests.reserved_by(request_id)
                verdict = KvAdmission.FITS
        if verdict is KvAdmission.FITS and self.prefix is not None:
            self.prefix.evict(need + others + self.pool_reserved + self.prefix.nbytes - budget)
        if verdict is KvAdmission.NEVER:
            raise self.never_fits(need, tokens)
        if verdict is KvAdmission.LATER:
            raise StatecoreError(ErrorInfo(
                Fault.OVERLOADED, Code.OVERLOADED,
                f"KV memory is taken by live requests ({others:,} of {budget - self.pool_reserved:,} "
                f"bytes); this one needs {need:,}: try again shortly",
            ))
        return need

    def prefix_room(self) -> int:
        """What the KV budget leaves beside requests' reservations, the slot pool's share and the
        kept prefix blocks: the most host blocks coming back may add (adapters.mlx.prefix_cache)."""
        kept = 0 if self.prefix is None else self.prefix.nbytes
        return self.settings.kv_memory_bytes - self.reserved_bytes - self.pool_reserved - kept

    def prefill_reservation(self, prompt_tokens: int, max_tokens: int) -> tuple[int, int]:
        """(bytes, tokens) a new prompt reserves: its own cache, and on a node that decodes it,
        the whole request's when it will decode outside the slot layout (a slot is set aside)."""
        total = prompt_tokens + max_tokens
        fits_a_slot = self.pool is not None and total + 2 <= self.pool.max_capacity
        if self.settings.decodes_locally and not fits_a_slot:
            return self.cost.of(total), total
        return self.cost.of(prompt_tokens), prompt_tokens

    def never_fits(self, need: int, tokens: int) -> StatecoreError:
        budget = self.settings.kv_memory_bytes
        aside = f", {self.pool_reserved:,} set aside for the slot layout" if self.pool_reserved else ""
        return StatecoreError(ErrorInfo(
            Fault.CLIENT, Code.KV_MEMORY_EXCEEDED,
            f"this request's KV cache ({tokens} tokens) needs up to {need:,} bytes; this node's KV "
            f"budget is {budget:,} bytes (--kv-memory-bytes){aside}: ask for fewer tokens",
        ))

    @property
    def reserved(self) -> dict[str, int]:
        """Each request's own KV bytes (outside the slot pool): a view of the records."""
        return self.requests.reserved

    @property
    def reserved_bytes(self) -> int:
        return self.requests.reserved_bytes

    def unreserve(self, request_id: str) -> None:
        self.requests.unreserve(request_id)

    def forget(self, request_id: str) -> None:
        """A request leaves the engine (its prefill failed or was given up, a keep task is done or
        dropped): its record, and with it its reservation, goes."""
        self.requests.remove(request_id)

    def quantize(self, cache: list[Any]) -> None:
        if self.settings.kv_bits is None:
            return
        maybe_quantize_kv_cache(  # type: ignore[no-untyped-call]
            cache, quantized_kv_start=0, kv_group_size=self.settings.kv_group_size,
            kv_bits=self.settings.kv_bits,
        )

    # -- the loop ------------------------------------------------------------------------------

    def take_jobs(self, *, wait: bool, timeout: float | None) -> list[Job[Any] | Stop | Crash]:
        """Every job queued now; with `wait` (nothing to compute), first the next one to come, or
        none after `timeout` seconds (None: as long as it takes)."""
        jobs: list[Job[Any] | Stop | Crash] = []
        if wait:
            self.idle = True
            with contextlib.suppress(queue.Empty):
                jobs.append(self.queue.get(timeout=timeout))
            # progress_at before idle: a reader that sees busy also sees a fresh start time.
            self.progress_at = time.monotonic()
            self.idle = False
        while True:
            try:
                jobs.append(self.queue.get_nowait())
            except queue.Empty:
                return jobs

    def run(self) -> None:
        while True:
            busy = bool(len(self.live) > len(self.gathering) or self.waiting or self.inflight)
            # Choices waiting for each other wake the loop when their patience ends.
            jobs = self.take_jobs(wait=not busy, timeout=self.choices.timeout())
            for job in jobs:
                if isinstance(job, Stop):
                    return
                if isinstance(job, Crash):
                    raise InjectedCrash("device loop crash injected by a test")
                self.run_job(job)
                self.progress_at = time.monotonic()
            self.step()
            self.progress_at = time.monotonic()

    def handoff_imminent(self) -> bool:
        """A handed-off request's last piece arrived within HANDOFF_COMING_S: it joins any moment."""
        now = time.monotonic()
        return any(now - since < HANDOFF_COMING_S for since in list(self.handoffs_coming.values()))

    def stalled_s(self) -> float:
        """Seconds the loop has been busy without finishing a job or a step (0 while it waits
        for work). Read from any thread: the watchdog's one input."""
        if self.idle:
            return 0.0
        return max(0.0, time.monotonic() - self.progress_at)

    def run_job(self, job: Job[Any]) -> None:
        if job.is_abandoned():
            return
        self.compute_job(job)

    def compute_job(self, job: Job[Any]) -> None:
        started = time.perf_counter()
        self.running = job
        try:
            value = self.perform(job)
        except Exception as exc:
            if not isinstance(exc, StatecoreError):
                logger.exception("device job failed")
            self.finish(job, Outcome(error=as_statecore(exc)))
        else:
            if not job.deferred:
                self.finish(job, Outcome(value=value))
        finally:
            self.running = None
        self.account("other_job", started)

    def finish(self, job: Job[Any], result: Outcome[Any]) -> None:
        """Hand a computed job its outcome, or undo it when its caller is gone."""
        with job.lock:
            job.outcome = result
            abandoned = job.abandoned
        if abandoned:
            if result.error is None and job.undo is not None:
                self.undo_abandoned(job)
            return
        if job.done is not None:
            post(job.token, job.done.set)

    def undo_abandoned(self, job: Job[Any]) -> None:
        """Perform the undo of a job whose caller left after it ran (a cancel, now)."""
        assert job.undo is not None
        try:
            self.perform(Job(job.undo, None))
        except Exception:
            logger.exception("undoing an abandoned job failed")

    def drop_abandoned_waiting(self) -> None:
        """Prompts whose caller left before their prefill finished stop taking steps."""
        for rid in [rid for rid, task in self.waiting.items()
                    if not task.keeps_only and task.job.is_abandoned()]:
            self.forget(rid)

    def account(self, what: str, started: float, calls: int = 1) -> None:
        calls_before, seconds = self.profile[what]
        self.profile[what] = (calls_before + calls, seconds + time.perf_counter() - started)

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> None:
        """Build and start this step, then read back the previous one; while a handed-off
        request is about to join, read the previous one back first (`settle`)."""
        if self.inflight is not None and self.handoff_imminent():
            self.settle()
            return
        started = time.perf_counter()
        spent_before = {kind: seconds for kind, (_, seconds) in self.profile.items()}
        traces_before = 0 if self.compiled is None else self.compiled.traces
        self.drop_abandoned_waiting()
        current = InFlight()
        outputs: list[Any] = []
        slot_rows = [live for live in self.live.values() if live.slot is not None]
        if self.speculator is not None and slot_rows:  # a verify step may decode them instead
            slot_rows = self.speculator.step(self, slot_rows)
        with mx.stream(generation_stream):
            if slot_rows:
                building = time.perf_counter()
                try:
                    slot_step = self.slots.build(slot_rows)
                    current.tokens, current.owners = slot_step.tokens, slot_step.owners
                    current.logprobs = slot_step.logprobs
                    outputs.extend(slot_step.outputs)
                except Exception as exc:
                    self.fail_rows(slot_rows, exc)
                    current = InFlight()
                self.account("decode_build", building)
                calls, _ = self.profile["decode_rows"]
                self.profile["decode_rows"] = (calls + len(slot_rows), 0.0)
            plan = self.schedule()
            current.prefill_tokens = plan.prefill_tokens
            outputs.extend(self.build_prefills(plan, current))
            self.computing = ("", ())
            if outputs:
                launching = time.perf_counter()
                mx.async_eval(outputs)  # type: ignore[no-untyped-call]
                self.account("launch", launching)
        built = bool(outputs) or bool(current.failed_prefills)
        previous, self.inflight = self.inflight, (current if built else None)
        if previous is not None:
            self.read_back(previous)
        # Lanes that evaluate on their own: the batch lane, then the solo requests.
        self.choices.release()
        if len(self.batch):
            self.batch.step()
        for live in self.solo.step([live for live in self.live.values() if live.solo_cache is not None]):
            assert live.solo_cache is not None
            self.batch.insert(live, live.solo_cache)  # its one solo step after a split is done
        waited_for = [] if previous is None else [previous]  # the steps this one's time is the device's for
        if built and not self.live and not self.waiting:
            # Nothing else will come: read this step back now rather than on the next one.
            self.inflight = None
            self.read_back(current)
            waited_for.append(current)
        self.account("step", started)
        elapsed = time.perf_counter() - started
        if waited_for or (not built and self.live):
            # A step's time is the device's for the step read back in it (its launch waits for the
            # one before, its read-back for the rest); a step that built nothing (the lanes that
            # evaluate on their own) is a step without prefill.
            self.rates = measured_step(self.rates, elapsed, sum(step.prefill_tokens for step in waited_for))
        if elapsed >= SLOW_STEP_S:
            self.note_slow_step(elapsed, len(slot_rows), len(plan.prefills), spent_before, traces_before)
        self.publish()

    def settle(self) -> None:
        """Read the step on the device back before the next is built: the install of a request
        whose last piece is arriving (a job) then comes before that next step, so the request's
        second token is one step sooner, at the price of the host's build no longer overlapping
        the device for the few steps until it joins."""
        previous, self.inflight = self.inflight, None
        assert previous is not None
        self.read_back(previous)
        self.publish()

    def note_slow_step(self, elapsed: float, rows: int, units: int, spent_before: dict[str, float],
                       traces_before: int) -> None:
        parts = sorted(((kind, seconds - spent_before[kind]) for kind, (_, seconds) in self.profile.items()
                        if kind not in ("step", "decode_rows") and seconds > spent_before[kind]),
                       key=lambda part: -part[1])
        traces = 0 if self.compiled is None else self.compiled.traces - traces_before
        self.slow_steps.append(SlowStep(time.time(), elapsed, rows, units, traces, tuple(parts)))
        where = ", ".join(f"{kind} {seconds * 1000:.0f} ms" for kind, seconds in parts)
        logger.debug("slow step: %.0f ms, %d decode rows, %d prefill units, %d new traces, %s",
                     elapsed * 1000, rows, units, traces, where)

    def twice(self, call: Callable[[], _T], undo: Callable[[], None], what: str) -> _T:
        """`call()`; if it raises, undo what it changed and call once more (a transient error
        costs a retry, not a request). A second raise is undone too, then raised."""
        try:
            return call()
        except Exception as exc:
            self.step_retries += 1
            logger.warning("%s raised (%s: %s); computing it again", what, type(exc).__name__, exc)
            undo()
        try:
            return call()
        except Exception:
            undo()
            raise

    def fail_alone(self, live: Live, raised: Exception, deliveries: dict[trio.lowlevel.TrioToken, list[Any]]
                   ) -> None:
        """End a request whose own row's decode step kept raising."""
        self.rows_isolated += 1
        logger.error("request %s fails alone: its decode step raised %s: %s",
                     live.request_id, type(raised).__name__, raised)
        error = engine_failed(f"a decode step failed for this request: {type(raised).__name__}: {raised}")
        self.end(live, error, deliveries)

    def schedule(self) -> StepPlan:
        """This step's plan (`statecore.engine_schedule.schedule`) from the records as they are."""
        s = self.settings
        for task in self.waiting.values():
            self.look_again(task)  # blocks built since it arrived: the plan sees what is left
        # A choice of n > 1 never shares a padded call: whether its siblings' prefills wait beside
        # it is a matter of timing, and the rows of a padded call differ from a prompt's own call
        # in their last bits (OpenBLAS); alone, a choice prefills as on any other node.
        candidates = [Candidate(task.request_id, task.order, len(task.tokens), task.chunks, task.units,
                                task.done_units, self.short_batching and task.is_short
                                and task.sampler.sampling.choices == 1, task.keeps_only)
                      for task in self.waiting.values()]
        target_ms = s.step_target_ms
        budget = Budget(s.max_num_batched_tokens, s.prefill_batch,
                        None if target_ms is None else target_ms / 1000, self.rates,
                        decode_only=self.handoff_joined or self.handoff_imminent(),
                        streamed_alone=len(self.waiting) == 1 and all(
                            task.segment_sink is not None for task in self.waiting.values()))
        self.handoff_joined = False
        memory = None
        if s.prefill_memory_cap:
            assert self.shape is not None
            memory = Memory(s.kv_memory_bytes, 0 if self.pool is None else self.pool.nbytes,
                            self.reserved_bytes, 0 if self.prefix is None else self.prefix.nbytes, self.shape,
                            max((live.limit for live in self.live.values()), default=1), self.cost.per_token,
                            ALLOCATION_STEP)
        return schedule(len(self.live), candidates, budget, max_padding=s.max_padding, bucket=self.bucket,
                        memory=memory)

    def apply_memory_plan(self, plan: StepPlan) -> None:
        """What the plan frees for its prefill (keep tasks, kept prefix blocks), and its counts."""
        for request_id in plan.dropped_keeps:
            self.forget(request_id)
        if plan.evict_prefix_bytes and self.prefix is not None:
            self.prefix.evict(plan.evict_prefix_bytes)
        if plan.activation_estimate is None:
            return
        if plan.capped:
            self.prefill_capped_steps += 1
        if plan.over_budget:
            if not self.activation_overruns:
                logger.warning("a step's activations are estimated at %d bytes: beside the KV held, over "
                               "the budget of %d bytes (the oldest prompt's prefill runs alone); "
                               "counted in activation_overruns", plan.activation_estimate,
                               self.settings.kv_memory_bytes)
            self.activation_overruns += 1
        self.activation_peak = max(self.activation_peak, plan.activation_estimate)

    def build_prefills(self, plan: StepPlan, current: InFlight) -> list[Any]:
        """Build the plan's prefill calls: its padded groups, then each prompt's units."""
        started = time.perf_counter()
        outputs = _StepOutputs(self.pipelined)
        self.apply_memory_plan(plan)
        tasks = [(self.waiting[work.request_id], work.units) for work in plan.prefills]
        groups = [[self.waiting[rid] for rid in group] for group in plan.groups]
        for members in groups:
            self.computing = ("prefill", [task.request_id for task in members])
            try:
                run_short_batch(self.model, members, self.bucket)
            except Exception:
                # One prompt must not fail its neighbours: they run alone below.
                logger.exception("a batched prefill of %d prompts failed; running them alone",
                                 len(members))
                self.step_retries += 1
                for task in members:
                    self.restart(task)
                continue
            self.account("prefill_batched", started, len(members))
            for task in members:
                outputs.extend(self.capture_segments(task, current))
                outputs.extend(self.prefill_outputs(task, current))
        for task, units in tasks:
            if task.finished:
                continue
            if self.look_again(task):  # blocks built earlier in this step
                units = min(units, len(task.units) - task.done_units)
            self.computing = ("prefill", [task.request_id])
            try:
                pieces = run_units(self.model, task, units, self.quantize, self.bucket,
                                   None if self.prefix is None else self.keep_chunk)
            except Exception as exc:
                if task.keeps_only:  # nobody waits for it: the conversation is just not kept
                    logger.warning("keeping %s raised (%s: %s); not kept", task.request_id,
                                   type(exc).__name__, exc)
                    self.forget(task.request_id)
                    continue
                if not task.retried and not isinstance(exc, StatecoreError):
                    # Once more from its first token, in a later step: prefill is a pure function
                    # of the prompt, so a transient error costs time, not the request.
                    self.step_retries += 1
                    logger.warning("prefill of %s raised (%s: %s); starting it again",
                                   task.request_id, type(exc).__name__, exc)
                    self.restart(task)
                    continue
                logger.exception("prefill failed for %s", task.request_id)
                self.forget(task.request_id)
                self.choices.ended(task.sampler.sampling)
                current.failed_prefills.append((task, as_statecore(exc)))
                continue
            outputs.extend(self.capture_segments(task, current))
            if task.finished and task.keeps_only:
                self.forget(task.request_id)  # its kept blocks are among the pieces
                outputs.extend(pieces)
            elif task.finished:
                outputs.extend(self.prefill_outputs(task, current))
            else:
                if not task.keeps_only:
                    self.requests[task.request_id].phase = EnginePhase.PREFILLING
                outputs.extend(pieces)
        self.account("prefill_chunks", started)
        return outputs.arrays

    def capture_segments(self, task: PrefillTask, current: InFlight) -> list[Any]:
        """A streamed handoff's pieces whose KV this step completes: per chunk, the layers of the
        units built since the last capture, cut out as their own arrays (evaluated with the step,
        handed to the sink when it is read back), in pieces of at most STREAMED_PIECE_BYTES
        (`statecore.scheduling.streamed_pieces`). Cached leading chunks go in the first capture."""
        if task.segment_sink is None or task.cache is None or task.streamed_units >= task.done_units:
            return []
        arrays: list[Any] = []
        units = task.units[task.streamed_units : task.done_units]
        ranges: list[tuple[int, int, int, int]] = []
        for chunk in sorted({unit.chunk for unit in units}):
            mine = [unit for unit in units if unit.chunk == chunk]
            first, end = mine[0].first_layer, mine[-1].end_layer
            start = task.chunk_start(chunk)
            stop = start + task.chunks[chunk]
            if ranges and ranges[-1][1] == start and ranges[-1][2:] == (first, end):
                start = ranges.pop()[0]  # the chunks of one step go as one piece when they can
            ranges.append((start, stop, first, end))
        keys, values = task.cache[0].keys, task.cache[0].values
        layer_token_bytes = (keys.shape[1] * keys.shape[3] * keys.dtype.size
                             + values.shape[1] * values.shape[3] * values.dtype.size)
        for where in [piece for step_range in ranges
                      for piece in streamed_pieces(*step_range, layer_token_bytes=layer_token_bytes,
                                                   most_bytes=STREAMED_PIECE_BYTES)]:
            start, stop, first, end = where
            pieces = [mx.contiguous(buffer[..., start:stop, :]) for layer in task.cache[first:end]
                      for buffer in (layer.keys, layer.values)]
            current.segments.append((task, where, pieces))
            arrays.extend(pieces)
        task.streamed_units = task.done_units
        return arrays

    def hand_segments(self, step: InFlight) -> None:
        """A read-back step's streamed pieces to their sinks (computed now), unless the request
        left meanwhile."""
        for task, where, pieces in step.segments:
            if task.job is None or task.job.is_abandoned():
                continue
            try:
                task.segment_sink(where, pieces)
            except Exception:  # the sink's failure is its request's (it hears of it at export)
                logger.exception("handing a KV segment of %s out failed", task.request_id)
                task.segment_sink = None

    def keep_chunk(self, task: PrefillTask, chunk: int) -> list[Any]:
        """A whole chunk just built: into the prefix cache."""
        assert self.prefix is not None and task.cache is not None
        start = task.chunk_start(chunk)
        return self.prefix.keep(task.block_keys, chunk, task.cache, start, start + task.chunks[chunk])

    def forget_prefixes(self) -> None:
        """Empty the prefix cache, counters included (after the load's warm-up request)."""
        self.drop_keep_tasks()
        self.conversations_kept = self.conversation_tokens_kept = 0
        if self.prefix is not None:
            self.prefix = self.prefix.emptied()

    def forget_activation_counts(self) -> None:
        """The prefill memory cap's counters back to 0 (after the load's warm-up request): they
        count serving traffic."""
        self.prefill_capped_steps = self.activation_overruns = self.activation_peak = 0

    def keep_conversation(self, live: Live) -> None:
        """A request ended normally: queue the keep task of its conversation's whole chunks (when
        its prompt's blocks are cached and the memory is free now; else nothing is kept)."""
        prefix, conversation = self.prefix, live.conversation
        if prefix is None or conversation is None:
            return
        chunk, ends = self.settings.prefill_chunk_size, self.block_ends
        bounds = conversation_block_bounds(conversation, chunk, ends)
        keys = prefix.conversation_keys_of(conversation)
        cached = prefix.index.cached(keys)
        own_blocks = len(block_bounds(conversation[: live.prompt_tokens], chunk, ends))
        blocks = conversation_block_range(own_blocks, len(bounds), cached)
        keep_id = f"{live.request_id}#keep"
        if not blocks or keep_id in self.waiting:
            return
        tokens = conversation[: bounds[blocks.stop - 1]]
        need = self.cost.of(len(tokens))
        fits = kv_admission(need, self.reserved_bytes + prefix.nbytes, self.pool_reserved,
                            self.settings.kv_memory_bytes)
        if fits is not KvAdmission.FITS:
            return
        chunks = tuple(end - start for start, end in zip([0, *bounds], bounds[: blocks.stop], strict=False))
        self.arrivals += 1
        sampler = PositionSampler(SamplingParams(max_tokens=1), 0, len(tokens), tokens)
        task = PrefillTask(keep_id, tokens, sampler, _KEEP_AFTER + self.arrivals, chunks,
                           prefill_units(chunks, self.layers, self.unit_tokens), keeps_only=True)
        task.block_keys = keys[: blocks.stop]
        count, cache = prefix.start(task.block_keys, counted=False)
        if cache is not None:
            task.cache = cache
            task.done_tokens = cache[0].offset
            task.done_units = next(i for i, unit in enumerate(task.units) if unit.chunk == count)
        self.requests.add(EngineRequest(keep_id, EnginePhase.KEEPING, reserved=need, task=task))
        self.conversations_kept += 1
        self.conversation_tokens_kept += len(tokens) - task.done_tokens

    def drop_keep_tasks(self) -> bool:
        """Forget every keep task not yet done (admission needs their memory); whether any was."""
        dropped = [rid for rid, task in self.waiting.items() if task.keeps_only]
        for rid in dropped:
            self.forget(rid)
        return bool(dropped)

    def keep_installed(self, tokens: Sequence[int], cache: list[Any]) -> None:
        """A handed-off prompt's whole chunks into the prefix cache, as they arrived. Only prompts
        of more than one chunk before their last token: a prefill node may compute a shorter one
        in a padded batch, whose numbers are not the chunk call's."""
        prefix = self.prefix
        chunk = self.settings.prefill_chunk_size
        if prefix is None or not self.settings.keep_conversations or len(tokens) - 1 <= chunk:
            return
        if not self.plain(cache):
            return
        keys = prefix.keys_of(tokens)
        bounds = block_bounds(tokens, chunk, self.block_ends)
        kept: list[Any] = []
        for index, (start, end) in enumerate(zip([0, *bounds], bounds, strict=False)):
            kept.extend(prefix.keep(keys, index, cache, start, end))
        if kept:
            mx.eval(kept)  # copies now: the installed cache itself goes on into a slot

    def keep_imported(self, tokens: Sequence[int], cache: list[Any]) -> int:
        """Another node's prefix-cache blocks covering `tokens` (whole chunks, computed as chunks
        there: the same fingerprint) into this prefix cache; the leading tokens now cached. Unlike
        `keep_installed` it needs neither a long prompt nor `keep_conversations`: these are kept
        blocks, never a padded batch's numbers."""
        prefix = self.prefix
        if prefix is None or not self.plain(cache):
            return 0
        keys = prefix.conversation_keys_of(tokens)
        bounds = conversation_block_bounds(tokens, prefix.chunk_size, prefix.ends)
        kept: list[Any] = []
        for index, (start, end) in enumerate(zip([0, *bounds], bounds, strict=False)):
            kept.extend(prefix.keep(keys, index, cache, start, end))
        if kept:
            mx.eval(kept)  # copies now, so the imported cache can go
        count = prefix.index.cached(keys)
        return bounds[count - 1] if count else 0

    def touch_prefix(self, tokens: Sequence[int]) -> list[bytes]:
        """The prompt's block keys, its cached leading blocks made the most recently used: called
        before its admission, whose eviction then takes other prompts' blocks before its own."""
        if self.prefix is None:
            return []
        keys = self.prefix.keys_of(tokens)
        self.prefix.index.cached(keys)
        return keys

    def start_from_prefix(self, task: PrefillTask, keys: list[bytes], again: bool = False) -> None:
        """A new prompt whose first whole chunks are cached starts after them (`keys`: its block
        keys, from `touch_prefix`). `again`: a prompt that found none at arrival and has not
        started, looked up once more as its first unit is built: a prompt that came with others
        starting the same way (a shared system prompt) finds the blocks the first of them has
        computed since, in an earlier step or earlier in this one."""
        if self.prefix is None:
            return
        task.block_keys = keys
        count, cache = self.prefix.start(task.block_keys, again=again)
        if cache is None:
            return
        task.cache = cache
        task.done_tokens = task.cached_tokens = cache[0].offset
        task.done_units = next(i for i, unit in enumerate(task.units) if unit.chunk == count)

    def look_again(self, task: PrefillTask) -> bool:
        """A prompt that found no kept blocks at arrival and has not started looks again: prompts
        that came together with one system prompt start after the blocks the first of them has
        built since. Whether it starts later now."""
        if task.done_units or not task.block_keys or task.retried or task.keeps_only:
            return False
        self.start_from_prefix(task, task.block_keys, again=True)
        return task.done_units > 0

    def slot_tokens_in_flight(self) -> bool:
        return self.inflight is not None and self.inflight.tokens is not None

    def read_back_now(self) -> None:
        previous, self.inflight = self.inflight, None
        if previous is not None:
            self.read_back(previous)

    def slot_inputs_on_host(self) -> None:
        self.slots.last_tokens = None

    def fail_rows(self, rows: list[Live], exc: Exception) -> None:
        """A step that could not be built fails its rows only; the loop goes on."""
        logger.exception("a decode step failed for %d requests", len(rows))
        error = engine_failed(f"a decode step failed: {type(exc).__name__}: {exc}")
        deliveries: dict[trio.lowlevel.TrioToken, list[Any]] = {}
        for live in rows:
            self.end(live, error, deliveries)
        self.slots.last_tokens = None
        self.hand_out(deliveries)

    def prefill_outputs(self, task: PrefillTask, current: InFlight) -> list[Any]:
        self.requests[task.request_id].phase = EnginePhase.PREFILLED
        current.finished_prefills.append(task)
        assert task.cache is not None
        return [task.first, *(c.state for c in task.cache)]

    def read_back(self, step: InFlight) -> None:
        """Wait for a step's results and hand them out (tokens, first tokens, failures)."""
        started = time.perf_counter()
        deliveries: dict[trio.lowlevel.TrioToken, list[Any]] = {}
        finished: list[tuple[PrefillTask, Outcome[Any]]] = []
        try:
            tokens: list[int] = step.tokens.tolist() if step.tokens is not None else []
            firsts = [int(task.first.item()) for task in step.finished_prefills]
        except Exception as exc:
            logger.exception("a step failed on the device; failing its requests")
            error = engine_failed(f"a decode step failed: {type(exc).__name__}: {exc}")
            for owner in step.owners:
                if owner is not None and self.live.get(owner.request_id) is owner:
                    self.end(owner, error, deliveries)
            finished.extend((task, Outcome(error=error)) for task in step.finished_prefills)
            for task in step.finished_prefills:
                record = self.requests.get(task.request_id)
                if record is not None and record.task is task:
                    self.forget(task.request_id)
            self.slots.last_tokens = None
        else:
            self.hand_segments(step)  # before the prefills' outcomes: the pieces go out first
            for slot, (owner, token) in enumerate(zip(step.owners, tokens, strict=False)):
                if owner is None or self.live.get(owner.request_id) is not owner:
                    continue  # a free slot's row, or a request that ended meanwhile
                owner.last_token = token
                item = self.count_token(owner, token, read_logprobs(step.logprobs.get(slot)))
                self.hand_token(owner, item, deliveries)
            for task, first in zip(step.finished_prefills, firsts, strict=True):
                assert task.cache is not None
                nbytes = self.cache_bytes(task.cache)
                self.requests.hold(task.request_id, Held(task.cache, len(task.tokens), nbytes,
                                                         task.sampler.sampling))
                logprobs = read_logprobs(task.sampler.take_logprobs())
                outcome = PrefillOutcome(first, len(task.tokens), nbytes, logprobs, task.cached_tokens,
                                         streamed=task.segment_sink is not None)
                finished.append((task, Outcome(value=outcome)))
        finished.extend((task, Outcome(error=error)) for task, error in step.failed_prefills)
        self.account("readback", started)
        self.hand_out(deliveries, finished)

    def hand_out(self, deliveries: dict[trio.lowlevel.TrioToken, list[Any]],
                 finished: list[tuple[PrefillTask, Outcome[Any]]] = ()) -> None:  # type: ignore[assignment]
        """Publish the statistics first, so that a caller woken by its result sees them."""
        self.publish()
        for task, outcome in finished:
            self.finish(task.job, outcome)
        for trio_token, items in deliveries.items():
            post(trio_token, deliver, items)

    def count_token(self, live: Live, token: int, logprobs: TokenLogprobs | None = None) -> GeneratedToken:
        """Count one token; how it ends the request is `statecore.policy.token_finish`'s."""
        live.remaining -= 1
        if self.speculator is not None:
            self.speculator.took(live, token)
        if live.conversation is not None:
            live.conversation.append(token)
        finish = token_finish(token, self.eos, ignore_eos=live.sampler.sampling.ignore_eos,
                              remaining=live.remaining)
        return GeneratedToken(token, is_eos=finish == STOP, finish_reason=finish, logprobs=logprobs)

    def hand_token(self, live: Live, item: GeneratedToken,
                   deliveries: dict[trio.lowlevel.TrioToken, list[Any]]) -> bool:
        """Give a request its next token; its last one ends it (True then)."""
        if item.finish_reason is not None:
            self.end(live, item, deliveries)
            return True
        deliveries.setdefault(live.token, []).append((live.send, item, False))
        return False

    def end(self, live: Live, item: StreamItem,
            deliveries: dict[trio.lowlevel.TrioToken, list[Any]]) -> None:
        """A request leaves the decoder with its last item (its conversation is kept when that
        item ends it normally)."""
        self.remove(live)
        if isinstance(item, GeneratedToken) and self.model is not None:
            self.keep_conversation(live)
        deliveries.setdefault(live.token, []).append((live.send, item, True))

    def remove(self, live: Live) -> None:
        record = self.requests.get(live.request_id)
        if record is not None and record.live is live:
            self.requests.remove(live.request_id)  # its reservation with it
            if self.speculator is not None:
                self.speculator.left(live.request_id)
            self.choices.left(live, record)
        self.slots.leave(live)
        self.batch.remove(live)

    def restart(self, task: PrefillTask) -> None:
        """A prefill that raised starts again from its first chunk in a later step."""
        task.restart()
        record = self.requests.get(task.request_id)
        if record is not None and record.phase is EnginePhase.PREFILLING:
            record.phase = EnginePhase.WAITING

    # -- the other lanes -----------------------------------------------------------------------

    def lane_for(self, cache: list[Any], prompt_tokens: int, remaining: int, constrained: bool) -> str:
        """Where a request decodes (`statecore.engine_schedule.choose_lane`): "slot", "batch" or "solo"."""
        return choose_lane(plain_kv=all(type(c) is KVCache for c in cache),
                           needed_tokens=prompt_tokens + remaining + 2,
                           slot_capacity=None if self.pool is None else self.pool.max_capacity,
                           batchable=batchable(cache), constrained=constrained).value

    def join(self, live: Live, cache: list[Any], prompt: list[int], lane: str,
             reserved: int | None = None) -> None:
        """Put a request with its prompt's cache into `lane` (the caller checked capacity), its
        record reserving `reserved` bytes from now (None: what it reserves already); a choice of
        n > 1 bound for a batched lane waits for its siblings first (`adapters.mlx.choices`)."""
        if lane != "solo" and live.sampler.sampling.choices > 1 and self.choices.waits(live):
            record = self.requests.join(live, lane, (cache, prompt))
        else:
            self.enter(live, cache, prompt, lane)
            record = self.requests.join(live, lane, None)
        if reserved is not None:
            record.reserved = reserved
        if lane == "slot" and record.phase is EnginePhase.RUNNING:
            record.reserved = 0  # its KV lives in the pool now
        if self.choices.groups:
            self.choices.release()

    def enter(self, live: Live, cache: list[Any], prompt: list[int], lane: str) -> None:
        needed = len(prompt) + live.remaining + 2
        live.limit = needed
        if lane == "slot":
            self.slots.enter(live, cache, len(prompt), needed)
            if self.speculator is not None:
                self.speculator.joined(live, prompt)
        elif lane == "batch":
            self.batch.insert(live, cache)
        else:
            live.solo_cache = cache

    def overloaded(self) -> StatecoreError | None:
        """Whether one more request may decode: every one decoding, or staged for its slot,
        counts against --max-batch."""
        if len(self.live) + len(self.slots.staged) >= self.settings.max_batch:
            return StatecoreError(ErrorInfo(
                Fault.OVERLOADED, Code.OVERLOADED,
                f"{len(self.live)} requests are decoding and {len(self.slots.staged)} arriving "
                f"(max_batch {self.settings.max_batch})",
            ))
        return None

    def drop(self, request_id: str) -> None:
        """Cancel: leave the decoder and free everything held for the request. Idempotent."""
        self.slots.staged.unstage(self.pool, request_id)
        record = self.requests.get(request_id)
        if record is None:
            return
        if record.phase is EnginePhase.GATHERING or record.phase is EnginePhase.RUNNING:
            assert record.live is not None
            self.remove(record.live)
            post(record.live.token, deliver, [(record.live.send, None, True)])
            return
        self.requests.remove(request_id)
        if record.phase is EnginePhase.HELD:
            self.choices.ended(record.sampling)
        elif record.phase in (EnginePhase.WAITING, EnginePhase.PREFILLING):
            assert record.task is not None
            self.choices.ended(record.task.sampler.sampling)
            self.finish(record.task.job, Outcome(error=StatecoreError(ErrorInfo(
                Fault.CANCELLED, Code.CANCELLED, f"request {request_id!r} was cancelled"))))

    def die(self, error: StatecoreError) -> None:
        """Leave everything dead: fail the running and queued jobs, waiting prefills and live
        streams. Also called from trio when the watchdog abandons a stalled thread."""
        running = self.running
        if running is not None and running.done is not None:
            running.outcome = Outcome(error=error)
            post(running.token, running.done.set)
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, Job) and job.done is not None:
                job.outcome = Outcome(error=error)
                post(job.token, job.done.set)
        for task in self.waiting.values():
            if task.job is not None and task.job.done is not None:
                task.job.outcome = Outcome(error=error)
                post(task.job.token, task.job.done.set)
        for live in self.live.values():
            post(live.token, deliver, [(live.send, error, True)])
        self.requests.clear()
        self.choices.groups.clear()
        self.batch.clear()
        self.model = None
        self.pool = None
        self.slots.last_tokens = None
        self.inflight = None

