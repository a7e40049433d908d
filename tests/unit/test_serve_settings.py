"""Node settings: engine settings read from the environment (bad values warn and fall back, never
crash), and the flags a local cluster hands on to its children."""

from __future__ import annotations

import pytest

from adapters.cli import build_parser
from adapters.serve import ENGINE_SWITCH_INTERVAL, _forwarded_serving_flags, _switch_interval


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


def test_a_local_cluster_hands_every_flag_set_to_its_children_but_the_secret_and_socket() -> None:
    args = build_parser().parse_args([
        "run", "--log-json", "--log-level", "DEBUG", "--max-in-flight", "7", "--kv-lease", "5",
        "--inject-fault", "prefill", "--inject-fault", "install:slow=1", "--force-disaggregation",
        "--internal-token", "s3cret", "--listen-fd", "5", "--max-batch", "32",  # 32: the default
    ])
    forwarded = _forwarded_serving_flags(args)
    assert forwarded == [  # in the order the flags are declared
        "--force-disaggregation", "--kv-lease", "5.0", "--max-in-flight", "7",
        "--inject-fault", "prefill", "--inject-fault", "install:slow=1",
        "--log-json", "--log-level", "DEBUG",
    ]
    assert "s3cret" not in forwarded and "--listen-fd" not in forwarded
    assert build_parser().parse_args(["run", *forwarded]).max_in_flight == 7  # children accept them


def test_a_default_cluster_hands_nothing_on() -> None:
    assert _forwarded_serving_flags(build_parser().parse_args(["run"])) == []
