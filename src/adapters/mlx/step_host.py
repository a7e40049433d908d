"""What a step executor works on: the step on the device (`InFlight`, read back after the next is
built) and the device loop as the executor sees it (`ExecutorHost`), shared by the executor and
what handles a step that failed on the device. Types only: this module imports mlx only through
the types it names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from adapters.mlx.batch_lane import BatchLane
from adapters.mlx.choices import ChoiceGathering
from adapters.mlx.jobs import Outcome
from adapters.mlx.keeping import PrefixKeeping
from adapters.mlx.kv_out import Captured
from adapters.mlx.memory import KvCost
from adapters.mlx.prefill import PrefillTask
from adapters.mlx.prefix_cache import PrefixCache
from adapters.mlx.profile import DeviceProfile
from adapters.mlx.requests import RequestTable
from adapters.mlx.rows import Deliveries, Live
from adapters.mlx.settings import Settings
from adapters.mlx.slot_lane import SlotLane
from adapters.mlx.solo_lane import SoloLane
from adapters.mlx.speculative import SpeculationHost, Speculator
from statecore.engine_schedule import Stacking
from statecore.errors import StatecoreError
from statecore.scheduling import ModelShape, StepRates

__all__ = ["ExecutorHost", "InFlight"]


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
    # streamed handoffs' pieces it cut out (`kv_out.capture_pieces`)
    segments: Captured = field(default_factory=list)


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
    stacking: Stacking | None
    shape: ModelShape | None
    cost: KvCost
    rates: StepRates
    handoff_joined: bool
    joins_early: bool  # on the CPU a step's slot rows are read back before the other lanes step
    publish: Callable[[], None]
    cache_bytes: Callable[[list[Any]], int]

    handoffs_coming: dict[str, float]
    handoffs_expected: dict[str, float]

    def drop_abandoned_waiting(self) -> None: ...

    def hand_out(self, deliveries: Deliveries,
                 finished: list[tuple[PrefillTask, Outcome[Any]]] = ...) -> None: ...
