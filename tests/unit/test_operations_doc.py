"""docs/operations.md documents every flag of `statecore run` and every metric family."""

from __future__ import annotations

import argparse
from pathlib import Path

from adapters.cli import build_parser
from adapters.metrics import Metrics
from effects.fakes import FakeEngine
from effects.health import PeerSet
from effects.interpret import EnginePerformer
from effects.runner import NodeRunner
from statecore.table import DECODE_REQUEST

DOC = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()


def test_every_run_flag_is_documented() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    run = sub.choices["run"]
    flags = [o for action in run._actions for o in action.option_strings if o.startswith("--")]
    missing = [f for f in flags if f != "--help" and f"`{f}" not in DOC]
    assert not missing, f"flags missing from docs/operations.md: {missing}"


def test_every_metric_family_is_documented() -> None:
    metrics = Metrics("prefill")
    engine = FakeEngine()

    async def probe(url: str) -> bool:
        return True

    runner = NodeRunner(DECODE_REQUEST, EnginePerformer(engine))
    metrics.watch(runner, engine=engine, peers=PeerSet({"decode": ["http://d"]}, probe),
                  kv_buffer_bytes=lambda: 0)
    names = {metric.name for metric in metrics.registry.collect()}
    assert names
    missing = sorted(n for n in names if f"`{n}" not in DOC)
    assert not missing, f"metrics missing from docs/operations.md: {missing}"
