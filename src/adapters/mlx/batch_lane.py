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
choice order (`DeviceLoop.release_choices`). The device loop retries a step that raises
(`checkpoint` undoes it) and splits the batch when it raises again (`split`).
This module imports mlx and mlx_lm; it must never import trio (but for the types of `Live`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from adapters.mlx.checkpoint import Checkpoint
from adapters.mlx.rows import Live
from adapters.mlx.sampling import PositionSampler, sample_rows

__all__ = ["BatchLane", "batchable"]


def batchable(cache: list[Any]) -> bool:
    """Whether every layer's cache can join a batch (its class merges; a quantized KV cache, a
    chunked one and custom classes cannot)."""
    return all(callable(getattr(type(layer), "merge", None)) for layer in cache)


class BatchLane:
    """The rows of the batch lane and their batch caches (see the module's paragraph)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.rows: list[Live] = []
        self.cache: list[Any] = []  # one batch cache per layer; empty while no row decodes

    def __len__(self) -> int:
        return len(self.rows)

    def insert(self, live: Live, cache: list[Any]) -> None:
        """A row joins at the end: `cache` holds everything before its last token."""
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

    def checkpoint(self) -> Checkpoint:
        """What undoes a step that raised (its samplers are rewound by the caller)."""
        return Checkpoint(self.cache)

    def step(self) -> list[int]:
        """Every row's next token, in `rows` order (evaluated: the caller hands them out)."""
        with mx.stream(generation_stream):
            inputs = mx.array([[live.last_token] for live in self.rows], dtype=mx.uint32)
            logits = self.model(inputs, cache=self.cache)[:, -1, :]
            samplers: list[PositionSampler | None] = [
                None if live.sampler.plain_greedy else live.sampler for live in self.rows]
            tokens = sample_rows(logits, samplers)
            mx.eval(tokens, [layer.state for layer in self.cache])
        return [int(token) for token in tokens.tolist()]

    def split(self) -> list[tuple[Live, list[Any]]]:
        """Every row leaves with its own cache (for the solo lane); the lane is empty after."""
        rows, caches = self.rows, self.cache
        self.rows, self.cache = [], []
        taken = []
        for index, live in enumerate(rows):
            live.batched = False
            taken.append((live, [batch.extract(index) for batch in caches]))
        return taken

    def clear(self) -> None:
        for live in self.rows:
            live.batched = False
        self.rows, self.cache = [], []
