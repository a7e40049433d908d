"""A prefill node's pulls of a decode node's cached prefix: whether to pull, the pull, what it cost.

The router tells a prefill node when the decode node it hands off to holds the start of the
prompt in its prefix cache (`PrefixSource`, route prefill_node_prefix). Before the prefill, the
node's `PrefixPuller` decides by its mode (`--prefix-pull`): "never"; "always" (whenever the
decode node holds more of the prompt than this node's own prefix cache); "auto" (as "always",
and only when `statecore.routing.prefix_pull_pays` says moving the missing blocks is quicker than
computing them, by rates measured here: the prefill calls' tokens per second, the pulls' bytes per
second and latency, the KV bytes per token). A pull is `Peers.fetch_prefix` then
`Engine.import_prefix`: the blocks land in this node's prefix cache, and the prefill that follows
starts after them as after any cached blocks. Any failure of either (whatever its fault: the
connection, a 404, a malformed payload, another fingerprint) is logged and counted, and the
prefill goes on without it: a pull never fails a request. This module may import `statecore`
and trio; it must never import httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio

from effects.engine_port import Engine, PrefillOutcome
from effects.handoffs import HandoffRecord
from effects.ports import Peers, PrefixSource
from statecore.errors import StatecoreError
from statecore.routing import PullRates, cached_prefix_tokens, prefix_pull_pays

__all__ = ["PULL_MODES", "PULL_OUTCOMES", "PrefixPullStatistics", "PrefixPuller"]

log = logging.getLogger("statecore.prefix_pull")

PULL_MODES = ("auto", "always", "never")  # --prefix-pull
PULL_OUTCOMES = ("pulled", "skipped", "failed")
PULL_TIMEOUT_S = 30.0  # a pull slower than this is given up: the prefill computes the blocks instead


@dataclass(frozen=True, slots=True)
class PrefixPullStatistics:
    """Counts since start: hints by outcome, and what the pulls moved."""

    pulled: int = 0
    skipped: int = 0
    failed: int = 0
    tokens: int = 0  # prompt tokens pulled (kept in this node's prefix cache)
    nbytes: int = 0
    seconds: float = 0.0  # the pulls and imports together
    rates: PullRates = field(default_factory=PullRates)


class PrefixPuller:
    def __init__(self, engine: Engine, peers: Peers, mode: str = "auto",
                 timeout_s: float = PULL_TIMEOUT_S) -> None:
        if mode not in PULL_MODES:
            raise ValueError(f"mode must be one of {', '.join(PULL_MODES)}, not {mode!r}")
        self.engine = engine
        self.peers = peers
        self.mode = mode
        self.timeout_s = timeout_s
        self.rates = PullRates()
        self._counts = dict.fromkeys(PULL_OUTCOMES, 0)
        self._tokens = self._bytes = 0
        self._seconds = 0.0
        # this node's own prefix-cache summary, refreshed by version (an unchanged one is one
        # integer comparison on the engine's side)
        self._block_tokens = 0
        self._block_ends: tuple[int, ...] = ()
        self._version: int | None = None
        self._own_keys: frozenset[bytes] = frozenset()

    def statistics(self) -> PrefixPullStatistics:
        return PrefixPullStatistics(self._counts["pulled"], self._counts["skipped"], self._counts["failed"],
                                    self._tokens, self._bytes, self._seconds, self.rates)

    async def _own_cached(self, prompt: Sequence[int]) -> int:
        summary = await self.engine.prefix_summary(self._version)
        if summary is not None:
            self._block_tokens, self._version = summary.block_tokens, summary.version
            self._block_ends = summary.block_ends
            self._own_keys = frozenset(summary.keys)
        if self._block_tokens <= 0:
            return 0
        return cached_prefix_tokens(prompt, self._block_tokens, self._own_keys, self._block_ends)

    async def before_prefill(self, request_id: str, prompt: Sequence[int], source: PrefixSource,
                             record: HandoffRecord | None = None) -> int:
        """Pull the prompt's start from `source` when the mode says so; the tokens kept (0: none)."""
        held = min(source.tokens, len(prompt) - 1)  # the last token is always computed
        if self.mode == "never":
            return self._skip(request_id, "--prefix-pull never")
        if held <= 0:
            return self._skip(request_id, "no whole block before the last token")
        own = await self._own_cached(prompt)
        if self._block_tokens <= 0:
            return self._skip(request_id, "this node keeps no prefix cache")
        if held <= own:
            return self._skip(request_id, f"its own prefix cache holds {own} tokens already")
        if self.mode == "auto" and not prefix_pull_pays(held, own, self.rates):
            return self._skip(request_id, f"pulling {held - own} tokens would not pay ({self.rates})")
        started = time.perf_counter()
        try:
            with trio.fail_after(self.timeout_s):
                pulled = await self.peers.fetch_prefix(source.node, prompt[:held])
                nbytes, first_byte_s = len(pulled.payload), pulled.first_byte_s
                kept = await self.engine.import_prefix(pulled.payload, prompt[:held])
        except (StatecoreError, trio.TooSlowError) as exc:
            self._counts["failed"] += 1
            log.warning("request %s: the prefix pull from %s failed, computing the prompt instead: %s",
                        request_id, source.node, exc if isinstance(exc, StatecoreError) else "timed out")
            return 0
        del pulled  # the receive buffer is free for the next pull
        seconds = time.perf_counter() - started
        self._counts["pulled"] += 1
        self._tokens += kept
        self._bytes += nbytes
        self._seconds += seconds
        # what the cost function weighs: the wait for the first byte, then the bytes moved and
        # imported (the import grows with them as the transfer does)
        self.rates = self.rates.held(nbytes, kept).pulled(nbytes, first_byte_s, seconds - first_byte_s)
        if record is not None:
            record.prefix_pull_tokens, record.prefix_pull_bytes, record.prefix_pull_s = kept, nbytes, seconds
        log.info("request %s: pulled %d prompt tokens (%d bytes) from %s in %.3f s (its own cache held %d)",
                 request_id, kept, nbytes, source.node, seconds, own)
        return kept

    def _skip(self, request_id: str, why: str) -> int:
        self._counts["skipped"] += 1
        log.info("request %s: no prefix pull: %s", request_id, why)
        return 0

    def prefilled(self, outcome: PrefillOutcome, seconds: float, chunk_tokens: int) -> None:
        """A prefill here took `seconds`: its rate counts when it computed at least a chunk."""
        computed = outcome.prompt_tokens - outcome.cached_tokens
        self.rates = self.rates.held(outcome.held_bytes, outcome.prompt_tokens)
        if computed >= max(1, chunk_tokens):
            self.rates = self.rates.prefilled(computed, seconds)
