"""The serving-role loop as a pure machine that hosts many requests.

`LoopState` holds the loop's own record and every live request's record. `loop_step` routes
one envelope: a loop event goes through the loop's table (and, for `TransportLost`, to every
live request too); a request event goes to that request alone, so one request's failure can
change no other; an event for a request not live is absorbed, unless the machine's `absent`
rule answers it (a KV pull for a request this node does not hold). A request that reaches a
terminal phase leaves the live set and its outcome is counted; a draining loop with nothing
live finishes its drain. Only `TransportLost` or a finished drain stops the loop. This module
must never import trio, httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from statecore.errors import client_error
from statecore.events import DrainComplete, Event, TransportLost
from statecore.ids import RequestId
from statecore.intents import Intent, Reject
from statecore.phases import LoopPhase
from statecore.policy import admission
from statecore.step import (
    LoopRecord,
    RequestRecord,
    new_request,
    outcome_reason,
    step_absent,
    step_loop,
    step_request,
)
from statecore.table import Machine

P = TypeVar("P", bound=enum.Enum)


@dataclass(frozen=True, slots=True)
class ForLoop:
    """An event for the loop itself."""

    event: Event


@dataclass(frozen=True, slots=True)
class ForRequest:
    """An event for one request."""

    request_id: RequestId
    event: Event


@dataclass(frozen=True, slots=True)
class OpenRequest:
    """A new request arrives at intake."""

    request_id: RequestId


Envelope = ForLoop | ForRequest | OpenRequest


@dataclass(frozen=True, slots=True)
class LoopState(Generic[P]):
    machine: Machine[P]
    loop: LoopRecord = field(default_factory=LoopRecord)
    live: Mapping[RequestId, RequestRecord[P]] = field(default_factory=dict)
    # Only the requests that reached a terminal phase in the last step: the host counts them.
    # Keeping every outcome ever would make each step copy a map that grows without bound.
    settled: Mapping[RequestId, RequestRecord[P]] = field(default_factory=dict)

    @property
    def stopped(self) -> bool:
        return self.loop.phase is LoopPhase.STOPPED

    @property
    def accepting(self) -> bool:
        return self.loop.phase is LoopPhase.SERVING

    def outcome(self, request_id: RequestId) -> str | None:
        """Why a request that reached a terminal phase in the last step ended, in the same words
        on every node (`statecore.step.outcome_reason`); None for any other request."""
        record = self.settled.get(request_id)
        return None if record is None else outcome_reason(self.machine, record)


def new_loop(machine: Machine[P]) -> LoopState[P]:
    return LoopState(machine=machine)


def _settle(state: LoopState[P], record: RequestRecord[P]) -> LoopState[P]:
    """Put a moved request back: live if not terminal, settled (this step) if it is."""
    live = dict(state.live)
    if state.machine.is_terminal(record.phase):
        live.pop(record.request_id, None)
        return replace(state, live=live, settled={**state.settled, record.request_id: record})
    live[record.request_id] = record
    return replace(state, live=live)


def _finish_drain(state: LoopState[P], intents: list[Intent]) -> LoopState[P]:
    if state.loop.phase is LoopPhase.DRAINING and not state.live:
        loop, more = step_loop(state.loop, DrainComplete())
        intents.extend(more)
        return replace(state, loop=loop)
    return state


def loop_step(state: LoopState[P], envelope: Envelope) -> tuple[LoopState[P], list[Intent]]:
    """Route one envelope. Total and pure: never raises, whatever the envelope."""
    intents: list[Intent] = []
    if state.settled:
        state = replace(state, settled={})
    match envelope:
        case OpenRequest(request_id=rid):
            refused = admission(state.loop.phase, len(state.live))
            if refused is not None:
                return state, [Reject(rid, refused)]
            if rid in state.live:
                return state, [Reject(rid, client_error(f"duplicate request id {rid!r}"))]
            state = _settle(state, new_request(state.machine, rid))
        case ForRequest(request_id=rid, event=event):
            record = state.live.get(rid)
            if record is None:  # a late event is absorbed; a question (a KV pull) is answered
                return state, step_absent(state.machine, rid, event)
            moved, intents = step_request(state.machine, record, event)
            state = _settle(state, moved)
        case ForLoop(event=event):
            loop, intents = step_loop(state.loop, event)
            state = replace(state, loop=loop)
            if isinstance(event, TransportLost) and loop.phase is LoopPhase.STOPPED:
                for record in list(state.live.values()):
                    moved, more = step_request(state.machine, record, event)
                    intents.extend(more)
                    state = _settle(state, moved)
    state = _finish_drain(state, intents)
    return state, intents


__all__ = [
    "Envelope",
    "ForLoop",
    "ForRequest",
    "LoopState",
    "OpenRequest",
    "loop_step",
    "new_loop",
]
