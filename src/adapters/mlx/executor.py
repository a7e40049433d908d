"""The step's executor on the device thread: it performs the plan the pure scheduler gave
(`statecore.engine_schedule.schedule`, asked in `plan` from the records as they are) and reads a
step back. Building: what the plan frees first (keep tasks that give way, kept prefix blocks),
then its padded groups of short prompts, then each prompt's work units (`adapters.mlx.prefill`);
a streamed handoff's pieces that the step completes are cut out as their own arrays; a prompt
whose last unit is built adds its first token and cache to the step's outputs. Reading back: the
decoding rows' tokens go to their streams, the streamed pieces to their sinks, finished prefills
become held caches and answer their callers. A step that fails on the device fails its own
requests only: its slot rows fail, the slot pool's buffers start again empty (the lane writes in
again the rows it can: `SlotLane.lose`), and its prompts (finished or not) start again once, as
a prefill that raises does (a streamed one sends the pieces that step held back once they are
computed again); the step built after it, if any, reads nothing of the lost pool back and leaves
those prompts out, and a prefix cache that either kept blocks into starts again empty. A prefill
that raises starts again once, in a later step; a padded group that raises runs its prompts
alone. This module imports mlx and trio (only for trio tokens); it sees the device loop only as
an `ExecutorHost`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.generate import generation_stream

from adapters.kv.codec import wire_view
from adapters.mlx.batch_lane import BatchLane
from adapters.mlx.choices import ChoiceGathering
from adapters.mlx.jobs import Outcome, as_statecore, engine_failed
from adapters.mlx.keeping import PrefixKeeping
from adapters.mlx.memory import ALLOCATION_STEP, KvCost
from adapters.mlx.prefill import PrefillTask, run_short_batch, run_units
from adapters.mlx.prefix_cache import PrefixCache
from adapters.mlx.profile import DeviceProfile
from adapters.mlx.requests import Held, RequestTable
from adapters.mlx.rows import Deliveries, Live
from adapters.mlx.sampling import read_logprobs
from adapters.mlx.settings import Settings
from adapters.mlx.slot_lane import SlotLane
from adapters.mlx.solo_lane import SoloLane
from adapters.mlx.speculative import SpeculationHost, Speculator
from effects.engine_port import PrefillOutcome
from statecore.engine_schedule import (
    Budget,
    Candidate,
    EnginePhase,
    Finish,
    Memory,
    PrefillFailure,
    StepPlan,
    decode_only,
    handoff_imminent,
    prefill_failure,
    schedule,
    update,
)
from statecore.errors import StatecoreError
from statecore.scheduling import (
    STREAMED_PIECE_BYTES,
    ModelShape,
    StepRates,
    measured_step,
    streamed_pieces,
)

__all__ = ["ExecutorHost", "InFlight", "StepExecutor"]

logger = logging.getLogger("adapters.engine_mlx")


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


# A streamed piece's tokens [start, stop) of layers [first, end).
Range = tuple[int, int, int, int]


@dataclass(eq=False)
class InFlight:
    """A step handed to the device; read back after the next one is built."""

    tokens: Any = None  # slot lane: (rows,) sampled tokens
    owners: list[Live | None] = field(default_factory=list)
    logprobs: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # slot -> its token's, lazily
    generation: int = 0  # the slot pool's buffers it wrote (`SlotPool.generation`)
    slot_outputs: int = 0  # how many of the step's outputs, first in its list, are the slot step's
    finished_prefills: list[PrefillTask] = field(default_factory=list)
    prefilling: list[PrefillTask] = field(default_factory=list)  # prompts it computed units of, unfinished
    kept_blocks: bool = False  # it keeps prefix blocks (computed by the step)
    streamed_from: dict[str, int] = field(default_factory=dict)  # request id -> its first unit streamed here
    launch_raised: Exception | None = None  # its launch raised (a failure on the device seen at once)
    prefill_tokens: int = 0  # the prefill work it planned (what the step-time target measures)
    failed_prefills: list[tuple[PrefillTask, StatecoreError]] = field(default_factory=list)
    # streamed handoffs: (task, (start, stop, first layer, end layer), keys then values per layer as
    # the wire carries them (`codec.wire_view`), their dtype)
    segments: list[tuple[PrefillTask, Range, list[Any], Any]] = field(default_factory=list)


class ExecutorHost(SpeculationHost, Protocol):
    """What the executor needs of the device loop: its records, lanes and parts, and the step
    on the device (`inflight`)."""

    settings: Settings
    requests: RequestTable
    waiting: Mapping[str, PrefillTask]
    prefix: PrefixCache | None
    keeping: PrefixKeeping
    choices: ChoiceGathering
    slots: SlotLane
    batch: BatchLane
    solo: SoloLane
    speculator: Speculator | None
    profile: DeviceProfile
    inflight: InFlight | None
    short_batching: bool
    shape: ModelShape | None
    cost: KvCost
    rates: StepRates
    handoff_joined: bool
    publish: Callable[[], None]
    cache_bytes: Callable[[list[Any]], int]

    handoffs_coming: dict[str, float]
    handoffs_expected: dict[str, float]

    def drop_abandoned_waiting(self) -> None: ...

    def hand_out(self, deliveries: Deliveries,
                 finished: list[tuple[PrefillTask, Outcome[Any]]] = ...) -> None: ...


class StepExecutor:
    """A device loop's step executor (see the module's paragraph), and the memory cap's counts."""

    def __init__(self, loop: ExecutorHost) -> None:
        self.loop = loop
        self.prefill_capped_steps = 0  # steps whose planned prefill was cut to fit the memory budget
        self.activation_overruns = 0  # steps estimated over the budget (the oldest prompt's unit alone)
        self.activation_peak = 0  # the largest estimate of one step's activations so far (capped steps)

    def forget_activation_counts(self) -> None:
        """The prefill memory cap's counters back to 0 (after the load's warm-up request): they
        count serving traffic."""
        self.prefill_capped_steps = self.activation_overruns = self.activation_peak = 0

    def step(self) -> None:
        """Build and start this step, then read back the previous one; while a handed-off
        request is about to join, read the previous one back first (`settle`)."""
        loop, profile = self.loop, self.loop.profile
        if loop.inflight is not None and handoff_imminent(list(loop.handoffs_coming.values()),
                                                          time.monotonic()):
            self.settle()
            return
        started = time.perf_counter()
        spent_before = profile.seconds()
        traces_before = 0 if loop.compiled is None else loop.compiled.traces
        loop.drop_abandoned_waiting()
        current = InFlight()
        outputs: list[Any] = []
        slot_rows = [live for live in loop.live.values() if live.slot is not None]
        if loop.speculator is not None and slot_rows:  # a verify step may decode them instead
            slot_rows = loop.speculator.step(loop, slot_rows)
        with mx.stream(generation_stream):
            if slot_rows:
                building = time.perf_counter()
                try:
                    slot_step = loop.slots.build(slot_rows)
                    current.tokens, current.owners = slot_step.tokens, slot_step.owners
                    current.logprobs = slot_step.logprobs
                    assert loop.pool is not None
                    current.generation, current.slot_outputs = loop.pool.generation, len(slot_step.outputs)
                    outputs.extend(slot_step.outputs)
                except Exception as exc:
                    self.fail_rows(slot_rows, exc)
                    current = InFlight()
                profile.account("decode_build", building)
                profile.count("decode_rows", len(slot_rows))
            plan, candidates = self.plan()
            current.prefill_tokens = plan.prefill_tokens
            outputs.extend(self.build_prefills(plan, current))
            self.advance(candidates, plan)
            loop.computing = ("", ())
        built = bool(outputs) or bool(current.failed_prefills)
        previous, loop.inflight = loop.inflight, (current if built else None)
        # On the CPU a launch computes the step before it returns (MLX's CPU stream): nothing runs
        # behind the host's next build, so what a step hands out leaves as soon as it can: at once,
        # after its own launch (its tokens would otherwise wait for the next step's build, a
        # fifth to a third of a CPU decode step), unless it streamed pieces of a prompt it did not
        # finish: those say whether the step computing the prompt's last pieces has started, which
        # the next build decides, so that step is read back after the next build, ahead of its
        # launch (not after it: a handed-off request's second token would wait for a layer slice
        # of a prompt). Elsewhere the launch returns at once, and a step's results leave as soon
        # as it ends.
        on_cpu = mx.default_device() == mx.cpu
        if previous is not None and on_cpu:
            self.read_back(previous)
            if self.stale(current):  # built on the pool the previous step lost: not computed
                outputs = outputs[current.slot_outputs :]
        if outputs:
            with mx.stream(generation_stream):
                launching = time.perf_counter()
                try:
                    mx.async_eval(outputs)  # type: ignore[no-untyped-call]
                except Exception as exc:  # a failure on the device that the launch met already
                    current.launch_raised = exc
                profile.account("launch", launching)
        if previous is not None and not on_cpu:
            self.read_back(previous)
        # Lanes that evaluate on their own: the batch lane, then the solo requests.
        loop.choices.release()
        if len(loop.batch):
            loop.batch.step()
        for live in loop.solo.step([live for live in loop.live.values() if live.solo_cache is not None]):
            assert live.solo_cache is not None
            loop.batch.insert(live, live.solo_cache)  # its one solo step after a split is done
        # The steps this one's time is the device's for: on the CPU the one its launch computed;
        # elsewhere the one read back in it (its launch waits for the one before, its read-back
        # for the rest), and this one too when it is read back at once.
        waited_for = ([current] if built else []) if on_cpu else ([] if previous is None else [previous])
        if built and ((not loop.live and not loop.waiting)
                      or (on_cpu and (bool(current.finished_prefills) or not current.segments))):
            # Nothing else will come (or, on the CPU, it is computed and no piece in it waits on
            # the next build): read this step back now rather than on the next one.
            loop.inflight = None
            self.read_back(current)
            if not on_cpu:
                waited_for.append(current)
        profile.account("step", started)
        elapsed = time.perf_counter() - started
        if waited_for or (not built and loop.live):
            # A step that built nothing (the lanes that evaluate on their own) is a step without
            # prefill.
            loop.rates = measured_step(loop.rates, elapsed, sum(step.prefill_tokens for step in waited_for))
        traces = 0 if loop.compiled is None else loop.compiled.traces - traces_before
        profile.step_ended(elapsed, len(slot_rows), len(plan.prefills), spent_before, traces)
        loop.publish()

    def settle(self) -> None:
        """Read the step on the device back before the next is built: the install of a request
        whose last piece is arriving (a job) then comes before that next step, so the request's
        second token is one step sooner, at the price of the host's build no longer overlapping
        the device for the few steps until it joins."""
        loop = self.loop
        previous, loop.inflight = loop.inflight, None
        assert previous is not None
        self.read_back(previous)
        loop.publish()

    def plan(self) -> tuple[StepPlan, list[Candidate]]:
        """This step's plan (`statecore.engine_schedule.schedule`) from the records as they are,
        and the candidates it was made from."""
        loop = self.loop
        s = loop.settings
        for task in loop.waiting.values():
            loop.keeping.look_again(task)  # blocks built since it arrived: the plan sees what is left
        # A choice of n > 1 never shares a padded call: whether its siblings' prefills wait beside
        # it is a matter of timing, and the rows of a padded call differ from a prompt's own call
        # in their last bits (OpenBLAS); alone, a choice prefills as on any other node.
        candidates = [Candidate(task.request_id, task.order, len(task.tokens), task.chunks, task.units,
                                task.done_units, loop.short_batching and task.is_short
                                and task.sampler.sampling.choices == 1, task.keeps_only,
                                tuple(task.block_keys))
                      for task in loop.waiting.values()]
        target_ms = s.step_target_ms
        oldest = min(loop.waiting.values(), key=lambda task: task.order, default=None)
        budget = Budget(s.max_num_batched_tokens, s.prefill_batch,
                        None if target_ms is None else target_ms / 1000, loop.rates,
                        decode_only=decode_only(loop.handoff_joined, list(loop.handoffs_coming.values()),
                                                time.monotonic(), list(loop.handoffs_expected.values())),
                        oldest_streams=oldest is not None and oldest.segment_sink is not None)
        loop.handoff_joined = False
        memory = None
        if s.prefill_memory_cap:
            assert loop.shape is not None
            memory = Memory(s.kv_memory_bytes, 0 if loop.pool is None else loop.pool.nbytes,
                            loop.requests.reserved_bytes, 0 if loop.prefix is None else loop.prefix.nbytes,
                            loop.shape,
                            max((live.limit for live in loop.live.values()), default=1), loop.cost.per_token,
                            ALLOCATION_STEP)
        return schedule(len(loop.live), candidates, budget, max_padding=s.max_padding, bucket=loop.bucket,
                        memory=memory), candidates

    def advance(self, candidates: Sequence[Candidate], plan: StepPlan) -> None:
        """The prompts' phases after the build, from their progress as `update` gives it (from
        the units each has done as built): one that computed units and has more left is
        prefilling, one whose call raised starts again waiting. Those that finished moved as they
        were built (prefilled, or a done keep task gone), as did a failed one (gone)."""
        loop = self.loop
        left, _ = update(candidates, plan, {rid: task.done_units for rid, task in loop.waiting.items()})
        planned = {work.request_id for work in plan.prefills}
        for candidate in left:
            record = loop.requests.get(candidate.request_id)
            if record is None or record.phase not in (EnginePhase.WAITING, EnginePhase.PREFILLING):
                continue  # gone, or a keep task (keeping until it is done)
            if candidate.done_units == 0:
                record.phase = EnginePhase.WAITING
            elif candidate.request_id in planned:
                record.phase = EnginePhase.PREFILLING

    def apply_memory_plan(self, plan: StepPlan) -> None:
        """What the plan frees for its prefill (keep tasks, kept prefix blocks), and its counts."""
        loop = self.loop
        for request_id in plan.dropped_keeps:
            loop.requests.remove(request_id, Finish.GAVE_WAY)
        if plan.evict_prefix_bytes and loop.prefix is not None:
            loop.prefix.evict(plan.evict_prefix_bytes)
        if plan.activation_estimate is None:
            return
        if plan.capped:
            self.prefill_capped_steps += 1
        if plan.over_budget:
            if not self.activation_overruns:
                logger.warning("a step's activations are estimated at %d bytes: beside the KV held, over "
                               "the budget of %d bytes (the oldest prompt's prefill runs alone); "
                               "counted in activation_overruns", plan.activation_estimate,
                               loop.settings.kv_memory_bytes)
            self.activation_overruns += 1
        self.activation_peak = max(self.activation_peak, plan.activation_estimate)

    def build_prefills(self, plan: StepPlan, current: InFlight) -> list[Any]:
        """Build the plan's prefill calls: its padded groups, then each prompt's units."""
        loop = self.loop
        started = time.perf_counter()
        outputs = _StepOutputs(loop.pipelined)
        self.apply_memory_plan(plan)
        tasks = [(loop.waiting[work.request_id], work.units) for work in plan.prefills]
        groups = [[loop.waiting[rid] for rid in group] for group in plan.groups]
        for members in groups:
            loop.computing = ("prefill", [task.request_id for task in members])
            try:
                run_short_batch(loop.model, members, loop.bucket)
            except Exception:
                # One prompt must not fail its neighbours: they run alone below.
                logger.exception("a batched prefill of %d prompts failed; running them alone",
                                 len(members))
                loop.step_retries += 1
                for task in members:
                    task.restart()  # from its first chunk, in a later step
                continue
            loop.profile.account("prefill_batched", started, len(members))
            for task in members:
                outputs.extend(self.capture_segments(task, current))
                outputs.extend(self.prefill_outputs(task, current))

        def keep_chunk(task: PrefillTask, chunk: int) -> list[Any]:
            kept = loop.keeping.keep_chunk(task, chunk)
            current.kept_blocks = current.kept_blocks or bool(kept)
            return kept

        for task, units in tasks:
            if task.finished:
                continue
            if loop.keeping.look_again(task):  # blocks built earlier in this step
                units = min(units, len(task.units) - task.done_units)
            loop.computing = ("prefill", [task.request_id])
            try:
                pieces = run_units(loop.model, task, units, loop.quantize, loop.bucket,
                                   None if loop.prefix is None else keep_chunk)
            except Exception as exc:
                failure = prefill_failure(keeps_only=task.keeps_only, retried=task.retried,
                                          typed=isinstance(exc, StatecoreError))
                if failure is PrefillFailure.GIVE_UP:
                    logger.warning("keeping %s raised (%s: %s); not kept", task.request_id,
                                   type(exc).__name__, exc)
                    loop.requests.remove(task.request_id, Finish.GAVE_WAY)
                    continue
                if failure is PrefillFailure.RESTART:  # from its first token, in a later step
                    loop.step_retries += 1
                    logger.warning("prefill of %s raised (%s: %s); starting it again",
                                   task.request_id, type(exc).__name__, exc)
                    task.restart()
                    continue
                logger.exception("prefill failed for %s", task.request_id)
                loop.requests.remove(task.request_id, Finish.FAILED)
                loop.choices.ended(task.sampler.sampling)
                current.failed_prefills.append((task, as_statecore(exc)))
                continue
            outputs.extend(self.capture_segments(task, current))
            if task.finished and task.keeps_only:
                loop.requests.remove(task.request_id, Finish.KEPT)  # its kept blocks are among the pieces
                outputs.extend(pieces)
            elif task.finished:
                outputs.extend(self.prefill_outputs(task, current))
            else:
                current.prefilling.append(task)
                outputs.extend(pieces)
        loop.profile.account("prefill_chunks", started)
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
            pieces = [wire_view(mx.contiguous(buffer[..., start:stop, :])) for layer in task.cache[first:end]
                      for buffer in (layer.keys, layer.values)]
            current.segments.append((task, where, pieces, keys.dtype))
            arrays.extend(pieces)
        current.streamed_from.setdefault(task.request_id, task.streamed_units)
        task.streamed_units = task.done_units
        return arrays

    def hand_segments(self, step: InFlight) -> None:
        """A read-back step's streamed pieces to their sinks (computed now), unless the request
        left meanwhile. A piece says whether the step computing its prompt's last pieces has
        started: the next step was built before this one is read back, so a prompt whose units
        are all built, and which this step did not finish, finishes in the step now running."""
        for task, where, pieces, dtype in step.segments:
            if task.job is None or task.job.is_abandoned():
                continue
            last_step_started = task.done_units >= len(task.units) and task not in step.finished_prefills
            try:
                task.segment_sink(where, pieces, dtype, last_step_started)
            except Exception:  # the sink's failure is its request's (it hears of it at export)
                logger.exception("handing a KV segment of %s out failed", task.request_id)
                task.segment_sink = None

    def prefill_outcome(self, task: PrefillTask, first: int) -> PrefillOutcome:
        """A finished prompt's outcome, its first token read back."""
        assert task.cache is not None
        logprobs = read_logprobs(task.sampler.take_logprobs())
        return PrefillOutcome(first, len(task.tokens), self.loop.cache_bytes(task.cache), logprobs,
                              task.cached_tokens, streamed=task.segment_sink is not None)

    def tell_first_tokens(self, step: InFlight, outcomes: list[PrefillOutcome]) -> None:
        """A streamed prompt's first token to its sink ahead of the pieces of the step that
        sampled it: reading those pieces out waits for the device (on a GPU each one is copied to
        the host), and its caller passes the first token on at once."""
        for task, outcome in zip(step.finished_prefills, outcomes, strict=True):
            if task.segment_sink is None or task.job is None or task.job.is_abandoned():
                continue
            try:
                task.segment_sink.first_token(outcome)
            except Exception:  # the sink's failure is its request's (it hears of it at export)
                logger.exception("telling %s's first token failed", task.request_id)
                task.segment_sink = None

    def fail_rows(self, rows: list[Live], exc: Exception) -> None:
        """A step that could not be built fails its rows only; the loop goes on."""
        loop = self.loop
        logger.exception("a decode step failed for %d requests", len(rows))
        error = engine_failed(f"a decode step failed: {type(exc).__name__}: {exc}")
        deliveries: Deliveries = {}
        for live in rows:
            loop.end(live, error, deliveries)
        loop.slots.last_tokens = None
        loop.hand_out(deliveries)

    def prefill_outputs(self, task: PrefillTask, current: InFlight) -> list[Any]:
        loop = self.loop
        loop.requests[task.request_id].phase = EnginePhase.PREFILLED
        current.finished_prefills.append(task)
        assert task.cache is not None
        return [task.first, *(c.state for c in task.cache)]

    def stale(self, step: InFlight) -> bool:
        """Whether a step's slot part wrote buffers that the pool has lost since (its rows were
        written in again or failed then: nothing of it is read back)."""
        pool = self.loop.pool
        return step.tokens is not None and (pool is None or step.generation != pool.generation)

    def read_back(self, step: InFlight) -> None:
        """Wait for a step's results and hand them out (tokens, first tokens, failures)."""
        loop = self.loop
        started = time.perf_counter()
        deliveries: Deliveries = {}
        finished: list[tuple[PrefillTask, Outcome[Any]]] = []
        stale = self.stale(step)
        try:
            if step.launch_raised is not None:
                raise step.launch_raised
            tokens: list[int] = step.tokens.tolist() if step.tokens is not None and not stale else []
            firsts = [int(task.first.item()) for task in step.finished_prefills]
        except Exception as exc:
            self.failed_on_device(step, exc, stale, deliveries, finished)
        else:
            outcomes = [self.prefill_outcome(task, first)
                        for task, first in zip(step.finished_prefills, firsts, strict=True)]
            self.tell_first_tokens(step, outcomes)
            self.hand_segments(step)  # before the prefills' outcomes: their calls end after the pieces
            for slot, (owner, token) in enumerate(zip(step.owners, tokens, strict=False)):
                if owner is None or loop.live.get(owner.request_id) is not owner:
                    continue  # a free slot's row, or a request that ended meanwhile
                owner.last_token = token
                item = loop.count_token(owner, token, read_logprobs(step.logprobs.get(slot)))
                loop.hand_token(owner, item, deliveries)
            for task, outcome in zip(step.finished_prefills, outcomes, strict=True):
                assert task.cache is not None
                loop.requests.hold(task.request_id, Held(task.cache, len(task.tokens), outcome.held_bytes,
                                                         task.sampler.sampling))
                outcome = replace(outcome, streamed=task.segment_sink is not None)  # its pieces all went
                finished.append((task, Outcome(value=outcome)))
        finished.extend((task, Outcome(error=error)) for task, error in step.failed_prefills)
        loop.profile.account("readback", started)
        loop.hand_out(deliveries, finished)

    def failed_on_device(self, step: InFlight, exc: Exception, stale: bool, deliveries: Deliveries,
                         finished: list[tuple[PrefillTask, Outcome[Any]]]) -> None:
        """A step that raised while the device computed it: what it computed is not to be
        trusted, and neither is what was built on it (see the module's paragraph)."""
        loop = self.loop
        logger.exception("a step failed on the device; failing its requests")
        raised = f"{type(exc).__name__}: {exc}"
        if step.tokens is not None and not stale:
            error = engine_failed(f"a decode step failed on the device: {raised}")
            for owner in step.owners:
                if owner is not None and loop.live.get(owner.request_id) is owner:
                    loop.end(owner, error, deliveries)
            lost = engine_failed(f"its KV was in the slot pool, which a decode step that failed on the "
                                 f"device left unusable ({raised})")
            rows = [live for live in loop.live.values() if live.slot is not None]
            again = loop.slots.lose(rows, lost, deliveries)
            logger.warning("the slot pool's buffers start again empty; %d of %d rows written in again",
                           len(again), len(rows))
        loop.slots.last_tokens = None
        following = loop.inflight if loop.inflight is not step else None  # built after it, read back later
        kept = [s.kept_blocks for s in (step, following) if s is not None]
        if loop.prefix is not None and any(kept):
            # Blocks it kept hold what it computed, and those kept by the step after it may hold
            # what was computed from that: the prefix cache starts again empty.
            logger.warning("a step that kept prefix blocks failed on the device: the prefix cache "
                           "starts again empty")
            loop.prefix = loop.prefix.emptied()
        prompt_error = engine_failed(f"the step computing its prompt failed on the device: {raised}")
        # Pieces that the step after it streamed never go out either (it leaves these prompts out).
        streamed_from = {**({} if following is None else following.streamed_from), **step.streamed_from}
        redone = {id(task) for task in [*step.finished_prefills, *step.prefilling]
                  if self.prefill_lost(task, prompt_error, finished, streamed_from)}
        if following is not None and redone:
            following.finished_prefills = [t for t in following.finished_prefills if id(t) not in redone]
            following.prefilling = [t for t in following.prefilling if id(t) not in redone]
            following.segments = [segment for segment in following.segments if id(segment[0]) not in redone]

    def prefill_lost(self, task: PrefillTask, error: StatecoreError,
                     finished: list[tuple[PrefillTask, Outcome[Any]]],
                     streamed_from: Mapping[str, int]) -> bool:
        """A prompt whose units were in a step that failed on the device: it starts again
        (`prefill_failure`: once; a keep task gives up; one that failed before fails), its
        pieces streamed from where that step's began (they never went out; those before it did,
        and are not sent again). Whether it was still the prompt's (not gone meanwhile)."""
        loop = self.loop
        record = loop.requests.get(task.request_id)
        if record is None or record.task is not task:
            return False
        failure = prefill_failure(keeps_only=task.keeps_only, retried=task.retried, typed=False)
        if task.request_id in streamed_from:
            task.streamed_units = streamed_from[task.request_id]
        if failure is PrefillFailure.GIVE_UP:
            loop.requests.remove(task.request_id, Finish.GAVE_WAY)
        elif failure is PrefillFailure.RESTART:
            loop.step_retries += 1
            logger.warning("prefill of %s was in a step that failed on the device; starting it again",
                           task.request_id)
            task.restart()
            record.phase = EnginePhase.WAITING
        else:
            loop.requests.remove(task.request_id, Finish.FAILED)
            loop.choices.ended(task.sampler.sampling)
            finished.append((task, Outcome(error=error)))
        return True
