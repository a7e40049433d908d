"""Every peer marked down and every retry the client never sees logs its cause (issue 36): the
router's peer-health line names the failure or the probe's answer, and `RetryLines` (an
instrument of the router's runner) writes one INFO line per retry with the error that caused it."""

from __future__ import annotations

import logging

import pytest

from adapters.serve.logs import RetryLines
from effects.health import PeerSet
from statecore.errors import Code, peer_error
from statecore.events import PeerFailed, PrefillLocally, ProbeFailed, ProbeSucceeded, RetryRequested
from statecore.ids import RequestId


async def _healthy(url: str) -> bool:
    return True


def test_a_peer_marked_suspect_then_down_names_why(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="statecore.health")
    peers = PeerSet({"decode": ["http://d"]}, _healthy)
    peers.feed("http://d", ProbeSucceeded())
    peers.feed("http://d", PeerFailed(peer_error("connection refused", Code.TRANSPORT_LOST)))
    peers.feed("http://d", ProbeFailed("health check failed"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[1] == "peer http://d: up -> suspect on peer_failed (transport_lost: connection refused)"
    assert lines[2] == "peer http://d: suspect -> down on probe_failed (health check failed)"


def test_a_retry_logs_its_cause(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="statecore")
    lines = RetryLines()
    cause = peer_error("the prefill node answered 502", Code.PEER_FAILED)
    lines.applied(RequestId("r-7"), RetryRequested(cause), None)
    lines.applied(RequestId("r-7"), PrefillLocally(), None)  # any other event: nothing to say
    (line,) = [r.getMessage() for r in caplog.records if r.name.startswith("statecore")]
    assert line == "request r-7: retrying on another node after peer_failed: the prefill node answered 502"
