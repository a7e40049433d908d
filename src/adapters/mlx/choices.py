"""The choices of one request (n > 1) at a batched lane: they wait for each other and enter together.

A row's numbers in a batched lane depend on the rows beside it (the batch lane pads them to each
other; a call's row count picks its kernels), so the choices of one request enter their lane in
one step, in choice order, which makes their bytes the same on every run and on every node. A
choice bound for the slot or batch lane *gathers* (its record in phase `gathering`, holding its
prompt's cache) while a sibling may still come; `statecore.scheduling.joining_choices` decides
when the gathered ones enter: once every choice has arrived or ended, or after
`CHOICE_PATIENCE_S` without news of a missing one (it decodes elsewhere, or ended unseen). A
choice that comes after its siblings already decode here enters at once. This module imports
trio only for the types of a delivery; it must never import the device loop (it sees it as a
`ChoiceHost`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from adapters.mlx.jobs import StreamItem, as_statecore
from adapters.mlx.requests import EngineRequest, RequestTable
from adapters.mlx.rows import Deliveries, Live
from effects.engine_port import SamplingParams
from statecore.engine_schedule import EnginePhase
from statecore.scheduling import joining_choices

__all__ = ["CHOICE_PATIENCE_S", "ChoiceGathering", "ChoiceGroup", "ChoiceHost"]

logger = logging.getLogger("adapters.engine_mlx")

# How long the batched lanes' arrived choices of a request wait for a missing one not seen on this
# node (decoding elsewhere, or ended before it came here) before they join without it.
CHOICE_PATIENCE_S = 2.0


@dataclass(eq=False)
class ChoiceGroup:
    """What the choices of one request share while some of them gather: how many there are,
    when a missing one was last known to be on its way here, and which ended without coming
    (the gathering ones are the records in phase `gathering` of this group)."""

    choices: int
    seen: float  # time.monotonic()
    ended: set[int] = field(default_factory=set)


class ChoiceHost(Protocol):
    """What gathering needs of the device loop."""

    requests: RequestTable

    def enter(self, live: Live, cache: list[Any], prompt: list[int], lane: str) -> None: ...

    def end(self, live: Live, item: StreamItem, deliveries: Deliveries) -> None: ...

    def hand_out(self, deliveries: Deliveries) -> None: ...


class ChoiceGathering:
    """The choice groups of the requests gathering on this node (see the module's paragraph)."""

    def __init__(self, host: ChoiceHost) -> None:
        self.host = host
        self.groups: dict[str, ChoiceGroup] = {}

    def waits(self, live: Live) -> bool:
        """A choice reaches its lane: whether it waits for the request's other choices (it then
        gathers), or enters at once (its siblings already decode here)."""
        sampling = live.sampler.sampling
        group = self.groups.get(sampling.choice_group)
        if group is None:
            if any((other.batched or other.slot is not None)
                   and other.sampler.sampling.choice_group == sampling.choice_group
                   for other in self.host.requests.live.values()):
                return False
            group = ChoiceGroup(sampling.choices, time.monotonic())
            self.groups[sampling.choice_group] = group
        group.seen = time.monotonic()
        return True

    def arrived(self, group: str) -> dict[int, EngineRequest]:
        """The gathering choices of a request, by choice."""
        return {record.live.sampler.sampling.choice: record
                for record in self.host.requests.in_phase(EnginePhase.GATHERING)
                if record.live is not None and record.live.sampler.sampling.choice_group == group}

    def ended(self, sampling: SamplingParams | None) -> None:
        """A choice that will not decode here (it ended at its first token, failed, or was
        cancelled): its siblings stop waiting for it."""
        if sampling is None or sampling.choices <= 1:
            return
        group = self.groups.get(sampling.choice_group)
        if group is not None:
            group.ended.add(sampling.choice)
        self.release()

    def left(self, live: Live, record: EngineRequest) -> None:
        """A request left the decoder (its record is gone): a gathering choice counts as ended."""
        sampling = live.sampler.sampling
        group = self.groups.get(sampling.choice_group) if sampling.choices > 1 else None
        if group is not None and record.phase is EnginePhase.GATHERING:
            group.ended.add(sampling.choice)
            if not self.arrived(sampling.choice_group):  # nobody of it waits any more
                del self.groups[sampling.choice_group]

    def release(self) -> None:
        """Every request whose arrived choices may enter their lane now enters it: in one step, in
        choice order (in the slot lane each takes the lowest free slot, so the same ones)."""
        now = time.monotonic()
        for key, group in list(self.groups.items()):
            arrived = self.arrived(key)
            missing = set(range(group.choices)) - set(arrived) - group.ended
            if missing and self.on_their_way(key, missing):
                group.seen = now
            joining = joining_choices(group.choices, arrived, group.ended, now - group.seen,
                                      CHOICE_PATIENCE_S)
            if not joining:
                continue
            del self.groups[key]
            deliveries: Deliveries = {}
            for choice in joining:
                record = arrived[choice]
                live, lane = record.live, record.lane
                assert live is not None and lane is not None and record.arrived is not None
                cache, prompt = record.arrived
                try:
                    self.host.enter(live, cache, prompt, lane)
                except Exception as exc:  # this choice fails (its slot's copy kept raising), nothing else
                    logger.exception("request %s could not enter the %s lane", live.request_id, lane)
                    self.host.end(live, as_statecore(exc), deliveries)
                    continue
                record.phase, record.arrived = EnginePhase.RUNNING, None
                if lane == "slot":
                    record.reserved = 0  # its KV lives in the pool now
            self.host.hand_out(deliveries)

    def on_their_way(self, group: str, choices: set[int]) -> bool:
        """Whether one of a request's `choices` is prefilling here, or prefilled and held here."""
        requests = self.host.requests
        samplings = [task.sampler.sampling for task in requests.waiting.values()]
        samplings += [held.sampling for held in requests.held.values() if held.sampling is not None]
        return any(s.choice_group == group and s.choice in choices for s in samplings)

    def timeout(self) -> float | None:
        """Seconds until the first gathering request's patience ends (None: nobody waits)."""
        if not self.groups:
            return None
        now = time.monotonic()
        return max(0.0, min(group.seen + CHOICE_PATIENCE_S - now for group in self.groups.values()))
