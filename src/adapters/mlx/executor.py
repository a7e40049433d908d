"""The step's executor on the device thread: it performs the plan the pure scheduler gave
(`statecore.engine_schedule.schedule`, asked in `plan` from the records as they are), launches
the step (the slot lane's decode call, then the plan's prefill calls, built by
`adapters.mlx.prefill_build`) and reads a step back: the decoding rows' tokens go to their
streams, the streamed pieces to their sinks, finished prefills become held caches and answer
their callers (a streamed prompt's first token ahead of its last step's pieces:
`adapters.mlx.kv_out`). Which step is read back when (at once on the CPU, where the launch
computes it; after the next build elsewhere) is decided in `step`. A step that fails on the
device fails its own requests only (`adapters.mlx.device_failure`). This module imports mlx and
trio (only for trio tokens); it sees the device loop only as an `ExecutorHost`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from adapters.mlx.device_failure import failed_on_device
from adapters.mlx.jobs import Outcome, engine_failed
from adapters.mlx.kv_out import hand_pieces, tell_first_tokens
from adapters.mlx.prefill import PrefillTask
from adapters.mlx.prefill_build import PrefillBuild
from adapters.mlx.requests import Held
from adapters.mlx.rows import Deliveries, Live
from adapters.mlx.sampling import read_logprobs
from adapters.mlx.step_host import ExecutorHost, InFlight
from adapters.mlx.step_memory import StepMemory
from effects.engine_port import PrefillOutcome
from statecore.engine_schedule import (
    Budget,
    Candidate,
    EnginePhase,
    StepPlan,
    decode_only,
    handoff_imminent,
    schedule,
    update,
)
from statecore.scheduling import (
    measured_step,
)

__all__ = ["StepExecutor"]

logger = logging.getLogger("adapters.engine_mlx")


class StepExecutor:
    """A device loop's step executor (see the module's paragraph)."""

    def __init__(self, loop: ExecutorHost) -> None:
        self.loop = loop
        self.memory = StepMemory(loop)  # the prefill memory cap: what a plan frees, and its counts
        self.prefills = PrefillBuild(loop, self.memory, self.read_early)  # the plan's prefill calls

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
        # a handed-off request joined since the last step: this step computes its second token
        # (the plan below clears the flag)
        carries_join = loop.handoff_joined and loop.joins_early
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
            outputs.extend(self.prefills.build(plan, current, candidates, self.first_tokens_early()))
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
        # On the CPU, where the launch computed it, this step's tokens leave before the lanes that
        # evaluate on their own compute theirs (a handed-off request decodes in the slot lane
        # while streams too long for a slot decode in the batch lane: its second token waited for
        # the batch's step, ~a step more).
        computed = built and on_cpu and (bool(current.finished_prefills) or not current.segments)
        # Elsewhere the step that carries a joined request's second token is read back at once,
        # not after the next step's build and launch: that token would otherwise wait a whole
        # host step more (on an H100 a 1B model's decode step is host-bound, ~5 ms of build and
        # launch), once per join, while the next build overlaps nothing for that one step.
        read_early = (computed and loop.joins_early) or (built and carries_join and not on_cpu)
        # The steps this one's time is the device's for: on the CPU the one its launch computed;
        # elsewhere the one read back in it (its launch waits for the one before, its read-back
        # for the rest), and this one too when it is read back now (`read_now`).
        waited_for = ([current] if built else []) if on_cpu else ([] if previous is None else [previous])
        if read_early:
            self.read_now(current, waited_for, on_cpu)
        # Lanes that evaluate on their own: the batch lane, then the solo requests.
        loop.choices.release()
        batch_stepped = bool(len(loop.batch))
        if batch_stepped:
            loop.batch.step()
        # after the batch's step: a batch that raised twice splits into solo rows, which step now
        solo_rows = [live for live in loop.live.values() if live.solo_cache is not None]
        for live in loop.solo.step(solo_rows):
            assert live.solo_cache is not None
            loop.batch.insert(live, live.solo_cache)  # its one solo step after a split is done
        # Off the CPU, a lane that evaluated on its own waited for the device, and this step's
        # launch ran before it: its tokens are ready now, not after the next build and launch (a
        # prompt longer than a slot decoding in the batch lane held every slot row's tokens back a
        # whole step, each step).
        waited = (batch_stepped or bool(solo_rows)) and not on_cpu and not current.segments
        if not read_early and built and ((not loop.live and not loop.waiting) or computed or waited):
            # Nothing else will come (or it is computed, and no piece in it waits on the next
            # build): read this step back now rather than on the next one.
            self.read_now(current, waited_for, on_cpu)
        profile.account("step", started)
        elapsed = time.perf_counter() - started
        if waited_for or (not built and loop.live):
            # A step that built nothing (the lanes that evaluate on their own) is a step without
            # prefill.
            loop.rates = measured_step(loop.rates, elapsed, sum(step.prefill_tokens for step in waited_for))
        traces = 0 if loop.compiled is None else loop.compiled.traces - traces_before
        profile.step_ended(elapsed, len(slot_rows), len(plan.prefills), spent_before, traces)
        loop.publish()

    def first_tokens_early(self) -> bool:
        """Whether this step's finished prompts are read back as it goes (`adapters.mlx.prefill_build`:
        early first tokens): not on a tensor- or pipeline-parallel rank (their launches keep the
        plan's order), nor on the CPU behind a step not yet read back (its tokens would wait for
        this one's prefill, which a CPU launch computes)."""
        loop = self.loop
        lockstep = getattr(loop, "tensor", None) is not None
        behind = loop.inflight is not None and mx.default_device() == mx.cpu
        return not (loop.pipelined or lockstep or behind)

    def read_early(self, tasks: list[PrefillTask]) -> bool:
        """Read finished prompts back before their step ends and answer them (their arrays were
        launched). False, reading nothing, where one raised: the step's own read-back meets it."""
        try:
            for task in tasks:
                task.first.item()
        except Exception:
            return False
        self.read_back(InFlight(finished_prefills=list(tasks)))
        return True

    def read_now(self, step: InFlight, waited_for: list[InFlight], on_cpu: bool) -> None:
        """Read `step` back in the call that launched it, not the next: nothing is left in flight,
        and off the CPU (where the launch returned at once) that call's time is the device's for
        `step` too."""
        self.loop.inflight = None
        self.read_back(step)
        if not on_cpu:
            waited_for.append(step)

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
        # The same holds for a stacked call (a row computes as alone only where measured so; a
        # streamed prompt's pieces are cut from its own cache; keep tasks give way to memory; a
        # speculating node's last calls may carry drafts, which a stacked call does not).
        candidates = [Candidate(task.request_id, task.order, len(task.tokens), task.chunks, task.units,
                                task.done_units, loop.short_batching and task.is_short
                                and task.sampler.sampling.choices == 1, task.keeps_only,
                                tuple(task.block_keys),
                                (task.sampler.sampling.adapter or "") if loop.stacking is not None
                                and loop.speculator is None and task.sampler.sampling.choices == 1
                                and not task.keeps_only and task.segment_sink is None else None)
                      for task in loop.waiting.values()]
        target_ms = s.step_target_ms
        oldest = min(loop.waiting.values(), key=lambda task: task.order, default=None)
        budget = Budget(s.max_num_batched_tokens, s.prefill_batch,
                        None if target_ms is None else target_ms / 1000, loop.rates,
                        target_floors=s.step_target_floors,
                        decode_only=decode_only(loop.handoff_joined, list(loop.handoffs_coming.values()),
                                                time.monotonic(), list(loop.handoffs_expected.values())),
                        oldest_streams=oldest is not None and oldest.segment_sink is not None)
        loop.handoff_joined = False
        return schedule(len(loop.live), candidates, budget, max_padding=s.max_padding, bucket=loop.bucket,
                        memory=self.memory.now(), stacking=loop.stacking), candidates

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

    def prefill_outcome(self, task: PrefillTask, first: int) -> PrefillOutcome:
        """A finished prompt's outcome, its first token read back."""
        assert task.cache is not None
        logprobs = read_logprobs(task.sampler.take_logprobs())
        return PrefillOutcome(first, len(task.tokens), self.loop.cache_bytes(task.cache), logprobs,
                              task.cached_tokens, streamed=task.segment_sink is not None)

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
            drawn = [() if task.drawn is None or loop.speculator is None
                     else loop.speculator.first_verified(task, first)
                     for task, first in zip(step.finished_prefills, firsts, strict=True)]
        except Exception as exc:
            failed_on_device(loop, step, exc, stale, deliveries, finished)
        else:
            outcomes = [self.prefill_outcome(task, first)
                        for task, first in zip(step.finished_prefills, firsts, strict=True)]
            tell_first_tokens(step.finished_prefills, outcomes)
            hand_pieces(step.segments, step.finished_prefills)  # the prefills' calls end after them
            for slot, (owner, token) in enumerate(zip(step.owners, tokens, strict=False)):
                if owner is None or loop.live.get(owner.request_id) is not owner:
                    continue  # a free slot's row, or a request that ended meanwhile
                owner.last_token = token
                item = loop.count_token(owner, token, read_logprobs(step.logprobs.get(slot)))
                loop.hand_token(owner, item, deliveries)
            for task, outcome, tokens_drawn in zip(step.finished_prefills, outcomes, drawn, strict=True):
                assert task.cache is not None
                loop.requests.hold(task.request_id, Held(task.cache, len(task.tokens), outcome.held_bytes,
                                                         task.sampler.sampling, tokens_drawn))
                outcome = replace(outcome, streamed=task.segment_sink is not None)  # its pieces all went
                finished.append((task, Outcome(value=outcome)))
        finished.extend((task, Outcome(error=error)) for task, error in step.failed_prefills)
        loop.profile.account("readback", started)
        loop.hand_out(deliveries, finished)
