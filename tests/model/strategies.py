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
    TokenGenerated,
    TransportLost,
)
from statecore.spec import MachineSpec, load_spec

SPECS = Path(__file__).resolve().parents[2] / "specs"

errors = st.builds(ErrorInfo, st.sampled_from(Fault), st.sampled_from(Code), st.text(max_size=20))
tokens = st.integers(min_value=0, max_value=50_000)

events: st.SearchStrategy[Event] = st.one_of(
    st.builds(Admitted, st.integers(0, 5000)),
    st.builds(Rejected, errors),
    st.just(Dispatched()),
    st.builds(PrefillDone, tokens, st.integers(0, 1 << 30)),
    st.builds(FirstToken, tokens),
    st.just(DecodeStarted()),
    st.builds(TokenGenerated, tokens),
    st.builds(Finished, st.sampled_from(["stop", "length"])),
    st.just(StopMatched()),
    st.builds(RetryRequested, errors),
    st.just(PrefillLocally()),
    st.just(KvRequested()),
    st.just(KvTaken()),
    st.builds(KvReceived, st.integers(0, 1 << 30)),
    st.just(KvInstalled()),
    st.builds(PeerFailed, errors),
    st.builds(EngineFailed, errors),
    st.just(ClientCancelled()),
    st.builds(TimerFired, st.sampled_from(Timer)),
    st.builds(TransportLost, st.text(max_size=10)),
    st.just(RequestOpened()),
    st.just(LoopReady()),
    st.just(DrainRequested()),
    st.just(DrainComplete()),
    st.just(ProbeSucceeded()),
    st.builds(ProbeFailed, st.text(max_size=10)),
)


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
        DecodeStarted(), TokenGenerated(2), Finished("stop"), StopMatched(),
        RetryRequested(_ERROR), PrefillLocally(), KvRequested(), KvTaken(), KvReceived(10),
        KvInstalled(), PeerFailed(_ERROR), EngineFailed(_ERROR), ClientCancelled(),
        TimerFired(Timer.DEADLINE), TransportLost(), RequestOpened(), LoopReady(), DrainRequested(),
        DrainComplete(), ProbeSucceeded(), ProbeFailed(),
    )
}
