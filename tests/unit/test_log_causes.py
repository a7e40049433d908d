"""Every peer marked down and every retry the client never sees logs its cause (issue 36): the
router's peer-health line names the failure or the probe's answer, and `RetryLogged` writes one
INFO line per retry with the error that caused it."""

from __future__ import annotations

import logging

import pytest
import trio

from adapters.serve.logs import RetryLogged
from effects.health import PeerSet
from effects.interpret import RouterPerformer
from statecore.errors import Code, peer_error
from statecore.events import Event, PeerFailed, ProbeFailed, ProbeSucceeded, RetryRequested
from statecore.ids import RequestId
from statecore.intents import StartPrefill


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


class _Retrying(RouterPerformer):
    """A router performer whose every attempt fails before the client saw a token."""

    def __init__(self) -> None:  # nothing of the real one is used
        pass

    async def work(self, intent: object, context: object, post: object) -> None:
        assert callable(post)
        await post(RetryRequested(peer_error("the prefill node answered 502", Code.PEER_FAILED)))


def test_a_retry_logs_its_cause(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="statecore")
    posted: list[Event] = []

    async def post(event: Event) -> None:
        posted.append(event)

    intent = StartPrefill(RequestId("r-7"))
    trio.run(RetryLogged(_Retrying()).work, intent, None, post)
    assert [type(e) for e in posted] == [RetryRequested]
    (line,) = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert line == "request r-7: retrying on another node after peer_failed: the prefill node answered 502"
