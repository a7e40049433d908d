"""Engine-node settings read from the environment: bad values warn and fall back, never crash."""

from __future__ import annotations

import pytest

from adapters.serve import ENGINE_SWITCH_INTERVAL, _switch_interval


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, ENGINE_SWITCH_INTERVAL),
        ("0.002", 0.002),
        ("1", 1.0),
        ("abc", ENGINE_SWITCH_INTERVAL),
        ("0", ENGINE_SWITCH_INTERVAL),
        ("-1", ENGINE_SWITCH_INTERVAL),
        ("nan", ENGINE_SWITCH_INTERVAL),
        ("5", ENGINE_SWITCH_INTERVAL),
    ],
)
def test_switch_interval(raw: str | None, expected: float) -> None:
    assert _switch_interval(raw) == expected
