"""What a request's KV cache weighs, and how much memory the node gives KV caches.

`KvCost` is measured once at load by prefilling two probe prompts and fitting a line through
their caches' live bytes (`fixed` + `per_token` x tokens), so it holds for every cache family
without a table of classes: plain and quantized KV grow per token, SSM state is fixed, a
rotating cache is over-counted past its window (the safe side); `KvCost.of` adds mlx-lm's
allocation step. `slot_per_token` is one slot's
bytes per position in the slot layout (plain KVCache models). `default_kv_memory_bytes` is the
budget when `--kv-memory-bytes` is not given. `model_shape` reads what a step's transient
activations grow with (`statecore.scheduling.activation_bytes` does the arithmetic). This module
imports mlx; never trio.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from statecore.scheduling import ModelShape

__all__ = [
    "ALLOCATION_STEP",
    "DEFAULT_KV_MEMORY_FRACTION",
    "KvCost",
    "activation_dtype_bytes",
    "default_kv_memory_bytes",
    "device_memory_bytes",
    "measure_kv_cost",
    "model_shape",
    "out_of_memory_advice",
    "parameter_bytes",
    "share_the_device",
    "state_bytes",
]

# mlx-lm's KVCache grows its buffers 256 positions at a time: a cache may hold that many more.
ALLOCATION_STEP = 256
DEFAULT_KV_MEMORY_FRACTION = 0.4
# Of the device's memory, what weights and KV may take together by default: MLX's CUDA allocator
# starts giving its cache back at 80 %, and a step's activations need the rest.
DEVICE_USABLE_FRACTION = 0.7
ALLOCATOR_FRACTION = 0.8  # MLX's CUDA allocator's own default limit, as a share of the device
MIN_DEFAULT_KV_MEMORY_BYTES = 256 << 20
_PROBE_LENGTHS = (8, 24)


@dataclass(frozen=True, slots=True)
class KvCost:
    fixed: int  # bytes a request's cache takes whatever its length
    per_token: int  # bytes per position
    slot_per_token: int  # one slot's bytes per position in the slot layout (0: no slot lane)

    def of(self, tokens: int) -> int:
        """The most a cache of `tokens` positions (its own, outside the slot layout) may take."""
        return self.fixed + self.per_token * (tokens + ALLOCATION_STEP)


def state_bytes(cache: Sequence[Any]) -> int:
    """Bytes of a cache's state arrays as allocated (for caches the KV wire cannot trim)."""
    leaves: list[tuple[str, Any]] = tree_flatten([c.state for c in cache])  # type: ignore[assignment]
    return sum(int(array.nbytes) for _, array in leaves if hasattr(array, "nbytes"))


def measure_kv_cost(probe: Callable[[int], Sequence[Any]], live_bytes: Callable[[Sequence[Any]], int],
                    slot_layers: Sequence[Any] | None) -> KvCost:
    """Fit bytes = fixed + per_token x tokens through two probe caches (`probe(n)` prefills n
    tokens and returns the evaluated cache; `live_bytes` weighs one, trimmed to what it holds);
    `slot_layers`, a plain-KVCache model's cache, gives the slot layout's cost too."""
    short, long = _PROBE_LENGTHS
    small, large = live_bytes(probe(short)), live_bytes(probe(long))
    per_token = max(0, -(-(large - small) // (long - short)))  # rounded up
    fixed = max(0, small - per_token * short)
    slot = sum(2 * c.keys.shape[1] * c.keys.shape[3] * c.keys.dtype.size for c in slot_layers or ())
    return KvCost(fixed, per_token, slot)


def default_kv_memory_bytes(model_dir: Path | None = None, shared_by: int = 1) -> int:
    """A share of the device's memory (the GPU's, else the machine's RAM) for KV caches, never
    more than what the weights (`model_dir`'s safetensors) leave of the device's usable part
    (the rest is for the step's activations and the allocator); `shared_by` engine nodes on one
    device (a local cluster's) split it."""
    total = device_memory_bytes()
    weights = 0 if model_dir is None else sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    left = int(total * DEVICE_USABLE_FRACTION) - shared_by * weights
    return max(MIN_DEFAULT_KV_MEMORY_BYTES, min(int(total * DEFAULT_KV_MEMORY_FRACTION), left) // shared_by)


def share_the_device(shared_by: int) -> int | None:
    """With `shared_by` engine processes on one device, bound this process's MLX allocator (the
    memory above which it gives its cache of freed buffers back) to its share: MLX's own limit
    is a share of the whole device per process (80 % on CUDA), so two processes' caches could
    together take more than the device has. Returns the limit set (None: one process, MLX's
    default kept)."""
    if shared_by <= 1:
        return None
    limit = int(device_memory_bytes() * ALLOCATOR_FRACTION) // shared_by
    mx.set_memory_limit(limit)
    return limit


def out_of_memory_advice(exc: BaseException, kv_memory_bytes: int) -> str | None:
    """What to change when the device ran out of memory (None: `exc` is something else). MLX
    raises a RuntimeError naming the allocation that failed (CUDA: cudaMalloc...; Metal:
    "[malloc] Unable to allocate")."""
    text = str(exc)
    if not isinstance(exc, RuntimeError) or not ("out of memory" in text or "Unable to allocate" in text):
        return None
    return (f"the device ran out of memory ({device_memory_bytes() / 2**30:.1f} GiB; the KV caches may take "
            f"{kv_memory_bytes / 2**30:.1f} GiB of it): start the node with a smaller --kv-memory-bytes, "
            "fewer prefill tokens per step (--max-num-batched-tokens), or --device-shared-by N when N "
            "engine nodes share this device")


def device_memory_bytes() -> int:
    """The device's memory: MLX's device_info names it `memory_size` on Metal and `total_memory`
    on CUDA; the CPU backend names none (the machine's RAM is the device's)."""
    info: dict[str, Any] = dict(mx.device_info())
    for key in ("memory_size", "total_memory"):
        total = info.get(key)
        if isinstance(total, int) and total > 0:
            return total
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _config_int(args: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(args, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def parameter_bytes(model: Any) -> int:
    """The bytes of every parameter this process holds of `model` (a tensor-parallel rank: its shard)."""
    leaves: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    return sum(int(array.nbytes) for _, array in leaves)


def activation_dtype_bytes(model: Any, probe_cache: Sequence[Any]) -> int:
    """Bytes of one activation element: the dtype of the first plain KV cache's keys, else of the
    model's first floating-point parameter (a quantized model's scales: its compute dtype)."""
    for layer in probe_cache:
        keys = getattr(layer, "keys", None)
        dtype = getattr(keys, "dtype", None)
        if dtype is not None and mx.issubdtype(dtype, mx.floating):
            return int(dtype.size)
    leaves: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for _, array in leaves:
        if hasattr(array, "dtype") and mx.issubdtype(array.dtype, mx.floating):
            return int(array.dtype.size)
    return 4


def model_shape(model: Any, vocab_size: int, probe_cache: Sequence[Any]) -> ModelShape:
    """The sizes a model call's activations grow with, from the model's config (`model.args`, or
    a `text_config` inside it); what a family does not name falls back on the safe side: heads
    of 64 dimensions over the hidden size, as many KV heads as query heads, an MLP four times
    the hidden size. Mixture-of-experts, sliding-window and state-space layers are priced as
    dense attention (an over-estimate)."""
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)
    if isinstance(text, dict):
        args = SimpleNamespace(**text)
    hidden = _config_int(args, "hidden_size", "d_model", "dim", "n_embd") or 4096
    heads = _config_int(args, "num_attention_heads", "n_heads", "n_head", "num_heads") or max(1, hidden // 64)
    head_dim = _config_int(args, "head_dim") or max(1, hidden // heads)
    kv_heads = _config_int(args, "num_key_value_heads", "n_kv_heads") or heads
    intermediate = _config_int(args, "intermediate_size", "hidden_dim", "ffn_dim") or 4 * hidden
    return ModelShape(hidden, heads, kv_heads, head_dim, intermediate, max(1, vocab_size),
                      activation_dtype_bytes(model, probe_cache))
