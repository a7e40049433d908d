"""The engine's scheduling policy (statecore.scheduling): tables for the exact plans, hypothesis for
the properties — the budget is never exceeded, the oldest prompt always advances, and every
prompt reaches its first token within a bounded number of steps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statecore.scheduling import (
    KvAdmission,
    PrefillWork,
    StepBudget,
    StepPlan,
    WaitingPrefill,
    kv_admission,
    padding_groups,
    plan_step,
    prefill_chunks,
)


@pytest.mark.parametrize(
    ("prompt", "chunk", "expected"),
    [
        (1, 16, (1,)),
        (2, 16, (1, 1)),
        (17, 16, (16, 1)),
        (18, 16, (16, 1, 1)),
        (40, 16, (16, 16, 7, 1)),
    ],
)
def test_prefill_chunks_follow_generate_step(prompt: int, chunk: int, expected: tuple[int, ...]) -> None:
    assert prefill_chunks(prompt, chunk) == expected
    assert sum(expected) == prompt


def wait(rid: str, order: int, *chunks: int) -> WaitingPrefill:
    return WaitingPrefill(rid, order, chunks)


@pytest.mark.parametrize(
    ("decode_rows", "waiting", "budget", "expected"),
    [
        # Nothing waits: every decode row, nothing else.
        (5, [], StepBudget(100, 8), StepPlan(5, ())),
        # Oldest first, whole chunks: "a" takes two of its chunks, "b" its first, "c" nothing.
        (4, [wait("b", 2, 30, 10), wait("a", 1, 40, 20, 50), wait("c", 3, 50, 1)], StepBudget(100, 8),
         StepPlan(4, (PrefillWork("a", 2, 60, False), PrefillWork("b", 1, 30, False)))),
        # A chunk that does not fit is passed over; a later, smaller one may use the room.
        (0, [wait("a", 1, 80, 1), wait("b", 2, 30, 1), wait("c", 3, 19, 1)], StepBudget(100, 8),
         StepPlan(0, (PrefillWork("a", 2, 81, True), PrefillWork("c", 1, 19, False)))),
        # The row cap: at most two prompts advance.
        (0, [wait("a", 1, 1), wait("b", 2, 1), wait("c", 3, 1)], StepBudget(100, 2),
         StepPlan(0, (PrefillWork("a", 1, 1, True), PrefillWork("b", 1, 1, True)))),
    ],
)
def test_plan_step_table(decode_rows: int, waiting: list[WaitingPrefill], budget: StepBudget,
                         expected: StepPlan) -> None:
    assert plan_step(decode_rows, waiting, budget) == expected


prompts = st.lists(st.integers(1, 300), min_size=0, max_size=12)


@settings(max_examples=200, deadline=None)
@given(prompts, st.integers(1, 64), st.integers(0, 32), st.integers(1, 8), st.integers(0, 200))
def test_no_prompt_starves_and_the_budget_holds(lengths: list[int], chunk: int, decode_rows: int,
                                                rows: int, slack: int) -> None:
    # The engine's rule: the budget covers the largest decode batch plus one chunk.
    budget = StepBudget(decode_rows + chunk + slack, rows)
    waiting = {f"r{i}": wait(f"r{i}", i, *prefill_chunks(n, chunk)) for i, n in enumerate(lengths)}
    total_chunks = sum(len(w.chunks_left) for w in waiting.values())
    steps = 0
    while waiting:
        steps += 1
        assert steps <= total_chunks, "some prompt made no progress"
        plan = plan_step(decode_rows, list(waiting.values()), budget)
        assert plan.tokens <= budget.tokens
        assert len(plan.prefills) <= rows
        oldest = min(waiting.values(), key=lambda w: w.order)
        assert plan.prefills and plan.prefills[0].request_id == oldest.request_id
        for work in plan.prefills:
            prompt = waiting[work.request_id]
            assert work.tokens == sum(prompt.chunks_left[: work.chunks])
            left = prompt.chunks_left[work.chunks :]
            assert work.finishes == (not left)
            if left:
                waiting[work.request_id] = WaitingPrefill(prompt.request_id, prompt.order, left)
            else:
                del waiting[work.request_id]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 2000), max_size=40), st.floats(0.0, 1.0), st.integers(1, 8))
def test_padding_groups_partition_within_the_bound(lengths: list[int], waste: float, rows: int) -> None:
    groups = padding_groups(lengths, waste, rows)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        assert 1 <= len(group) <= rows
        real = sum(lengths[i] for i in group)
        padded = max(lengths[i] for i in group) * len(group)
        assert len(group) == 1 or padded - real <= waste * real + 1e-9


def test_equal_lengths_share_one_group() -> None:
    assert padding_groups([5, 5, 5], 0.0, 8) == [[0, 1, 2]]
    assert padding_groups([5, 9, 5], 0.0, 8) == [[0, 2], [1]]


# ---------------------------------------------------------------------------------------------
# KV memory admission


@pytest.mark.parametrize(("need", "reserved", "fixed", "budget", "verdict"), [
    (10, 0, 0, 10, KvAdmission.FITS),  # exactly full
    (11, 0, 0, 10, KvAdmission.NEVER),
    (5, 6, 0, 10, KvAdmission.LATER),  # others hold it now
    (5, 0, 6, 10, KvAdmission.NEVER),  # the set-aside share is never given back
    (4, 0, 6, 10, KvAdmission.FITS),
    (0, 10, 0, 10, KvAdmission.FITS),  # a request that needs nothing more always fits
])
def test_kv_admission_table(need: int, reserved: int, fixed: int, budget: int, verdict: KvAdmission) -> None:
    assert kv_admission(need, reserved, fixed, budget) is verdict


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6))
def test_kv_admission_never_overcommits_and_never_means_never(need: int, reserved: int, fixed: int,
                                                             budget: int) -> None:
    verdict = kv_admission(need, reserved, fixed, budget)
    if verdict is KvAdmission.FITS:
        assert fixed + reserved + need <= budget
    # NEVER does not depend on what others hold; LATER turns into FITS once they leave.
    assert (verdict is KvAdmission.NEVER) == (kv_admission(need, 0, fixed, budget) is KvAdmission.NEVER)
    if verdict is KvAdmission.LATER:
        assert kv_admission(need, 0, fixed, budget) is KvAdmission.FITS


def test_kv_admission_refuses_negative_counts() -> None:
    with pytest.raises(ValueError):
        kv_admission(-1, 0, 0, 10)
