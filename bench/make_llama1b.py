"""Write a random-weight model of Llama-3.2-1B's shape (bf16) that mlx-lm and statecore load offline.

Shape as meta-llama/Llama-3.2-1B's config.json: hidden 2048, 16 layers, 32 query / 8 KV heads of
64, MLP 8192, vocab 128,256, tied embeddings, llama3 RoPE scaling: 1.24 B parameters, 2.5 GB in
bf16. Weights are drawn with `mx.random` on the default device (the GPU when MLX has one), seeded.
The tokenizer is statecore's 512-token byte-level BPE (`support.tiny_models.build_tokenizer`); the
embedding rows of its special tokens, of every id >= 512 and of the 128 lone bytes that are no text
by themselves (0x80-0xFF) are zero, so with tied embeddings their logits are 0 while the others'
have a std of ~45: greedy decoding emits neither EOS nor an id whose text a streaming client never
sees (held back as a partial UTF-8 sequence: a client counting streamed tokens would count too
few), and every matmul keeps the real model's size.

    python3 bench/make_llama1b.py /tmp/llama1b            # on the GPU machine: a few seconds
    python3 bench/make_llama1b.py /tmp/small --hidden-size 256 --layers 2 --vocab 4096  # CPU test
    python3 bench/make_llama1b.py /tmp/cpu23m --hidden-size 512 --layers 6 --vocab 512 --dtype float32

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # support/: the tiny checkpoints

TOKENIZER_TOKENS = 512
SPECIAL_IDS = (0, 1, 2)  # bos, eos, pad of the "bpe" tokenizer


def llama_1b_config(hidden: int, layers: int, vocab: int) -> dict[str, Any]:
    heads = hidden // 64
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": 64,
        "vocab_size": vocab,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": SPECIAL_IDS[0],
        "eos_token_id": SPECIAL_IDS[1],
        "pad_token_id": SPECIAL_IDS[2],
        "torch_dtype": "bfloat16",
    }


def text_ids(tokenizer_dir: Path) -> list[int]:
    """The ids below TOKENIZER_TOKENS, special ones aside, that decode to text by themselves."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return [i for i in range(len(SPECIAL_IDS), TOKENIZER_TOKENS) if "\ufffd" not in tokenizer.decode([i])]


def random_weights(config: dict[str, Any], seed: int, emitted: list[int]) -> dict[str, mx.array]:
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict(config))  # type: ignore[no-untyped-call]
    shapes: dict[str, mx.array] = {}
    tree_flatten(model.parameters(), destination=shapes)
    del model
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    weights: dict[str, mx.array] = {}
    for i, (name, default) in enumerate(sorted(shapes.items())):
        shape = tuple(default.shape)
        if len(shape) >= 2:
            std = 1.0 if "embed" in name else 1.5 / math.sqrt(shape[-1])
            value = mx.random.normal(shape, dtype=mx.bfloat16, key=keys[i]) * std
            if "embed" in name:
                keep = mx.zeros((shape[0], 1), dtype=mx.bool_)
                keep[mx.array(emitted)] = True
                value = mx.where(keep, value, mx.zeros_like(value))
        else:
            value = mx.ones(shape, dtype=mx.bfloat16)  # norm scales
        weights[name] = value.astype(mx.bfloat16)
        mx.eval(weights[name])
    return weights


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the weights' type (float32: what a CPU user runs; bf16 is slow on a CPU)")
    args = parser.parse_args(argv)
    from support.tiny_models import build_tokenizer

    start = time.perf_counter()
    config = llama_1b_config(args.hidden_size, args.layers, args.vocab)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(args.out_dir, "bpe")
    weights = random_weights(config, args.seed, text_ids(args.out_dir))
    if args.dtype != "bfloat16":  # drawn in bf16 either way: the same numbers, widened
        config["torch_dtype"] = args.dtype
        weights = {name: value.astype(getattr(mx, args.dtype)) for name, value in weights.items()}
    mx.save_safetensors(str(args.out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (args.out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    params = sum(w.size for w in weights.values())
    print(f"wrote {args.out_dir}: {params / 1e9:.3f} B parameters on {mx.default_device()} "
          f"in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
