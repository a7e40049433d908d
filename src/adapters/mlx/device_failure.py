"""A step that failed on the device, as its read-back finds it (`StepExecutor.read_back`): it
fails its own requests only. Its slot rows fail and the slot pool's buffers start again empty
(the lane writes in again the rows it can: `SlotLane.lose`); its prompts, finished or not, start
again once, as a prefill that raises does, a streamed one sending again the pieces that step held
back; the step built after it, if any, leaves those prompts out; and a prefix cache that either
step kept blocks into starts again empty. This module imports nothing of mlx itself; it sees the
device loop only as an `ExecutorHost` (`adapters.mlx.step_host`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from adapters.mlx.jobs import Outcome, engine_failed
from adapters.mlx.prefill import PrefillTask
from adapters.mlx.rows import Deliveries
from adapters.mlx.step_host import ExecutorHost, InFlight
from statecore.engine_schedule import EnginePhase, Finish, PrefillFailure, prefill_failure
from statecore.errors import StatecoreError

__all__ = ["failed_on_device", "prefill_lost"]

logger = logging.getLogger("adapters.engine_mlx")


def failed_on_device(loop: ExecutorHost, step: InFlight, exc: Exception, stale: bool,
                     deliveries: Deliveries, finished: list[tuple[PrefillTask, Outcome[Any]]]) -> None:
    """A step that raised while the device computed it: what it computed is not to be
    trusted, and neither is what was built on it (see the module's paragraph)."""
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
              if prefill_lost(loop, task, prompt_error, finished, streamed_from)}
    if following is not None and redone:
        following.finished_prefills = [t for t in following.finished_prefills if id(t) not in redone]
        following.prefilling = [t for t in following.prefilling if id(t) not in redone]
        following.segments = [segment for segment in following.segments if id(segment[0]) not in redone]

def prefill_lost(loop: ExecutorHost, task: PrefillTask, error: StatecoreError,
                 finished: list[tuple[PrefillTask, Outcome[Any]]],
                 streamed_from: Mapping[str, int]) -> bool:
    """A prompt whose units were in a step that failed on the device: it starts again
    (`prefill_failure`: once; a keep task gives up; one that failed before fails), its
    pieces streamed from where that step's began (they never went out; those before it did,
    and are not sent again). Whether it was still the prompt's (not gone meanwhile)."""
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
