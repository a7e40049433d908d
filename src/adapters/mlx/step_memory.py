"""A step's memory under the prefill memory cap (`--prefill-memory-cap`; docs/engine.md, "A step's
activations"): what the pure scheduler is told of the KV budget (`statecore.engine_schedule.Memory`,
from the device loop's budgets as they are), what its plan then frees before the step's prefill
(keep tasks that give way, kept prefix blocks), and the cap's counters the statistics report. It
reads the loop's records and budgets and changes only the prefix cache's and the keep tasks'
share; it imports neither mlx nor trio, and sees the loop only as an `ExecutorHost`.
"""

from __future__ import annotations

import logging

from adapters.mlx.memory import ALLOCATION_STEP
from adapters.mlx.step_host import ExecutorHost
from statecore.engine_schedule import Finish, Memory, StepPlan

__all__ = ["StepMemory"]

logger = logging.getLogger("adapters.engine_mlx")


class StepMemory:
    """A device loop's step memory (see the module's paragraph)."""

    def __init__(self, loop: ExecutorHost) -> None:
        self.loop = loop
        self.prefill_capped_steps = 0  # steps whose planned prefill was cut to fit the memory budget
        self.activation_overruns = 0  # steps estimated over the budget (the oldest prompt's unit alone)
        self.activation_peak = 0  # the largest estimate of one step's activations so far (capped steps)

    def forget_counts(self) -> None:
        """The cap's counters back to 0 (after the load's warm-up request): they count serving
        traffic."""
        self.prefill_capped_steps = self.activation_overruns = self.activation_peak = 0

    def now(self) -> Memory | None:
        """What the scheduler weighs a step's prefill against (None: the cap is off)."""
        loop = self.loop
        s = loop.settings
        if not s.prefill_memory_cap:
            return None
        assert loop.shape is not None
        return Memory(s.kv_memory_bytes, 0 if loop.pool is None else loop.pool.nbytes,
                      loop.requests.reserved_bytes, 0 if loop.prefix is None else loop.prefix.nbytes,
                      loop.shape, max((live.limit for live in loop.live.values()), default=1),
                      loop.cost.per_token, ALLOCATION_STEP)

    def apply(self, plan: StepPlan) -> None:
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
