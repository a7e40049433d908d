"""Every machine's transitions: the single source of truth.

Each machine is a `Machine`: its phases, initial and terminal phases, the declared edges
`(phase, event kind) -> Edge(target, intents, code)`, and the rule for pairs nobody
declared. `Machine.table` expands that rule into a *total* table, so `step`, the diagram
exporter, the spec comparison and the model tests all read the same data and no transition
is hand-coded anywhere else. This module must never import trio, httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Generic, TypeVar

from statecore.errors import Code
from statecore.events import EventKind
from statecore.intents import IntentKind
from statecore.phases import (
    DECODE_TERMINAL,
    LOOP_TERMINAL,
    PEER_TERMINAL,
    PREFILL_TERMINAL,
    ROUTER_TERMINAL,
    DecodePhase,
    LoopPhase,
    PeerPhase,
    PrefillPhase,
    RouterPhase,
)

P = TypeVar("P", bound=enum.Enum)

E = EventKind
I = IntentKind  # noqa: E741 - short alias keeps the tables readable


class Undeclared(enum.Enum):
    """What a machine does with a (phase, event) pair its table does not declare."""

    FAIL_REQUEST = "fail_request"  # move to the failure phase with ILLEGAL_TRANSITION
    REPORT_BUG = "report_bug"  # stay, and report an IllegalTransition bug


@dataclass(frozen=True, slots=True)
class Edge(Generic[P]):
    target: P
    intents: tuple[IntentKind, ...] = ()
    code: Code | None = None  # the failure code when the event carries no error of its own
    declared: bool = True


@dataclass(frozen=True)
class Machine(Generic[P]):
    name: str
    title: str
    phases: type[P]
    initial: P
    terminal: frozenset[P]
    failure: P | None
    cancelled: P | None
    undeclared: Undeclared
    # intents that free what a phase holds; prepended on every failure edge out of it
    cleanup: Mapping[P, tuple[IntentKind, ...]]
    declared: Mapping[tuple[P, EventKind], Edge[P]] = field(default_factory=dict)
    # what an event for a request this node does not hold (never opened, or already ended) asks
    # for: a question that must be answered whatever the request's fate; any other such event
    # is absorbed
    absent: Mapping[EventKind, tuple[IntentKind, ...]] = field(default_factory=dict)

    @cached_property
    def table(self) -> Mapping[tuple[P, EventKind], Edge[P]]:
        """The total table: every (phase, event kind) pair has exactly one edge."""
        total: dict[tuple[P, EventKind], Edge[P]] = {}
        for phase, kind in itertools.product(self.all_phases, EventKind):
            total[(phase, kind)] = self.declared.get((phase, kind)) or self._undeclared(phase)
        return total

    @property
    def all_phases(self) -> tuple[P, ...]:
        return tuple(self.phases)

    def edge(self, phase: P, kind: EventKind) -> Edge[P]:
        return self.table[(phase, kind)]

    def is_terminal(self, phase: P) -> bool:
        return phase in self.terminal

    def is_unsuccessful(self, phase: P) -> bool:
        """A terminal phase that carries an error (failed or cancelled)."""
        return phase is self.failure or phase is self.cancelled

    def _undeclared(self, phase: P) -> Edge[P]:
        if phase in self.terminal:
            return Edge(phase, (), None, declared=False)  # terminal phases absorb
        if self.undeclared is Undeclared.FAIL_REQUEST and self.failure is not None:
            intents = (*self.cleanup.get(phase, ()), I.REJECT)
            return Edge(self.failure, intents, Code.ILLEGAL_TRANSITION, declared=False)
        return Edge(phase, (I.REPORT_BUG,), Code.ILLEGAL_TRANSITION, declared=False)


def _request_machine(
    *,
    name: str,
    title: str,
    phases: type[P],
    initial: P,
    terminal: frozenset[P],
    failure: P,
    cancelled: P,
    cleanup: Mapping[P, tuple[IntentKind, ...]],
    progress: Iterable[tuple[P, EventKind, Edge[P]]],
    timeout_code: Mapping[P, Code] | None = None,
    absent: Mapping[EventKind, tuple[IntentKind, ...]] | None = None,
) -> Machine[P]:
    """A request machine: the progress edges, plus failure and cancellation from every
    non-terminal phase, each carrying that phase's cleanup intents."""
    edges: dict[tuple[P, EventKind], Edge[P]] = {}
    for phase, kind, edge in progress:
        key = (phase, kind)
        if key in edges:
            raise ValueError(f"{name}: edge {phase.name} x {kind.name} declared twice")
        edges[key] = edge
    timeouts = timeout_code or {}
    for phase in phases:
        if phase in terminal:
            continue
        free = cleanup.get(phase, ())
        cancel_target_intents = (*free,) if cancelled is not failure else (*free, I.REJECT)
        failing: dict[EventKind, Edge[P]] = {
            E.PEER_FAILED: Edge(failure, (*free, I.REJECT)),
            E.ENGINE_FAILED: Edge(failure, (*free, I.REJECT)),
            E.REJECTED: Edge(failure, (*free, I.REJECT)),
            E.TRANSPORT_LOST: Edge(failure, (*free, I.REJECT), Code.TRANSPORT_LOST),
            E.TIMER_FIRED: Edge(failure, (*free, I.REJECT), timeouts.get(phase, Code.TIMEOUT)),
            E.CLIENT_CANCELLED: Edge(cancelled, cancel_target_intents, Code.CANCELLED),
        }
        for kind, edge in failing.items():
            edges.setdefault((phase, kind), edge)
    return Machine(
        name=name,
        title=title,
        phases=phases,
        initial=initial,
        terminal=terminal,
        failure=failure,
        cancelled=cancelled,
        undeclared=Undeclared.FAIL_REQUEST,
        cleanup=cleanup,
        declared=edges,
        absent=absent or {},
    )


R = RouterPhase
ROUTER_REQUEST: Machine[RouterPhase] = _request_machine(
    name="request_router",
    title="Request on the router",
    phases=RouterPhase,
    initial=R.INTAKE,
    terminal=ROUTER_TERMINAL,
    failure=R.FAILED,
    cancelled=R.CANCELLED,
    cleanup={
        R.ROUTED: (I.CANCEL_TIMER, I.CANCEL_REMOTE),
        R.PREFILLING: (I.CANCEL_TIMER, I.CANCEL_REMOTE),
        R.HANDING_OFF: (I.CANCEL_TIMER, I.CANCEL_REMOTE),
        R.DECODING: (I.CANCEL_TIMER, I.CANCEL_REMOTE),
    },
    progress=[
        (R.INTAKE, E.ADMITTED, Edge(R.ROUTED, (I.ARM_DEADLINE, I.START_PREFILL))),
        (R.ROUTED, E.DISPATCHED, Edge(R.PREFILLING)),
        # a new attempt frees what the failed one held on its nodes before it starts (inside
        # START_PREFILL, so that can never race with the new attempt)
        (R.ROUTED, E.RETRY, Edge(R.ROUTED, (I.START_PREFILL,))),
        (R.PREFILLING, E.RETRY, Edge(R.ROUTED, (I.START_PREFILL,))),
        (R.PREFILLING, E.FIRST_TOKEN, Edge(R.HANDING_OFF, (I.RESPOND_TOKEN, I.START_DECODE))),
        (R.PREFILLING, E.FINISHED, Edge(R.DONE, (I.CANCEL_TIMER, I.CANCEL_REMOTE, I.COMPLETE))),
        (R.HANDING_OFF, E.DECODE_STARTED, Edge(R.DECODING)),
        (R.HANDING_OFF, E.TOKEN, Edge(R.DECODING, (I.RESPOND_TOKEN,))),
        (R.HANDING_OFF, E.FINISHED, Edge(R.DONE, (I.CANCEL_TIMER, I.CANCEL_REMOTE, I.COMPLETE))),
        (R.HANDING_OFF, E.STOP_MATCHED, Edge(R.DONE, (I.CANCEL_TIMER, I.CANCEL_REMOTE, I.COMPLETE))),
        (R.DECODING, E.TOKEN, Edge(R.DECODING, (I.RESPOND_TOKEN,))),
        (R.DECODING, E.FINISHED, Edge(R.DONE, (I.CANCEL_TIMER, I.COMPLETE))),
        (R.DECODING, E.STOP_MATCHED, Edge(R.DONE, (I.CANCEL_TIMER, I.CANCEL_REMOTE, I.COMPLETE))),
    ],
)

F = PrefillPhase
PREFILL_REQUEST: Machine[PrefillPhase] = _request_machine(
    name="request_prefill",
    title="Request on a prefill node",
    phases=PrefillPhase,
    initial=F.INTAKE,
    terminal=PREFILL_TERMINAL,
    failure=F.FAILED,
    cancelled=F.CANCELLED,
    cleanup={
        F.PREFILL: (I.CANCEL_TIMER, I.RELEASE_KV),
        F.HANDOFF: (I.CANCEL_TIMER, I.RELEASE_KV),
    },
    progress=[
        (F.INTAKE, E.ADMITTED, Edge(F.PREFILL, (I.ARM_DEADLINE, I.START_PREFILL))),
        (F.PREFILL, E.PREFILL_DONE, Edge(F.HANDOFF, (I.ARM_LEASE, I.RESPOND_TOKEN))),
        # a pull is answered in every phase: with the KV once it is held, else refused (a pull
        # too early leaves the request alone); a pull for a request not held here is `absent`'s
        (F.INTAKE, E.KV_REQUESTED, Edge(F.INTAKE, (I.REFUSE_KV,))),
        (F.PREFILL, E.KV_REQUESTED, Edge(F.PREFILL, (I.REFUSE_KV,))),
        (F.HANDOFF, E.KV_REQUESTED, Edge(F.HANDOFF, (I.SEND_KV,))),
        (F.HANDOFF, E.KV_TAKEN, Edge(F.DONE, (I.CANCEL_TIMER, I.RELEASE_KV))),
        # the router's request ended at its first token (EOS, max_tokens 1, a stop string):
        # a normal end, not a cancellation
        (F.HANDOFF, E.STOP_MATCHED, Edge(F.DONE, (I.CANCEL_TIMER, I.RELEASE_KV))),
    ],
    timeout_code={F.HANDOFF: Code.LEASE_EXPIRED},
    absent={E.KV_REQUESTED: (I.REFUSE_KV,)},
)

D = DecodePhase
DECODE_REQUEST: Machine[DecodePhase] = _request_machine(
    name="request_decode",
    title="Request on a decode node",
    phases=DecodePhase,
    initial=D.INTAKE,
    terminal=DECODE_TERMINAL,
    failure=D.FAILED,
    cancelled=D.CANCELLED,
    cleanup={
        D.PREFILLING_LOCALLY: (I.CANCEL_TIMER, I.RELEASE_KV),
        D.RECEIVING_KV: (I.CANCEL_TIMER, I.CANCEL_REMOTE),
        D.INSTALLING: (I.CANCEL_TIMER, I.CANCEL_REMOTE, I.STOP_DECODING),
        D.DECODING: (I.CANCEL_TIMER, I.STOP_DECODING),
    },
    progress=[
        (D.INTAKE, E.ADMITTED, Edge(D.RECEIVING_KV, (I.ARM_DEADLINE, I.FETCH_KV))),
        (D.INTAKE, E.PREFILL_LOCALLY, Edge(D.PREFILLING_LOCALLY, (I.ARM_DEADLINE, I.START_PREFILL))),
        # the router's request ended (a stop string in the first token) before this node decoded
        (D.INTAKE, E.STOP_MATCHED, Edge(D.DONE, (I.COMPLETE,))),
        (D.RECEIVING_KV, E.STOP_MATCHED, Edge(D.DONE, (I.CANCEL_TIMER, I.RELEASE_KV, I.COMPLETE))),
        (D.PREFILLING_LOCALLY, E.PREFILL_DONE, Edge(D.INSTALLING, (I.RESPOND_TOKEN, I.INSTALL_KV))),
        (D.PREFILLING_LOCALLY, E.FINISHED, Edge(D.DONE, (I.CANCEL_TIMER, I.RELEASE_KV, I.COMPLETE))),
        (D.RECEIVING_KV, E.KV_RECEIVED, Edge(D.INSTALLING, (I.INSTALL_KV,))),
        # a streamed handoff: the first token arrives amid the KV and is passed on at once; a first
        # token that ends the request (EOS) ends it once the stream is in
        (D.RECEIVING_KV, E.PREFILL_DONE, Edge(D.RECEIVING_KV, (I.RESPOND_TOKEN,))),
        (D.RECEIVING_KV, E.FINISHED, Edge(D.DONE, (I.CANCEL_TIMER, I.RELEASE_KV, I.COMPLETE))),
        (D.INSTALLING, E.KV_INSTALLED, Edge(D.DECODING, (I.RELEASE_KV, I.START_DECODE))),
        (D.INSTALLING, E.FINISHED, Edge(D.DONE, (I.CANCEL_TIMER, I.RELEASE_KV, I.COMPLETE))),
        (D.INSTALLING, E.STOP_MATCHED,
         Edge(D.DONE, (I.CANCEL_TIMER, I.STOP_DECODING, I.RELEASE_KV, I.COMPLETE))),
        (D.DECODING, E.TOKEN, Edge(D.DECODING, (I.RESPOND_TOKEN,))),
        (D.DECODING, E.FINISHED, Edge(D.DONE, (I.CANCEL_TIMER, I.COMPLETE))),
        (D.DECODING, E.STOP_MATCHED, Edge(D.DONE, (I.CANCEL_TIMER, I.STOP_DECODING, I.COMPLETE))),
    ],
)

L = LoopPhase
_LOOP_EDGES: dict[tuple[LoopPhase, EventKind], Edge[LoopPhase]] = {
    # admission: only a serving loop takes new requests (statecore.policy.admission reads these)
    (L.STARTING, E.REQUEST_OPENED): Edge(L.STARTING, (I.REFUSE_REQUEST,)),
    (L.SERVING, E.REQUEST_OPENED): Edge(L.SERVING, (I.ADMIT_REQUEST,)),
    (L.DRAINING, E.REQUEST_OPENED): Edge(L.DRAINING, (I.REFUSE_REQUEST,)),
    (L.STARTING, E.LOOP_READY): Edge(L.SERVING, (I.START_ACCEPTING,)),
    (L.STARTING, E.DRAIN_REQUESTED): Edge(L.STOPPED, (I.STOP_LOOP,)),
    (L.STARTING, E.TRANSPORT_LOST): Edge(L.STOPPED, (I.STOP_LOOP,)),
    # a request's failure is handled inside `serving`: the loop records it and goes on
    (L.SERVING, E.PEER_FAILED): Edge(L.SERVING),
    (L.SERVING, E.ENGINE_FAILED): Edge(L.SERVING),
    (L.SERVING, E.REJECTED): Edge(L.SERVING),
    (L.SERVING, E.DRAIN_REQUESTED): Edge(L.DRAINING, (I.STOP_ACCEPTING, I.ARM_DRAIN)),
    (L.SERVING, E.TRANSPORT_LOST): Edge(L.STOPPED, (I.STOP_ACCEPTING, I.STOP_LOOP)),
    (L.DRAINING, E.PEER_FAILED): Edge(L.DRAINING),
    (L.DRAINING, E.ENGINE_FAILED): Edge(L.DRAINING),
    (L.DRAINING, E.REJECTED): Edge(L.DRAINING),
    (L.DRAINING, E.DRAIN_REQUESTED): Edge(L.DRAINING),
    (L.DRAINING, E.DRAIN_COMPLETE): Edge(L.STOPPED, (I.STOP_LOOP,)),
    (L.DRAINING, E.TIMER_FIRED): Edge(L.STOPPED, (I.STOP_LOOP,)),
    (L.DRAINING, E.TRANSPORT_LOST): Edge(L.STOPPED, (I.STOP_LOOP,)),
}
SERVING_LOOP: Machine[LoopPhase] = Machine(
    name="role_loop",
    title="Serving-role loop",
    phases=LoopPhase,
    initial=L.STARTING,
    terminal=LOOP_TERMINAL,
    failure=None,
    cancelled=None,
    undeclared=Undeclared.REPORT_BUG,
    cleanup={},
    declared=_LOOP_EDGES,
)

H = PeerPhase
_GO_DOWN = Edge(H.DOWN, (I.MARK_UNAVAILABLE, I.ARM_COOLDOWN))
_PEER_EDGES: dict[tuple[PeerPhase, EventKind], Edge[PeerPhase]] = {
    (H.UNKNOWN, E.PROBE_SUCCEEDED): Edge(H.UP, (I.MARK_AVAILABLE,)),
    # never seen up: a node still starting, probed again every interval rather than after a
    # down node's cooldown (a router started beside its nodes routes within an interval of them)
    (H.UNKNOWN, E.PROBE_FAILED): Edge(H.UNKNOWN),
    (H.UNKNOWN, E.TRANSPORT_LOST): _GO_DOWN,
    (H.UNKNOWN, E.TIMER_FIRED): Edge(H.UNKNOWN),
    (H.UP, E.PROBE_SUCCEEDED): Edge(H.UP),
    (H.UP, E.PROBE_FAILED): Edge(H.SUSPECT),
    (H.UP, E.PEER_FAILED): Edge(H.SUSPECT),
    (H.UP, E.TRANSPORT_LOST): Edge(H.SUSPECT),
    (H.UP, E.TIMER_FIRED): Edge(H.UP),
    (H.SUSPECT, E.PROBE_SUCCEEDED): Edge(H.UP),
    (H.SUSPECT, E.PROBE_FAILED): _GO_DOWN,
    # a request's failure only raises suspicion; the node's own health probe decides "down"
    (H.SUSPECT, E.PEER_FAILED): Edge(H.SUSPECT),
    (H.SUSPECT, E.TRANSPORT_LOST): _GO_DOWN,
    (H.SUSPECT, E.TIMER_FIRED): Edge(H.SUSPECT),
    # half-open: a down peer is probed only once its cooldown has passed
    (H.DOWN, E.TIMER_FIRED): Edge(H.PROBING, (I.SEND_PROBE,)),
    (H.DOWN, E.PROBE_SUCCEEDED): Edge(H.DOWN),
    (H.DOWN, E.PROBE_FAILED): Edge(H.DOWN),
    (H.DOWN, E.PEER_FAILED): Edge(H.DOWN),
    (H.DOWN, E.TRANSPORT_LOST): Edge(H.DOWN),
    (H.PROBING, E.PROBE_SUCCEEDED): Edge(H.UP, (I.MARK_AVAILABLE,)),
    (H.PROBING, E.PROBE_FAILED): Edge(H.DOWN, (I.ARM_COOLDOWN,)),
    (H.PROBING, E.PEER_FAILED): Edge(H.DOWN, (I.ARM_COOLDOWN,)),
    (H.PROBING, E.TRANSPORT_LOST): Edge(H.DOWN, (I.ARM_COOLDOWN,)),
    (H.PROBING, E.TIMER_FIRED): Edge(H.PROBING),
}
PEER_HEALTH: Machine[PeerPhase] = Machine(
    name="peer_health",
    title="Peer health as the router sees it",
    phases=PeerPhase,
    initial=H.UNKNOWN,
    terminal=PEER_TERMINAL,
    failure=None,
    cancelled=None,
    undeclared=Undeclared.REPORT_BUG,
    cleanup={},
    declared=_PEER_EDGES,
)

REQUEST_MACHINES = {
    m.name: m for m in (ROUTER_REQUEST, PREFILL_REQUEST, DECODE_REQUEST)
}
MACHINES: dict[str, Machine[RouterPhase] | Machine[PrefillPhase] | Machine[DecodePhase]
               | Machine[LoopPhase] | Machine[PeerPhase]] = {
    ROUTER_REQUEST.name: ROUTER_REQUEST,
    PREFILL_REQUEST.name: PREFILL_REQUEST,
    DECODE_REQUEST.name: DECODE_REQUEST,
    SERVING_LOOP.name: SERVING_LOOP,
    PEER_HEALTH.name: PEER_HEALTH,
}

__all__ = [
    "DECODE_REQUEST",
    "MACHINES",
    "PEER_HEALTH",
    "PREFILL_REQUEST",
    "REQUEST_MACHINES",
    "ROUTER_REQUEST",
    "SERVING_LOOP",
    "Edge",
    "Machine",
    "Undeclared",
]
