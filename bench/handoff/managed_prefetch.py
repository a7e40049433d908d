"""Does moving MLX's CUDA memory in bulk (cudaMemPrefetchAsync) speed a handoff's host copies?

MLX's CUDA backend allocates every array with cudaMallocManaged: the host reading a KV piece that
the GPU computed (the prefill node's copy into shared memory), and the GPU reading an array the
host built (the decode node's write into a slot), each move the pages by faults, 4-64 KiB at a
time. This times both directions for a 1B-shaped cache (16 layers, 8 KV heads of 64, bf16: 32 KiB
a token), plain and after a bulk prefetch of the same bytes, median of --reps:

- `to host`: freshly computed arrays copied into a host buffer (numpy), as `ShmOutbox.put` does:
  read where they are (by faults), after a bulk prefetch, and copied out by the copy engine first
  (`adapters.mlx.managed_memory.host_copies`, `STATECORE_CUDA_PREFETCH=copy`, which this sets);
- `to device`: arrays built from host memory written into a slot buffer and evaluated, as a
  staged piece is.

    python3 bench/handoff/managed_prefetch.py --tokens 2000 8000     # on the GPU machine

On the CPU (no CUDA runtime) it prints the plain times only. Bench code: it may import anything,
and nothing under src/ may import it.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import glob
import os
import statistics
import sys
import time
from typing import Any

import mlx.core as mx
import numpy as np

os.environ["STATECORE_CUDA_PREFETCH"] = "copy"  # before the product's module reads it
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
from adapters.mlx import managed_memory

LAYERS, KV_HEADS, HEAD_DIM = 16, 8, 64


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Runtime:
    """The CUDA runtime's prefetch through ctypes (CUDA 12 and 13 signatures)."""

    def __init__(self) -> None:
        self.lib = None
        self.path = None
        candidates = ["libcudart.so.13", "libcudart.so.12", ctypes.util.find_library("cudart") or ""]
        for site in sys.path:
            pattern = os.path.join(site, "nvidia", "**", "libcudart.so*")
            candidates += sorted(glob.glob(pattern, recursive=True))
        for name in candidates:
            if not name:
                continue
            try:
                self.lib = ctypes.CDLL(name)
                self.path = name
                break
            except OSError:
                continue
        self.version = 0
        self.stream = ctypes.c_void_p(0)
        if self.lib is not None:
            v = ctypes.c_int()
            self.lib.cudaRuntimeGetVersion(ctypes.byref(v))
            self.version = v.value

    def open_stream(self) -> None:
        """A stream of its own (non-blocking), so that waiting for the prefetch never waits for
        the model's kernels."""
        assert self.lib is not None
        self.lib.cudaStreamCreateWithFlags(ctypes.byref(self.stream), ctypes.c_uint(1))

    def prefetch(self, pointer: int, size: int, *, to_device: bool) -> int:
        assert self.lib is not None
        if self.version >= 13000:
            where = _Location(1, 0) if to_device else _Location(2, 0)  # Device 0 / Host
            return int(self.lib.cudaMemPrefetchAsync(ctypes.c_void_p(pointer), ctypes.c_size_t(size),
                                                     where, ctypes.c_uint(0), self.stream))
        return int(self.lib.cudaMemPrefetchAsync(ctypes.c_void_p(pointer), ctypes.c_size_t(size),
                                                 ctypes.c_int(0 if to_device else -1), self.stream))

    def synchronize(self) -> int:
        assert self.lib is not None
        return int(self.lib.cudaStreamSynchronize(self.stream))


def host_view(array: Any) -> np.ndarray:
    return np.asarray(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)


def fresh_cache(tokens: int, seed: int) -> list[Any]:
    mx.random.seed(seed)
    shape = (1, KV_HEADS, tokens, HEAD_DIM)
    arrays = [mx.random.normal(shape).astype(mx.bfloat16) for _ in range(2 * LAYERS)]
    mx.eval(arrays)
    return arrays


def to_host(tokens: int, runtime: Runtime | None, seed: int) -> float:
    arrays = fresh_cache(tokens, seed)
    views = [host_view(a) for a in arrays]  # evaluated already: no copy, no read yet
    out = np.empty(sum(v.nbytes for v in views), dtype=np.uint8)
    start = time.perf_counter()
    if runtime is not None:
        codes = {runtime.prefetch(v.ctypes.data, v.nbytes, to_device=False) for v in views}
        codes.add(runtime.synchronize())
        if codes != {0}:
            raise RuntimeError(f"cudaMemPrefetchAsync to the host answered {codes}")
    pos = 0
    for v in views:
        flat = v.reshape(-1).view(np.uint8)
        np.copyto(out[pos : pos + flat.nbytes], flat)
        pos += flat.nbytes
    return time.perf_counter() - start


def to_host_copied(tokens: int, seed: int) -> float:
    """The copy engine's copies (the product's `host_copies`), then the same host copy."""
    arrays = fresh_cache(tokens, seed)
    views = [host_view(a) for a in arrays]
    out = np.empty(sum(v.nbytes for v in views), dtype=np.uint8)
    start = time.perf_counter()
    copies = managed_memory.host_copies([codec_view(a) for a in arrays])
    pos = 0
    for c in copies:
        flat = np.asarray(c).reshape(-1).view(np.uint8)
        np.copyto(out[pos : pos + flat.nbytes], flat)
        pos += flat.nbytes
    elapsed = time.perf_counter() - start
    if not np.array_equal(out[: views[0].nbytes], views[0].reshape(-1).view(np.uint8)):
        raise RuntimeError("the copy engine's copy differs from the array")
    return elapsed


def codec_view(array: Any) -> Any:
    return array.view(mx.uint16) if array.dtype == mx.bfloat16 else array


def to_device(tokens: int, runtime: Runtime | None, seed: int, pool: list[Any]) -> float:
    rng = np.random.default_rng(seed)
    shape = (1, KV_HEADS, tokens, HEAD_DIM)
    host = [rng.integers(0, 1 << 15, size=shape, dtype=np.uint16) for _ in range(2 * LAYERS)]
    built = [mx.array(h).view(mx.bfloat16) for h in host]
    mx.eval(built)  # on the host: the copy from numpy into managed memory
    start = time.perf_counter()
    if runtime is not None:
        views = [host_view(b) for b in built]
        codes = {runtime.prefetch(v.ctypes.data, v.nbytes, to_device=True) for v in views}
        codes.add(runtime.synchronize())
        if codes != {0}:
            raise RuntimeError(f"cudaMemPrefetchAsync to the device answered {codes}")
    for layer in range(LAYERS):
        pool[2 * layer][0:1, :, :tokens, :] = built[2 * layer]
        pool[2 * layer + 1][0:1, :, :tokens, :] = built[2 * layer + 1]
    mx.eval(pool)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2000, 8000])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    runtime = Runtime()
    usable = runtime.lib is not None and mx.default_device() == mx.gpu
    if usable:
        mx.eval(mx.zeros(1))  # MLX's context first
        runtime.open_stream()
    print(f"# device {mx.default_device()}; CUDA runtime {runtime.path} version {runtime.version}; "
          f"prefetch {'on' if usable else 'not available'}")
    print("| tokens | MiB | to host plain ms | to host prefetched ms | ratio | to host copy engine ms "
          "| ratio | to device plain ms | to device prefetched ms | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tokens in args.tokens:
        slots = (4, KV_HEADS, max(args.tokens), HEAD_DIM)
        pool = [mx.zeros(slots, dtype=mx.bfloat16) for _ in range(2 * LAYERS)]
        mx.eval(pool)
        rows: dict[str, list[float]] = {"hp": [], "hf": [], "hc": [], "dp": [], "df": []}
        for rep in range(args.reps + 1):  # the first is a warm-up
            got = {"hp": to_host(tokens, None, rep), "dp": to_device(tokens, None, rep, pool)}
            if usable:
                got["hf"] = to_host(tokens, runtime, rep + 100)
                got["hc"] = to_host_copied(tokens, rep + 200)
                got["df"] = to_device(tokens, runtime, rep + 100, pool)
            if rep:
                for key, value in got.items():
                    rows[key].append(value * 1000)
        med = {k: statistics.median(v) if v else float("nan") for k, v in rows.items()}
        mib = tokens * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2 / (1 << 20)
        print(f"| {tokens} | {mib:.0f} | {med['hp']:.1f} | {med['hf']:.1f} | {med['hf'] / med['hp']:.2f} | "
              f"{med['hc']:.1f} | {med['hc'] / med['hp']:.2f} | "
              f"{med['dp']:.1f} | {med['df']:.1f} | {med['df'] / med['dp']:.2f} |")


if __name__ == "__main__":
    main()
