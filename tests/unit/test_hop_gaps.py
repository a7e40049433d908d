"""`bench/handoff/hop_gaps.py`, the reader that says at which hop a stream's gap was made: gaps per
request, inside and outside the handoff windows, in the decode engine's step, and a window's longest
gap in the steps after its join. Made-up timelines whose answers are worked out by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest


def _load() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "handoff" / "hop_gaps.py"
    spec = importlib.util.spec_from_file_location("hop_gaps", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hop_gaps = _load()


def test_gaps_are_taken_within_a_request_never_across_two() -> None:
    assert hop_gaps.gaps_of({"a": [0.0, 1.0, 1.0, 3.0], "b": [10.0, 11.0]}) == [
        (0.0, 1.0), (1.0, 1.0), (1.0, 3.0), (10.0, 11.0)]


def test_percentile_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert hop_gaps.percentile(values, 99) == 99.0
    assert hop_gaps.percentile(values, 100) == 100.0
    assert hop_gaps.percentile([5.0], 99) == 5.0


def test_figures_split_the_gaps_by_the_windows_in_the_given_step() -> None:
    # a request stepping every 0.1 s, one gap of 0.4 s inside the window [1.0, 1.5], one of
    # 0.3 s far outside it
    moments = [round(0.1 * i, 3) for i in range(11)] + [1.4, 1.5, 1.6, 1.7, 2.0, 2.1]
    gaps = hop_gaps.gaps_of({"r": moments})
    row = hop_gaps.figures(gaps, [(1.0, 1.5)], 0.1)
    # (0.9, 1.0) ends at the window's start: outside; (1.0, 1.4) and (1.4, 1.5) inside; (1.5, 1.6) outside
    assert row["n_in"] == 2 and row["n_out"] == len(gaps) - 2
    assert row["max_in"] == pytest.approx(4.0)
    assert row["max_out"] == pytest.approx(3.0)
    assert row["p99_out"] == pytest.approx(3.0)
    assert hop_gaps.step_outside(gaps, [(1.0, 1.5)]) == pytest.approx(0.1)


def test_a_windows_stall_is_in_the_steps_after_its_join() -> None:
    # steps of 0.1 s, a 0.5 s gap at the join (2.0), then steps of 0.2 s (the batch with the long
    # prompt in it) until the window ends a second after the join
    moments = [1.5, 1.6, 1.7, 1.8, 1.9, 2.4] + [round(2.4 + 0.2 * i, 3) for i in range(1, 4)]
    gaps = hop_gaps.gaps_of({"r": moments})
    assert hop_gaps.joined_stall(gaps, (1.9, 3.0)) == pytest.approx(0.5 / 0.2)
    assert hop_gaps.joined_stall(gaps, (0.0, 1.0)) is None  # no gap lies in its last second


def test_by_hop_reports_every_hop_in_the_decode_engines_step() -> None:
    engine = {"r": [0.1 * i for i in range(30)]}
    # the client's copy of the same tokens, each 0.01 s later, one of them 0.25 s late (outside)
    late = [0.1 * i + 0.01 + (0.25 if i == 10 else 0.0) for i in range(30)]
    rows = hop_gaps.by_hop({"decode applied": engine, "client": {"r": late}}, [(2.0, 2.2)])
    assert list(rows) == ["decode applied", "client"]
    assert rows["decode applied"]["step_ms"] == pytest.approx(100.0)
    assert rows["decode applied"]["max_out"] == pytest.approx(1.0)
    assert rows["client"]["max_out"] == pytest.approx(3.5)  # 0.35 s in steps of 0.1
    assert rows["client"]["max_in"] == pytest.approx(1.0)
    assert "| client |" in hop_gaps.table(rows)


def test_node_hops_drop_the_prefills_first_token_where_it_is_written() -> None:
    decode = {"applied": {"r": [2.0, 3.0], "x": [9.0]}, "read": {"r": [1.0, 2.1, 3.1]}}
    router = {"applied": {"r": [2.2, 3.2]}, "read": {"r": [1.2, 2.3, 3.3]}}
    hops = hop_gaps.node_hops(decode, router, {"r": [1.3, 2.4, 3.4]}, ["r"])
    assert hops == {"decode applied": {"r": [2.0, 3.0]}, "decode read": {"r": [2.1, 3.1]},
                    "router applied": {"r": [2.2, 3.2]}, "router read": {"r": [2.3, 3.3]},
                    "client": {"r": [2.4, 3.4]}}


def test_within_keeps_each_stretch_apart() -> None:
    hops = {"client": {"r": [1.0, 2.0, 3.0, 7.0, 8.0, 12.0]}}
    kept = hop_gaps.within(hops, [(0.0, 2.5), (6.0, 9.0)])
    assert kept == {"client": {"r@0": [1.0, 2.0], "r@1": [7.0, 8.0]}}
    # the 5 s between the stretches is no gap of either
    assert max(b - a for a, b in hop_gaps.gaps_of(kept["client"])) == 1.0


def test_gaps_outside_the_windows_are_split_by_the_busy_spans() -> None:
    # steps of 0.1 s; a 0.3 s gap during a prefill span [0.5, 1.0], a 0.2 s one after it
    moments = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.8, 0.9, 1.1, 1.2, 1.4, 1.5, 1.6]
    gaps = hop_gaps.gaps_of({"r": [round(m, 3) for m in moments]})
    row = hop_gaps.figures(gaps, [], 0.1, busy=[(0.5, 1.0)])
    assert row["n_busy"] == 3 and row["n_idle"] == len(gaps) - 3  # (0.5, 0.8), (0.8, 0.9), (0.9, 1.1)
    assert row["max_busy"] == pytest.approx(3.0)
    assert row["max_idle"] == pytest.approx(2.0)
    assert "p99_busy" not in hop_gaps.figures(gaps, [], 0.1)
