"""Injected faults say where they fired, and mark exactly the requests a test means: a phase on
any node's request, one choice of an n > 1 request, or a request's first attempt only (a peer's
failure the router retries elsewhere)."""

from __future__ import annotations

import pytest

from effects.faults import ENABLE_ENV, Faults, Phase
from statecore.errors import Code, Fault, StatecoreError


def armed(monkeypatch: pytest.MonkeyPatch, *specs: str, where: str = "decode") -> Faults:
    monkeypatch.setenv(ENABLE_ENV, "1")
    faults = Faults.parse(specs, where=where)
    assert isinstance(faults, Faults)
    return faults


async def fired(faults: Faults, phase: Phase, request_id: str) -> StatecoreError | None:
    try:
        await faults.at(phase, request_id)
    except StatecoreError as exc:
        return exc
    return None


async def test_a_typed_fault_names_its_phase_and_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    faults = armed(monkeypatch, "prefill", "install", where="prefill")
    error = await fired(faults, Phase.PREFILL, "req-inject-fault-prefill-1")
    assert error is not None and error.info.code is Code.INJECTED_FAULT and error.info.fault is Fault.BUG
    assert error.info.message == "injected fault at prefill on the prefill node"
    assert await fired(faults, Phase.INSTALL, "req-inject-fault-prefill-1") is None  # another phase
    assert await fired(faults, Phase.PREFILL, "req-2") is None  # not marked


async def test_a_tag_with_a_choice_marks_that_choice_only(monkeypatch: pytest.MonkeyPatch) -> None:
    faults = armed(monkeypatch, "prefill")
    rid = "r-inject-fault-prefill.choice1-x"
    assert await fired(faults, Phase.PREFILL, rid) is None  # choice 0 is the request id itself
    assert await fired(faults, Phase.PREFILL, f"{rid}.1") is not None
    assert await fired(faults, Phase.PREFILL, f"{rid}.2") is None


async def test_a_peer_fault_fails_the_first_attempt_only(monkeypatch: pytest.MonkeyPatch) -> None:
    faults = armed(monkeypatch, "prefill:peer")
    error = await fired(faults, Phase.PREFILL, "r-inject-fault-peer-prefill-3")
    assert error is not None and error.info.fault is Fault.PEER  # the router retries a peer's failure
    assert "at prefill on the decode node" in error.info.message
    assert await fired(faults, Phase.PREFILL, "r-inject-fault-peer-prefill-3.retry1") is None
    assert await fired(faults, Phase.PREFILL, "r-inject-fault-prefill-3") is None  # not armed as `fail`
