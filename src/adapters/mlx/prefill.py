"""Prefill work: one prompt's chunks in generate_step's order, and short prompts batched together.

A `PrefillTask` is one prompt on its way to its first token. Its chunks were fixed when it arrived
(`statecore.scheduling.prefill_chunks`: prompt[:-1] in chunks of the node's chunk size, then the
last token alone), so however the scheduler spreads them over steps, the model sees exactly the
calls mlx-lm's `generate_step` makes, in the same order, on the task's own `make_prompt_cache`.
Each chunk's evaluation is cut into work units (`statecore.scheduling.prefill_units`): `run_units`
builds a chunk's graph at its first unit (lazily) and hands the device loop the cache layers each
unit evaluates, so a long chunk is computed a few layers per step; the graph is the one call's,
so are the numbers. Under a step-time target a unit may be finer than a layer: `mark_inner_points`
has the model's layers hand out points of their graph as the chunk's call builds it (a layer's
attention output, its MLP's first projection), and such a unit evaluates one of them: still
nodes of the one call's graph, evaluated in its order, so every bit is the call's. A built
chunk is handed to the prefix cache at its last unit, once every layer of it is evaluated.
Where the request will speculate, its last call may carry draft tokens after the prompt's last
token (`LastCallDrafts`, speculative decoding's first verify step): row 0 still gives the first
token, the others the target's draws after each draft.

`run_short_batch` computes several short prompts (each one chunk plus the last token) in one padded
call pair: left-padded heads through mlx-lm's `BatchKVCache` (its per-row offsets and masks keep
each row's positions and attention its own), then every last token at once; each row's cache is
then cut out as a plain `KVCache`. Plain KVCache models without kv_bits only. Both may round their
call's length up to a *shape bucket* (see `run_units`).

`run_stacked` computes several prompts' next chunk in one *stacked* call where each would make
that call alone from the same cache position with the same padded length (a burst of first
turns on one cached system prompt: their user messages, then their last tokens): the rows'
caches stacked along the batch axis, each row's tokens padded at its end as its own call pads
them, no mask beyond the causal one. A row's numbers are then its own call's wherever the device
computes a row the same whatever the call's row count: `stack_row_counts` measures at load at
which counts it does (on the CPU every count, with OpenBLAS and the bundled BLAS; on a GPU the
matmul kernels may change with the row count), and only those counts are stacked. This module
imports mlx and mlx_lm; it must never import trio.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from adapters.mlx.sampling import PositionSampler, sample_rows
from statecore.scheduling import DEFAULT_CHUNK_TOKENS, PrefillUnit, bucketed
from statecore.speculation import row_classes

__all__ = [
    "LastCallDrafts",
    "PrefillTask",
    "Stack",
    "default_shape_bucket",
    "enabled_on_cuda",
    "mark_inner_points",
    "on_cuda",
    "run_stacked",
    "run_units",
    "run_short_batch",
    "stack_row_counts",
    "warm_chunk_shapes",
    "tune_cuda_backend",
]


@dataclass(eq=False)
class PrefillTask:
    request_id: str
    tokens: list[int]
    sampler: PositionSampler
    order: int
    chunks: tuple[int, ...]
    units: tuple[PrefillUnit, ...]
    done_units: int = 0
    done_tokens: int = 0  # prompt tokens whose chunks' graphs are built
    cache: list[Any] | None = None
    first: Any = None  # the first token, lazily, once the last chunk is built
    job: Any = field(default=None, repr=False)
    retried: bool = False  # restarted once after its model call raised
    block_keys: list[bytes] = field(default_factory=list)  # the prefix cache's names of its whole chunks
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (not computed)
    keeps_only: bool = False  # a finished conversation's chunks, computed to be kept: no first token
    # A streamed handoff (plain KVCache layers): called on the device thread with each piece of
    # the cache once it is computed, (tokens, layers, its arrays: keys then values per layer).
    segment_sink: Any = field(default=None, repr=False)
    streamed_units: int = 0  # units whose KV went to the sink (or was captured for it)
    stack: Stack | None = field(default=None, repr=False)  # the stacked call its cache is a row of
    # Draft tokens its last call carried after the prompt's last token (a (k,) array), and the
    # target's draws after each of them (lazily, then read back: `LastCallDrafts`); None: none.
    drafts: Any = None
    drawn: Any = None
    # The inner points of the chunk being built (`mark_inner_points`), lazily, until its units
    # evaluate them; None where its units evaluate whole layers.
    points: list[Any] | None = field(default=None, repr=False)

    def restart(self) -> None:
        """Forget what was computed: the next step starts the prompt again from its first chunk
        (computing the cached ones too)."""
        self.cache, self.first, self.done_units, self.done_tokens = None, None, 0, 0
        self.points = None
        self.drafts = self.drawn = None
        self.cached_tokens = 0
        self.stack = None
        # What was streamed stays streamed: the same calls compute the same numbers again.
        self.sampler.position = len(self.tokens)  # the first token's draw, as on arrival
        self.sampler.restart(self.tokens)
        self.retried = True

    @property
    def units_left(self) -> tuple[int, ...]:
        """The tokens each remaining work unit is worth (the scheduler's view)."""
        return tuple(unit.tokens for unit in self.units[self.done_units :])

    def chunk_start(self, chunk: int) -> int:
        """The prompt position where chunk `chunk` begins."""
        return sum(self.chunks[:chunk])

    @property
    def finished(self) -> bool:
        return self.done_units == len(self.units)

    @property
    def is_short(self) -> bool:
        """Nothing computed yet, and all of it is one head chunk plus the last token."""
        return self.done_units == 0 and len(self.chunks) == 2 and not self.keeps_only


class LastCallDrafts(Protocol):
    """Draft tokens a prompt's last call may carry after its last token (speculative decoding:
    `adapters.mlx.speculative`), so that the call is the request's first verify step."""

    def drafts(self, task: PrefillTask) -> Any | None:
        """The (k,) uint32 array of drafts the task's last call carries, or None: the last token alone."""
        ...

    def draws(self, task: PrefillTask, logits: Any) -> Any:
        """The target's draws from the (k, vocab) logits of the draft rows (after the first token's)."""
        ...


_CUDA_SHAPE_BUCKET = 128
# On MLX's CUDA backend a prefill call's kernels take the host longer to launch than the GPU to
# run at 256 tokens (an H100, the Llama-3.2-1B shape: an 8,000-token cold prompt 0.20-0.22 s in
# 256-token calls, 0.11-0.12 at 512, 0.08 at 1,024, 0.044-0.055 at 2,048), so whole 2,048-token
# chunks there; a chat's shared system prompt or document is still a block of its own wherever a
# message ends (statecore.prefix: in a prompt shorter than a chunk too). Elsewhere (the CPU, Metal) 256.
_CUDA_CHUNK_TOKENS = 2048
_CUDA_ATTENTION_GRAPHS = 2048


def on_cuda() -> bool:
    """Whether the model runs on MLX's CUDA backend (where the GPU-only defaults apply)."""
    return bool(mx.default_device() == mx.gpu and mx.cuda.is_available())


def enabled_on_cuda(mode: str) -> bool:
    """An auto | on | off setting whose "auto" means on with MLX's CUDA backend only."""
    return on_cuda() if mode == "auto" else mode == "on"


def default_chunk_tokens() -> int:
    """Tokens per prefill call and prefix block: 2,048 on MLX's CUDA backend, where smaller
    calls are bound by the host's kernel launches, `DEFAULT_CHUNK_TOKENS` (256) elsewhere."""
    return _CUDA_CHUNK_TOKENS if on_cuda() else DEFAULT_CHUNK_TOKENS


def default_shape_bucket() -> int:
    """128 on MLX's CUDA backend, whose prefill attention builds a cuDNN graph for every new
    (query, key) shape; 0 elsewhere (on the CPU and Metal a new shape costs nothing, padding
    would only add work and change last bits against mlx-lm's generate_step)."""
    return _CUDA_SHAPE_BUCKET if on_cuda() else 0


def tune_cuda_backend() -> None:
    """MLX CUDA settings for serving, set unless the environment already names them (read once, at
    the process's first GPU work, so this runs before the model loads):

    - `MLX_CUDA_SDPA_CACHE_SIZE`: keep more cuDNN attention graphs than MLX's default (a few dozen
      to a few hundred, by version): a node meets one per chunk shape and chunk position.
    - `MLX_USE_CUDA_GRAPHS=0`: launch kernels directly instead of capturing them into CUDA graphs.
      A serving step's shapes change every step (rows join and leave, prefill chunks of any
      length), so MLX kept instantiating and updating graphs on the step's critical path: on an
      H200 (Llama-3.2-1B shape, realish at 32) the launch took 10.1 ms of a 16.8 ms step with
      graphs, 7.1 of 12.4 without, and the node streamed 1,450 -> 2,123 tok/s (docs/performance.md).
    """
    os.environ.setdefault("MLX_CUDA_SDPA_CACHE_SIZE", str(_CUDA_ATTENTION_GRAPHS))
    os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "0")


def warm_chunk_shapes(model: Any, bucket: int, chunk_size: int) -> int:
    """Run one prefill of every chunk shape a node with this bucket and chunk size meets in prompts
    of up to two chunks (a first chunk of each padded size, and each size after one whole
    chunk), so that no such request pays for building its attention graph (~90 ms per new
    (query, key) shape on MLX's CUDA backend, a stall of every stream decoding beside it).
    Returns how many shapes it ran."""
    padded = bucketed(chunk_size, bucket)
    sizes = range(bucket, padded + 1, bucket)
    zeros = partial(mx.zeros, dtype=mx.uint32)
    for size in sizes:
        cache: list[Any] = make_prompt_cache(model)
        mx.eval(model(zeros((1, size)), cache=cache))
    # The last of them is a whole chunk (padded): trimmed to it, a longer prompt's first chunk.
    after = cache
    for layer in after:
        layer.trim(padded - chunk_size)
    for size in sizes:
        mx.eval(model(zeros((1, size)), cache=after))
        for layer in after:
            layer.trim(size)
    return 2 * len(sizes)


# Where a chunk's call is being built to be evaluated in inner points: the points its layers
# hand out, in the graph's order (`mark_inner_points`); None in every other call.
_RECORDING: ContextVar[list[Any] | None] = ContextVar("inner_points", default=None)
_INNER_POINTS = (("self_attn",), ("mlp", "gate_proj"))  # each layer's, where every layer has it
_RECORDING_CLASSES: dict[type, type] = {}


def _recording_class(cls: type) -> type:
    """`cls` whose calls also hand their output to the recording call's list, if any."""
    if cls not in _RECORDING_CLASSES:
        call: Callable[..., Any] = cls.__call__

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = call(self, *args, **kwargs)
            if (points := _RECORDING.get()) is not None:
                points.append(out)
            return out

        recording = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
        _RECORDING_CLASSES[cls] = recording
    return _RECORDING_CLASSES[cls]


def mark_inner_points(model: Any, layers: int) -> int:
    """Have each of the model's `layers` layers hand out points of a prefill call's graph inside
    it: its attention's output, and its MLP's first projection's (llama-like MLPs), those every
    layer has. Each marked module's class becomes a subclass whose call also appends its output
    to the list of the call being recorded (`run_units`); in every other call it does nothing,
    and the module's weights, parameter names and computation stay as they were. Returns the
    points per layer (0: none, e.g. where the model's layers are not `model.layers`)."""
    found = getattr(model, "layers", None)
    if not isinstance(found, list) or len(found) != layers:
        return 0
    marked = []
    for path in _INNER_POINTS:
        modules = []
        for layer in found:
            for name in path:
                layer = layer.get(name) if isinstance(layer, dict) else None
            modules.append(layer)
        if all(callable(module) and isinstance(module, dict) for module in modules):
            marked.append(modules)
    for modules in marked:
        for module in modules:
            if type(module) not in _RECORDING_CLASSES.values():
                module.__class__ = _recording_class(type(module))
    return len(marked)


def run_units(model: Any, task: PrefillTask, count: int, quantize: Callable[[list[Any]], None],
              bucket: int = 0, built: Callable[[PrefillTask, int], list[Any]] | None = None,
              carry: LastCallDrafts | None = None) -> list[Any]:
    """Build what the task's next `count` units need; return the arrays they evaluate this step.

    A unit that starts a chunk builds the chunk's whole graph (the last chunk's samples the first
    token); every unit returns its layers' cache states, and its inner points (`PrefillUnit.inner`,
    recorded as the graph is built). With `bucket` (plain KVCache layers only)
    a chunk of several tokens is padded at its end to a multiple of `bucket` and the padding's
    positions are trimmed off the cache again: attention is causal, so no real position sees them,
    and the GPU meets a few chunk shapes instead of one per prompt length (MLX's CUDA attention
    builds a cuDNN graph per shape, tens of ms each). `built(task, chunk)` (the prefix cache) is
    told of every chunk at its last unit and returns more arrays for the step to evaluate. `carry`
    may give the prompt's last call drafts to verify (never a padded call: that is one token)."""
    if task.cache is None:
        task.cache = make_prompt_cache(model)
    outputs: list[Any] = []
    for _ in range(count):
        unit = task.units[task.done_units]
        if unit.starts_chunk:
            size = task.chunks[unit.chunk]
            start = task.done_tokens
            padding = bucketed(size, bucket) - size if size > 1 else 0
            last = unit.chunk == len(task.chunks) - 1 and not task.keeps_only
            drafts = carry.drafts(task) if carry is not None and last and size == 1 else None
            if drafts is None:
                piece = mx.array([task.tokens[start : start + size] + [0] * padding])
            else:
                piece = mx.concatenate([mx.array(task.tokens[start:], dtype=mx.uint32), drafts])[None]
            points: list[Any] | None = [] if unit.inner else None
            recording = _RECORDING.set(points)
            try:
                out = model(piece, cache=task.cache)
            finally:
                _RECORDING.reset(recording)
            task.points = points
            if padding:
                for layer in task.cache:
                    layer.trim(padding)
            quantize(task.cache)
            task.done_tokens += size
            if last:
                task.first = task.sampler.next_token(out[:, 0 if drafts is not None else -1, :])
            if drafts is not None:
                assert carry is not None
                task.drafts, task.drawn = drafts, carry.draws(task, out[0, 1:, :])
        task.done_units += 1
        outputs.extend(layer.state for layer in task.cache[unit.first_layer : unit.end_layer])
        if task.points is not None:
            # Each point once (the step evaluates it; later units' arrays hold it as an input).
            for index in unit.inner:
                if index < len(task.points):
                    outputs.append(task.points[index])
                    task.points[index] = None
        if unit.end_layer == len(task.cache):
            task.points = None
            if built is not None:
                # Told at the chunk's last unit, not its first: what `built` evaluates (a copy of the
                # chunk's every layer) would compute the whole chunk in its first unit's step.
                outputs.extend(built(task, unit.chunk))
    return outputs


def run_short_batch(model: Any, tasks: Sequence[PrefillTask], bucket: int = 0) -> None:
    """Several short prompts in one padded call pair; each task ends with its own cache and first
    token. With `bucket`, the padded length is a multiple of it (fewer shapes, as in run_units)."""
    heads = [task.tokens[:-1] for task in tasks]
    longest = bucketed(max(len(head) for head in heads), bucket)
    padding = [longest - len(head) for head in heads]
    layers = len(make_prompt_cache(model))
    batch_cache = [BatchKVCache(padding) for _ in range(layers)]
    padded = mx.array([[0] * pad + head for pad, head in zip(padding, heads, strict=True)])
    model(padded, cache=batch_cache)
    last = mx.array([[task.tokens[-1]] for task in tasks])
    out = model(last, cache=batch_cache)
    firsts = sample_rows(out[:, -1, :], [task.sampler for task in tasks])
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
        task.done_units = len(task.units)
        task.done_tokens = len(task.tokens)


@dataclass(eq=False)
class Stack:
    """A stacked call's cache, one row per prompt (`rows[i]` is the cache of the prompt in row i,
    views of `layers`' row i): the next stacked call of the same prompts, in the same order and at
    the same position, goes on from it instead of stacking their caches again."""

    layers: list[Any]
    rows: list[list[Any]]

    def continues(self, tasks: Sequence[PrefillTask]) -> bool:
        offset = self.layers[0].offset
        return len(tasks) == len(self.rows) and all(
            task.stack is self and task.cache is row and row[0].offset == offset
            for task, row in zip(tasks, self.rows, strict=True))


def _stacked_cache(model: Any, tasks: Sequence[PrefillTask], offset: int) -> list[Any]:
    """One cache of the tasks' caches (each at `offset`) stacked along the batch axis."""
    if offset == 0:
        return make_prompt_cache(model)
    layers = []
    for index in range(len(tasks[0].cache or ())):
        rows = [task.cache[index] for task in tasks if task.cache is not None]
        stacked = KVCache()  # type: ignore[no-untyped-call]
        stacked.keys = mx.concatenate([row.keys[..., :offset, :] for row in rows], axis=0)
        stacked.values = mx.concatenate([row.values[..., :offset, :] for row in rows], axis=0)
        stacked.offset = offset
        layers.append(stacked)
    return layers


def run_stacked(model: Any, tasks: Sequence[PrefillTask], bucket: int = 0) -> None:
    """The tasks' next chunk in one stacked call, a row each (every task at the same position,
    its chunk of the same padded length, one whole-chunk unit; plain KVCache layers). Each task
    ends with its own cache (its row) and, where the chunk was its last, its first token."""
    offset = tasks[0].done_tokens
    sizes = [task.chunks[task.units[task.done_units].chunk] for task in tasks]
    padded = bucketed(sizes[0], bucket) if sizes[0] > 1 else 1
    for task, size in zip(tasks, sizes, strict=True):
        unit = task.units[task.done_units]
        if (task.done_tokens != offset or (bucketed(size, bucket) if size > 1 else 1) != padded
                or not unit.starts_chunk or (task.cache is None and offset)):
            raise ValueError("a stacked call's rows start at one position with one padded length")
    previous = tasks[0].stack
    layers = previous.layers if previous is not None and previous.continues(tasks) else (
        _stacked_cache(model, tasks, offset))
    pieces = mx.array([task.tokens[offset : offset + size] + [0] * (padded - size)
                       for task, size in zip(tasks, sizes, strict=True)])
    out = model(pieces, cache=layers)
    if len(set(sizes)) == 1:
        for layer in layers:
            layer.trim(padded - sizes[0])
    for row, task in enumerate(tasks):
        if task.units[task.done_units].chunk == len(task.chunks) - 1 and not task.keeps_only:
            # its own call's expression, on its row (a batched argmax would skip the sampler's step)
            task.first = task.sampler.next_token(out[row : row + 1, -1, :])
    stack = Stack(layers, [])
    for row, (task, size) in enumerate(zip(tasks, sizes, strict=True)):
        cache = []
        for layer in layers:
            own = KVCache()  # type: ignore[no-untyped-call]
            own.keys, own.values = layer.keys[row : row + 1], layer.values[row : row + 1]
            own.offset = offset + size
            cache.append(own)
        stack.rows.append(cache)
        task.cache, task.stack = cache, stack
        task.done_tokens += size
        task.done_units += 1


_PROBE_PREFIX = 16  # the load check's cached tokens per row (attention reads real keys)


def stack_row_counts(model: Any, most: int, tokens: int, vocab: int
                     ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The row counts, of 2..`most`, at which a stacked call computes every row exactly as the
    row's own call does: for a call of `tokens` tokens, and for a call of one (a prompt's last
    token; on MLX's CUDA backend a lone one is a matrix-vector product, several rows a cuBLAS
    matmul), each row from a cache of its own (other tokens in every row), comparing the logits
    the call samples from and every layer's keys and values. Run at load. Then each count's
    class for both (`statecore.speculation.row_classes`, by the first row, 1..`most`): where a
    row alone is in a class of its own, which counts would still compute alike (for the log)."""
    if most < 2:
        return (), (), (1,), (1,)

    def tokens_of(row: int, count: int, salt: int) -> list[int]:
        return [(row * 7919 + position * 104729 + salt) % vocab for position in range(count)]

    def stacked(caches: list[list[tuple[Any, Any]]]) -> list[Any]:
        layers = []
        for index in range(len(caches[0])):
            layer = KVCache()  # type: ignore[no-untyped-call]
            layer.keys = mx.concatenate([cache[index][0] for cache in caches], axis=0)
            layer.values = mx.concatenate([cache[index][1] for cache in caches], axis=0)
            layer.offset = int(layer.keys.shape[2])
            layers.append(layer)
        return layers

    def call(rows: range, length: int, salt: int, cache: list[Any]
             ) -> tuple[list[Any], list[tuple[Any, Any]]]:
        """One call over `rows` from `cache`: its last logits and every layer's keys and values
        (what it compares), and the cache after it (keys and values to its offset)."""
        logits = model(mx.array([tokens_of(row, length, salt) for row in rows]), cache=cache)[:, -1, :]
        states = [(layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :])
                  for layer in cache]
        mx.eval(logits, states)
        return [logits, *(array for pair in states for array in pair)], states

    def same(one: list[Any], row: int, other: list[Any], other_row: int) -> bool:
        return all(bool(mx.array_equal(mine[row : row + 1], theirs[other_row : other_row + 1]).item())
                   for mine, theirs in zip(one, other, strict=True))

    def first_row(arrays: list[Any]) -> list[Any]:
        """Row 0 in buffers of its own (a slice would keep the whole call's buffers alive)."""
        row = [mx.take(array, mx.array([0]), axis=0) for array in arrays]
        mx.eval(row)
        return row

    prefixes: list[list[tuple[Any, Any]]] = []  # each row's cache after its prefix
    heads: list[list[tuple[Any, Any]]] = []  # ... and after its longer call
    alone: list[tuple[list[Any], list[Any]]] = []  # each row's two calls computed alone
    for row in range(most):
        cache = make_prompt_cache(model)
        _, prefix = call(range(row, row + 1), _PROBE_PREFIX, 1, cache)
        head, after = call(range(row, row + 1), tokens, 2, cache)
        last, _ = call(range(row, row + 1), 1, 3, cache)
        prefixes.append(prefix)
        heads.append(after)
        alone.append((head, last))
    counts: tuple[list[int], list[int]] = ([], [])
    firsts: tuple[list[list[Any]], list[list[Any]]] = ([first_row(alone[0][0])], [first_row(alone[0][1])])
    for count in range(2, most + 1):
        for kind, (length, salt, start) in enumerate(((tokens, 2, prefixes), (1, 3, heads))):
            together, _ = call(range(count), length, salt, stacked(start[:count]))
            firsts[kind].append(first_row(together))
            if all(same(together, row, alone[row][kind], 0) for row in range(count)):
                counts[kind].append(count)
    classes = [row_classes([[same(a, 0, b, 0) for b in rows] for a in rows]) for rows in firsts]
    return tuple(counts[0]), tuple(counts[1]), classes[0], classes[1]
