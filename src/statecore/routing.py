"""The router's choice of node: expected new prefill work plus load, from what each node says it holds.

Every engine node keeps the KV of whole prompt blocks it computed (`statecore.prefix`) and
publishes a summary of their keys. For a prompt, a candidate's `cached_tokens` is how many of the
prompt's leading tokens its summary says it holds (`cached_prefix_tokens`); a candidate without a
fresh summary counts as holding nothing, so when no summary is fresh the choice is the plain
least-loaded one. The cost of sending the prompt to a node is the prompt tokens it would still
compute, plus the prompt tokens it is still computing for earlier requests (`prefilling`, the
router's own count: a queue ahead of this prompt), plus `load_tokens` for each request already in
flight there (what one more running request is worth in prefill tokens, like the load term of
Dynamo's KV router). A suspect node is chosen only when no healthy one is left.

`choose_route` is the router's first decision for a turn: where its prompt is prefilled. A decode
node that holds the start of the prompt (a conversation it served keeps its KV there) takes the
turn and prefills only the rest, when that rest is shorter than the router's local-prefill
threshold (PREFIX_HIT_LOCAL); a prompt shorter than the threshold is prefilled on a decode node
anyway (LOCAL); anything else goes to a prefill node, whose KV is handed off. When the cheapest
decode node holds some of that prompt, it is the turn's decode node and the prefill node is told
where those blocks are (PREFILL_NODE_PREFIX): the prefill node may pull them from it instead of
computing them, and hands off to it as always; when no decode node holds any of it, the decode
node is the least loaded (PREFILL_NODE). When every prefill node already has at least the prompt's
worth of prefill queued and a decode node is prefilling nothing itself, that decode node takes
the prompt (OVERFLOW): a queue at the prefill nodes would otherwise make a burst of long prompts
wait one after another while the decode nodes' compute sits between decode steps.

Whether the pull pays is the prefill node's call (`prefix_pull_pays`): it pulls when moving the
blocks it lacks costs less time than computing them, by rates it measured itself (`PullRates`:
its prefill tokens per second, its pulls' bytes per second and latency, the KV bytes per token).
Pure: this module must never import trio, httpx, mlx or mlx_lm.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from enum import Enum

from statecore.prefix import block_bounds, keys_at

__all__ = ["DEFAULT_LOAD_TOKENS", "DEFAULT_PULL_BYTES_PER_S", "DEFAULT_PULL_LATENCY_S",
           "SUMMARY_KEY_BYTES", "Overflow", "PullRates", "Route", "RouteCandidate", "RouteChoice", "avoiding",
           "cached_prefix_tokens", "choose_node", "choose_route", "held_prefix_tokens", "overflows",
           "prefills_locally", "prefix_pull_pays", "prompt_summary_blocks", "prompt_summary_keys",
           "route_cost", "summary_key"]

DEFAULT_LOAD_TOKENS = 512
"""What one request in flight on a node weighs against prompt tokens it would not recompute."""

SUMMARY_KEY_BYTES = 8
"""Summaries carry each block key's first 8 bytes: a false match only costs a worse choice (the
node checks its full keys itself), and a summary of a thousand blocks stays a few kilobytes."""


@dataclass(frozen=True, slots=True)
class RouteCandidate:
    node: str
    in_flight: int
    suspect: bool = False
    cached_tokens: int = 0  # the prompt's leading tokens the node's fresh summary holds (0: none)
    prefilling: int = 0  # prompt tokens the router sent it to prefill whose first token is not back


def avoiding(nodes: Sequence[str], avoid: Collection[str], otherwise: Sequence[str] | None = None
             ) -> list[str]:
    """`nodes` but those in `avoid` (the nodes a retried request's failed attempts used), or, when
    that would leave none, `otherwise`: by default all of `nodes` (a node that failed this request
    once serves it better than a refusal does); where the caller has a pick of its own to fall
    back on, none."""
    return [node for node in nodes if node not in avoid] or list(nodes if otherwise is None else otherwise)


def summary_key(key: bytes) -> bytes:
    """A block key as a node's summary carries it."""
    return key[:SUMMARY_KEY_BYTES]


def prompt_summary_keys(prompt: Sequence[int], block_tokens: int, ends: Collection[int] = ()) -> list[bytes]:
    """The summary keys of the prompt's blocks (of `block_tokens`, ending early after a token of
    `ends`: `statecore.prefix.block_bounds`), in order."""
    return prompt_summary_blocks(prompt, block_tokens, ends)[0]


def prompt_summary_blocks(prompt: Sequence[int], block_tokens: int, ends: Collection[int] = ()
                          ) -> tuple[list[bytes], list[int]]:
    """The prompt's blocks as a node with this block size and these block ends cuts them: their
    summary keys and where each ends."""
    bounds = block_bounds(prompt, block_tokens, ends)
    return [summary_key(key) for key in keys_at(prompt, bounds)], bounds


def held_prefix_tokens(keys: Sequence[bytes], bounds: Sequence[int], held: Collection[bytes]) -> int:
    """How many leading tokens of a prompt whose block summary keys are `keys` (its blocks ending
    at `bounds`) a node holding `held` would not compute: whole leading blocks only, as the node
    reuses."""
    count = 0
    for key in keys:
        if key not in held:
            break
        count += 1
    return bounds[count - 1] if count else 0


def cached_prefix_tokens(prompt: Sequence[int], block_tokens: int, held: Collection[bytes],
                         ends: Collection[int] = ()) -> int:
    """How many of the prompt's leading tokens a node holding blocks `held` (summary keys, of
    `block_tokens` tokens each, ending early after a token of `ends`) would not compute."""
    return held_prefix_tokens(*prompt_summary_blocks(prompt, block_tokens, ends), held)


def route_cost(prompt_tokens: int, candidate: RouteCandidate, load_tokens: int) -> int:
    """Prompt tokens the node would compute, plus those it is computing for earlier requests
    (`prefilling`: they come first), plus `load_tokens` per request in flight there."""
    new_tokens = max(0, prompt_tokens - candidate.cached_tokens)
    return new_tokens + max(0, candidate.prefilling) + load_tokens * max(0, candidate.in_flight)


def choose_node(prompt_tokens: int, candidates: Sequence[RouteCandidate], load_tokens: int) -> RouteCandidate:
    """The cheapest candidate: healthy before suspect, then by cost, then fewer in flight, then
    the first listed (so equal nodes are taken in a stable order)."""
    if not candidates:
        raise ValueError("choose_node needs at least one candidate")
    if load_tokens < 0:
        raise ValueError("load_tokens must be >= 0")
    _, best = min(enumerate(candidates), key=lambda pair: (
        pair[1].suspect, route_cost(prompt_tokens, pair[1], load_tokens), pair[1].in_flight, pair[0]))
    return best


class Route(Enum):
    """Where a turn's prompt is prefilled (the label of the router's log line and metric)."""

    PREFIX_HIT_LOCAL = "prefix_hit_local"  # on the decode node holding its start: only the rest
    LOCAL = "local"  # a short prompt, on a decode node
    PREFILL_NODE = "prefill_node"  # on a prefill node; its KV is handed off to a decode node
    # on a prefill node told that the decode node it hands off to holds the prompt's start
    PREFILL_NODE_PREFIX = "prefill_node_prefix"
    # bound for a prefill node, on a decode node instead: the prefill nodes are busy (`overflows`)
    OVERFLOW = "overflow"


@dataclass(frozen=True, slots=True)
class RouteChoice:
    route: Route
    decode: RouteCandidate  # the decode node chosen (for PREFILL_NODE: by load alone)
    # the prompt's leading tokens the cheapest decode node holds: reused there when local; for
    # PREFILL_NODE_PREFIX, what the prefill node may pull from it
    held_tokens: int = 0

    @property
    def local(self) -> bool:
        return self.route not in (Route.PREFILL_NODE, Route.PREFILL_NODE_PREFIX)


def prefills_locally(prompt_tokens: int, local_below: int) -> bool:
    """Whether a prompt is short enough that its decode node prefills it itself, whichever node
    that is (`choose_route` may send a longer one there too: the rest after a prefix it holds, or
    an overflow). `local_below` 0: never."""
    return prompt_tokens < local_below


class Overflow(Enum):
    """Where a prompt bound for a busy prefill tier may be prefilled instead (`--prefill-overflow`).
    IDLE, the default: only on a decode node with nothing in flight, whose steps no stream shares;
    a decode node's streams are what disaggregation protects, and a long prefill beside them stalls
    them as it would on a single node, or more (a decode node's step-time target is 4 of its steps,
    a single node's 2 on the CPU): at equal hardware on a quiet CPU box, 1P1D against two single
    nodes (bench/serving/disagg_equal.py), overflow onto a decoding node made the streams' gap p99
    in the window 1.56x (llama) and 2.75x (qwen3) the single nodes', against 0.67x and 0.68x (the
    engine's) without it, long prompts' TTFT 0.50-0.56x against 0.74-0.75x (docs/performance.md).
    ON: onto any decode node prefilling nothing of its own (its streams share their steps with the
    prompt, in layer slices). OFF: never."""

    ON = "on"
    IDLE = "idle"
    OFF = "off"


def overflows(prompt_tokens: int, prefill_backlog: int | None, decode_node: RouteCandidate,
              overflow: Overflow = Overflow.IDLE) -> bool:
    """Whether a prompt bound for a prefill node is prefilled on `decode_node` instead: every
    prefill node already has at least this prompt's worth of prefill queued (`prefill_backlog`,
    the least of theirs; None: no prefill node to ask), so the prompt would wait there about as
    long as it takes to compute, and the decode node prefills nothing itself now (and, under
    `Overflow.IDLE`, has nothing in flight). One such prompt at a time per decode node; where it
    has streams (`Overflow.ON`) they share their steps with it (in layer slices, see
    `prefill_units`), so the prompt takes somewhat longer there than alone, but it starts at once."""
    if overflow is Overflow.OFF:
        return False
    return (prefill_backlog is not None and prefill_backlog >= prompt_tokens
            and decode_node.prefilling == 0 and not decode_node.suspect
            and (overflow is Overflow.ON or decode_node.in_flight == 0))


def choose_route(prompt_tokens: int, decode_candidates: Sequence[RouteCandidate], local_below: int,
                 load_tokens: int, prefill_backlog: int | None = None,
                 overflow: Overflow = Overflow.IDLE) -> RouteChoice:
    """The turn's route and decode node. The decode node is the cheapest by `choose_node` (new
    prefill work plus load); if it holds some of the prompt and the rest is shorter than
    `local_below`, it prefills that rest itself; a prompt shorter than `local_below` is prefilled
    on it too; otherwise a prefill node takes the prompt: handing off to that cheapest node when
    it holds some of the prompt (the prefill node may pull those blocks), else to the least
    loaded; unless the prefill nodes are busy (`overflows`, given `prefill_backlog`): then that
    decode node prefills it (OVERFLOW, as `overflow` allows). `local_below` 0: always a prefill
    node."""
    if local_below < 0:
        raise ValueError("local_below must be >= 0")
    if local_below == 0:  # every prompt through a prefill node: nothing overflows
        prefill_backlog = None
    best = choose_node(prompt_tokens, decode_candidates, load_tokens)
    if best.cached_tokens > 0 and prefills_locally(prompt_tokens - best.cached_tokens, local_below):
        return RouteChoice(Route.PREFIX_HIT_LOCAL, best, best.cached_tokens)
    if prefills_locally(prompt_tokens, local_below):
        return RouteChoice(Route.LOCAL, best, best.cached_tokens)
    if best.cached_tokens > 0:
        if overflows(prompt_tokens, prefill_backlog, best, overflow):
            return RouteChoice(Route.OVERFLOW, best, best.cached_tokens)
        return RouteChoice(Route.PREFILL_NODE_PREFIX, best, best.cached_tokens)
    unsummarized = [replace(c, cached_tokens=0) for c in decode_candidates]
    idle = [c for c in unsummarized if overflows(prompt_tokens, prefill_backlog, c, overflow)]
    if idle:
        return RouteChoice(Route.OVERFLOW, choose_node(prompt_tokens, idle, load_tokens), best.cached_tokens)
    return RouteChoice(Route.PREFILL_NODE, choose_node(prompt_tokens, unsummarized, load_tokens),
                       best.cached_tokens)


DEFAULT_PULL_BYTES_PER_S = 1e9
"""What a prefix pull is assumed to move per second before the node has measured one."""
DEFAULT_PULL_LATENCY_S = 0.005
"""What a prefix pull is assumed to cost before its first byte, before the node has measured one."""
_EWMA_WEIGHT = 0.25  # a new measurement's share of a rate


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + _EWMA_WEIGHT * (new - old)


@dataclass(frozen=True, slots=True)
class PullRates:
    """What a prefill node measured of itself, for `prefix_pull_pays`: exponentially weighted
    averages; None until measured (a prefill rate is needed, the others have priors)."""

    prefill_tokens_per_s: float | None = None
    pull_bytes_per_s: float = DEFAULT_PULL_BYTES_PER_S
    pull_latency_s: float = DEFAULT_PULL_LATENCY_S
    kv_bytes_per_token: float | None = None
    pulls_measured: int = 0

    def prefilled(self, computed_tokens: int, seconds: float) -> PullRates:
        """A prefill that computed `computed_tokens` in `seconds` (only calls of at least a chunk
        are worth measuring: the caller decides)."""
        if computed_tokens <= 0 or seconds <= 0:
            return self
        return replace(self, prefill_tokens_per_s=_ewma(self.prefill_tokens_per_s, computed_tokens / seconds))

    def held(self, nbytes: int, tokens: int) -> PullRates:
        """A cache of `tokens` tokens weighs `nbytes` (the first such figure is kept: it is the
        model's, not the traffic's)."""
        if self.kv_bytes_per_token is not None or tokens <= 0 or nbytes <= 0:
            return self
        return replace(self, kv_bytes_per_token=nbytes / tokens)

    def pulled(self, nbytes: int, latency_s: float, body_s: float) -> PullRates:
        """A pull of `nbytes`: `latency_s` until its first byte, `body_s` for the body."""
        if nbytes <= 0:
            return self
        first = self.pulls_measured == 0  # the priors give way to the first measurement at once
        rate = self.pull_bytes_per_s if body_s <= 0 else nbytes / body_s
        return replace(self, pull_bytes_per_s=rate if first else _ewma(self.pull_bytes_per_s, rate),
                       pull_latency_s=max(0.0, latency_s) if first else _ewma(self.pull_latency_s,
                                                                               max(0.0, latency_s)),
                       pulls_measured=self.pulls_measured + 1)


def prefix_pull_pays(held_tokens: int, own_cached_tokens: int, rates: PullRates) -> bool:
    """Whether pulling the `held_tokens` a decode node holds of a prompt costs a prefill node
    less time than computing those it does not hold itself (`own_cached_tokens`):
    latency + missing * bytes per token / pull rate < missing / prefill rate. Never when it holds
    as much already, never before it has measured its own prefill rate and KV bytes per token."""
    missing = held_tokens - own_cached_tokens
    if (missing <= 0 or rates.prefill_tokens_per_s is None or rates.prefill_tokens_per_s <= 0
            or rates.kv_bytes_per_token is None or rates.pull_bytes_per_s <= 0):
        return False
    pull_s = rates.pull_latency_s + missing * rates.kv_bytes_per_token / rates.pull_bytes_per_s
    return pull_s < missing / rates.prefill_tokens_per_s
