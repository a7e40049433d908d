"""Where the device thread's time goes: calls and seconds per kind of work (`DeviceProfile.spent`,
read by the statistics and benchmarks), and the latest steps that took `SLOW_STEP_S` or more with
their time split by kind (`SlowStep`). Plain values and the clock only: it must never import mlx,
trio or the device loop.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

__all__ = ["KINDS", "SLOW_STEP_S", "DeviceProfile", "SlowStep"]

logger = logging.getLogger("adapters.engine_mlx")

SLOW_STEP_S = 0.1  # a step this long is kept in `slow_steps` with where its time went
_SLOW_STEPS_KEPT = 32
# The kinds of work timed: a whole step, then its parts ("decode_rows" counts rows, not seconds)
KINDS = ("step", "decode_build", "decode_rows", "prefill_chunks", "prefill_batched", "prefill_stacked",
         "launch", "readback", "other_job")


@dataclass(frozen=True, slots=True)
class SlowStep:
    """One step that took `SLOW_STEP_S` or more: what it computed and where its time went."""

    at: float  # time.time() when it ended
    seconds: float
    decode_rows: int
    prefill_units: int
    new_traces: int  # slot-step shapes traced in this step (each a graph build, then MLX's compile)
    parts: tuple[tuple[str, float], ...]  # (profile kind, seconds in this step), largest first


class DeviceProfile:
    """The device thread's time by kind (see the module's paragraph). Only the device thread
    writes it; another thread reads a copy of `spent` (one assignment per update)."""

    def __init__(self) -> None:
        self.spent: dict[str, tuple[int, float]] = {kind: (0, 0.0) for kind in KINDS}
        self.slow_steps: deque[SlowStep] = deque(maxlen=_SLOW_STEPS_KEPT)  # the latest slow steps

    def account(self, what: str, started: float, calls: int = 1) -> None:
        """`calls` of `what` took the time since `started` (time.perf_counter())."""
        calls_before, seconds = self.spent[what]
        self.spent[what] = (calls_before + calls, seconds + time.perf_counter() - started)

    def count(self, what: str, calls: int) -> None:
        """`calls` more of `what`, untimed."""
        calls_before, _ = self.spent[what]
        self.spent[what] = (calls_before + calls, 0.0)

    def seconds(self) -> dict[str, float]:
        """Seconds so far by kind: what a step's parts are measured from."""
        return {kind: seconds for kind, (_, seconds) in self.spent.items()}

    def step_ended(self, elapsed: float, rows: int, units: int, spent_before: dict[str, float],
                   new_traces: int) -> None:
        """A step of `elapsed` seconds ended: kept with its parts when it was slow."""
        if elapsed < SLOW_STEP_S:
            return
        parts = sorted(((kind, seconds - spent_before[kind]) for kind, (_, seconds) in self.spent.items()
                        if kind not in ("step", "decode_rows") and seconds > spent_before[kind]),
                       key=lambda part: -part[1])
        self.slow_steps.append(SlowStep(time.time(), elapsed, rows, units, new_traces, tuple(parts)))
        where = ", ".join(f"{kind} {seconds * 1000:.0f} ms" for kind, seconds in parts)
        logger.debug("slow step: %.0f ms, %d decode rows, %d prefill units, %d new traces, %s",
                     elapsed * 1000, rows, units, new_traces, where)
