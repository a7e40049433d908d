"""What handing one streamed KV piece out costs a prefill node's device thread, on this device.

A 1B-shaped piece (4 layers of Llama-3.2-1B's cache: 8 KV heads of 64, bf16, 2,048 tokens: 16 MiB)
is cut out of its layers' buffers as a step of a streamed prefill cuts it (`mx.contiguous` of a
token range), launched, and read while the next step runs (`--busy` matmuls launched behind it),
two ways, `--reps` times each, ms per piece:

- `as layers`: the piece's arrays made into `KVCache` layers and framed by `codec.host_tensors`
  (each layer rebuilt to check that it travels; bfloat16 viewed as uint16 on the host, a new array
  to evaluate);
- `wire views`: the arrays viewed as uint16 with the step (`codec.wire_view`) and framed by
  `codec.kv_piece_tensors` (what `adapters.mlx.executor` and `kv_out` do): nothing to evaluate.

It then checks that both give the same header and bytes (exit 1 if not).

    python3 bench/handoff/piece_handout.py            # on the GPU machine, ~10 s
    .venv/bin/python bench/handoff/piece_handout.py --busy 0 --reps 3   # CPU

Bench code: it may import anything, and nothing under src/ may import it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from adapters.kv import codec
from adapters.mlx.payloads import kv_cache

LAYERS, KV_HEADS, HEAD_DIM, CAPACITY, TOKENS = 4, 8, 64, 4096, 2048


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--busy", type=int, default=20, help="4096x4096 matmuls launched behind the piece")
    args = parser.parse_args()
    buffers = [mx.random.normal((1, KV_HEADS, CAPACITY, HEAD_DIM)).astype(mx.bfloat16)
               for _ in range(2 * LAYERS)]
    square = mx.random.normal((4096, 4096)).astype(mx.bfloat16)
    mx.eval(buffers, square)

    def step(wire: bool) -> tuple[list[Any], Any]:
        piece = [mx.contiguous(buffer[..., :TOKENS, :]) for buffer in buffers]
        if wire:
            piece = [codec.wire_view(array) for array in piece]
        mx.async_eval(piece)  # type: ignore[no-untyped-call]
        running = square
        for _ in range(args.busy):
            running = running @ square
        mx.async_eval(running)  # type: ignore[no-untyped-call]
        return piece, running

    def as_layers(piece: list[Any]) -> Any:
        layers = [kv_cache(piece[i], piece[i + 1], TOKENS) for i in range(0, len(piece), 2)]
        return codec.host_tensors(layers, fingerprint="piece", token_count=TOKENS)

    def wire_views(piece: list[Any]) -> Any:
        return codec.kv_piece_tensors(piece, dtype=mx.bfloat16, fingerprint="piece", token_count=TOKENS)

    print(f"device {mx.default_device()}; a piece of {LAYERS} layers x {TOKENS} tokens "
          f"({2 * LAYERS * KV_HEADS * TOKENS * HEAD_DIM * 2 >> 20} MiB); {args.busy} matmuls behind it")
    for name, wire, frame in (("as layers", False, as_layers), ("wire views", True, wire_views)):
        times = []
        for _ in range(args.reps):
            piece, running = step(wire)
            started = time.perf_counter()
            frame(piece)
            times.append(time.perf_counter() - started)
            mx.eval(running)
        print(f"{name}: ms per piece median {1000 * statistics.median(times):.2f} "
              f"({', '.join(f'{1000 * t:.2f}' for t in times)})")
    piece, running = step(False)
    mx.eval(running)
    old = as_layers(piece)
    new = wire_views([codec.wire_view(array) for array in piece])
    same = old.header_bytes == new.header_bytes and (
        b"".join(bytes(run) for run in old.runs) == b"".join(bytes(run) for run in new.runs))
    print(f"the same header and bytes: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
