"""The router's knowledge of what each node's prefix cache holds: summaries pulled on a timer.

Every `interval_s` the router asks each node for its prefix-cache summary (`Peers.prefix_summary`,
with the version it has, so an unchanged summary costs one small answer). A summary older than
`stale_after_s`, or one the node could not give, is not used: the node then counts as holding
nothing, and when no node has a fresh summary the choice is the plain least-loaded one
(`statecore.routing`). Between pulls, a node the router just sent a prompt to prefill counts as
holding that prompt's whole blocks too (`expect`, as Dynamo's router tracks what it routed): a
conversation's next turn, sent right after the answer, finds its node before the next pull says
so; the next changed summary replaces the guess. This module may import `statecore` and trio;
never httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import trio

from effects.engine_port import PrefixSummary
from statecore.errors import StatecoreError
from statecore.routing import held_prefix_tokens, prompt_summary_blocks

log = logging.getLogger("statecore.routing")

FetchSummary = Callable[[str, int | None], Awaitable[PrefixSummary | None]]  # (node, since) -> summary


BlockRule = tuple[int, tuple[int, ...]]  # a node's block size and block ends


@dataclass(frozen=True, slots=True)
class _Held:
    block_tokens: int
    version: int
    keys: frozenset[bytes]
    fetched_at: float
    block_ends: tuple[int, ...] = ()

    @property
    def rule(self) -> BlockRule:
        """How the node cuts a prompt into blocks: its block size and block ends."""
        return self.block_tokens, self.block_ends


class PrefixSummaries:
    def __init__(self, nodes: Iterable[str], fetch: FetchSummary, *, interval_s: float = 1.0,
                 stale_after_s: float = 5.0, clock: Callable[[], float] = trio.current_time) -> None:
        self.nodes = list(dict.fromkeys(nodes))
        self.fetch = fetch
        self.interval_s = interval_s
        self.stale_after_s = stale_after_s
        self.clock = clock
        self._held: dict[str, _Held] = {}
        # per block rule, the last prompt asked about and its blocks (`_blocks`)
        self._last: dict[BlockRule, tuple[tuple[int, ...], tuple[list[bytes], list[int]]]] = {}

    def _blocks(self, prompt: Sequence[int], held: _Held) -> tuple[list[bytes], list[int]]:
        """The prompt's block keys and ends under the node's rule (`prompt_summary_blocks`). Routing
        one request asks for them up to four times (the decode nodes, the prefill nodes, what the
        chosen ones are then expected to hold), on its first token's path: the last prompt's are
        kept per rule."""
        tokens = prompt if isinstance(prompt, tuple) else tuple(prompt)
        last = self._last.get(held.rule)
        if last is None or (last[0] is not tokens and last[0] != tokens):
            last = tokens, prompt_summary_blocks(tokens, held.block_tokens, held.block_ends)
            self._last[held.rule] = last
        return last[1]

    def fresh(self, node: str) -> bool:
        held = self._held.get(node)
        return (held is not None and held.block_tokens > 0
                and self.clock() - held.fetched_at <= self.stale_after_s)

    def blocks(self, node: str) -> int:
        """Blocks the node's fresh summary lists (0 without one)."""
        return len(self._held[node].keys) if self.fresh(node) else 0

    def version(self, node: str) -> int | None:
        """The version of the node's last summary the router holds (None before the first)."""
        held = self._held.get(node)
        return None if held is None else held.version

    def cached_tokens(self, nodes: Sequence[str], prompt: Sequence[int]) -> dict[str, int]:
        """Per node, the prompt's leading tokens its fresh summary says it holds (0 without one);
        the prompt's block keys are hashed once per block rule, not once per node."""
        cached: dict[str, int] = {}
        for node in nodes:
            if not self.fresh(node):
                cached[node] = 0
                continue
            held = self._held[node]
            cached[node] = held_prefix_tokens(*self._blocks(prompt, held), held.keys)
        return cached

    def expect(self, node: str, prompt: Sequence[int]) -> None:
        """The node was sent `prompt` to prefill: count its whole blocks as held until the node's
        next changed summary (only on a fresh summary, whose block size is known)."""
        if not self.fresh(node):
            return
        held = self._held[node]
        keys, _ = self._blocks(prompt, held)
        self._held[node] = _Held(held.block_tokens, held.version, held.keys | frozenset(keys),
                                 held.fetched_at, held.block_ends)

    def record(self, node: str, summary: PrefixSummary | None) -> None:
        """A fetch's answer: a new summary, or None for "unchanged" (it is fresh again)."""
        now = self.clock()
        if summary is not None:
            self._held[node] = _Held(summary.block_tokens, summary.version, frozenset(summary.keys), now,
                                     summary.block_ends)
        elif node in self._held:
            held = self._held[node]
            self._held[node] = _Held(held.block_tokens, held.version, held.keys, now, held.block_ends)

    async def refresh(self, node: str) -> None:
        held = self._held.get(node)
        try:
            with trio.fail_after(self.stale_after_s):  # a node that does not answer must not hold up the rest
                summary = await self.fetch(node, None if held is None else held.version)
        except trio.TooSlowError:
            log.debug("no prefix summary from %s within %.1f s", node, self.stale_after_s)
            return
        except StatecoreError as exc:
            # Unused from now on (stale), not wrong: routing falls back to load for this node.
            log.debug("no prefix summary from %s: %s", node, exc.info.message)
            return
        self.record(node, summary)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            async with trio.open_nursery() as nursery:
                for node in self.nodes:
                    nursery.start_soon(self.refresh, node)
            await trio.sleep(self.interval_s)


__all__ = ["FetchSummary", "PrefixSummaries"]
