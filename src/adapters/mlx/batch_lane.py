"""The batch lane: rows whose caches are not plain `KVCache` layers (rotating, arrays/SSM,
`CacheList`), decoding together in one model call a step.

The lane holds its rows in batch order and one batch cache per layer, built and changed only
through the public API of mlx-lm's cache classes: a joining row's prompt cache becomes a batch of
one (`merge`, the class method every batchable cache has) and is appended (`extend`); a leaving
row is filtered out (`filter`); a row that must step alone takes its own cache out (`extract`).
No private attribute of mlx-lm is read and no generator of mlx-lm runs: the lane samples each row
with its own `PositionSampler` (`sample_rows`, as the slot lane does), so penalties, logprobs
and seeded draws are the request's on every lane. A row's numbers depend on the rows beside it
(the batch pads their caches to each other): the choices of one request join in one step, in
choice order (`adapters.mlx.choices`). A step that raises is undone (every batch cache
through its public `state`, each row's sampler rewound) and computed once more; if that raises
too, every row leaves with its own cache for one solo step (where a row that keeps raising fails
alone) and rejoins after it.
This module imports mlx and mlx_lm; it must never import trio (but for the types of `Live`).
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from adapters.mlx.checkpoint import Checkpoint
from adapters.mlx.jobs import engine_failed
from adapters.mlx.rows import Deliveries, LaneHost, Live, rewind
from adapters.mlx.sampling import PositionSampler, read_logprobs, sample_rows

__all__ = ["BatchLane", "batchable"]

logger = logging.getLogger("adapters.engine_mlx")


def batchable(cache: list[Any]) -> bool:
    """Whether every layer's cache can join a batch (its class merges; a quantized KV cache, a
    chunked one and custom classes cannot)."""
    return all(callable(getattr(type(layer), "merge", None)) for layer in cache)


class BatchLane:
    """The rows of the batch lane and their batch caches (see the module's paragraph)."""

    def __init__(self, loop: LaneHost) -> None:
        self.loop = loop
        self.rows: list[Live] = []
        self.cache: list[Any] = []  # one batch cache per layer; empty while no row decodes

    def __len__(self) -> int:
        return len(self.rows)

    def insert(self, live: Live, cache: list[Any]) -> None:
        """A row joins at the end: `cache` holds everything before its last token (a row back
        from its solo step after a split: its own cache, which it leaves)."""
        live.solo_cache, live.rejoin = None, False
        joining = [type(layer).merge([layer]) for layer in cache]
        if self.rows:
            for batch, one in zip(self.cache, joining, strict=True):
                batch.extend(one)
        else:
            self.cache = joining
        self.rows.append(live)
        live.batched = True

    def remove(self, live: Live) -> None:
        """A row leaves; the others keep their caches (the batch is filtered)."""
        if not live.batched:
            return
        live.batched = False
        index = self.rows.index(live)
        del self.rows[index]
        if not self.rows:
            self.cache = []
            return
        keep = [i for i in range(len(self.rows) + 1) if i != index]
        for batch in self.cache:
            batch.filter(keep)

    def step(self) -> None:
        """One step of every row, its tokens handed out (see the module's paragraph)."""
        loop, rows = self.loop, list(self.rows)
        marks = [live.sampler.mark() for live in rows]
        loop.computing = ("decode", [live.request_id for live in rows])
        checkpoint = Checkpoint(self.cache)

        def undo() -> None:
            checkpoint.restore()
            rewind(rows, marks)

        try:
            tokens = loop.twice(self.call, undo, f"a batch decode step of {len(rows)} rows")
        except Exception:
            self.split()
            return
        deliveries: Deliveries = {}
        for live, token in zip(rows, tokens, strict=True):
            live.last_token = token
            item = loop.count_token(live, token, read_logprobs(live.sampler.take_logprobs()))
            loop.hand_token(live, item, deliveries)
        loop.hand_out(deliveries)

    def call(self) -> list[int]:
        """Every row's next token, in `rows` order (evaluated)."""
        with mx.stream(generation_stream):
            inputs = mx.array([[live.last_token] for live in self.rows], dtype=mx.uint32)
            logits = self.loop.model(inputs, cache=self.cache)[:, -1, :]
            samplers: list[PositionSampler | None] = [
                None if live.sampler.plain_greedy else live.sampler for live in self.rows]
            tokens = sample_rows(logits, samplers)
            mx.eval(tokens, [layer.state for layer in self.cache])
        return [int(token) for token in tokens.tolist()]

    def split(self) -> None:
        """Every row leaves with its own cache for one solo step (`Live.rejoin`); the lane is
        empty after. A batch whose caches cannot even be taken apart fails its rows."""
        rows, caches = self.rows, self.cache
        try:
            taken = [[batch.extract(index) for batch in caches] for index in range(len(rows))]
        except Exception as exc:
            logger.exception("a batch decode step failed and its rows could not be taken out")
            error = engine_failed(f"batch decode step failed: {type(exc).__name__}: {exc}")
            self.clear()
            deliveries: Deliveries = {}
            for live in rows:
                self.loop.end(live, error, deliveries)
            self.loop.hand_out(deliveries)
            return
        logger.warning("a batch decode step of %d rows raised twice; each row steps alone", len(rows))
        self.rows, self.cache = [], []
        for live, cache in zip(rows, taken, strict=True):
            live.batched = False
            live.solo_cache = cache
            live.rejoin = True

    def clear(self) -> None:
        for live in self.rows:
            live.batched = False
        self.rows, self.cache = [], []
