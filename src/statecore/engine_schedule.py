"""The engine's step, decided as data: `schedule(...) -> StepPlan` and `update(...)`, both pure.

The device loop (`adapters.mlx.device`) runs one loop of three verbs: `schedule` what a step
computes from what the engine holds, execute that plan on the device (build, launch, read back),
and `update` the requests' progress with what it computed. This module is the first and the
last: given the requests with prefill work left (`Candidate`), the decode rows, the step's token
budget (`Budget`) and, under a memory budget, the KV memory as it stands (`Memory`), `schedule`
decides the token budget of the step (`scheduling.step_token_budget`), which prompts advance by
how many work units (`scheduling.plan_step`: decode rows first, then the oldest prompts' units),
which short prompts share a padded call (`scheduling.padding_groups`), which prompts' next calls
of one shape share a stacked call (`scheduling.stack_groups`, `Stacking`), and what of that fits
the memory beside the KV held (`scheduling.fit_activations`): which keep tasks give way, how many
bytes of kept prefix blocks go, the activation estimate. `update` advances the prompts by the
plan's units and says which finished. The engine's other decisions are here too: where a request
decodes (`choose_lane`), whether a request's KV is admitted and what gives way to it
(`admission`), what a prefill whose call raised becomes (`prefill_failure`), and whether a step
holds prefill back for a handed-off request about to join (`decode_only`). A prompt whose next
prefix block another prompt is computing right now (started in an earlier step, or started and not
finished earlier in this one: a block cut into layer slices) waits for it to be kept instead of
computing it again (`block_waits`); one that another finishes earlier in the same step starts
after it when built. The executor performs what these say; it decides nothing of its own.
This module must never import trio, httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate

from statecore.scheduling import (
    STEP_TARGET_FLOOR_MULTIPLE,
    KvAdmission,
    ModelShape,
    PrefillUnit,
    PrefillWork,
    StepBudget,
    StepRates,
    WaitingPrefill,
    activation_bytes,
    batched_prefill_bytes,
    bucketed,
    chunk_activation_bytes,
    fit_activations,
    kv_admission,
    padding_groups,
    plan_step,
    prefill_work_bytes,
    stack_groups,
    step_token_budget,
)

__all__ = [
    "HANDOFF_COMING_S",
    "HANDOFF_EXPECTED_S",
    "Admission",
    "Budget",
    "Candidate",
    "EnginePhase",
    "Finish",
    "Lane",
    "Memory",
    "PrefillFailure",
    "StackedCall",
    "Stacking",
    "StepPlan",
    "admission",
    "block_waits",
    "choose_lane",
    "decode_only",
    "handoff_imminent",
    "prefill_failure",
    "schedule",
    "update",
]

# How long steps hold prefill back for a handed-off request whose last piece arrived (it joins as
# soon as it is validated; a request that never does stops holding it back after this)
HANDOFF_COMING_S = 2.0
# ... and for one whose prefill node has started the step computing its last pieces (that step
# may take seconds on a slow device; the engine forgets the request at once when it joins, is
# cancelled or fails: this only bounds a prefill node that went quiet)
HANDOFF_EXPECTED_S = 30.0


class EnginePhase(enum.Enum):
    """Where a request is in the engine (one record per request holds it)."""

    WAITING = "waiting"  # its prompt is queued; no work unit computed yet (a cached start may count)
    PREFILLING = "prefilling"  # some of its work units computed
    PREFILLED = "prefilled"  # its last unit launched: its first token is read back with the step
    HELD = "held"  # a prefilled cache waiting for its export or its local decode
    GATHERING = "gathering"  # a choice of n > 1 at its batched lane, waiting for its siblings
    RUNNING = "running"  # decoding in its lane
    KEEPING = "keeping"  # a keep task: a finished conversation's chunks computed for the prefix cache


class Finish(enum.Enum):
    """How a request left the engine: its record's last word (`STOP` and `LENGTH` are the
    OpenAI finish reasons of `statecore.policy.token_finish`)."""

    STOP = "stop"  # an end token (or its first token was one)
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # its caller cancelled, or left before its prefill finished
    FAILED = "failed"  # its prefill or a decode step failed, or the engine died
    RELEASED = "released"  # its held cache was released (exported, or not wanted)
    KEPT = "kept"  # a keep task whose chunks are in the prefix cache
    GAVE_WAY = "gave_way"  # a keep task dropped: a request needed its memory, or its call raised


class Lane(enum.Enum):
    SLOT = "slot"  # preallocated per-row KV (plain KVCache models)
    BATCH = "batch"  # the other batchable cache families, rows padded to each other
    SOLO = "solo"  # one call per request and step


def choose_lane(*, plain_kv: bool, needed_tokens: int, slot_capacity: int | None, batchable: bool,
                constrained: bool) -> Lane:
    """Where a request decodes: the slot lane when its cache is plain KVCache and its whole
    length (`needed_tokens`) fits a slot (`slot_capacity`, None: no slot pool); else the batch
    lane when its cache classes batch, unless a grammar constrains it (a row under a grammar waits
    on its mask before each draw: outside the slot lane it decodes solo, so that the rows of a
    batch keep their company); else solo."""
    if plain_kv and slot_capacity is not None and needed_tokens <= slot_capacity:
        return Lane.SLOT
    if batchable and not constrained:
        return Lane.BATCH
    return Lane.SOLO


@dataclass(frozen=True, slots=True)
class Candidate:
    """A request with prefill work left, as the scheduler sees it: its arrival `order` (FCFS; keep
    tasks come after every prompt), its chunks and work units and how many are done, whether it
    may share a padded call with other short prompts when it finishes in this step (`batchable`:
    nothing computed, one chunk before its last token, one choice, a model that batches prefill),
    and whether it is a keep task (optional work: it gives way to memory). `stack_key`: None when
    its calls never share a stacked call (a keep task, a streamed handoff, a choice of n > 1),
    else what the rows of one stacked call must share beside their shape (its adapter's name)."""

    request_id: str
    order: int
    prompt_tokens: int
    chunks: tuple[int, ...]
    units: tuple[PrefillUnit, ...]
    done_units: int = 0
    batchable: bool = False
    keeps_only: bool = False
    block_keys: tuple[bytes, ...] = ()
    stack_key: str | None = None

    @property
    def units_left(self) -> tuple[int, ...]:
        return tuple(unit.tokens for unit in self.units[self.done_units :])

    def block_at(self, done_units: int) -> bytes | None:
        """The key of the block its unit `done_units` belongs to (None: no such unit, or a chunk
        that is not kept, as its last token's)."""
        if done_units >= len(self.units):
            return None
        chunk = self.units[done_units].chunk
        return self.block_keys[chunk] if chunk < len(self.block_keys) else None

    def first_unit_of(self, chunk: int) -> int:
        """The index of chunk `chunk`'s first unit (its unit count past the last chunk)."""
        return next((i for i, unit in enumerate(self.units) if unit.chunk >= chunk), len(self.units))


@dataclass(frozen=True, slots=True)
class Budget:
    """The step's token budget as configured (`tokens`, `prefill_rows`) and what sizes it: a
    step-time target (`target_s`: None = the default, `target_floors` times the measured step
    without prefill; 0 = off) at the measured `rates`,
    `decode_only` (a handed-off request joined or is about to: no prefill this step) and
    `oldest_streams` (the oldest prompt prefilling streams its KV to a decode node: slices that
    travel while the rest computes, and later prompts wait behind it rather than share the step
    its first token comes from). When only keep tasks wait, the step's budget is sized as
    optional work (`scheduling.step_token_budget`): under a target, only the room it leaves."""

    tokens: int
    prefill_rows: int
    target_s: float | None = 0.0
    rates: StepRates = field(default_factory=StepRates)
    target_floors: float = STEP_TARGET_FLOOR_MULTIPLE
    decode_only: bool = False
    oldest_streams: bool = False


@dataclass(frozen=True, slots=True)
class Memory:
    """The KV memory as the step starts (under a memory budget): the node's `budget`, the slot
    pool as allocated, the requests' reservations, the kept prefix blocks; what the model's calls
    grow with (`shape`), the positions the longest decode row may attend, a cache position's
    bytes and the batch cache's allocation step."""

    budget: int
    pool_bytes: int
    reserved: int
    prefix_bytes: int
    shape: ModelShape
    decode_attended: int
    kv_per_token: int
    cache_step: int


@dataclass(frozen=True, slots=True)
class Stacking:
    """Where prompts' calls may share a stacked call: the row counts at which this device
    computes every row of a call as that row's own call (measured at load; 1 is implied), for
    calls of several tokens (`counts`) and of one (`one_token_counts`: a prompt's last token,
    whose lone call may take other kernels), and the longest call (tokens, padded) that stacks
    (the load check's shape)."""

    counts: tuple[int, ...]
    most_tokens: int
    one_token_counts: tuple[int, ...] = ()

    def counts_for(self, tokens: int) -> tuple[int, ...]:
        return self.one_token_counts if tokens == 1 else self.counts


@dataclass(frozen=True, slots=True)
class StackedCall:
    """One model call over several prompts' next chunk (a row each, oldest first): chunk
    `chunks[i]` of `request_ids[i]`, every one starting at cache position `offset` and `tokens`
    long once padded. The rows' numbers are their own calls' (`Stacking`), so a prompt's calls
    are a cache-less run's whichever of them were stacked."""

    offset: int
    tokens: int
    request_ids: tuple[str, ...]
    chunks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step computes: every decode row; the prefill work of `prefills` (oldest first;
    a request in a padded group runs all its units in that group's call); the padded groups of
    short prompts (each in its own order); keep tasks that give way (`dropped_keeps`) and the
    kept prefix bytes to free first (`evict_prefix_bytes`); under a memory budget the step's
    activation estimate, whether the fit cut planned work (`capped`) and whether the estimate is
    over the budget anyway (`over_budget`: the oldest prompt's lone unit); the prompts that wait
    this step for a block another is computing (`waiting_for_blocks`, `block_waits`); the
    stacked calls (`stacks`, by offset): a prompt in one computes its units before its first
    stacked chunk alone, then every unit it has planned from there as a call of its own or a
    row of a stacked call, in the order of their offsets."""

    budget_tokens: int
    decode_rows: int
    prefills: tuple[PrefillWork, ...] = ()
    groups: tuple[tuple[str, ...], ...] = ()
    dropped_keeps: tuple[str, ...] = ()
    evict_prefix_bytes: int = 0
    activation_estimate: int | None = None
    capped: bool = False
    over_budget: bool = False
    waiting_for_blocks: tuple[str, ...] = ()
    stacks: tuple[StackedCall, ...] = ()

    @property
    def prefill_tokens(self) -> int:
        return sum(work.tokens for work in self.prefills)

    @property
    def tokens(self) -> int:
        return self.decode_rows + self.prefill_tokens


def schedule(decode_rows: int, candidates: Sequence[Candidate], budget: Budget, *, max_padding: float,
             bucket: int = 0, memory: Memory | None = None, stacking: Stacking | None = None) -> StepPlan:
    """The step's plan (see the module's paragraph). Every decode row runs; the oldest prompt
    advances unless the step is decode-only or the budget leaves no prefill row; nothing exceeds
    the token budget; under a memory budget the plan's activations and the KV held stay within
    it, except the oldest prompt's lone next unit (`over_budget`), and only keep tasks (never a
    request) give way to memory. A prompt waiting for a block another computes (`block_waits`)
    is left out; the oldest of the others advances. With `stacking` (and no memory budget: a
    stacked call copies its rows' caches, which the estimate does not count) the planned calls
    of one shape share stacked calls (`stacked_calls`)."""
    waits: set[str] = set()
    while True:  # each pass leaves out the prompts that would start a block another is inside
        ready = [c for c in candidates if c.request_id not in waits]
        waiting = [WaitingPrefill(c.request_id, c.order, c.units_left) for c in ready]
        oldest = min(waiting, key=lambda w: w.order, default=None)
        tokens = step_token_budget(budget.tokens, decode_rows,
                                   oldest.units_left[0] if oldest is not None and oldest.units_left else 0,
                                   decode_only=budget.decode_only, target_s=budget.target_s,
                                   rates=budget.rates, oldest_streams=budget.oldest_streams,
                                   target_floors=budget.target_floors,
                                   optional_only=bool(ready) and all(c.keeps_only for c in ready))
        planned = plan_step(decode_rows, waiting, StepBudget(tokens, budget.prefill_rows))
        more = block_waits(candidates, {work.request_id: work.units for work in planned.prefills}) - waits
        if not more:
            break
        waits |= more
    by_id = {c.request_id: c for c in candidates}
    # Only prompts planned to finish this step share a padded call: it computes all of each.
    short = [by_id[work.request_id] for work in planned.prefills
             if work.finishes and by_id[work.request_id].batchable]
    groups: list[list[Candidate]] = []
    if len(short) > 1:
        lengths = [c.prompt_tokens for c in short]
        groups = [[short[i] for i in group]
                  for group in padding_groups(lengths, max_padding, budget.prefill_rows) if len(group) > 1]
    plan = StepPlan(tokens, decode_rows, planned.prefills,
                    tuple(tuple(c.request_id for c in group) for group in groups),
                    waiting_for_blocks=tuple(c.request_id for c in candidates if c.request_id in waits))
    if memory is None or not planned.prefills:
        if stacking is None:
            return plan
        return replace(plan, stacks=stacked_calls(plan, by_id, bucket, stacking))
    return _fit_memory(plan, by_id, groups, memory, bucket)


def stackable_units(candidate: Candidate, units: int, bucket: int, most_tokens: int
                    ) -> list[tuple[int, int, int]]:
    """The calls of a prompt's next `units` units that may be rows of stacked calls, as (chunk,
    offset, padded length): the longest run of them at the end, each a whole chunk in one unit
    (all its layers: a chunk in layer slices is one call over several steps), no prefix block
    (a block is kept, or skipped, as it is built), at most `most_tokens` long once padded."""
    calls: list[tuple[int, int, int]] = []
    if candidate.stack_key is None:
        return calls
    starts = [0, *accumulate(candidate.chunks)]
    first = candidate.done_units
    for index in range(first + units - 1, first - 1, -1):
        unit = candidate.units[index]
        whole = unit.starts_chunk and (index + 1 == len(candidate.units)
                                       or candidate.units[index + 1].chunk != unit.chunk)
        size = candidate.chunks[unit.chunk]
        padded = bucketed(size, bucket) if size > 1 else size
        if not whole or unit.chunk < len(candidate.block_keys) or padded > most_tokens:
            break
        calls.append((unit.chunk, starts[unit.chunk], padded))
    return calls[::-1]


def stacked_calls(plan: StepPlan, by_id: Mapping[str, Candidate], bucket: int, stacking: Stacking
                  ) -> tuple[StackedCall, ...]:
    """The plan's calls that share stacked calls: of every planned prompt outside a padded group,
    its `stackable_units`, grouped by shape (`scheduling.stack_groups`), oldest prompt first."""
    grouped = {rid for group in plan.groups for rid in group}
    calls: list[tuple[str, int, int, int, str]] = []  # (request, chunk, offset, padded, key)
    for work in plan.prefills:
        candidate = by_id[work.request_id]
        if work.request_id in grouped or candidate.stack_key is None:
            continue
        for chunk, offset, padded in stackable_units(candidate, work.units, bucket, stacking.most_tokens):
            calls.append((work.request_id, chunk, offset, padded, candidate.stack_key))
    groups: list[list[int]] = []
    for one_token in (False, True):  # each length measured on its own (Stacking.counts_for)
        kind = [index for index, call in enumerate(calls) if (call[3] == 1) == one_token]
        shapes = [(calls[i][2], calls[i][3], calls[i][4]) for i in kind]
        groups += [[kind[i] for i in group]
                   for group in stack_groups(shapes, stacking.counts_for(1 if one_token else 2))]
    groups.sort(key=lambda group: (calls[group[0]][2], group[0]))
    return tuple(StackedCall(calls[group[0]][2], calls[group[0]][3], tuple(calls[i][0] for i in group),
                             tuple(calls[i][1] for i in group)) for group in groups)


def block_waits(candidates: Sequence[Candidate], planned: Mapping[str, int]) -> set[str]:
    """The prompts that must not compute their next block now because another prompt is
    computing it: it is *inside* that block (it computed some of the block's layer units, in an
    earlier step or earlier in this one: `planned` gives each planned prompt's units this step,
    in the order the step builds them, oldest first). A prompt whose next blocks another finishes
    earlier in this step computes nothing of them: it starts after them when it is built (the
    executor looks again), so it waits only if the block after them is one another is inside.
    The block is kept when its last unit is built and the waiter starts after it, a step later;
    a prompt that leaves (cancelled, failed) or starts again from its first chunk is inside
    nothing, so whoever waited for it computes the block itself. A request never waits for a
    keep task (optional work, scheduled last); a keep task waits for anyone."""
    inside: dict[bytes, str] = {}  # block -> the prompt inside it (started, not finished)
    for c in candidates:
        key = c.block_at(c.done_units)
        if key is not None and not c.units[c.done_units].starts_chunk:
            inside.setdefault(key, c.request_id)
    keeps = {c.request_id for c in candidates if c.keeps_only}
    finished: set[bytes] = set()  # blocks whose last unit an earlier prompt builds this step
    waits: set[str] = set()
    by_id = {c.request_id: c for c in candidates}
    ordered = [by_id[rid] for rid in planned] + [c for c in candidates if c.request_id not in planned]
    for c in ordered:
        done = c.done_units
        if done < len(c.units) and c.units[done].starts_chunk:
            while (key := c.block_at(done)) is not None and key in finished:
                done = c.first_unit_of(c.units[done].chunk + 1)  # found kept when it is built
            owner = inside.get(key) if key is not None and c.units[done].starts_chunk else None
            if owner is not None and owner != c.request_id and (c.keeps_only or owner not in keeps):
                waits.add(c.request_id)
                continue
        for index in range(done, min(done + planned.get(c.request_id, 0), len(c.units))):
            key = c.block_at(index)
            if key is None:
                continue
            ends = index + 1 == len(c.units) or c.units[index + 1].chunk != c.units[index].chunk
            if ends:
                finished.add(key)
                if inside.get(key) == c.request_id:
                    del inside[key]
            else:
                inside.setdefault(key, c.request_id)
    return waits


def _fit_memory(plan: StepPlan, by_id: dict[str, Candidate], groups: list[list[Candidate]], memory: Memory,
                bucket: int) -> StepPlan:
    """Of the planned prefill work, what fits beside the KV held and reserved and the decode
    rows' activations. A padded group keeps its oldest members (one left runs alone); a prompt
    keeps its first units; the oldest planned prompt always advances, alone when even that is
    over (kept prefix blocks are freed first as far as that makes it fit). A keep task whose next
    unit alone does not fit beside everything held is dropped. What is left out waits for a later
    step, its place in line kept."""
    shape = memory.shape
    units = {work.request_id: work.units for work in plan.prefills}

    def alone(candidate: Candidate, count: int) -> int:
        chunk_bytes = chunk_activation_bytes(shape, candidate.chunks, bucket)
        return prefill_work_bytes(chunk_bytes, candidate.units, candidate.done_units, count)

    def batched(members: Sequence[Candidate]) -> int:
        head = bucketed(max(c.prompt_tokens - 1 for c in members), bucket)
        return batched_prefill_bytes(shape, len(members), head, memory.kv_per_token, memory.cache_step)

    # (order, each prefix's cost, the group or None, its oldest candidate), oldest first
    calls: list[tuple[int, list[int], list[Candidate] | None, Candidate]] = []
    grouped: set[str] = set()
    for group in groups:
        oldest_first = sorted(group, key=lambda c: c.order)
        first = oldest_first[0]
        costs = [alone(first, units[first.request_id])]
        costs += [batched(oldest_first[:count]) for count in range(2, len(group) + 1)]
        calls.append((first.order, list(accumulate(costs, max)), group, first))
        grouped.update(c.request_id for c in group)
    for work in plan.prefills:
        if work.request_id not in grouped:
            candidate = by_id[work.request_id]
            costs = [alone(candidate, count) for count in range(1, work.units + 1)]
            calls.append((candidate.order, list(accumulate(costs, max)), None, candidate))
    calls.sort(key=lambda call: call[0])
    rows = plan.decode_rows
    decode = activation_bytes(shape, rows, 1, memory.decode_attended, sampled=True) if rows else 0
    room = memory.budget - memory.pool_bytes - memory.reserved
    kept_room = room - decode - memory.prefix_bytes
    dropped = [call for call in calls if call[3].keeps_only and call[1][0] > kept_room]
    calls = [call for call in calls if call not in dropped]
    # Kept prefixes give way to the oldest prompt's next work, as they do to admission; whole
    # blocks go, so at least this much is freed (the fit assumes no more).
    evict = max(0, calls[0][1][0] + decode - (room - memory.prefix_bytes)) if calls else 0
    room -= max(0, memory.prefix_bytes - evict)
    kept = fit_activations([costs for _, costs, _, _ in calls], room - decode)
    fitted_groups: list[tuple[str, ...]] = []
    units_now: dict[str, int] = {}
    estimate = decode
    for (_, costs, batch, first), count in zip(calls, kept, strict=True):
        if count:
            estimate += costs[count - 1]
        if batch is None:
            units_now[first.request_id] = count
            continue
        chosen = {c.request_id for c in sorted(batch, key=lambda c: c.order)[:count]}
        members = [c.request_id for c in batch if c.request_id in chosen]  # the group's own order
        if len(members) > 1:
            fitted_groups.append(tuple(members))
        for rid in members:
            units_now[rid] = units[rid]
    prefills = []
    for work in plan.prefills:
        count = units_now.get(work.request_id, 0)
        if count:
            candidate = by_id[work.request_id]
            left = candidate.units_left
            prefills.append(PrefillWork(work.request_id, count, sum(left[:count]), count == len(left)))
    capped = sum(kept) < sum(len(costs) for _, costs, _, _ in calls)
    return replace(plan, prefills=tuple(prefills), groups=tuple(fitted_groups),
                   dropped_keeps=tuple(call[3].request_id for call in dropped), evict_prefix_bytes=evict,
                   activation_estimate=estimate, capped=capped, over_budget=estimate > room)


def update(candidates: Sequence[Candidate], plan: StepPlan, built: Mapping[str, int] | None = None
           ) -> tuple[tuple[Candidate, ...], tuple[str, ...]]:
    """The candidates after the plan ran: each advanced by its planned units (a dropped keep task
    gone), or to the units `built` says it has done where the executor built otherwise (a cached
    start found during the step skipped units; a call that raised starts again from none); those
    whose last unit ran leave the candidates and are named in `finished` (a prompt's first token
    is then read back; a keep task is done)."""
    ran = {work.request_id: work.units for work in plan.prefills}
    built = built or {}
    dropped = set(plan.dropped_keeps)
    left: list[Candidate] = []
    finished: list[str] = []
    for candidate in candidates:
        if candidate.request_id in dropped:
            continue
        done = built.get(candidate.request_id, candidate.done_units + ran.get(candidate.request_id, 0))
        if done >= len(candidate.units):
            finished.append(candidate.request_id)
        else:
            left.append(replace(candidate, done_units=done, batchable=candidate.batchable and done == 0))
    return tuple(left), tuple(finished)


@dataclass(frozen=True, slots=True)
class Admission:
    """What admitting a request's KV comes to: the verdict (`scheduling.kv_admission`), whether
    the keep tasks give way first (`drop_keep_tasks`), and the kept prefix bytes to free (at
    least; 0 when none need go)."""

    verdict: KvAdmission
    drop_keep_tasks: bool = False
    evict_prefix_bytes: int = 0


def admission(need: int, others: int, keeping: int, pool_reserved: int, prefix_bytes: int,
              budget: int) -> Admission:
    """Admit `need` bytes of a request's own KV beside `others` reserved by the other requests
    (`keeping` of them by keep tasks), the slot pool's `pool_reserved` and `prefix_bytes` of kept
    prefix blocks, in `budget`. Kept prefixes give way to it, then keep tasks, as far as it needs
    and only when that makes it fit: a request refused anyway takes nothing from them (the verdict
    counts every kept block as gone)."""
    verdict = kv_admission(need, others, pool_reserved, budget)
    drop = False
    if verdict is KvAdmission.LATER and kv_admission(need, others - keeping, pool_reserved,
                                                     budget) is KvAdmission.FITS:
        drop, others, verdict = True, others - keeping, KvAdmission.FITS
    if verdict is not KvAdmission.FITS:
        return Admission(verdict)
    return Admission(verdict, drop, max(0, need + others + pool_reserved + prefix_bytes - budget))


class PrefillFailure(enum.Enum):
    """What a prefill whose call raised becomes."""

    RESTART = "restart"  # once more from its first token, in a later step
    FAIL = "fail"  # the request fails with the error
    GIVE_UP = "give_up"  # a keep task: nobody waits for it, the conversation is just not kept


def prefill_failure(*, keeps_only: bool, retried: bool, typed: bool) -> PrefillFailure:
    """A keep task gives up; a prompt's first untyped error (`typed`: the engine's own
    `StatecoreError`, a refusal that computing again would repeat) starts it again: prefill is a
    pure function of the prompt, so a transient error costs time, not the request; a second
    error, or a typed one, fails it."""
    if keeps_only:
        return PrefillFailure.GIVE_UP
    if not retried and not typed:
        return PrefillFailure.RESTART
    return PrefillFailure.FAIL


def handoff_imminent(arrived: Sequence[float], now: float) -> bool:
    """A handed-off request whose last piece arrived (`arrived`: when, in seconds) less than
    `HANDOFF_COMING_S` ago joins any moment (one that never does stops counting after that)."""
    return any(now - since < HANDOFF_COMING_S for since in arrived)


def decode_only(joined: bool, arrived: Sequence[float], now: float, expected: Sequence[float] = ()) -> bool:
    """Whether this step decodes only (no prefill work): a handed-off request joined since the
    last step, or one is about to (`handoff_imminent`), or its prefill node has started the step
    computing its last pieces (`expected`: since when, in seconds; for HANDOFF_EXPECTED_S at
    most), and its second token must wait for no prefill (a step of this node's own prefill can
    be many decode steps long, and one started before the last piece arrives still runs when it
    does)."""
    return (joined or handoff_imminent(arrived, now)
            or any(now - since < HANDOFF_EXPECTED_S for since in expected))
