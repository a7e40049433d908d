"""The slot lane's model call traced once per shape and replayed (`mx.compile`).

A decode step is host work on the GPU: building the model's graph op by op from Python takes
2.5-5 ms of a 7-12 ms step there (docs/performance.md). Traced, a step with the same shapes
replays the recorded graph in one call, with MLX's elementwise fusion. The shapes are the row
count, the attended length and the pool's capacity, so the row count is rounded up to a multiple
of `ROW_BUCKET` (free slots in the range compute a throwaway row, as holes already do) and the
attended length up to the shape bucket: a serving run meets a few dozen shapes, each traced
once (`traces` counts them). With the CUDA attention kernel the length only sets how many
512-position chunks its grid has, so it is rounded up to a whole chunk: lengths within one chunk
share one trace. A shape a coming handoff will need is traced ahead (`prepare`, when its first
piece is staged): a trace is milliseconds of host time (3-4 on an H100 for the 1B shape), better
spent while the prompt is still computed than on the step the request joins, which the running
streams already wait on. The pool's buffers go in as inputs and come back as outputs, and
nothing else holds the old ones, so MLX still writes the new keys and values in place. The
model's Python never runs on a replay, so a test's model-call hook is called here, on every call.
This module imports mlx; never trio, never the engine.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from adapters.mlx.attention import KERNEL_CHUNK, DecodeAttention, kernel_attention
from adapters.mlx.slots import SlotPool, layers_over
from statecore.scheduling import bucketed

__all__ = ["COMPILE_MODES", "ROW_BUCKET", "TRACE_BUCKET", "CompiledSlotStep"]

COMPILE_MODES = ("auto", "on", "off")
ROW_BUCKET = 8  # rows per traced shape: 4 row counts cover a batch of 32
TRACE_BUCKET = 128  # attended lengths per traced shape, when the node's shape bucket is finer
_KEPT = 256  # traced shapes kept; the oldest is dropped past it


class _Traced:
    """The buffers a traced step is given: the pool's layout with the call's own arrays."""

    def __init__(self, buffers: Sequence[Any], num_layers: int, attention: DecodeAttention | None) -> None:
        self.keys = list(buffers[:num_layers])
        self.values = list(buffers[num_layers:])
        self.attention = attention
        self.num_layers = num_layers


class CompiledSlotStep:
    """`model(tokens, cache=slot layers)` for a step over the pool's first rows, traced per shape."""

    def __init__(self, model: Any, pool: SlotPool, bucket: int,
                 before_call: Callable[[], None] | None = None) -> None:
        self._model = model
        self._pool = pool
        self._bucket = max(bucket, KERNEL_CHUNK if pool.attention is kernel_attention else TRACE_BUCKET)
        self._before_call = before_call
        self._steps: OrderedDict[tuple[int, int, int], Callable[..., Any]] = OrderedDict()
        self.traces = 0  # shapes traced so far (each costs one ordinary graph build)

    def rows(self, used: int) -> int:
        """How many leading slots a step covers when `used` of them are needed."""
        return min(self._pool.num_slots, bucketed(used, ROW_BUCKET))

    def __call__(self, tokens: Any, offsets: Sequence[int]) -> Any:
        """The (rows, vocab) last-position logits; row i writes at offsets[i] of slot i."""
        pool = self._pool
        step = self._step(len(offsets), pool.attended_length(offsets, self._bucket))
        if self._before_call is not None:
            self._before_call()
        outputs = step(tokens, mx.array(list(offsets), dtype=mx.int32), *pool.keys, *pool.values)
        layers = pool.num_layers
        # The pool lets go of the old buffers here, before evaluation: they are written in place.
        pool.keys[:] = outputs[1 : 1 + layers]
        pool.values[:] = outputs[1 + layers :]
        return outputs[0]

    def prepare(self, used: int, longest_offset: int) -> bool:
        """Trace, without computing it, the step over `used` leading slots whose longest row
        writes at `longest_offset`, unless that shape is traced already; whether it traced. The
        traced call's outputs are dropped unevaluated: nothing is written."""
        pool, rows, traces = self._pool, self.rows(used), self.traces
        step = self._step(rows, pool.attended_length([longest_offset], self._bucket))
        if self.traces == traces:  # a shape met before: traced already
            return False
        with mx.stream(generation_stream):  # a trace keeps the stream it was made on: the steps'
            step(mx.zeros((rows,), dtype=mx.uint32), mx.zeros((rows,), dtype=mx.int32), *pool.keys,
                 *pool.values)
        return True

    def _step(self, rows: int, length: int) -> Callable[..., Any]:
        key = (rows, length, self._pool.capacity)
        step = self._steps.get(key)
        if step is not None:
            self._steps.move_to_end(key)
            return step
        model, layers, attention = self._model, self._pool.num_layers, self._pool.attention

        def traced(tokens: Any, positions: Any, *buffers: Any) -> tuple[Any, ...]:
            view = _Traced(buffers, layers, attention)
            cache = layers_over(view, positions, mx.arange(rows, dtype=mx.int32), length, length)
            logits = model(tokens[:, None], cache=cache)[:, -1, :]
            return (logits, *view.keys, *view.values)

        step = mx.compile(traced)
        self._steps[key] = step
        self.traces += 1
        if len(self._steps) > _KEPT:
            self._steps.popitem(last=False)
        return step
