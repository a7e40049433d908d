"""The engine's step as data (statecore.engine_schedule): tables for exact plans (decode rows first,
the oldest prompts' units, padded groups of short prompts, lanes), and hypothesis against the KV
state for the properties the device loop relies on: the token budget is never exceeded, the
memory budget never but by the oldest prompt's lone unit, only keep tasks give way to memory
(no decode row, no request), and schedule -> update reaches every prompt's first token within a
bounded number of steps (no starvation); the engine's other decisions (admission and what gives
way to it, a failed prefill's fate, a decode-only step) by table, admission also by hypothesis."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statecore.engine_schedule import (
    HANDOFF_COMING_S,
    HANDOFF_EXPECTED_S,
    Admission,
    Budget,
    Candidate,
    Finish,
    Lane,
    Memory,
    PrefillFailure,
    StackedCall,
    Stacking,
    StepPlan,
    admission,
    choose_lane,
    decode_only,
    prefill_failure,
    schedule,
    update,
)
from statecore.policy import FINISH_REASONS, LENGTH, STOP
from statecore.scheduling import (
    STREAMED_SLICE_TOKENS,
    KvAdmission,
    ModelShape,
    PrefillWork,
    StepRates,
    prefill_chunks,
    prefill_units,
)

SHAPE = ModelShape(hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10, dtype_bytes=4)
LAYERS = 4


def prompt(rid: str, order: int, tokens: int, chunk: int = 16, unit: int = 64, done: int = 0,
           batchable: bool = False, keeps_only: bool = False, blocks: int = 0, stack_key: str | None = None
           ) -> Candidate:
    chunks = prefill_chunks(tokens, chunk)
    return Candidate(rid, order, tokens, chunks, prefill_units(chunks, LAYERS, unit), done, batchable,
                     keeps_only, tuple(bytes([i]) for i in range(blocks)), stack_key)


@pytest.mark.parametrize(
    ("rows", "candidates", "budget", "expected"),
    [
        # nothing waits: every decode row, the configured budget
        (3, [], Budget(100, 8), StepPlan(100, 3)),
        # the oldest first, whatever order they come in; the budget less the rows is what prefill gets
        (2, [prompt("b", 2, 17), prompt("a", 1, 17)], Budget(35, 8),
         StepPlan(35, 2, (PrefillWork("a", 2, 17, True), PrefillWork("b", 1, 16, False)))),
        # a handed-off request joined: decode rows alone
        (2, [prompt("a", 1, 17)], Budget(100, 8, decode_only=True), StepPlan(2, 2)),
        # short prompts finishing together share one padded call (in length order)
        (0, [prompt("a", 1, 17, batchable=True), prompt("b", 2, 16, batchable=True)], Budget(100, 8),
         StepPlan(100, 0, (PrefillWork("a", 2, 17, True), PrefillWork("b", 2, 16, True)), (("b", "a"),))),
        # ... never one that does not finish in this step
        (0, [prompt("a", 1, 17, batchable=True), prompt("b", 2, 17, batchable=True)], Budget(33, 8),
         StepPlan(33, 0, (PrefillWork("a", 2, 17, True), PrefillWork("b", 1, 16, False)))),
    ],
)
def test_schedule_table(rows: int, candidates: list[Candidate], budget: Budget, expected: StepPlan) -> None:
    assert schedule(rows, candidates, budget, max_padding=0.5) == expected


def test_a_step_target_leaves_prefill_what_the_measured_rates_allow() -> None:
    """Beside streams, a target twice the floor at 1 ms a prefill token leaves 5 tokens: the
    oldest prompt's next unit (a whole chunk of 16) still goes, and no more."""
    rates = StepRates(floor_s=0.005, excess_s=0.016, prefill_tokens=16.0)
    plan = schedule(4, [prompt("a", 1, 40)], Budget(100, 8, target_s=0.010, rates=rates), max_padding=0)
    assert plan.budget_tokens == 4 + 16 and plan.prefills == (PrefillWork("a", 1, 16, False),)


def test_a_keep_task_takes_only_capacity_the_streams_leave() -> None:
    """Under a target of 2 floors at 1 ms a prefill token a step beside streams has 5 tokens of
    room: a prompt's next unit (a chunk of 16) goes anyway, a keep task's waits; with nothing
    decoding the keep task advances, a unit at a time (5 tokens fit)."""
    rates = StepRates(floor_s=0.005, excess_s=0.016, prefill_tokens=16.0)
    budget = Budget(100, 8, target_s=None, rates=rates, target_floors=2.0)
    keep = prompt("k#keep", 1 << 40, 40, keeps_only=True)
    beside = schedule(4, [keep], budget, max_padding=0)
    assert beside.budget_tokens == 4 + 5 and beside.prefills == ()
    with_prompt = schedule(4, [prompt("a", 1, 40), keep], budget, max_padding=0)
    assert with_prompt.prefills == (PrefillWork("a", 1, 16, False),)
    idle = schedule(0, [keep], budget, max_padding=0)
    assert idle.budget_tokens == 16 and idle.prefills == (PrefillWork("k#keep", 1, 16, False),)
    fixed = schedule(4, [keep], replace(budget, target_s=0.0), max_padding=0)
    assert fixed.prefills == (PrefillWork("k#keep", 4, 40, True),)


@pytest.mark.parametrize(
    ("plain", "needed", "capacity", "batches", "constrained", "lane"),
    [
        (True, 100, 101, True, False, Lane.SLOT),
        (True, 100, 101, True, True, Lane.SLOT),  # a grammar decodes in the slot lane as any row
        (True, 102, 101, True, False, Lane.BATCH),  # too long for a slot
        (True, 100, None, True, True, Lane.SOLO),  # no slot pool; a grammar keeps a batch's company
        (False, 10, 101, False, False, Lane.SOLO),  # a cache that does not batch
    ],
)
def test_choose_lane(plain: bool, needed: int, capacity: int | None, batches: bool, constrained: bool,
                     lane: Lane) -> None:
    assert choose_lane(plain_kv=plain, needed_tokens=needed, slot_capacity=capacity, batchable=batches,
                       constrained=constrained) is lane


def memory(budget: int, reserved: int = 0, prefix: int = 0) -> Memory:
    return Memory(budget, 0, reserved, prefix, SHAPE, decode_attended=64, kv_per_token=32, cache_step=256)


def test_a_keep_task_gives_way_and_kept_prefixes_are_freed_for_the_oldest_prompt() -> None:
    candidates = [prompt("a", 1, 40), prompt("k#keep", 1 << 40, 48, keeps_only=True)]
    whole = schedule(2, candidates, Budget(500, 8), max_padding=0)
    assert [w.request_id for w in whole.prefills] == ["a", "k#keep"]
    tight = schedule(2, candidates, Budget(500, 8), max_padding=0, memory=memory(4_000, prefix=3_000))
    assert tight.dropped_keeps == ("k#keep",) and tight.evict_prefix_bytes > 0
    assert [w.request_id for w in tight.prefills] == ["a"] and tight.decode_rows == 2


candidate_lists = st.lists(
    st.tuples(st.integers(1, 80), st.booleans(), st.booleans()), min_size=0, max_size=6,
).map(lambda specs: [prompt(f"r{i}", (1 << 40) + i if keep else i, tokens, batchable=short and tokens <= 17,
                            keeps_only=keep)
                     for i, (tokens, short, keep) in enumerate(specs)])


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(0, 8), candidates=candidate_lists, tokens=st.integers(0, 200),
       budget=st.integers(0, 100_000), reserved=st.integers(0, 10_000), prefix=st.integers(0, 10_000))
def test_a_plan_keeps_the_budgets_and_changes_no_request_for_memory(
        rows: int, candidates: list[Candidate], tokens: int, budget: int, reserved: int, prefix: int) -> None:
    # the engine keeps its configured budget >= a full batch + its largest unit
    configured = rows + 64 + tokens
    held = memory(budget, reserved, prefix)
    plan = schedule(rows, candidates, Budget(configured, 4), max_padding=0.5, memory=held)
    by_id = {c.request_id: c for c in candidates}
    assert plan.decode_rows == rows  # every decode row runs; none is ever evicted
    assert plan.tokens <= max(plan.budget_tokens, rows) and plan.budget_tokens <= configured
    assert all(by_id[rid].keeps_only for rid in plan.dropped_keeps)  # only keep tasks give way
    assert not set(plan.dropped_keeps) & {w.request_id for w in plan.prefills}
    assert all(0 < w.units <= len(by_id[w.request_id].units_left) for w in plan.prefills)
    for group in plan.groups:
        assert len(group) > 1 and all(by_id[rid].batchable for rid in group)
    if plan.prefills:
        assert plan.activation_estimate is not None
        free = budget - reserved - max(0, prefix - plan.evict_prefix_bytes)
        if plan.over_budget:  # only the oldest prompt's lone item goes over: its next unit, or
            # (planned into a padded group) its whole short prompt, alone
            (lone,) = plan.prefills
            assert lone.request_id == min(candidates, key=lambda c: c.order).request_id
            assert lone.units == 1 or by_id[lone.request_id].batchable
            assert not plan.groups
        else:
            assert plan.activation_estimate <= free
    requests = [c for c in candidates if not c.keeps_only]
    if requests:  # the oldest request always advances (a keep task only after every request)
        oldest_request = min(requests, key=lambda c: c.order)
        assert any(w.request_id == oldest_request.request_id for w in plan.prefills)


@settings(max_examples=100, deadline=None)
@given(candidates=candidate_lists, rows=st.integers(0, 4), budget=st.integers(0, 20_000))
def test_schedule_then_update_brings_every_prompt_to_its_first_token(
        candidates: list[Candidate], rows: int, budget: int) -> None:
    """No starvation: under any memory budget, steps of schedule -> update finish every request
    within as many steps as it and the requests before it have units (keep tasks may give way)."""
    waiting = list(candidates)
    bound = sum(len(c.units) for c in candidates)
    finished: set[str] = set()
    for _ in range(bound):
        if not waiting:
            break
        plan = schedule(rows, waiting, Budget(rows + 64, 4), max_padding=0.5, memory=memory(budget))
        left, done = update(waiting, plan)
        finished.update(done)
        assert not set(plan.dropped_keeps) & {c.request_id for c in left}  # a dropped keep task is gone
        waiting = list(left)
    assert {c.request_id for c in candidates if not c.keeps_only} <= finished


def test_update_takes_what_was_built_where_it_differs_from_the_plan() -> None:
    """A prompt that found cached blocks during the step is further along than planned; one whose
    call raised starts again from none (and may share a padded call again); the rest ran as
    planned."""
    planned, skipped, raised = prompt("p", 0, 40), prompt("s", 1, 40), prompt("r", 2, 20, batchable=True)
    plan = StepPlan(400, 0, (PrefillWork("p", 1, 16, False), PrefillWork("s", 1, 16, False),
                             PrefillWork("r", len(raised.units), 20, True)))
    left, finished = update([planned, skipped, raised], plan, {"s": len(skipped.units) - 1, "r": 0})
    assert finished == ()
    assert [(c.request_id, c.done_units, c.batchable) for c in left] == [
        ("p", 1, False), ("s", len(skipped.units) - 1, False), ("r", 0, True)]


def test_a_lone_streamed_prompt_goes_in_slices_that_travel_while_the_rest_computes() -> None:
    """At 1 ms a prefill token a slice of STREAMED_SLICE_S is under STREAMED_SLICE_TOKENS: the
    slice is that many tokens; unmeasured, or not streamed, the whole budget."""
    rates = StepRates(floor_s=0.005, excess_s=0.016, prefill_tokens=16.0)
    alone = schedule(0, [prompt("a", 1, 2000)], Budget(4000, 8, rates=rates, oldest_streams=True),
                     max_padding=0)
    assert alone.budget_tokens == STREAMED_SLICE_TOKENS and alone.prefill_tokens <= STREAMED_SLICE_TOKENS
    unmeasured = Budget(4000, 8, oldest_streams=True)
    assert schedule(0, [prompt("a", 1, 2000)], unmeasured, max_padding=0).budget_tokens == 4000
    not_streamed = Budget(4000, 8, rates=rates)
    assert schedule(0, [prompt("a", 1, 2000)], not_streamed, max_padding=0).budget_tokens == 4000


def test_a_prompt_behind_a_streamed_one_waits_rather_than_share_the_step_of_its_first_token() -> None:
    """The oldest prompt streams its KV and a second one arrives: steps stay slices of the
    oldest's, the second taking only what the oldest leaves of one; not streamed, they share the
    configured budget as before."""
    rates = StepRates(floor_s=0.005, excess_s=0.016, prefill_tokens=16.0)
    waiting = [prompt("old", 1, 2000, done=3), prompt("new", 2, 2000)]
    sliced = schedule(0, waiting, Budget(4000, 8, rates=rates, oldest_streams=True), max_padding=0)
    assert [work.request_id for work in sliced.prefills] == ["old"]
    assert sliced.prefill_tokens <= STREAMED_SLICE_TOKENS
    last = [prompt("old", 1, 2000, done=len(waiting[0].units) - 1), prompt("new", 2, 2000)]
    finishing = schedule(0, last, Budget(4000, 8, rates=rates, oldest_streams=True), max_padding=0)
    assert finishing.prefills[0].request_id == "old" and finishing.prefills[0].finishes
    assert finishing.prefill_tokens <= STREAMED_SLICE_TOKENS  # the newcomer's share fits the slice
    shared = schedule(0, waiting, Budget(4000, 8, rates=rates), max_padding=0)
    assert [work.request_id for work in shared.prefills] == ["old", "new"]


FITS, LATER, NEVER = KvAdmission.FITS, KvAdmission.LATER, KvAdmission.NEVER


@pytest.mark.parametrize(("need", "others", "keeping", "pool", "kept", "expected"), [
    (10, 0, 0, 0, 0, Admission(FITS)),  # room: nothing gives way
    (10, 50, 0, 20, 30, Admission(FITS, False, 10)),  # kept prefixes give way as far as it needs
    (10, 50, 20, 45, 0, Admission(FITS, True, 0)),  # later, but fits once the keep tasks go
    (10, 50, 4, 45, 30, Admission(LATER)),  # keep tasks would not make room: nothing gives way
    (10, 0, 0, 95, 30, Admission(NEVER)),  # never fits beside the slot pool
    (10, 50, 20, 20, 30, Admission(FITS, False, 10)),  # prefixes first: the keep tasks stay
])
def test_admission_table(need: int, others: int, keeping: int, pool: int, kept: int,
                         expected: Admission) -> None:
    assert admission(need, others, keeping, pool, kept, 100) == expected


@given(need=st.integers(0, 200), others=st.integers(0, 200), keeping_share=st.floats(0, 1),
       pool=st.integers(0, 200), kept=st.integers(0, 200), budget=st.integers(0, 400))
def test_an_admitted_request_fits_and_a_refused_one_takes_nothing(
        need: int, others: int, keeping_share: float, pool: int, kept: int, budget: int) -> None:
    """Admitted, the request fits beside what stays (no more freed than that takes); refused,
    no kept block nor keep task gives way to it."""
    keeping = int(others * keeping_share)
    decided = admission(need, others, keeping, pool, kept, budget)
    if decided.verdict is not FITS:
        assert decided == Admission(decided.verdict)
        return
    staying = others - (keeping if decided.drop_keep_tasks else 0)
    assert need + staying + pool + kept - decided.evict_prefix_bytes <= budget
    assert decided.evict_prefix_bytes == max(0, need + staying + pool + kept - budget)
    assert not decided.drop_keep_tasks or need + others + pool > budget  # only when it must


@pytest.mark.parametrize(("keeps_only", "retried", "typed", "expected"), [
    (True, False, False, PrefillFailure.GIVE_UP),
    (True, True, True, PrefillFailure.GIVE_UP),
    (False, False, False, PrefillFailure.RESTART),
    (False, True, False, PrefillFailure.FAIL),
    (False, False, True, PrefillFailure.FAIL),
])
def test_prefill_failure_table(keeps_only: bool, retried: bool, typed: bool,
                               expected: PrefillFailure) -> None:
    assert prefill_failure(keeps_only=keeps_only, retried=retried, typed=typed) is expected


@pytest.mark.parametrize(("joined", "arrived", "last_step", "expected"), [
    (False, [], [], False),
    (True, [], [], True),
    (False, [100.0 - HANDOFF_COMING_S / 2], [], True),
    (False, [100.0 - HANDOFF_COMING_S], [], False),  # it never joined: prefill goes on
    # its prefill node computes its last pieces, for longer than a last piece is waited for
    (False, [], [100.0 - HANDOFF_COMING_S * 2], True),
    (False, [], [100.0 - HANDOFF_EXPECTED_S], False),  # that prefill node went quiet
])
def test_decode_only_table(joined: bool, arrived: list[float], last_step: list[float],
                           expected: bool) -> None:
    assert decode_only(joined, arrived, 100.0, last_step) is expected


# -- prompts sharing prefix blocks: one computes a block, the others wait for it to be kept ----------

def blocks_prompt(rid: str, order: int, keys: list[bytes], chunk: int = 16, unit: int = 64, done: int = 0,
                  keeps_only: bool = False) -> Candidate:
    """A prompt of whole chunks named `keys` (the prefix cache's blocks) and its last token."""
    candidate = prompt(rid, order, chunk * len(keys) + 1, chunk, unit, done, keeps_only=keeps_only)
    return Candidate(candidate.request_id, order, candidate.prompt_tokens, candidate.chunks, candidate.units,
                     done, False, keeps_only, tuple(keys))


SYSTEM = [b"s0", b"s1"]
INSIDE_S1 = blocks_prompt("o", 1, [*SYSTEM, b"o"], unit=4, done=6)  # two of s1's four layer slices done
AT_S1 = blocks_prompt("w", 2, [*SYSTEM, b"w"], unit=4, done=4)  # about to start s1


@pytest.mark.parametrize(
    ("candidates", "budget", "waiting"),
    [
        # the other is inside s1 (two of its four layer slices done) and this step finishes it
        # first: the newcomer at s1 starts after it when built ...
        ([INSIDE_S1, AT_S1], Budget(200, 8), ()),
        # ... this step takes one more slice of it: the newcomer waits ...
        ([INSIDE_S1, AT_S1], Budget(4, 8), ("w",)),
        # ... one not sharing it does not
        ([INSIDE_S1, blocks_prompt("x", 2, [b"x0", b"x1"], unit=4)], Budget(200, 8), ()),
        # both at s0, whole blocks: the older computes s0 and s1 first, the other starts after them
        ([blocks_prompt("o", 1, [*SYSTEM, b"o"]), blocks_prompt("w", 2, [*SYSTEM, b"w"])],
         Budget(200, 8), ()),
        # both at s0 in layer slices, a budget for three slices: the older starts s0 and the other waits
        ([blocks_prompt("o", 1, [*SYSTEM, b"o"], unit=4), blocks_prompt("w", 2, [*SYSTEM, b"w"], unit=4)],
         Budget(12, 8), ("w",)),
        # a request never waits for a keep task (optional work, last in line) ...
        ([blocks_prompt("k#keep", 1 << 40, [*SYSTEM, b"k"], unit=4, done=6, keeps_only=True),
          AT_S1], Budget(200, 8), ()),
        # ... and a keep task waits for a request
        ([INSIDE_S1, blocks_prompt("k#keep", 1 << 40, [*SYSTEM, b"k"], unit=4, done=4, keeps_only=True)],
         Budget(4, 8), ("k#keep",)),
    ],
)
def test_block_waits_table(candidates: list[Candidate], budget: Budget, waiting: tuple[str, ...]) -> None:
    plan = schedule(0, candidates, budget, max_padding=0)
    assert plan.waiting_for_blocks == waiting
    assert not set(waiting) & {work.request_id for work in plan.prefills}


def test_a_waiter_computes_the_block_itself_once_its_computer_is_gone() -> None:
    """No starvation: the prompt inside the block is cancelled (it leaves the candidates) or
    starts again from its first chunk (a call raised): the waiter computes the block."""
    owner, waiter = INSIDE_S1, AT_S1
    assert "w" in schedule(0, [owner, waiter], Budget(4, 8), max_padding=0).waiting_for_blocks
    alone = schedule(0, [waiter], Budget(4, 8), max_padding=0)
    assert alone.waiting_for_blocks == () and [work.request_id for work in alone.prefills] == ["w"]
    again = blocks_prompt("o", 1, [*SYSTEM, b"o"], unit=4, done=0)  # it starts from s0 once more
    assert schedule(0, [again, waiter], Budget(4, 8), max_padding=0).waiting_for_blocks == ()


shared_prompts = st.tuples(
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(1, 2)), min_size=1, max_size=6),
    st.sampled_from([4, 8, 64]),
).map(lambda spec: [blocks_prompt(f"r{i}", i, [f"f{family}:{j}".encode() for j in range(shared)]
                                  + [f"r{i}:{j}".encode() for j in range(own)], unit=spec[1])
                    for i, (family, shared, own) in enumerate(spec[0])])


@settings(max_examples=200, deadline=None)
@given(candidates=shared_prompts, tokens=st.integers(16, 80), rows=st.integers(1, 4),
       cancels=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 5)), max_size=3))
def test_a_block_is_computed_once_while_its_computer_lives(
        candidates: list[Candidate], tokens: int, rows: int, cancels: list[tuple[int, int]]) -> None:
    """Against a model of the prefix cache (the blocks kept) and of the executor (every prompt
    about to start a block skips the kept ones, when planned and again when built): no block is
    started while another prompt is inside it or after it was kept; a prompt sharing no block
    with another never waits; every prompt not cancelled reaches its first token (a waiter whose
    computer is cancelled computes the block itself)."""
    kept: set[bytes] = set()
    inside: dict[bytes, str] = {}  # block -> the prompt that started it and has not finished it

    def skip_kept(candidate: Candidate) -> Candidate:
        done = candidate.done_units
        if done >= len(candidate.units) or not candidate.units[done].starts_chunk:
            return candidate
        count = next((i for i, key in enumerate(candidate.block_keys) if key not in kept),
                     len(candidate.block_keys))
        if count <= candidate.units[done].chunk:
            return candidate
        return replace(candidate, done_units=candidate.first_unit_of(count))

    waiting = list(candidates)
    cancelled: set[str] = set()
    finished: set[str] = set()
    for step in range(sum(len(c.units) for c in candidates) + 1):
        for at, index in cancels:
            if at == step and waiting:
                gone = waiting.pop(index % len(waiting))
                cancelled.add(gone.request_id)
                inside = {key: rid for key, rid in inside.items() if rid != gone.request_id}
        if not waiting:
            break
        waiting = [skip_kept(c) for c in waiting]
        plan = schedule(0, waiting, Budget(tokens, rows), max_padding=0)
        for rid in plan.waiting_for_blocks:
            waiter = next(c for c in waiting if c.request_id == rid)
            assert any(set(waiter.block_keys) & set(c.block_keys) for c in waiting if c is not waiter)
        by_id = {c.request_id: c for c in waiting}
        built: dict[str, int] = {}
        for work in plan.prefills:
            candidate = skip_kept(by_id[work.request_id])
            start = candidate.done_units
            for index in range(start, min(start + work.units, len(candidate.units))):
                key = candidate.block_at(index)
                if key is None:
                    continue
                unit = candidate.units[index]
                if unit.starts_chunk:
                    assert key not in kept and inside.get(key, candidate.request_id) == candidate.request_id
                    inside[key] = candidate.request_id
                if index + 1 == len(candidate.units) or candidate.units[index + 1].chunk != unit.chunk:
                    kept.add(key)
                    inside.pop(key, None)
            built[candidate.request_id] = min(start + work.units, len(candidate.units))
        left, done = update(waiting, plan, {c.request_id: built.get(c.request_id, c.done_units)
                                            for c in waiting})
        finished.update(done)
        waiting = list(left)
    assert {c.request_id for c in candidates} - cancelled <= finished


def test_a_token_s_finish_reason_is_the_finish_of_its_request_s_record() -> None:
    """The engine ends a request's record with `Finish(reason)` of the token that ended it."""
    assert {Finish(reason) for reason in FINISH_REASONS} == {Finish.STOP, Finish.LENGTH}
    assert (Finish(STOP), Finish(LENGTH)) == (Finish.STOP, Finish.LENGTH)


STACKING = Stacking((2, 3, 4), most_tokens=16, one_token_counts=(2, 3, 4))


def test_prompts_past_a_cached_block_stack_their_tails_and_last_tokens() -> None:
    """Three prompts of 20 tokens past their cached first block (16 tokens), and a cold one whose
    first chunk is a block: the four 3-token tails are one stacked call, the last tokens another;
    the block is its prompt's own call; a prompt that may not stack (None) computes alone."""
    hits = [prompt(rid, order, 20, done=1, blocks=1, stack_key="") for order, rid in enumerate("abc")]
    cold = prompt("d", 3, 20, blocks=1, stack_key="")
    lone = prompt("e", 4, 20, done=1, blocks=1)
    plan = schedule(0, [*hits, cold, lone], Budget(200, 8), max_padding=0, stacking=STACKING)
    assert plan.stacks == (StackedCall(16, 3, ("a", "b", "c", "d"), (1, 1, 1, 1)),
                           StackedCall(19, 1, ("a", "b", "c", "d"), (2, 2, 2, 2)))
    assert plan.prefills == schedule(0, [*hits, cold, lone], Budget(200, 8), max_padding=0).prefills
    # where one-token calls compute a row alone differently (a matrix-vector product on CUDA), the
    # last tokens go alone and the tails still stack; counts are measured per kind
    everyone = [*hits, cold, lone]
    gpu = Stacking((2, 3, 4), 16)
    assert schedule(0, everyone, Budget(200, 8), max_padding=0, stacking=gpu).stacks == plan.stacks[:1]
    pairs = Stacking((2,), 16, (2, 3, 4))
    assert schedule(0, everyone, Budget(200, 8), max_padding=0, stacking=pairs).stacks == (
        StackedCall(16, 3, ("a", "b"), (1, 1)), StackedCall(16, 3, ("c", "d"), (1, 1)),
        StackedCall(19, 1, ("a", "b", "c", "d"), (2, 2, 2, 2)))
    # padded to a bucket of 8, tails of 3 and 5 tokens are one shape; a longer call than the
    # load check's never stacks; an adapter's rows stack with that adapter's only
    odd = [prompt("a", 0, 20, done=1, blocks=1, stack_key=""),
           prompt("b", 1, 22, done=1, blocks=1, stack_key=""),
           prompt("c", 2, 20, done=1, blocks=1, stack_key="x")]
    plan = schedule(0, odd, Budget(200, 8), max_padding=0, bucket=8, stacking=STACKING)
    assert plan.stacks == (StackedCall(16, 8, ("a", "b"), (1, 1)),)
    assert schedule(0, odd, Budget(200, 8), max_padding=0, bucket=32, stacking=STACKING).stacks == ()


def test_a_chunk_in_layer_slices_or_a_budget_cut_stacks_nothing_before_it() -> None:
    """Only the planned units' last run of whole chunks stacks: a prompt cut by the budget after
    its tail stacks its tail; units that slice a chunk's layers stack nothing."""
    cut = [prompt(rid, order, 20, done=1, blocks=1, stack_key="") for order, rid in enumerate("ab")]
    plan = schedule(0, cut, Budget(7, 8), max_padding=0, stacking=STACKING)
    assert [w.units for w in plan.prefills] == [2, 1]  # b's last token waits for the next step
    assert plan.stacks == (StackedCall(16, 3, ("a", "b"), (1, 1)),)
    sliced = [prompt(rid, order, 40, unit=4, stack_key="") for order, rid in enumerate("ab")]
    plan = schedule(0, sliced, Budget(500, 8), max_padding=0, stacking=STACKING)
    assert all(c.tokens == 1 for c in plan.stacks) and len(plan.stacks) == 1  # the last tokens only


@settings(max_examples=150, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 3), st.sampled_from(["", "x", None])),
                      max_size=8),
       tokens=st.integers(1, 200), bucket=st.sampled_from([0, 8]), unit=st.sampled_from([4, 64]))
def test_a_stacked_call_holds_planned_whole_chunks_of_one_shape_past_the_blocks(
        specs: list[tuple[int, int, str | None]], tokens: int, bucket: int, unit: int) -> None:
    candidates = []
    for i, (length, blocks, key) in enumerate(specs):
        chunks = prefill_chunks(length, 16)
        blocks = min(blocks, len(chunks) - 1)
        units = prefill_units(chunks, LAYERS, unit)
        done = next(index for index, u in enumerate(units) if u.chunk == blocks)
        candidates.append(Candidate(f"r{i}", i, length, chunks, units, done,
                                    block_keys=tuple(bytes([b]) for b in range(blocks + 1)), stack_key=key))
    plan = schedule(0, candidates, Budget(tokens + 64, 4), max_padding=0, bucket=bucket, stacking=STACKING)
    assert replace(plan, stacks=()) == schedule(0, candidates, Budget(tokens + 64, 4), max_padding=0,
                                                bucket=bucket)
    by_id = {c.request_id: c for c in candidates}
    planned = {w.request_id: w.units for w in plan.prefills}
    seen: set[tuple[str, int]] = set()
    for call in plan.stacks:
        assert 2 <= len(call.request_ids) <= 4 and len(set(call.request_ids)) == len(call.request_ids)
        keys = set()
        for rid, chunk in zip(call.request_ids, call.chunks, strict=True):
            c = by_id[rid]
            keys.add(c.stack_key)
            indices = [i for i, u in enumerate(c.units) if u.chunk == chunk]
            # a whole chunk, planned
            assert len(indices) == 1 and c.done_units <= indices[0] < c.done_units + planned[rid]
            assert chunk >= len(c.block_keys) and sum(c.chunks[:chunk]) == call.offset
            size = c.chunks[chunk]
            assert (size if size == 1 or not bucket else -(-size // bucket) * bucket) == call.tokens <= 16
            assert (rid, chunk) not in seen
            seen.add((rid, chunk))
        assert len(keys) == 1 and None not in keys
    assert [call.offset for call in plan.stacks] == sorted(call.offset for call in plan.stacks)
