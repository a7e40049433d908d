"""What a node says when it starts: a warning when its internal endpoints are open beyond
loopback without a token (repeated in /health), and hypercorn's lines once, not twice."""

from __future__ import annotations

import argparse
import logging

import httpx
import pytest
import trio
from hypercorn.logging import Logger

from adapters.frontend.app import build_app
from adapters.frontend.frontend import Frontend
from adapters.serve.listeners import open_listener
from adapters.serve.logs import setup_logging
from adapters.serve.node import exposure_warning, hypercorn_config, warn_if_exposed
from tests.integration.fake_backend import FakeBackend


def test_a_loopback_node_or_one_with_a_token_says_nothing() -> None:
    with open_listener("127.0.0.1", 0) as local, open_listener("0.0.0.0", 0) as wide:
        assert exposure_warning(local, None, "prefill") is None
        assert exposure_warning(wide, "s3cret", "prefill") is None


def test_a_node_open_beyond_loopback_without_a_token_warns(caplog: pytest.LogCaptureFixture) -> None:
    with open_listener("0.0.0.0", 0) as wide, caplog.at_level(logging.WARNING, "statecore"):
        warnings = warn_if_exposed(wide, None, "decode")
    assert len(warnings) == 1 and "0.0.0.0" in warnings[0] and "--internal-token" in warnings[0]
    assert [r.getMessage() for r in caplog.records] == warnings


def test_health_repeats_the_start_up_warnings() -> None:
    frontend = Frontend(None, FakeBackend())
    app = build_app(frontend)

    async def health() -> dict[str, object]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            response = await client.get("/health")
            assert response.status_code == 200
            body: dict[str, object] = response.json()
            return body

    assert trio.run(health) == {"status": "ok"}
    frontend.warnings = ["internal endpoints are open on 0.0.0.0 without a token"]
    assert trio.run(health) == {"status": "ok", "warnings": frontend.warnings}


def test_hypercorn_lines_come_out_once(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(argparse.Namespace(log_json=False, log_level="INFO"), "single")
    with open_listener("127.0.0.1", 0) as sock:
        config = hypercorn_config(sock)
        trio.run(Logger(config).info, "Running on http://127.0.0.1:1 (CTRL + C to quit)")
    err = capsys.readouterr().err
    assert err.count("Running on") == 1, err
