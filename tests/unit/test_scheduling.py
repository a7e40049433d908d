"""The engine's scheduling policy (statecore.scheduling): tables for the exact plans, hypothesis for
the properties — work units cover every layer of every chunk once, in order, within their size;
the budget is never exceeded, the oldest prompt always advances, and every prompt reaches its
first token within a bounded number of steps; the choices of one request join a batch together."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statecore.scheduling import (
    KvAdmission,
    PrefillUnit,
    PrefillWork,
    StepBudget,
    StepPlan,
    WaitingPrefill,
    bucketed,
    joining_choices,
    kv_admission,
    padding_groups,
    plan_step,
    prefill_chunks,
    prefill_units,
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


@pytest.mark.parametrize(("tokens", "bucket", "expected"),
                         [(1, 0, 1), (130, 1, 130), (1, 128, 128), (128, 128, 128), (129, 128, 256)])
def test_bucketed_rounds_up_to_a_multiple(tokens: int, bucket: int, expected: int) -> None:
    assert bucketed(tokens, bucket) == expected


@pytest.mark.parametrize(
    ("chunks", "layers", "unit_tokens", "expected"),
    [
        # A chunk that fits is one unit of every layer.
        ((16, 1), 4, 16, [(0, 0, 4, 16), (1, 0, 4, 1)]),
        # 1,535 tokens over 6 layers, 512 a unit: two layers a unit.
        ((1535, 1), 6, 512, [(0, 0, 2, 512), (0, 2, 4, 512), (0, 4, 6, 512), (1, 0, 6, 1)]),
        # Less than one layer's worth still takes a whole layer.
        ((16, 16, 1), 2, 4, [(0, 0, 1, 8), (0, 1, 2, 8), (1, 0, 1, 8), (1, 1, 2, 8), (2, 0, 2, 1)]),
        # Slices as even as the layers allow: 7 layers, at most 3 a unit -> 2, 2, 3.
        ((70, 1), 7, 30, [(0, 0, 2, 20), (0, 2, 4, 20), (0, 4, 7, 30), (1, 0, 7, 1)]),
    ],
)
def test_prefill_units_table(chunks: tuple[int, ...], layers: int, unit_tokens: int,
                             expected: list[tuple[int, int, int, int]]) -> None:
    assert prefill_units(chunks, layers, unit_tokens) == tuple(PrefillUnit(*u) for u in expected)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 2048), st.integers(1, 80), st.integers(1, 4096))
def test_prefill_units_cover_every_layer_once_in_order(prompt: int, chunk: int, layers: int,
                                                       unit_tokens: int) -> None:
    chunks = prefill_chunks(prompt, chunk)
    units = prefill_units(chunks, layers, unit_tokens)
    walked = [(u.chunk, layer) for u in units for layer in range(u.first_layer, u.end_layer)]
    assert walked == [(c, layer) for c in range(len(chunks)) for layer in range(layers)]
    for unit in units:
        assert unit.end_layer > unit.first_layer
        one_layer = -(-chunks[unit.chunk] // layers)
        assert unit.tokens <= max(unit_tokens, one_layer)
    for index, size in enumerate(chunks):
        mine = [u.tokens for u in units if u.chunk == index]
        assert size <= sum(mine) < size + len(mine)  # rounded up, never lost


def wait(rid: str, order: int, *units: int) -> WaitingPrefill:
    return WaitingPrefill(rid, order, units)


@pytest.mark.parametrize(
    ("decode_rows", "waiting", "budget", "expected"),
    [
        # Nothing waits: every decode row, nothing else.
        (5, [], StepBudget(100, 8), StepPlan(5, ())),
        # Oldest first, whole units: "a" takes two of its units, "b" its first, "c" nothing.
        (4, [wait("b", 2, 30, 10), wait("a", 1, 40, 20, 50), wait("c", 3, 50, 1)], StepBudget(100, 8),
         StepPlan(4, (PrefillWork("a", 2, 60, False), PrefillWork("b", 1, 30, False)))),
        # A unit that does not fit is passed over; a later, smaller one may use the room.
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
@given(prompts, st.integers(1, 64), st.integers(1, 6), st.integers(0, 32), st.integers(1, 8),
       st.integers(1, 200))
def test_no_prompt_starves_and_the_budget_holds(lengths: list[int], chunk: int, layers: int,
                                                decode_rows: int, rows: int, room: int) -> None:
    # The engine's rule: the budget covers the largest decode batch plus its largest unit.
    unit_tokens = max(room, -(-chunk // layers))
    budget = StepBudget(decode_rows + unit_tokens, rows)
    waiting = {f"r{i}": wait(f"r{i}", i, *(u.tokens for u in prefill_units(prefill_chunks(n, chunk), layers,
                                                                              unit_tokens)))
               for i, n in enumerate(lengths)}
    total_units = sum(len(w.units_left) for w in waiting.values())
    steps = 0
    while waiting:
        steps += 1
        assert steps <= total_units, "some prompt made no progress"
        plan = plan_step(decode_rows, list(waiting.values()), budget)
        assert plan.tokens <= budget.tokens
        assert len(plan.prefills) <= rows
        oldest = min(waiting.values(), key=lambda w: w.order)
        assert plan.prefills and plan.prefills[0].request_id == oldest.request_id
        for work in plan.prefills:
            prompt = waiting[work.request_id]
            assert work.tokens == sum(prompt.units_left[: work.units])
            left = prompt.units_left[work.units :]
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


# ---------------------------------------------------------------------------------------------
# The choices of one request (n > 1) join a padded batch together


@pytest.mark.parametrize(("choices", "arrived", "ended", "waited", "joining"), [
    (2, {0}, set(), 0.0, ()),  # choice 1 is still on its way
    (2, {1, 0}, set(), 0.0, (0, 1)),  # all here: together, in choice order
    (3, {2, 0}, {1}, 0.0, (0, 2)),  # choice 1 ended at its first token
    (3, {0}, {1}, 0.0, ()),
    (2, {0}, set(), 0.5, ()),
    (2, {1}, set(), 2.0, (1,)),  # choice 0 was not seen here for the whole patience
    (2, set(), {0}, 9.0, ()),  # nobody to join
    (1, {0}, set(), 0.0, (0,)),
])
def test_joining_choices_table(choices: int, arrived: set[int], ended: set[int], waited: float,
                               joining: tuple[int, ...]) -> None:
    assert joining_choices(choices, arrived, ended, waited, patience_s=2.0) == joining


@given(st.integers(1, 8), st.sets(st.integers(0, 7)), st.sets(st.integers(0, 7)), st.floats(0.0, 10.0))
def test_joining_choices_join_all_arrived_at_once_or_none(choices: int, arrived: set[int], ended: set[int],
                                                         waited: float) -> None:
    arrived, ended = {c for c in arrived if c < choices}, {c for c in ended if c < choices} - arrived
    joining = joining_choices(choices, arrived, ended, waited, patience_s=2.0)
    assert joining in ((), tuple(sorted(arrived)))
    if arrived and (len(arrived) + len(ended) == choices or waited >= 2.0):
        assert joining == tuple(sorted(arrived))  # never waits for nothing, never past its patience
