"""Hypothesis strategies for every event type, and a spec-driven oracle for the tables."""

from __future__ import annotations

from pathlib import Path

from hypothesis import strategies as st

from statecore.errors import Code, ErrorInfo, Fault
from statecore.events import (
    Admitted,
    ClientCancelled,
    DecodeStarted,
    Dispatched,
    DrainComplete,
    DrainRequested,
    EngineFailed,
    Event,
    EventKind,
    Finished,
    FirstToken,
    KvInstalled,
    KvReceived,
    KvRequested,
    KvTaken,
    LoopReady,
    PeerFailed,
    PrefillDone,
    PrefillLocally,
    ProbeFailed,
    ProbeSucceeded,
    Rejected,
    RequestOpened,
    RetryRequested,
    StopMatched,
    Timer,
    TimerFired,
    TokensGenerated,
    TransportLost,
)
from statecore.spec import MachineSpec, load_spec

SPECS = Path(__file__).resolve().parents[2] / "specs"

errors = st.builds(ErrorInfo, st.sampled_from(Fault), st.sampled_from(Code), st.text(max_size=20))
tokens = st.integers(min_value=0, max_value=50_000)

# One strategy per event kind: the model tests draw a kind the spec allows, then its payload.
EVENTS_BY_KIND: dict[EventKind, st.SearchStrategy[Event]] = {
    EventKind.ADMITTED: st.builds(Admitted, st.integers(0, 5000)),
    EventKind.REJECTED: st.builds(Rejected, errors),
    EventKind.DISPATCHED: st.just(Dispatched()),
    EventKind.PREFILL_DONE: st.builds(PrefillDone, tokens, st.integers(0, 1 << 30)),
    EventKind.FIRST_TOKEN: st.builds(FirstToken, tokens),
    EventKind.DECODE_STARTED: st.just(DecodeStarted()),
    EventKind.TOKEN: st.builds(TokensGenerated, st.lists(tokens, min_size=1, max_size=4).map(tuple)),
    EventKind.FINISHED: st.builds(Finished, st.sampled_from(["stop", "length"])),
    EventKind.STOP_MATCHED: st.builds(StopMatched, st.sampled_from(["stop", "length"])),
    EventKind.RETRY: st.builds(RetryRequested, errors),
    EventKind.PREFILL_LOCALLY: st.just(PrefillLocally()),
    EventKind.KV_REQUESTED: st.just(KvRequested()),
    EventKind.KV_TAKEN: st.just(KvTaken()),
    EventKind.KV_RECEIVED: st.builds(KvReceived, st.integers(0, 1 << 30)),
    EventKind.KV_INSTALLED: st.just(KvInstalled()),
    EventKind.PEER_FAILED: st.builds(PeerFailed, errors),
    EventKind.ENGINE_FAILED: st.builds(EngineFailed, errors),
    EventKind.CLIENT_CANCELLED: st.just(ClientCancelled()),
    EventKind.TIMER_FIRED: st.builds(TimerFired, st.sampled_from(Timer)),
    EventKind.TRANSPORT_LOST: st.builds(TransportLost, st.text(max_size=10)),
    EventKind.REQUEST_OPENED: st.just(RequestOpened()),
    EventKind.LOOP_READY: st.just(LoopReady()),
    EventKind.DRAIN_REQUESTED: st.just(DrainRequested()),
    EventKind.DRAIN_COMPLETE: st.just(DrainComplete()),
    EventKind.PROBE_SUCCEEDED: st.just(ProbeSucceeded()),
    EventKind.PROBE_FAILED: st.builds(ProbeFailed, st.text(max_size=10)),
}
events: st.SearchStrategy[Event] = st.one_of(*EVENTS_BY_KIND.values())


def spec(name: str) -> MachineSpec:
    return load_spec(SPECS / f"{name}.toml")


def expected_target(machine_spec: MachineSpec, phase: str, event_kind: str) -> str:
    """What the spec says a phase becomes on an event (the oracle for the model tests)."""
    if phase in machine_spec.terminal:
        return phase
    edge = machine_spec.edges().get((phase, event_kind))
    if edge is not None:
        return edge.target
    if machine_spec.undeclared == "fail_request":
        return "failed"
    return phase

_ERROR = ErrorInfo(Fault.PEER, Code.PEER_FAILED, "sample")
SAMPLE_EVENTS: dict[type[Event], Event] = {
    type(e): e
    for e in (
        Admitted(3), Rejected(_ERROR), Dispatched(), PrefillDone(1, 10), FirstToken(1),
        DecodeStarted(), TokensGenerated((2,)), Finished("stop"), StopMatched(),
        RetryRequested(_ERROR), PrefillLocally(), KvRequested(), KvTaken(), KvReceived(10),
        KvInstalled(), PeerFailed(_ERROR), EngineFailed(_ERROR), ClientCancelled(),
        TimerFired(Timer.DEADLINE), TransportLost(), RequestOpened(), LoopReady(), DrainRequested(),
        DrainComplete(), ProbeSucceeded(), ProbeFailed(),
    )
}
