"""Prefill work: one prompt's chunks in generate_step's order, and short prompts batched together.

A `PrefillTask` is one prompt on its way to its first token. Its chunks were fixed when it arrived
(`statecore.scheduling.prefill_chunks`: prompt[:-1] in chunks of the node's chunk size, then the
last token alone), so however the scheduler spreads them over steps, the model sees exactly the
calls mlx-lm's `generate_step` makes, in the same order, on the task's own `make_prompt_cache`.
`run_chunks` builds the next chunks' graph (lazily: the device loop evaluates a whole step at once).

`run_short_batch` computes several short prompts (each one chunk plus the last token) in one padded
call pair: left-padded heads through mlx-lm's `BatchKVCache` (its per-row offsets and masks keep
each row's positions and attention its own), then every last token at once; each row's cache is
then cut out as a plain `KVCache`. Plain KVCache models without kv_bits only. This module imports
mlx and mlx_lm; it must never import trio.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from adapters.mlx.sampling import PositionSampler, log_softmax, sample_rows

__all__ = ["PrefillTask", "run_chunks", "run_short_batch"]


@dataclass(eq=False)
class PrefillTask:
    request_id: str
    tokens: list[int]
    sampler: PositionSampler
    order: int
    chunks: tuple[int, ...]
    done_chunks: int = 0
    done_tokens: int = 0
    cache: list[Any] | None = None
    first: Any = None  # the first token, lazily, once the last chunk is built
    job: Any = field(default=None, repr=False)
    retried: bool = False  # restarted once after its model call raised

    def restart(self) -> None:
        """Forget what was computed: the next step starts the prompt again from its first chunk."""
        self.cache, self.first, self.done_chunks, self.done_tokens = None, None, 0, 0
        self.sampler.position = len(self.tokens)  # the first token's draw, as on arrival
        self.retried = True

    @property
    def chunks_left(self) -> tuple[int, ...]:
        return self.chunks[self.done_chunks :]

    @property
    def is_short(self) -> bool:
        """Nothing computed yet, and all of it is one head chunk plus the last token."""
        return self.done_chunks == 0 and len(self.chunks) == 2


def run_chunks(model: Any, task: PrefillTask, count: int, quantize: Callable[[list[Any]], None]) -> None:
    """Build the graph of the task's next `count` chunks; the last one samples the first token."""
    if task.cache is None:
        task.cache = make_prompt_cache(model)
    for _ in range(count):
        size = task.chunks[task.done_chunks]
        start = task.done_tokens
        piece = mx.array([task.tokens[start : start + size]])
        out = model(piece, cache=task.cache)
        quantize(task.cache)
        task.done_chunks += 1
        task.done_tokens += size
        if task.done_chunks == len(task.chunks):
            task.first = task.sampler(log_softmax(out[:, -1, :]))


def run_short_batch(model: Any, tasks: Sequence[PrefillTask]) -> None:
    """Several short prompts in one padded call pair; each task ends with its own cache and first token."""
    heads = [task.tokens[:-1] for task in tasks]
    longest = max(len(head) for head in heads)
    padding = [longest - len(head) for head in heads]
    layers = len(make_prompt_cache(model))
    batch_cache = [BatchKVCache(padding) for _ in range(layers)]
    padded = mx.array([[0] * pad + head for pad, head in zip(padding, heads, strict=True)])
    model(padded, cache=batch_cache)
    last = mx.array([[task.tokens[-1]] for task in tasks])
    out = model(last, cache=batch_cache)
    firsts = sample_rows(log_softmax(out[:, -1, :]), [task.sampler for task in tasks])
    end = longest + 1
    for row, (task, pad) in enumerate(zip(tasks, padding, strict=True)):
        cache = []
        for layer in batch_cache:
            keys: Any = layer.keys
            values: Any = layer.values
            own = KVCache()  # type: ignore[no-untyped-call]
            own.keys = mx.contiguous(keys[row : row + 1, :, pad:end, :])
            own.values = mx.contiguous(values[row : row + 1, :, pad:end, :])
            own.offset = end - pad
            cache.append(own)
        task.cache = cache
        task.first = firsts[row : row + 1]
        task.done_chunks = len(task.chunks)
        task.done_tokens = len(task.tokens)
