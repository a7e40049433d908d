"""What undoing a failed step costs when nothing fails: the checkpoint the merge lane takes of
mlx-lm's batch generator before every step (`adapters.mlx.checkpoint`), against the step itself,
in the same run. Rows decode a history of `--history` tokens in mlx-lm's `BatchGenerator`.

    python3 bench/checkpoint_overhead.py --family gemma3_text --rows 32
    python3 bench/checkpoint_overhead.py --model /tmp/llama1b   # any mlx-lm model directory

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # support/: the tiny checkpoints


def main() -> None:
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load

    from adapters.mlx.checkpoint import Checkpoint
    from support.tiny_models import cached_checkpoint

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="an mlx-lm model directory (default: a tiny checkpoint of --family)")
    parser.add_argument("--family", default="gemma3_text")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--history", type=int, default=200)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    path = args.model or str(cached_checkpoint(args.family))
    model = load(path)[0]
    generator = BatchGenerator(model, stop_tokens=[[0]], completion_batch_size=args.rows,
                               prefill_batch_size=args.rows)
    generator.insert([[5 + (i * 7 + j) % 400 for j in range(args.history)] for i in range(args.rows)],
                     max_tokens=[args.steps * 3 + 100] * args.rows)
    for _ in range(50):  # prefill, then a few steps to warm up
        generator.next()  # type: ignore[no-untyped-call]
    started = time.perf_counter()
    for _ in range(args.steps):
        Checkpoint(generator)
    checkpoint_s = (time.perf_counter() - started) / args.steps
    started = time.perf_counter()
    for _ in range(args.steps):
        generator.next()  # type: ignore[no-untyped-call]
    step_s = (time.perf_counter() - started) / args.steps
    print(f"{Path(path).name}: {len(model.layers)} layers, {args.rows} rows, history {args.history}: "
          f"checkpoint {checkpoint_s * 1e6:.0f} us, step {step_s * 1e3:.2f} ms "
          f"({checkpoint_s / step_s:.1%} of a step)")


if __name__ == "__main__":
    main()
