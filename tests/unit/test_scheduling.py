"""The engine's scheduling policy (statecore.scheduling): tables for the exact plans, hypothesis for
the properties — work units cover every layer of every chunk once, in order, within their size;
the budget is never exceeded, the oldest prompt always advances, and every prompt reaches its
first token within a bounded number of steps. Under a memory budget: the activation estimate's
arithmetic, and the cap (never exceeded but by the oldest prompt's unit alone; nothing starves).
The choices of one request join a batch together. The step's token budget (`step_token_budget`):
a table of its cases, the moving rates it reads, and hypothesis for the bounds (never over the
configured budget, always the oldest prompt's next unit, so nothing starves under any rates; the
default target leaves waiting prompts at least 15/16 of a step but for one unit's rounding;
optional work, keep tasks, never outgrows the target beside streams and advances when idle)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statecore.scheduling import (
    DECODE_NODE_FLOOR_MULTIPLE,
    SINGLE_NODE_CPU_FLOOR_MULTIPLE,
    STEP_TARGET_FLOOR_MULTIPLE,
    STREAMED_SLICE_TOKENS,
    KvAdmission,
    ModelShape,
    PrefillUnit,
    PrefillWork,
    StepBudget,
    StepPlan,
    StepRates,
    WaitingPrefill,
    activation_bytes,
    batched_prefill_bytes,
    bucketed,
    chunk_activation_bytes,
    fit_activations,
    joining_choices,
    kv_admission,
    measured_step,
    padding_groups,
    plan_step,
    prefill_chunks,
    prefill_units,
    prefill_work_bytes,
    stack_groups,
    step_token_budget,
    streamed_pieces,
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
    assert prefill_units(chunks, layers, unit_tokens, 0) == prefill_units(chunks, layers, unit_tokens)


@pytest.mark.parametrize(
    ("chunks", "layers", "unit_tokens", "inner", "expected"),
    [
        # Single-layer units stop at each layer's 2 inner points: layer 0's keys and values with
        # its first point, its second alone, then layer 1's (layer 0's rest), layer 1's points,
        # layer 2's; the last layer has none. 256 tokens over 7 points: 37 each (the first unit 2).
        ((256, 1), 3, 86, 2, [(0, 0, 1, 74, (0,)), (0, 1, 1, 37, (1,)), (0, 1, 2, 37, ()),
                              (0, 2, 2, 37, (2,)), (0, 2, 2, 37, (3,)), (0, 2, 3, 37, ()),
                              (1, 0, 3, 1, ())]),
        # One point a layer: 3 points of 16 tokens.
        ((16, 1), 2, 8, 1, [(0, 0, 1, 11, (0,)), (0, 1, 2, 6, ()), (1, 0, 2, 1, ())]),
        # Units of several layers are not cut: the points only split single-layer units.
        ((1535, 1), 6, 512, 2, [(0, 0, 2, 512, ()), (0, 2, 4, 512, ()), (0, 4, 6, 512, ()),
                                (1, 0, 6, 1, ())]),
        # A model of one layer has no point before its last keys and values.
        ((16, 1), 1, 4, 2, [(0, 0, 1, 16, ()), (1, 0, 1, 1, ())]),
    ],
)
def test_prefill_units_at_inner_points_table(chunks: tuple[int, ...], layers: int, unit_tokens: int,
                                             inner: int, expected: list[tuple[int, int, int, int,
                                                                              tuple[int, ...]]]) -> None:
    assert prefill_units(chunks, layers, unit_tokens, inner) == tuple(PrefillUnit(*u) for u in expected)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 2048), st.integers(1, 40), st.integers(1, 4096),
       st.integers(0, 3))
def test_prefill_units_walk_the_graph_in_order(prompt: int, chunk: int, layers: int, unit_tokens: int,
                                               inner: int) -> None:
    """Every unit evaluates points of the graph after all it needs: in each chunk the layers'
    keys and values once each, in order, every inner point of a layer but the last once, after its
    layer's keys and values and before the next layer's; a chunk of single-layer units stops at
    every point, one point a unit (layer 0's keys and values go with its first point)."""
    chunks = prefill_chunks(prompt, chunk)
    units = prefill_units(chunks, layers, unit_tokens, inner)
    for index in range(len(chunks)):
        mine = [u for u in units if u.chunk == index]
        walked: list[tuple[str, int]] = []
        for unit in mine:
            walked += [("kv", layer) for layer in range(unit.first_layer, unit.end_layer)]
            walked += [("inner", point) for point in unit.inner]
            assert unit.tokens >= 1
        split = any(u.inner for u in mine)
        expected: list[tuple[str, int]] = []
        for layer in range(layers):
            expected.append(("kv", layer))
            if split and layer + 1 < layers:
                expected += [("inner", layer * inner + point) for point in range(inner)]
        assert walked == expected
        single_layer = max(1, min(layers, (unit_tokens * layers) // chunks[index])) == 1
        assert split == (single_layer and layers > 1 and inner > 0)
        if split:
            assert len(mine) == len(expected) - 1  # one point a unit, layer 0's two together
            # worth the chunk's tokens, as its whole-layer units are (each rounded up)
            assert chunks[index] <= sum(u.tokens for u in mine) <= chunks[index] + len(mine)


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


# A node that measured a 10 ms step without prefill and 1 ms per prefill token.
MEASURED = StepRates(floor_s=0.010, excess_s=0.050, prefill_tokens=50.0)


@pytest.mark.parametrize(
    ("configured", "rows", "oldest_unit", "decode_only", "target_s", "rates", "expected"),
    [
        # Right after a handed-off request joins: the decode rows alone.
        (2052, 4, 256, True, None, MEASURED, 4),
        # No stream decodes: the whole configured budget, whatever the target.
        (2052, 0, 256, False, 0.001, MEASURED, 2052),
        # Off: the configured budget.
        (2052, 4, 256, False, 0.0, MEASURED, 2052),
        # Nothing measured yet: the oldest prompt's next unit.
        (2052, 4, 256, False, None, StepRates(), 4 + 256),
        (2052, 4, 256, False, 0.050, StepRates(floor_s=0.010), 4 + 256),
        # The default target, 16 floors (160 ms): 150 ms of prefill at 1 ms a token.
        (2052, 4, 8, False, None, MEASURED, 4 + 150),
        # A target of 510 ms: 500 tokens.
        (2052, 4, 8, False, 0.510, MEASURED, 4 + 500),
        # ... but never less than the oldest prompt's next unit,
        (2052, 4, 256, False, 0.510, MEASURED, 4 + 500),
        (2052, 4, 600, False, 0.510, MEASURED, 4 + 600),
        (2052, 4, 600, False, 0.005, MEASURED, 4 + 600),
        # ... nor more than the configured budget.
        (2052, 4, 8, False, 60.0, MEASURED, 2052),
        # Prefill measured free: the configured budget.
        (2052, 4, 8, False, None, StepRates(floor_s=0.01, excess_s=0.0, prefill_tokens=10.0), 2052),
    ],
)
def test_step_token_budget_table(configured: int, rows: int, oldest_unit: int, decode_only: bool,
                                 target_s: float | None, rates: StepRates, expected: int) -> None:
    assert step_token_budget(configured, rows, oldest_unit, decode_only=decode_only, target_s=target_s,
                             rates=rates) == expected


@pytest.mark.parametrize(("floors", "expected"), [
    (STEP_TARGET_FLOOR_MULTIPLE, 4 + 150),  # 16 floors (160 ms): 150 ms of prefill at 1 ms a token
    (DECODE_NODE_FLOOR_MULTIPLE, 4 + 30),  # a decode node's 4 (40 ms): 30 ms
    (1.0, 4 + 8),  # no room beside the floor: the oldest prompt's next unit only
])
def test_the_default_target_is_a_multiple_of_the_measured_floor(floors: float, expected: int) -> None:
    assert step_token_budget(2052, 4, 8, decode_only=False, target_s=None, rates=MEASURED,
                             target_floors=floors) == expected


@pytest.mark.parametrize(
    ("rows", "oldest_unit", "target_s", "rates", "expected"),
    [
        # beside streams only what the target leaves: 2 floors (20 ms) leave 10 tokens at 1 ms a token,
        (4, 8, None, MEASURED, 4 + 10),
        # ... and no unit is forced: one that does not fit waits (a prompt's would go)
        (4, 64, None, MEASURED, 4 + 10),
        # nothing measured yet: no optional work beside streams
        (4, 8, None, StepRates(), 4),
        (4, 8, None, StepRates(floor_s=0.010), 4),
        # no stream decoding (idle capacity): what fits the target, at least the next unit
        (0, 8, None, MEASURED, 10),
        (0, 64, None, MEASURED, 64),
        (0, 64, None, StepRates(), 64),
        # the target off: the configured budget, as for any prompt
        (4, 64, 0.0, MEASURED, 2052),
        (0, 64, 0.0, MEASURED, 2052),
    ],
)
def test_optional_work_takes_what_the_target_leaves(rows: int, oldest_unit: int, target_s: float | None,
                                                    rates: StepRates, expected: int) -> None:
    assert step_token_budget(2052, rows, oldest_unit, decode_only=False, target_s=target_s, rates=rates,
                             target_floors=SINGLE_NODE_CPU_FLOOR_MULTIPLE, optional_only=True) == expected


@settings(max_examples=300, deadline=None)
@given(st.floats(0.001, 0.5), st.floats(1e-6, 0.01), st.integers(0, 32), st.integers(1, 600),
       st.integers(64, 4096), st.floats(1.0, 64.0))
def test_optional_work_never_lengthens_a_streams_step_and_advances_when_idle(
        floor: float, per_token: float, rows: int, unit: int, room: int, floors: float) -> None:
    """Whatever the measured rates: beside streams, a step whose only waiting work is optional (keep
    tasks) stays within the target at the measured rate (no unit forced); with nothing decoding
    it takes at least that work's next unit, and more only as far as the target allows."""
    rates = StepRates(floor_s=floor, excess_s=per_token * 100, prefill_tokens=100.0)
    configured = rows + max(room, unit)
    tokens = step_token_budget(configured, rows, unit, decode_only=False, target_s=None, rates=rates,
                               target_floors=floors, optional_only=True)
    assert rows <= tokens <= configured
    prefill_s = (tokens - rows) * per_token
    slack = 1e-9 * (1 + floors * floor)
    if rows:
        assert floor + prefill_s <= floors * floor + slack
    else:
        assert tokens >= unit and (tokens == unit or floor + prefill_s <= floors * floor + slack)


SLOW_PREFILL = StepRates(excess_s=1.0, prefill_tokens=500.0)  # 2 ms a token: a CPU
FAST_PREFILL = StepRates(excess_s=0.045, prefill_tokens=2000.0)  # 22.5 us a token: a 1B on a GPU


@pytest.mark.parametrize(
    ("configured", "rows", "oldest_unit", "rates", "expected"),
    [
        # one streamed prompt alone on a slow device: a slice a step, so its KV travels while the
        # rest computes
        (2052, 0, 256, SLOW_PREFILL, STREAMED_SLICE_TOKENS),
        # ... at least its next unit, at most the configured budget
        (2052, 0, 1000, SLOW_PREFILL, 1000),
        (300, 0, 256, SLOW_PREFILL, 300),
        # on a fast one, steps of STREAMED_SLICE_S at least (500 ms / 22.5 us: 22,223 tokens)
        (32768, 0, 256, FAST_PREFILL, 22223),
        (8192, 0, 256, FAST_PREFILL, 8192),
        (2052, 0, 256, FAST_PREFILL, 2052),
        # no rate measured yet: the configured budget
        (2052, 0, 256, StepRates(), 2052),
        # streams decoding: the step-time rules as without it
        (2052, 4, 8, MEASURED, 4 + 150),
    ],
)
def test_a_prompt_streaming_its_kv_alone_is_computed_in_slices(configured: int, rows: int, oldest_unit: int,
                                                              rates: StepRates, expected: int) -> None:
    assert step_token_budget(configured, rows, oldest_unit, decode_only=False, target_s=None, rates=rates,
                             oldest_streams=True) == expected
    if rows == 0:  # not streamed: the whole budget
        assert step_token_budget(configured, rows, oldest_unit, decode_only=False, target_s=None,
                                 rates=rates) == configured


@settings(max_examples=300, deadline=None)
@given(st.floats(0.001, 0.5), st.floats(1e-6, 0.01), st.integers(1, 32),
       st.lists(st.integers(1, 64), min_size=1, max_size=60), st.integers(64, 4096),
       st.sampled_from([STEP_TARGET_FLOOR_MULTIPLE, DECODE_NODE_FLOOR_MULTIPLE]) | st.floats(1.0, 64.0))
def test_the_default_target_leaves_waiting_prompts_most_of_a_step(floor: float, per_token: float, rows: int,
                                                                  units: list[int], room: int,
                                                                  floors: float) -> None:
    """Beside streams, under the default target (`floors` times the measured floor) and whatever
    the measured rates, the oldest prompt advances; the step's prefill at the measured rate (a)
    overruns the target only by the oldest prompt's one unit, and (b) when work is left that the
    target held back, takes all of the target but the floor ((floors - 1) / floors of it: 15/16 by
    default), less one unit and a token of rounding: the prompts waiting beside streams are never
    starved of the device."""
    rates = StepRates(floor_s=floor, excess_s=per_token * 100, prefill_tokens=100.0)
    configured = rows + max(room, max(units))
    target = floors * floor
    tokens = step_token_budget(configured, rows, units[0], decode_only=False, target_s=None, rates=rates,
                               target_floors=floors)
    plan = plan_step(rows, [WaitingPrefill("a", 0, tuple(units))], StepBudget(tokens, 8))
    assert plan.prefills and plan.tokens <= tokens <= configured
    work = plan.prefills[0]
    prefill_s = work.tokens * per_token
    slack = 1e-9 * (1 + target)
    assert floor + prefill_s <= target + slack or work.units == 1
    left = units[work.units :]
    if left and tokens < configured:
        assert prefill_s >= (floors - 1) / floors * target - (left[0] + 1) * per_token - slack


def test_step_token_budget_refuses_negative_inputs() -> None:
    with pytest.raises(ValueError):
        step_token_budget(100, 4, 8, decode_only=False, target_s=-1.0, rates=MEASURED)
    with pytest.raises(ValueError):
        step_token_budget(100, -1, 8, decode_only=False, target_s=None, rates=MEASURED)
    with pytest.raises(ValueError):
        step_token_budget(100, 4, 8, decode_only=False, target_s=None, rates=MEASURED, target_floors=0.0)


def test_measured_step_moves_the_floor_and_the_rate() -> None:
    rates = measured_step(StepRates(), 0.010, 0)
    assert rates.floor_s == 0.010 and rates.prefill_token_s is None
    rates = measured_step(rates, 0.020, 0)
    assert rates.floor_s == pytest.approx(0.012)  # a fifth of the way
    rates = measured_step(rates, 0.112, 100)  # 100 ms beyond the floor for 100 tokens
    assert rates.prefill_token_s == pytest.approx(0.001)
    rates = measured_step(rates, 0.212, 100)  # twice as slow now: the rate moves a fifth of the way
    assert rates.prefill_token_s == pytest.approx((0.8 * 0.1 + 0.2 * 0.2) / 100)
    assert measured_step(StepRates(), 0.5, 10).prefill_token_s == pytest.approx(0.05)  # no floor yet
    assert measured_step(MEASURED, 0.001, 10).prefill_token_s is not None  # faster than the floor: 0
    with pytest.raises(ValueError):
        measured_step(StepRates(), -0.1, 0)


step_rates = st.builds(
    StepRates, st.none() | st.floats(0.0, 1.0),
    st.floats(0.0, 10.0), st.floats(0.0, 1000.0))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=8), st.integers(1, 64), st.integers(1, 6),
       st.integers(0, 32), st.integers(1, 300), st.none() | st.floats(0.0, 2.0),
       st.lists(st.tuples(step_rates, st.booleans()), min_size=1, max_size=20), st.floats(0.1, 64.0))
def test_a_timed_budget_holds_and_starves_no_prompt(lengths: list[int], chunk: int, layers: int,
                                                    decode_rows: int, room: int, target_s: float | None,
                                                    rates: list[tuple[StepRates, bool]],
                                                    floors: float) -> None:
    """Whatever the rates and the target (or the default target's multiple), a step's plan stays
    within the configured budget, and every step but a decode-only one advances the oldest prompt:
    the prompts all finish within their units' count of such steps."""
    unit_tokens = max(room, -(-chunk // layers))
    configured = 32 + unit_tokens  # the engine's rule: its largest batch plus its largest unit
    waiting = {f"r{i}": wait(f"r{i}", i, *(u.tokens for u in prefill_units(prefill_chunks(n, chunk), layers,
                                                                              unit_tokens)))
               for i, n in enumerate(lengths)}
    total_units = sum(len(w.units_left) for w in waiting.values())
    steps = advancing = 0
    decode_only = False
    while waiting:
        # A decode-only step is one step after a join (or a bounded wait for one): never two in a row here.
        measured, joined = rates[steps % len(rates)]
        decode_only = joined and not decode_only
        steps += 1
        advancing += not decode_only
        assert advancing <= total_units, "some prompt made no progress"
        oldest = min(waiting.values(), key=lambda w: w.order)
        tokens = step_token_budget(configured, decode_rows, oldest.units_left[0], decode_only=decode_only,
                                   target_s=target_s, rates=measured, target_floors=floors)
        assert decode_rows <= tokens <= configured
        plan = plan_step(decode_rows, list(waiting.values()), StepBudget(tokens, 8))
        assert plan.tokens <= tokens
        if decode_only:
            assert not plan.prefills
            continue
        assert plan.prefills and plan.prefills[0].request_id == oldest.request_id
        for work in plan.prefills:
            prompt = waiting[work.request_id]
            left = prompt.units_left[work.units :]
            if left:
                waiting[work.request_id] = WaitingPrefill(work.request_id, prompt.order, left)
            else:
                del waiting[work.request_id]


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
# Transient activations and the prefill memory cap

# hidden 4, 2 query heads and 1 KV head of 2, MLP 8, vocabulary 10, float32: one token's layer
# intermediates are 4 x (5*4 + 5*2*2 + 3*1*2 + 3*8) = 280 bytes.
SMALL = ModelShape(hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10, dtype_bytes=4)
# The mid-size tiny llama of bench/serving/kv_memory.py (hidden 512, 32 heads of 16, MLP 1024, float32).
MID = ModelShape(512, 32, 16, 16, 1024, 512, 4)
MIB = 1 << 20


def test_a_token_s_layer_intermediates() -> None:
    assert SMALL.token_bytes == 280
    with pytest.raises(ValueError):
        ModelShape(4, 0, 1, 2, 8, 10, 4)


@pytest.mark.parametrize(
    ("rows", "tokens", "attended", "sampled", "expected"),
    [
        (1, 3, 5, False, 2 * 3 * 5 * 4 + 3 * 280),  # scores heads x tokens x attended, then intermediates
        (1, 3, 5, True, 2 * 3 * 5 * 4 + 3 * 280 + 3 * 10 * (4 + 4)),  # + logits (model dtype + float32)
        (2, 3, 5, False, 2 * (2 * 3 * 5 * 4 + 3 * 280)),  # rows scale everything
        (4, 1, 100, True, 4 * (2 * 100 * 4 + 280 + 10 * 8)),  # a decode step of 4 rows at 100 positions
        (0, 3, 5, True, 0),
    ],
)
def test_activation_bytes_table(rows: int, tokens: int, attended: int, sampled: bool, expected: int) -> None:
    assert activation_bytes(SMALL, rows, tokens, attended, sampled) == expected


def test_the_estimate_grows_with_the_square_of_a_chunk() -> None:
    # What docs/performance.md measured on the CPU (MLX 0.32.4, peak - held of one prompt's
    # prefill): 4.1, 20.1, 63.9, 214.6 and 583.6 MiB for prompts of 100, 300, 600, 1,200 and 2,047.
    estimates = [sum(chunk_activation_bytes(MID, (n - 1, 1))) / MIB for n in (100, 300, 600, 1200, 2047)]
    assert [round(e, 1) for e in estimates] == [4.6, 21.2, 64.4, 216.7, 581.2]


@pytest.mark.parametrize(
    ("chunks", "bucket", "expected"),
    [
        # The head chunk attends itself; the last token attends everything, and samples.
        ((3, 1), 0, ((1, 3, 3, False), (1, 1, 4, True))),
        # A bucket pads a chunk of several tokens (not the last token alone); positions stay real.
        ((3, 1), 4, ((1, 4, 4, False), (1, 1, 4, True))),
        ((4, 4, 2, 1), 0, ((1, 4, 4, False), (1, 4, 8, False), (1, 2, 10, False), (1, 1, 11, True))),
    ],
)
def test_chunk_activation_bytes_table(chunks: tuple[int, ...], bucket: int,
                                      expected: tuple[tuple[int, int, int, bool], ...]) -> None:
    assert chunk_activation_bytes(SMALL, chunks, bucket) == tuple(activation_bytes(SMALL, *e)
                                                                   for e in expected)


def test_prefill_work_bytes_counts_each_chunk_once() -> None:
    units = prefill_units((16, 16, 1), 2, 8)  # chunk 0: 2 units, chunk 1: 2 units, chunk 2: 1
    chunk_bytes = (10, 20, 5)
    assert prefill_work_bytes(chunk_bytes, units, 0, 1) == 10
    assert prefill_work_bytes(chunk_bytes, units, 0, 2) == 10  # both layer slices of chunk 0
    assert prefill_work_bytes(chunk_bytes, units, 1, 2) == 30
    assert prefill_work_bytes(chunk_bytes, units, 0, 5) == 35
    assert prefill_work_bytes(chunk_bytes, units, 2, 0) == 0


def test_batched_prefill_bytes_adds_the_batch_cache() -> None:
    def calls(head: int) -> int:  # the heads' call, then the last tokens' (which samples)
        return activation_bytes(SMALL, 3, head, head) + activation_bytes(SMALL, 3, 1, head + 1, True)

    assert batched_prefill_bytes(SMALL, 3, 7, 100, 256) == calls(7) + 3 * 100 * 256
    assert batched_prefill_bytes(SMALL, 3, 255, 100, 256) == calls(255) + 3 * 100 * 256  # head + last: 256
    assert batched_prefill_bytes(SMALL, 3, 256, 100, 256) == calls(256) + 3 * 100 * 512  # one more step


@pytest.mark.parametrize(
    ("calls", "allowance", "expected"),
    [
        ([], 10, ()),
        ([[5, 12], [3]], 10, (1, 1)),  # the first call's second item does not fit; the next call's does
        ([[5, 12], [3]], 20, (2, 1)),
        ([[5], [6], [4]], 10, (1, 0, 1)),  # a call that does not fit is passed over
        ([[15, 20], [3]], 10, (1, 0)),  # the oldest's first item alone, over the allowance
        ([[1], [1]], -5, (1, 0)),  # no room at all (decode rows took it): the oldest still advances
        ([[0, 0], [0]], 0, (2, 1)),
    ],
)
def test_fit_activations_table(calls: list[list[int]], allowance: int, expected: tuple[int, ...]) -> None:
    assert fit_activations(calls, allowance) == expected


def test_fit_activations_refuses_decreasing_costs() -> None:
    with pytest.raises(ValueError):
        fit_activations([[5, 4]], 10)
    with pytest.raises(ValueError):
        fit_activations([[-1]], 10)


costs_of_calls = st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=6), max_size=8).map(
    lambda calls: [[sum(steps[: i + 1]) for i in range(len(steps))] for steps in calls])


@settings(max_examples=300, deadline=None)
@given(costs_of_calls, st.integers(-20, 200))
def test_the_cap_holds_but_for_the_oldest_alone(calls: list[list[int]], allowance: int) -> None:
    kept = fit_activations(calls, allowance)
    assert len(kept) == len(calls)
    assert all(0 <= k <= len(c) for k, c in zip(kept, calls, strict=True))
    total = sum(c[k - 1] for k, c in zip(kept, calls, strict=True) if k)
    if calls:
        assert kept[0] >= 1  # the oldest prompt always advances
    if calls and total > allowance:
        assert kept == (1,) + (0,) * (len(calls) - 1)  # ... alone
    else:
        # Greedy, in order: no call could have kept one item more with what was left.
        left = allowance
        for k, c in zip(kept, calls, strict=True):
            assert k == len(c) or c[k] > left
            left -= c[k - 1] if k else 0


waiting_prompts = st.lists(st.lists(st.tuples(st.integers(1, 60), st.integers(0, 100)), min_size=1,
                                    max_size=5), max_size=10)


@settings(max_examples=200, deadline=None)
@given(waiting_prompts, st.lists(st.integers(-50, 300), min_size=1, max_size=5), st.integers(1, 8),
       st.booleans())
def test_under_the_cap_every_prompt_is_scheduled(prompts: list[list[tuple[int, int]]], allowances: list[int],
                                                 rows: int, batch: bool) -> None:
    """plan_step, then fit_activations as the engine calls it (prompts that finish together in one
    batched call, priced above their sum, when `batch`): the cap holds but for a lone unit, the
    oldest prompt advances every step, and every prompt reaches its first token."""
    budget = StepBudget(64, rows)
    units = {f"r{i}": list(p) for i, p in enumerate(prompts)}  # (tokens, bytes) of each unit left
    order = {f"r{i}": i for i in range(len(prompts))}
    total_units = sum(len(p) for p in prompts)
    steps = 0
    while units:
        allowance = allowances[steps % len(allowances)]
        steps += 1
        assert steps <= total_units, "some prompt made no progress"
        waiting = [WaitingPrefill(rid, order[rid], tuple(t for t, _ in left)) for rid, left in units.items()]
        plan = plan_step(0, waiting, budget)
        work = {w.request_id: w for w in plan.prefills}
        finishing = sorted((rid for rid, w in work.items() if w.finishes and w.units == 1),
                           key=order.__getitem__)
        grouped = finishing if batch and len(finishing) > 1 else []
        calls: list[tuple[int, list[int], list[str]]] = []
        if grouped:
            alone = units[grouped[0]][0][1]
            calls.append((order[grouped[0]], [alone] + [2 * sum(units[r][0][1] for r in grouped[:k]) + 1
                                                        for k in range(2, len(grouped) + 1)], grouped))
        for rid, w in work.items():
            if rid not in grouped:
                mine = [b for _, b in units[rid][: w.units]]
                calls.append((order[rid], [sum(mine[: k + 1]) for k in range(w.units)], [rid]))
        calls.sort(key=lambda call: call[0])
        kept = fit_activations([c for _, c, _ in calls], allowance)
        total = sum(c[k - 1] for (_, c, _), k in zip(calls, kept, strict=True) if k)
        items = sum(kept)
        assert total <= allowance or items == 1
        oldest = min(units, key=order.__getitem__)
        advanced: dict[str, int] = {}
        for (_, _, members), k in zip(calls, kept, strict=True):
            if members is grouped and grouped:
                for rid in members[:k]:
                    advanced[rid] = 1
            elif k:
                advanced[members[0]] = k
        assert advanced.get(oldest, 0) >= 1
        for rid, k in advanced.items():
            del units[rid][:k]
            if not units[rid]:
                del units[rid]
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


@given(start=st.integers(0, 5000), tokens=st.integers(1, 5000), first_layer=st.integers(0, 40),
       layers=st.integers(1, 40), layer_token_bytes=st.integers(1, 1 << 16),
       most_bytes=st.integers(1, 1 << 26))
def test_streamed_pieces_cover_the_step_in_order_and_in_bounded_pieces(
    start: int, tokens: int, first_layer: int, layers: int, layer_token_bytes: int, most_bytes: int
) -> None:
    stop, end_layer = start + tokens, first_layer + layers
    pieces = streamed_pieces(start, stop, first_layer, end_layer, layer_token_bytes=layer_token_bytes,
                             most_bytes=most_bytes)
    covered: dict[int, int] = {layer: start for layer in range(first_layer, end_layer)}
    for piece_start, piece_stop, piece_first, piece_end in pieces:
        assert first_layer <= piece_first < piece_end <= end_layer
        assert start <= piece_start < piece_stop <= stop
        size = (piece_stop - piece_start) * (piece_end - piece_first) * layer_token_bytes
        assert size <= max(most_bytes, layer_token_bytes)  # one token of one layer is the least piece
        for layer in range(piece_first, piece_end):
            assert covered[layer] == piece_start  # each layer's ranges follow one another
            covered[layer] = piece_stop
    assert set(covered.values()) == {stop}
    if tokens * layers * layer_token_bytes <= most_bytes:
        assert pieces == [(start, stop, first_layer, end_layer)]  # a small step stays one piece


@settings(max_examples=200, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(0, 3), st.sampled_from([1, 8, 16]), st.sampled_from(["", "x"])),
                       max_size=30),
       counts=st.sets(st.integers(1, 8), max_size=8))
def test_stacked_calls_share_one_shape_at_a_measured_count_and_leave_out_only_what_cannot_stack(
        shapes: list[tuple[int, int, str]], counts: set[int]) -> None:
    groups = stack_groups(shapes, counts)
    grouped = [index for group in groups for index in group]
    assert len(grouped) == len(set(grouped))  # one call at most
    for group in groups:
        assert len(group) in counts and len(group) >= 2
        assert len({shapes[index] for index in group}) == 1 and group == sorted(group)  # oldest first
    assert [shapes[group[0]][0] for group in groups] == sorted(shapes[group[0]][0] for group in groups)
    smallest = min((count for count in counts if count >= 2), default=None)
    for shape in set(shapes):
        left = [i for i, other in enumerate(shapes) if other == shape and i not in grouped]
        assert smallest is None or len(left) < smallest  # no call of a measured count was left out


def test_stacked_calls_take_the_largest_measured_count_first() -> None:
    one = (5, 16, "")
    assert stack_groups([one] * 7, {2, 4}) == [[0, 1, 2, 3], [4, 5]]
    assert stack_groups([one] * 3, set()) == []  # nothing measured alike: every call alone
    assert stack_groups([(9, 1, ""), one, (9, 1, ""), one, (5, 16, "x")], {2, 3}) == [[1, 3], [0, 2]]
