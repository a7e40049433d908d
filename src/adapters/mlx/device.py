"""The device loop: one thread that owns the model and every cache, and runs steps.

Each turn of the loop drains the job queue (`adapters.mlx.jobs.Inbox`: each job's command
performed; cancels, exports, joins take effect at once; new prompts queue as prefill tasks), then
runs one step
(`adapters.mlx.executor`: the pure scheduler's plan built, started with `mx.async_eval`, and the
previous step read back meanwhile). Building step N+1 and delivering step N's tokens overlap the
device computing step N; a row that ended in step N computes one throwaway token in step N+1.
The loop holds every request's record (`adapters.mlx.requests`), the lanes, and the parts that
act on them: KV admission (`adapters.mlx.admission`), prefix keeping (`adapters.mlx.keeping`),
the executor, the choices of n > 1 (`adapters.mlx.choices`), the time profile
(`adapters.mlx.profile`).

Lanes. Models whose every layer is a plain `KVCache` (without kv_bits) decode in the *slot lane*
(`adapters.mlx.slots`): preallocated per-row KV, joining and leaving move no other row. Other
batchable families decode in the *batch lane* (`adapters.mlx.batch_lane`: rotating, arrays/SSM,
`CacheList`, over the cache classes' public merge/extend/filter/extract), and caches that cannot
batch at all (quantized KV, llama4's chunked cache, custom classes) decode in the *solo lane*, one
generate_step-style call per request and step; so do requests under a grammar (`response_format`)
in families outside the slot lane. A row's numbers in a batched lane depend on the rows beside it
(the batch lane pads them to each other; a call's row count picks its kernels): the choices of
one request (n > 1) wait for each other and enter their lane in one step, in choice order
(`joining_choices`), which makes their bytes the same on every run and on every node. Prefill is
scheduled the same way for every family. A failing step fails the requests of that step only; an
exception escaping the loop itself kills the thread (the engine reports itself dead). This module
imports mlx, mlx_lm and trio (only for trio tokens); statecore and effects never import it.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import trio
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import KVCache

from adapters.mlx.admission import Admission
from adapters.mlx.batch_lane import BatchLane
from adapters.mlx.choices import ChoiceGathering
from adapters.mlx.compiled import CompiledSlotStep
from adapters.mlx.draft_model import DraftModel
from adapters.mlx.executor import StepExecutor
from adapters.mlx.jobs import (
    Crash,
    Inbox,
    Job,
    Outcome,
    Stop,
    StreamItem,
    deliver,
    engine_failed,
    post,
)
from adapters.mlx.keeping import PrefixKeeping
from adapters.mlx.memory import KvCost
from adapters.mlx.prefill import PrefillTask
from adapters.mlx.prefix_cache import PrefixCache
from adapters.mlx.profile import DeviceProfile
from adapters.mlx.requests import RequestTable
from adapters.mlx.rows import Live
from adapters.mlx.settings import Settings
from adapters.mlx.slot_lane import SlotLane
from adapters.mlx.slots import SlotPool
from adapters.mlx.solo_lane import SoloLane
from adapters.mlx.speculative import Speculator
from adapters.mlx.step_host import InFlight
from effects.engine_port import GeneratedToken
from statecore.engine_schedule import EnginePhase, Finish, Stacking
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.events import TokenLogprobs
from statecore.policy import token_finish
from statecore.prefix import ALL, MessageBlocks
from statecore.scheduling import ModelShape, StepRates, work_unit_tokens

__all__ = ["JOIN_ENV", "DeviceLoop", "InjectedCrash", "joins_early"]

logger = logging.getLogger("adapters.engine_mlx")

_T = TypeVar("_T")

# `STATECORE_JOIN=late` (environment, a decode node) joins a handed-off request as before, to
# compare: its prompt's chunks copied into the prefix cache on the step it joins, and on the CPU
# a step's slot rows read back after the other lanes have stepped.
JOIN_ENV: Final = "STATECORE_JOIN"


def joins_early() -> bool:
    """Whether a handed-off request's second token goes first (the default; see `JOIN_ENV`)."""
    return os.environ.get(JOIN_ENV, "early").strip().lower() != "late"


class InjectedCrash(Exception):
    """Raised outside any job by a Crash sentinel."""


class DeviceLoop:
    """All device-thread state. Only the device thread calls its methods (after `load`)."""

    def __init__(self, settings: Settings, queue_: queue.SimpleQueue[Job[Any] | Stop | Crash]) -> None:
        self.settings = settings
        self.inbox = Inbox(queue_)  # the jobs: taken, performed, finished (or undone), failed at death
        self.model: Any = None
        self.eos: frozenset[int] = frozenset()
        # after these tokens a prefill block ends early (statecore.prefix.block_bounds): the eos ids
        self.block_ends: frozenset[int] = frozenset()
        self.message_blocks: MessageBlocks = ALL  # ... by this rule (Settings.message_blocks)
        self.vocab_size = 0
        self.context_length = 0
        self.slot_lane = False
        self.streams_ranges = False  # plain KVCache layers: a handoff streams by token and layer range
        self.short_batching = False
        self.stacking: Stacking | None = None  # where prompts' calls share stacked calls (measured at load)
        self.bucket = 0  # the shape bucket in use (Settings.shape_bucket on plain KVCache models)
        self.layers = 1  # cache layers of the model: what a prefill work unit slices
        self.inner_points = 0  # ... and the points inside each that a unit may stop at (timed units)
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
        self.cache_bytes: Callable[[list[Any]], int] = lambda cache: 0
        self.cost = KvCost(0, 0, 0)
        self.pool_reserved = 0  # bytes the slot pool may grow to, set aside from the KV budget
        self.step_retries = 0  # model calls computed again after one raised
        self.rows_isolated = 0  # requests failed alone because their row's model call kept raising
        self.shape: ModelShape | None = None  # what a step's activations grow with (set at load)
        # Tests only (--inject-fault model_call_*): runs before each model call with the request
        # ids it computes, inside the model's call, and may raise.
        self.model_call_hook: Callable[[str, Sequence[str]], None] | None = None
        self.computing: tuple[str, Sequence[str]] = ("", ())  # (stage, request ids) of the next call
        self.profile = DeviceProfile()  # where the thread's time goes
        # A handed-off request joined since the last step, or one whose last piece has arrived
        # (by request id: when, time.monotonic(); set and cleared by the engine in trio): steps
        # decode only meanwhile, so that its second token waits for no prefill work (on a decode
        # node that prefills some prompts itself, one step of that can be many decode steps
        # long, and a step launched before the join still runs when the request joins)
        self.handoff_joined = False
        self.handoffs_coming: dict[str, float] = {}
        # ... and one whose prefill node has started the step computing its last pieces (the
        # stream's flag): no prefill work is started meanwhile either, but steps stay pipelined
        self.handoffs_expected: dict[str, float] = {}
        self.rates = StepRates()  # what this node's steps took: what the step-time target sizes by
        self.joins_early = joins_early()
        self.speculator: Speculator | None = None  # speculative decoding, when on (set at load)
        self.draft_model: DraftModel | None = None  # --draft-model (set at load, before configure)
        self.admission = Admission(self)  # whether a request's KV fits, and what gives way to it
        self.keeping = PrefixKeeping(self)  # what goes into the prefix cache; where prompts start from it
        self.executor = StepExecutor(self)  # a step: the plan built and started, the last one read back

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
                                timed=self.timed_units)

    @property
    def timed_units(self) -> bool:
        """Whether a step-time target sizes this node's steps: its units are as fine as the model allows."""
        s = self.settings
        return s.step_target_ms != 0 and s.decodes_locally and not self.pipelined

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

    def quantize(self, cache: list[Any]) -> None:
        if self.settings.kv_bits is None:
            return
        maybe_quantize_kv_cache(  # type: ignore[no-untyped-call]
            cache, quantized_kv_start=0, kv_group_size=self.settings.kv_group_size,
            kv_bits=self.settings.kv_bits,
        )

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        inbox = self.inbox
        while True:
            busy = bool(len(self.live) > len(self.gathering) or self.waiting or self.inflight)
            # Choices waiting for each other wake the loop when their patience ends.
            for job in inbox.take(wait=not busy, timeout=self.choices.timeout()):
                if isinstance(job, Stop):
                    return
                if isinstance(job, Crash):
                    raise InjectedCrash("device loop crash injected by a test")
                if not job.is_abandoned():
                    self.compute_job(job)
                inbox.progress_at = time.monotonic()
            self.executor.step()
            if self.keeping.due:
                self.keeping.keep_due()
            inbox.progress_at = time.monotonic()

    def compute_job(self, job: Job[Any]) -> None:
        started = time.perf_counter()
        self.inbox.compute(job)
        self.profile.account("other_job", started)

    def drop_abandoned_waiting(self) -> None:
        """Prompts whose caller left before their prefill finished stop taking steps."""
        for rid in [rid for rid, task in self.waiting.items()
                    if not task.keeps_only and task.job.is_abandoned()]:
            self.requests.remove(rid, Finish.CANCELLED)

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

    def slot_tokens_in_flight(self) -> bool:
        return self.inflight is not None and self.inflight.tokens is not None

    def read_back_now(self) -> None:
        previous, self.inflight = self.inflight, None
        if previous is not None:
            self.executor.read_back(previous)

    def slot_inputs_on_host(self) -> None:
        self.slots.last_tokens = None

    def staged_lost(self, error: StatecoreError) -> list[Live]:
        return self.slots.staged.lose(error)

    def hand_out(self, deliveries: dict[trio.lowlevel.TrioToken, list[Any]],
                 finished: list[tuple[PrefillTask, Outcome[Any]]] = ()) -> None:  # type: ignore[assignment]
        """Publish the statistics first, so that a caller woken by its result sees them."""
        self.publish()
        for task, outcome in finished:
            self.inbox.finish(task.job, outcome)
        for trio_token, items in deliveries.items():
            post(trio_token, deliver, items)

    def count_token(self, live: Live, token: int, logprobs: TokenLogprobs | None = None) -> GeneratedToken:
        """Count one token; how it ends the request is `statecore.policy.token_finish`'s."""
        live.remaining -= 1
        self.slots.read_back(live)  # its slot can no longer be written in again as it joined
        if live.keep_prompt is not None:
            self.keeping.due.append(live)
        if self.speculator is not None:
            self.speculator.took(live, token)
        if live.conversation is not None:
            live.conversation.append(token)
        finish = token_finish(token, self.eos, ignore_eos=live.sampler.sampling.ignore_eos,
                              remaining=live.remaining)
        return GeneratedToken(token, finish_reason=finish, logprobs=logprobs)

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
        finish = Finish.FAILED
        if isinstance(item, GeneratedToken):
            assert item.finish_reason is not None  # the token that ends it says how
            finish = Finish(item.finish_reason)
        self.remove(live, finish)
        if isinstance(item, GeneratedToken) and self.model is not None:
            self.keeping.keep_conversation(live)
        deliveries.setdefault(live.token, []).append((live.send, item, True))

    def remove(self, live: Live, finish: Finish) -> None:
        """A request leaves the decoder (its record, its reservation and its lane's row)."""
        if live.keep_prompt is not None:  # its prompt's chunks, kept while its slot is still its own
            if finish in (Finish.STOP, Finish.LENGTH):
                self.keeping.keep_joined(live)
            live.keep_prompt = None
        record = self.requests.get(live.request_id)
        if record is not None and record.live is live:
            self.requests.remove(live.request_id, finish)
            if self.speculator is not None:
                self.speculator.left(live.request_id)
            self.choices.left(live, record)
        self.slots.leave(live)
        self.batch.remove(live)

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

    def drop(self, request_id: str) -> None:
        """Cancel: leave the decoder and free everything held for the request. Idempotent."""
        self.slots.staged.unstage(self.pool, request_id)
        record = self.requests.get(request_id)
        if record is None:
            return
        if record.phase is EnginePhase.GATHERING or record.phase is EnginePhase.RUNNING:
            assert record.live is not None
            self.remove(record.live, Finish.CANCELLED)
            post(record.live.token, deliver, [(record.live.send, None, True)])
            return
        self.requests.remove(request_id, Finish.CANCELLED)
        if record.phase is EnginePhase.HELD:
            self.choices.ended(record.sampling)
        elif record.phase in (EnginePhase.WAITING, EnginePhase.PREFILLING):
            assert record.task is not None
            self.choices.ended(record.task.sampler.sampling)
            self.inbox.finish(record.task.job, Outcome(error=StatecoreError(ErrorInfo(
                Fault.CANCELLED, Code.CANCELLED, f"request {request_id!r} was cancelled"))))

    def die(self, error: StatecoreError) -> None:
        """Leave everything dead: fail the running and queued jobs, waiting prefills and live
        streams. Also called from trio when the watchdog abandons a stalled thread."""
        self.inbox.fail_all(error)
        for task in self.waiting.values():
            if task.job is not None and task.job.done is not None:
                task.job.outcome = Outcome(error=error)
                post(task.job.token, task.job.done.set)
        for live in self.live.values():
            post(live.token, deliver, [(live.send, error, True)])
        self.requests.clear(Finish.FAILED)
        self.keeping.due = []
        self.choices.groups.clear()
        self.batch.clear()
        self.model = None
        self.pool = None
        self.slots.last_tokens = None
        self.slots.joined.clear()  # the prompt caches kept for rows that would be written in again
        self.inflight = None

