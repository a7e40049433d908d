"""The prefill calls of one step, built from its plan on the device thread: what the plan frees
first (`adapters.mlx.step_memory`), then its padded groups of short prompts, then each prompt's
work units (`adapters.mlx.prefill`), the calls the plan stacks as rows of one call
(`run_stacked`) in the order of their positions; a streamed handoff's pieces that the step
completes are cut out as their own arrays; a prompt whose last unit is built adds its first token
and cache to the step's outputs. A prefill that raises starts again once, in a later step (a keep
task gives up); a padded group or stacked call that raises starts each of its prompts again
alone. Nothing here evaluates (but a pipeline rank's launches in call order, and early first
tokens): the executor (`adapters.mlx.executor`) launches what this returns with the step's decode.
*Early first tokens*: where the executor asks for them, a prompt that finishes in the step is
launched as soon as its calls are built, and the prompts launched before it are read back and
answered then (`read_early`), not when the whole step ends: a burst of first turns on a cached
system prompt finishes in one step of many short calls (their tails), whose first tokens all
left at its end, so the median waited for nearly all of them (on a GPU, where a short call costs
the host about as much as a long one, as long as the cache-less prompts, one a step, took to get
half of theirs out). The same arrays are evaluated, in the same calls: only when they are read
changes. This module imports mlx; never trio.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from adapters.mlx.first_verify import first_verify
from adapters.mlx.jobs import as_statecore
from adapters.mlx.kv_out import capture_pieces
from adapters.mlx.prefill import PrefillTask, run_short_batch, run_stacked, run_units
from adapters.mlx.step_host import ExecutorHost, InFlight
from adapters.mlx.step_memory import StepMemory
from statecore.engine_schedule import (
    Candidate,
    EnginePhase,
    Finish,
    PrefillFailure,
    StackedCall,
    StepPlan,
    prefill_failure,
    update,
)
from statecore.errors import StatecoreError

__all__ = ["PrefillBuild"]

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



class PrefillBuild:
    """A device loop's prefill calls of one step (see the module's paragraph)."""

    def __init__(self, loop: ExecutorHost, memory: StepMemory,
                 read_early: Callable[[list[PrefillTask]], bool] | None = None) -> None:
        self.loop = loop
        self.memory = memory  # the prefill memory cap: what the plan frees before its calls
        # Reads finished prompts back and answers them now (the executor's); False where one raised
        self.read_early = read_early
        self.early = False  # this step's prompts answer early (`build`'s argument)
        self.launched: list[PrefillTask] = []  # finished in this step, launched, not read back yet

    def build(self, plan: StepPlan, current: InFlight, candidates: Sequence[Candidate],
              early: bool = False) -> list[Any]:
        """Build the plan's prefill calls: its padded groups, then each prompt's units; a prompt in
        a stacked call computes its units before its first stacked chunk here, and the rest of
        its planned units after every prompt's (`build_stacked`). `early`: first tokens are read
        back as the step goes (the module's paragraph), where the plan finishes several prompts;
        the last one's still with the step."""
        self.early = early and self.read_early is not None and self.finishes_several(candidates, plan)
        try:
            return self.build_calls(plan, current, candidates)
        finally:
            current.finished_prefills.extend(self.launched)  # read back with the step
            self.launched = []

    @staticmethod
    def finishes_several(candidates: Sequence[Candidate], plan: StepPlan) -> bool:
        """Whether the plan finishes more than one prompt (keep tasks answer nobody)."""
        _, finishing = update(candidates, plan)
        keeps = {c.request_id for c in candidates if c.keeps_only}
        return len(set(finishing) - keeps) > 1

    def build_calls(self, plan: StepPlan, current: InFlight, candidates: Sequence[Candidate]) -> list[Any]:
        loop = self.loop
        started = time.perf_counter()
        outputs = _StepOutputs(loop.pipelined)
        self.memory.apply(plan)
        tasks = [(loop.waiting[work.request_id], work.units) for work in plan.prefills]
        groups = [[loop.waiting[rid] for rid in group] for group in plan.groups]
        for members in groups:
            if not self.run_group(run_short_batch, members, "a batched prefill", "prefill_batched"):
                continue
            for task in members:
                outputs.extend(capture_pieces(task, current.segments, current.streamed_from))
                outputs.extend(self.prefill_outputs(task, current))

        def keep_chunk(task: PrefillTask, chunk: int) -> list[Any]:
            kept = loop.keeping.keep_chunk(task, chunk)
            current.kept_blocks = current.kept_blocks or bool(kept)
            return kept

        first_stacked: dict[str, int] = {}  # a prompt in a stacked call -> its first stacked chunk
        for call in plan.stacks:
            for rid, chunk in zip(call.request_ids, call.chunks, strict=True):
                first_stacked[rid] = min(chunk, first_stacked.get(rid, chunk))
        carry = first_verify(loop.speculator, loop)
        for task, units in tasks:
            if task.finished:
                continue
            if loop.keeping.look_again(task):  # blocks built earlier in this step
                units = min(units, len(task.units) - task.done_units)
            if task.request_id in first_stacked:  # its units before the stacked ones
                units = max(0, self.first_unit_of(task, first_stacked[task.request_id]) - task.done_units)
                if not units:
                    continue
            loop.computing = ("prefill", [task.request_id])
            try:
                pieces = run_units(loop.model, task, units, loop.quantize, loop.bucket,
                                   None if loop.prefix is None else keep_chunk, carry)
            except Exception as exc:
                self.prefill_raised(task, exc, current)
                continue
            if task.request_id in first_stacked:
                outputs.extend(pieces)  # the rest after every prompt's units (build_stacked)
                continue
            outputs.extend(capture_pieces(task, current.segments, current.streamed_from))
            if task.finished and task.keeps_only:
                loop.requests.remove(task.request_id, Finish.KEPT)  # its kept blocks are among the pieces
                loop.keeping.kept(task)
                outputs.extend(pieces)
            elif task.finished:
                outputs.extend(self.prefill_outputs(task, current))
            else:
                current.prefilling.append(task)
                outputs.extend(pieces)
        if plan.stacks:
            planned = {work.request_id: work.units for work in plan.prefills}
            ends = {c.request_id: c.done_units + planned[c.request_id]
                    for c in candidates if c.request_id in planned}
            self.build_stacked(plan.stacks, [(task, first_stacked[task.request_id], ends[task.request_id])
                                             for task, _ in tasks if task.request_id in first_stacked],
                               current, outputs)
        loop.profile.account("prefill_chunks", started)
        return outputs.arrays

    @staticmethod
    def first_unit_of(task: PrefillTask, chunk: int) -> int:
        return next((i for i, unit in enumerate(task.units) if unit.chunk >= chunk), len(task.units))

    def build_stacked(self, stacks: Sequence[StackedCall], tasks: Sequence[tuple[PrefillTask, int, int]],
                      current: InFlight, outputs: _StepOutputs) -> None:
        """The planned units of the prompts in stacked calls (`tasks`: each prompt, its first
        stacked chunk and the unit its planned units end before), from that chunk on (each a
        whole chunk: one call), by position: a stacked call once, as a row of it
        each of its prompts that stands at its chunk (one left computes alone), any other unit as
        the prompt's own call. Then each prompt's first token and cache, or its state so far."""
        loop = self.loop
        by_member = {(rid, chunk): call for call in stacks
                     for rid, chunk in zip(call.request_ids, call.chunks, strict=True)}
        calls: list[tuple[int, int, PrefillTask, int]] = []  # (offset, order, task, chunk)
        for task, first_chunk, end in tasks:
            first = self.first_unit_of(task, first_chunk)
            chunks = [task.units[index].chunk for index in range(first, min(end, len(task.units)))]
            calls.extend((task.chunk_start(chunk), task.order, task, chunk) for chunk in chunks)
        done: set[int] = set()
        for _, _, task, chunk in sorted(calls, key=lambda call: call[:2]):
            call = by_member.get((task.request_id, chunk))
            if call is not None and id(call) in done:
                continue
            if call is None:
                members = [task]
            else:
                done.add(id(call))
                members = [loop.waiting[rid] for rid, own in zip(call.request_ids, call.chunks, strict=True)
                           if rid in loop.waiting and self.stands_at(loop.waiting[rid], own)]
            members = [member for member in members
                       if member.request_id in loop.waiting and self.stands_at(member, chunk)]
            if len(members) == 1:
                loop.computing = ("prefill", [members[0].request_id])
                try:
                    run_units(loop.model, members[0], 1, loop.quantize, loop.bucket)
                except Exception as exc:
                    self.prefill_raised(members[0], exc, current)
            elif members:
                self.run_group(run_stacked, members, "a stacked prefill call", "prefill_stacked")
        for task, _, _ in tasks:
            if task.request_id not in loop.waiting or task.cache is None:
                continue  # failed, or starts again
            if task.finished:
                outputs.extend(self.prefill_outputs(task, current))
            else:
                current.prefilling.append(task)
                outputs.extend([layer.state for layer in task.cache])

    @staticmethod
    def stands_at(task: PrefillTask, chunk: int) -> bool:
        """Whether the prompt's next unit starts chunk `chunk` (not restarted, not past it)."""
        return (not task.finished and task.units[task.done_units].chunk == chunk
                and task.units[task.done_units].starts_chunk and (task.cache is not None or chunk == 0))

    def run_group(self, call: Callable[[Any, list[PrefillTask], int], None], members: list[PrefillTask],
                  what: str, kind: str) -> bool:
        """One call of several prompts (`run_short_batch`, `run_stacked`), timed as `kind`; whether
        it was built (if it raised, each of its prompts starts again: `restart_group`)."""
        loop = self.loop
        loop.computing = ("prefill", [task.request_id for task in members])
        started = time.perf_counter()
        try:
            call(loop.model, members, loop.bucket)
        except Exception:
            self.restart_group(what, members)
            return False
        loop.profile.account(kind, started, len(members))
        return True

    def restart_group(self, what: str, members: list[PrefillTask]) -> None:
        """One call of several prompts raised: one prompt must not fail its neighbours, so each
        starts again from its first chunk in a later step (alone, unless it groups again); the
        step counts a retry. Called in the handler (the traceback is logged)."""
        logger.exception("%s of %d prompts failed; starting them again", what, len(members))
        self.loop.step_retries += 1
        for task in members:
            task.restart()

    def prefill_raised(self, task: PrefillTask, exc: Exception, current: InFlight) -> None:
        """A prompt's call raised: a keep task gives up, a prompt starts again once, else fails."""
        loop = self.loop
        failure = prefill_failure(keeps_only=task.keeps_only, retried=task.retried,
                                  typed=isinstance(exc, StatecoreError))
        if failure is PrefillFailure.GIVE_UP:
            logger.warning("keeping %s raised (%s: %s); not kept", task.request_id,
                           type(exc).__name__, exc)
            loop.requests.remove(task.request_id, Finish.GAVE_WAY)
            return
        if failure is PrefillFailure.RESTART:  # from its first token, in a later step
            loop.step_retries += 1
            logger.warning("prefill of %s raised (%s: %s); starting it again",
                           task.request_id, type(exc).__name__, exc)
            task.restart()
            return
        logger.exception("prefill failed for %s", task.request_id)
        loop.requests.remove(task.request_id, Finish.FAILED)
        loop.choices.ended(task.sampler.sampling)
        current.failed_prefills.append((task, as_statecore(exc)))


    def prefill_outputs(self, task: PrefillTask, current: InFlight) -> list[Any]:
        loop = self.loop
        loop.requests[task.request_id].phase = EnginePhase.PREFILLED
        assert task.cache is not None
        drawn = [] if task.drawn is None else [task.drawn]  # a first verify step's (speculative)
        arrays = [task.first, *drawn, *(c.state for c in task.cache)]
        # A streamed prompt's first token goes out with its last pieces, which the step holds
        if not self.early or task.segment_sink is not None:
            current.finished_prefills.append(task)
            return arrays
        try:
            mx.async_eval(arrays)  # type: ignore[no-untyped-call]
        except Exception:  # the step's own launch meets it again and fails what it must
            current.finished_prefills.append(task)
            return arrays
        # Those launched before it are computed by now, or nearly: the host built this one meanwhile
        earlier, self.launched = self.launched, [task]
        if earlier and self.read_early is not None and not self.read_early(earlier):
            current.finished_prefills.extend(earlier)  # one raised: the step's read-back fails it
        return arrays  # launched already: the step's launch finds them evaluated or on their way
