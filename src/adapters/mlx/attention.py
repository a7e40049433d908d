"""The slot lane's decode attention: one query per row over that row's own slot, without a mask.

A slot step attends every row over the pool's buffers, each row up to its own length. Through
`mx.fast.scaled_dot_product_attention` that takes a boolean mask, and MLX's CUDA backend has no
fused kernel for a masked one-token query: it falls back to separate matmul, mask and softmax
kernels, about 2 ms of a 7 ms batch-32 step on the H200 (docs/performance.md). Here a kernel of our
own (`mx.fast.cuda_kernel`) reads each row's slot in place and stops at its length: the keys are
split into chunks of `_CHUNK` positions, one thread block per (row, query head, chunk) keeps a
running max and sum (exp2, float32; a chunk past its row's length leaves an empty part at once),
and a second kernel merges the chunks (when every row fits in one chunk, the block writes the
result itself: one launch per layer). `route_attention`
points mlx-lm's attention at it for caches that offer `fused_attention`; every other cache goes
to mlx-lm's own function unchanged. `reference_attention` is the same contract in plain MLX ops:
the load-time self-check compares the kernel against it, and CPU tests route through it.
Off CUDA, MLX's masked attention over the batch's longest row is the fast way, but where its bits
follow that padded length (float32 under OpenBLAS: the weighted sum of the values reduces over
every attended position, padding included, in blocks that move with the length) a row's tokens
would depend on which other rows share its step; `masked_matches_alone` finds that out at load,
and `exact_rows_attention` then gives each row its own call over exactly its own length: the bits
it has alone, as in mlx-lm's own decoding. This module imports mlx and mlx_lm's model base; never
trio, never the engine.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import mlx.core as mx

__all__ = [
    "DECODE_ATTENTION_MODES",
    "KERNEL_CHUNK",
    "AttentionChoice",
    "DecodeAttention",
    "check_kernel",
    "choose_attention",
    "exact_rows_attention",
    "kernel_attention",
    "masked_matches_alone",
    "reference_attention",
    "route_attention",
]

logger = logging.getLogger(__name__)

# (queries, keys, values, slots, lengths, scale, longest) -> (rows, query heads, 1, head dim);
# keys and values are whole pool buffers (slots, kv heads, capacity, head dim), slots and lengths
# (rows,) int32 arrays, longest the largest length (known on the host).
DecodeAttention = Callable[[Any, Any, Any, Any, Any, float, int], Any]

DECODE_ATTENTION_MODES = ("auto", "kernel", "masked", "rows", "reference")

_CHUNK = 512  # key positions per thread block: long rows spread over more blocks
KERNEL_CHUNK = _CHUNK  # the kernel's grid changes only every this many attended positions
_WARPS = 16  # warps per block; warp w takes every _WARPS-th position of the chunk

# NVRTC has no math.h, so no INFINITY.
_HEADER = """
#define NEG_INF (__int_as_float(0xff800000))
"""

_BLOCK_HEAD = """
    constexpr int PER_LANE = D / 32;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int row = blockIdx.x / HQ;
    const int head = blockIdx.x % HQ;
    const int kv_head = head / (HQ / HKV);
    const int chunk = blockIdx.y;
    const int chunks = gridDim.y;
    const int capacity = keys_shape[2];
    const int length = lengths[row];
    const size_t part = (size_t(row) * HQ + head) * chunks + chunk;
"""

# Several chunks: a chunk past its row's length leaves an empty part (the merge skips it) at once,
# not after the block's reduction: beside one long row (a handed-off prompt joining short
# streams) most of the grid's blocks are such.
_PARTIAL_SKIP = """
    if (chunk * CHUNK >= length) {
        if (threadIdx.x == 0) {
            part_max[part] = NEG_INF;
            part_sum[part] = 0.0f;
        }
        return;
    }
"""

_BLOCK_BODY = """
    float q[PER_LANE];
    float acc[PER_LANE];
    const float scale_log2 = scale[0] * 1.4426950408889634f;
    const T* query = queries + (size_t(row) * HQ + head) * D + lane * PER_LANE;
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        q[i] = scale_log2 * static_cast<float>(query[i]);
        acc[i] = 0.0f;
    }
    const size_t base = (size_t(slots[row]) * HKV + kv_head) * size_t(capacity) * D + lane * PER_LANE;
    const T* key = keys + base;
    const T* value = values + base;
    float running_max = NEG_INF;
    float running_sum = 0.0f;
    const int end = min(length, (chunk + 1) * CHUNK);
    for (int j = chunk * CHUNK + warp; j < end; j += WARPS) {
        float score = 0.0f;
        #pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            score += q[i] * static_cast<float>(key[size_t(j) * D + i]);
        }
        #pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) {
            score += __shfl_xor_sync(0xffffffff, score, offset);
        }
        const float new_max = fmaxf(running_max, score);
        const float factor = exp2f(running_max - new_max);
        const float weight = exp2f(score - new_max);
        running_sum = running_sum * factor + weight;
        #pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            acc[i] = acc[i] * factor + weight * static_cast<float>(value[size_t(j) * D + i]);
        }
        running_max = new_max;
    }

    __shared__ float warp_max[WARPS];
    __shared__ float warp_sum[WARPS];
    __shared__ float warp_acc[WARPS][D + 1];
    if (lane == 0) {
        warp_max[warp] = running_max;
        warp_sum[warp] = running_sum;
    }
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        warp_acc[warp][lane * PER_LANE + i] = acc[i];
    }
    __syncthreads();
    if (warp != 0) {
        return;
    }
    float block_max = NEG_INF;
    #pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        block_max = fmaxf(block_max, warp_max[w]);
    }
    float block_sum = 0.0f;
    float out[PER_LANE];
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        out[i] = 0.0f;
    }
    if (block_max != NEG_INF) {
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float factor = exp2f(warp_max[w] - block_max);
            block_sum += warp_sum[w] * factor;
            #pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                out[i] += warp_acc[w][lane * PER_LANE + i] * factor;
            }
        }
    }
"""

# Several chunks: each block leaves its max, sum and weighted values for the merge kernel.
_PARTIAL_EPILOGUE = """
    if (lane == 0) {
        part_max[part] = block_max;
        part_sum[part] = block_sum;
    }
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        part_acc[part * D + lane * PER_LANE + i] = out[i];
    }
"""

# One chunk covers every row: the block's result is the row's attention (no merge launch).
_DIRECT_EPILOGUE = """
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        output[part * D + lane * PER_LANE + i] = static_cast<T>(out[i] / block_sum);
    }
"""

_MERGE_SOURCE = """
    constexpr int PER_LANE = D / 32;
    const int lane = threadIdx.x % 32;
    const int pair = blockIdx.x;  // row * HQ + head
    const int chunks = part_max_shape[2];
    float total_max = NEG_INF;
    for (int c = 0; c < chunks; ++c) {
        total_max = fmaxf(total_max, part_max[size_t(pair) * chunks + c]);
    }
    float total_sum = 0.0f;
    float out[PER_LANE];
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        out[i] = 0.0f;
    }
    for (int c = 0; c < chunks; ++c) {
        const size_t part = size_t(pair) * chunks + c;
        const float m = part_max[part];
        if (m == NEG_INF) {
            continue;
        }
        const float factor = exp2f(m - total_max);
        total_sum += part_sum[part] * factor;
        #pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            out[i] += part_acc[part * D + lane * PER_LANE + i] * factor;
        }
    }
    #pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        output[size_t(pair) * D + lane * PER_LANE + i] = static_cast<T>(out[i] / total_sum);
    }
"""

_kernels: dict[str, Any] = {}
_scales: dict[float, Any] = {}
_templates: dict[tuple[Any, ...], list[tuple[str, Any]]] = {}


def _kernel(name: str) -> Any:
    if name not in _kernels:
        outputs = {"direct": ["output"], "partial": ["part_max", "part_sum", "part_acc"], "merge": ["output"]}
        inputs = (["part_max", "part_sum", "part_acc"] if name == "merge"
                  else ["queries", "keys", "values", "slots", "lengths", "scale"])
        source = {"direct": _BLOCK_HEAD + _BLOCK_BODY + _DIRECT_EPILOGUE,
                  "partial": _BLOCK_HEAD + _PARTIAL_SKIP + _BLOCK_BODY + _PARTIAL_EPILOGUE,
                  "merge": _MERGE_SOURCE}[name]
        _kernels[name] = mx.fast.cuda_kernel(name=f"statecore_slot_attention_{name}", input_names=inputs,
                                             output_names=outputs[name], source=source, header=_HEADER)
    return _kernels[name]


def _template(dtype: Any, dim: int, query_heads: int, kv_heads: int) -> list[tuple[str, Any]]:
    # Built once per shape: a step calls this once per layer, and host time is step time.
    key = (dtype, dim, query_heads, kv_heads, _CHUNK, _WARPS)
    if key not in _templates:
        _templates[key] = [("T", dtype), ("D", dim), ("HQ", query_heads), ("HKV", kv_heads),
                           ("CHUNK", _CHUNK), ("WARPS", _WARPS)]
    return _templates[key]


def _scale(value: float) -> Any:
    if value not in _scales:
        _scales[value] = mx.array([value], dtype=mx.float32)
    return _scales[value]


def kernel_attention(queries: Any, keys: Any, values: Any, slots: Any, lengths: Any,
                     scale: float, longest: int) -> Any:
    """The CUDA kernels; `longest` sets how many chunks each row's keys are split into."""
    rows, query_heads, _, dim = queries.shape
    chunks = -(-longest // _CHUNK)
    template = _template(queries.dtype, dim, query_heads, keys.shape[1])
    inputs = [queries, keys, values, slots, lengths, _scale(scale)]
    block = (_WARPS * 32, 1, 1)
    pairs = rows * query_heads
    if chunks <= 1:
        (output,) = _kernel("direct")(
            inputs=inputs, template=template, grid=(pairs * _WARPS * 32, 1, 1), threadgroup=block,
            output_shapes=[(rows, query_heads, 1, dim)], output_dtypes=[queries.dtype])
        return output
    part_max, part_sum, part_acc = _kernel("partial")(
        inputs=inputs, template=template, grid=(pairs * _WARPS * 32, chunks, 1), threadgroup=block,
        output_shapes=[(rows, query_heads, chunks), (rows, query_heads, chunks),
                       (rows, query_heads, chunks, dim)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    (output,) = _kernel("merge")(
        inputs=[part_max, part_sum, part_acc], template=template, grid=(pairs * 32, 1, 1),
        threadgroup=(32, 1, 1), output_shapes=[(rows, query_heads, 1, dim)], output_dtypes=[queries.dtype],
    )
    return output


def reference_attention(queries: Any, keys: Any, values: Any, slots: Any, lengths: Any,
                        scale: float, longest: int) -> Any:
    """The same contract in MLX ops: gather the rows' slots, mask past each length, attend."""
    k = keys[slots, :, :longest, :]
    v = values[slots, :, :longest, :]
    mask = (mx.arange(longest)[None, :] < lengths[:, None])[:, None, None, :]
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


def exact_rows_attention(queries: Any, keys: Any, values: Any, rows: Sequence[tuple[int, int]],
                         scale: float) -> Any:
    """Each row's query over its own slot up to its own length, one call a row and no mask:
    `rows` holds each row's (slot, length), known on the host. A row's bits are those of its
    attention alone, whatever the other rows' lengths."""
    each = [mx.fast.scaled_dot_product_attention(
        queries[row : row + 1], keys[slot : slot + 1, :, :length, :], values[slot : slot + 1, :, :length, :],
        scale=scale) for row, (slot, length) in enumerate(rows)]
    return each[0] if len(each) == 1 else mx.concatenate(each, axis=0)


# (length, padded length) pairs the load check tries: short and long rows, padded by one position
# and by many, across the block sizes a BLAS uses
_PADDINGS = ((7, 8), (41, 57), (100, 2048), (1003, 1008), (1003, 2048))


def masked_matches_alone(query_heads: int, kv_heads: int, dim: int, dtype: Any) -> bool:
    """Whether MLX's masked attention over a padded length gives a row the bits of its attention
    alone, for a model of these shapes on this device and BLAS (a few lengths and paddings tried)."""
    q_key, k_key, v_key = mx.random.split(mx.random.key(11), 3)
    longest = max(padded for _, padded in _PADDINGS)
    queries = mx.random.normal((1, query_heads, 1, dim), key=q_key).astype(dtype)
    keys = mx.random.normal((1, kv_heads, longest, dim), key=k_key).astype(dtype)
    values = mx.random.normal((1, kv_heads, longest, dim), key=v_key).astype(dtype)
    scale = dim ** -0.5
    for length, padded in _PADDINGS:
        alone = mx.fast.scaled_dot_product_attention(queries, keys[:, :, :length], values[:, :, :length],
                                                     scale=scale)
        mask = (mx.arange(padded) < length)[None, None, None, :]
        masked = mx.fast.scaled_dot_product_attention(queries, keys[:, :, :padded], values[:, :, :padded],
                                                      scale=scale, mask=mask)
        if not mx.array_equal(alone, masked).item():
            return False
    return True


def check_kernel(query_heads: int, kv_heads: int, dim: int, dtype: Any) -> str | None:
    """Run the kernel once against `reference_attention` on random ragged rows shaped like the
    model's; None when they agree, else why the kernel must not be used."""
    if dim % 32 != 0 or dim > 256 or query_heads % kv_heads != 0:
        return f"head dim {dim} / {query_heads} query heads over {kv_heads} kv heads: not supported"
    error = 0.0
    try:
        rows, capacity = 5, 3 * _CHUNK + 64
        slots = mx.array([4, 0, 2, 1, 3], dtype=mx.int32)
        key = mx.random.key(7)
        q_key, k_key, v_key = mx.random.split(key, 3)
        queries = mx.random.normal((rows, query_heads, 1, dim), key=q_key).astype(dtype)
        keys = mx.random.normal((rows, kv_heads, capacity, dim), key=k_key).astype(dtype)
        values = mx.random.normal((rows, kv_heads, capacity, dim), key=v_key).astype(dtype)
        scale = dim ** -0.5
        # Rows within one chunk (the one-kernel path), then rows over several (partials + merge).
        for ragged in ([1, 7, _CHUNK // 2, _CHUNK - 1, _CHUNK], [1, 7, _CHUNK, _CHUNK + 1, 3 * _CHUNK + 50]):
            lengths = mx.array(ragged, dtype=mx.int32)
            got = kernel_attention(queries, keys, values, slots, lengths, scale, max(ragged))
            want = reference_attention(queries, keys, values, slots, lengths, scale, max(ragged))
            gap = mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item()
            error = max(error, float(gap))  # type: ignore[arg-type]
    except Exception as exc:  # a kernel that does not compile or launch here is not used
        return f"{type(exc).__name__}: {exc}"
    tolerance = 1e-4 if dtype == mx.float32 else 3e-2
    if not error <= tolerance:
        return f"max error {error:.3g} against the reference exceeds {tolerance}"
    return None


def _routed(original: Callable[..., Any]) -> Callable[..., Any]:
    def scaled_dot_product_attention(queries: Any, keys: Any, values: Any, cache: Any, scale: float,
                                     mask: Any, sinks: Any = None) -> Any:
        fused = getattr(cache, "fused_attention", None)
        if fused is not None and sinks is None and queries.shape[2] == 1:
            return fused(queries, scale)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.statecore_routed = True  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def route_attention() -> int:
    """Point every loaded mlx-lm model module that calls mlx-lm's own attention function at one
    that honours `fused_attention` (idempotent); returns how many modules are routed now. Models
    that call MLX's attention directly keep the masked path, which stays correct."""
    from mlx_lm.models import base

    routed = _routed(base.scaled_dot_product_attention)
    count = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("mlx_lm.models.") or module is None:
            continue
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is None:
            continue
        if getattr(current, "statecore_routed", False):
            count += 1
        elif current is base.scaled_dot_product_attention and name != "mlx_lm.models.base":
            module.__dict__["scaled_dot_product_attention"] = routed
            count += 1
    return count


class AttentionChoice(NamedTuple):
    """The slot lane's decode attention: a pool attention (None: not one), whether each row
    attends in a call of its own (`exact_rows_attention`), and a phrase for the load log."""

    attention: DecodeAttention | None
    exact_rows: bool
    phrase: str


_ROWS = "exact rows (MLX, a call a row)"


def choose_attention(mode: str, query_heads: int, kv_heads: int, dim: int, dtype: Any) -> AttentionChoice:
    """The slot lane's attention for `mode` (DECODE_ATTENTION_MODES) and a model of these
    shapes; raises ValueError when "kernel" cannot be had. `auto`: the kernel on CUDA where its
    check passes; on the CPU MLX's masked attention where it gives each row its bits alone
    (`masked_matches_alone`), else exact rows; on Metal masked (a call a row would be a launch
    each)."""
    if mode == "masked":
        return AttentionChoice(None, False, "masked (MLX)")
    if mode == "reference":
        route_attention()
        return AttentionChoice(reference_attention, False, "reference (MLX ops)")
    if mode == "rows":
        route_attention()
        return AttentionChoice(None, True, _ROWS)
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    why_not = check_kernel(query_heads, kv_heads, dim, dtype) if on_cuda else "needs MLX's CUDA backend"
    if why_not is None:
        route_attention()
        return AttentionChoice(kernel_attention, False, "statecore kernel")
    if mode == "kernel":
        raise ValueError(f"decode_attention kernel cannot be used: {why_not}")
    if on_cuda:
        logger.warning("the slot lane's attention kernel is not used (%s); masked attention instead", why_not)
    elif mx.default_device() == mx.cpu and not masked_matches_alone(query_heads, kv_heads, dim, dtype):
        route_attention()
        return AttentionChoice(None, True, _ROWS + ": masked attention's bits follow the longest row here")
    return AttentionChoice(None, False, "masked (MLX)")
