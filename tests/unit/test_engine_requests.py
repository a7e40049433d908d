"""The device loop's request table: one record per request, and every map the loop reads a view
of it (a request is in exactly the views its phase names, and leaves them all when it leaves)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from hypothesis import given
from hypothesis import strategies as st

from adapters.mlx.prefill import PrefillTask
from adapters.mlx.requests import EngineRequest, Held, RequestTable
from adapters.mlx.rows import Live
from statecore.engine_schedule import EnginePhase, Finish

TASK = cast(PrefillTask, object())
LIVE = cast(Live, SimpleNamespace(request_id="a"))
HELD = Held([], 3, 100)

# phase -> the views a record of it is in
VIEWS: dict[EnginePhase, set[str]] = {
    EnginePhase.WAITING: {"waiting"},
    EnginePhase.PREFILLING: {"waiting"},
    EnginePhase.KEEPING: {"waiting"},
    EnginePhase.PREFILLED: set(),
    EnginePhase.HELD: {"held"},
    EnginePhase.GATHERING: {"live", "gathering"},
    EnginePhase.RUNNING: {"live"},
}


def record(rid: str, phase: EnginePhase, reserved: int = 0) -> EngineRequest:
    fields: dict[str, Any] = {"task": TASK, "held": HELD if phase is EnginePhase.HELD else None,
                              "live": LIVE if phase in (EnginePhase.GATHERING, EnginePhase.RUNNING) else None}
    return EngineRequest(rid, phase, reserved=reserved, **fields)


def views(table: RequestTable, rid: str) -> set[str]:
    return {name for name in ("waiting", "held", "live", "gathering") if rid in getattr(table, name)}


def test_each_phase_is_in_the_views_it_names() -> None:
    for phase, expected in VIEWS.items():
        table = RequestTable()
        table.add(record("r", phase))
        assert views(table, "r") == expected, phase


def test_holding_a_dropped_request_brings_it_back_without_a_reservation() -> None:
    """A prefill read back after its request was cancelled is held again, reserving nothing
    (the caller's undo releases it)."""
    table = RequestTable()
    table.hold("r", HELD)
    assert table["r"].phase is EnginePhase.HELD and table.reserved_bytes == 0 and table.held["r"] is HELD


def test_joining_moves_a_request_to_the_end_and_drops_its_task_and_cache() -> None:
    table = RequestTable()
    table.add(record("a", EnginePhase.HELD, reserved=10))
    table.add(record("b", EnginePhase.WAITING, reserved=5))
    joined = table.join(LIVE, "batch", None)
    assert [rid for rid, _ in table.items()] == ["b", "a"]
    assert joined.phase is EnginePhase.RUNNING and joined.lane == "batch" and joined.reserved == 10
    assert joined.task is None and joined.held is None and table.live["a"] is LIVE


@given(st.lists(st.tuples(st.sampled_from(list(EnginePhase)), st.integers(0, 1000), st.booleans()),
                max_size=12))
def test_the_views_and_reservations_follow_the_records(steps: list[tuple[EnginePhase, int, bool]]) -> None:
    """Whatever records come and go, each view holds exactly the records of its phases, in table
    order, and the reserved bytes are the records' sum."""
    table = RequestTable()
    for index, (phase, reserved, leaves) in enumerate(steps):
        rid = f"r{index % 5}"
        if leaves:
            table.remove(rid, Finish.CANCELLED)
        else:
            table.add(record(rid, phase, reserved))
        records = table.records()
        for name in ("waiting", "held", "live", "gathering"):
            expected = [r.request_id for r in records if name in VIEWS[r.phase]]
            assert list(getattr(table, name)) == expected
        assert table.reserved_bytes == sum(r.reserved for r in records)
        assert table.reserved == {r.request_id: r.reserved for r in records if r.reserved}


def test_a_request_leaves_with_its_finish_and_is_counted_by_it() -> None:
    """Leaving is the one way out of the table and names how: the record that left says it, the
    table counts it, and a request that had no record counts nothing."""
    table = RequestTable()
    table.add(record("a", EnginePhase.RUNNING, reserved=7))
    table.add(record("b", EnginePhase.WAITING))
    left = table.remove("a", Finish.LENGTH)
    assert left is not None and left.finish is Finish.LENGTH and "a" not in table
    assert table.remove("a", Finish.CANCELLED) is None
    table.clear(Finish.FAILED)
    assert len(table) == 0 and table.finished == {Finish.LENGTH: 1, Finish.FAILED: 1}
