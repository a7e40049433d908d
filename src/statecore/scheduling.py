"""The engine's scheduling policy: what one device step computes, as a pure function.

Every step of an engine node runs all of its decoding rows (one token each) and, with what is
left of a per-step token budget, the next prefill work of waiting prompts, oldest first (FCFS).
A prompt is cut into fixed chunks once, when it arrives (`prefill_chunks`: generate_step's order,
so the computation is the same whatever the load), and each chunk's evaluation into *work units*
(`prefill_units`): consecutive slices of the model's layers, each at most a unit's worth of
tokens x layers. A step takes whole units: a long chunk is evaluated a few layers per step while
the rows already decoding keep streaming, so no stream waits longer than one step's budget, and
the numbers are those of one call (the same graph, evaluated in pieces). `padding_groups` decides
which short prompts share one padded model call; `bucketed` rounds a call's length up to a shape
bucket. `step_token_budget` is the one home of a step's token budget: the configured one while no
stream decodes, the decode rows alone right after a handed-off request joins, and otherwise what
the step-time target leaves for prefill at the rates the engine measures of its own steps
(`StepRates`, `measured_step`): a prompt arriving beside streams advances a slice a step, and no
stream waits the whole prompt's prefill between two tokens. `kv_admission` decides whether a
request's KV cache fits the node's memory budget now, later, or never. Under a memory budget a
step's prefill is also capped by its transient activations: `activation_bytes` estimates one
model call's from the model's shape (`ModelShape`), `chunk_activation_bytes` /
`prefill_work_bytes` / `batched_prefill_bytes` price a step's prefill work, and
`fit_activations` keeps of the planned calls what fits beside the KV held (the oldest prompt
always advances, alone if it must). `joining_choices` decides when the choices of one request
(n > 1) join a batch whose rows are padded to each other (the batch lane): together, in choice
order. `stack_groups` decides which prompts' next calls of one shape (the same cache offset and
padded length) share one *stacked* call, a row each, where the device computes a row the same
whatever the call's row count (measured at load): a burst of prompts that start from one cached
system prompt then computes its tails in a few calls instead of one call each.
The engine (`adapters.mlx`) performs the plan; nothing here touches a device.
This module must never import trio, httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_STEP_PREFILL_TOKENS",
    "DECODE_NODE_FLOOR_MULTIPLE",
    "SINGLE_NODE_CPU_FLOOR_MULTIPLE",
    "STEP_TARGET_FLOOR_MULTIPLE",
    "KvAdmission",
    "ModelShape",
    "PrefillUnit",
    "PrefillWork",
    "StepBudget",
    "StepPlan",
    "StepRates",
    "WaitingPrefill",
    "activation_bytes",
    "batched_prefill_bytes",
    "bucketed",
    "chunk_activation_bytes",
    "default_step_tokens",
    "fit_activations",
    "joining_choices",
    "kv_admission",
    "measured_step",
    "padding_groups",
    "plan_step",
    "stack_groups",
    "prefill_chunks",
    "prefill_units",
    "prefill_work_bytes",
    "DEVICE_PIECE_BYTES",
    "STREAMED_PIECE_BYTES",
    "STREAMED_SLICE_S",
    "STREAMED_SLICE_TOKENS",
    "step_token_budget",
    "streamed_pieces",
    "work_unit_tokens",
]


DEFAULT_CHUNK_TOKENS = 256
"""A prefill call's tokens unless the node says otherwise: the prefix cache's block (a prompt is
reused in whole chunks), small enough for a shared system prompt to span several."""

DEFAULT_STEP_PREFILL_TOKENS = 2048
"""The prefill tokens one step computes by default (beside its decode rows): several chunks of a
prompt per step, so a small chunk costs a long prompt no extra steps."""


def default_step_tokens(max_batch: int, chunk_size: int) -> int:
    """The default per-step token budget: a full decode batch plus a step's prefill, at least a
    whole chunk of it."""
    return max_batch + max(chunk_size, DEFAULT_STEP_PREFILL_TOKENS)


def bucketed(tokens: int, bucket: int) -> int:
    """`tokens` rounded up to a multiple of `bucket` (a shape bucket; 0 or 1: no rounding)."""
    return tokens if bucket <= 1 else -(-tokens // bucket) * bucket


def prefill_chunks(prompt_tokens: int, chunk_size: int) -> tuple[int, ...]:
    """The token counts of a prompt's prefill calls, in order: prompt[:-1] in chunks of at most
    `chunk_size`, then the last prompt token alone (its logits give the first token)."""
    if prompt_tokens < 1 or chunk_size < 1:
        raise ValueError("a prompt has at least one token and a chunk at least one")
    head = prompt_tokens - 1
    full, rest = divmod(head, chunk_size)
    return (chunk_size,) * full + ((rest,) if rest else ()) + (1,)


@dataclass(frozen=True, slots=True)
class PrefillUnit:
    """One piece of a prompt's prefill: chunk `chunk`'s layers [first_layer, end_layer), worth
    `tokens` (the chunk's tokens times the share of the layers, rounded up). A unit finer than a
    layer also evaluates `inner`: points inside the chunk's layers (indices into their list in
    the graph's order, `inner_points` per layer), after its layers; a unit of inner points only
    completes no layer (first_layer == end_layer)."""

    chunk: int
    first_layer: int
    end_layer: int
    tokens: int
    inner: tuple[int, ...] = ()

    @property
    def starts_chunk(self) -> bool:
        return self.first_layer == 0


def prefill_units(chunks: Sequence[int], layers: int, unit_tokens: int, inner_points: int = 0
                  ) -> tuple[PrefillUnit, ...]:
    """Each chunk's layers in slices of at most `unit_tokens` worth (at least one layer a slice,
    as equal as the layers allow); a chunk that fits is one unit of all its layers.

    With `inner_points` (points inside each layer where its evaluation may stop: the model's
    attention output, the MLP's first projection; `adapters.mlx.prefill.mark_inner_points`), a
    chunk whose slices would be single layers is cut at those points too: a unit each, a layer's
    keys and values being the last point of its work (they need the whole layer before it), so
    layer k's unit evaluates what its inner points left of layer k - 1 and its own keys and values.
    The first layer's keys and values (the embedding and a projection) go with layer 0's first
    inner point, and the last layer has none (nothing after its keys and values is needed unless
    the chunk samples, and a chunk of one token is one unit). Each point is worth an equal share of
    the chunk's tokens, so its units are worth the chunk (as its whole-layer units are)."""
    if layers < 1 or unit_tokens < 1 or inner_points < 0:
        raise ValueError("a model has at least one layer and a unit at least one token")
    units: list[PrefillUnit] = []
    for index, size in enumerate(chunks):
        per_unit = max(1, min(layers, (unit_tokens * layers) // size))
        if per_unit == 1 and layers > 1 and inner_points:
            units.extend(_inner_units(index, size, layers, inner_points))
            continue
        pieces = -(-layers // per_unit)
        for piece in range(pieces):
            first, end = piece * layers // pieces, (piece + 1) * layers // pieces
            units.append(PrefillUnit(index, first, end, -(-size * (end - first) // layers)))
    return tuple(units)


def _inner_units(chunk: int, size: int, layers: int, inner_points: int) -> list[PrefillUnit]:
    """A chunk's units at every inner point: layer 0 with its first point, then in graph order
    each point alone, each layer's keys and values after its layer before's points."""
    points = layers + (layers - 1) * inner_points
    share = -(-size // points)
    units = [PrefillUnit(chunk, 0, 1, -(-2 * size // points), (0,))]
    units += [PrefillUnit(chunk, 1, 1, share, (point,)) for point in range(1, inner_points)]
    for layer in range(1, layers):
        units.append(PrefillUnit(chunk, layer, layer + 1, share))
        if layer + 1 < layers:
            units += [PrefillUnit(chunk, layer + 1, layer + 1, share, (layer * inner_points + point,))
                      for point in range(inner_points)]
    return units


@dataclass(frozen=True, slots=True)
class StepBudget:
    """How much one step may compute.

    `tokens` bounds decode rows plus prefill tokens; `prefill_rows` bounds how many prompts
    advance in one step (each is at least one model call). The engine guarantees `tokens` >= its
    largest decode batch + its largest unit, so the oldest waiting prompt always advances.
    """

    tokens: int
    prefill_rows: int


@dataclass(frozen=True, slots=True)
class WaitingPrefill:
    """A prompt with prefill work left: `order` is its arrival number (FCFS), `units_left` the
    tokens each of its remaining work units is worth."""

    request_id: str
    order: int
    units_left: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrefillWork:
    """Run the next `units` work units of one prompt this step (`tokens` tokens in all)."""

    request_id: str
    units: int
    tokens: int
    finishes: bool  # its last unit runs: the first token is sampled this step


@dataclass(frozen=True, slots=True)
class StepPlan:
    decode_rows: int
    prefills: tuple[PrefillWork, ...]

    @property
    def tokens(self) -> int:
        return self.decode_rows + sum(work.tokens for work in self.prefills)


def plan_step(decode_rows: int, waiting: Sequence[WaitingPrefill], budget: StepBudget) -> StepPlan:
    """Every decode row, then whole units of the oldest prompts while the budget lasts.

    A prompt whose next unit does not fit is passed over (a smaller, later one may fit), but it
    keeps its place: the oldest prompt is always first in line, so none starves. The plan never
    exceeds `budget.tokens`; decode rows alone may (they are never made to wait), which the
    engine prevents by sizing the budget above its batch.
    """
    if decode_rows < 0:
        raise ValueError("decode_rows must be >= 0")
    left = budget.tokens - decode_rows
    chosen: list[PrefillWork] = []
    for prompt in sorted(waiting, key=lambda w: w.order):
        if len(chosen) >= budget.prefill_rows or left <= 0:
            break
        taken = tokens = 0
        for size in prompt.units_left:
            if tokens + size > left:
                break
            taken += 1
            tokens += size
        if taken:
            chosen.append(PrefillWork(prompt.request_id, taken, tokens, taken == len(prompt.units_left)))
            left -= tokens
    return StepPlan(decode_rows, tuple(chosen))


# -- the step's budget: configured, or sized by a step-time target ---------------------------------

STEP_TARGET_FLOOR_MULTIPLE = 16.0
"""The step-time target when none is given: this many times a step without prefill (the decode
step the streams see). A step beside streams then gives waiting prompts 15/16 of its time and the
streams' decode the rest, so a prompt's prefill takes about 1/15 longer than alone, while a
stream's worst gap beside a long prompt stays 16 of its usual steps. A smaller multiple costs more
than it seems: at 4 the prompts got 3/4 of the device (a step took one layer of a chunk), and on a
mixed load, where a prompt waits for those before it, the quarter lost compounds: on the CPU the
engine's mean wait for a first token rose 1.45x on the realish mix, against 1.06x at 16
(docs/performance.md, "A long prompt beside streams")."""

DECODE_NODE_FLOOR_MULTIPLE = 4.0
"""The multiple a decode node's serving command passes: its streams' gaps are what it is for, and
most of its prompts are prefilled elsewhere, so a stream waits at most 4 of its steps and the
few prompts it prefills itself take longer."""

SINGLE_NODE_CPU_FLOOR_MULTIPLE = 2.0
"""The multiple a single node's serving command passes on the CPU. There a step of the fixed
budget beside streams is seconds long (2,048 tokens of a 23 M model in bf16: ~20 s), and a burst
of prompts arriving together made every stream that had started wait whole such steps: realish
at 32, a stream's gap p99 34-88x mlx_lm.server's. At 2 a step gives its prefill about the decode
step's time and at least one unit; with units inside a layer (`prefill_units`' inner points) that
holds (the 23 M llama in float32, realish, medians of 2 reps: gap p99 0.22-0.52x mlx_lm.server's,
TTFT p50 0.30-0.93x). At 4 TTFT p50 was 0.69x 2's at 8 and 1.04x at 32, but the gap p99 1.27-1.34x,
and at 32 820-1126 ms against whole-layer units at 2's 560-584 in another run (docs/performance.md,
"Serving on the CPU")."""

_RATE_WEIGHT = 0.2  # each new step's share of the moving averages: about the last five steps count


@dataclass(frozen=True, slots=True)
class StepRates:
    """What the engine measured of its own steps (moving averages; None until a step showed it).

    `floor_s` is a step's seconds without prefill: its decode rows and the per-step host work.
    `prefill_token_s` is the seconds each prefill token adds to a step, measured as the steps
    with prefill exceeding the floor (`excess_s` over `prefill_tokens`, both averaged).
    """

    floor_s: float | None = None
    excess_s: float = 0.0
    prefill_tokens: float = 0.0

    @property
    def prefill_token_s(self) -> float | None:
        return self.excess_s / self.prefill_tokens if self.prefill_tokens > 0 else None


def measured_step(rates: StepRates, seconds: float, prefill_tokens: int) -> StepRates:
    """`rates` after one step that took `seconds` and computed `prefill_tokens` of prefill work
    beside its decode rows. A step without prefill moves the floor; one with prefill moves the
    rate by what it took beyond the floor (all of it while no floor is known: an overestimate,
    which only makes the next slices smaller)."""
    if seconds < 0 or prefill_tokens < 0:
        raise ValueError("a step's seconds and tokens are >= 0")
    if prefill_tokens == 0:
        floor = seconds if rates.floor_s is None else rates.floor_s + _RATE_WEIGHT * (seconds - rates.floor_s)
        return replace(rates, floor_s=floor)
    excess = max(0.0, seconds - (rates.floor_s or 0.0))
    keep = 1.0 - _RATE_WEIGHT
    if rates.prefill_tokens == 0:
        return replace(rates, excess_s=excess, prefill_tokens=float(prefill_tokens))
    return replace(rates, excess_s=keep * rates.excess_s + _RATE_WEIGHT * excess,
                   prefill_tokens=keep * rates.prefill_tokens + _RATE_WEIGHT * prefill_tokens)


def work_unit_tokens(step_tokens: int, max_batch: int, chunk_size: int, layers: int, *, timed: bool) -> int:
    """The most one prefill work unit may be worth (`prefill_units`): what a step of `step_tokens`
    leaves beside a full batch; when a step-time target sizes the steps (`timed`), at most one
    layer of a chunk, the finest slice, so that the target can cut a step as fine as the model
    allows (the units of one chunk that a step takes are still evaluated as its one graph)."""
    room = step_tokens - max_batch
    return min(room, -(-chunk_size // layers)) if timed else room


STREAMED_SLICE_TOKENS = 512
"""The fewest tokens of a step while its only prompt streams its KV to a decode node and nothing
decodes: each step's piece travels while the next is computed, so when the first token is
sampled only the last slice is left to move (a whole prompt in one step would leave all of it)."""

STREAMED_SLICE_S = 0.5
"""...and the least time such a step should take at the measured rate: a sliced step has a fixed
cost, measured at ~50 ms on an H100 (an 8,000-token prompt of a 1B model in 5 slices took 1.8x
its one-step prefill; fixed 512-token slices on an H200 made it 1.5-1.9x), so a slice of 500 ms
keeps it near a tenth. On a CPU a 512-token slice already takes longer; on a fast GPU a 1B
model's prompts of 8,000 tokens stay one step, their KV leaving in pieces after it."""


STREAMED_PIECE_BYTES = 16 * 1024 * 1024
"""The most KV bytes one streamed piece carries: a step's KV leaves in pieces of a few layers each,
so that one piece's copy out of the device, its transfer, its check and its copy into the decode
node's slot overlap the next piece's instead of following a whole step's KV one after another."""

DEVICE_PIECE_BYTES = 256 * 1024 * 1024
"""...and a piece that stays in GPU memory (a device piece): its copies are device to device (64 MiB,
a 2,000-token chunk of a 1B model, in a fraction of a millisecond on an H100), so there is nothing
to overlap, and each piece's fixed costs (its document's trip, a job on each node's device thread)
would only add up; a quarter of the default device buffer (`STATECORE_KV_DEVICE_BYTES`), so that a
piece still fits beside the ones not yet taken."""


def streamed_pieces(start: int, stop: int, first_layer: int, end_layer: int, *, layer_token_bytes: int,
                    most_bytes: int = STREAMED_PIECE_BYTES) -> list[tuple[int, int, int, int]]:
    """A step's KV of tokens [start, stop) and layers [first_layer, end_layer), as pieces
    (start, stop, first layer, end layer) of at most `most_bytes` (`layer_token_bytes`: one
    token's keys and values in one layer): by groups of whole layers, a layer's tokens split too
    only when one layer alone is larger. In order: a layer's token ranges follow one another, the
    layer groups of one token range ascend."""
    if not (0 <= start < stop and 0 <= first_layer < end_layer) or layer_token_bytes <= 0 or most_bytes <= 0:
        raise ValueError("a piece needs tokens, layers and sizes > 0")
    tokens = stop - start
    layers_per_piece = most_bytes // (tokens * layer_token_bytes)
    if layers_per_piece >= 1:
        return [(start, stop, layer, min(end_layer, layer + layers_per_piece))
                for layer in range(first_layer, end_layer, layers_per_piece)]
    tokens_per_piece = max(1, most_bytes // layer_token_bytes)
    return [(first, min(stop, first + tokens_per_piece), layer, layer + 1)
            for first in range(start, stop, tokens_per_piece) for layer in range(first_layer, end_layer)]


def step_token_budget(configured: int, decode_rows: int, oldest_unit: int, *, decode_only: bool,
                      target_s: float | None, rates: StepRates, oldest_streams: bool = False,
                      target_floors: float = STEP_TARGET_FLOOR_MULTIPLE, optional_only: bool = False) -> int:
    """The tokens one step may compute (`StepBudget.tokens`): the one place that decides it.

    - `decode_only` (a handed-off request joined, or is about to): the decode rows alone, so its
      second token waits for no prefill.
    - no stream decoding and the oldest prompt prefilling streams its KV to a decode node
      (`oldest_streams`): a slice of at least STREAMED_SLICE_TOKENS and STREAMED_SLICE_S at the
      measured rate (and its next unit), so its KV moves while the rest is computed, and a later
      prompt takes only what is left of a slice (its whole chunk beside the oldest's last slice
      would hold that prompt's first token back by its own time); until a rate is measured, the
      configured budget (as below).
    - no stream decoding: the whole `configured` budget; nobody waits between tokens.
    - streams decoding: the decode rows plus the prefill tokens that fit the step-time target at
      the measured rates (`target_s`: seconds, 0 = off (the configured budget), None = the default,
      `target_floors` times the measured floor), never less than the oldest waiting
      prompt's next unit (`oldest_unit`, 0 when none waits), so the oldest prompt always advances,
      and never more than `configured`. Until a rate is measured, that one unit.
    - only optional work waits (`optional_only`: keep tasks, which nobody waits for) and a target
      is on: what fits the target and no more, so optional work takes only capacity the streams
      leave (beside streams no unit is forced: a stream's step never outgrows the target for
      it); with no stream decoding, at least its next unit (idle capacity), so that a prompt
      arriving meanwhile waits a target's step, not a whole configured budget.
    The engine keeps `configured` >= its largest decode batch + its largest unit.
    """
    if min(configured, decode_rows, oldest_unit) < 0 or (target_s is not None and not target_s >= 0):
        raise ValueError("budgets, rows, units and the target are >= 0")
    if not target_floors > 0:
        raise ValueError("the default target is a positive multiple of the floor")
    if decode_only:
        return decode_rows
    if decode_rows == 0 and oldest_streams:
        per_token = rates.prefill_token_s
        if per_token is None or per_token <= 0:
            return configured  # unmeasured: slices could cost more than they save
        worth = max(STREAMED_SLICE_TOKENS, math.ceil(STREAMED_SLICE_S / per_token))
        return min(configured, max(oldest_unit, worth))
    if target_s == 0 or (decode_rows == 0 and not optional_only):
        return configured
    least = decode_rows + (0 if optional_only and decode_rows else oldest_unit)
    floor, per_token = rates.floor_s, rates.prefill_token_s
    target = target_s
    if target is None and floor is not None:
        target = target_floors * floor
    if target is None or per_token is None:
        return min(configured, least)
    room = target - (floor or 0.0)
    if per_token <= 0 or room >= configured * per_token:  # (before dividing: a rate near 0 overflows)
        fits = configured
    else:
        fits = int(room / per_token) if room > 0 else 0
    return min(configured, max(least, decode_rows + fits))


def padding_groups(lengths: Sequence[int], max_waste: float, max_rows: int) -> list[list[int]]:
    """Group indices of `lengths` into padded batches: each group is padded to its longest
    member, and a group's padding stays within `max_waste` of its real tokens. Shortest first;
    every index lands in exactly one group of at most `max_rows`."""
    if not max_waste >= 0.0 or max_rows < 1:
        raise ValueError("max_waste must be >= 0 and max_rows >= 1")
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for index in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        size = lengths[index]
        # Sorted ascending: the newcomer is the group's longest, so padding = its length * rows - real.
        padded = size * (len(current) + 1)
        if current and (len(current) >= max_rows or padded - (real + size) > max_waste * (real + size)):
            groups.append(current)
            current, real = [], 0
        current.append(index)
        real += size
    if current:
        groups.append(current)
    return groups


def stack_groups(shapes: Sequence[tuple[int, int, str]], counts: Collection[int]) -> list[list[int]]:
    """Group indices of `shapes` into stacked calls: `shapes[i]` is call i's (cache offset, padded
    length, key: what else its rows must share, e.g. an adapter), in priority order (oldest
    prompt first). A stacked call's rows have one shape and a row count in `counts` (the counts
    at which the device computes every row as a call of that row alone does; 1 is implied), as
    many rows a call as `counts` allows, oldest first; what is left over runs alone. Returns the
    groups of two rows or more, by offset (a prompt's calls come one after another), then by
    their first index; every index is in one group at most."""
    allowed = sorted({count for count in counts if count >= 2}, reverse=True)
    by_shape: dict[tuple[int, int, str], list[int]] = {}
    for index, shape in enumerate(shapes):
        by_shape.setdefault(shape, []).append(index)
    groups: list[list[int]] = []
    for members in by_shape.values():
        while (size := next((count for count in allowed if count <= len(members)), 0)):
            groups.append(members[:size])
            members = members[size:]
    return sorted(groups, key=lambda group: (shapes[group[0]][0], group[0]))


class KvAdmission(enum.Enum):
    FITS = "fits"  # take it now
    LATER = "later"  # it fits once others leave: refuse for now, with a retry hint
    NEVER = "never"  # it does not fit even an idle node: the client must ask for less


def kv_admission(need: int, reserved: int, fixed: int, budget: int) -> KvAdmission:
    """Whether a request whose KV cache takes `need` more bytes fits a budget of `budget` bytes,
    of which `fixed` are set aside for good (the slot pool) and `reserved` are held by the
    requests live now. Nothing is allocated before this answer."""
    if min(need, reserved, fixed, budget) < 0:
        raise ValueError("byte counts are >= 0")
    if fixed + need > budget:
        return KvAdmission.NEVER
    if fixed + reserved + need > budget:
        return KvAdmission.LATER
    return KvAdmission.FITS


# -- transient activations -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a model call's transient activations grow with (read from the model's config by the
    engine): `heads` query heads and `kv_heads` key/value heads of `head_dim`, the MLP's
    `intermediate` size, the vocabulary, and the bytes of one activation element."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        if min(self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate, self.vocab,
               self.dtype_bytes) < 1:
            raise ValueError("every size of a model shape is >= 1")

    @property
    def token_bytes(self) -> int:
        """One token's intermediates in one layer, all counted as live at once: the hidden state,
        its two norms, the attention's output and the residual (5 x hidden); queries (projected,
        rotated, scaled), the attention's output and its transposed copy (5 x heads x head_dim);
        keys (projected, rotated) and values (3 x kv_heads x head_dim); the MLP's gate, up and
        their product (3 x intermediate)."""
        return self.dtype_bytes * (5 * self.hidden + 5 * self.heads * self.head_dim
                                   + 3 * self.kv_heads * self.head_dim + 3 * self.intermediate)


def activation_bytes(shape: ModelShape, rows: int, tokens: int, attended: int, sampled: bool = False) -> int:
    """An upper estimate of one model call's transient bytes: `rows` sequences of `tokens` new
    tokens, each attending `attended` positions (its context and itself).

    Layers run one after another, so one layer's working set counts: the attention scores
    (rows x heads x tokens x attended, materialized where no fused attention kernel runs, as on
    the CPU) and every per-token intermediate (`ModelShape.token_bytes`); a call that samples
    adds its logits (rows x tokens x vocab, in the model's dtype and a float32 copy). KV caches
    are not counted here: the budget reserves them."""
    if min(rows, tokens, attended) < 0:
        raise ValueError("rows, tokens and attended are >= 0")
    scores = shape.heads * tokens * attended * shape.dtype_bytes
    logits = tokens * shape.vocab * (shape.dtype_bytes + 4) if sampled else 0
    return rows * (scores + tokens * shape.token_bytes + logits)


def chunk_activation_bytes(shape: ModelShape, chunks: Sequence[int], bucket: int = 0) -> tuple[int, ...]:
    """Each prefill chunk's call alone (`prefill_chunks`' order): a chunk of several tokens is
    padded to its shape bucket as the engine pads it, and attends every position before it and
    its own; the last chunk samples the first token."""
    estimates: list[int] = []
    before = 0
    for index, size in enumerate(chunks):
        padded = bucketed(size, bucket) if size > 1 else size
        estimates.append(activation_bytes(shape, 1, padded, before + padded, index == len(chunks) - 1))
        before += size
    return tuple(estimates)


def prefill_work_bytes(chunk_bytes: Sequence[int], units: Sequence[PrefillUnit], start: int,
                       count: int) -> int:
    """What units [start, start + count) of one prompt take in one step: each chunk they touch once
    (a chunk's work units slice its layers, and its layers run one after another)."""
    return sum(chunk_bytes[chunk] for chunk in sorted({unit.chunk for unit in units[start : start + count]}))


def batched_prefill_bytes(shape: ModelShape, rows: int, head_tokens: int, kv_per_token: int,
                          cache_step: int) -> int:
    """A padded call pair over `rows` short prompts (`head_tokens` each after padding, then every
    last token, which samples), plus the batch cache they fill: rows x the head and last token
    rounded up to the cache's allocation step, at `kv_per_token` bytes a position, held until
    each row's cache is cut out (the cut-out copies are the rows' own, which their
    reservations count)."""
    return (activation_bytes(shape, rows, head_tokens, head_tokens)
            + activation_bytes(shape, rows, 1, head_tokens + 1, sampled=True)
            + rows * kv_per_token * bucketed(head_tokens + 1, cache_step))


def fit_activations(calls: Sequence[Sequence[int]], allowance: int) -> tuple[int, ...]:
    """How many items of each planned call to run so that their activations fit `allowance`.

    `calls` are in priority order (the first holds the oldest prompt planned); `calls[j][i]` is
    what call j takes with its first i + 1 items (its prompts, or its work units, oldest first),
    non-decreasing in i. Each call keeps the most items that fit what is left, in order; the
    first call always keeps at least one, so the oldest prompt advances every step even when
    that item alone exceeds the allowance (it then runs alone: nothing else is kept). The kept
    total exceeds `allowance` only in that case.
    """
    kept: list[int] = []
    left = allowance
    for index, prefix in enumerate(calls):
        if any(b > a for a, b in zip(prefix[1:], prefix, strict=False)) or any(c < 0 for c in prefix):
            raise ValueError("a call's prefix costs are >= 0 and non-decreasing")
        count = 0
        while count < len(prefix) and prefix[count] <= left:
            count += 1
        if index == 0 and count == 0 and prefix:
            kept.append(1)
            kept.extend(0 for _ in calls[1:])
            return tuple(kept)  # the lone item: over the allowance, nothing beside it
        kept.append(count)
        if count:
            left -= prefix[count - 1]
    return tuple(kept)
def joining_choices(choices: int, arrived: Collection[int], ended: Collection[int], waited_s: float,
                    patience_s: float) -> tuple[int, ...]:
    """Which of a request's `choices` choices that reached the batch (`arrived`) join it now, in
    choice order (their rows' order); () while they wait.

    A row's numbers in such a batch depend on the rows beside it and on how each was padded when
    it joined, so the choices join in one step, once every one has arrived or `ended` (it ended
    at its first token, failed or was cancelled): the same request then computes the same bytes
    on every run and on every node. A missing choice that was last seen on this node `waited_s`
    ago, `patience_s` or more, is not waited for (it decodes elsewhere, or ended unseen).
    """
    if choices < 1 or not patience_s >= 0.0:
        raise ValueError("a request has at least one choice and patience is >= 0")
    if not arrived:
        return ()
    if len(set(arrived) | set(ended)) < choices and waited_s < patience_s:
        return ()
    return tuple(sorted(arrived))
