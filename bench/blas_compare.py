"""MLX CPU: the bundled BLAS vs a preloaded system OpenBLAS, alternating, on the same models.

Runs bench/blas_check.py in fresh processes, alternately without and with
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 (Debian's `libopenblas0`), --reps times per
model, and prints the medians, the OpenBLAS/bundled ratios and whether greedy tokens and the last
logits were bit-identical between the two (they are not expected to be: summation order differs).

    .venv/bin/python bench/blas_compare.py                       # the three built tiny llamas

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent))  # support/: the tiny checkpoints
OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
SIZES = ((256, 4), (512, 6), (1024, 4))


def check(model: Path, preload: bool, prompt_len: int) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = OPENBLAS
    out = subprocess.run([sys.executable, str(HERE / "blas_check.py"), "--model", str(model),
                          "--prompt-len", str(prompt_len)], env=env, check=True, capture_output=True,
                         text=True).stdout
    doc: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, action="append", default=None)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args(argv)
    if not Path(OPENBLAS).exists():
        raise SystemExit(f"{OPENBLAS} is missing: apt-get install libopenblas0")
    from support.tiny_models import cached_checkpoint

    models: list[Path] = args.model or [cached_checkpoint("llama", hidden_size=h, num_layers=n)
                                        for h, n in SIZES]
    keys = ("matmul_1024_gflops", "prefill_tok_s", "decode_tok_s")
    print(f"{'model':40s} {'metric':20s} {'bundled':>9s} {'openblas':>9s} {'ratio':>6s}")
    for model in models:
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for rep in range(args.reps):
            for preload in ((False, True) if rep % 2 == 0 else (True, False)):
                runs[preload].append(check(model, preload, args.prompt_len))
        for key in keys:
            a = statistics.median(r[key] for r in runs[False])
            b = statistics.median(r[key] for r in runs[True])
            print(f"{model.name:40s} {key:20s} {a:9.1f} {b:9.1f} {b / a:6.2f}")
        same_tokens = runs[False][0]["tokens_sha"] == runs[True][0]["tokens_sha"]
        same_logits = runs[False][0]["last_logits_sha"] == runs[True][0]["last_logits_sha"]
        stable = all(r["last_logits_sha"] == runs[p][0]["last_logits_sha"] for p in runs for r in runs[p])
        print(f"{model.name:40s} greedy tokens equal: {same_tokens}; last logits bit-equal: {same_logits}; "
              f"each BLAS repeatable: {stable}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
